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

from azyx.backends.disk import DiskDevice
from azyx.device import DISK, buffer_of
from azyx.errors import AzyxIOError, DeviceError
from azyx.fileformat import Header, SafetensorsError, TensorEntry, read_header
from azyx.files import DiskFile, FileRange, covering, file_identity
from azyx.graph import GRAPH, MOVEMENT, Node, Op, StridedView, contiguous_strides, prod, view_through
from azyx.runtime import RT

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
            leaf = _narrowed(src, node, view) if view is not None else None
            if leaf is not None:
                return leaf
    node.device, node.pinned = RT.resolve_device(None, prod(node.shape) * node.dtype.itemsize)
    return node


def _narrowed(src: Node, n: Node, view: StridedView) -> Node | None:
    """A disk Leaf over just the bytes `view` covers of `src`'s range: one range, or the runs of a box along an inner
    axis (`_runs`: one device's columns of a shard read only those); None where `src` is itself runs (its bytes are
    not a plain range of the file)."""
    rng: FileRange = buffer_of(src).mem
    if rng.runs is not None:
        return None
    item = n.dtype.itemsize
    runs = _runs(src, n.shape, view)
    if runs is not None:
        run, step, first = runs
        buf = disk_device().buffer(rng.file, rng.offset + first * item, prod(n.shape) * item, rng.what,
                                   (run * item, step * item))
        leaf = Node(Op.LEAF, (), None, n.shape, n.dtype, DISK, False)
        leaf.buffer, leaf.view = buf, StridedView.contiguous(n.shape)
        return leaf
    lo, hi = covering(view, n.shape)
    if lo == hi:
        lo = hi = 0
    buf = disk_device().buffer(rng.file, rng.offset + lo * item, (hi - lo) * item, rng.what)
    leaf = Node(Op.LEAF, (), None, n.shape, n.dtype, DISK, False)
    leaf.buffer, leaf.view = buf, StridedView(view.offset - lo if hi > lo else 0, view.strides)
    return leaf


def _runs(src: Node, shape: tuple[int, ...], view: StridedView) -> tuple[int, int, int] | None:
    """(run, step, first) in elements where `view` of the contiguous `src` is a box whose rows are runs of `run`
    elements, one every `step`, from element `first`, and reading just those saves bytes over the covering range:
    a slice along an inner axis `k`, the axes after it whole, those between the first and it whole."""
    full = src.shape
    assert src.view is not None
    strides = contiguous_strides(full)
    if src.view.offset or src.view.strides != strides or len(shape) != len(full) or 0 in shape or \
            view.strides != strides:
        return None
    k = max((i for i, (a, b) in enumerate(zip(shape, full)) if a != b), default=0)
    if k == 0 or any(shape[i] != full[i] for i in range(1, k)):
        return None
    inner = prod(full[k + 1:])
    return shape[k] * inner, full[k] * inner, view.offset
