"""Lazy tensors over safetensors files: Leaf nodes on device "disk", and the rules for ops built on them.

Opening a file reads and validates its header only; each tensor is a disk Buffer over its byte range. Ops on a disk
tensor follow two rules, applied when the node is built (`on_build`, called by `Tensor._from_node`):
- a movement op that a strided view expresses (a slice `t[2:5]`, `t[i]`, reshape, permute, expand, flip) makes a
  new disk Leaf over just the bytes it covers, so realizing it reads only those;
- anything else (arithmetic, casts, reductions, padding) computes on the AUTO compute device: the disk runs nothing;
  the planner inserts the transfer that reads the file.
"""

from __future__ import annotations

import os
import threading
import weakref
from typing import TYPE_CHECKING, Any

from azyx.backends.disk import DiskDevice, DiskFile, FileRange, covering, file_identity
from azyx.device import DISK
from azyx.errors import AzyxIOError, DeviceError
from azyx.graph import MOVEMENT, Node, Op, StridedView, prod, view_through
from azyx.io.format import Header, SafetensorsError, TensorEntry, read_header
from azyx.runtime import GRAPH, RT

if TYPE_CHECKING:
    from azyx.tensor import Tensor

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


def disk_tensor(f: DiskFile, entry: TensorEntry) -> Tensor:
    """A Leaf on "disk" over one tensor's bytes."""
    from azyx.tensor import Tensor

    buf = disk_device().buffer(f, header_of(f).data_start + entry.begin, entry.nbytes, f"tensor {entry.name!r}")
    node = Node(Op.LEAF, (), None, entry.shape, entry.dtype, DISK, False)
    node.buffer, node.view = buf, StridedView.contiguous(entry.shape)
    return Tensor._from_node(node)


def from_safetensors(path: Any, name: str) -> Tensor:
    """`Tensor.from_safetensors`: tensor `name` of the file at `path`, lazily (header read only)."""
    f = open_safetensors(path)
    entry = header_of(f).tensors.get(name) if isinstance(name, str) else None
    if entry is None:
        names = list(header_of(f).tensors)
        listed = ", ".join(repr(n) for n in names[:8]) + (f", ... ({len(names)} in all)" if len(names) > 8 else "")
        raise SafetensorsError(f.path, f"no tensor named {name!r}; it has {listed or 'none'}")
    return disk_tensor(f, entry)


def load_safetensors(path: Any) -> dict[str, Tensor]:
    """Every tensor of a safetensors file as a lazy disk tensor, in file order; reads the header only.

    >>> import numpy as np, azyx
    >>> from safetensors.numpy import save_file
    >>> save_file({"a": np.ones(3, np.float32), "b": np.zeros((2, 2), np.int64)}, "/tmp/azyx_doc2.safetensors")
    >>> ts = azyx.io.load_safetensors("/tmp/azyx_doc2.safetensors")
    >>> sorted((k, t.shape, t.dtype.name, t.device) for k, t in ts.items())
    [('a', (3,), 'float32', 'disk'), ('b', (2, 2), 'int64', 'disk')]
    >>> (ts["a"].to("c:0") + 1).numpy_sync().tolist()
    [2.0, 2.0, 2.0]
    """
    f = open_safetensors(path)
    return {name: disk_tensor(f, e) for name, e in header_of(f).tensors.items()}


def metadata_of(path: Any) -> dict[str, str]:
    """The file's `__metadata__` (empty when it has none); reads the header only."""
    return dict(header_of(open_safetensors(path)).metadata or {})


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
    assert src.buffer is not None
    rng: FileRange = src.buffer.mem
    item = n.dtype.itemsize
    lo, hi = covering(view, n.shape)
    if lo == hi:
        lo = hi = 0
    buf = disk_device().buffer(rng.file, rng.offset + lo * item, (hi - lo) * item, rng.what)
    leaf = Node(Op.LEAF, (), None, n.shape, n.dtype, DISK, False)
    leaf.buffer, leaf.view = buf, StridedView(view.offset - lo if hi > lo else 0, view.strides)
    return leaf
