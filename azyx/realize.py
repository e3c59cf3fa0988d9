"""The asynchronous path of one realize: canonical walk -> cached plan (or schedule + compile) -> submit ->
the targets become leaves -> wait for their timeline values on the event loop."""

from __future__ import annotations

import asyncio
import collections
import threading
import time
import weakref
from collections.abc import Callable, Coroutine, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import numpy as np

from azyx.device import buffer_of, host_read
from azyx.dtypes import dtypes
from azyx.errors import AzyxError, RuntimeStateError, fresh_copy
from azyx.graph import GraphCopy, Op, prod
from azyx.plan import ExecutionPlan
from azyx.runtime import GRAPH, RT
from azyx.schedule import make_plan
from azyx.walk import Walk, canonicalize
from azyx.workers import in_worker_thread

if TYPE_CHECKING:
    from azyx.device import Buffer, Device
    from azyx.graph import Node, StridedView

T = TypeVar("T")


class Handle(Protocol):
    """What the async path needs of a tensor: the id of its node in the graph (tensor.py, above, is the API)."""

    id: int
# a graph heavier than this is planned on a worker thread: planning costs ~70 us a node and ~0.5 ms more a reduce
INLINE_PLAN_WEIGHT, REDUCE_WEIGHT = 16, 8
# seconds of realizes' work in a row on a crowded loop (half of a 1 ms tick: the crowd's graph building, which no
# realize can pace, comes on top), and how many ready handles are a crowd
BURST, CROWD = 0.5e-3, 8
LOOP_COPY_BYTES = 1 << 20  # a host copy this large (~0.1 ms at 10 GB/s, more on a busy machine) runs on a worker
SPIN_MISSES = 3  # a plan whose work outlasted the device's spin window this many times in a row is not polled for


async def realize(*tensors: Handle) -> None:
    """Compute all `tensors` in one plan; returns when their buffers are ready."""
    plan, _, _ = await submit(tensors)
    await wait_for([GRAPH[t.id].buffer for t in tensors], plan)  # type: ignore[misc]


async def submit(tensors: Sequence[Handle]) -> tuple[ExecutionPlan | None, Walk | None, list[Buffer]]:
    """Plan (or find the cached plan), compile and submit the computation of the unrealized `tensors`, which become
    leaves holding buffers that are ready once their work is done. Returns the plan that ran, its walk and the
    buffers bound to the walk's leaves (None, None, [] when everything was realized already)."""
    rt = RT
    await _pace()
    while True:
        targets = list(dict.fromkeys(t.id for t in tensors if GRAPH[t.id].buffer is None))
        if not targets:
            return None, None, []
        walk = canonicalize(GRAPH, targets)
        plan = rt.plan_cache.get(walk.key)
        if plan is not None:
            rt.plan_cache.touch(plan)
            break
        if _plan_weight(walk) <= INLINE_PLAN_WEIGHT:
            plan = make_plan(rt, GRAPH, walk, targets)
        else:  # planning and rendering a big graph takes milliseconds: a worker plans a copy of its nodes
            copy = GraphCopy(GRAPH, [*walk.topo, *walk.leaves])
            plan = await in_worker_thread(make_plan, rt, copy, Walk(copy, walk.key, walk.topo, walk.leaves, targets,
                                                                    walk.scalars, walk.scalar_of, walk.donated),
                                          targets)
        plan = await rt.compile(plan)  # (its kernels searched, with search on); the graph may change: walk it again
        rt.plan_cache[walk.key] = plan
        await _pace()  # (the realizes that waited for this compile wake together)
    bindings = [GRAPH[i].buffer for i in walk.leaves]
    try:
        outs = run_plan(plan, bindings, lambda slot: GRAPH[walk.leaves[slot]], walk.scalars)  # type: ignore[arg-type]
    except AzyxError:  # an allocation refused, a failed device: the targets stay unrealized; once what the run
        ex = rt.executor  # had submitted has run, every buffer it took is back in its pool (the error says so)
        partial, ex.partial = ex.partial, None
        await ex.settle(partial)
        raise
    for tid, (buf, view) in zip(targets, outs):
        GRAPH.become_leaf(tid, buf, view)
    return plan, walk, bindings  # type: ignore[return-value]


