"""The asynchronous path of one realize: canonical walk -> cached plan (or schedule + compile) -> submit ->
the targets become leaves -> wait for their timeline values on the event loop."""

from __future__ import annotations

import asyncio
import collections
import threading
import time
import weakref
from asyncio import _get_running_loop as _running_loop
from collections.abc import Callable, Coroutine, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import numpy as np

from azyx.device import buffer_of, host_read
from azyx.dtypes import dtypes
from azyx.errors import AzyxError, DTypeError, RuntimeStateError, fresh_copy
from azyx.graph import CHAINS, GRAPH, SHARED, GraphCopy, Op, prod, user_site
from azyx.plan import ExecutionPlan
from azyx.runtime import RT, InFlight, loop_identity
from azyx.schedule import make_plan
from azyx.walk import Walk, canonicalize
from azyx.workers import in_python_thread, in_worker_thread

if TYPE_CHECKING:
    from azyx.device import Buffer, Device
    from azyx.graph import Node, StridedView

T = TypeVar("T")
_nodes = GRAPH.nodes  # (indexed directly on the hot path: Graph.__getitem__ is a Python call)


class Handle(Protocol):
    """What the async path needs of a tensor: the id of its node in the graph (tensor.py, above, is the API)."""

    id: int
# a graph heavier than this is planned on a worker thread: planning costs ~150 us plus ~30 us a node, more for a large
# tensor's graph, and ~0.5 ms more a reduce (AMD EPYC: 8 elementwise nodes 0.33 ms; 13 nodes of a 64M-element graph
# took ~1 ms on the loop at a weight of 16; hosts of slower cores take twice that)
INLINE_PLAN_WEIGHT, REDUCE_WEIGHT = 8, 8
# seconds of realizes' work in a row on a crowded loop (a quarter of a 1 ms tick: the crowd's graph building, which
# no realize can pace, comes on top; against half a tick, 200 requests on c:0 (AMD EPYC) left a 1 ms timer late by
# 1.45-1.63 ms at the median of 15 runs instead of 1.74-1.81, and 1.75-1.93 at worst instead of 2.55-2.80, for 3-5%
# more total time), and how many ready handles are a crowd
BURST, CROWD = 0.25e-3, 16
FIRST_WAKE = 8  # how many waiters the end of a crowd's first run wakes (a run of BURST lets ~5 requests through)
LOOP_COPY_BYTES = 1 << 20  # a host copy this large (~0.1 ms at 10 GB/s, more on a busy machine) runs on a worker
SPIN_MAX = 1e-3  # the longest a realize queries for its work's completion on an idle loop (see wait_for)


async def realize(*tensors: Handle) -> None:
    """Compute all `tensors` in one plan; returns when their buffers are ready."""
    if RT.probing:  # a backend a tensor names is being probed (off the loop): plan once it has its devices
        await RT.probed()
    if (fut := _gate()) is not None:  # (before submit's coroutine: a crowd's first loop iteration holds 200 of these)
        await _pace(fut)
    try:
        got = _submit_cached(tensors)  # (a cached plan's run needs no coroutine of submit's)
    except AzyxError:
        await _settle_partial()
        raise
    if isinstance(got, _OffLoop):  # (a long run: on a worker thread)
        got = await got.run()
    elif isinstance(got, _MISS_OR_RESERVE):  # (a new plan to make, or large buffers to reserve first: submit does it)
        got = await submit(tensors, True, got if isinstance(got, _Miss) else None)
    plan = got[0]
    bufs: list[Buffer] = [_nodes[t.id].buffer for t in tensors]  # type: ignore[misc,union-attr]
    if not done(bufs):
        await wait_for(bufs, plan)


def flat_targets(items: Sequence[Any]) -> tuple[Handle, ...]:
    """Tensors, and lists and tuples of them (nested), as one flat tuple in order (what `azyx.realize` takes);
    anything else raises DTypeError naming it."""
    out: list[Handle] = []
    for x in items:
        if isinstance(x, list | tuple):
            out.extend(flat_targets(x))
        elif isinstance(getattr(x, "id", None), int):
            out.append(x)
        else:
            raise DTypeError(f"realize takes tensors, and lists and tuples of them; got {type(x).__name__} {x!r:.60}")
    return tuple(out)


