"""Kernels that a plan runs back to back on one device are one batch (one work item; on a C device one call into C
that opens one OpenMP region for the kernels that can share it): every kind of kernel in one batch, checked against
numpy on every device kind, and batches split where a plan moves data between devices."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

import azyx
from azyx import Tensor
from azyx.codegen.launch import OWN_REGION, SERIAL, SHARED, parallel_kind
from azyx.graph import GRAPH
from azyx.runtime import RT
from tests.compare import sample
from tests.runtime_state import settle

rng = np.random.default_rng(5)


async def test_shared_serial_and_own_region_kernels_in_one_batch(device: str) -> None:
    xn, qn = sample(rng, (300, 700), "small"), sample(rng, (65537,), "small")
    x, q = Tensor(xn, device=device), Tensor(qn, device=device)
    a = (x * 2).exp()  # shares its loop among the threads
    s = a.sum()  # a reduction of every element: in two stages (many partial sums shared out, then one)
    t = q.exp().sum()  # the same over a prime number of elements: no two stages, a region of its own
    b = a / s + t  # shared again, reading the reductions
    c = x[:3, :5] * 3  # too small to share: one thread
    d = b * c.sum()  # shared, after a serial kernel
    e = d.sum(axis=1)  # a reduction per row, shared by rows
    targets = [a, s, t, b, c, d, e]
    plan = azyx.schedule(*targets)
    dev = RT.device(device)
    if dev.kind == "c":
        kinds = {parallel_kind(k.kernel, dev.dialect, dev.threads) for k in plan.kernels}  # type: ignore[arg-type]
        assert kinds == ({SERIAL, SHARED, OWN_REGION} if dev.threads > 1 else {SERIAL})
    await azyx.realize(*targets)
    if dev.kind == "c":  # one batch: every output is ready at the same timeline value
        assert len({GRAPH[t.id].buffer.ready for t in targets}) == 1  # type: ignore[union-attr]
    x64 = xn.astype(np.float64)
    a_ref = np.exp(x64 * 2)
    s_ref, t_ref = a_ref.sum(), np.exp(qn.astype(np.float64)).sum()
    c_ref = x64[:3, :5] * 3
    d_ref = (a_ref / s_ref + t_ref) * c_ref.sum()
    refs = [a_ref, s_ref, t_ref, a_ref / s_ref + t_ref, c_ref, d_ref, d_ref.sum(axis=1)]
    for t, ref in zip(targets, refs):
        np.testing.assert_allclose(await t.numpy(), ref, rtol=1e-4, atol=1e-7)


async def test_kernels_that_differ_only_in_the_length_of_their_shared_loop(device: str) -> None:
    # a C kernel loops over the [lo, hi) it is given, so these render to one program: each plan has its own length
    for rows in (300, 100, 500):
        xn = sample(rng, (rows, 384), "small")
        y = (Tensor(xn, device=device) * 2 + 1).exp()
        np.testing.assert_allclose(await y.numpy(), np.exp(xn.astype(np.float64) * 2 + 1), rtol=1e-5)


async def test_batches_split_where_data_moves_between_devices() -> None:
    xn = sample(rng, (256, 300))
    x = Tensor(xn, device="c:0")
    a = (x * 3).relu()  # c:0
    b = (a.to("c:1") + 1).sqrt()  # c:1, after a copy that waits for c:0
    c = (b.to("c:0") * a).sum(axis=0)  # back on c:0, after a copy that waits for c:1
    await azyx.realize(a, b, c)  # one plan: c:0, copy, c:1, copy, c:0
    got = [await t.numpy() for t in (a, b, c)]
    a_ref = np.maximum(xn * 3, 0)
    b_ref = np.sqrt(a_ref + 1)
    np.testing.assert_allclose(got[0], a_ref, rtol=1e-6)
    np.testing.assert_allclose(got[1], b_ref, rtol=1e-6)
    np.testing.assert_allclose(got[2], (b_ref * a_ref).sum(axis=0), rtol=1e-4, atol=1e-4)


def test_more_pool_threads_than_cores(tmp_path: Path) -> None:
    # helpers take parts from each other's runs; with more threads than cores some lose their core mid-batch
    script = """
