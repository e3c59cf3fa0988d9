"""What every device whose memory is host memory shares: its memory part (memory.HostBlocks), its queue part (an
in-order worker queue: queues.WorkQueue), gathering and batches that run inline or queued."""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from typing import Any

import numpy as np

from azyx.device import INLINE, QUEUED, BatchState, Buffer, Device, LaunchItem, Runner, gatherable, host_read
from azyx.dtypes import DType
from azyx.graph import Shape, StridedView
from azyx.memory import HostBlocks, memory_bytes
from azyx.plan import ExecutionPlan
from azyx.queues import WorkQueue

WIDE_KEPT = 64  # gathers' batches kept per device (a crowd's gathers come in a few sizes)


class HostDevice(Device):
    """A device whose buffers are host memory: allocation, copies and reads are plain memory operations."""

    host_memory = True
    alloc_anywhere = True  # (a locked pool of numpy blocks)

    def __init__(self, index: int, options: dict[str, Any]):
        super().__init__(index, options)
        capacity = int(options.get("memory") or memory_bytes() * 3 // 4)
        self.mem = HostBlocks(self, Buffer, capacity, capacity // 4)
        # the memory part's own calls, a frame less on a small run's path (each buffer taken and given back)
        self.alloc, self.alloc_many, self.release = (  # type: ignore[method-assign]
            self.mem.alloc, self.mem.alloc_many, self.mem.release)
        self.queue = WorkQueue(self.timeline, self.name, self.record_failure)
        self.inline_work = int(options.get("inline_work", 1 << 16))
        # the open gather (`open_gather`): its reserved timeline value (0: none open), the runs' kernels and batches
        self.gather_v = 0
        self.gathered: list[LaunchItem] = []
        self.gathered_batches: list[BatchState] = []
        # a gather's batch by the batches it gathered (their ids: the batches are kept with it, so no id is reused)
        self.wide: dict[tuple[int, ...], tuple[list[BatchState], BatchState]] = {}

    def buffer_from_numpy(self, arr: np.ndarray) -> Buffer:
        assert arr.flags.c_contiguous
        self.allocator.account(arr.nbytes)
        return Buffer(self, arr.nbytes, arr, arr.ctypes.data if arr.nbytes else 0, False)

    def read(self, buf: Buffer, view: StridedView, shape: Shape, dtype: DType) -> np.ndarray:
        return host_read(buf.mem, view, shape, dtype)

    def pending(self) -> int:
        return self.queue.submitted - self.timeline.value

    def queued(self) -> int:
        return self.queue.submitted

    def runs_inline(self, work: int) -> bool:
        """Whether work of this size runs on the submitting thread when the queue is idle (`inline_work`): handing it
        to the worker thread would cost more than the work."""
        return work <= self.inline_work

    def submit(self, fn: Callable[[], None], waits: list[tuple[Device, int]], work: int) -> int:
        return self.queue.submit(fn, [(d.timeline, v) for d, v in waits], self.runs_inline(work))

    def prepare_batch(self, batch: BatchState) -> None:
        """INLINE where the batch's work is small (`runs_inline`), else QUEUED. A backend then leaves in an INLINE
        batch's `prepared` what runs it now on the calling thread: `prepared.inline(items)`."""
        batch.how = INLINE if self.runs_inline(batch.work) else QUEUED

    def prepare(self, plan: ExecutionPlan, batches: list[BatchState]) -> Runner:
        """The base's runner (each batch INLINE or QUEUED), gathering where the plan is `gatherable` and its work is
        handed to the queue (QUEUED): a crowd's runs are then one hand-off, not one each. An INLINE plan's runs are
        not gathered: each runs where it is submitted, and its realize returns without waiting, where a gathered run
        is waited for (a wake-up of its task, ~10 us on a 2-core host, more than the run's own submission)."""
        runner = super().prepare(plan, batches)
        runner.gathers = self.gather_runs and gatherable(plan) and any(b.how is QUEUED for b in batches)
        return runner

    def open_gather(self) -> None:
        assert not self.gather_v
        self.gather_v = self.queue.reserve()

    def gather_launch(self, items: list[LaunchItem], batch: BatchState) -> int:
        assert self.gather_v
        self.gathered += items
        self.gathered_batches.append(batch)
        return self.gather_v

    def close_gather(self) -> None:
        """The gathered kernels as one batch (prepared once per combination of the runs' batches, by the device's own
        rule: INLINE only where the whole is small work), one work item of the reserved value: on a C device one call
        into C, which runs on the device's runner, not on the loop's thread, unless it is small."""
        v, items, batches = self.gather_v, self.gathered, self.gathered_batches
        self.gather_v, self.gathered, self.gathered_batches = 0, [], []
        try:
            key = tuple(map(id, batches))
            found = self.wide.get(key)
            if found is None:
                if len(self.wide) >= WIDE_KEPT:
                    self.wide.pop(next(iter(self.wide)))
                wide = BatchState([step for b in batches for step in b.steps])
                self.prepare_batch(wide)
                found = self.wide[key] = (batches, wide)
            wide = found[1]
            if wide.how is INLINE:
                self.queue.submit_reserved(functools.partial(wide.prepared.inline, items), v, True)
            else:
                self.queue.submit_reserved(self.batch_fn(items, wide), v, False)
        except BaseException as e:  # (the runs' records raise it; their value still comes, or they would wait on)
            self.record_failure(v, e)
            self.queue.submit_reserved(_keep_alive(items), v, False)

    def batch_fn(self, items: list[LaunchItem], batch: BatchState) -> Callable[[], None]:
        """The work item that runs these kernels in order (it holds their buffers until it has run)."""
        raise NotImplementedError

    def launch_many(self, items: list[LaunchItem], waits: list[tuple[Device, int]],
                    batch: BatchState | None = None) -> int:
        """Kernels back to back. An INLINE batch whose waits are met runs here and now where the queue is idle (a
        steady small request: no work item, no hand-off); any other is one work item, so one hand-off to the worker
        thread (or the native queue) for all of them."""
        if batch is None:
            batch = self.batch_of(items)
        if batch.how is INLINE and (not waits or all(d.timeline.value >= w for d, w in waits)) and (
                v := self.queue.run_now(batch.prepared.inline, items)):
            return v
        return self.queue.submit(self.batch_fn(items, batch), [(d.timeline, w) for d, w in waits], False)

    def copy(self, src: Buffer, dst: Buffer, n: int, waits: list[tuple[Device, int]]) -> int:
        """A memmove on this device's queue (also from another host-memory device of this kind: c:0 -> c:1)."""

        def copy() -> None:
            ctypes.memmove(dst.ptr, src.ptr, n)

        return self.submit(copy, waits, n // 64)

    copy_peer = copy

    def copy_from_host(self, host: np.ndarray, dst: Buffer, waits: list[tuple[Device, int]], keep: Any,
                       offset: int = 0) -> int:
        def copy() -> None:
            assert keep is not None
            ctypes.memmove(dst.ptr + offset, host.ctypes.data, host.nbytes)

        return self.submit(copy, waits, host.nbytes // 64)

    def hold(self, waits: list[tuple[Device, int]], keep: Any) -> int:
        return self.submit(_keep_alive(keep), waits, 0)

    def write(self, buf: Buffer, host: np.ndarray) -> None:
        ctypes.memmove(buf.ptr, host.ctypes.data, min(buf.nbytes, host.nbytes))

    def close(self) -> None:
        self.queue.close()


def _keep_alive(*objs: object) -> Callable[[], None]:
    """A no-op work item that holds `objs` (buffers) until the queue has run it."""

    def hold() -> None:
        assert objs

    return hold


class HostMemory(HostDevice):
    """Plain host memory ("host"): where tensors made from numpy data wait for a device whose memory is not
    host memory; the plan copies them over when it first needs them. Not a compute device."""

    kind = "host"
    listed = False