class _Burst:
    """A run of realizes' work on one asyncio loop without its due timers getting a turn (see `_pace`), and the
    realizes waiting for a later run, in order (`again`: woken ones that found the run over, to go first)."""

    __slots__ = ("start", "open", "passed", "waiters", "again")

    def __init__(self) -> None:
        self.start, self.open, self.passed = 0.0, False, 0
        self.waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self.again: list[asyncio.Future[None]] = []

    def end(self) -> None:
        """The run is over (the due timers have had their turn): wake as many waiters as the run let through, and
        one more (they run in the next iteration, in order; those past the next run's time wait again)."""
        self.open = False
        self.waiters.extendleft(reversed(self.again))
        self.again.clear()
        wake, self.passed = self.passed + 1, 0
        while self.waiters and wake:
            fut = self.waiters.popleft()
            if not fut.done():  # (a cancelled realize's)
                fut.set_result(None)
                wake -= 1


# per loop, as an attribute of the loop itself: its waiters' futures refer to their loop, so a table keyed by loops
# (weakly) kept any loop that closed with a waiter still queued (a task destroyed, never resumed), with all it held
_BURST_ATTR = "_azyx_burst"


async def _pace() -> None:
    """Keep a crowd of realizes that became ready together (200 requests started by one gather) from holding the loop:
    asyncio runs every handle that was ready when an iteration began before the timers that fell due, so each of them
    doing its share of work (walk, plan hand-off, submit) would delay everyone else's timers by the sum. Once they
    have worked `BURST` seconds in a row, the rest wait, in order, for a later iteration, after the due timers have
    run (the end of a run wakes about as many as the last one let through: a crowd costs a wake-up or two per
    realize, not one per iteration).
    A realize alone on the loop (the common case) pays one look at the ready queue."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:  # trio: its scheduler interleaves tasks and timers itself
        return
    ready = getattr(loop, "_ready", None)
    burst: _Burst | None = getattr(loop, _BURST_ATTR, None)
    if ready is None or (len(ready) < CROWD and (burst is None or not burst.waiters)):
        return
    if burst is None:
        burst = _Burst()
        try:
            setattr(loop, _BURST_ATTR, burst)
        except AttributeError:  # a loop without a __dict__ (none with a `_ready` queue is known): no pacing
            return
    woken = False
    while True:
        now = time.perf_counter()
        if not burst.open:
            burst.open, burst.start = True, now
            loop.call_later(0, burst.end)  # runs with the timers that fall due now: after everyone ready before it
            break
        if now - burst.start <= BURST:
            break
        fut = loop.create_future()
        queue = burst.again if woken else burst.waiters
        queue.append(fut)
        try:
            await fut
        except asyncio.CancelledError:  # out of the queue: its future would keep the loop (the table's key) alive
            if fut in queue:
                queue.remove(fut)
            raise
        woken = True
    burst.passed += 1


def _plan_weight(walk: Walk) -> int:
    """What planning the walk's graph costs, in nodes (a reduce weighs more: several kernel shapes are tried)."""
    if len(walk.topo) > INLINE_PLAN_WEIGHT:
        return len(walk.topo)
    weight = 0
    for i in walk.topo:
        weight += REDUCE_WEIGHT if GRAPH[i].op is Op.REDUCE else 1
    return weight


def run_plan(plan: ExecutionPlan, bindings: list[Buffer], leaf: Callable[[int], Node | None],
             scalars: list[Any] | tuple[Any, ...] = ()) -> list[tuple[Buffer, StridedView]]:
    """Submit `plan` with `bindings` as its inputs and `scalars` as its scalars' values; returns the targets' buffers
    and views. Host data the plan uploads for an input stays on the device: `leaf(slot)`, the input's node, keeps the
    uploaded buffer (None: nobody does)."""
    outs, adopted = RT.executor.run(plan, bindings, scalars)
    for (slot, _), buf in zip(plan.adopt, adopted):
        if (n := leaf(slot)) is not None:
            n.buffer = buf
    return outs


# per plan and device: how many times in a row the plan's work outlasted the device's spin window (see wait_for)
_spin_misses: weakref.WeakKeyDictionary[ExecutionPlan, dict[str, int]] = weakref.WeakKeyDictionary()