Submitted = tuple["ExecutionPlan | None", "Walk | None", "list[Buffer]"]
RESERVE_BYTES = 16 << 20  # a plan whose large new buffers on a device add up to this many bytes reserves them first

# per plan that needs it: per device, the large buffers (Device.reserve_min and up) its run makes (see _Reserve)
_reserves: weakref.WeakKeyDictionary[ExecutionPlan, list[tuple[Any, list[int]]]] = weakref.WeakKeyDictionary()


class _Reserve:
    """A cached plan's large new buffers, to be made on a worker thread before its run takes them from the pools
    (their driver allocations would hold the loop's thread: `Device.reserve`)."""

    __slots__ = ("needs",)

    def __init__(self, needs: list[tuple[Any, list[int]]]) -> None:
        self.needs = needs

    def __call__(self) -> None:
        for dev, sizes in self.needs:
            dev.reserve(sizes)


class _Miss:
    """A walk the plan cache lacks, and what it saw: the targets' nodes and the leaves' buffers. If the graph below the
    targets is unchanged once the plan is made (`unchanged`), the plan runs on this walk: a miss walks the graph
    once."""

    __slots__ = ("walk", "nodes", "bufs")

    def __init__(self, walk: Walk) -> None:
        self.walk = walk
        self.nodes = [_nodes[i] for i in walk.targets]
        self.bufs = [_nodes[i].buffer for i in walk.leaves]  # type: ignore[union-attr]

    def unchanged(self, tensors: Sequence[Handle]) -> bool:
        """Whether walking `tensors` now would give this walk: the same target nodes (no tensor rebound, no node
        freed and its id reused), none of its nodes realized meanwhile (each unrealized node holds its sources, so
        the nodes below are the same too), the same buffer on every leaf (none uploaded meanwhile), and no
        assignment whose writing in place (in the key) may have changed with another reference to its base."""
        walk = self.walk
        if _targets(tensors) != walk.targets:
            return False
        for i, n in zip(walk.targets, self.nodes):
            if _nodes[i] is not n:
                return False
        for i in walk.topo:  # (a node realized meanwhile may have freed its sources, which come first)
            n = _nodes[i]
            if n is None or n.buffer is not None or n.op is Op.ASSIGN:
                return False
        for i, b in zip(walk.leaves, self.bufs):
            n = _nodes[i]
            if n is None or n.buffer is not b:
                return False
        return True


# the plans whose runs are long Python work (`UnifiedExecutor.runs_long`: a load queueing hundreds of staged copies)
_long_runs: weakref.WeakSet[ExecutionPlan] = weakref.WeakSet()


class _OffLoop:
    """A cached plan's run that is long Python work (`UnifiedExecutor.runs_long`: a load queueing hundreds of staged
    copies), for `run` to submit on a worker thread: the loop's thread does only the bookkeeping (the walk, then its
    targets made leaves). A target realized meanwhile (another realize of it) keeps that buffer."""

    __slots__ = ("plan", "walk", "bindings")

    def __init__(self, plan: ExecutionPlan, walk: Walk) -> None:
        self.plan, self.walk = plan, walk
        self.bindings = [_nodes[i].buffer for i in walk.leaves]  # type: ignore[union-attr]

    async def run(self) -> Submitted:
        plan, walk = self.plan, self.walk
        try:
            outs = await in_python_thread(run_plan, plan, self.bindings, lambda slot: None, walk.scalars)
        except AzyxError:
            await _settle_partial()
            raise
        for tid, (buf, view) in zip(walk.targets, outs):
            if _nodes[tid].buffer is None:  # type: ignore[union-attr]
                GRAPH.become_leaf(tid, buf, view)
        return plan, walk, self.bindings  # type: ignore[return-value]


_MISS_OR_RESERVE = (_Miss, _Reserve, _OffLoop)


