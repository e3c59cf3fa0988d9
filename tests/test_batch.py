"""Kernels that a plan runs back to back on one device are one batch (one work item; on a C device one call into C
that opens one OpenMP region for the kernels that can share it): every kind of kernel in one batch, checked against
numpy on every device kind, and batches split where a plan moves data between devices."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np

import azyx
from azyx import Tensor
from azyx.cstyle import OWN_REGION, SERIAL, SHARED, parallel_kind
from azyx.runtime import GRAPH, RT
from tests.compare import sample

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