async def wait_for(bufs: list[Buffer], plan: ExecutionPlan | None = None) -> None:
    """Wait until every buffer of `bufs` is ready (one wait per device: its queue is in order, so its latest value
    covers every earlier one), then raise the first failure of the work that wrote them (their runs' records: work
    of other runs on the same devices is not this wait's business). The work of a small plan is often done
    by now, or within a few microseconds: `poll` sees that without a wake-up from a device thread (about 70 us on
    a VM). It may query for up to the device's `spin` seconds, but only while the loop has nothing else to run and
    only for a plan whose work has not outlasted that window `SPIN_MISSES` times in a row."""
    last: dict[Device, int] = {}
    for buf in bufs:
        if buf.ready > last.get(buf.device, -1):
            last[buf.device] = buf.ready
    for dev, ready in last.items():
        if dev.timeline.value < ready:
            misses = _spin_misses.get(plan) if dev.spin and plan is not None else None
            if misses is None and dev.spin and plan is not None:
                misses = _spin_misses[plan] = {}
            if misses is not None and misses.get(dev.name, 0) < SPIN_MISSES and _loop_idle():
                misses[dev.name] = 0 if dev.poll(ready, dev.spin) else misses.get(dev.name, 0) + 1
            else:
                dev.poll(ready)
        if dev.timeline.value < ready:
            await dev.timeline.wait(ready)  # (raises DeviceFailedError when the device has failed)
    records = {id(r): r for b in bufs if (r := b.run) is not None and not r.clean}
    for rec in records.values():
        for dev, (_, hi) in rec.spans.items():  # the rest of the run's work (on devices the buffers are not on)
            if dev.timeline.value < hi:
                await dev.timeline.wait(hi)
        if (err := rec.failure()) is not None:
            raise fresh_copy(err)


def _loop_idle() -> bool:
    """Whether the running asyncio loop has no callback ready to run (it would sleep next); False under trio and
    loops without that queue."""
    try:
        ready = getattr(asyncio.get_running_loop(), "_ready", None)
    except RuntimeError:
        return False
    return ready is not None and not ready


async def to_numpy(t: Handle) -> np.ndarray:
    await realize(t)
    n = GRAPH[t.id]
    assert n.view is not None
    buf, view, shape, dtype = buffer_of(n), n.view, n.shape, n.dtype
    dev = buf.device
    if not dev.host_memory and not dev.storage:  # a device with a queue: read in its order, await the timeline
        # a crowd of realizes whose work finished together wakes in one loop iteration: their reads are paced too
        await _pace()
        host = np.empty(buf.nbytes, np.uint8)
        before = dev.queued()
        v = dev.copy_to_host(buf, host, [])
        if v is not None:
            await dev.timeline.wait(v)
            if (err := dev.failure_in(before, v)) is not None:
                raise fresh_copy(err)
            size = prod(shape) * dtype.itemsize
            if dtype is not dtypes.bfloat16 and view.is_contiguous(shape) and LOOP_COPY_BYTES <= buf.nbytes <= 2 * size:
                # the fresh array the device wrote becomes the caller's: no second copy of a large buffer
                return host[view.offset * dtype.itemsize:][:size].view(dtype.np).reshape(shape)
            if buf.nbytes < LOOP_COPY_BYTES:
                return host_read(host, view, shape, dtype)
            return await in_worker_thread(host_read, host, view, shape, dtype)
    if buf.nbytes >= LOOP_COPY_BYTES or dev.storage:  # large copies and file reads leave the loop free
        return await in_worker_thread(buf.device.read, buf, view, shape, dtype)
    return buf.device.read(buf, view, shape, dtype)


_local = threading.local()


def run_sync(coro: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine to completion for scripts; refuses inside a running event loop."""
    try:
        asyncio.get_running_loop()
        running = True
    except RuntimeError:
        running = False
    if not running:
        try:
            import sniffio

            sniffio.current_async_library()
            running = True
        except Exception:
            running = False
    if running:
        coro.close()
        raise RuntimeStateError("realize_sync()/numpy_sync() called inside a running event loop; "
                                "use `await t.realize()` / `await t.numpy()` there")
    loop = getattr(_local, "loop", None)
    if loop is None or loop.is_closed():
        loop = _local.loop = asyncio.new_event_loop()
    return loop.run_until_complete(coro)