def _note_reserves(rt: Any, plan: ExecutionPlan) -> None:
    """Remember, for a new plan, the large buffers its runs make on devices where that is slow (`reserve_min`)."""
    by_dev: dict[Any, list[int]] = {}
    started = rt.started_devices()
    for s in plan.slots:
        if s.kind in ("temp", "output"):
            dev = started.get(s.device)
            if dev is not None and dev.reserve_min and s.nbytes >= dev.reserve_min:
                by_dev.setdefault(dev, []).append(s.nbytes)
    needs = [(dev, sizes) for dev, sizes in by_dev.items() if sum(sizes) >= RESERVE_BYTES]
    if needs:
        _reserves[plan] = needs


def _reservation(needs: list[tuple[Any, list[int]]]) -> _Reserve | None:
    """The reservation a plan's run needs now: of its large buffers (`_reserves`), those their devices' pools do not
    cache (blocks of other sizes there serve none)."""
    short = [(dev, missing) for dev, sizes in needs if (missing := dev.allocator.uncached(sizes))]
    return _Reserve(short) if short else None


def _targets(tensors: Sequence[Handle]) -> list[int]:
    """The ids of the unrealized `tensors`, each once, in order."""
    if len(tensors) == 1:  # (one tensor, the common case: no generator, no dict)
        tid = tensors[0].id
        return [tid] if _nodes[tid].buffer is None else []  # type: ignore[union-attr]
    return list(dict.fromkeys(t.id for t in tensors if _nodes[t.id].buffer is None))  # type: ignore[union-attr]


def _submit_cached(tensors: Sequence[Handle], reserved: bool = False) -> Submitted | _Miss | _Reserve | _OffLoop:
    """submit's common case, without a coroutine: the unrealized `tensors`' graph walked and, when its plan is cached,
    submitted (see submit); else the walk (a `_Miss`), for submit to plan; or, for a cached plan whose large new
    buffers the pools lack (and `reserved` false), what to reserve first (off the loop, then walked again); or a long
    run to submit off the loop (`_OffLoop`)."""
    targets = _targets(tensors)
    if not targets:
        return None, None, []
    walk = canonicalize(GRAPH, targets)
    cache = RT.plan_cache
    plan = cache.get(walk.key)
    if plan is None:
        return _Miss(walk)
    cache.touch(plan)
    return _run_walk(plan, walk, reserved)


def _run_walk(plan: ExecutionPlan, walk: Walk, reserved: bool) -> Submitted | _Reserve | _OffLoop:
    """Submit `plan` for the graph `walk` walked (its targets then become leaves), or, where its large new buffers
    must be reserved first (and `reserved` false), what to reserve; or, on an asyncio loop, a long run to submit off
    the loop's thread (`_OffLoop`)."""
    if _long_runs and plan in _long_runs and _running_loop() is not None:  # (its worker makes its buffers too)
        return _OffLoop(plan, walk)
    if _reserves and not reserved and (needs := _reserves.get(plan)) and (r := _reservation(needs)) is not None:
        return r
    bindings = []  # (a loop: a comprehension is a call of its own on Python 3.11)
    for i in walk.leaves:
        bindings.append(_nodes[i].buffer)  # type: ignore[union-attr]
    outs = run_plan(plan, bindings, lambda slot: GRAPH[walk.leaves[slot]], walk.scalars)  # type: ignore[arg-type]
    for tid, (buf, view) in zip(walk.targets, outs):
        GRAPH.become_leaf(tid, buf, view)
    return plan, walk, bindings  # type: ignore[return-value]


async def _settle_partial() -> None:
    """After a run that raised part way (an allocation refused, a failed device; the targets stay unrealized): once
    what it had submitted has run, every buffer it took is back in its pool (the error says so)."""
    ex = RT.executor
    partial, ex.partial = ex.partial, None
    await ex.settle(partial)


