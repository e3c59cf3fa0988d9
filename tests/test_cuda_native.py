"""The CUDA device's native queue and lanes (azyx/csrc/queue.c, lane.c) against the Python path they replay: the same
runs of a one-kernel plan through `native.Lane` and through the executor's batch path (the lane taken away), then
`poll` through `native.Queue` and through CUDADevice's Python (the native queue taken away), from the same settled
state, give the same values, buffers, records and queue bookkeeping. The queue's state is its own: the device reads
its counters and tables from it. Runs where a GPU is present (the lent H200); skipped elsewhere."""

from __future__ import annotations

import gc
from typing import Any

import numpy as np
import pytest

import azyx
from azyx import Tensor
from azyx.graph import GRAPH
from azyx.native import native
from azyx.runtime import RT
from azyx.walk import canonicalize

GPUS = [d for d in azyx.devices() if d.startswith("cuda:")]
pytestmark = pytest.mark.skipif(not GPUS, reason="no CUDA device")
RUNS = 5  # (fewer than UNWATCHED: every run's command stays unwatched until polled)


async def _settled(dev: Any, buf: Any) -> None:
    """Nothing queued, nothing held, and the device's waiter thread has handled every command it was handed: a read of
    `buf` last (its host-side `post` is the waiter thread's to run, so its value is reached only once that thread
    handled it)."""
    await RT.executor.synchronize_all()
    dev.read_into(buf, np.empty(buf.nbytes, np.uint8))
    gc.collect()
    dev.collect()
    assert dev.timeline.value == dev.submitted == dev.waited == dev.queue.watched


def _scalars(plan: Any, t: Tensor) -> list[Any]:
    """The scalars of `t`'s graph, whose plan is `plan`: what a run of it takes."""
    w = canonicalize(GRAPH, [t.id])
    assert RT.plan_cache.get(w.key) is plan
    return list(w.scalars)


def _runs(dev: Any, plan: Any, x: Tensor, make: Any, lane: bool) -> list[tuple[Any, ...]]:
    """RUNS runs of `plan` (the plan of `make(x, k)`) on `x`'s buffer with run k's scalars, through the lane or the
    executor's path; per run what it left: its values relative to the first's base, the queue's tables, the output's
    record, view and buffer."""
    xbuf = GRAPH.nodes[x.id].buffer
    prepared = RT.executor.prepared[plan]
    kept, prepared.lane = prepared.lane, (prepared.lane if lane else None)
    base = dev.submitted
    seen = []
    try:
        for k in range(RUNS):
            outs, uploads = RT.executor.run(plan, [xbuf], _scalars(plan, make(x, k)))
            assert not uploads
            (buf, view), = outs
            seen.append((dev.submitted - base, buf.ready - base, dev.timeline.value >= dev.submitted,
                         sorted(v - base for v in dev.queue.holding if v > base),
                         sorted(v - base for v in dev.queue.events if v > base),
                         [v - base for _, v in dev.queue.unwatched if v > base],
                         {d.name: (a - base, b - base) for d, (a, b) in buf.run.spans.items()},
                         buf.run.parents == [], view, buf))
    finally:
        prepared.lane = kept
    return seen


async def test_a_lane_replays_what_the_python_batch_path_does() -> None:
    """The same one-kernel plan run through `native.Lane` and through the executor's path (begin_batch, alloc,
    launch_many, end_batch): the same values reserved, the same commands held and unwatched, the same records, spans
    and views, and numpy's results in both."""
    if native is None:
        pytest.skip("AZYX_NATIVE=0: no lane")
    dev = RT.device("cuda:0")
    xn = np.random.default_rng(3).standard_normal(4096).astype(np.float32)
    x = Tensor(xn, device="cuda:0")
    await x.realize()
    def make(t: Tensor, k: int) -> Tensor:
        return (t * (0.5 * k + 0.25) - 1).relu()  # (no factor of 0 or 1: the same plan each run)

    for k in (6, 7):  # (the first run adopts x's upload; the second plans with x on the device)
        await make(x, k).realize()
    probe = make(x, 8)
    plan = RT.plan_cache.get(canonicalize(GRAPH, [probe.id]).key)
    assert plan is not None and len(plan.kernels) == 1
    assert RT.executor.prepared[plan].lane is not None
    xbuf = GRAPH.nodes[x.id].buffer
    results = {}
    for lane in (True, False):
        await _settled(dev, xbuf)
        results[lane] = _runs(dev, plan, x, make, lane)
        await _settled(dev, xbuf)
    assert [r[:-1] for r in results[True]] == [r[:-1] for r in results[False]]
    for lane in (True, False):
        for k, r in enumerate(results[lane]):
            buf, view = r[-1], r[-2]
            got = np.empty(buf.nbytes, np.uint8)
            dev.read_into(buf, got)
            want = np.maximum(xn * np.float32(0.5 * k + 0.25) - 1, 0)
            at = view.offset
            np.testing.assert_allclose(got.view(np.float32)[at:at + want.size], want, rtol=1e-5, atol=1e-5)


