"""Workloads shared by the multi-device test files (OpenCL, CUDA): many tasks hopping devices at once, and
realizes cancelled while their transfers are queued. Each checks its own results against numpy."""

from __future__ import annotations

import asyncio

import numpy as np

from azyx import Tensor


async def spread_tasks(devices: list[str], rng: np.random.Generator) -> None:
    """200 concurrent tasks, each computing on one device and finishing on another."""
    xs = rng.standard_normal(2048).astype(np.float32)
    bases = {d: Tensor(xs, device=d) for d in devices}

    async def task(i: int) -> None:
        d0, d1 = devices[i % len(devices)], devices[(i // len(devices)) % len(devices)]
        t = ((bases[d0] * (i % 7) + 1).to(d1) * bases[d1]).sum(axis=0, keepdim=True) + i
        out = await t.numpy()
        np.testing.assert_allclose(out, [((xs * (i % 7) + 1) * xs).sum() + i], rtol=1e-4, atol=1e-3)

    await asyncio.gather(*(task(i) for i in range(200)))


async def cancel_transfers(yields: int, via: str, n: int) -> None:
    """Three c:0 -> `via` -> c:1 chains of `n` elements, cancelled after `yields` loop turns; then one recomputed."""
    xs = np.arange(n, dtype=np.float32)
    x = Tensor(xs, device="c:0")
    ys = [((x + i).to(via) * 2).to("c:1") - 1 for i in range(3)]
    tasks = [asyncio.create_task(y.realize()) for y in ys]
    for _ in range(yields):
        await asyncio.sleep(0)
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    np.testing.assert_array_equal(await ys[2].numpy(), (xs + 2) * 2 - 1)