async def submit(tensors: Sequence[Handle], gated: bool = False, miss: _Miss | None = None) -> Submitted:
    """Plan (or find the cached plan), compile and submit the computation of the unrealized `tensors`, which become
    leaves holding buffers that are ready once their work is done. Returns the plan that ran, its walk and the
    buffers bound to the walk's leaves (None, None, [] when everything was realized already). `gated`: the caller
    has had its turn on a crowded loop already (`_gate`); `miss`: the caller's walk of a graph the cache lacked."""
    rt = RT
    if rt.probing:
        await rt.probed()
    if not gated and (fut := _gate()) is not None:
        await _pace(fut)
    reserved = False
    while True:
        if miss is None:
            try:
                got = _submit_cached(tensors, reserved)
            except AzyxError:
                await _settle_partial()
                raise
            if isinstance(got, _Reserve):  # (made on a worker, then walked again: once)
                await in_worker_thread(got)
                reserved = True
                continue
            if isinstance(got, _OffLoop):
                return await got.run()
            if not isinstance(got, _Miss):
                return got
            miss = got
        walk = miss.walk
        key = walk.key
        # a crowd of realizes of one new graph (200 requests that differ only in their scalars) plans it once: the
        # others wait for that plan (each planning it on a worker thread of its own, 200 threads of Python work held
        # the loop's thread off the GIL for ~100 ms on an H200's host)
        loop_id = loop_identity()
        job = rt.planning.get(key)
        if job is not None and job.loop == loop_id:
            await job.event.wait()
            if job.error is not None:  # (its plan or compile failed: so does this realize)
                raise fresh_copy(job.error)
            if (fut := _gate()) is not None:
                await _pace(fut)
            miss = None
            continue  # (the graph may have changed meanwhile: walk it again)
        job = rt.planning[key] = InFlight(loop_id)
        try:
            plan = rt.plan_cache[key] = await _plan(rt, walk, walk.targets)
        except Exception as e:  # (a cancelled realize is no failure: whoever waited plans anew)
            job.error = e
            raise
        finally:
            if rt.planning.get(key) is job:
                del rt.planning[key]
            job.event.set()
        if (fut := _gate()) is not None:  # (the realizes that waited for this compile wake together)
            await _pace(fut)
        if miss.unchanged(tensors):  # (the usual case: the plan runs on the walk it was made from)
            try:
                ran = _run_walk(plan, walk, reserved)
            except AzyxError:
                await _settle_partial()
                raise
            if isinstance(ran, _OffLoop):
                return await ran.run()
            if not isinstance(ran, _Reserve):
                return ran
            await in_worker_thread(ran)
            reserved = True
        miss = None  # (walked again, as the graph changed meanwhile or buffers were reserved: it finds the plan now)


async def _plan(rt: Any, walk: Walk, targets: list[int]) -> ExecutionPlan:
    """The plan of a walk the cache lacks, its kernels compiled (and searched, with search on)."""
    rt.planned += 1
    CHAINS.note(GRAPH.nodes, walk.topo, user_site)  # (a chain that grows across realizes warns once)
    if _plan_weight(walk) <= INLINE_PLAN_WEIGHT:
        plan = make_plan(rt, GRAPH, walk, targets)
    else:  # planning and rendering a big graph takes milliseconds: a worker plans a copy of its nodes
        copy = GraphCopy(GRAPH, [*walk.topo, *walk.leaves])
        plan = await in_python_thread(make_plan, rt, copy, Walk(copy, walk.key, walk.topo, walk.leaves, targets,
                                                                walk.scalars, walk.scalar_nodes, walk.donated), targets)
    plan = await rt.compile(plan)  # (the graph may change meanwhile: the caller walks it again)
    _note_reserves(rt, plan)
    if not plan.adopt and rt.executor.runs_long(plan):
        _long_runs.add(plan)
    return plan


class _Burst:
    """A run of realizes' work on one asyncio loop without its due timers getting a turn (see `_pace`), its length
    (`limit`, seconds), and the realizes waiting for a later run, in order (`again`: woken ones that found the run
    over, to go first)."""

    __slots__ = ("start", "open", "passed", "limit", "waiters", "again")

    def __init__(self) -> None:
        self.start, self.open, self.passed, self.limit = 0.0, False, 0, BURST
        self.waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self.again: list[asyncio.Future[None]] = []

    def end(self) -> None:
        """The run is over (the due timers have had their turn): wake as many waiters as the run let through, and
        one more (they run in the next iteration, in order; those past the next run's time wait again); after a
        crowd's first run, which let one through, as many as a run lets through about."""
        self.open = False
        self.waiters.extendleft(reversed(self.again))
        self.again.clear()
        wake, self.passed = self.passed + 1 if self.limit else FIRST_WAKE, 0
        while self.waiters and wake:
            fut = self.waiters.popleft()
            if not fut.done():  # (a cancelled realize's)
                fut.set_result(None)
                wake -= 1


