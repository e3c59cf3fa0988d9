"""The contract between the scheduler and the executor: an `ExecutionPlan` and its steps, frozen data.

The scheduler (azyx.schedule) builds a plan once per graph structure; the executor (azyx.executor) runs it with new
buffers and scalar values as often as the structure comes back. Everything here is decided before anything runs:
kernel order, buffer slots and their lifetimes, devices, transfers, and each kernel's launch geometry.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from azyx.codegen.launch import Launch
from azyx.codegen.search_actions import SplitSite
from azyx.dtypes import DType, scalar_packer
from azyx.graph import StridedView
from azyx.ir import Kernel, scalar_args


@dataclass(frozen=True)
class Slot:
    device: str
    dtype: DType
    nbytes: int
    kind: str  # "input" | "temp" | "output" | "check" (a run's check words on a device: bound by the executor)


@dataclass(frozen=True)
class KernelStep:
    device: str
    name: str
    src: str
    args: tuple[int, ...]  # slot ids; the first `outs` are written, the rest read
    work: int
    kernel: Kernel = field(repr=False, compare=False)
    outs: int = 1
    launch: Launch = field(default=Launch(), compare=False)  # its grid and group, or its shared loop (renderer's)
    # the plan's scalars it takes, in parameter order (after the buffers), and how their values are passed
    scalars: tuple[int, ...] = field(default=(), init=False)
    scalar_dtypes: tuple[DType, ...] = field(default=(), init=False, repr=False, compare=False)
    pack: Callable[[Sequence[Any]], tuple[int, ...]] | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        args = scalar_args(self.kernel)
        if args:
            object.__setattr__(self, "scalars", tuple(v.arg for v in args))
            object.__setattr__(self, "scalar_dtypes", tuple(v.dtype for v in args))
            object.__setattr__(self, "pack", scalar_packer([v.dtype for v in args], self.scalars))

    def words(self, scalars: Sequence[Any]) -> tuple[int, ...]:
        """This run's values of the kernel's scalar parameters, as the 64-bit words that carry them."""
        if self.pack is None:
            return ()
        return self.pack(scalars)


@dataclass(frozen=True)
class TransferStep:
    src: int
    dst: int
    src_device: str
    dst_device: str


Step = KernelStep | TransferStep


@dataclass(frozen=True, eq=False)
class ExecutionPlan:
    """Everything decided before anything runs: steps in order, buffer slots, lifetimes, devices. Frozen, and equal
    only to itself: what the executor derives from a plan to run it faster is the executor's (keyed by the plan)."""

    steps: tuple[Step, ...]
    slots: tuple[Slot, ...]
    n_inputs: int
    outputs: tuple[tuple[int, StridedView], ...]  # per target: the slot and how to index it
    frees: tuple[tuple[int, ...], ...]  # per step: temp slots whose last use it is
    devices: tuple[str, ...]
    adopt: tuple[tuple[int, int], ...] = ()  # (input slot, slot): host data a leaf keeps on its device from now on
    n_scalars: int = 0  # the values a run binds (Walk.scalars): the graph's Python numbers, kernel arguments
    # input slots a kernel writes in place (an assignment into a realized tensor nothing else held when planned):
    # whoever binds new inputs to the plan (azyx.jit) binds there only buffers that nothing else reads
    overwrites: tuple[int, ...] = ()
    # the reductions the planner split or could have split, with their device: what azyx.tune searches the parts of
    splits: tuple[tuple[str, SplitSite], ...] = ()
    # slots of kind "check": per device, the int32 words where its kernels flag an index out of range (ir.Kernel.check);
    # the executor binds each run's own check words there, and the run's record reads it when the work is done
    checks: tuple[int, ...] = ()
    # targets (their positions) whose buffer another target or an input holds too (a realized view of an input, a
    # collective's replicas in memory their devices share): such a buffer is never written in place (graph.SHARED)
    aliased: tuple[int, ...] = ()

    @property
    def kernels(self) -> list[KernelStep]:
        """The plan's kernel steps, in the order they run (transfers left out)."""
        return [s for s in self.steps if isinstance(s, KernelStep)]

    def describe(self) -> str:
        """A readable listing of the plan: one line per step (kernel with its device and arguments, or transfer), as
        `AZYX_DEBUG=2` prints it."""
        lines = [f"ExecutionPlan: {len(self.steps)} steps, {len(self.slots)} slots on {', '.join(self.devices)}"]
        for i, s in enumerate(self.steps):
            if isinstance(s, KernelStep):
                lines.append(f"  {i}: kernel {s.name} on {s.device} args={s.args} work={s.work}")
            else:
                lines.append(f"  {i}: transfer slot {s.src} ({s.src_device}) -> slot {s.dst} ({s.dst_device})")
        return "\n".join(lines)
