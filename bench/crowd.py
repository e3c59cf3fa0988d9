"""Concurrent realizes of one cached plan on any device (issue 38 item 2), beside PyTorch on the CPU (c:N) in the same
run: bench/gpu.py's rows "10-op graph, realize only / azyx.jit replay" (one, and 8 in flight) and "200 concurrent
requests" for a device without CUDA. PyTorch: the same ops eagerly (8 calls; 200 requests in a 16-thread pool).

    python bench/crowd.py [--device c:0] [--quick] [--size 1024]

Also prints how many work items the device's queue took per realize in flight (coalesced realizes share one).
Never asserts on speed: it reports; every result is checked against numpy.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import azyx  # noqa: E402
from azyx import Tensor  # noqa: E402
from azyx.runtime import RT  # noqa: E402

FLIGHT = 8


def ten_ops(s: Any) -> Any:  # azyx or torch (bench/gpu.py's)
    return ((((s * 1.5 + s) * 2 - s) / 3).relu() * s + 1).exp().sqrt() - s


def graph(s: Any, a: float) -> Any:  # azyx or torch: a request with its own scalar (bench/gpu.py's crowd)
    return ((((s * a + s) * 2 - s) / 3).relu() * s + 1).exp().sqrt() - s


def reference(x: np.ndarray, a: float) -> np.ndarray:
    return np.sqrt(np.exp(np.maximum(((x * a + x) * 2 - x) / 3, 0) * x + 1)) - x


async def realize_timings(fn: Callable[[Any], Any], jitted: Any, small: Tensor, reps: int, flight: int
                          ) -> list[float]:
    """Seconds per realize (median of `reps` after a warm-up) of `fn(small)` built before the clock: one realize,
    `flight` in flight together; then `jitted(small)` (azyx.jit of `fn`): one replay, `flight` together. Prints how
    many of those runs the executor gathered into how many submissions (concurrent realizes coalesce)."""

    async def once() -> float:
        t = fn(small)
        t0 = time.perf_counter()
        await t.realize()
        return time.perf_counter() - t0

    async def together() -> float:
        ts = [fn(small) for _ in range(flight)]
        t0 = time.perf_counter()
        await asyncio.gather(*(t.realize() for t in ts))
        return (time.perf_counter() - t0) / flight

    async def replay() -> float:
        t0 = time.perf_counter()
        await jitted(small)
        return time.perf_counter() - t0

    async def replays() -> float:
        t0 = time.perf_counter()
        await asyncio.gather(*(jitted(small) for _ in range(flight)))
        return (time.perf_counter() - t0) / flight

    for _ in range(3):
        for f in (once, together, replay, replays):
            await f()
    ex = RT.executor
    runs, gathers = ex.gathered, ex.gathers
    ours = [statistics.median([await f() for _ in range(reps)]) for f in (once, together, replay, replays)]
    print(f"{ex.gathered - runs} runs gathered into {ex.gathers - gathers} submissions ({flight} in flight "
          f"coalesce)", flush=True)
    return ours


async def realize_only(dev: str, reps: int, torch: Any, size: int) -> list[tuple[str, float, float]]:
    """realize_timings' rows for the 10-op graph on `size` floats of `dev`, beside the peer's eager calls (PyTorch on
    the CPU; numpy without it)."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal(size).astype(np.float32)
    small = Tensor(x, device=dev)
    await small.realize()
    jitted = azyx.jit(ten_ops)
    await realize_timings(ten_ops, jitted, small, 3, FLIGHT)  # (warm: the plan and the trace made)
    want = reference(x, 1.5)
    for got in [await ten_ops(small).numpy(), await (await jitted(small)).numpy()]:
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    d = RT.device(dev)
    before = d.queued()
    await asyncio.gather(*(ten_ops(small).realize() for _ in range(FLIGHT)))
    items = (d.queued() - before) / FLIGHT
    ours = await realize_timings(ten_ops, jitted, small, reps, FLIGHT)
    tx = torch.from_numpy(x) if torch is not None else x

    def eager(n: int) -> float:
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            for _ in range(n):
                ten_ops(tx) if torch is not None else reference(tx, 1.5)
            times.append((time.perf_counter() - t0) / n)
        return statistics.median(times)

    t_one, t_many = eager(1), eager(FLIGHT)
    print(f"{dev}: work items per realize, {FLIGHT} in flight: {items:.2f}")
    what = f"10-op graph on {size:,} f32"
    return [(f"{what}, realize only (built before the clock), 1 / us", ours[0], t_one),
            (f"{what}, realize only, {FLIGHT} in flight / us each", ours[1], t_many),
            (f"{what}, azyx.jit replay, 1 / us", ours[2], t_one),
            (f"{what}, azyx.jit replay, {FLIGHT} in flight / us each", ours[3], t_many)]


CHAIN, WIDTH = 100, 32  # the steady many-kernel plan: products in a row, none fusing into the next


def product_chain(x: Any, ws: list[Any], s: Any) -> Any:  # azyx or torch
    for w in ws:
        x = (x @ w) * s
    return x


def check(got: np.ndarray, want: np.ndarray) -> None:
    """Equal to numpy within float32 rounding over CHAIN products (relative to the largest value)."""
    err = float(np.abs(got - want).max() / np.abs(want).max())
    assert err < 1e-4, f"the {CHAIN}-product chain differs from numpy's by {err:.2e} (relative to its largest value)"


