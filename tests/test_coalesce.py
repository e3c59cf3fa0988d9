"""Concurrent realizes of one cached plan coalesce (issue 38 item 2): a crowd's runs that become ready in one loop
iteration are one submission of the device where its runner gathers them (c:N for plans whose work is handed to its
queue; CUDA, OpenCL, Vulkan), and each request still gets its own result, its own failure and its own cancellation.
On devices whose runner does not gather, the same crowds run one by one and give the same values."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

import azyx
from azyx import Tensor
from azyx.device import gatherable, work_devices
from azyx.graph import GRAPH
from azyx.native import native
from azyx.plan import TransferStep
from azyx.queues import WorkQueue
from azyx.runtime import RT
from azyx.timeline import TimelineSignal
from azyx.walk import canonicalize

N = 8  # requests in flight
SIZE = 1 << 17  # floats a request: work past a C device's inline_work, so that its runs are handed to the queue
rng = np.random.default_rng(38)


def gathers_on(device: str) -> bool:
    """Whether the device's runner gathers a crowd's runs of these requests' plans (the test then asserts that it
    did): C, OpenCL and Vulkan devices; CUDA only without the native core, since with it a plan of one kernel runs
    through its lane."""
    kind = RT.device(device).kind
    return kind in ("c", "opencl", "vulkan") or (kind == "cuda" and native is None)


def request(x: Tensor, a: float) -> Tensor:
    return ((x * a + 1).relu() * x).exp() - a


def reference(x: np.ndarray, a: float) -> np.ndarray:
    return np.exp(np.maximum(x * a + 1, 0) * x) - a


async def crowd(device: str, data: list[np.ndarray], scalars: list[float]) -> list[np.ndarray]:
    async def one(x: np.ndarray, a: float) -> np.ndarray:
        return await request(Tensor(x, device=device), a).numpy()

    return list(await asyncio.gather(*(one(x, a) for x, a in zip(data, scalars))))


async def test_concurrent_realizes_each_return_their_own_values(device: str) -> None:
    data = [rng.standard_normal(SIZE).astype(np.float32) * 0.5 for _ in range(N)]
    scalars = [float(a) for a in rng.uniform(0.5, 2.0, N)]
    await crowd(device, data, scalars)  # (the plan made and cached)
    ex, dev = RT.executor, RT.device(device)
    gathered, gathers, submitted = ex.gathered, ex.gathers, dev.queued()
    got = await crowd(device, data, scalars)
    for g, x, a in zip(got, data, scalars):
        np.testing.assert_allclose(g, reference(x, a), rtol=1e-5, atol=1e-6)
    if gathers_on(device) and dev.host_memory:  # (elsewhere each request's plan uploads its data)
        # every run joined a gather, and the crowd cost fewer submissions than runs
        assert ex.gathered - gathered == N
        assert 0 < dev.queued() - submitted < N
    if dev.gathers_copies:  # each request's upload, kernel and read: its runs and reads in fewer gathers than runs
        assert ex.gathered - gathered == N
        assert 0 < ex.gathers - gathers < N


async def test_prebuilt_graphs_in_flight_coalesce(device: str) -> None:
    x = Tensor(rng.standard_normal(SIZE).astype(np.float32) * 0.5, device=device)
    await x.realize()
    for _ in range(2):
        ts = [request(x, 1.0 + i / 8) for i in range(N)]
        gathered, gathers = RT.executor.gathered, RT.executor.gathers
        await asyncio.gather(*(t.realize() for t in ts))
    xn = await x.numpy()
    for i, t in enumerate(ts):
        np.testing.assert_allclose(await t.numpy(), reference(xn, 1.0 + i / 8), rtol=1e-5, atol=1e-6)
    if gathers_on(device):  # all eight in one gather
        assert (RT.executor.gathered - gathered, RT.executor.gathers - gathers) == (N, 1)


async def test_jit_replays_coalesce(device: str) -> None:
    f = azyx.jit(request)
    xs = [Tensor(rng.standard_normal(SIZE).astype(np.float32) * 0.5, device=device) for _ in range(N)]
    await azyx.realize(*(x * 1 for x in xs))  # (each uploaded, where it is host data: all have one signature)
    await f(xs[0], 1.5)  # the trace
    gathered = RT.executor.gathered
    got = await asyncio.gather(*(f(x, 1.0 + i / 8) for i, x in enumerate(xs)))
    assert f.replays == N
    for i, (t, x) in enumerate(zip(got, xs)):
        np.testing.assert_allclose(await t.numpy(), reference(await x.numpy(), 1.0 + i / 8), rtol=1e-5, atol=1e-6)
    if gathers_on(device):
        assert RT.executor.gathered - gathered == N


async def test_a_lone_realize_is_not_gathered(device: str) -> None:
    x = Tensor(rng.standard_normal(SIZE).astype(np.float32), device=device)
    await request(x, 1.0).realize()
    gathered = RT.executor.gathered
    got = await request(x, 0.5).numpy()
    np.testing.assert_allclose(got, reference(await x.numpy(), 0.5), rtol=1e-5, atol=1e-6)
    assert RT.executor.gathered == gathered


async def test_a_failing_request_fails_only_itself(device: str) -> None:
    table = rng.standard_normal(1000).astype(np.float32)
    t = Tensor(table, device=device)
    idxs = [rng.integers(0, 1000, SIZE).astype(np.int32) for _ in range(N)]
    idxs[3][12345] = 1000  # one request's data holds an index out of range
    held = [Tensor(idx, device=device) for idx in idxs]
    await azyx.realize(t * 1, *(i + 0 for i in held))  # (on the device from now on: each request's plan is its own)

    async def one(idx: Tensor, a: float) -> np.ndarray:
        return await (t[idx] * a).exp().numpy()

    for _ in range(2):  # (the second crowd runs the cached plan)
        gathered = RT.executor.gathered
        got = await asyncio.gather(*(one(idx, 0.5 + i / 8) for i, idx in enumerate(held)), return_exceptions=True)
        assert isinstance(got[3], azyx.IndexOutOfRange) and "index 1000" in str(got[3])
        for i, (g, idx) in enumerate(zip(got, idxs)):
            if i != 3:
                assert isinstance(g, np.ndarray), g
                np.testing.assert_allclose(g, np.exp(table[idx] * (0.5 + i / 8)), rtol=1e-5)
    if gathers_on(device):
        assert RT.executor.gathered - gathered == N


async def test_a_cancelled_request_leaves_the_others(device: str) -> None:
    x = Tensor(rng.standard_normal(SIZE).astype(np.float32) * 0.5, device=device)
    await request(x, 1.0).realize()
    xn = await x.numpy()

    async def one(a: float) -> np.ndarray:
        return await request(x, a).numpy()

    gathered = RT.executor.gathered
    tasks = [asyncio.ensure_future(one(1.0 + i / 8)) for i in range(N)]
    await asyncio.sleep(0)  # each has submitted its run (into the gather, where the device gathers) and waits
    tasks[2].cancel()
    got = await asyncio.gather(*tasks, return_exceptions=True)
    assert isinstance(got[2], asyncio.CancelledError)
    for i, g in enumerate(got):
        if i != 2:
            np.testing.assert_allclose(g, reference(xn, 1.0 + i / 8), rtol=1e-5, atol=1e-6)  # type: ignore[arg-type]
    if gathers_on(device):
        assert RT.executor.gathered - gathered == N


@pytest.mark.parametrize("cancel_first", [True, False])
async def test_a_request_cancelled_before_it_ran_is_not_submitted(device: str, cancel_first: bool) -> None:
    x = Tensor(rng.standard_normal(SIZE).astype(np.float32) * 0.5, device=device)
    await request(x, 1.0).realize()
    xn = await x.numpy()
    tasks = [asyncio.ensure_future(request(x, 1.0 + i / 8).numpy()) for i in range(N)]
    k = 0 if cancel_first else N - 1
    tasks[k].cancel()  # before it ever ran: it never joins the gather
    gathered = RT.executor.gathered
    got = await asyncio.gather(*tasks, return_exceptions=True)
    assert isinstance(got[k], asyncio.CancelledError)
    for i, g in enumerate(got):
        if i != k:
            np.testing.assert_allclose(g, reference(xn, 1.0 + i / 8), rtol=1e-5, atol=1e-6)  # type: ignore[arg-type]
    if gathers_on(device):
        assert RT.executor.gathered - gathered == N - 1


def test_gathering_turns_off_in_the_config(tmp_path: Path) -> None:
    """`{"c": {"gather": false}}`: the same crowd runs one run per submission, with the same values."""
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"c": {"gather": False}}))
    code = """if True:
        import asyncio, numpy as np
        from azyx import Tensor
        from azyx.runtime import RT
        async def main():
            x = Tensor(np.linspace(-1, 1, 1 << 17, dtype=np.float32), device="c:0")
            for _ in range(2):
                got = await asyncio.gather(*(((x * a + 1).relu() * x).exp().numpy() for a in (0.5, 1.0, 2.0)))
            return RT.executor.gathered, [float(g[-1]) for g in got]
        print(*asyncio.run(main()))"""
    env = {**os.environ, "AZYX_CONFIG": str(cfg)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300, check=True)
    gathered, rest = out.stdout.split(" ", 1)
    assert gathered == "0"
    np.testing.assert_allclose(json.loads(rest), [np.exp(max(a + 1, 0)) for a in (0.5, 1.0, 2.0)], rtol=1e-5)


@pytest.mark.parametrize("given_before_the_worker_takes_the_later_item", [True, False])
def test_a_reserved_item_runs_before_later_items_that_the_worker_took(
        given_before_the_worker_takes_the_later_item: bool) -> None:
    """A host device's queue keeps program order around a gather's reserved value: an item submitted after the
    reservation (another thread's, while the gather is open) waits for the reserved item, which the worker thread runs
    first once it is given, even where the worker took the later item already (else it would wait for it forever)."""
    timeline = TimelineSignal("test")
    failures: list[tuple[int, BaseException]] = []
    q = WorkQueue(timeline, "test", lambda v, e: failures.append((v, e)))
    ran: list[str] = []
    gate = threading.Event()
    try:
        v1 = q.submit(lambda: (gate.wait(30), ran.append("before")), [], False)  # busy: the worker holds it
        r = q.reserve()
        v3 = q.submit(lambda: ran.append("after"), [], False)  # queued behind the reservation
        if given_before_the_worker_takes_the_later_item:
            q.submit_reserved(lambda: ran.append("reserved"), r, False)
            gate.set()
        else:
            gate.set()
            timeline.wait_sync(v1)  # the worker now takes the later item, whose turn is after the reservation's
            q.submit_reserved(lambda: ran.append("reserved"), r, False)
        timeline.wait_sync(v3)
        assert (v1, r, v3) == (1, 2, 3) and ran == ["before", "reserved", "after"] and not failures
    finally:
        gate.set()
        q.close()


async def test_one_signal_wakes_a_crowd_of_waiters() -> None:
    """A crowd's realizes that wait for one timeline value, reached by another thread, all resume (with one wake-up of
    the loop: `timeline._wake_all`), a cancelled one among them included as cancelled; a thread's callback on the same
    value runs too."""
    timeline = TimelineSignal("test")
    ran = threading.Event()
    timeline.on_reach(3, ran.set)
    tasks = [asyncio.ensure_future(timeline.wait(3)) for _ in range(N)]
    await asyncio.sleep(0)  # (each waits now)
    tasks[1].cancel()
    await asyncio.sleep(0)
    thread = threading.Thread(target=timeline.signal, args=(3,))
    thread.start()
    done, pending = await asyncio.wait(tasks, timeout=30)
    thread.join()
    assert not pending and ran.is_set()
    assert [t.cancelled() for t in tasks] == [i == 1 for i in range(N)]
    assert all(t.result() is None for i, t in enumerate(tasks) if i != 1)


async def test_a_request_plan_that_uploads_its_data_is_its_devices(device: str) -> None:
    """A request's plan that uploads host data for its input (a TransferStep out of the host device) has its work on
    the request's device alone (`work_devices`): it runs there as one batch and, where the device's gathers take
    copies (CUDA), a crowd's runs of it gather (`gatherable(plan, uploads=True)`); a host-memory device uploads
    nothing."""
    x = rng.standard_normal(1024).astype(np.float32)
    t = request(Tensor(x, device=device), 0.75)
    np.testing.assert_allclose(await t.numpy(), reference(x, 0.75), rtol=1e-5, atol=1e-6)
    again = request(Tensor(x, device=device), 0.75)  # (its graph walked: the cached plan's key)
    plan = RT.plan_cache.get(canonicalize(GRAPH, [again.id]).key)
    assert plan is not None
    assert work_devices(plan) == [device]
    uploads = [s for s in plan.steps if isinstance(s, TransferStep)]
    assert bool(uploads) == (not RT.device(device).host_memory)
    assert gatherable(plan, uploads=True) and gatherable(plan) == (not uploads)


def test_a_failed_batch_fails_every_value_it_reserved() -> None:
    """A batch submitted as one command completes the values it reserved from its first on: its failure, recorded at
    its last value with its first (`record_failure`), is every one of those values' (`failure_in`), none outside."""
    dev = RT.device("c:0")
    base = dev.timeline.value + 1_000_000  # (values no work of this process reaches)
    err = azyx.DeviceError("the batch failed")
    dev.record_failure(base + 9, err, first=base + 5)
    try:
        for lo, hi in ((base + 4, base + 5), (base + 6, base + 7), (base + 8, base + 9), (base, base + 20)):
            assert dev.failure_in(lo, hi) is not None, (lo - base, hi - base)
        for lo, hi in ((base, base + 4), (base + 9, base + 12)):
            assert dev.failure_in(lo, hi) is None, (lo - base, hi - base)
    finally:
        dev.failures.pop(base + 9, None)
        dev.failed_from.pop(base + 9, None)