# per loop, as an attribute of the loop itself: its waiters' futures refer to their loop, so a table keyed by loops
# (weakly) kept any loop that closed with a waiter still queued (a task destroyed, never resumed), with all it held
_BURST_ATTR = "_azyx_burst"


def _gate(woken: bool = False) -> asyncio.Future[None] | None:
    """A realize's turn on a crowded asyncio loop (see `_pace`): None when it may go on now (no crowd is ready and no
    earlier realize waits, or the current run of realizes' work has time left: it then counts in that run), else a
    future queued in order, for `_pace` to wait on (`woken`: a realize woken already that found the run over, which
    goes first next time). A realize alone on the loop (the common case) pays this look at the ready queue, no
    coroutine."""
    loop = _running_loop()
    if loop is None:  # trio: its scheduler interleaves tasks and timers itself
        return None
    ready = getattr(loop, "_ready", None)
    if ready is None:
        return None
    burst: _Burst | None = getattr(loop, _BURST_ATTR, None)
    if not woken and len(ready) < CROWD and (burst is None or not burst.waiters):
        return None
    if burst is None:
        burst = _Burst()
        try:
            setattr(loop, _BURST_ATTR, burst)
        except AttributeError:  # a loop without a __dict__ (none with a `_ready` queue is known): no pacing
            return None
    now = time.perf_counter()
    if not burst.open:
        # a crowd that has just formed (no one waits) lets only this realize through now: the loop iteration it
        # formed in holds all of its requests' own work up to their realizes already (their graph building)
        burst.open, burst.start = True, now
        burst.limit = BURST if woken or burst.waiters or burst.again else 0.0
        loop.call_later(0, burst.end)  # runs with the timers that fall due now: after everyone ready before it
    elif now - burst.start > burst.limit:
        fut = loop.create_future()
        (burst.again if woken else burst.waiters).append(fut)
        return fut
    burst.passed += 1
    return None


