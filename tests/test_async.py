"""Async behaviour: concurrency, cancellation, loop latency, trio, the sync escape hatch."""

from __future__ import annotations

import asyncio
import gc
import os
import time

import numpy as np
import pytest
from runtime_state import settle

import azyx
from azyx import Tensor
from azyx.runtime import RT


async def _two_hundred_tasks() -> None:
    rng = np.random.default_rng(0)
    xs = rng.standard_normal(4096).astype(np.float32)
    x = Tensor(xs, device="c:0")
    shared = (x * 2).relu()  # every task's graph contains this unrealized node
    other = x.to("c:1") + 1  # and half of them a transfer

    async def task(i: int) -> None:
        t = (shared + (i % 5)) * (x - 0.5)
        if i % 2:
            t = t.to("c:1") * other
        ref = (np.maximum(xs * 2, 0) + (i % 5)) * (xs - 0.5)
        if i % 2:
            ref = ref * (xs + 1)
        out = await t.numpy()
        np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)

    await asyncio.gather(*(task(i) for i in range(200)))


async def test_200_concurrent_tasks_with_overlapping_graphs() -> None:
    base_nodes, base_mem = await settle()
    await _two_hundred_tasks()
    nodes, mem = await settle()
    assert nodes == base_nodes
    assert mem == base_mem


async def _realize_cancel_and_check(yields: int) -> None:
    xs = np.linspace(-2, 2, 1 << 18, dtype=np.float32)
    x = Tensor(xs, device="c:0")
    salt = 0.25 + yields / 100  # a graph structure this test has not compiled before in this process
    ys = [((x * salt + i).exp() * x).sum(axis=0, keepdim=True) for i in range(4)]
    tasks = [asyncio.create_task(azyx.realize(y)) for y in ys]
    for _ in range(yields):
        await asyncio.sleep(0)  # let the tasks run up to some await point, different for each parameter
    for t in tasks:
        t.cancel()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    assert all(isinstance(r, asyncio.CancelledError) or r == (y,) for r, y in zip(results, ys))
    # the runtime is still consistent: the same tensors realize correctly afterwards
    out = await ys[1].numpy()
    np.testing.assert_allclose(out, [(np.exp(xs * salt + 1) * xs).sum()], rtol=1e-4)


@pytest.mark.parametrize("yields", [0, 1, 2, 3, 5, 10, 40])
async def test_cancelling_a_realize_leaks_nothing(yields: int) -> None:
    base_nodes, base_mem = await settle()
    await _realize_cancel_and_check(yields)  # its frame (and the cancelled tasks' tracebacks) ends here
    nodes, mem = await settle()
    assert nodes == base_nodes
    assert mem == base_mem


async def test_cancelling_while_the_device_computes_leaks_nothing() -> None:
    base_nodes, base_mem = await settle()
    n = 1 << 22
    x1, x2 = Tensor.rand(n, device="c:0"), Tensor.rand(n, device="c:0")
    await azyx.realize(x1, x2)
    await ((x1 * 1.75).exp() + x1).realize()  # compiles and caches the plan
    y = (x2 * 1.75).exp() + x2  # same structure: realize submits at once and then awaits the device
    task = asyncio.create_task(y.realize())
    await asyncio.sleep(0)
    assert RT.device("c:0").pending() > 0, "the device finished before the test could cancel mid-compute"
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    xs = await x2.numpy()
    np.testing.assert_allclose(await y.numpy(), np.exp(xs * 1.75) + xs, rtol=1e-5)
    del x1, x2, y, task
    nodes, mem = await settle()
    assert (nodes, mem) == (base_nodes, base_mem)


async def test_cancel_mid_transfer_leaks_nothing() -> None:
    base_nodes, base_mem = await settle()
    xs = np.arange(1 << 20, dtype=np.float32)
    x = Tensor(xs, device="c:0")
    y = (x + 1).to("c:1") * 2
    task = asyncio.create_task(y.realize())
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    np.testing.assert_array_equal(await y.numpy(), (xs + 1) * 2)
    del x, y, task
    nodes, mem = await settle()
    assert (nodes, mem) == (base_nodes, base_mem)


@pytest.mark.serial
async def test_heartbeat_keeps_ticking_while_a_large_graph_compiles_and_runs() -> None:
    n = 64 << 20
    x = Tensor.rand(n, device="c:0")
    await x.realize()
    salt = 1.0 + (os.getpid() % 1000) / 1000 + time.time() % 1
    # a structure not seen before, so that it compiles even beside a warm disk cache (a new scalar value is a kernel
    # argument: it compiles nothing)
    steps = 1 + (os.getpid() + time.time_ns()) % 199
    z = x * salt + 0.5
    for _ in range(steps):
        z = z + 0.25
    y = (z.sqrt() * x).sum()
    ticks: list[float] = []
    done = asyncio.Event()

    async def heartbeat() -> None:
        while not done.is_set():
            ticks.append(time.perf_counter())
            await asyncio.sleep(0.001)

    # as a service after start-up (README), and as tests/test_loop_latency.py: a full collection of the test run's
    # heap (every collected test item) holds the loop for up to a quarter second, azyx's work or not
    gc.collect()
    gc.freeze()
    hb = asyncio.create_task(heartbeat())
    await asyncio.sleep(0)
    t0 = time.perf_counter()
    try:
        await y.realize()
    finally:
        elapsed = time.perf_counter() - t0
        done.set()
        await hb
        gc.unfreeze()
    xs = await x.numpy()
    want = (np.sqrt(xs.astype(np.float64) * salt + 0.5 + 0.25 * steps) * xs).sum()
    np.testing.assert_allclose(await y.item(), want, rtol=1e-3)
    gaps = np.diff([t0, *[t for t in ticks if t >= t0]])
    # a blocked loop shows one gap as long as the whole realize; a free one ticks all along
    assert len(gaps) >= 10, f"only {len(gaps)} heartbeats in {elapsed:.3f}s"
    assert gaps.max() < max(0.1, elapsed / 3), f"longest heartbeat gap {gaps.max():.3f}s of {elapsed:.3f}s"


def test_trio_through_anyio() -> None:
    trio = pytest.importorskip("trio")
    xs = np.arange(12, dtype=np.float32).reshape(3, 4)

    async def main() -> np.ndarray:
        t = (Tensor(xs, device="c:0") * 3).sum(axis=1).to("c:1") + 1
        return await t.numpy()

    np.testing.assert_allclose(trio.run(main), (xs * 3).sum(axis=1) + 1)


async def test_sync_calls_inside_a_running_loop_raise() -> None:
    t = Tensor([1.0, 2.0]) + 1
    with pytest.raises(azyx.RuntimeStateError, match="running event loop"):
        t.numpy_sync()
    with pytest.raises(azyx.RuntimeStateError):
        t.realize_sync()
    np.testing.assert_allclose(await t.numpy(), [2.0, 3.0])


def test_sync_escape_hatch() -> None:
    t = Tensor([[1, 2], [3, 4]]) * 2
    assert t.realize_sync() is t
    np.testing.assert_array_equal(t.numpy_sync(), [[2, 4], [6, 8]])


async def test_realize_several_tensors_in_one_plan() -> None:
    xs = np.arange(10, dtype=np.float32)
    x = Tensor(xs)
    a, b = x + 1, (x + 1).sum()
    out = await azyx.realize(a, b)
    assert out == (a, b)
    np.testing.assert_allclose(await a.numpy(), xs + 1)
    assert await b.item() == pytest.approx((xs + 1).sum())
    assert await b.tolist() == pytest.approx((xs + 1).sum())