async def steady_chain(dev: str, reps: int, torch: Any) -> list[tuple[str, float, float | None]]:
    """A steady plan of CHAIN kernels (1 x WIDTH rows through CHAIN products, each scaled by a traced scalar that
    changes every call) replayed by azyx.jit: seconds per replay, and the host's part of it, the executor's submission
    of the run (`UnifiedExecutor.run`, timed around each call), beside the peer's eager calls (PyTorch on the CPU, or
    numpy)."""
    rng = np.random.default_rng(1)
    xn = rng.standard_normal((1, WIDTH)).astype(np.float32)
    wn = [(rng.standard_normal((WIDTH, WIDTH)) / np.sqrt(WIDTH)).astype(np.float32) for _ in range(CHAIN)]
    x, ws = Tensor(xn, device=dev), [Tensor(w, device=dev) for w in wn]
    await azyx.realize(x, *ws)
    jitted = azyx.jit(lambda x, s: product_chain(x, ws, s))
    for i in range(5):
        y = await jitted(x, 1.0 + i / 64)
    check(await y.numpy(), product_chain(xn, wn, np.float32(1.0 + 4 / 64)))
    kernels = len(RT.executor.last[0].kernels)  # type: ignore[union-attr]
    ex, runs = RT.executor, []
    submit = ex.run

    def timed(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return submit(*args, **kwargs)
        finally:
            runs.append(time.perf_counter() - t0)

    ex.run = timed  # type: ignore[method-assign]
    walls = []
    try:
        for i in range(reps):
            t0 = time.perf_counter()
            y = await jitted(x, 1.0 + (i % 7) / 64)
            walls.append(time.perf_counter() - t0)
    finally:
        del ex.run
    check(await y.numpy(), product_chain(xn, wn, np.float32(1.0 + ((reps - 1) % 7) / 64)))
    tx, tw = (torch.from_numpy(xn), [torch.from_numpy(w) for w in wn]) if torch is not None else (xn, wn)
    eager = []
    for i in range(reps):
        t0 = time.perf_counter()
        product_chain(tx, tw, 1.0 + (i % 7) / 64)
        eager.append(time.perf_counter() - t0)
    what = f"{kernels}-kernel steady plan (1x{WIDTH} through {CHAIN} products, new scalar each call)"
    return [(f"{what}, azyx.jit replay / us", statistics.median(walls), statistics.median(eager)),
            (f"{what}, host submission per run (executor.run) / us", statistics.median(runs), None)]


async def crowd(dev: str, n_req: int, runs: int, size: int, theirs_one: Callable[[np.ndarray, float], np.ndarray]
                ) -> tuple[float, float]:
    """Requests per second of `n_req` concurrent requests, each its own `size` floats and its own scalar through the
    10-op `graph`, read back: azyx, one task per request on the loop; the peer, `theirs_one(x, a)` per request in a
    16-thread pool (the way services run torch today); median of `runs`, every result checked against numpy."""
    rng = np.random.default_rng(3)
    data = [rng.standard_normal(size).astype(np.float32) for _ in range(n_req)]
    scalars = [float(v) for v in rng.uniform(0.5, 2.0, n_req)]

    async def ours() -> list[np.ndarray]:
        async def one(x: np.ndarray, a: float) -> np.ndarray:
            return await graph(Tensor(x, device=dev), a).numpy()
        return list(await asyncio.gather(*(one(x, a) for x, a in zip(data, scalars))))

    pool = ThreadPoolExecutor(16)

    def theirs() -> list[np.ndarray]:
        return list(pool.map(theirs_one, data, scalars))

    for _ in range(3):
        got, want = await ours(), theirs()
    for g, w, x, a in zip(got, want, data, scalars):
        np.testing.assert_allclose(g, reference(x, a), rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(w, reference(x, a), rtol=1e-4, atol=1e-5)
    az, pt = [], []
    for _ in range(runs):
        t0 = time.perf_counter()
        await ours()
        az.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        theirs()
        pt.append(time.perf_counter() - t0)
    pool.shutdown()
    return n_req / statistics.median(az), n_req / statistics.median(pt)


async def main() -> None:
    try:
        import torch

        torch.set_num_threads(1)  # (each request is tiny: a thread pool's requests, each on one thread)
    except ImportError:  # (the peer is numpy then)
        torch = None
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", help="ignored: this script prints its table and writes none")
    ap.add_argument("--device", default="c:0")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--size", type=int, default=1024, help="floats per graph (1,024: bench/gpu.py's)")
    ap.add_argument("--only", choices=("all", "chain"), default="all", help="chain: the steady many-kernel plan only")
    args = ap.parse_args()
    reps = 30 if args.quick else 200
    peer = "torch (CPU, eager)" if torch is not None else "numpy"
    chain = await steady_chain(args.device, reps, torch)
    if args.only == "chain":
        print(f"| workload ({args.device}) | azyx | {peer} | ratio |\n|---|---:|---:|---:|")
        for what, ours, theirs in chain:
            print(f"| {what} | {ours * 1e6:.1f} | " + (f"{theirs * 1e6:.1f} | {theirs / ours:.2f}x |" if theirs else
                                                        "— | — |"))
        return
    rows = await realize_only(args.device, reps, torch, args.size)
    n_req = 50 if args.quick else 200
    a, t = await crowd(args.device, n_req, 5 if args.quick else 15, args.size,
                       lambda x, a: graph(torch.from_numpy(x), a).numpy() if torch is not None else reference(x, a))
    name = f"{n_req} concurrent requests (10 ops on {args.size:,} f32, own scalar, read back) / req/s"
    print(f"| workload ({args.device}) | azyx | {peer} | ratio |\n|---|---:|---:|---:|")
    for what, ours, theirs in [*rows, *chain]:
        print(f"| {what} | {ours * 1e6:.1f} | " + (f"{theirs * 1e6:.1f} | {theirs / ours:.2f}x |" if theirs else
                                                    "— | — |"))
    print(f"| {name} | {a:.0f} | {t:.0f} | {a / t:.2f}x |")


if __name__ == "__main__":
    asyncio.run(main())
