"""What every device whose memory is host memory shares: a pooled allocator and an in-order worker queue."""

from __future__ import annotations

import ctypes
import functools
import os
import queue
import threading
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from azyx.allocator import PoolAllocator
from azyx.device import INLINE, QUEUED, BatchState, Buffer, Device, LaunchItem, Runner, gatherable, host_read
from azyx.dtypes import DType
from azyx.graph import Shape, StridedView
from azyx.plan import ExecutionPlan, KernelStep
from azyx.timeline import TimelineSignal
from azyx.workers import lower_priority

ALIGN = 64
_HANDED = object()  # (_HANDED, v): a WorkQueue's wake-up, reserved item `v` given to its worker (`submit_reserved`)
WIDE_KEPT = 64  # gathers' batches kept per device (a crowd's gathers come in a few sizes)


def _aligned(size: int) -> np.ndarray:
    raw = np.empty(size + ALIGN, np.uint8)
    off = (-raw.ctypes.data) % ALIGN
    return raw[off : off + size]


def _aligned_block(size: int) -> tuple[np.ndarray, int]:
    mem = _aligned(size)
    return mem, mem.ctypes.data  # (numpy's ctypes.data costs a microsecond: read once per block, not per use)


class HostAllocator(PoolAllocator):
    """Pooled 64-byte aligned host blocks, each kept with its address."""

    def __init__(self, capacity: int, cache_limit: int, what: str = "host memory"):
        super().__init__(capacity, cache_limit, _aligned_block, what)


class NativeQueue(Protocol):
    """A queue beside the worker thread that runs some work items with no Python (a C device's runner): `put` hands
    one over (returning at once, in the queue's order) and signals the timeline with `v` once it has run."""

    def takes(self, fn: Callable[[], None]) -> bool: ...

    def put(self, fn: Callable[[], None], v: int) -> None: ...


class WorkQueue:
    """An in-order queue drained by one worker thread; small work runs inline when the queue is idle. Where the device
    has a native queue, work it takes goes there instead when everything before it is done or there too (and its
    waits are met), so that it starts without this thread, and without the GIL; the rest keeps program order by
    waiting for the item before it."""

    def __init__(self, timeline: TimelineSignal, name: str, record_failure: Callable[[int, BaseException], None]):
        self.timeline, self.name = timeline, name
        self.q: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.submitted = 0
        self.lock = threading.Lock()
        self.thread: threading.Thread | None = None
        self.record_failure = record_failure  # (timeline value, error) of a work item that failed
        self.native: NativeQueue | None = None
        self.native_last = 0  # the value of the last item handed to the native queue
        # values reserved for items handed over later (`reserve`), with the item once given to this queue's worker
        # (None until then; gone once run or handed to the native queue); the worker runs them before later items
        self.reserved: dict[int, Callable[[], None] | None] = {}
        self.handed = threading.Condition(self.lock)  # (notified when a reservation is given or resolved)

    def submit(self, fn: Callable[[], None], waits: list[tuple[TimelineSignal, int]], inline: bool) -> int:
        with self.lock:
            self.submitted += 1
            v = self.submitted
            idle = self.timeline.value == v - 1
            if (idle or self.native_last == v - 1) and all(t.value >= w for t, w in waits):
                if inline and idle:
                    self._execute(fn, v)
                    del fn  # the work's buffers go back to the pool before anyone sees the timeline advance
                    self.timeline.signal(v)
                    return v
                if self.native is not None and self.native.takes(fn):
                    self.native.put(fn, v)
                    self.native_last = v
                    return v
            self._to_worker((fn, waits, v))
        return v

    def _to_worker(self, item: Any) -> None:
        """(Under the lock.) An item for the worker thread, started with the first."""
        if self.thread is None:
            self.thread = threading.Thread(target=self._loop, name=f"azyx-{self.name}", daemon=True)
            self.thread.start()
        self.q.put(item)

    def reserve(self) -> int:
        """The next timeline value, for a work item handed over later (`submit_reserved`); items submitted meanwhile
        come after it (none can run inline or go to the native queue before it: the worker thread takes them, and
        runs the reserved item first once it is given)."""
        with self.lock:
            self.submitted += 1
            self.reserved[self.submitted] = None
            return self.submitted

    def submit_reserved(self, fn: Callable[[], None], v: int, inline: bool) -> None:
        """The work item of value `v` (`reserve`'s): run here and now where `inline` and the queue is idle up to it,
        else handed to the native queue where everything before it is done or there, else to the worker thread, which
        runs it before any later item it took meanwhile (`_reserved_before`)."""
        with self.lock:
            idle = self.timeline.value == v - 1
            if inline and idle:
                del self.reserved[v]
                self._execute(fn, v)
                del fn  # (as `submit`: the buffers back to the pool before the timeline advances)
                self.timeline.signal(v)
            elif (idle or self.native_last == v - 1) and self.native is not None and self.native.takes(fn):
                del self.reserved[v]
                self.native.put(fn, v)
                self.native_last = v
            else:
                self.reserved[v] = fn
                self._to_worker((_HANDED, v))  # (wakes an idle worker; one that took a later item waits on `handed`)
            self.handed.notify_all()

    def _reserved_before(self, u: int) -> None:
        """(The worker thread, before the item of value `u`.) Run the reserved items of lower values, in order, each
        once it is given; one resolved elsewhere (inline, the native queue) is simply gone. Waiting for one is safe:
        the queue's items below `u` were put before `u`'s, so this thread has taken them all."""
        while True:
            with self.lock:
                lower = [r for r in self.reserved if r < u]
                if not lower:
                    return
                r = min(lower)
                fn = self.reserved[r]
                if fn is None:
                    self.handed.wait()
                    continue
                del self.reserved[r]
                box = [fn]
                del fn
            self._run_in_order(box, [], r)

    def run_now(self, fn: Callable[..., None], *args: Any) -> int:
        """Run `fn(*args)` on the calling thread as the queue's next item, where the queue is idle (everything before
        it has run): returns its timeline value; 0 where the queue is busy (the caller queues the work instead)."""
        with self.lock:
            v = self.submitted + 1
            if self.timeline.value != v - 1:
                return 0
            self.submitted = v
            try:
                fn(*args)
            except BaseException as e:  # the run it belongs to raises it (RunRecord)
                self.record_failure(v, e)
            self.timeline.signal(v)
        return v

    def _execute(self, fn: Callable[[], None], v: int) -> None:
        try:
            fn()
        except BaseException as e:  # the run it belongs to raises it (RunRecord); the queue keeps going
            self.record_failure(v, e)

    def _loop(self) -> None:
        # Device work runs at a lower priority than the event loop thread (OpenMP threads started from here
        # inherit it), so the loop wakes on time even while kernels keep every core busy.
        lower_priority()
        while True:
            item = self.q.get()
            if item is None:
                return
            if item[0] is _HANDED:  # (every item below it is taken: those put before it)
                self._reserved_before(item[1] + 1)
                continue
            fn, waits, v = item
            box = [fn]
            del item, fn
            if self.reserved:
                self._reserved_before(v)
            self._run_in_order(box, waits, v)

    def _run_in_order(self, box: list[Callable[[], None]], waits: list[tuple[TimelineSignal, int]], v: int) -> None:
        """(The worker thread.) Run item `v` (the one in `box`, taken out: the item's last reference is this
        frame's) once every value before it and its `waits` are reached, then signal it."""
        fn = box.pop()
        try:
            self.timeline.wait_sync(v - 1)  # an item before it may be in the native queue
            for t, w in waits:
                t.wait_sync(w)
        except BaseException as e:  # a device it waits for has failed (DeviceFailedError): its inputs are lost
            self.record_failure(v, e)
        else:
            self._execute(fn, v)
        del fn  # release the work's buffers before signalling completion
        self.timeline.signal(v)

    def close(self) -> None:
        if self.thread is not None:
            self.q.put(None)
            self.thread.join(timeout=5)
            self.thread = None


def memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 8 << 30


class HostDevice(Device):
    """A device whose buffers are host memory: allocation, copies and reads are plain memory operations."""

    host_memory = True
    alloc_anywhere = True  # (a locked pool of numpy blocks)

    def __init__(self, index: int, options: dict[str, Any]):
        super().__init__(index, options)
        self.capacity = int(options.get("memory") or memory_bytes() * 3 // 4)
        self.allocator = HostAllocator(self.capacity, self.capacity // 4, self.name)
        self.queue = WorkQueue(self.timeline, self.name, self.record_failure)
        self.inline_work = int(options.get("inline_work", 1 << 16))
        # the open gather (`open_gather`): its reserved timeline value (0: none open), the runs' kernels and batches
        self.gather_v = 0
        self.gathered: list[LaunchItem] = []
        self.gathered_batches: list[BatchState] = []
        # a gather's batch by the batches it gathered (their ids: the batches are kept with it, so no id is reused)
        self.wide: dict[tuple[int, ...], tuple[list[BatchState], BatchState]] = {}

    def alloc(self, nbytes: int) -> Buffer:
        (mem, ptr), size = self.allocator.alloc(nbytes)
        return Buffer(self, size, mem, ptr, True)

    def alloc_many(self, sizes: list[int]) -> list[Buffer]:
        return [Buffer(self, size, mem, ptr, True) for (mem, ptr), size in self.allocator.alloc_many(sizes)]

    def release(self, buf: Buffer) -> None:
        if buf.pooled:
            self.allocator.free((buf.mem, buf.ptr), buf.nbytes)
        else:
            self.allocator.free(None, buf.nbytes)  # only the accounting (the array is its owner's)

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

    def launch(self, step: KernelStep, bufs: list[Buffer], waits: list[tuple[Device, int]],
               words: tuple[int, ...] = ()) -> int:
        return self.launch_many([(step, bufs, words)], waits)

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