async def _pace(fut: asyncio.Future[None] | None) -> None:
    """Keep a crowd of realizes that became ready together (200 requests started by one gather) from holding the loop:
    asyncio runs every handle that was ready when an iteration began before the timers that fell due, so each of them
    doing its share of work (walk, plan hand-off, submit) would delay everyone else's timers by the sum. Once they
    have worked `BURST` seconds in a row, the rest wait, in order, for a later iteration, after the due timers have
    run (the end of a run wakes about as many as the last one let through: a crowd costs a wake-up or two per
    realize, not one per iteration). `fut`: the turn `_gate` queued; waited for, and again while a woken realize
    finds the run over."""
    while fut is not None:
        try:
            await fut
        except asyncio.CancelledError:  # out of the queue: its future would keep the loop (the table's key) alive
            burst: _Burst | None = getattr(asyncio.get_running_loop(), _BURST_ATTR, None)
            for queue in (burst.waiters, burst.again) if burst is not None else ():
                if fut in queue:
                    queue.remove(fut)
            raise
        fut = _gate(woken=True)


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
    uploaded buffer (None: nobody does). Where other work is ready in the running asyncio loop's iteration (a crowd of
    realizes, each submitting in turn), the executor may gather this run with theirs (UnifiedExecutor.run's `crowd`)."""
    loop = _running_loop()
    ex = RT._executor or RT.executor  # (the property's answer once started, without its call)
    outs, adopted = ex.run(plan, bindings, scalars, loop if getattr(loop, "_ready", None) else None)
    for i in plan.aliased:
        SHARED.add(outs[i][0])
    for (slot, _), buf in zip(plan.adopt, adopted):
        if (n := leaf(slot)) is not None:
            n.buffer = buf
    return outs


# per plan and device: how long its work took when last seen, from the wait's start until it was done (see wait_for)
_work_times: weakref.WeakKeyDictionary[ExecutionPlan, dict[str, float]] = weakref.WeakKeyDictionary()


def done(bufs: list[Buffer]) -> bool:
    """Whether every buffer of `bufs` is ready and the work that wrote them is known to have succeeded (a failure is
    raised), without waiting: a small plan that ran inline is done by now, and a small plan's work on a GPU often is
    by the time its realize asks (one query of the device, `poll`); either awaits no `wait_for`."""
    for buf in bufs:
        if buf.device.timeline.value < buf.ready and not buf.device.poll(buf.ready):
            return False
    for buf in bufs:
        rec = buf.run
        if rec is not None and not rec.clean:
            if (err := rec.failure()) is not None:
                raise fresh_copy(err)
            if not rec.clean:
                return False
    return True


async def wait_for(bufs: list[Buffer], plan: ExecutionPlan | None = None) -> None:
    """Wait until every buffer of `bufs` is ready (one wait per device: its queue is in order, so its latest value
    covers every earlier one), then raise the first failure of the work that wrote them (their runs' records: work
    of other runs on the same devices is not this wait's business). A device that completes work lazily (`spin`: CUDA)
    is asked first: a small plan's work is often done within microseconds, and a wake-up from its waiter thread costs
    about 60 us more. While the loop has nothing else to run it queries for as long as the plan's work took last time
    (1.5x, at least the device's `spin`, at most SPIN_MAX and never past the loop's next timer)."""
    last: dict[Device, int] = {}
    for buf in bufs:
        if buf.ready > last.get(buf.device, -1):
            last[buf.device] = buf.ready
    gathering = RT.executor.gathering
    if gathering and any(dev in gathering for dev in last):
        # the work is in a crowd's gather, which the loop submits next (UnifiedExecutor._gather): then ask the device
        # (a gather run inline is done by then; the crowd's last realize may spin for the rest, and wakes the others)
        await asyncio.sleep(0)
    start = time.perf_counter()
    for dev, ready in last.items():
        if dev.timeline.value >= ready:
            continue
        times = None
        if dev.spin and plan is not None:
            times = _work_times.get(plan)
            if times is None:
                times = _work_times[plan] = {}
            took = times.get(dev.name)
            window = dev.spin if took is None else 1.5 * took if took <= SPIN_MAX else 0.0
            window = _idle_window(max(window, dev.spin) if window else SPIN_MAX)
            if dev.poll(ready, window if took is None or took <= SPIN_MAX else 0.0):
                times[dev.name] = time.perf_counter() - start
                continue
            if not window:  # the loop has other work: how long this wait takes says nothing of the plan's
                times = None
        elif dev.poll(ready):
            continue
        await dev.timeline.wait(ready)  # (raises DeviceFailedError when the device has failed)
        if times is not None:  # (an overestimate by the wake-up: work near SPIN_MAX stops being spun for)
            times[dev.name] = time.perf_counter() - start
    records = {id(r): r for b in bufs if (r := b.run) is not None and not r.clean}
    for rec in records.values():
        for dev, (_, hi) in rec.spans.items():  # the rest of the run's work (on devices the buffers are not on)
            if dev.timeline.value < hi:
                await dev.timeline.wait(hi)
        if (err := rec.failure()) is not None:
            raise fresh_copy(err)


def _idle_window(limit: float) -> float:
    """How long the running asyncio loop can be held without delaying anything: 0 when a callback is ready to run,
    else until its next timer is due, at most `limit` seconds (0 under trio and loops without those queues)."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return 0.0
    if getattr(loop, "_ready", True):
        return 0.0
    timers = getattr(loop, "_scheduled", None)  # (a heap: the first is due first)
    if timers is None:
        return 0.0
    if timers:
        limit = min(limit, timers[0].when() - loop.time())
    return limit


async def to_numpy(t: Handle) -> np.ndarray:
    if (fut := _gate()) is not None:  # (before submit's coroutine: a crowd's first loop iteration holds 200 of these)
        await _pace(fut)
    try:
        got = _submit_cached((t,))  # (realize's body: no coroutine of submit's for a cached plan)
    except AzyxError:
        await _settle_partial()
        raise
    if isinstance(got, _MISS_OR_RESERVE):
        got = await submit((t,), True, got if isinstance(got, _Miss) else None)
    plan = got[0]
    n = _nodes[t.id]
    assert n is not None
    bufs = [buffer_of(n)]
    dev = bufs[0].device
    if dev.host_memory or dev.storage:
        return await _read_realized(n, bufs, plan)
    # a device with a queue reads in its order, right behind the work that writes the buffer: one wait for both (a
    # crowd of realizes whose work finished together wakes in one loop iteration: their reads are paced too)
    if (fut := _gate()) is not None:
        await _pace(fut)
    if getattr(loop := _running_loop(), "_ready", None):
        RT.executor.gather_read(dev, loop)  # (a crowd's reads: one command with its runs, where the device can)
    return await _read_queued(n, bufs, plan)


async def _read_realized(n: Any, bufs: list[Any], plan: ExecutionPlan | None = None) -> np.ndarray:
    """The bytes of node `n` (its buffer `bufs`) on a host-memory (or storage) device, once the work that writes them
    is done (that work's failure raised): nothing to submit, so no pacing (as `_read_queued`). Read here, or (a large
    copy, a file's read) on a worker thread: the loop stays free."""
    if not done(bufs):
        await wait_for(bufs, plan)
    assert n.view is not None
    buf, view, shape, dtype = bufs[0], n.view, n.shape, n.dtype
    if buf.nbytes >= LOOP_COPY_BYTES or buf.device.storage:
        return await in_worker_thread(buf.device.read, buf, view, shape, dtype)
    return buf.device.read(buf, view, shape, dtype)


def read_now(t: Handle) -> Coroutine[Any, Any, np.ndarray]:
    """`to_numpy` of a realized tensor whose copy is queued at this call, not when the coroutine first runs: on a device
    with a queue the read goes behind the work that writes the tensor and ahead of work queued after this call (a
    pipelined decode reads step N's tokens while step N+1 runs). Elsewhere the same as `to_numpy` (on a host-memory
    device, the bytes as they are once the work that writes them is done)."""
    n = _nodes[t.id]
    if n is None or n.buffer is None:
        return to_numpy(t)
    bufs = [buffer_of(n)]
    dev = bufs[0].device
    if dev.storage:
        return to_numpy(t)
    if dev.host_memory:
        return _read_realized(n, bufs)
    return _read_queued(n, bufs, None)


def _read_queued(n: Any, bufs: list[Any], plan: ExecutionPlan | None) -> Coroutine[Any, Any, np.ndarray]:
    """The read of node `n`'s buffer on a device with a queue, queued now (done or not, the work that writes it is
    ahead of it in the queue); then the run that wrote it answers for its failures (an index out of range, its work on
    other devices) before the bytes are handed out."""
    dev = bufs[0].device
    host = np.empty(bufs[0].nbytes, np.uint8)
    before = dev.queued()
    return _read_landed(n, bufs, plan, host, before, dev.copy_to_host(bufs[0], host, []))


async def _read_landed(n: Any, bufs: list[Any], plan: ExecutionPlan | None, host: np.ndarray, before: int,
                       v: int) -> np.ndarray:
    """`_read_queued`'s wait for its copy (value `v` of the device's timeline) and the bytes handed out."""
    buf, view, shape, dtype = bufs[0], n.view, n.shape, n.dtype
    dev = buf.device
    await dev.timeline.wait(v)
    if (err := dev.failure_in(before, v)) is not None:
        raise fresh_copy(err)
    if not done(bufs):
        await wait_for(bufs, plan)
    size = prod(shape) * dtype.itemsize
    if dtype is not dtypes.bfloat16 and view.is_contiguous(shape) and LOOP_COPY_BYTES <= buf.nbytes <= 2 * size:
        # the fresh array the device wrote becomes the caller's: no second copy of a large buffer
        return host[view.offset * dtype.itemsize:][:size].view(dtype.np).reshape(shape)
    if buf.nbytes < LOOP_COPY_BYTES:
        return host_read(host, view, shape, dtype)
    return await in_worker_thread(host_read, host, view, shape, dtype)


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
