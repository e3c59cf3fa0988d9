"""Sharded tensors: one logical tensor whose pieces live on several devices of this host.

`t.shard(devices, axis)` splits `t` along `axis` into one piece per device (numpy's `array_split` sizes);
`azyx.replicate(t, devices)` puts a whole copy on each. A `ShardedTensor` is a list of ordinary lazy Tensors, one per
device, and a layout (the split axis and the pieces' sizes, or replicated): ops on it build each piece's graph on its
own device, so elementwise ops and reductions run where the shards are, and realizing the pieces together (`await
s.realize()`, or `azyx.realize` of several) runs them as one ExecutionPlan. Collectives (all-reduce, all-gather,
reduce-scatter, broadcast) are built from the pieces' slices and copies to other devices: between devices whose memory
is this process's host memory (C devices) a kernel reads the other device's buffer in place, with no copy
(`Tensor._readable_on`, `azyx.schedule.shares_memory`), and a replicated result is one buffer that every device's piece
holds (never written in place while they do: `azyx.graph.SHARED`); elsewhere they become the plan's transfer steps,
which the executor routes by its sync strategy (peer where the API has it, host-staged otherwise) and overlaps with
compute where the plan allows. Matrix products with a sharded operand run row- or column-parallel, or as partial
products joined by an all-reduce. `DataParallel` trains a model data-parallel: a replica per device, each a slice of
every batch, gradients all-reduced in the step's plan.

    x = Tensor(data).shard(["cuda:0", "cuda:1"], axis=0)  # rows split over two GPUs
    w = azyx.replicate(weights, ["cuda:0", "cuda:1"])     # a copy on each
    y = (x @ w).relu()                                     # each GPU its rows
    total = await y.sum().realize()                        # partial sums all-reduced: on both
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from azyx.errors import ArgumentError, ShapeError
from azyx.realize import realize as _realize
from azyx.realize import run_sync
from azyx.runtime import RT
from azyx.schedule import shares_memory
from azyx.tape import GradientTape
from azyx.tensor import Tensor, _dims

REDUCE_OPS = ("sum", "max", "min")


class ShardedTensor:
    """Pieces (`shards`, one per device in `devices`) of one logical tensor of `shape`: split along `axis` (pieces of
    `sizes` along it), or, with `axis` None, each a whole copy (replicated)."""

    defers_to_it = True  # Tensor's binary ops with one on the right return NotImplemented: Python calls ours

    def __init__(self, shards: Sequence[Tensor], axis: int | None):
        if not shards:
            raise ArgumentError("a sharded tensor needs at least one piece")
        self.shards = list(shards)
        self.devices = [t.device for t in shards]
        if len(set(self.devices)) != len(self.devices):
            raise ArgumentError(f"a sharded tensor's pieces must be on distinct devices, got {self.devices}")
        first = shards[0]
        if axis is None:
            if any(t.shape != first.shape for t in shards):
                raise ShapeError(f"replicated pieces differ in shape: {[t.shape for t in shards]}")
            self.shape = first.shape
        else:
            if any(t.ndim != first.ndim or t.shape[:axis] + t.shape[axis + 1:] != first.shape[:axis]
                   + first.shape[axis + 1:] for t in shards):
                raise ShapeError(f"pieces along axis {axis} differ off it: {[t.shape for t in shards]}")
            self.shape = first.shape[:axis] + (sum(t.shape[axis] for t in shards),) + first.shape[axis + 1:]
        self.axis = axis
        self.sizes = tuple(t.shape[axis] for t in shards) if axis is not None else ()

    # ---------------------------------------------------------------- what it is
    @property
    def dtype(self) -> Any:
        """The dtype of every piece."""
        return self.shards[0].dtype

    @property
    def ndim(self) -> int:
        """Number of axes of the whole tensor."""
        return len(self.shape)

    @property
    def replicated(self) -> bool:
        """True when every device holds the whole tensor (no split axis)."""
        return self.axis is None

    def __repr__(self) -> str:
        how = "replicated" if self.axis is None else f"axis {self.axis} in {list(self.sizes)}"
        return f"ShardedTensor(shape={self.shape}, {self.dtype.name}, {how} over {self.devices})"

    def jit_flatten(self) -> tuple[list[Tensor], tuple, Callable[[list[Tensor]], ShardedTensor]]:
        """azyx.jit takes a ShardedTensor argument as its pieces (a replay binds them) and this layout."""
        axis = self.axis
        return self.shards, ("ShardedTensor", axis, tuple(self.devices), self.sizes), lambda ts: ShardedTensor(ts,
                                                                                                            axis)

    def _like(self, shards: list[Tensor], axis: int | None = -1) -> ShardedTensor:
        return ShardedTensor(shards, self.axis if axis == -1 else axis)

    # ---------------------------------------------------------------- realizing and reading
    async def realize(self) -> ShardedTensor:
        """Compute every piece, in one ExecutionPlan."""
        await _realize(*self.shards)
        return self

    def gather(self, device: str | None = None) -> Tensor:
        """The whole tensor on one device (the first piece's by default): pieces copied there and joined."""
        dev = device or self.devices[0]
        if self.axis is None:
            return self.shards[self.devices.index(dev)] if dev in self.devices else self.shards[0].to(dev)
        return Tensor.cat([t._readable_on(dev) for t in self.shards], axis=self.axis)

    async def numpy(self) -> np.ndarray:
        """Coroutine: the whole tensor as a numpy array (the pieces gathered on the first device, then read)."""
        return await self.gather().numpy()

    def numpy_sync(self) -> np.ndarray:
        """`numpy()` for scripts, outside a running event loop."""
        return run_sync(self.numpy())

    # ---------------------------------------------------------------- elementwise
    def _pieces_of(self, other: Any) -> list[Any]:
        """`other` as one operand per piece: a number as it is, a Tensor (on any device) moved to each piece's device
        and sliced like this tensor where it spans the split axis, a ShardedTensor of the same layout piece by
        piece, a replicated one sliced like a Tensor."""
        if isinstance(other, ShardedTensor):
            if other.axis is None:  # its copy on each piece's device where it has one
                local = dict(zip(other.devices, other.shards))
                return self._pieces_of_whole([local.get(d, other.shards[0]) for d in self.devices])
            if self.axis is None:  # (replicated with split: the split side leads, `other op self`)
                raise _layouts(self, other)
            if (other.devices, other.axis, other.sizes) != (self.devices, self.axis, self.sizes) or \
                    other.shape != self.shape:
                raise _layouts(self, other)
            return other.shards
        if isinstance(other, Tensor):
            return self._pieces_of_whole([other] * len(self.shards))
        return [other] * len(self.shards)

    def _pieces_of_whole(self, wholes: list[Tensor]) -> list[Tensor]:
        out = []
        lo = 0
        for t, whole, n in zip(self.shards, wholes, self.sizes or (0,) * len(self.shards)):
            w = whole.to(t.device)
            ax = None if self.axis is None else self.axis - (self.ndim - w.ndim)
            if ax is not None and ax >= 0 and w.shape[ax] != 1:  # spans the split axis: this piece's part of it
                if w.shape[ax] != self.shape[self.axis]:  # type: ignore[index]
                    raise ShapeError(f"an operand of shape {whole.shape} does not broadcast to {self.shape}")
                w = w._shrink([(lo, lo + n) if i == ax else (0, s) for i, s in enumerate(w.shape)])
            out.append(w)
            lo += n
        return out

    def _map(self, fn: Callable[..., Tensor], *others: Any) -> ShardedTensor:
        cols = [self._pieces_of(o) for o in others]
        return self._like([fn(t, *(c[i] for c in cols)) for i, t in enumerate(self.shards)])

    def __add__(self, o: Any) -> ShardedTensor:
        return self._map(lambda a, b: a + b, o)

    def __radd__(self, o: Any) -> ShardedTensor:
        return self._map(lambda a, b: b + a, o)

    def __sub__(self, o: Any) -> ShardedTensor:
        return self._map(lambda a, b: a - b, o)

    def __rsub__(self, o: Any) -> ShardedTensor:
        return self._map(lambda a, b: b - a, o)

    def __mul__(self, o: Any) -> ShardedTensor:
        return self._map(lambda a, b: a * b, o)

    def __rmul__(self, o: Any) -> ShardedTensor:
        return self._map(lambda a, b: b * a, o)

    def __truediv__(self, o: Any) -> ShardedTensor:
        return self._map(lambda a, b: a / b, o)

    def __rtruediv__(self, o: Any) -> ShardedTensor:
        return self._map(lambda a, b: b / a, o)

    def __pow__(self, o: Any) -> ShardedTensor:
        return self._map(lambda a, b: a**b, o)

    def __neg__(self) -> ShardedTensor:
        return self._map(lambda a: -a)

    def __lt__(self, o: Any) -> ShardedTensor:
        return self._map(lambda a, b: a < b, o)

    def __gt__(self, o: Any) -> ShardedTensor:
        return self._map(lambda a, b: a > b, o)

    def maximum(self, o: Any) -> ShardedTensor:
        """Elementwise maximum with `o` (a number, Tensor or ShardedTensor of the same layout), piece by piece."""
        return self._map(lambda a, b: a.maximum(b), o)

    def where(self, a: Any, b: Any) -> ShardedTensor:
        """`a` where this (bool) tensor is true, else `b`, piece by piece."""
        return self._map(lambda c, x, y: Tensor.where(c, x, y), a, b)

    def cast(self, dtype: Any) -> ShardedTensor:
        """Every piece cast to `dtype`; same layout."""
        return self._map(lambda a: a.cast(dtype))

    def __getattr__(self, name: str) -> Any:
        """Tensor's unary elementwise methods (exp, relu, sqrt, ...) piece by piece."""
        if name.startswith("_") or name not in _UNARY:
            raise AttributeError(f"'ShardedTensor' has no attribute {name!r}")
        return lambda *a, **k: self._map(lambda t: getattr(t, name)(*a, **k))

    # ---------------------------------------------------------------- reductions
    def _reduce(self, op: str, axis: int | Sequence[int] | None, keepdim: bool) -> ShardedTensor:
        axes = tuple(range(self.ndim)) if axis is None else tuple(
            a % self.ndim for a in ((axis,) if isinstance(axis, int) else axis))
        parts = [getattr(t, op)(axis=axes, keepdim=keepdim) for t in self.shards]
        if self.axis is None:
            return ShardedTensor(parts, None)
        if self.axis in axes:  # each piece holds a partial result: combined on every device
            return ShardedTensor(parts, None)._all_reduce(op)
        new_axis = self.axis if keepdim else self.axis - sum(1 for a in axes if a < self.axis)
        return ShardedTensor(parts, new_axis)

    @_dims
    def sum(self, axis: int | Sequence[int] | None = None, keepdim: bool = False) -> ShardedTensor:
        """Sum over `axis` (None: all; int or tuple) like `Tensor.sum`; over the split axis the partial sums are
        all-reduced, so the result is replicated."""
        return self._reduce("sum", axis, keepdim)

    @_dims
    def max(self, axis: int | Sequence[int] | None = None, keepdim: bool = False) -> ShardedTensor:
        """Maximum over `axis` like `Tensor.max`; over the split axis the partial maxima are all-reduced (replicated
        result)."""
        return self._reduce("max", axis, keepdim)

    @_dims
    def min(self, axis: int | Sequence[int] | None = None, keepdim: bool = False) -> ShardedTensor:
        """Minimum over `axis` like `Tensor.min`; over the split axis the partial minima are all-reduced (replicated
        result)."""
        return self._reduce("min", axis, keepdim)

    @_dims
    def mean(self, axis: int | Sequence[int] | None = None, keepdim: bool = False) -> ShardedTensor:
        """Mean over `axis` like `Tensor.mean`: the sum divided by the count of reduced elements."""
        axes = range(self.ndim) if axis is None else ((axis,) if isinstance(axis, int) else axis)
        count = 1
        for a in axes:
            count *= self.shape[a]
        return self.sum(axis, keepdim) / float(count)

    # ---------------------------------------------------------------- collectives
    def _all_reduce(self, op: str, chunks: int | None = None) -> ShardedTensor:
        """Pieces holding partial values of one whole (a replicated layout of partials) combined by `op` into the
        same result on every device. Devices that read each other's memory in place (C devices: the scheduler's
        `shares_memory`, which are parts of one machine's cores and memory) combine every piece in one kernel on the
        first device, reading the others where they lie; the other devices' pieces are that result's buffer (their
        kernels read it in place; realized, they hold it: no copy, and no assignment writes into it in place while
        another holds it, graph.SHARED). Otherwise a ring reduce-scatters over the
        pieces' flattened elements (each device sends (n-1)/n of a piece, combining a chunk per step), then each
        combined chunk is copied to every device; a swap where there are two devices and `chunks` is not given (where
        a device's kernels read the other's memory, CUDA peers: `schedule.reads_in_place`, each reads the other's piece
        where it lies, the two at once, with no copy).
        `chunks`: the elements cut into that many rings side by side in the plan, so that one ring's transfers
        overlap another's reductions (a pipeline; on C devices a ring too, each step read in place)."""
        if op not in REDUCE_OPS:
            raise ArgumentError(f"all-reduce op must be one of {REDUCE_OPS}, got {op!r}")
        combine = _COMBINE[op]
        n = len(self.shards)
        if n == 1:
            return ShardedTensor(self.shards, None)
        if chunks is None and _shared(self.devices):  # one kernel combines every piece where it lies
            whole = self.shards[0]
            for t in self.shards[1:]:
                whole = combine(whole, t._readable_on(whole.device))
            return self._replicas(whole)
        total = int(np.prod(self.shards[0].shape))
        if n == 2 and chunks is None or total < n:
            # each device combines every piece, reading the others where they lie where its kernels can: a swap of two
            # (CUDA peers: both links at once), or fewer elements than devices
            out = []
            for dev in self.devices:
                whole = self.shards[0]._readable_on(dev)
                for t in self.shards[1:]:
                    whole = combine(whole, t._readable_on(dev))
                out.append(whole)
            return ShardedTensor(out, None)
        shape = self.shape
        flat = [t.reshape(-1) for t in self.shards]
        k = max(1, min(chunks or 1, total // n))
        m = n * k
        bounds = [(total * i // m, total * (i + 1) // m) for i in range(m)]
        pieces = [[f._shrink([b]) for b in bounds] for f in flat]  # pieces[device][chunk]
        result: list[list[Tensor]] = [[] for _ in range(n)]
        for j in range(k):  # one ring per n chunks: after n-1 steps device i holds chunk j*n + (i + 1) % n combined
            acc = [pieces[i][j * n + i] for i in range(n)]
            owner = [j * n + i for i in range(n)]
            for _ in range(n - 1):
                moved = [acc[(i - 1) % n]._readable_on(self.devices[i]) for i in range(n)]
                owner = [owner[(i - 1) % n] for i in range(n)]
                acc = [combine(moved[i], pieces[i][owner[i]]) for i in range(n)]
            for i, dev in enumerate(self.devices):  # every device collects each combined chunk from its holder
                for c in range(j * n, j * n + n):
                    holder = owner.index(c)
                    result[i].append(acc[holder] if holder == i else acc[holder]._readable_on(dev))
        out = []
        for i, dev in enumerate(self.devices):  # each combined chunk written into its place (a join by `cat` would
            whole = Tensor.zeros(total, dtype=self.dtype, device=dev)  # read every chunk at each point: 15x slower)
            for (lo, hi), part in zip(bounds, result[i]):
                whole[lo:hi] = part
            out.append(whole.reshape(*shape))
        return ShardedTensor(out, None)

    def all_reduce(self, op: str = "sum") -> ShardedTensor:
        """A replicated tensor whose pieces hold partial values (one per device, e.g. each device's gradients)
        combined by `op` ("sum", "max", "min") into the same result on every device."""
        if self.axis is not None:
            raise ArgumentError(f"all_reduce combines replicated partial values; this tensor is split along axis "
                                f"{self.axis} (all_gather joins pieces)")
        return self._all_reduce(op)

    def all_gather(self) -> ShardedTensor:
        """The whole tensor on every device (replicated). Devices that share memory (C devices) hold one buffer: the
        pieces joined once, on the first device (see `_all_reduce`)."""
        if self.axis is None:
            return self
        if _shared(self.devices):
            return self._replicas(self.gather(self.devices[0]))
        return ShardedTensor([self.gather(d) for d in self.devices], None)

    def _replicas(self, whole: Tensor) -> ShardedTensor:
        """`whole` on every device, read in place where they share memory (a replica is then its buffer)."""
        return ShardedTensor([whole._readable_on(d) for d in self.devices], None)

    def reduce_scatter(self, axis: int = 0, op: str = "sum") -> ShardedTensor:
        """Replicated partial values combined by `op`, each device keeping its piece along `axis` (the first half
        of an all-reduce: each device holds a part of the result)."""
        if self.axis is not None:
            raise ArgumentError(f"reduce_scatter combines replicated partial values; this tensor is split along axis "
                                f"{self.axis}")
        ax = axis % self.ndim
        bounds = _split_bounds(self.shape[ax], len(self.shards))
        combine = _COMBINE[op]
        out = []
        for i, dev in enumerate(self.devices):
            part = [t._shrink([bounds[i] if a == ax else (0, s) for a, s in enumerate(t.shape)]) for t in self.shards]
            acc = part[i]
            for j, p in enumerate(part):
                if j != i:
                    acc = combine(acc, p._readable_on(dev))
            out.append(acc)
        return ShardedTensor(out, ax)

    def broadcast(self, src: int = 0) -> ShardedTensor:
        """Piece `src`'s value on every device (replicated; where the devices share memory, one buffer)."""
        whole = self.shards[src] if self.axis is None else self.gather(self.devices[src])
        return self._replicas(whole)

    # ---------------------------------------------------------------- matrix products
    def __matmul__(self, other: Any) -> ShardedTensor:
        """Sharded @ replicated (or a Tensor): rows split (any axis but the last) give a product split the same way;
        split along the reduced axis with `other` split along its rows alike: partial products all-reduced."""
        if isinstance(other, ShardedTensor) and other.axis is not None:
            if self.axis == self.ndim - 1 and other.axis == other.ndim - 2 and self.sizes == other.sizes and \
                    self.devices == other.devices:
                return ShardedTensor([a @ b for a, b in zip(self.shards, other.shards)], None)._all_reduce("sum")
            raise _layouts(self, other)
        if self.axis == self.ndim - 1:
            raise ShapeError(f"{self!r} is split along the reduced axis; split the right operand along its rows too")
        rights = [(other.shards[0] if isinstance(other, ShardedTensor) else other).to(d) for d in self.devices]
        return self._like([a @ b for a, b in zip(self.shards, rights)])

    def __rmatmul__(self, other: Any) -> ShardedTensor:
        """Tensor (or replicated) @ column-split: each device computes its columns of the product."""
        if self.axis != self.ndim - 1:
            raise ShapeError(f"{other.shape} @ {self!r}: the right operand must be split along its columns")
        lefts = [(other.shards[0] if isinstance(other, ShardedTensor) else other).to(d) for d in self.devices]
        out = [a @ b for a, b in zip(lefts, self.shards)]
        return ShardedTensor(out, out[0].ndim - 1)


_COMBINE: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "sum": lambda a, b: a + b, "max": lambda a, b: a.maximum(b), "min": lambda a, b: a.minimum(b)}

_UNARY = {"exp", "log", "sqrt", "rsqrt", "relu", "sigmoid", "tanh", "gelu", "silu", "abs", "square", "sin", "cos",
          "reciprocal", "softplus", "sign", "floor", "ceil", "round", "clip", "softmax", "log_softmax", "reshape",
          "unsqueeze"}


def _layouts(a: ShardedTensor, b: ShardedTensor) -> ShapeError:
    return ShapeError(f"sharded operands of different layouts: {a!r} and {b!r} (reshard one: gather, then shard)")


def _shared(devices: Sequence[str]) -> bool:
    """Whether every device reads the others' buffers in place (schedule.shares_memory)."""
    first = RT.device(devices[0])
    return all(shares_memory(first, RT.device(d)) for d in devices[1:])


def _split_bounds(n: int, parts: int) -> list[tuple[int, int]]:
    """numpy's array_split: the first n % parts pieces one longer."""
    q, r = divmod(n, parts)
    out, lo = [], 0
    for i in range(parts):
        hi = lo + q + (1 if i < r else 0)
        out.append((lo, hi))
        lo = hi
    return out


def shard(t: Tensor, devices: Sequence[str], axis: int = 0) -> ShardedTensor:
    """`t` split along `axis` into one piece per device (numpy's `array_split` sizes), each moved there."""
    devs = [RT.check_device(d) for d in devices]
    if not devs:
        raise ArgumentError("shard over an empty list of devices")
    if t.ndim == 0:
        raise ShapeError("a 0-d tensor cannot be split: replicate it")
    ax = axis % t.ndim if -t.ndim <= axis < t.ndim else None
    if ax is None:
        raise ShapeError(f"axis {axis} is out of range for a tensor of shape {t.shape}")
    if t.shape[ax] < len(devs):
        raise ShapeError(f"axis {axis} of {t.shape} has fewer elements than the {len(devs)} devices")
    bounds = _split_bounds(t.shape[ax], len(devs))
    return ShardedTensor([t._shrink([b if a == ax else (0, s) for a, s in enumerate(t.shape)]).to(d)
                          for b, d in zip(bounds, devs)], ax)


def replicate(t: Any, devices: Sequence[str]) -> ShardedTensor:
    """A whole copy of `t` (a Tensor, or anything `Tensor()` takes: a numpy array, a list) on each device."""
    if not isinstance(t, Tensor):
        t = Tensor(t)
    devs = [RT.check_device(d) for d in devices]
    if not devs:
        raise ArgumentError("replicate over an empty list of devices")
    return ShardedTensor([t.to(d) for d in devs], None)


Tensor.sharder = staticmethod(shard)  # Tensor.shard (a method of the layer below) calls it


class DataParallel:
    """Data-parallel training over devices: a replica of the model on each (made by `make(device)`, then given the
    first replica's parameters), each a slice of every batch along axis 0, gradients all-reduced in the step's plan.
    Each replica's optimiser applies the same all-reduced gradients, so the replicas stay equal.

        dp = DataParallel(lambda d: MLP(d), ["cuda:0", "cuda:1"])
        opts = [optim.SGD(m.parameters(), lr=0.1) for m in dp.replicas]
        loss, grads = dp.gradients(lambda m, x, y: nn.cross_entropy(m(x), y), x, y)
        for opt, g in zip(opts, grads):
            opt.step(g)
        await azyx.realize(loss, *(t for o in opts for t in o.tensors()))  # one plan: every device's step
    """

    def __init__(self, make: Callable[[str], Any], devices: Sequence[str]):
        self.devices = [RT.check_device(d) for d in devices]
        if len(set(self.devices)) != len(self.devices) or not self.devices:
            raise ArgumentError(f"data parallel needs distinct devices, got {list(devices)}")
        self.replicas = [make(d) for d in self.devices]
        first = self.replicas[0].parameters()
        for m in self.replicas[1:]:
            for p, p0 in zip(m.parameters(), first, strict=True):
                p.assign(p0.to(p.device))

    def parameters(self) -> list[Tensor]:
        """Every replica's parameters (realize them with a step: all devices' updates in one plan)."""
        return [p for m in self.replicas for p in m.parameters()]

    def gradients(self, loss_fn: Callable[..., Tensor], *batch: Tensor | ShardedTensor
                  ) -> tuple[Tensor, list[list[Tensor]]]:
        """`loss_fn(model, *pieces)`, a mean over the pieces' rows, on each replica with its rows of the batch
        (Tensors split along axis 0 over the devices, or ShardedTensors split so already); returns the mean loss over
        the whole batch (on the first device) and, per replica, the gradients of its parameters summed over the
        devices, each replica's share weighted by its rows: the gradients of the whole batch's mean loss."""
        parts = [b if isinstance(b, ShardedTensor) else shard(b, self.devices, 0) for b in batch]
        if not parts or any(p.axis != 0 or p.devices != self.devices or p.sizes != parts[0].sizes for p in parts):
            raise ShapeError("data parallel batches must be split along axis 0 over the replicas' devices alike")
        rows = parts[0].shape[0]
        losses, grads = [], []
        for i, m in enumerate(self.replicas):
            with GradientTape() as tape:
                loss = loss_fn(m, *(p.shards[i] for p in parts)) * (parts[0].sizes[i] / rows)
            grads.append(tape.gradient(loss, m.parameters()))
            losses.append(loss)
        summed = [ShardedTensor([g[j] for g in grads], None).all_reduce("sum") for j in range(len(grads[0]))]
        total = ShardedTensor(losses, None).all_reduce("sum").shards[0]
        return total, [[s.shards[i] for s in summed] for i in range(len(self.replicas))]
