"""File-backed tensors: Leaf nodes on device "disk" over safetensors files, and the rules for ops built on them.

Opening a file reads and validates its header only; each tensor is a disk Buffer over its byte range (azyx.io builds
the user API on this module). Ops on a disk tensor follow two rules, applied when the node is built (`on_build`, called
by `Tensor._from_node`):
- a movement op that a strided view expresses (a slice `t[2:5]`, `t[i]`, reshape, permute, expand, flip) makes a
  new disk Leaf over just the bytes it covers, so realizing it reads only those;
- anything else (arithmetic, casts, reductions, padding) computes on the AUTO compute device: the disk runs nothing;
  the planner inserts the transfer that reads the file.
"""

from __future__ import annotations

import os
import threading
import weakref
from typing import Any

from azyx.backends.disk import DiskDevice, DiskFile, FileRange, covering, file_identity
from azyx.device import DISK, buffer_of
from azyx.errors import AzyxIOError, DeviceError
from azyx.fileformat import Header, SafetensorsError, TensorEntry, read_header
from azyx.graph import MOVEMENT, Node, Op, StridedView, prod, view_through
from azyx.runtime import GRAPH, RT

_open: weakref.WeakValueDictionary[tuple[Any, ...], DiskFile] = weakref.WeakValueDictionary()
_open_lock = threading.Lock()


def disk_device() -> DiskDevice:
    """The runtime's disk device (its `bytes_read`, `in_use` and `buffers` counters are public)."""
    dev = RT.device(DISK)
    assert isinstance(dev, DiskDevice)
    return dev


def open_safetensors(path: Any) -> DiskFile:
    """The open file and its validated header (`file.header`), shared while tensors over it live; a file changed
    on disk since (another inode, size or mtime) is opened and parsed afresh."""
    try:
        p = os.fspath(path)
    except TypeError:
        raise AzyxIOError(f"a safetensors path must be a str or os.PathLike, got {path!r}") from None
    try:
        key = (os.path.realpath(p), *file_identity(os.stat(p)))
    except OSError as e:
        raise AzyxIOError(f"{p}: cannot open: {e.strerror or e}") from e
    with _open_lock:
        f = _open.get(key)
    if f is not None:
        return f
    f = DiskFile(p)
    try:
        f.header = read_header(f.fd, p, f.size)
    except BaseException:
        f.close()  # now, rather than when the garbage collector gets to it
        raise
    with _open_lock:
        return _open.setdefault((key[0], *f.identity), f)


def header_of(f: DiskFile) -> Header:
    h = f.header
    assert isinstance(h, Header)
    return h


def disk_node(f: DiskFile, entry: TensorEntry) -> Node:
    """A Leaf on "disk" over one tensor's bytes (not yet in the graph)."""
    buf = disk_device().buffer(f, header_of(f).data_start + entry.begin, entry.nbytes, f"tensor {entry.name!r}")
    node = Node(Op.LEAF, (), None, entry.shape, entry.dtype, DISK, False)
    node.buffer, node.view = buf, StridedView.contiguous(entry.shape)
    return node


def safetensors_node(path: Any, name: str) -> Node:
    """`Tensor.from_safetensors`'s node: tensor `name` of the file at `path`, lazily (header read only)."""
    f = open_safetensors(path)
    entry = header_of(f).tensors.get(name) if isinstance(name, str) else None
    if entry is None:
        names = list(header_of(f).tensors)
        listed = ", ".join(repr(n) for n in names[:8]) + (f", ... ({len(names)} in all)" if len(names) > 8 else "")
        raise SafetensorsError(f.path, f"no tensor named {name!r}; it has {listed or 'none'}")
    return disk_node(f, entry)


# ------------------------------------------------------------------------------------------------ build rules
def on_build(node: Node) -> Node:
    """A node about to join the graph whose device is "disk": a view of a disk Leaf becomes a narrower disk Leaf;
    any other op moves to the AUTO compute device (unpinned, like every AUTO placement)."""
    op = node.op
    if op is Op.LEAF:
        return node
    if op is Op.TODEVICE:
        raise DeviceError("cannot move a tensor to the disk device; write files with azyx.io.save_safetensors")
    if op in MOVEMENT:
        src = GRAPH[node.src[0]]
        if src.device == DISK and src.buffer is not None and src.view is not None:
            view = view_through(node, src.shape, src.view)
            if view is not None:
                return _narrowed(src, node, view)
    node.device, node.pinned = RT.resolve_device(None, prod(node.shape) * node.dtype.itemsize)
    return node


def _narrowed(src: Node, n: Node, view: StridedView) -> Node:
    """A disk Leaf over just the bytes `view` covers of `src`'s range."""
    rng: FileRange = buffer_of(src).mem
    item = n.dtype.itemsize
    lo, hi = covering(view, n.shape)
    if lo == hi:
        lo = hi = 0
    buf = disk_device().buffer(rng.file, rng.offset + lo * item, (hi - lo) * item, rng.what)
    leaf = Node(Op.LEAF, (), None, n.shape, n.dtype, DISK, False)
    leaf.buffer, leaf.view = buf, StridedView(view.offset - lo if hi > lo else 0, view.strides)
    return leaf
