"""azyx: an asyncio-native lazy tensor runtime. Build graphs synchronously; `await t.realize()`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from azyx.autograd import no_grad
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
    RuntimeStateError,
    ShapeError,
    StateDictError,
)
from azyx.jit import jit
from azyx.plan import ExecutionPlan
from azyx.realize import flat_targets
from azyx.realize import realize as _realize
from azyx.runtime import GRAPH, RT
from azyx.schedule import make_plan
from azyx.shard import DataParallel, ShardedTensor, replicate
from azyx.stats import Stats, stats
from azyx.tape import GradientTape
from azyx.tensor import Tensor
from azyx.tune import tune, tune_sync
from azyx.viz import plot_graph
from azyx.walk import canonicalize

__all__ = [
    "AllocationError", "ArgumentError", "AxisError", "AzyxError", "AzyxIOError", "CompileError", "DType", "DTypeError",
    "DeviceError", "DeviceFailedError", "GradientTape", "IndexOutOfRange", "RuntimeStateError", "ShapeError", "Tensor",
    "configure", "devices", "dtypes", "jit", "manual_seed", "plot_graph", "realize", "schedule", "Stats", "stats",
    "synchronize", "train", "tune", "tune_sync",
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
    """Available compute devices, in AUTO preference order."""
    return RT.device_names()


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