import numpy as np, azyx
from azyx import Tensor
azyx.configure({"c": {"threads": 5}, "opencl": {"enabled": False}})
rng = np.random.default_rng(3)
xn, wn = rng.standard_normal((96, 300)).astype(np.float32), rng.standard_normal((300, 64)).astype(np.float32)
x, w = Tensor(xn, device="c:0"), Tensor(wn, device="c:0")
for _ in range(20):
    h = (x @ w).relu()
    out = ((h * 2).exp() / (h.sum() + 1)).sum(axis=1)
    ref = np.exp(np.maximum(xn @ wn, 0) * 2) / (np.maximum(xn @ wn, 0).sum() + 1)
    np.testing.assert_allclose(out.numpy_sync(), ref.sum(axis=1), rtol=1e-4)
print("OK")
"""
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path)}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300,
                            cwd=Path(__file__).resolve().parent.parent)
    assert result.returncode == 0 and "OK" in result.stdout, result.stderr


# ---- the C runner: batches start with no Python thread, in the device queue's order -------------------------------
async def test_batch_copy_batch_on_one_device_keep_program_order() -> None:
    dev = RT.device("c:0")
    n = 1 << 21  # 8 MiB: neither the batches nor the copy are small enough to run inline
    xn = sample(rng, (n,), "small")
    x, b = Tensor(xn, device="c:0"), Tensor(np.zeros(n, np.float32), device="c:0")
    await azyx.realize(x, b)
    a = x * 2 + 1
    await (x * 2 + 1).realize()  # the same structure: a's plan is cached, so its realize submits at once
    first = asyncio.ensure_future(a.realize())
    await asyncio.sleep(0)  # a's batch is queued
    buf_a, buf_b = GRAPH[a.id].buffer, GRAPH[b.id].buffer
    assert buf_a is not None and buf_b is not None
    batch_v = buf_a.ready
    copy_v = RT.executor.execute_transfer(buf_a, buf_b)  # a Python work item after it: copies a into b once a's
    assert buf_b.ready == copy_v  # batch has run, and b is ready when the copy is
    c = b * 3 - x  # a batch after the copy: reads what the copy wrote
    assert batch_v < copy_v
    got = await c.numpy()
    await first
    assert dev.queue.native_last >= batch_v  # a's batch went to the runner (the queue was idle before it)
    np.testing.assert_allclose(got, (xn * 2 + 1) * 3 - xn, rtol=1e-6)
    np.testing.assert_allclose(await a.numpy(), xn * 2 + 1, rtol=1e-6)


async def test_cancelling_a_realize_whose_batch_is_queued_in_c_leaks_nothing() -> None:
    base_nodes, base_mem = await settle()
    xn = sample(rng, (1 << 20,), "small")
    x = Tensor(xn, device="c:0")
    await ((x * 1.5).exp() - x).realize()  # compiles and caches the plan
    ys = [(x * 1.5).exp() - x for _ in range(4)]  # same structure: each realize submits its batch at once
    tasks = [asyncio.ensure_future(y.realize()) for y in ys]
    await asyncio.sleep(0)
    assert RT.device("c:0").queue.native_last > 0
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for y in ys:
        np.testing.assert_allclose(await y.numpy(), np.exp(xn * 1.5) - xn, rtol=1e-5)
    del x, y, ys, t, tasks
    nodes, mem = await settle()
    assert (nodes, mem) == (base_nodes, base_mem)


def test_shutdown_runs_the_batches_queued_in_c_first(tmp_path: Path) -> None:
    script = """
import asyncio, numpy as np, azyx
from azyx import Tensor
from azyx.graph import GRAPH
from azyx.runtime import RT
azyx.configure({"opencl": {"enabled": False}})

async def main():
    xn = np.linspace(-1, 1, 1 << 20, dtype=np.float32)
    xs = [Tensor(xn + i, device="c:0") for i in range(8)]
    await azyx.realize(*xs)
    await (xs[0] * 0.5 + 1).realize()  # compiled and cached: the realizes below submit at once
    ys = [x * 0.5 + 1 for x in xs]
    tasks = [asyncio.ensure_future(y.realize()) for y in ys]
    await asyncio.sleep(0)
    dev = RT.device("c:0")
    assert dev.pending() > 0 and dev.queue.native_last > 0, "nothing was queued in C"
    bufs = [GRAPH[y.id].buffer for y in ys]
    RT.shutdown()  # the runner finishes what it was given, then stops
    for i, b in enumerate(bufs):
        np.testing.assert_allclose(b.mem.view(np.float32)[:xn.size], (xn + i) * 0.5 + 1, rtol=1e-6)
    await asyncio.gather(*tasks)  # every waiter was woken
    print("OK")

asyncio.run(main())
"""
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path)}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300,
                            cwd=Path(__file__).resolve().parent.parent)
    assert result.returncode == 0 and "OK" in result.stdout, result.stderr
