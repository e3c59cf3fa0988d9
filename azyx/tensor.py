"""The user API: a `Tensor` is a handle (an id into the graph); every op appends one node and returns.

Nothing here touches a device. `await t.realize()` hands the graph to the async path (realize.py): the scheduler
(schedule.py) plans it and the executor (executor.py) runs the plan.
"""

from __future__ import annotations

import builtins
import functools
import math
import types
import weakref
from collections.abc import Callable, Generator, Iterator, Sequence
from typing import Any, NamedTuple, Protocol, TypeVar

import numpy as np

from azyx import ops as _ops
from azyx.device import DISK, buffer_of, host_view
from azyx.dtypes import (
    DType,
    check_int,
    dtypes,
    from_numpy,
    least_float,
    promote,
    promote_scalar,
    scalar_dtype,
    to_dtype,
)
from azyx.errors import (
    ArgumentError,
    AxisError,
    AzyxError,
    DeviceError,
    DTypeError,
    IndexOutOfRange,
    RuntimeStateError,
    ShapeError,
)
from azyx.graph import GRAPH, READ_IN_PLACE, Node, Op, Shape, prod
from azyx.native import native
from azyx.realize import done as _done
from azyx.realize import realize as _realize
from azyx.realize import run_sync
from azyx.realize import to_numpy as _read
from azyx.runtime import RT
from azyx.storage import on_build, safetensors_node
from azyx.traced import Traced, lift

_nodes = GRAPH.nodes
DISK_RUNS = 32  # runs of consecutive rows that a gather by a host index from a disk tensor reads one by one
# (a global is read in a tenth of the time an enum member takes to look up on its class: the ops' fast paths use these)
_CONST, _BINARY, _UNARY, _REDUCE, _RESHAPE = Op.CONST, Op.BINARY, Op.UNARY, Op.REDUCE, Op.RESHAPE
Scalar = bool | int | float
T = TypeVar("T")
REPR_MAX_ELEMENTS = 1 << 22  # repr reads a realized tensor this large or smaller to show its values


def _norm_axis(axis: int, ndim: int, extra: int = 0) -> int:
    n = ndim + extra
    if type(axis) is int and -n <= axis < n:  # the common case, checked cheaply
        return axis % n
    if not isinstance(axis, int | np.integer) or isinstance(axis, bool):
        raise AxisError(f"axis must be an int, got {axis!r}")
    if not -max(n, 1) <= axis < max(n, 1):
        raise AxisError(f"axis {axis} is out of range for a tensor of {ndim} dimensions")
    return int(axis) % max(n, 1) if n else 0


def _norm_axes(axis: int | Sequence[int] | None, ndim: int) -> tuple[int, ...]:
    if axis is None:
        return tuple(range(ndim))
    if type(axis) is int and -ndim <= axis < ndim:  # one axis, the common case
        return (axis % ndim,)
    axes = (axis,) if isinstance(axis, int | np.integer) else tuple(axis)
    out = tuple(sorted({_norm_axis(a, ndim) for a in axes}))
    if len(out) != len(axes):
        raise AxisError(f"repeated axis in {axis!r}")
    return out if ndim else ()


class ValuesIndices(NamedTuple):
    """What `max(dim=)`, `min(dim=)`, `sort`, and `topk` return, as PyTorch's do: the values and their indices along
    the axis (int32, like argmax), both lazy tensors on the input's device. Unpacks as `values, indices = ...`."""

    values: Tensor
    indices: Tensor


def _torch_names(kw: dict[str, Any]) -> None:
    """PyTorch's `dim=` for `axis=` and numpy's `keepdims=` for `keepdim=`, translated in place in `kw`."""
    for theirs, ours in (("dim", "axis"), ("keepdims", "keepdim")):
        if theirs in kw:
            if ours in kw:
                raise ArgumentError(f"both {ours}= and {theirs}= given ({kw[ours]!r} and {kw[theirs]!r}); they are "
                                    f"the same argument")
            kw[ours] = kw.pop(theirs)


def _dims(fn: Callable[..., T]) -> Callable[..., T]:
    """The one place that lets every method with `axis=`/`keepdim=` take `dim=`/`keepdims=` as well (PyTorch's and
    numpy's names for them): `x.sum(dim=1, keepdims=True)` is `x.sum(axis=1, keepdim=True)`."""

    @functools.wraps(fn)
    def method(*args: Any, **kw: Any) -> T:
        if kw:
            _torch_names(kw)
        return fn(*args, **kw)

    return method


# results of max/min given a positional axis (numpy's: the values alone), by id(): unpacking one raises, because
# PyTorch's `values, idx = x.max(-1)` would otherwise unpack two rows' maxima silently
_VALUES_ONLY: dict[int, weakref.ref] = {}