async def test_queue_poll_does_what_the_python_poll_does() -> None:
    """`poll` of the last of a few unwatched commands, through native.Queue and through CUDADevice's Python, from the
    same settled state: both see it complete (spinning up to a second), advance the timeline to it and drop the
    completed unwatched commands and what they held (the waiter thread has nothing older)."""
    if native is None:
        pytest.skip("AZYX_NATIVE=0: the Python poll alone")
    dev = RT.device("cuda:0")
    x = Tensor(np.arange(4096, dtype=np.float32), device="cuda:0")
    await x.realize()
    def make(t: Tensor, k: int) -> Tensor:
        return t * 3.0 + (k + 0.5)  # (no term of 0: the same plan each run)

    for k in (6, 7):  # (the first run adopts x's upload; the second plans with x on the device)
        await make(x, k).realize()
    probe = make(x, 8)
    plan = RT.plan_cache.get(canonicalize(GRAPH, [probe.id]).key)
    assert plan is not None
    xbuf = GRAPH.nodes[x.id].buffer
    states = []
    queue = dev.native_queue
    for native_poll in (True, False):
        await _settled(dev, xbuf)
        base = dev.submitted
        outs = [RT.executor.run(plan, [xbuf], _scalars(plan, make(x, k)))[0] for k in range(RUNS)]
        assert [v - base for _, v in dev.queue.unwatched] == list(range(1, RUNS + 1))
        dev.native_queue = queue if native_poll else None  # (None: CUDADevice.poll's Python)
        try:
            reached = dev.poll(dev.submitted, 1.0)
        finally:
            dev.native_queue = queue
        states.append((reached, dev.timeline.value - base, dev.waited - base, list(dev.queue.unwatched),
                       sorted(v - base for v in dev.queue.holding if v > base)))
        for k, ((buf, view),) in enumerate(outs):
            got = np.empty(buf.nbytes, np.uint8)
            dev.read_into(buf, got)
            at = view.offset
            want = np.arange(4096, dtype=np.float32) * 3 + (k + 0.5)
            np.testing.assert_array_equal(got.view(np.float32)[at:at + 4096], want)
        del outs
    assert states[0] == states[1] == (True, RUNS, RUNS, [], [])


def test_the_queue_state_is_the_native_queues_own() -> None:
    """With the native core the device's counters, open batch and tables are its native.Queue's (one value each, which
    C and Python both advance); without it, a Python record of the same fields."""
    from azyx.backends.cuda import _QueueState

    dev: Any = RT.device("cuda:0")
    state = dev.queue_state
    if native is None:
        assert type(state) is _QueueState and dev.native_queue is None
    else:
        assert state is dev.native_queue and type(state) is native.Queue
        for owner, table in ((dev.queue, "holding"), (dev.queue, "events"), (dev.queue, "unwatched"),
                             (dev, "free_events")):
            assert getattr(owner, table) is getattr(state, table)
            with pytest.raises(AttributeError):
                setattr(state, table, None)
    dev.queue.demanded = dev.queue.demanded + 0  # (through the event queue: the state's member)
    assert (dev.submitted, dev.waited, dev.queue.watched, dev.queue.demanded, dev.batch) == \
        (state.submitted, state.waited, state.handed, state.demanded, state.batch)
    assert (dev.queue.submitted, dev.queue.waited) == (state.submitted, state.waited)  # (the event queue's, too)
