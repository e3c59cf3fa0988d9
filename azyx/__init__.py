"""azyx: an asyncio-native lazy tensor runtime. Build graphs synchronously; `await t.realize()`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from azyx.autograd import no_grad
from azyx.config import ConfigError
from azyx.dtypes import DType, dtypes
from azyx.errors import (
    AllocationError,
    ArgumentError,
    AxisError,
    AzyxError,
    AzyxIOError,
    CompileError,
    DeviceError,
    DeviceFailedError,
    DTypeError,
    IndexOutOfRange,
    LazyChainWarning,
    RuntimeStateError,
    ShapeError,
    StateDictError,
)
from azyx.graph import GRAPH
from azyx.jit import jit
from azyx.plan import ExecutionPlan
from azyx.realize import flat_targets
from azyx.realize import realize as _realize
from azyx.registry import BACKENDS
from azyx.runtime import RT
from azyx.schedule import make_plan
from azyx.shard import DataParallel, ShardedTensor, replicate
from azyx.stats import Stats, stats
from azyx.tape import GradientTape
from azyx.tensor import Tensor
from azyx.tune import tune, tune_sync
from azyx.viz import plot_graph
from azyx.walk import canonicalize

__all__ = [
    "AllocationError", "ArgumentError", "AxisError", "AzyxError", "AzyxIOError", "CompileError", "ConfigError", "DType",
    "DTypeError", "DeviceError", "DeviceFailedError", "GradientTape", "IndexOutOfRange", "LazyChainWarning",
    "RuntimeStateError", "ShapeError", "Tensor",
    "configure", "devices", "dtypes", "jit", "manual_seed", "plot_graph", "realize", "schedule", "Stats", "stats",
    "start", "synchronize", "train", "tune", "tune_sync",
    "ExecutionPlan", "StateDictError", "io", "nn", "optim", "DataParallel", "ShardedTensor", "replicate",
    "einsum", "no_grad",
]


async def realize(*tensors: Tensor | Sequence[Tensor]) -> tuple[Tensor, ...]:
    """Compute several tensors in one ExecutionPlan: tensors, or lists and tuples of them (`azyx.realize([a, b])`).
    Returns the tensors, flattened in order (`a, b = await azyx.realize([a, b])`). A coroutine."""
    targets: tuple[Any, ...] = flat_targets(tensors)
    await _realize(*targets)
    return targets


einsum = Tensor.einsum  # azyx.einsum("ij,jk->ik", a, b), as numpy.einsum/torch.einsum


def schedule(*tensors: Tensor) -> ExecutionPlan:
    """The ExecutionPlan that realizing `tensors` would run (cached like realize's), without running it."""
    targets = list(dict.fromkeys(t.id for t in tensors if GRAPH[t.id].buffer is None))
    walk = canonicalize(GRAPH, targets)
    return RT.plan_cache.get(walk.key) or make_plan(RT, GRAPH, walk, targets)


def devices() -> list[str]:
    """Every available compute device: AUTO's candidates first, in AUTO's order (the fastest by its speed estimate),
    then the other backends' devices. Probes every backend not probed yet, on the calling thread (in a service,
    `await azyx.start()` first)."""
    return RT.device_names()


async def start(*backends: str) -> list[str]:
    """Start the runtime off the event loop: read the configuration, probe the backends (driver loading, device
    contexts) on a worker thread while the loop stays free, and return their devices in `devices()`'s order (the
    async form of `devices()`). With no argument every backend, so that `azyx.devices()` answers at once afterwards;
    else the backends named (`"c"`, `"cuda"`) or those of the devices named (`"c:0"`). A service awaits it before it
    serves; without it, the first realize does the same for the devices it needs.

    >>> import asyncio, azyx
    >>> "c:0" in asyncio.run(azyx.start("c"))
    True
    """
    kinds = [b.partition(":")[0] if isinstance(b, str) else b for b in backends] if backends else None
    for kind, name in zip(kinds or [], backends):
        if kind not in BACKENDS:
            raise DeviceError(f"unknown backend {name!r}; backends: {', '.join(BACKENDS)}")
    await RT.startup(kinds)
    return RT.device_names(kinds)


def configure(cfg: dict[str, Any]) -> None:
    """Configure backends from a dict (same sections as the JSON config file); call before first use."""
    RT.configure(cfg)


def manual_seed(seed: int) -> None:
    """Make the random factories reproducible."""
    import numpy as np

    RT.rng = np.random.default_rng(seed)


async def synchronize() -> None:
    """Wait until every device has finished all the work submitted so far."""
    await RT.executor.synchronize_all()


class train:
    """`with azyx.train():` switches training mode on (dropout active); `azyx.train(False)` off."""

    def __init__(self, mode: bool = True):
        self.mode, self.prev = mode, Tensor.training

    def __enter__(self) -> train:
        self.prev, Tensor.training = Tensor.training, self.mode
        return self

    def __exit__(self, *exc: object) -> None:
        Tensor.training = self.prev


from azyx import io, nn, optim  # noqa: E402  (safetensors files, layers and optimisers, built on everything above)