def _dims_with_indices(arg: str, pairwise: str) -> Callable[[Callable[..., Tensor]], Callable[..., Any]]:
    """max/min: `_dims`, and PyTorch's pair where PyTorch's name is used: `x.max(dim=1)` is a `ValuesIndices`
    (values, indices by `arg`, argmax or argmin: the first index of the extreme). With numpy's `axis` (by keyword or
    position) the result is the values alone, as numpy's; one given by position refuses to be unpacked or iterated,
    naming both forms (the decision: numpy's positional meaning stays, PyTorch's unpacking never silently splits rows).
    A tensor in the axis' place is PyTorch's `x.max(y)`: the elementwise `pairwise` (maximum or minimum).
    """

    def deco(fn: Callable[..., Tensor]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def method(self: Tensor, *args: Any, **kw: Any) -> Any:
            if "dim" in kw:
                _torch_names(kw)
                values = fn(self, *args, **kw)
                if kw["axis"] is None:  # (torch's x.max() without a dim: the one value)
                    return values
                return ValuesIndices(values, getattr(self, arg)(kw["axis"], kw.get("keepdim", False)))
            if kw:
                _torch_names(kw)
            if args and isinstance(args[0], Tensor):
                return getattr(self, pairwise)(*args)
            out = fn(self, *args, **kw)
            if args and args[0] is not None:
                k = id(out)
                _VALUES_ONLY[k] = weakref.ref(out, lambda _, k=k: _VALUES_ONLY.pop(k, None))  # type: ignore[misc]
            return out

        return method

    return deco


def broadcast_shapes(*shapes: Shape) -> Shape:
    """The shape numpy's broadcasting gives `shapes` (`ShapeError` naming them where they do not broadcast)."""
    if len(shapes) == 2:  # the common case, without sets
        a, b = shapes
        if len(a) != len(b):
            a, b = (1,) * (len(b) - len(a)) + a, (1,) * (len(a) - len(b)) + b
        out2 = []
        for x, y in zip(a, b):
            if x != y and y != 1:
                if x != 1:
                    break
                x = y
            out2.append(x)
        else:
            return tuple(out2)
    nd = max(len(s) for s in shapes)
    out = []
    for i in range(-nd, 0):
        sizes = {s[i] for s in shapes if len(s) >= -i} - {1}
        if len(sizes) > 1:
            raise ShapeError(f"shapes {' and '.join(str(s) for s in shapes)} cannot be broadcast together")
        out.append(sizes.pop() if sizes else 1)
    return tuple(out)


def _same_value(a: Any, b: Any) -> bool:
    """Equal scalars, -0.0 and 0.0 told apart (a NaN is never the same: the caller keeps both)."""
    return bool(a == b) and (type(a) is not float or math.copysign(1.0, a) == math.copysign(1.0, b))


def _fold_value(v: Any, dtype: DType) -> Scalar:
    """A numpy scalar result as the Python scalar a CONST node of `dtype` holds (a traced one stays traced)."""
    if isinstance(v, Traced):
        return lift(_fold_value, v, dtype)
    if type(v) is float and dtype.kind == "f" and dtype.itemsize >= 4:
        return v if dtype.itemsize == 8 else float(np.float32(v))
    if dtype is dtypes.bfloat16:
        return float(np.float32(v))
    x = np.asarray(v).astype(dtype.np)
    return x.item()


class Tracer(Protocol):
    """What azyx.jit's recorder is told while it traces a function: tensors rebound in place, and random draws (with
    how to draw them again)."""

    def rebinding(self, handle: Tensor) -> None:
        """`handle` is about to be rebound (`Tensor.assign`, `t[key] = value`)."""
        ...

    def draw(self, t: Tensor, again: Callable[[], Tensor]) -> None:
        """`t` was drawn at random; `again()` draws its next value for a replay."""
        ...

    def guard(self, read: Callable[[], Any], value: Any) -> None:
        """The trace holds only while `read()` returns `value` (a replay checks it, and traces again if not)."""
        ...


def _drawn(t: Tensor, again: Callable[[], Tensor]) -> Tensor:
    """A random tensor just drawn: a function that azyx.jit traces draws it anew on each replay with `again`."""
    if Tensor.tracer is not None:
        Tensor.tracer.draw(t, again)
    return t


def _shape_arg(shape: Any) -> Shape:
    if len(shape) == 1 and isinstance(shape[0], list | tuple):
        shape = shape[0]
    for s in shape:  # plain non-negative ints (the common case) need no conversion
        if type(s) is not int or s < 0:
            break
    else:
        return tuple(shape)
    try:
        out = tuple(int(s) for s in shape)
    except (TypeError, ValueError):
        raise ShapeError(f"shape must be ints, got {shape!r}") from None
    if any(s < 0 for s in out):
        raise ShapeError(f"negative dimension in shape {out}")
    return out


def _binop(op: str, reverse: bool = False) -> Callable[[Tensor, Any], Tensor]:
    """Tensor's method for binary `op` (`reverse`: the reflected one, as in `2 - t`): the common cases of a model
    (a number of the tensor's kind; a tensor of the same dtype on the same device, broadcast or not) built right here,
    everything else by Tensor._binary (promotion, folded constants, other operands). One call per op: the node is
    built in the operator's own frame."""
    kind = _ops.BINARY[op][0]
    out_bool = kind == "bool"
    int_numbers = kind != "float"  # an int number keeps an int tensor's dtype (true division makes floats)
    float_ok = op not in _ops.BITWISE  # (a bitwise op refuses floats: the general path raises the error)


    def method(self: Tensor, other: Any) -> Tensor:
        na = _nodes[self.id]
        assert na is not None
        tp = type(other)
        node = None
        if (tp is float or tp is int) and na.op is not _CONST:
            k = na.dtype.kind
            if (k == "f" and float_ok) or (k in "iu" and tp is int and int_numbers):
                if k != "f" and not -128 <= other < 128:  # (an int the dtype cannot hold raises, never wraps)
                    check_int(na.dtype, other)
                value = float(other) if k == "f" and tp is int else other
                out_dt = dtypes.bool if out_bool else na.dtype
                if not reverse:  # x op number: the number is the op's own (Op.BINARY's arg2)
                    node = Node(_BINARY, (self.id,), op, na.shape, out_dt, na.device, na.pinned, value)
                else:
                    c = GRAPH.add(Node(_CONST, (), value, na.shape, na.dtype, na.device, na.pinned))
                    node = Node(_BINARY, (c, self.id), op, na.shape, out_dt, na.device, na.pinned)
        elif tp is Tensor:
            nb = _nodes[other.id]
            assert nb is not None
            if (nb.dtype is na.dtype and nb.device == na.device and (na.op is not _CONST or nb.op is not _CONST)
                    and (kind != "float" or na.dtype.kind == "f") and (float_ok or na.dtype.kind != "f")):
                a, b, shape = self, other, na.shape
                if nb.shape != shape:  # broadcasting
                    shape = broadcast_shapes(shape, nb.shape)
                    a, b = a._broadcast_to(shape), b._broadcast_to(shape)
                node = Node(_BINARY, (b.id, a.id) if reverse else (a.id, b.id), op, shape,
                            dtypes.bool if out_bool else na.dtype, na.device, na.pinned or nb.pinned)
        if node is None:
            return self._binary(op, other, reverse)
        if node.device == DISK:
            return Tensor._from_node(node)
        t = _new_object(Tensor)  # (Tensor._from_node's body: a call fewer per op, ~0.1 us of ~1)
        t.id = _add_node(node)
        node.rc += 1
        return t

    name = {"max": "maximum", "min": "minimum"}.get(op) or f"__{'r' if reverse else ''}{op}__"
    method.__name__, method.__qualname__ = name, f"Tensor.{name}"
    method.__doc__ = f"`{op}` elementwise, with numpy's broadcasting and PyTorch's type promotion."
    if native is not None:  # the same common cases built in C (but broadcasting), this function for the rest
        flags = out_bool | int_numbers << 1 | float_ok << 2 | reverse << 3 | (kind == "float") << 4
        return native.Method(op, flags, method, name, method.__qualname__, method.__doc__)
    return method


_new_object, _add_node = object.__new__, GRAPH.add
_pow = _binop("pow")  # (Tensor.__pow__ takes the exponents it turns into other ops first)


class Tensor:
    """A lazy tensor: a handle into azyx's graph.

    `Tensor(data, dtype=None, device=None)`: `data` a numpy array, a Python number or a (nested) list; the dtype is
    `dtype` (a DType, numpy dtype or name), else numpy's array's own, else float32 for floats, int32 for ints and bool
    for bools; `device` a name such as "c:0", else AUTO placement.

    Every op (arithmetic, the methods below, indexing) is synchronous and cheap: it appends a node and returns a new
    lazy Tensor on the device of its operands (a tensor whose device was asked for wins over automatically placed
    ones; two different asked-for devices raise `DeviceError`: move one with `.to()`). Binary ops broadcast like numpy
    and promote dtypes like PyTorch; Python numbers in them are kernel arguments, so a new value compiles nothing.
    Nothing runs until a coroutine asks for the values: `await t.realize()`, `await t.numpy()`, `await t.item()`,
    `await t.tolist()`, or `await azyx.realize(a, b)` for several in one plan (`realize_sync()`/`numpy_sync()` in
    scripts). Reductions take `axis=None` (an int or a tuple, negative allowed) and `keepdim=False`.

    >>> import azyx
    >>> t = azyx.Tensor([1.0, 2.0, 3.0]) * 2
    >>> t.numpy_sync().tolist()
    [2.0, 4.0, 6.0]
    """

    __slots__ = ("id", "__weakref__")
    id: int
    training: bool = False  # dropout is active only while True (see azyx.train())
    tracer: Tracer | None = None  # azyx.jit's recorder while it traces a function
    sharder: Callable[..., Any] | None = None  # azyx.shard.shard, installed by that module (a layer above this one)

    def __init__(self, data: Any, dtype: Any = None, device: str | None = None):
        if isinstance(data, Tensor):
            src = data.cast(dtype) if dtype is not None else data
            src = src.to(device) if device is not None else src
            self.id = src.id
            GRAPH.retain(self.id)
            return
        arr = _to_numpy(data, dtype)
        dt = to_dtype(dtype) if dtype is not None else from_numpy(arr.dtype)
        dev, pinned = RT.resolve_device(device, arr.nbytes)
        buf, view = RT.buffer_from_numpy(_to_storage(arr, dt), dev)
        node = Node(Op.LEAF, (), None, tuple(arr.shape), dt, dev, pinned)
        node.buffer, node.view = buf, view
        self.id = GRAPH.add(node)
        node.rc += 1

    @staticmethod
    def _from_node(node: Node) -> Tensor:
        if node.device == DISK:  # over a file-backed tensor: views stay on disk (narrower ranges), compute goes AUTO
            node = on_build(node)
        t = object.__new__(Tensor)
        t.id = GRAPH.add(node)
        node.rc += 1
        return t

    def __del__(self) -> None:
        try:
            n = _nodes[self.id]
            if n is not None and n.rc > 1:  # (GRAPH.release's common case, without the call)
                n.rc -= 1
                return
            GRAPH.release(self.id)
        except (AttributeError, TypeError):  # interpreter shutdown or a failed __init__
            pass

    # ---------------------------------------------------------------- attributes
    @property
    def _node(self) -> Node:
        return _nodes[self.id]  # type: ignore[return-value]

    @property
    def shape(self) -> Shape:
        """The shape, a tuple of ints (known without computing anything)."""
        return _nodes[self.id].shape  # type: ignore[union-attr]

    @property
    def dtype(self) -> DType:
        """The element type, a `DType` (`t.dtype == dtypes.float32`)."""
        return _nodes[self.id].dtype  # type: ignore[union-attr]

    @property
    def device(self) -> str:
        """The device name, e.g. "c:0" ("disk" for a tensor still in a safetensors file). An automatically placed
        tensor reports the device its data ended up on."""
        return _nodes[self.id].device  # type: ignore[union-attr]

    @property
    def ndim(self) -> builtins.int:
        """Number of axes: `len(t.shape)`."""
        return len(self.shape)

    def numel(self) -> builtins.int:
        """Number of elements: the product of the shape (1 for a 0-d tensor)."""
        return prod(self.shape)

    def __len__(self) -> builtins.int:
        if not self.shape:
            raise ShapeError("len() of a 0-d tensor")
        return self.shape[0]

    def __hash__(self) -> builtins.int:
        return id(self)

    # ---------------------------------------------------------------- copies
    def __copy__(self) -> Tensor:
        """`copy.copy(t)`: a new handle to t's value, independent of t (a tensor's value never changes: rebinding
        either handle, `assign` or `t[i] = v`, leaves the other as it was). Costs nothing: no data is copied."""
        t = _new_object(Tensor)
        t.id = self.id
        GRAPH.retain(self.id)
        return t

    def __deepcopy__(self, memo: dict[builtins.int, Any]) -> Tensor:
        """`copy.deepcopy(t)` (and of a Module holding t): as `copy.copy`, a new independent handle to the same
        immutable value; a tensor reached twice is copied once."""
        return self.__copy__()

    def __reduce__(self) -> tuple[Any, ...]:
        """pickle: the values (the tensor is realized first: outside a running event loop only, else
        RuntimeStateError naming `await t.numpy()`), its dtype, and its device where it was asked for."""
        n = self._node
        return (_unpickle, (self.numpy_sync(), n.dtype.name, n.device if n.pinned else None))

    # ---------------------------------------------------------------- node building
    def _new(self, op: Op, src: tuple[builtins.int, ...], arg: Any, shape: Shape, dtype: DType,
             arg2: Any = None) -> Tensor:
        n = _nodes[self.id]
        return Tensor._from_node(Node(op, src, arg, shape, dtype, n.device, n.pinned, arg2))  # type: ignore[union-attr]

    @staticmethod
    def _const(value: Scalar, shape: Shape, dtype: DType, device: str, pinned: builtins.bool) -> Tensor:
        return Tensor._from_node(Node(Op.CONST, (), _fold_value(value, dtype), shape, dtype, device, pinned))

    def _const_like(self, value: Scalar, shape: Shape | None = None, dtype: DType | None = None) -> Tensor:
        n = self._node
        return Tensor._const(value, n.shape if shape is None else shape, dtype or n.dtype, n.device, n.pinned)

    # ---------------------------------------------------------------- realizing
    async def realize(self) -> Tensor:
        """Compute this tensor; returns it (realized).

        >>> import asyncio, azyx
        >>> asyncio.run((azyx.Tensor([1, 2]) + 1).realize()).shape
        (2,)
        """
        await _realize(self)
        return self

    async def numpy(self) -> np.ndarray:
        """Realize and return a numpy array the caller owns."""
        return await _read(self)

    async def item(self) -> Scalar:
        """Coroutine: realize this one-element tensor and return its value as a Python bool, int or float
        (`ShapeError` for more than one element).

        >>> import asyncio
        >>> asyncio.run((Tensor([1.5, 2.5]).sum()).item())
        4.0"""
        if self.numel() != 1:
            raise ShapeError(f"item() needs exactly one element, the tensor has shape {self.shape}")
        return (await _read(self)).reshape(()).item()

    async def tolist(self) -> Any:
        """Coroutine: realize and return the values as (nested) Python lists, like `numpy().tolist()`."""
        return (await self.numpy()).tolist()

    def realize_sync(self) -> Tensor:
        """`await t.realize()` for scripts: computes this tensor and returns it. Raises `RuntimeStateError` inside a
        running event loop (await `realize()` there)."""
        run_sync(self.realize())
        return self

    def numpy_sync(self) -> np.ndarray:
        """`await t.numpy()` for scripts: a numpy array the caller owns (bfloat16 as float32). Raises
        `RuntimeStateError` inside a running event loop."""
        return run_sync(self.numpy())

    # ---------------------------------------------------------------- factories
    @staticmethod
    def full(shape: Any, value: Scalar, dtype: Any = None, device: str | None = None) -> Tensor:
        """A lazy tensor of `shape` (an int or a tuple) filled with `value`: a constant, no data is uploaded.

        dtype: `dtype`, else the value's own (bool; int32, or int64 for an int outside int32's range; float32). An
        int that does not fit an integer `dtype` raises DTypeError naming it. device: `device`, else AUTO. The value
        is a kernel argument: a new value compiles nothing.

        >>> Tensor.full((2, 3), 7).numpy_sync().tolist()
        [[7, 7, 7], [7, 7, 7]]"""
        shape = _shape_arg(shape if isinstance(shape, list | tuple) else (shape,))
        dt = to_dtype(dtype) if dtype is not None else scalar_dtype(value)
        if dt.is_int and isinstance(value, int | np.integer) and not isinstance(value, bool):
            check_int(dt, value)
        dev, pinned = RT.resolve_device(device, prod(shape) * dt.itemsize)
        return Tensor._const(value, shape, dt, dev, pinned)

    @staticmethod
    def zeros(*shape: Any, dtype: Any = None, device: str | None = None) -> Tensor:
        """A tensor of `shape` (ints, or one tuple) filled with 0; float32 unless `dtype` is given; `device` else
        AUTO."""
        return Tensor.full(_shape_arg(shape), 0.0, dtype=dtype or dtypes.default_float, device=device)

    @staticmethod
    def ones(*shape: Any, dtype: Any = None, device: str | None = None) -> Tensor:
        """A tensor of `shape` (ints, or one tuple) filled with 1; float32 unless `dtype` is given; `device` else
        AUTO."""
        return Tensor.full(_shape_arg(shape), 1.0, dtype=dtype or dtypes.default_float, device=device)

    @staticmethod
    def zeros_like(t: Tensor, dtype: Any = None, device: str | None = None) -> Tensor:
        """Zeros of `t`'s shape, with `t`'s dtype and device unless `dtype`/`device` are given."""
        return Tensor.full(t.shape, 0, dtype=dtype or t.dtype, device=device or t.device)

    @staticmethod
    def ones_like(t: Tensor, dtype: Any = None, device: str | None = None) -> Tensor:
        """Ones of `t`'s shape, with `t`'s dtype and device unless `dtype`/`device` are given."""
        return Tensor.full(t.shape, 1, dtype=dtype or t.dtype, device=device or t.device)

    @staticmethod
    def arange(start: Scalar, stop: Scalar | None = None, step: Scalar = 1, dtype: Any = None,
               device: str | None = None) -> Tensor:
        """`start, start + step, ...` below `stop` (`arange(n)`: 0..n-1), like `numpy.arange`.

        dtype: `dtype`, else float32 if any of start/stop/step is a float, int32 otherwise. device: `device`, else AUTO.
        `ShapeError` for step 0.

        >>> Tensor.arange(5).numpy_sync().tolist(), Tensor.arange(0.0, 1.0, 0.25).numpy_sync().tolist()
        ([0, 1, 2, 3, 4], [0.0, 0.25, 0.5, 0.75])"""
        if stop is None:
            start, stop = 0, start
        if step == 0:
            raise ShapeError("arange step must not be 0")
        is_float = any(isinstance(v, float) for v in (start, stop, step))
        dt = to_dtype(dtype) if dtype is not None else (dtypes.default_float if is_float else dtypes.default_int)
        return Tensor(np.arange(start, stop, step).astype(dt.numpy), dtype=dt, device=device)

    @staticmethod
    def eye(n: builtins.int, dtype: Any = None, device: str | None = None) -> Tensor:
        """The (n, n) identity matrix; float32 unless `dtype` is given; `device` else AUTO."""
        dt = to_dtype(dtype) if dtype is not None else dtypes.default_float
        return Tensor(np.eye(n, dtype=dt.numpy), dtype=dt, device=device)

    @staticmethod
    def rand(*shape: Any, dtype: Any = None, device: str | None = None) -> Tensor:
        """Uniform random numbers in [0, 1) of `shape`: `uniform(*shape)`. float32 unless `dtype` is given; `device`
        else AUTO. Drawn on the host from azyx's generator (`azyx.manual_seed` makes them reproducible)."""
        return Tensor.uniform(*shape, dtype=dtype, device=device)

    @staticmethod
    def uniform(*shape: Any, low: builtins.float = 0.0, high: builtins.float = 1.0, dtype: Any = None,
                device: str | None = None) -> Tensor:
        """Uniform random numbers in [`low`, `high`) of `shape`; float32 unless `dtype` is given; `device` else AUTO.
        Drawn on the host from azyx's generator (`azyx.manual_seed`); under `azyx.jit` each replay draws anew."""
        dt = to_dtype(dtype) if dtype is not None else dtypes.default_float
        x = RT.rng.random(_shape_arg(shape), dtype=np.float64 if dt is dtypes.float64 else np.float32)
        if low != 0.0 or high != 1.0:
            x = x * (high - low) + low
        if dt.itemsize < 4:  # rounding to a narrow float can reach `high`: keep the interval half-open
            top = np.float32(high) * (1 - 2.0 ** -(8 if dt is dtypes.bfloat16 else 11))
            x = np.minimum(x, top)
        return _drawn(Tensor(x.astype(dt.numpy, copy=False), dtype=dt, device=device),
                      lambda: Tensor.uniform(*shape, low=low, high=high, dtype=dtype, device=device))

    @staticmethod
    def randn(*shape: Any, dtype: Any = None, device: str | None = None) -> Tensor:
        """Standard normal random numbers of `shape`; float32 unless `dtype` is given; `device` else AUTO. Drawn on
        the host from azyx's generator (`azyx.manual_seed`); under `azyx.jit` each replay draws anew."""
        dt = to_dtype(dtype) if dtype is not None else dtypes.default_float
        x = RT.rng.standard_normal(_shape_arg(shape), dtype=np.float64 if dt is dtypes.float64 else np.float32)
        return _drawn(Tensor(x.astype(dt.numpy, copy=False), dtype=dt, device=device),
                      lambda: Tensor.randn(*shape, dtype=dtype, device=device))

    @staticmethod
    def from_safetensors(path: Any, name: str) -> Tensor:
        """Tensor `name` of a safetensors file, lazily: a Leaf on device "disk" (only the header is read now).
        `.to(device)`, an op with tensors on a compute device, or `numpy()` reads it when realized; a slice of a
        row-major tensor (`t[2:5]`, `t[i]`) reads only its own bytes. See `azyx.io`.

        >>> import numpy as np, azyx
        >>> from safetensors.numpy import save_file
        >>> save_file({"w": np.arange(6, dtype=np.float32).reshape(3, 2)}, "/tmp/azyx_doc.safetensors")
        >>> w = Tensor.from_safetensors("/tmp/azyx_doc.safetensors", "w")
        >>> w.device, (w[1] * 10).numpy_sync().tolist()
        ('disk', [20.0, 30.0])
        """
        return Tensor._from_node(safetensors_node(path, name))

    # ---------------------------------------------------------------- elementwise
    def _operand(self, other: Any) -> Tensor:
        if isinstance(other, Tensor):
            return other
        if isinstance(other, bool | int | float | np.generic):
            dt = promote_scalar(self.dtype, other)
            return self._const_like(other.item() if isinstance(other, np.generic) else other, dtype=dt)
        return Tensor(other, device=self.device)

    def _binary(self, op: str, other: Any, reverse: builtins.bool = False) -> Tensor:
        """The general binary op (the operators, made by `_binop`, build the common cases themselves)."""
        tp = type(other)
        if getattr(tp, "defers_to_it", False):  # a type that takes the op over (azyx.shard's ShardedTensor)
            return NotImplemented
        a, b = self, self._operand(other)
        if reverse:
            a, b = b, a
        na, nb = a._node, b._node
        kind = _ops.BINARY[op][0]
        dt = na.dtype if na.dtype is nb.dtype else promote(na.dtype, nb.dtype)
        if op in _ops.BITWISE and dt.is_float:
            raise DTypeError(f"{op} needs bool or integer tensors, got {na.dtype.name} and {nb.dtype.name}")
        if kind == "float":
            dt = least_float(dt)
        a, b = a.cast(dt), b.cast(dt)
        shape = na.shape if na.shape == nb.shape else broadcast_shapes(na.shape, nb.shape)
        a, b = a._broadcast_to(shape), b._broadcast_to(shape)
        na, nb = a._node, b._node
        device, pinned = _join_devices(na, nb)
        out_dt = dtypes.bool if kind == "bool" else dt
        if na.op is Op.CONST and nb.op is Op.CONST:
            with np.errstate(all="ignore"):
                v = lift(lambda x, y: _ops.BINARY[op][1](np.asarray(x, dt.numpy), np.asarray(y, dt.numpy)),
                         na.arg, nb.arg)
            return Tensor._const(v, shape, out_dt, device, pinned)
        return Tensor._from_node(Node(Op.BINARY, (a.id, b.id), op, shape, out_dt, device, pinned))

    def _unary(self, op: str) -> Tensor:
        n = _nodes[self.id]
        assert n is not None
        if n.dtype.kind == "f" and n.op is not _CONST and op != "not" and n.device != DISK:  # (the common case:
            t = _new_object(Tensor)  # nothing to cast or fold; Tensor._from_node's body)
            t.id = _add_node(node := Node(_UNARY, (self.id,), op, n.shape, n.dtype, n.device, n.pinned))
            node.rc += 1
            return t
        x = self.cast(least_float(self.dtype)) if _ops.UNARY[op][0] else self
        n = x._node
        if op == "not" and n.dtype.is_float:
            raise DTypeError(f"~ needs a bool or integer tensor, got {n.dtype.name}")
        if n.op is Op.CONST:
            with np.errstate(all="ignore"):
                return x._const_like(lift(lambda v: _ops.UNARY[op][1](np.asarray(v, n.dtype.numpy)), n.arg))
        return x._new(Op.UNARY, (x.id,), op, n.shape, n.dtype)

    def cast(self, dtype: Any) -> Tensor:
        """This tensor converted to `dtype` (a DType, numpy dtype or name) elementwise, like numpy's `astype`; same
        shape and device. Returns self when the dtype is already `dtype`."""
        dt = to_dtype(dtype)
        n = self._node
        if n.dtype is dt:
            return self
        if n.op is Op.CONST:
            return self._const_like(n.arg, dtype=dt)
        return self._new(Op.CAST, (self.id,), None, n.shape, dt)

    def float(self) -> Tensor:
        """`cast(float32)`."""
        return self.cast(dtypes.float32)

    def half(self) -> Tensor:
        """`cast(float16)`."""
        return self.cast(dtypes.float16)

    def int(self) -> Tensor:
        """`cast(int32)` (floats truncate toward zero)."""
        return self.cast(dtypes.int32)

    def bool(self) -> Tensor:
        """`cast(bool)`: True where nonzero."""
        return self.cast(dtypes.bool)

    __add__, __radd__ = _binop("add"), _binop("add", True)
    __sub__, __rsub__ = _binop("sub"), _binop("sub", True)
    __mul__, __rmul__ = _binop("mul"), _binop("mul", True)
    __truediv__, __rtruediv__ = _binop("truediv"), _binop("truediv", True)
    __floordiv__, __rfloordiv__ = _binop("floordiv"), _binop("floordiv", True)
    __mod__, __rmod__ = _binop("mod"), _binop("mod", True)

    def __pow__(self, o: Any) -> Tensor:
        if isinstance(o, int | float) and not isinstance(o, bool):
            if o == 2:
                return self.square()
            if o == 1:
                return self
            if o == 0.5 and self.dtype.is_float:
                return self.sqrt()
        return _pow(self, o)

    __rpow__ = _binop("pow", True)

    def __neg__(self) -> Tensor:
        if self.dtype.is_bool:
            raise DTypeError("negation of a bool tensor; use ~ instead")
        return self._unary("neg")

    __lt__ = _binop("lt")
    __le__ = _binop("le")
    __gt__ = _binop("gt")
    __ge__ = _binop("ge")
    __eq__ = _binop("eq")  # type: ignore[assignment]
    __ne__ = _binop("ne")  # type: ignore[assignment]

    __and__, __rand__ = _binop("and"), _binop("and", True)
    __or__, __ror__ = _binop("or"), _binop("or", True)
    __xor__, __rxor__ = _binop("xor"), _binop("xor", True)

    def __invert__(self) -> Tensor:
        return self._unary("not")

    def __abs__(self) -> Tensor:
        return self.abs()

    def __matmul__(self, o: Tensor) -> Tensor:
        if getattr(type(o), "defers_to_it", False):  # (see _binary)
            return NotImplemented
        return self.matmul(o)

    def __rmatmul__(self, o: Tensor) -> Tensor:
        return self._operand(o).matmul(self)

    def abs(self) -> Tensor:
        """|x| elementwise; same shape, dtype and device."""
        return self._unary("abs")

    def exp(self) -> Tensor:
        """e**x elementwise; same shape and device, float dtype (ints become float32)."""
        return self._unary("exp")

    def log(self) -> Tensor:
        """Natural logarithm elementwise (-inf at 0, nan below); float dtype."""
        return self._unary("log")

    def exp2(self) -> Tensor:
        """2**x elementwise; float dtype."""
        return self._unary("exp2")

    def log2(self) -> Tensor:
        """Base-2 logarithm elementwise; float dtype."""
        return self._unary("log2")

    def sqrt(self) -> Tensor:
        """Square root elementwise (nan below 0); float dtype."""
        return self._unary("sqrt")

    def rsqrt(self) -> Tensor:
        """1 / sqrt(x) elementwise; float dtype."""
        return self._unary("rsqrt")

    def reciprocal(self) -> Tensor:
        """1 / x elementwise; float dtype."""
        return self._unary("reciprocal")

    def sin(self) -> Tensor:
        """Sine elementwise (radians); float dtype."""
        return self._unary("sin")

    def cos(self) -> Tensor:
        """Cosine elementwise (radians); float dtype."""
        return self._unary("cos")

    def tan(self) -> Tensor:
        """Tangent elementwise (radians); float dtype."""
        return self._unary("tan")

    def tanh(self) -> Tensor:
        """Hyperbolic tangent elementwise; float dtype."""
        return self._unary("tanh")

    def erf(self) -> Tensor:
        """The error function elementwise; float dtype."""
        return self._unary("erf")

    def sigmoid(self) -> Tensor:
        """1 / (1 + e**-x) elementwise; float dtype."""
        return self._unary("sigmoid")

    def relu(self) -> Tensor:
        """max(x, 0) elementwise; same dtype."""
        return self._unary("relu")

    def gelu(self, approximate: str = "none") -> Tensor:
        """GELU elementwise: `x * Phi(x)` with the exact erf form (`approximate="none"`, PyTorch's default) or the
        tanh form (`approximate="tanh"`); float dtype."""
        if approximate not in ("none", "tanh"):
            raise ValueError(f"gelu approximate must be 'none' or 'tanh', got {approximate!r}")
        return self._unary("gelu" if approximate == "none" else "gelu_tanh")

    def silu(self) -> Tensor:
        """x * sigmoid(x) elementwise (swish); float dtype."""
        return self._unary("silu")

    def softplus(self) -> Tensor:
        """log(1 + e**x) elementwise, stable for large x; float dtype."""
        return self._unary("softplus")

    def sign(self) -> Tensor:
        """-1, 0 or 1 elementwise by the sign of x; same dtype."""
        return self._unary("sign")

    def floor(self) -> Tensor:
        """Largest integer <= x elementwise; same dtype (an integer tensor is returned as it is)."""
        return self if not self.dtype.is_float else self._unary("floor")

    def ceil(self) -> Tensor:
        """Smallest integer >= x elementwise; same dtype (an integer tensor is returned as it is)."""
        return self if not self.dtype.is_float else self._unary("ceil")

    def round(self) -> Tensor:
        """Round to the nearest integer, half to even (like numpy); same dtype (an integer tensor is returned as it
        is)."""
        return self if not self.dtype.is_float else self._unary("round")

    def square(self) -> Tensor:
        """x * x elementwise; same dtype. `x ** 2` builds this."""
        return self._unary("square")

    maximum = _binop("max")
    minimum = _binop("min")

    def clip(self, lo: Any = None, hi: Any = None) -> Tensor:
        """Each element limited to [`lo`, `hi`]: `maximum(lo)` then `minimum(hi)` (None leaves that side open);
        numbers or tensors, broadcasting; dtype promoted like `maximum`."""
        out = self
        if lo is not None:
            out = out.maximum(lo)
        if hi is not None:
            out = out.minimum(hi)
        return out

    @staticmethod
    def where(cond: Any, a: Any, b: Any) -> Tensor:
        """Elementwise `a if cond else b`, broadcasting all three."""
        tc, ta_, tb_ = type(cond), type(a), type(b)
        if tc is Tensor and (ta_ is Tensor) != (tb_ is Tensor) and (ta_ in (float, int) or tb_ in (float, int)):
            t, value = (a, b) if ta_ is Tensor else (b, a)  # the common case: a mask, a float tensor and a scalar
            nc, nt = _nodes[cond.id], _nodes[t.id]
            assert nc is not None and nt is not None
            if (nc.dtype is dtypes.bool and nt.dtype.kind == "f" and nc.shape == nt.shape and nc.device == nt.device
                    and nc.op is not Op.CONST):
                c = Tensor._const(value, nt.shape, nt.dtype, nc.device, nc.pinned)
                xy = (t.id, c.id) if ta_ is Tensor else (c.id, t.id)
                return Tensor._from_node(Node(Op.WHERE, (cond.id, *xy), None, nt.shape, nt.dtype, nt.device,
                                              nc.pinned or nt.pinned))
        anchor = next((x for x in (cond, a, b) if isinstance(x, Tensor)), None)
        if anchor is None:
            anchor = Tensor(cond)
        c = anchor._operand(cond) if not isinstance(cond, Tensor) else cond
        if not isinstance(c, Tensor) or not c.dtype.is_bool:
            c = c.cast(dtypes.bool)
        ta = a if isinstance(a, Tensor) else None
        tb = b if isinstance(b, Tensor) else None
        if ta is None and tb is None:
            dt = promote(scalar_dtype(a), scalar_dtype(b))
        elif ta is None:
            dt = promote_scalar(tb.dtype, a)  # type: ignore[union-attr]
        elif tb is None:
            dt = promote_scalar(ta.dtype, b)
        else:
            dt = promote(ta.dtype, tb.dtype)
        shapes = [x.shape for x in (c, ta, tb) if x is not None]
        shape = shapes[0] if len(shapes) == 1 else broadcast_shapes(*shapes)
        x = ta.cast(dt)._broadcast_to(shape) if ta is not None else c._const_like(a, shape=shape, dtype=dt)
        y = tb.cast(dt)._broadcast_to(shape) if tb is not None else c._const_like(b, shape=shape, dtype=dt)
        c = c._broadcast_to(shape)
        nc, nx, ny = c._node, x._node, y._node
        device, pinned = _join_devices(nc, nx, ny)
        if nc.op is Op.CONST:
            return x if nc.arg else y
        return Tensor._from_node(Node(Op.WHERE, (c.id, x.id, y.id), None, shape, dt, device, pinned))

    # ---------------------------------------------------------------- movement
    def _broadcast_to(self, shape: Shape) -> Tensor:
        """Broadcast to `shape` (which the caller knows it broadcasts to): leading 1s by a reshape, then an expand."""
        n = _nodes[self.id]
        assert n is not None
        s = n.shape
        if s == shape:
            return self
        if n.op is Op.CONST:
            return Tensor._from_node(Node(Op.CONST, (), n.arg, shape, n.dtype, n.device, n.pinned))
        x = self
        if len(s) < len(shape):
            s = (1,) * (len(shape) - len(s)) + s
            x = x._reshaped(s)
            if s == shape:
                return x
        for o, t in zip(s, shape):
            if o != t and o != 1:
                raise ShapeError(f"cannot expand {n.shape} to {shape}: only size-1 dimensions expand")
        return x._new(Op.EXPAND, (x.id,), shape, shape, n.dtype)

    def _reshaped(self, new: Shape) -> Tensor:
        """Reshape to `new`, a shape of as many elements (checked by the caller)."""
        n = _nodes[self.id]
        assert n is not None
        if new == n.shape:
            return self
        if n.op is _CONST:
            return Tensor._from_node(Node(_CONST, (), n.arg, new, n.dtype, n.device, n.pinned))
        if n.op is _RESHAPE:  # reshape of a reshape is one reshape
            m = _nodes[n.src[0]]
            assert m is not None
            return Tensor._from_node(Node(_RESHAPE, (n.src[0],), new, new, m.dtype, m.device, m.pinned))
        return Tensor._from_node(Node(_RESHAPE, (self.id,), new, new, n.dtype, n.device, n.pinned))

    def reshape(self, *shape: Any) -> Tensor:
        """The same elements in a new `shape` (ints, or one tuple; one -1 is inferred), in row-major order. A view
        where the layout allows (index arithmetic, no copy); `ShapeError` when the sizes differ.

        >>> Tensor.arange(6).reshape(2, -1).numpy_sync().tolist()
        [[0, 1, 2], [3, 4, 5]]"""
        if len(shape) == 1 and isinstance(shape[0], list | tuple):
            shape = tuple(shape[0])
        if shape.count(-1) > 1:
            raise ShapeError(f"reshape to {shape}: at most one dimension can be -1")
        n = self._node
        total = prod(n.shape)
        if -1 in shape:
            rest = prod([s for s in shape if s != -1])
            if rest == 0 or total % rest:
                raise ShapeError(f"cannot reshape {n.shape} into {shape}")
            shape = tuple(total // rest if s == -1 else s for s in shape)
        new = _shape_arg(shape)
        if prod(new) != total:
            raise ShapeError(f"cannot reshape {n.shape} ({total} elements) into {new} ({prod(new)} elements)")
        return self._reshaped(new)

    def _placed_like(self, t: Tensor) -> Tensor:
        """`t`, a fresh helper tensor made on self's device (an arange, a random mask, optimiser state), placed like
        self: pinned only when self is. Ops joining them then keep self's placement, so a model created on AUTO stays
        AUTO through a training step and the step's graph structure (and cached plan) is the same every step."""
        n = t._node
        # (a disk tensor's helpers are made on AUTO: the disk computes nothing)
        assert (n.device == self.device or self.device == DISK) and n.rc == 1 and not n.src, \
            "only a fresh tensor on self's device"
        n.pinned = self._node.pinned
        return t

    @staticmethod
    def _wrap(i: builtins.int) -> Tensor:
        t = object.__new__(Tensor)
        t.id = i
        GRAPH.retain(i)
        return t

    @staticmethod
    def _realized(shape: Shape, dtype: DType, device: str, pinned: builtins.bool, buffer: Any, view: Any) -> Tensor:
        """A handle of a new leaf node that holds `buffer` seen through `view` (azyx.jit's replay)."""
        if native is not None:
            return native.realized(shape, dtype, device, pinned, buffer, view)
        node = Node(Op.LEAF, (), None, shape, dtype, device, pinned)
        node.buffer, node.view = buffer, view
        return Tensor._wrap(GRAPH.add(node))

    def expand(self, *shape: Any) -> Tensor:
        """Broadcast size-1 axes to `shape` (ints or one tuple; -1 keeps an axis; new leading axes may be added),
        without a copy; `ShapeError` for an axis that is not 1."""
        if len(shape) == 1 and isinstance(shape[0], list | tuple):
            shape = tuple(shape[0])
        n = self._node
        if len(shape) < len(n.shape):
            raise ShapeError(f"cannot expand {n.shape} to {shape}")
        if len(shape) > len(n.shape):
            return self.reshape((1,) * (len(shape) - len(n.shape)) + n.shape).expand(*shape)
        new = tuple(o if s == -1 else s for s, o in zip(shape, n.shape))
        for o, s in zip(n.shape, new):
            if o != s and o != 1:
                raise ShapeError(f"cannot expand {n.shape} to {tuple(shape)}: only size-1 dimensions expand")
        new = _shape_arg(new)
        if new == n.shape:
            return self
        if n.op is Op.CONST:
            return self._const_like(n.arg, shape=new)
        return self._new(Op.EXPAND, (self.id,), new, new, n.dtype)

    def permute(self, *dims: Any) -> Tensor:
        """The axes reordered: axis i of the result is axis `dims[i]` of this one (ints or one tuple, negative
        allowed)."""
        if len(dims) == 1 and isinstance(dims[0], list | tuple):
            dims = tuple(dims[0])
        n = self._node
        nd = len(n.shape)
        for d in dims:
            if type(d) is not int or not 0 <= d < nd:
                axes = tuple(_norm_axis(d, nd) for d in dims)
                break
        else:
            axes = tuple(dims)
        if len(axes) != nd or sorted(axes) != list(range(nd)):
            raise AxisError(f"permute {dims} is not a permutation of the {nd} axes of shape {n.shape}")
        if axes == tuple(range(nd)):
            return self
        shape = tuple(n.shape[a] for a in axes)
        if n.op is Op.CONST:
            return self._const_like(n.arg, shape=shape)
        return self._new(Op.PERMUTE, (self.id,), axes, shape, n.dtype)

    def transpose(self, d0: builtins.int = -2, d1: builtins.int = -1) -> Tensor:
        """Axes `d0` and `d1` swapped (by default the last two)."""
        nd = self.ndim
        a, b = _norm_axis(d0, nd), _norm_axis(d1, nd)
        order = list(range(nd))
        order[a], order[b] = order[b], order[a]
        return self.permute(*order)

    @property
    def T(self) -> Tensor:
        """All axes reversed (the transpose of a matrix)."""
        return self.permute(*reversed(range(self.ndim)))

    def moveaxis(self, src: builtins.int, dst: builtins.int) -> Tensor:
        """Axis `src` moved to position `dst`, the others keeping their order (numpy's `moveaxis`)."""
        nd = self.ndim
        s, d = _norm_axis(src, nd), _norm_axis(dst, nd)
        order = [i for i in range(nd) if i != s]
        order.insert(d, s)
        return self.permute(*order)

    def pad(self, pads: Any, value: Scalar = 0.0) -> Tensor:
        """Padded with `value` (default 0.0, a kernel argument): `pads` is ((before, after), ...), one pair per axis;
        negative amounts crop. Same dtype and device.

        >>> Tensor([1, 2]).pad(((1, 2),), value=9).numpy_sync().tolist()
        [9, 1, 2, 9, 9]"""
        n = self._node
        try:
            pads = tuple((int(b), int(a)) for b, a in pads)
        except (TypeError, ValueError):
            raise ShapeError(f"pads must be ((before, after), ...) per axis, got {pads!r}") from None
        if len(pads) != len(n.shape):
            raise ShapeError(f"pads {pads} has {len(pads)} entries for a tensor of shape {n.shape}")
        for (b, a), s in zip(pads, n.shape):
            if b + a + s < 0 or -b > s or -a > s:
                raise ShapeError(f"pads {pads} shrink shape {n.shape} below zero")
        if all(b == 0 and a == 0 for b, a in pads):
            return self
        shape = tuple(s + b + a for s, (b, a) in zip(n.shape, pads))
        grows = any(b > 0 or a > 0 for b, a in pads)
        if n.op is Op.CONST and (not grows or _same_value(_fold_value(value, n.dtype), n.arg)):
            return self._const_like(n.arg, shape=shape)
        return self._new(Op.PAD, (self.id,), pads, shape, n.dtype, arg2=_fold_value(value, n.dtype))

    def _shrink(self, bounds: Sequence[tuple[builtins.int, builtins.int]]) -> Tensor:
        return self.pad(tuple((-lo, hi - s) for (lo, hi), s in zip(bounds, self.shape)))

    @_dims
    def flip(self, axis: builtins.int | Sequence[builtins.int]) -> Tensor:
        """The order of elements reversed along `axis` (an int or a tuple of ints)."""
        n = self._node
        axes = tuple(a for a in _norm_axes(axis, len(n.shape)) if n.shape[a] > 1)
        if not axes:
            return self
        if n.op is Op.CONST:
            return self
        return self._new(Op.FLIP, (self.id,), axes, n.shape, n.dtype)

    @_dims
    def squeeze(self, axis: builtins.int | Sequence[builtins.int] | None = None) -> Tensor:
        """Size-1 axes removed: all of them (`axis=None`), or those named by `axis` (an int or tuple; a named axis
        whose size is not 1 is left alone, like PyTorch)."""
        shape = self.shape
        if axis is None:
            return self.reshape(tuple(s for s in shape if s != 1))
        axes = _norm_axes(axis, len(shape))  # like PyTorch, axes whose size is not 1 are left alone
        return self.reshape(tuple(s for i, s in enumerate(shape) if i not in axes or s != 1))

    @_dims
    def unsqueeze(self, axis: builtins.int) -> Tensor:
        """A size-1 axis inserted at position `axis` (negative counts from the end of the result)."""
        shape = self.shape
        a = _norm_axis(axis, len(shape), 1)
        return self.reshape(shape[:a] + (1,) + shape[a:])

    def flatten(self, start: builtins.int = 0, end: builtins.int = -1) -> Tensor:
        """Axes `start`..`end` (inclusive, default all) merged into one; a 0-d tensor becomes shape (1,)."""
        shape = self.shape
        if not shape:
            return self.reshape(1)
        s, e = _norm_axis(start, len(shape)), _norm_axis(end, len(shape))
        if e < s:
            raise AxisError(f"flatten end axis {end} comes before start axis {start}")
        return self.reshape(shape[:s] + (prod(shape[s : e + 1]),) + shape[e + 1 :])

    def repeat(self, *reps: Any) -> Tensor:
        """Tile like numpy.tile."""
        if len(reps) == 1 and isinstance(reps[0], list | tuple):
            reps = tuple(reps[0])
        reps = _shape_arg(reps)
        x = self
        if len(reps) > x.ndim:
            x = x.reshape((1,) * (len(reps) - x.ndim) + x.shape)
        reps = (1,) * (x.ndim - len(reps)) + reps
        if all(r == 1 for r in reps):
            return x
        inter = tuple(v for s in x.shape for v in (1, s))
        big = tuple(v for r, s in zip(reps, x.shape) for v in (r, s))
        return x.reshape(inter).expand(*big).reshape(tuple(r * s for r, s in zip(reps, x.shape)))

    def _stride(self, axis: builtins.int, step: builtins.int) -> Tensor:
        """Every `step`-th element along `axis`, as pad + reshape + shrink (index arithmetic only)."""
        shape = self.shape
        n = shape[axis]
        m = -(-n // step)
        x = self.pad(tuple((0, m * step - n) if i == axis else (0, 0) for i in range(len(shape))))
        x = x.reshape(shape[:axis] + (m, step) + shape[axis + 1 :])
        x = x._shrink([(0, s) for s in shape[:axis]] + [(0, m), (0, 1)] + [(0, s) for s in shape[axis + 1 :]])
        return x.reshape(shape[:axis] + (m,) + shape[axis + 1 :])

    @staticmethod
    @_dims
    def cat(tensors: Sequence[Tensor], axis: builtins.int = 0) -> Tensor:
        """`tensors` joined along an existing `axis` (default 0); all shapes equal but along `axis`, dtypes promoted.
        A static method: `Tensor.cat([a, b], axis=1)`.

        >>> Tensor.cat([Tensor([[1, 2]]), Tensor([[3, 4]])], axis=0).numpy_sync().tolist()
        [[1, 2], [3, 4]]"""
        if not tensors:
            raise ShapeError("cat of an empty list")
        first = tensors[0]
        a = _norm_axis(axis, first.ndim)
        for t in tensors[1:]:
            if t.ndim != first.ndim or any(s != o for i, (s, o) in enumerate(zip(t.shape, first.shape)) if i != a):
                raise ShapeError(f"cat along axis {axis}: shape {t.shape} does not match {first.shape}")
        dt = first.dtype
        for t in tensors[1:]:
            dt = promote(dt, t.dtype)
        total = sum(t.shape[a] for t in tensors)
        out: Tensor | None = None
        start = 0
        for t in tensors:
            n = t.shape[a]
            pads = tuple((start, total - start - n) if i == a else (0, 0) for i in range(first.ndim))
            # the pieces are padded with the sum's identity: -0.0 for floats (x + -0.0 is x, -0.0 included; a 0.0
            # fill would turn a -0.0 of the input into 0.0)
            piece = t.cast(dt).pad(pads, value=-0.0 if dt.is_float else 0)
            out = piece if out is None else (out | piece if dt.is_bool else out + piece)
            start += n
        assert out is not None
        return out

    @staticmethod
    @_dims
    def stack(tensors: Sequence[Tensor], axis: builtins.int = 0) -> Tensor:
        """`tensors` (all of one shape) joined along a new axis `axis` (default 0). A static method:
        `Tensor.stack([a, b])`."""
        if not tensors:
            raise ShapeError("stack of an empty list")
        a = _norm_axis(axis, tensors[0].ndim, 1)
        for t in tensors[1:]:
            if t.shape != tensors[0].shape:
                raise ShapeError(f"stack needs equal shapes, got {tensors[0].shape} and {t.shape}")
        return Tensor.cat([t.unsqueeze(a) for t in tensors], axis=a)

    @_dims
    def split(self, size: builtins.int | Sequence[builtins.int], axis: builtins.int = 0) -> list[Tensor]:
        """A list of views along `axis` (default 0): pieces of `size` elements each (an int; the last may be
        shorter), or of the sizes in a list (which must add up to the axis).

        >>> [p.numpy_sync().tolist() for p in Tensor.arange(5).split(2)]
        [[0, 1], [2, 3], [4]]"""
        a = _norm_axis(axis, self.ndim)
        n = self.shape[a]
        if isinstance(size, int):
            if size <= 0:
                raise ShapeError(f"split size must be positive, got {size}")
            sizes = [min(size, n - i) for i in range(0, n, size)] or [0]
        else:
            sizes = list(size)
            if sum(sizes) != n:
                raise ShapeError(f"split sizes {sizes} do not add up to {n} along axis {axis}")
        out, start = [], 0
        for s in sizes:
            out.append(self._shrink([(start, start + s) if i == a else (0, d) for i, d in enumerate(self.shape)]))
            start += s
        return out

    @_dims
    def chunk(self, n: builtins.int, axis: builtins.int = 0) -> list[Tensor]:
        """A list of at most `n` views along `axis` (default 0), of equal size but the last (PyTorch's `chunk`)."""
        if n <= 0:
            raise ShapeError(f"chunk count must be positive, got {n}")
        size = self.shape[_norm_axis(axis, self.ndim)]
        return self.split(max(1, -(-size // n)), axis)

    def __getitem__(self, key: Any) -> Tensor:
        """numpy indexing: ints, slices (negative steps too), None and Ellipsis are views; integer tensors (or lists,
        or numpy arrays) among them read at their indices (several broadcast together, `x[[0, 1], [1, 2]]`; numpy's
        placement of the result's axes; negative indices count from the end). An index known on the host is checked at
        the call; one in a tensor raises IndexOutOfRange when realized (the kernel checks it; with AZYX_CHECKS=0 it is
        clamped: it never reads outside the tensor). A boolean mask raises DTypeError naming `Tensor.where` and
        `masked_fill` (its result's shape depends on the data).

        >>> t = Tensor([[1, 2], [3, 4], [5, 6]])
        >>> t[[2, -3]].numpy_sync().tolist(), t[:, Tensor([1])].numpy_sync().tolist()
        ([[5, 6], [1, 2]], [[2], [4], [6]])
        """
        if isinstance(key, Tensor | list | np.ndarray):
            key = (key,)
        elif not isinstance(key, tuple):
            key = (key,)
        arrays = [i for i, k in enumerate(key) if isinstance(k, Tensor | list | np.ndarray)]
        if arrays:
            return self._advanced(key, arrays)
        return self._basic(key)

    def _advanced(self, key: tuple, arrays: list[builtins.int]) -> Tensor:
        """`self[key]` where key[arrays[0]] is an integer array: the basic indices first, then a gather along the axis
        the array indexes (numpy puts its axes first when ints stand apart from it: ints are advanced indices too)."""
        for i in arrays:
            _refuse_mask(key[i])
        if len(arrays) > 1:
            return self._advanced_many(key, arrays)
        pos = arrays[0]
        x = self._basic(key[:pos] + (slice(None),) + key[pos + 1 :])
        n_real = sum(1 for k in key if k is not None and k is not Ellipsis)
        axis = 0  # the axis of x that the array indexes: the axes the entries before it leave
        for k in key[:pos]:
            if k is Ellipsis:
                axis += self.ndim - n_real
            elif not isinstance(k, int | np.integer):
                axis += 1
        out = x._take(axis, key[pos])
        adv = sorted([i for i, k in enumerate(key) if isinstance(k, int | np.integer)] + [pos])
        if adv != list(range(adv[0], adv[-1] + 1)):  # apart from an int: numpy puts the index's axes first
            k = out.ndim - x.ndim + 1
            return out.permute(*range(axis, axis + k), *range(axis), *range(axis + k, out.ndim))
        return out

    def _advanced_many(self, key: tuple, arrays: list[builtins.int]) -> Tensor:
        """`self[key]` with several integer arrays (numpy's rules: `x[[0, 1], [1, 2]]` reads x[0, 1] and x[1, 2]): the
        arrays broadcast together; the basic indices first, then one take along the first indexed axis and a gather
        along each further one (each index checked or clamped like `t[idx]`'s). The broadcast index's axes stand where
        the first array stood when the arrays (and ints) are adjacent in `key`, else first (numpy's placement)."""
        x = self._basic(tuple(slice(None) if i in arrays else k for i, k in enumerate(key)))
        n_real = sum(1 for k in key if k is not None and k is not Ellipsis)
        axes, axis = [], 0  # the axis of x each array indexes
        for i, k in enumerate(key):
            if i in arrays:
                axes.append(axis)
                axis += 1
            elif k is Ellipsis:
                axis += self.ndim - n_real
            elif not isinstance(k, int | np.integer):
                axis += 1
        idx = [x._rows(a, key[i]) for a, i in zip(axes, arrays)]
        bshape = broadcast_shapes(*(t.shape for t in idx))
        m = prod(bshape)
        rest = [d for d in range(x.ndim) if d not in axes]
        flat = [t._broadcast_to(bshape).reshape(m) for t in idx]
        y = x.permute(*axes, *rest)._take(0, flat[0])  # (m, the other indexed axes, the rest)
        for f in flat[1:]:
            index = f.reshape((m,) + (1,) * (y.ndim - 1))._broadcast_to((m, 1) + y.shape[2:])
            y = y._gathered(1, index).reshape((m,) + y.shape[2:])
        y = y.reshape(bshape + y.shape[1:])
        adv = sorted([i for i, k in enumerate(key) if isinstance(k, int | np.integer)] + arrays)
        if adv == list(range(adv[0], adv[-1] + 1)) and axes[0]:  # adjacent: the index's axes where the first stood
            nb = len(bshape)
            return y.permute(*range(nb, nb + axes[0]), *range(nb), *range(nb + axes[0], y.ndim))
        return y

    def _rows(self, axis: builtins.int, index: Any) -> Tensor:
        """An integer index along `axis` as a tensor on self's device: a host index (list, numpy) checked and
        wrapped now, naming the first value out of range."""
        n = self.shape[axis]
        if isinstance(index, Tensor):
            if index.dtype.is_float or index.dtype.is_bool:
                raise DTypeError(f"index tensors must be integer, got {index.dtype.name}")
            if n == 0 and index.numel():
                raise IndexOutOfRange(f"cannot index axis {axis} of size 0 (shape {self.shape})")
            return index if index.dtype in (dtypes.int32, dtypes.int64) else \
                index.cast(dtypes.int64 if index.dtype.itemsize >= 4 else dtypes.int32)
        arr = np.asarray(index)
        if arr.dtype.kind not in "iu" and arr.size:
            raise DTypeError(f"index arrays must be integer, got {arr.dtype}")
        arr = arr.astype(np.int64)
        bad = arr[(arr < -n) | (arr >= n)]
        if bad.size:
            raise IndexOutOfRange(f"index {bad.flat[0]} is out of range for axis {axis} of size {n}")
        arr = arr % max(n, 1)
        dt = np.int32 if n < 2**31 else np.int64
        dev = None if self.device == DISK else self.device
        return self._placed_like(Tensor(arr.astype(dt), device=dev)) if dev is not None else Tensor(arr.astype(dt))

    def _take(self, axis: builtins.int, index: Any) -> Tensor:
        """numpy's take along `axis`: the index's shape replaces that axis."""
        if not self.shape:
            raise IndexOutOfRange("cannot index a 0-d tensor with a tensor")
        if axis == 0 and self.device == DISK and not isinstance(index, Tensor):
            rows = self._disk_rows(index)
            if rows is not None:
                return rows
        idx = self._rows(axis, index)
        shape = self.shape
        pre, post, m = shape[:axis], shape[axis + 1 :], idx.numel()
        flat = idx.reshape((1,) * len(pre) + (m,) + (1,) * len(post))._broadcast_to(pre + (m,) + post)
        return self._gathered(axis, flat).reshape(pre + idx.shape + post)

    def _disk_rows(self, index: Any) -> Tensor | None:
        """`self[index]` for a file-backed (disk) tensor and a host index (list, numpy): only the rows the index needs
        are read (each run of consecutive rows a narrower disk range, joined on the compute device), then picked
        there. None where the rows are all of them or fall in more than DISK_RUNS runs (the whole range is read)."""
        arr = np.asarray(index)
        n = self.shape[0]
        if arr.dtype.kind not in "iu" or not arr.size or not n:
            return None
        arr = arr.astype(np.int64)
        bad = arr[(arr < -n) | (arr >= n)]
        if bad.size:
            raise IndexOutOfRange(f"index {bad.flat[0]} is out of range for axis 0 of size {n}")
        rows, inverse = np.unique(arr % n, return_inverse=True)
        cuts = np.flatnonzero(np.diff(rows) != 1) + 1
        starts, ends = [0, *cuts.tolist()], [*cuts.tolist(), len(rows)]
        if len(starts) > DISK_RUNS or (len(starts) == 1 and rows[0] == 0 and rows[-1] == n - 1):
            return None
        parts = [self[builtins.int(rows[a]) : builtins.int(rows[b - 1]) + 1] for a, b in zip(starts, ends)]
        table = parts[0] if len(parts) == 1 else Tensor.cat(parts, 0)
        return table._take(0, inverse.reshape(arr.shape))

    def _gathered(self, axis: builtins.int, index: Tensor) -> Tensor:
        """The GATHER node (index: integer, of self's number of axes, checked by the caller)."""
        na, ni = self._node, index._node
        device, pinned = _join_devices(na, ni)
        return Tensor._from_node(Node(Op.GATHER, (self.id, index.id), axis, ni.shape, na.dtype, device, pinned))

    def _scattered(self, axis: builtins.int, index: Tensor, shape: Shape) -> Tensor:
        """The SCATTER node: a tensor of `shape`, zero but where `index` (of self's shape) points along `axis`, where
        self's values add up (GATHER's gradient). Self and the index are padded to `shape` off the axis (a padded
        point adds 0 to row 0), so each point off the axis owns its elements."""
        if not self.numel():
            return self._const_like(0.0, shape=shape)
        pads = tuple((0, 0) if d == axis else (0, s - i) for d, (s, i) in enumerate(zip(shape, self.shape)))
        g, idx = self.pad(pads), index.pad(pads, value=0)
        ng, ni = g._node, idx._node
        device, pinned = _join_devices(ng, ni)
        return Tensor._from_node(Node(Op.SCATTER, (g.id, idx.id), (axis, shape), shape, ng.dtype, device, pinned))

    def _basic(self, key: tuple) -> Tensor:
        shape = self.shape
        bounds, flips, strides, final = [], [], [], []
        for k, dim in _key_axes(key, shape):
            if dim is None:
                final.append(1)
                continue
            n = shape[dim]
            if isinstance(k, int | np.integer) and not isinstance(k, bool):
                i = int(k)
                if not -n <= i < n:
                    raise IndexOutOfRange(f"index {i} is out of range for axis {dim} of size {n}")
                i %= n
                bounds.append((i, i + 1))
            elif isinstance(k, slice):
                start, stop, step = k.indices(n)
                count = len(range(start, stop, step))
                if count == 0:
                    bounds.append((0, 0))
                else:  # whole steps where the axis allows them, so a stepped slice stays a strided view
                    span = count * abs(step) if abs(step) > 1 and count > 1 else (count - 1) * abs(step) + 1
                    if step > 0:
                        bounds.append((start, min(n, start + span)))
                    else:
                        bounds.append((max(0, start + 1 - span), start + 1))
                        flips.append(dim)
                if abs(step) > 1 and count > 1:
                    strides.append((dim, abs(step)))
                final.append(count)
            else:
                raise IndexOutOfRange(f"unsupported index {k!r}")
        x = self._shrink(bounds)
        if flips:
            x = x.flip(flips)
        for d, s in strides:
            x = x._stride(d, s)
        return x.reshape(tuple(final))

    @_dims
    def gather(self, axis: builtins.int, index: Any) -> Tensor:
        """PyTorch's gather: out[i][j] = self[index[i][j]][j] for axis 0 (out has the index's shape; the index has
        self's number of axes, none longer than self's but `axis`). Negative indices count from the end; a host
        index (list, numpy) out of range raises here, one in a tensor raises IndexOutOfRange when realized.

        >>> Tensor([[1, 2], [3, 4]]).gather(1, Tensor([[1, 1], [0, 1]])).numpy_sync().tolist()
        [[2, 2], [3, 4]]
        """
        a = _norm_axis(axis, self.ndim)
        shape = index.shape if isinstance(index, Tensor) else np.shape(index)
        if len(shape) != self.ndim:
            raise ShapeError(f"gather index of shape {shape} needs {self.ndim} dimensions like {self.shape}")
        for d, (s, i) in enumerate(zip(self.shape, shape)):
            if d != a and i > s:
                raise ShapeError(f"gather index shape {shape} exceeds {self.shape} on axis {d}")
        return self._gathered(a, self._rows(a, index))

    # ---------------------------------------------------------------- reductions
    def _reduce(self, op: str, axis: Any, keepdim: builtins.bool) -> Tensor:
        n = _nodes[self.id]
        assert n is not None
        shape = n.shape
        if axis is None:  # (the common case, without comprehensions)
            axes = tuple(range(len(shape)))
            out_keep: Shape = (1,) * len(shape)
            out: Shape = ()
        else:
            axes = _norm_axes(axis, len(shape))
            out_keep = tuple([1 if i in axes else s for i, s in enumerate(shape)])
            out = tuple([s for i, s in enumerate(shape) if i not in axes])
        dt = n.dtype
        x = self.cast(dtypes.int32) if dt.kind == "b" and op in ("sum", "prod") else self
        if not axes:
            return x
        if op in ("max", "min") and any(shape[a] == 0 for a in axes):
            raise ShapeError(f"{op} over an empty axis of shape {shape}")
        nx = _nodes[x.id]
        assert nx is not None
        if nx.op is _CONST and op in ("max", "min"):
            r = x._const_like(nx.arg, shape=out_keep)
        elif keepdim or out == out_keep or nx.device == DISK:
            r = Tensor._from_node(Node(_REDUCE, (x.id,), (op, axes), out_keep, nx.dtype, nx.device, nx.pinned))
        else:  # the reduce, and the reshape that drops its axes (the only handle: no Tensor for the reduce itself)
            red = _add_node(Node(_REDUCE, (x.id,), (op, axes), out_keep, nx.dtype, nx.device, nx.pinned))
            t = _new_object(Tensor)
            t.id = _add_node(node := Node(_RESHAPE, (red,), out, out, nx.dtype, nx.device, nx.pinned))
            node.rc += 1
            return t
        return r if keepdim or out == out_keep else r._reshaped(out)

    @_dims
    def sum(self, axis: Any = None, keepdim: builtins.bool = False) -> Tensor:
        """Sum over `axis` (None: every axis; an int or a tuple, negative allowed), keeping the reduced axes as size
        1 with `keepdim=True`. dtype: bool sums as int32, ints and floats keep theirs (float16/bfloat16 accumulate
        in float32).

        >>> t = Tensor([[1.0, 2.0], [3.0, 4.0]])
        >>> t.sum().numpy_sync().tolist(), t.sum(axis=0).numpy_sync().tolist(), t.sum(1, keepdim=True).shape
        (10.0, [4.0, 6.0], (2, 1))"""
        return self._reduce("sum", axis, keepdim)

    @_dims
    def prod(self, axis: Any = None, keepdim: builtins.bool = False) -> Tensor:
        """Product over `axis` (None: every axis; int or tuple), `keepdim` as in `sum`; bool multiplies as int32."""
        return self._reduce("prod", axis, keepdim)

    @_dims_with_indices("argmax", "maximum")
    def max(self, axis: Any = None, keepdim: builtins.bool = False) -> Tensor:
        """Maximum over `axis` (None: every axis; int or tuple), `keepdim` as in `sum`; same dtype. Returns values
        only (the index: `argmax`). `ShapeError` over an empty axis.

        >>> Tensor([[1, 5], [7, 2]]).max(axis=1).numpy_sync().tolist()
        [5, 7]"""
        return self._reduce("max", axis, keepdim)

    @_dims_with_indices("argmin", "minimum")
    def min(self, axis: Any = None, keepdim: builtins.bool = False) -> Tensor:
        """Minimum over `axis` (None: every axis; int or tuple), `keepdim` as in `sum`; same dtype. Returns values
        only (the index: `argmin`). `ShapeError` over an empty axis."""
        return self._reduce("min", axis, keepdim)

    def _count(self, axis: Any) -> builtins.int:
        return prod([self.shape[a] for a in _norm_axes(axis, self.ndim)])

    def _wide(self) -> Tensor:
        """The float tensor to accumulate in: float16 and bfloat16 sum in float32 (as PyTorch does), else a sum of
        70000 ones overflows float16."""
        x = self.cast(least_float(self.dtype))
        return x.float() if x.dtype.itemsize < 4 else x

    @_dims
    def mean(self, axis: Any = None, keepdim: builtins.bool = False) -> Tensor:
        """Mean over `axis` (None: every axis; int or tuple), `keepdim` as in `sum`. dtype: floats keep theirs
        (float16 and bfloat16 accumulate in float32), ints and bool give float32."""
        x = self._wide()
        n = self._count(axis)
        return (x.sum(axis, keepdim) * (1.0 / n if n else math.nan)).cast(least_float(self.dtype))

    @_dims
    def var(self, axis: Any = None, keepdim: builtins.bool = False, correction: builtins.int = 1) -> Tensor:
        """Variance over `axis` (None: every axis) with `correction` (1: the unbiased estimate, PyTorch's default; 0:
        numpy's); `keepdim` as in `sum`; float dtype as in `mean`. nan where fewer than correction + 1 elements."""
        x = self._wide()
        n = self._count(axis)
        sq = (x - x.mean(axis, keepdim=True)).square().sum(axis, keepdim)
        return (sq * (1.0 / max(n - correction, 0) if n - correction > 0 else math.nan)).cast(least_float(self.dtype))

    @_dims
    def std(self, axis: Any = None, keepdim: builtins.bool = False, correction: builtins.int = 1) -> Tensor:
        """Standard deviation: `var(axis, keepdim, correction).sqrt()`."""
        return self.var(axis, keepdim, correction).sqrt()

    def _arg_extreme(self, axis: Any, keepdim: builtins.bool, op: str) -> Tensor:
        if axis is None:
            return self.flatten()._arg_extreme(0, keepdim=False, op=op) if not keepdim else \
                self.flatten()._arg_extreme(0, False, op).reshape((1,) * self.ndim)
        a = _norm_axis(axis, self.ndim)
        n = self.shape[a]
        if n == 0:
            raise ShapeError(f"arg{op} over an empty axis of shape {self.shape}")
        m = self._reduce(op, a, keepdim=True)
        rev = self._placed_like(Tensor.arange(n, 0, -1, device=self.device)).reshape((n,) + (1,) * (self.ndim - a - 1))
        is_m = (self == m) | (self != self) if self.dtype.is_float else self == m  # a NaN is the extreme (numpy)
        hit = Tensor.where(is_m, rev, 0)
        return (n - hit.max(a, keepdim)).cast(dtypes.int32)

    @_dims
    def argmax(self, axis: builtins.int | None = None, keepdim: builtins.bool = False) -> Tensor:
        """int32 index of the largest element along `axis` (None: of the flattened tensor), the first on ties; a NaN
        counts as the largest (numpy). `keepdim` as in `sum`.

        >>> Tensor([[1, 9, 9], [4, 2, 0]]).argmax(axis=1).numpy_sync().tolist()
        [1, 0]"""
        return self._arg_extreme(axis, keepdim, "max")

    @_dims
    def argmin(self, axis: builtins.int | None = None, keepdim: builtins.bool = False) -> Tensor:
        """int32 index of the smallest element along `axis` (None: of the flattened tensor), the first on ties;
        `keepdim` as in `sum`."""
        return self._arg_extreme(axis, keepdim, "min")

    @_dims
    def logsumexp(self, axis: Any = None, keepdim: builtins.bool = False) -> Tensor:
        """log(sum(exp(x))) over `axis` (None: every axis), computed stably (the maximum taken out first); `keepdim`
        as in `sum`; float dtype as in `mean`."""
        x = self._wide()
        m = x.max(axis, keepdim=True)
        m = Tensor.where(m.abs() == math.inf, 0.0, m)
        out = ((x - m).exp().sum(axis, keepdim=True).log() + m).cast(least_float(self.dtype))
        return out if keepdim else out.squeeze(_norm_axes(axis, self.ndim) or None) if self.ndim else out

    @_dims
    def softmax(self, axis: builtins.int = -1) -> Tensor:
        """exp(x) / sum(exp(x)) along `axis` (default -1, an int), computed stably; same shape, float dtype (float16
        and bfloat16 computed in float32 and rounded once).

        >>> [round(v, 4) for v in Tensor([1.0, 2.0, 3.0]).softmax().numpy_sync().tolist()]
        [0.09, 0.2447, 0.6652]"""
        x = self._wide()
        e = (x - x.max(axis, keepdim=True)).exp()
        return (e / e.sum(axis, keepdim=True)).cast(least_float(self.dtype))

    @_dims
    def log_softmax(self, axis: builtins.int = -1) -> Tensor:
        """log(softmax(x)) along `axis` (default -1), computed stably as x - max - log(sum(exp(x - max))); float
        dtype."""
        x = self._wide()
        s = x - x.max(axis, keepdim=True)
        return (s - s.exp().sum(axis, keepdim=True).log()).cast(least_float(self.dtype))

    # ---------------------------------------------------------------- linear algebra, nn
    def matmul(self, other: Tensor) -> Tensor:
        """Matrix product with numpy's rules (1-D operands, broadcast batch dims), as a fused multiply-reduce."""
        if type(other) is Tensor:
            na, nb = _nodes[self.id], _nodes[other.id]
            assert na is not None and nb is not None
            if (len(na.shape) == 2 and len(nb.shape) == 2 and na.shape[1] == nb.shape[0] and na.dtype is nb.dtype
                    and not na.dtype.is_bool and na.device == nb.device and na.pinned == nb.pinned
                    and na.op is not Op.CONST and nb.op is not Op.CONST):
                return self._matmul_2d(other, na, nb)  # the common case: the nodes below, without the general checks
        a, b = self, self._operand(other)
        if a.ndim == 0 or b.ndim == 0:
            raise ShapeError(f"matmul needs at least 1-D operands, got shapes {a.shape} and {b.shape}")
        a1, b1 = a.ndim == 1, b.ndim == 1
        if a1:
            a = a.reshape(1, a.shape[0])
        if b1:
            b = b.reshape(b.shape[0], 1)
        if a.shape[-1] != b.shape[-2]:
            raise ShapeError(f"matmul shapes {self.shape} and {other.shape}: inner dimensions "
                             f"{a.shape[-1]} and {b.shape[-2]} differ")
        try:
            batch = broadcast_shapes(a.shape[:-2], b.shape[:-2])
        except ShapeError:
            raise ShapeError(f"matmul shapes {self.shape} and {other.shape}: batch dimensions cannot be broadcast"
                             ) from None
        m, k, n = a.shape[-2], a.shape[-1], b.shape[-1]
        dt = promote(a.dtype, b.dtype)
        if dt.is_bool:
            dt = dtypes.int32
        x = a.cast(dt).reshape(a.shape[:-2] + (m, 1, k))
        y = b.cast(dt).transpose(-1, -2).reshape(b.shape[:-2] + (1, n, k))
        out = (x * y).sum(axis=-1)
        if batch and out.shape[:-2] != batch:
            out = out._broadcast_to(batch + (m, n))
        if a1:
            out = out.squeeze(-2)
        if b1:
            out = out.squeeze(-1)
        return out

    def _matmul_2d(self, other: Tensor, na: Node, nb: Node) -> Tensor:
        """(m, k) @ (k, n) of one dtype and device: the same nodes the general path builds for it."""
        (m, k), n = na.shape, nb.shape[1]
        x = self._reshaped((m, 1, k))
        y = other.permute(1, 0)._reshaped((1, n, k))
        prod3 = x._broadcast_to((m, n, k)) * y._broadcast_to((m, n, k))
        return prod3._new(Op.REDUCE, (prod3.id,), ("sum", (2,)), (m, n, 1), na.dtype)._reshaped((m, n))

    def dot(self, other: Tensor) -> Tensor:
        """`matmul(other)` (for 1-D operands, the inner product as a 0-d tensor)."""
        return self.matmul(other)

    def _windows(self, axis: builtins.int, k: builtins.int) -> Tensor:
        """Replace `axis` (size n) by (n-k+1, k) sliding windows, with index arithmetic only."""
        n = self.shape[axis]
        o = n - k + 1
        x = self.moveaxis(axis, -1)
        pre = x.shape[:-1]
        x = x.unsqueeze(-2).expand(*pre, k, n).reshape(*pre, k * n)
        x = x.pad(((0, 0),) * len(pre) + ((0, k),)).reshape(*pre, k, n + 1)[..., :o]
        x = x.transpose(-1, -2)  # (*pre, o, k)
        p = len(pre)
        return x.permute(*range(axis), p, p + 1, *range(axis, p))

    def conv2d(self, weight: Tensor, bias: Tensor | None = None,
               stride: builtins.int | tuple[builtins.int, builtins.int] = 1,
               padding: builtins.int | tuple[builtins.int, builtins.int] = 0) -> Tensor:
        """2-D convolution (cross-correlation, like PyTorch) of (N, C, H, W) with (O, C, KH, KW)."""
        if self.ndim != 4 or weight.ndim != 4:
            raise ShapeError(f"conv2d needs (N, C, H, W) input and (O, C, KH, KW) weight, got {self.shape} and "
                             f"{weight.shape}")
        sh, sw = (stride, stride) if isinstance(stride, int) else stride
        ph, pw = (padding, padding) if isinstance(padding, int) else padding
        nb, c, h, w = self.shape
        o, wc, kh, kw = weight.shape
        if wc != c:
            raise ShapeError(f"conv2d input has {c} channels but weight {weight.shape} expects {wc}")
        if h + 2 * ph < kh or w + 2 * pw < kw:
            raise ShapeError(f"conv2d kernel {(kh, kw)} is larger than the padded input {(h + 2 * ph, w + 2 * pw)}")
        x = self.pad(((0, 0), (0, 0), (ph, ph), (pw, pw)))
        x = x._windows(2, kh)._windows(4, kw)  # (N, C, OH1, KH, OW1, KW)
        if sh > 1:
            x = x._stride(2, sh)
        if sw > 1:
            x = x._stride(4, sw)
        oh, ow = x.shape[2], x.shape[4]
        x = x.permute(0, 2, 4, 1, 3, 5).reshape(nb, 1, oh, ow, c * kh * kw)
        wt = weight.reshape(1, o, 1, 1, c * kh * kw)
        out = (x * wt).sum(axis=-1)
        if bias is not None:
            out = out + bias.reshape(1, o, 1, 1)
        return out

    def _pool(self, k: builtins.int, op: str) -> Tensor:
        if self.ndim < 2:
            raise ShapeError(f"pooling needs at least 2 dimensions, got shape {self.shape}")
        if k <= 0:
            raise ShapeError(f"pool size must be positive, got {k}")
        *pre, h, w = self.shape
        oh, ow = h // k, w // k
        x = self._shrink([(0, s) for s in pre] + [(0, oh * k), (0, ow * k)])
        x = x.reshape(*pre, oh, k, ow, k)
        nd = len(pre)
        return x.max(axis=(nd + 1, nd + 3)) if op == "max" else x.mean(axis=(nd + 1, nd + 3))

    def max_pool2d(self, k: builtins.int = 2) -> Tensor:
        """Maximum over non-overlapping k x k windows of the last two axes (stride k; rows and columns past a whole
        window dropped); leading axes kept."""
        return self._pool(k, "max")

    def avg_pool2d(self, k: builtins.int = 2) -> Tensor:
        """Mean over non-overlapping k x k windows of the last two axes (stride k; rows and columns past a whole
        window dropped); leading axes kept."""
        return self._pool(k, "mean")

    @_dims
    def layernorm(self, axis: builtins.int | Sequence[builtins.int] = -1, eps: builtins.float = 1e-5) -> Tensor:
        """(x - mean) / sqrt(var + eps) over `axis` (default -1; an int or a tuple), variance without correction; no
        scale or shift (`nn.LayerNorm` adds them); float dtype."""
        x = self.cast(least_float(self.dtype))
        y = x - x.mean(axis, keepdim=True)
        return y * (y.square().mean(axis, keepdim=True) + eps).rsqrt()

    def one_hot(self, num_classes: builtins.int) -> Tensor:
        """int32 tensor of shape `self.shape + (num_classes,)`: 1 at each element's class, 0 elsewhere (`DTypeError`
        for a float tensor). A class outside [-num_classes, num_classes) raises IndexOutOfRange when realized (a
        negative one counts from the end, as an index does)."""
        if self.dtype.is_float:
            raise DTypeError(f"one_hot needs an integer tensor, got {self.dtype.name}")
        classes = self._placed_like(Tensor.arange(num_classes, device=self.device))
        return (classes._checked_classes(self).unsqueeze(-1) == classes).cast(dtypes.int32)

    def _checked_classes(self, index: Tensor) -> Tensor:
        """`self` (an arange) read at integer tensor `index`: the index's own values, but an index out of range
        raises IndexOutOfRange when the kernel runs (the gather's check) instead of matching no class."""
        return self._take(0, index)

    def dropout(self, p: builtins.float = 0.5) -> Tensor:
        """In training mode (`azyx.train()`), each element zeroed with probability `p` (default 0.5) and the rest
        scaled by 1/(1-p); otherwise this tensor unchanged. Same dtype."""
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"dropout probability must be in [0, 1], got {p}")
        if not Tensor.training or p == 0.0:
            return self
        if p == 1.0:
            return self * 0
        keep = self._placed_like(Tensor.rand(*self.shape, device=self.device)) >= p
        return Tensor.where(keep, self * (1.0 / (1.0 - p)), 0).cast(self.dtype)

    # ---------------------------------------------------------------- rebinding
    def assign(self, other: Any) -> Tensor:
        """Rebind this handle to `other` (same shape and dtype; the same device where this handle's device was
        asked for, else it goes where `other` is, as automatically placed tensors do); returns self. Lazy and
        functional: the old value is not overwritten, other handles to it keep it, and it is freed when nothing needs
        it. This is how an optimiser step updates parameters in place of the model's handles.

        >>> w = Tensor([1.0, 2.0])
        >>> w.assign(w * 2 + 1).numpy_sync().tolist()
        [3.0, 5.0]
        """
        n = self._node
        if not isinstance(other, Tensor):
            other = Tensor(other, dtype=n.dtype, device=n.device)
        o = other._node
        if o.shape != n.shape:
            raise ShapeError(f"assign of a tensor of shape {o.shape} to one of shape {n.shape}")
        if o.dtype is not n.dtype:
            raise DTypeError(f"assign of a {o.dtype.name} tensor to a {n.dtype.name} one; cast it first")
        if o.device != n.device and n.pinned:  # (a handle placed automatically goes where its new value is)
            raise DeviceError(f"assign of a tensor on {o.device} to one on {n.device}; move it with .to() first")
        self._rebind(other)
        return self

    def _rebind(self, other: Tensor) -> None:
        if other.id != self.id:
            if Tensor.tracer is not None:
                Tensor.tracer.rebinding(self)
            GRAPH.retain(other.id)
            old, self.id = self.id, other.id
            GRAPH.release(old)

    def __setitem__(self, key: Any, value: Any) -> None:
        """In-place update of a view, PyTorch's `t[key] = value`: ints, slices (with steps), None, Ellipsis, 0-d
        integer tensors, or one integer tensor index; `value` (a scalar or a tensor, cast to self's dtype) broadcasts
        to the view. This handle then reads the updated tensor. When realized, the kernel writes only the view, into
        the tensor's own buffer where nothing else holds the old value (else into a copy, which the holders do not
        see). A Python int position is a runtime value: a KV cache written at step after step runs one plan.

        >>> cache = Tensor.zeros(3, 2)
        >>> for step in range(3):
        ...     cache[step] = Tensor([1.0, 2.0]) * step
        >>> cache.numpy_sync().tolist()
        [[0.0, 0.0], [1.0, 2.0], [2.0, 4.0]]
        """
        self._rebind(self._assigned(key, value))

    def _assigned(self, key: Any, value: Any) -> Tensor:
        """self with the view `key` replaced by `value` (the ASSIGN node; see __setitem__)."""
        shape = self.shape
        entries: list[tuple] = []  # per entry of the key: ("new",), ("slice", start, step, n), ("at" | "index", pos)
        positions: list[Tensor] = []
        for k, dim in _key_axes(key if isinstance(key, tuple) else (key,), shape):
            if dim is None:
                entries.append(("new",))
                continue
            n = shape[dim]
            if isinstance(k, slice):
                start, _, step = k.indices(n)
                entries.append(("slice", start, step, len(range(*k.indices(n)))))
            elif isinstance(k, int | np.integer) and not isinstance(k, bool):
                if not -n <= k < n:
                    raise IndexOutOfRange(f"index {k} is out of range for axis {dim} of size {n}")
                entries.append(("at", len(positions)))
                pos = builtins.int(k) if isinstance(k, np.integer) else k  # (a traced int stays traced: azyx.jit)
                positions.append(self._const_like(pos % n, shape=(), dtype=dtypes.int32))
            elif isinstance(k, Tensor) and not k.shape:
                entries.append(("at", len(positions)))
                positions.append(self._rows(dim, k))
            elif isinstance(k, Tensor | list | np.ndarray):
                entries.append(("index", len(positions)))
                positions.append(self._rows(dim, k))
            else:
                raise IndexOutOfRange(f"unsupported index {k!r}")
        axes, region = _assign_axes(entries, positions, key)
        if isinstance(value, Tensor):
            v = value
        elif isinstance(value, builtins.bool | builtins.int | builtins.float | np.generic):
            v = self._const_like(value.item() if isinstance(value, np.generic) else value, shape=())
        else:
            v = Tensor(value, device=self.device)
        try:
            fits = broadcast_shapes(v.shape, tuple(region)) == tuple(region)
        except ShapeError:
            fits = False
        if not fits:
            raise ShapeError(f"cannot assign a tensor of shape {v.shape} to a view of shape {tuple(region)}")
        v = v.cast(self.dtype)._broadcast_to(tuple(region))
        if v.device != self.device:
            raise DeviceError(f"assignment of a tensor on {v.device} into one on {self.device}; move it with .to()")
        return self._assign_node(v, positions, (tuple(axes), tuple(region)))

    def _assign_node(self, value: Tensor, positions: Sequence[Tensor], arg: tuple) -> Tensor:
        na = self._node
        return Tensor._from_node(Node(Op.ASSIGN, (self.id, value.id, *(p.id for p in positions)), arg, na.shape,
                                      na.dtype, na.device, na.pinned))

    def _region(self, arg: tuple, positions: Sequence[Tensor]) -> Tensor:
        """The view of self that ASSIGN's `arg` writes, as a tensor of the region's shape (the value's gradient)."""
        axes, region = arg
        if sum(ax[0] == "index" for ax in axes) > 1:  # broadcast together (_assign_axes): numpy's gather of them
            key = [positions[ax[1]] if ax[0] == "index" else
                   slice(ax[1], ax[1] + ax[2] * region[ax[3]] if ax[1] + ax[2] * region[ax[3]] >= 0 else None, ax[2])
                   for ax in axes]
            return self[tuple(key)].reshape(region)
        x = self
        for d in reversed(range(len(axes))):  # last axis first: the axes before it keep their numbers
            ax = axes[d]
            if ax[0] == "slice":
                rows = np.arange(region[ax[3]]) * ax[2] + ax[1]
                x = x._take(d, self._placed_like(Tensor(rows.astype(np.int32), device=self.device)))
            else:
                x = x._take(d, positions[ax[1]])
        return x.reshape(region)

    # ---------------------------------------------------------------- devices
    @_dims
    def shard(self, devices: Sequence[str], axis: builtins.int = 0) -> Any:
        """This tensor split along `axis` into one piece per device (numpy's `array_split` sizes): an
        `azyx.shard.ShardedTensor`, whose ops run where its pieces are."""
        assert Tensor.sharder is not None, "azyx.shard installs Tensor.sharder (imported by azyx)"
        return Tensor.sharder(self, devices, axis)

    def to(self, device: Any = None, dtype: Any = None) -> Tensor:
        """A lazy copy on `device` (the copy runs when realized). PyTorch's habits too: `t.to(dtype)` (a DType, numpy
        dtype or dtype name in the device's place) casts, and `t.to(device, dtype)` does both."""
        if device is not None and _as_dtype(device) is not None:
            device, dtype = None, device
        if dtype is not None:
            return self.cast(dtype) if device is None else self.cast(dtype).to(device)
        return self._moved(RT.check_device(device), None)

    def _readable_on(self, device: str) -> Tensor:
        """`to(device)` for kernels there to read (collectives): where kernels on `device` read this tensor's device's
        memory (C devices sharing it, CUDA peers: azyx.schedule.reads_in_place) they read its buffer in place, with
        no copy; a copy else."""
        return self._moved(RT.check_device(device), READ_IN_PLACE)

    def _moved(self, name: str, how: str | None) -> Tensor:
        n = self._node
        if name == n.device:
            return self
        if n.op is Op.CONST:
            return Tensor._const(n.arg, n.shape, n.dtype, name, True)
        return Tensor._from_node(Node(Op.TODEVICE, (self.id,), how, n.shape, n.dtype, name, True))


    # ---------------------------------------------------------------- habits numpy and PyTorch users bring (issue 36)
    # Reading a realized tensor's values without awaiting (np.asarray, repr, float/int/bool), `await t`, dtype
    # shorthands, clone/detach. A lazy tensor never blocks: these raise RuntimeStateError naming the awaitable to use.
    __array_ufunc__ = None  # `ndarray + t` is Tensor.__radd__ (numpy would else read t with __array__)

    def __await__(self) -> Generator[Any, None, Tensor]:
        """`await t` realizes `t` and returns it (the same as `await t.realize()`).

        >>> import asyncio
        >>> async def main():
        ...     t = await (Tensor([1.0, 2.0]) * 2)
        ...     return np.asarray(t).tolist()  # (realized: reading it needs no await)
        >>> asyncio.run(main())
        [2.0, 4.0]
        """
        return self.realize().__await__()

    def _values(self, how: str, in_place: builtins.bool = False) -> np.ndarray:
        """The values of a realized tensor whose work has finished, read now (a blocking read of the device's memory).
        A lazy tensor, or one whose work is still running, raises RuntimeStateError naming `how`, the awaitable to
        use instead: nothing here waits for work. `in_place`: where it is host memory, a read-only view of it (no
        copy; bfloat16 is copied, widened)."""
        n = self._node
        if n.buffer is None or n.view is None:
            raise RuntimeStateError(f"the values of a lazy tensor (shape {n.shape}, {n.dtype.name}, {n.device}) are "
                                    f"unknown until it is realized; use `{how}` (or `await t` first)")
        buf = buffer_of(n)
        if not _done([buf]):
            raise RuntimeStateError(f"the tensor (shape {n.shape}, {n.dtype.name}, {n.device}) is still being "
                                    f"computed; use `{how}`")
        if in_place and buf.device.host_memory and n.dtype is not dtypes.bfloat16:
            return host_view(buf.mem, n.view, n.shape, n.dtype)
        return buf.device.read(buf, n.view, n.shape, n.dtype)

    def __array__(self, dtype: Any = None, copy: builtins.bool | None = None) -> np.ndarray:
        """`np.asarray(t)` of a realized tensor: its values (a new array). A lazy tensor raises
        `RuntimeStateError` naming `await t.numpy()`: numpy cannot await.

        >>> import numpy as np
        >>> np.asarray(Tensor([1, 2]).realize_sync()).tolist()
        [1, 2]
        """
        out = self._values("await t.numpy()")
        return out if dtype is None else out.astype(dtype, copy=False)

    def _scalar(self, kind: str) -> Scalar:
        """The one value of a realized one-element tensor (see _values), for float()/int()/bool()/index."""
        if self.numel() != 1:
            raise ShapeError(f"{kind}() needs a tensor of exactly one element, got shape {self.shape}")
        return self._values("await t.item()").reshape(()).item()

    def __iter__(self) -> Iterator[Tensor]:
        """Iterate over the first axis (lazy rows, `t[0]`, `t[1]`, ...), as numpy and PyTorch do. A 0-d tensor
        raises, and so does the result of `max`/`min` given an axis by position (see `_dims_with_indices`)."""
        r = _VALUES_ONLY.get(id(self))
        if r is not None and r() is self:
            raise ArgumentError("x.max(axis)/x.min(axis) with the axis by position is numpy's: the values alone, "
                                "not PyTorch's (values, indices) pair; use `values, indices = x.max(dim=axis)` for "
                                "the pair or `x.max(axis=axis)` for the values")
        if not self.shape:
            raise ShapeError("iteration over a 0-d tensor")
        return (self[i] for i in range(self.shape[0]))

    def __float__(self) -> builtins.float:
        """`float(t)` of a realized one-element tensor; a lazy one raises RuntimeStateError naming `await t.item()`.

        >>> float(Tensor([2.5]).realize_sync())
        2.5
        """
        return builtins.float(self._scalar("float"))

    def __int__(self) -> builtins.int:
        """`int(t)` of a realized one-element tensor (truncated toward zero, as Python's int()); a lazy one raises
        RuntimeStateError naming `await t.item()`.

        >>> int(Tensor([7]).realize_sync())
        7
        """
        return builtins.int(self._scalar("int"))

    def __index__(self) -> builtins.int:
        """A realized one-element integer (or bool) tensor as an index (`range(t)`, `lst[t]`); float tensors raise
        DTypeError, as in PyTorch."""
        if self.dtype.is_float:
            raise DTypeError(f"only integer tensors of one element can be an index, got {self.dtype.name}")
        return builtins.int(self._scalar("index"))

    def __bool__(self) -> builtins.bool:
        """`bool(t)` / `if t:` of a realized one-element tensor; a lazy one raises RuntimeStateError naming
        `await t.item()` (its value is unknown until realized)."""
        return builtins.bool(self._scalar("bool"))

    def __repr__(self) -> str:
        """A realized tensor shows its values in numpy's summarised format; a lazy one its shape, dtype and device."""
        n = self._node
        # (a file-backed tensor is not read for a repr, nor one so large that its summary would read a lot of memory)
        if n.buffer is not None and n.device != DISK and prod(n.shape) <= REPR_MAX_ELEMENTS:
            try:
                # (in place where the tensor is in host memory: numpy's summary reads only what it shows, and
                # Python 3.11's asyncio.run formats its main task's result, the tensors a realize returned, after
                # every run: copies of each, 16 MiB apiece, took a tenth of a 1 GiB load's time)
                values = self._values("await t.numpy()", in_place=True)
            except AzyxError:  # still computing (or its work failed: the realize that awaits it says so)
                values = None
            if values is not None:
                text = np.array2string(values, separator=", ", prefix="Tensor(")
                return f"Tensor({text}, dtype={n.dtype.name}, device={n.device!r})"
        state = "realized" if n.buffer is not None else "lazy"
        return f"<Tensor {state} shape={n.shape} dtype={n.dtype.name} device={n.device}>"

    def clone(self) -> Tensor:
        """A new handle with this tensor's value (lazy, no copy is made: azyx's tensors are values, and an in-place
        update `t[i] = v` or `assign` rebinds one handle only). Gradients flow through it. Same dtype and device.

        >>> a = Tensor([1.0, 2.0]); b = a.clone(); b[0] = 5.0
        >>> a.numpy_sync().tolist(), b.numpy_sync().tolist()
        ([1.0, 2.0], [5.0, 2.0])
        """
        return Tensor._wrap(self.id)

    def detach(self) -> Tensor:
        """This tensor's value as a new node no GradientTape records: gradients do not flow through it (PyTorch's
        `detach`). Lazy; same shape, dtype and device.

        >>> from azyx import GradientTape
        >>> x = Tensor([3.0])
        >>> with GradientTape() as tape:
        ...     y = (x * x.detach()).sum()
        >>> tape.gradient(y, x).numpy_sync().tolist()
        [3.0]
        """
        n = self._node
        saved, GRAPH.recording = GRAPH.recording, []
        try:
            return Tensor._from_node(Node(Op.RESHAPE, (self.id,), n.shape, n.shape, n.dtype, n.device, n.pinned))
        finally:
            GRAPH.recording = saved

    @staticmethod
    def empty(*shape: Any, dtype: Any = None, device: str | None = None) -> Tensor:
        """A tensor of `shape` whose values the caller will overwrite (PyTorch's `empty`). azyx has no uninitialised
        memory: it is `Tensor.zeros` (dtype: float32 unless given; device: AUTO unless given). Lazy.

        >>> Tensor.empty(2, 3).shape
        (2, 3)
        """
        return Tensor.zeros(*shape, dtype=dtype, device=device)

    def long(self) -> Tensor:
        """`cast(int64)` (PyTorch's shorthand). Lazy, same device."""
        return self.cast(dtypes.int64)

    def double(self) -> Tensor:
        """`cast(float64)` (PyTorch's shorthand). Lazy, same device."""
        return self.cast(dtypes.float64)

    def bfloat16(self) -> Tensor:
        """`cast(bfloat16)` (PyTorch's shorthand). Lazy, same device."""
        return self.cast(dtypes.bfloat16)

    def short(self) -> Tensor:
        """`cast(int16)` (PyTorch's shorthand). Lazy, same device."""
        return self.cast(dtypes.int16)

    def char(self) -> Tensor:
        """`cast(int8)` (PyTorch's shorthand). Lazy, same device."""
        return self.cast(dtypes.int8)

    def byte(self) -> Tensor:
        """`cast(uint8)` (PyTorch's shorthand). Lazy, same device."""
        return self.cast(dtypes.uint8)

    # ---------------------------------------------------------------- ops PyTorch users reach for (issue 36)
    # Each is composed of the graph's own ops (elementwise, reduce, movement, gather), so its gradient is theirs
    # (ops.py's and autograd.py's rules, next to those ops' forwards): none of these adds a node kind or a rule. Int and
    # bool results carry no gradient.
    def _helper(self, arr: np.ndarray) -> Tensor:
        """A small constant array an op needs (an arange, a mask) as a tensor placed like self (AUTO for a tensor on
        disk: the disk computes nothing)."""
        return self._placed_like(Tensor(arr, device=None if self.device == DISK else self.device))

    def isnan(self) -> Tensor:
        """Elementwise: whether the value is NaN (bool, same shape and device; all False for int and bool tensors).

        >>> Tensor([1.0, float("nan")]).isnan().numpy_sync().tolist()
        [False, True]
        """
        return self != self if self.dtype.is_float else self._const_like(False, dtype=dtypes.bool)

    def isinf(self) -> Tensor:
        """Elementwise: whether the value is +inf or -inf (bool, same shape and device).

        >>> Tensor([1.0, float("-inf")]).isinf().numpy_sync().tolist()
        [False, True]
        """
        return self.abs() == math.inf if self.dtype.is_float else self._const_like(False, dtype=dtypes.bool)

    def isfinite(self) -> Tensor:
        """Elementwise: whether the value is neither NaN nor infinite (bool, same shape and device).

        >>> Tensor([1.0, float("nan"), float("inf")]).isfinite().numpy_sync().tolist()
        [True, False, False]
        """
        return self.abs() < math.inf if self.dtype.is_float else self._const_like(True, dtype=dtypes.bool)

    def _truth_reduce(self, op: str, axis: Any, keepdim: builtins.bool) -> Tensor:
        """any (op "max") / all (op "min") of `self != 0` over `axis`: bool."""
        x = self if self.dtype.is_bool else self != 0
        axes = _norm_axes(axis, self.ndim)
        if any(self.shape[a] == 0 for a in axes):  # an empty axis: any is False, all is True (the identities)
            shape = tuple(1 if i in axes else s for i, s in enumerate(self.shape)) if keepdim else \
                tuple(s for i, s in enumerate(self.shape) if i not in axes)
            return self._const_like(op == "min", shape=shape, dtype=dtypes.bool)
        return x._reduce(op, axis, keepdim)

    @_dims
    def any(self, axis: Any = None, keepdim: builtins.bool = False) -> Tensor:
        """Whether any element along `axis` (int, tuple or None: all; also `dim=`) is nonzero/True: a bool tensor
        on this device (`keepdim`/`keepdims` keeps the reduced axes as size 1). An empty axis gives False.

        >>> Tensor([[0, 1], [0, 0]]).any(dim=1).numpy_sync().tolist()
        [True, False]
        """
        return self._truth_reduce("max", axis, keepdim)

    @_dims
    def all(self, axis: Any = None, keepdim: builtins.bool = False) -> Tensor:
        """Whether every element along `axis` (int, tuple or None: all; also `dim=`) is nonzero/True: a bool tensor
        on this device (`keepdim`/`keepdims` keeps the reduced axes as size 1). An empty axis gives True.

        >>> Tensor([[1, 1], [0, 1]]).all(axis=1).numpy_sync().tolist()
        [True, False]
        """
        return self._truth_reduce("min", axis, keepdim)

    def masked_fill(self, mask: Tensor, value: Any) -> Tensor:
        """`value` where the bool `mask` (broadcast to this tensor's shape) is True, this tensor elsewhere
        (PyTorch's `masked_fill`; the functional form, `t[mask] = v` is not supported). Same dtype, shape and device;
        gradient flows to this tensor where the mask is False.

        >>> Tensor([1.0, 2.0, 3.0]).masked_fill(Tensor([True, False, True]), 0.0).numpy_sync().tolist()
        [0.0, 2.0, 0.0]
        """
        if not isinstance(mask, Tensor) or not mask.dtype.is_bool:
            got = mask.dtype.name if isinstance(mask, Tensor) else type(mask).__name__
            raise DTypeError(f"masked_fill needs a bool mask tensor, got {got}")
        if broadcast_shapes(mask.shape, self.shape) != self.shape:
            raise ShapeError(f"masked_fill mask of shape {mask.shape} does not broadcast to {self.shape}")
        return Tensor.where(mask, value, self).cast(self.dtype)

    def _triangle(self, diagonal: builtins.int, lower: builtins.bool) -> Tensor:
        if self.ndim < 2:
            raise ShapeError(f"tril/triu need at least 2 dimensions, got shape {self.shape}")
        h, w = self.shape[-2:]
        rows = self._helper(np.arange(h, dtype=np.int32)).reshape(h, 1)
        cols = self._helper(np.arange(w, dtype=np.int32))
        keep = (cols - rows <= diagonal) if lower else (cols - rows >= diagonal)
        return Tensor.where(keep, self, self._const_like(0, shape=())).cast(self.dtype)

    def tril(self, diagonal: builtins.int = 0) -> Tensor:
        """The lower triangle of the last two axes (elements with column - row <= `diagonal`), zeros above it
        (PyTorch's/numpy's `tril`). Same dtype, shape and device.

        >>> Tensor([[1, 2], [3, 4]]).tril().numpy_sync().tolist()
        [[1, 0], [3, 4]]
        """
        return self._triangle(diagonal, True)

    def triu(self, diagonal: builtins.int = 0) -> Tensor:
        """The upper triangle of the last two axes (elements with column - row >= `diagonal`), zeros below it
        (PyTorch's/numpy's `triu`). Same dtype, shape and device.

        >>> Tensor([[1, 2], [3, 4]]).triu(1).numpy_sync().tolist()
        [[0, 2], [0, 0]]
        """
        return self._triangle(diagonal, False)

    @_dims
    def norm(self, p: Any = 2, axis: Any = None, keepdim: builtins.bool = False) -> Tensor:
        """The vector p-norm over `axis` (None: every element, as one vector; also `dim=`): `p` = 2 or "fro"
        (Euclidean), 1, any positive number, `math.inf` (max |x|), `-math.inf` (min |x|), or 0 (count of nonzeros).
        Float result (float16/bfloat16 accumulate in float32), on this device. The gradient at an all-zero vector is 0,
        as PyTorch's.

        >>> Tensor([3.0, 4.0]).norm().numpy_sync().item()
        5.0
        """
        out_dt = least_float(self.dtype)
        x = self._wide()

        def root(total: Tensor, q: builtins.float) -> Tensor:
            """total ** (1 / q), 0 at 0 with gradient 0 there (PyTorch's subgradient of a norm at a zero vector)."""
            zero = total == 0
            safe = Tensor.where(zero, 1.0, total)
            return Tensor.where(zero, 0.0, safe.sqrt() if q == 2 else safe ** (1.0 / q))

        if p == "fro" or p == 2:
            r = root(x.square().sum(axis, keepdim), 2)
        elif p == 1:
            r = x.abs().sum(axis, keepdim)
        elif p == math.inf or p == -math.inf:
            r = x.abs()._reduce("max" if p > 0 else "min", axis, keepdim)
        elif p == 0:
            r = (x != 0).cast(x.dtype).sum(axis, keepdim)
        elif isinstance(p, int | builtins.float) and not isinstance(p, builtins.bool) and p > 0:
            r = root((x.abs() ** builtins.float(p)).sum(axis, keepdim), p)
        else:
            raise ArgumentError(f"norm order p must be 'fro', a positive number, 0 or +-inf, got {p!r}")
        return r.cast(out_dt)

    def _scan(self, axis: Any, op: str) -> Tensor:
        """An inclusive scan (op "add": cumsum, "mul": cumprod) along `axis` (None: the flattened tensor) in
        ceil(log2 n) steps, each one kernel adding (multiplying) the running result shifted by 1, 2, 4, ... elements
        (Hillis-Steele): O(n log n) work, never an n x n product."""
        x = self.flatten() if axis is None else self
        if x.dtype.is_bool:
            x = x.cast(dtypes.int32)  # (PyTorch: bool and ints sum in int64; here in int32, like sum)
        narrow = x.dtype.is_float and x.dtype.itemsize < 4
        out_dt = x.dtype
        if narrow:
            x = x.float()
        a = _norm_axis(0 if axis is None else axis, x.ndim)
        n = x.shape[a] if x.ndim else 1
        fill = 0 if op == "add" else 1
        shift = 1
        while shift < n:
            moved = x.pad(tuple((shift, -shift) if d == a else (0, 0) for d in range(x.ndim)), value=fill)
            x = (x + moved if op == "add" else x * moved)._own_kernel()
            shift *= 2
        return x.cast(out_dt) if narrow else x

    @_dims
    def cumsum(self, axis: Any = None) -> Tensor:
        """Running sum along `axis` (also `dim=`; None: over the flattened tensor, like numpy). Same dtype (bool
        becomes int32), shape and device; float16/bfloat16 accumulate in float32. A scan of ceil(log2 n) kernels.

        >>> Tensor([1, 2, 3, 4]).cumsum(0).numpy_sync().tolist()
        [1, 3, 6, 10]
        """
        return self._scan(axis, "add")

    @_dims
    def cumprod(self, axis: Any = None) -> Tensor:
        """Running product along `axis` (also `dim=`; None: over the flattened tensor, like numpy). Same dtype (bool
        becomes int32), shape and device; the gradient is exact with zeros in the input.

        >>> Tensor([1.0, 2.0, 3.0]).cumprod(dim=0).numpy_sync().tolist()
        [1.0, 2.0, 6.0]
        """
        return self._scan(axis, "mul")

    def _own_kernel(self) -> Tensor:
        """Self's values computed by a kernel of their own (a sum over a new size-1 axis: a reduce read by several
        consumers gets its own buffer), for a step of a scan or a sorting network: each step reads the previous one
        at two index maps, and without the boundary the scheduler would fuse a chain of earlier steps into each."""
        return self.reshape(self.shape + (1,))._reduce("sum", self.ndim, False)

    def _sort_order(self, axis: builtins.int, descending: builtins.bool) -> Tensor:
        """The indices (int32) that sort self along `axis`: a bitonic sorting network over the axis padded to a power
        of two m, built from the graph's own ops. Each of its log2(m)(log2(m)+1)/2 stages is one kernel: every element
        reads its partner's index (a flip of the running order within a block), both values at those indices (two
        gathers of the input), and keeps its own or takes the partner's. The comparison orders (value, index) pairs,
        so the sort is stable; NaN sorts above every number (last ascending, first descending, as PyTorch); the padding
        sorts after everything."""
        a = _norm_axis(axis, self.ndim)
        x = self.moveaxis(a, -1)
        pre, n = x.shape[:-1], x.shape[-1]
        b = prod(pre)
        x = x.reshape(b, n)
        if x.dtype.is_bool:
            x = x.cast(dtypes.int32)
        m = 1 << max(0, (n - 1).bit_length())
        x = x.pad(((0, 0), (0, m - n)))
        order = self._helper(np.arange(m, dtype=np.int32))
        order = order.reshape(1, m)._broadcast_to((b, m))
        is_float = x.dtype.is_float

        def before(va: Tensor, ia: Tensor, vb: Tensor, ib: Tensor) -> Tensor:
            """Whether (va, ia) sorts before (vb, ib)."""
            ahead = va > vb if descending else va < vb
            same = va == vb
            if is_float:
                na, nb = va != va, vb != vb
                ahead = ahead | ((na & ~nb) if descending else (nb & ~na))
                same = same | (na & nb)
            return (ia < n) & ((ib >= n) | ahead | (same & (ia < ib)))

        def stage(cur: Tensor, block: builtins.int, flip_axis: builtins.int, lo: np.ndarray) -> Tensor:
            """One compare-exchange stage over pairs within blocks of `block` elements: an element's partner is its
            mirror along `flip_axis` of the (b, m / block, *lo.shape) view; `lo` tells a pair's first element."""
            shape = (b, m // block) + lo.shape
            im, io = cur, cur.reshape(shape).flip(flip_axis).reshape(b, m)  # each element's partner's index
            vm, vo = x.gather(1, im), x.gather(1, io)
            first = self._helper(lo)  # whether this element is its pair's first
            first_m = first.reshape((1, 1) + lo.shape)._broadcast_to(shape).reshape(b, m)
            take = Tensor.where(first_m, before(vo, io, vm, im), before(vm, im, vo, io))
            return Tensor.where(take, io, im)._own_kernel()

        k = 2
        while k <= m:  # merge sorted runs of k/2 into runs of k: a flip stage, then half-cleaners of k/4 ... 1
            order = stage(order, k, 2, np.arange(k) < k // 2)
            j = k // 4
            while j >= 1:
                order = stage(order, 2 * j, 2, np.array([[True] * j, [False] * j]))
                j //= 2
            k *= 2
        order = order._shrink(((0, b), (0, n))).reshape(pre + (n,))
        return order.moveaxis(-1, a)

    @_dims
    def sort(self, axis: builtins.int = -1, descending: builtins.bool = False,
             stable: builtins.bool = True) -> ValuesIndices:
        """Sort along `axis` (also `dim=`; default the last): a `ValuesIndices` (values, indices) pair like PyTorch's
        `sort`; values of this dtype, indices int32 (like argmax), both on this device. Stable (equal values keep
        their order, in both directions); NaN sorts above every number (last ascending, first with `descending`), as
        in PyTorch (`stable` is accepted for PyTorch's signature: the sort is always stable). A bitonic sorting
        network in the graph (one kernel a stage, about log2(n)^2 / 2 of them), no host round trip; the values'
        gradient flows back to the positions they came from.

        >>> values, indices = Tensor([3.0, 1.0, 2.0]).sort()
        >>> values.numpy_sync().tolist(), indices.numpy_sync().tolist()
        ([1.0, 2.0, 3.0], [1, 2, 0])
        """
        if not self.ndim:
            return ValuesIndices(self, self._const_like(0, dtype=dtypes.int32))
        order = self._sort_order(axis, descending)
        return ValuesIndices(self.gather(axis, order), order)

    @_dims
    def argsort(self, axis: builtins.int = -1, descending: builtins.bool = False,
                stable: builtins.bool = True) -> Tensor:
        """The int32 indices that sort this tensor along `axis` (also `dim=`; default the last), always stable, NaN
        last (first with `descending`); on this device. See `sort`.

        >>> Tensor([3, 1, 2]).argsort(descending=True).numpy_sync().tolist()
        [0, 2, 1]
        """
        if not self.ndim:
            return self._const_like(0, dtype=dtypes.int32)
        return self._sort_order(axis, descending)

    @_dims
    def topk(self, k: builtins.int, axis: builtins.int = -1, largest: builtins.bool = True,
             sorted: builtins.bool = True) -> ValuesIndices:
        """The `k` largest (smallest with `largest=False`) elements along `axis` (also `dim=`; default the last): a
        `ValuesIndices` pair like PyTorch's `topk`, values of this dtype and int32 indices on this device, in sorted
        order (also with `sorted=False`); ties keep the lower index first. Built on `sort`; the values' gradient flows
        back to where they came from.

        >>> Tensor([1.0, 5.0, 3.0, 4.0]).topk(2).indices.numpy_sync().tolist()
        [1, 3]
        """
        n = self.shape[_norm_axis(axis, self.ndim)] if self.ndim else 1
        if not 0 <= k <= n:
            raise ArgumentError(f"topk k={k} is out of range for an axis of size {n}")
        if not self.ndim:
            return self.sort()
        a = _norm_axis(axis, self.ndim)
        order = self._sort_order(a, largest)
        order = order._shrink([(0, k) if d == a else (0, s) for d, s in enumerate(order.shape)])
        return ValuesIndices(self.gather(a, order), order)

    @staticmethod
    def einsum(subscripts: str, *operands: Any) -> Tensor:
        """Einstein summation (numpy's/PyTorch's `einsum`): `"ij,jk->ik"`, `"bij,bjk->bik"`, `"ii->i"` (a diagonal),
        `"ij->"`, or the implicit form `"ij,jk"` (the output: the letters used once, sorted). Operands may be given as
        one list. Size-1 axes broadcast; `...` is not supported. Built as one broadcast product and a sum (the matmul
        path), so it fuses and differentiates like matmul. Promoted dtype, the operands' device. Also `azyx.einsum`.

        >>> a = Tensor([[1.0, 2.0], [3.0, 4.0]])
        >>> Tensor.einsum("ij,jk->ik", a, a).numpy_sync().tolist()
        [[7.0, 10.0], [15.0, 22.0]]
        """
        if len(operands) == 1 and isinstance(operands[0], list | tuple):
            operands = tuple(operands[0])
        eq = subscripts.replace(" ", "")
        if "..." in eq:
            raise ArgumentError(f"einsum {subscripts!r}: '...' is not supported; name every axis")
        lhs, arrow, out = eq.partition("->")
        terms = lhs.split(",")
        letters = "".join(terms)
        if not arrow:
            out = "".join(sorted(c for c in set(letters) if letters.count(c) == 1))
        if len(terms) != len(operands):
            raise ArgumentError(f"einsum {subscripts!r} names {len(terms)} operands, got {len(operands)}")
        if not all(c.isalpha() for c in letters + out) or len(set(out)) != len(out) or not set(out) <= set(letters):
            raise ArgumentError(f"einsum {subscripts!r}: subscripts must be letters, the output's unique and used in "
                                f"an input")
        ts = [t if isinstance(t, Tensor) else Tensor(t) for t in operands]
        order = list(out) + sorted(set(letters) - set(out))  # the output's axes, then the summed ones
        sizes: dict[str, builtins.int] = {}
        product: Tensor | None = None
        for term, t in zip(terms, ts):
            if len(term) != t.ndim:
                raise ShapeError(f"einsum {subscripts!r}: {term!r} names {len(term)} axes of a tensor of shape "
                                 f"{t.shape}")
            while len(set(term)) < len(term):  # a letter twice: the diagonal of those two axes
                c = next(c for c in term if term.count(c) > 1)
                i, j = term.index(c), term.index(c, term.index(c) + 1)
                t, term = t._diagonal(i, j), term[:j] + term[j + 1:]
            for c, s in zip(term, t.shape):
                if sizes.get(c, 1) not in (1, s) and s != 1:
                    raise ShapeError(f"einsum {subscripts!r}: axis {c!r} has sizes {sizes[c]} and {s}")
                sizes[c] = max(sizes.get(c, 1), s)
            perm = sorted(range(len(term)), key=lambda d: order.index(term[d]))
            t = t.permute(*perm) if perm else t
            present = [term[d] for d in perm]
            t = t.reshape(tuple(t.shape[present.index(c)] if c in present else 1 for c in order))
            product = t if product is None else product * t
        assert product is not None
        product = product._broadcast_to(tuple(sizes[c] for c in order))
        summed = tuple(range(len(out), len(order)))
        return product._reduce("sum", summed, False) if summed else product

    def _diagonal(self, i: builtins.int, j: builtins.int) -> Tensor:
        """The diagonal of axes i < j (of equal size n): axis j removed, axis i indexing the diagonal (a view)."""
        n = self.shape[i]
        if self.shape[j] != n:
            raise ShapeError(f"a diagonal of axes {i} and {j} needs equal sizes, got shape {self.shape}")
        x = self.moveaxis(j, -1).moveaxis(i, -2)
        x = x.reshape(x.shape[:-2] + (n * n,))._stride(x.ndim - 2, n + 1)
        return x.moveaxis(-1, i)


def _refuse_mask(index: Any) -> None:
    """A boolean mask as an index (`x[x > 3]`) has a data-dependent shape, which a lazy graph cannot have: raise,
    naming what to use instead."""
    dt = index.dtype if isinstance(index, Tensor) else np.asarray(index).dtype
    if dt == dtypes.bool or dt == np.bool_:
        raise DTypeError("a boolean mask index (`x[mask]`) has a shape known only from the data, which a lazy graph "
                         "cannot have; use `Tensor.where(mask, x, fill)` or `x.masked_fill(~mask, fill)` to keep the "
                         "shape, or read the values first: `(await x.numpy())[await mask.numpy()]`")


def _as_dtype(x: Any) -> DType | None:
    """`x` as a dtype where it names one (a DType, numpy dtype or type, dtype name), else None (a device name)."""
    if isinstance(x, str) and ":" in x:
        return None
    try:
        return to_dtype(x)
    except DTypeError:
        return None


def _assign_axes(entries: list[tuple], positions: list[Tensor], key: Any) -> tuple[list[tuple], list[int]]:
    """An assignment's axes (ASSIGN's arg, one per indexed axis) and the region it writes, from its key's `entries`
    (Tensor._assigned). Several integer-tensor indices (with slices only) broadcast together, as numpy's: their shape
    in the region where the first stood if they are adjacent, else in front (`cache[slots, :, positions] = kv`: one
    row per sequence, each at its own slot and position); `positions` takes them broadcast."""
    at = [i for i, e in enumerate(entries) if e[0] == "index"]
    if len(at) > 1 and any(e[0] in ("at", "new") for e in entries) or at and any(e[0] == "at" for e in entries):
        raise IndexOutOfRange(f"an integer-tensor index in an assignment goes with slices only, got {key!r}")
    band: tuple[int, ...] | None = None  # the region axes of several broadcast indices
    if len(at) > 1:
        try:
            shape = broadcast_shapes(*(positions[entries[i][1]].shape for i in at))
        except ShapeError:
            raise IndexOutOfRange(f"the integer-tensor indices of an assignment do not broadcast together: {key!r}") \
                from None
        for i in at:
            positions[entries[i][1]] = positions[entries[i][1]]._broadcast_to(shape)
    axes: list[tuple] = []
    region: list[int] = []
    for i, e in enumerate(entries):
        if len(at) > 1 and band is None and (i == at[0] or at != list(range(at[0], at[-1] + 1))):
            band = tuple(range(len(region), len(region) + len(shape)))
            region.extend(shape)
        if e[0] == "new":
            region.append(1)
        elif e[0] == "slice":
            axes.append(("slice", e[1], e[2], len(region)))
            region.append(e[3])
        elif e[0] == "at":
            axes.append(e)
        elif band is not None:
            axes.append(("index", e[1], band))
        else:
            idx = positions[e[1]]
            axes.append(("index", e[1], tuple(range(len(region), len(region) + idx.ndim))))
            region.extend(idx.shape)
    return axes, region


def _key_axes(key: tuple, shape: Shape) -> list[tuple[Any, int | None]]:
    """A basic index's entries, its Ellipsis (or the end) expanded into full slices, each with the axis it indexes
    (None: the entry is None, a new axis)."""
    n_real = sum(1 for k in key if k is not None and k is not Ellipsis)
    if sum(1 for k in key if k is Ellipsis) > 1:
        raise IndexOutOfRange("an index can only have a single ellipsis")
    if n_real > len(shape):
        raise IndexOutOfRange(f"too many indices ({n_real}) for a tensor of shape {shape}")
    at = next((i for i, k in enumerate(key) if k is Ellipsis), len(key))  # (by identity: == on a tensor makes a node)
    key = key[:at] + (slice(None),) * (len(shape) - n_real) + key[at + 1 :]
    out: list[tuple[Any, int | None]] = []
    dim = 0
    for k in key:
        out.append((k, None if k is None else dim))
        dim += k is not None
    return out


def _join_devices(*nodes: Node) -> tuple[str, bool]:
    """The device of an op's result: a pinned operand's device wins; mixing pinned devices is an error."""
    first = nodes[0]
    if len(nodes) == 2 and nodes[1].device == first.device:
        return first.device, first.pinned or nodes[1].pinned
    if all(n.device == first.device for n in nodes):
        return first.device, any(n.pinned for n in nodes)
    pinned = {n.device for n in nodes if n.pinned}
    if len(pinned) > 1:
        raise DeviceError(f"operands are on different devices {sorted(pinned)}; move them with .to(device)")
    if pinned:
        return pinned.pop(), True
    return next((n.device for n in nodes if n.device != DISK), first.device), False  # the disk computes nothing


def _unpickle(values: np.ndarray, dtype: str, device: str | None) -> Tensor:
    """A pickled tensor, rebuilt (bfloat16 arrives widened to float32 and is rounded back)."""
    return Tensor(values, dtype=dtype, device=device)


def _to_numpy(data: Any, dtype: Any) -> np.ndarray:
    """`data` (numpy array or scalar, Python scalar or nested list) as a numpy array of the tensor's dtype. Python
    values: an explicit `dtype` is applied to them directly (`[0.1]` as float64 is exactly 0.1, `[2**40]` as int64
    exactly 2**40; a value the dtype cannot hold raises DTypeError naming it); else floats become float32, ints int32
    where every value fits and int64 where one does not (numpy and PyTorch infer int64), bools bool."""
    dt = to_dtype(dtype) if dtype is not None else None
    if isinstance(data, np.ndarray):
        arr = data
        if not (arr.dtype == np.float16 or arr.dtype == np.float64 or arr.dtype.kind in "biuf"):
            raise DTypeError(f"unsupported numpy dtype {arr.dtype}")
    elif isinstance(data, np.generic):
        arr = np.asarray(data)
    else:
        host = None if dt is None else np.float32 if dt is dtypes.bfloat16 else dt.np
        try:
            arr = np.asarray(data, dtype=host)
        except OverflowError:  # a Python int outside the explicit dtype's range
            raise DTypeError(f"{_first_outside(data, dt)} does not fit {dt.name if dt else 'int64'}") from None
        except ValueError as e:
            raise ShapeError(f"ragged nested sequence: {e}") from None
        if dt is not None:
            return arr
        if arr.dtype == np.float64:
            arr = arr.astype(np.float32)
        elif arr.dtype.kind in "iu" or arr.dtype == object:
            arr = _python_ints(arr, data)
        elif arr.dtype.kind not in "bf":
            raise DTypeError(f"cannot make a tensor from {type(data).__name__} with numpy dtype {arr.dtype}")
    if dt is not None:
        arr = arr.astype(np.float32 if dt is dtypes.bfloat16 else dt.np, copy=False)
    else:
        from_numpy(arr.dtype)  # raises DTypeError for unsupported dtypes
    return arr


def _python_ints(arr: np.ndarray, data: Any) -> np.ndarray:
    """Python ints (numpy made `arr` of them): int32 where every value fits, else int64; a value outside int64's
    range (numpy made uint64 or object) raises DTypeError naming it."""
    if arr.dtype.kind == "i" and (not arr.size or (arr.min() >= -(2**31) and arr.max() < 2**31)):
        return arr.astype(np.int32)
    if arr.dtype.kind == "i":
        return arr.astype(np.int64)
    if arr.dtype.kind == "u" and (not arr.size or arr.max() < 2**63):
        return arr.astype(np.int64)
    if arr.dtype == object and all(isinstance(v, int) for v in arr.flat):  # (ints beyond uint64)
        raise DTypeError(f"{_first_outside(data, dtypes.int64)} does not fit int64")
    if arr.dtype.kind == "u":
        raise DTypeError(f"{_first_outside(data, dtypes.int64)} does not fit int64")
    raise DTypeError(f"cannot make a tensor from {type(data).__name__} with numpy dtype {arr.dtype}")


def _first_outside(data: Any, dt: DType | None) -> str:
    """The first Python int in (nested) `data` that integer dtype `dt` cannot hold, for an error message."""
    if dt is None or not dt.is_int:
        return f"a value of {data!r}"[:200]
    lo, hi = -(2 ** (8 * dt.itemsize - 1)), 2 ** (8 * dt.itemsize - 1) - 1
    if dt.kind == "u":
        lo, hi = 0, 2 ** (8 * dt.itemsize) - 1
    stack = [data]
    while stack:
        v = stack.pop()
        if isinstance(v, list | tuple):
            stack.extend(reversed(v))
        elif isinstance(v, int) and not lo <= v <= hi:
            return f"the Python int {v}"
    return f"a value of {data!r}"[:200]


def _to_storage(arr: np.ndarray, dt: DType) -> np.ndarray:
    """A C-contiguous copy in the dtype's storage format (bfloat16: the upper 16 bits, rounded to nearest even)."""
    if dt is dtypes.bfloat16:
        bits = np.array(arr, dtype=np.float32, order="C").view(np.uint32)  # (ascontiguousarray makes 0-d 1-d)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        return np.array(rounded, dtype=np.uint16)  # (a 0-d array comes back from >> as a numpy scalar)
    return np.array(arr, dtype=dt.np, order="C", copy=True)


if native is not None:  # the operators' common cases (`_binop`) and the handle's finalizer, in C
    _KINDS = (*dtypes.all(), dtypes.uint32)
    native.setup_tensor(Tensor, GRAPH, tuple(d for d in _KINDS if d.kind == "f"),
                        tuple(d for d in _KINDS if d.kind in "iu"), DISK, types.MethodType)
    Tensor.__del__ = native.Method(None, 0, None, "__del__", "Tensor.__del__", None)  # type: ignore[method-assign]
    # x.exp(), x.sum(): the common case built in C (a float tensor's unary op; a reduction over every axis), the
    # method's Python for the rest (its own arguments, other dtypes, constants)
    for _name, _kind in [*((u, 32) for u in ("abs", "exp", "log", "exp2", "log2", "sqrt", "rsqrt", "reciprocal", "sin",
                                              "cos", "tan", "tanh", "erf", "sigmoid", "relu", "silu", "softplus",
                                              "sign")),
                         *((r, 64) for r in ("sum", "prod", "max", "min"))]:
        _method = getattr(Tensor, _name)
        setattr(Tensor, _name, native.Method(_name, _kind, _method, _name, _method.__qualname__, _method.__doc__))
