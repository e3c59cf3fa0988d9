"""Bench the workloads on every compute device side by side (c:0, opencl:0 on PoCL, ...) with numpy, and the
executor's transfer bandwidth for each sync strategy against a numpy copy of the same size.

    python bench/devices.py [--quick] [--out bench/RESULTS.md]

Writes its tables into bench/RESULTS.md between `<!-- bench:devices:start -->` and `<!-- bench:devices:end -->`.
Never asserts: it reports.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import azyx  # noqa: E402
from azyx import Tensor  # noqa: E402
from azyx.graph import GRAPH  # noqa: E402
from azyx.runtime import RT  # noqa: E402

F32 = np.float32
START, END = "<!-- bench:devices:start -->", "<!-- bench:devices:end -->"


async def timed(fn: Callable[[], Awaitable[Any]], repeats: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        await fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        await fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def np_timed(fn: Callable[[], Any], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


async def workloads(devices: list[str], quick: bool) -> list[list[str]]:
    rng = np.random.default_rng(0)
    n16, side, mm = (1 << 20, 512, 256) if quick else (1 << 24, 4096, 1024)
    reps = 2 if quick else 7
    rows: list[list[str]] = []
    a_np, b_np, c_np = (rng.random(n16, dtype=F32) for _ in range(3))
    m_np = rng.random((side, side), dtype=F32)
    x_np, y_np = rng.random((mm, mm), dtype=F32), rng.random((mm, mm), dtype=F32)
    s_np = rng.random(1024, dtype=F32)
    ref = {
        "10-op graph, 1024 f32, steady realize (us)": np_timed(lambda: ((s_np * 1.5 + s_np) * 2 - s_np) / 3, reps),
        f"relu(a*b+c)*0.5+a, {n16 >> 20}M f32 (GB/s)": np_timed(
            lambda: np.maximum(a_np * b_np + c_np, 0) * 0.5 + a_np, reps),
        f"sum, {n16 >> 20}M f32 (GB/s)": np_timed(lambda: a_np.sum(), reps),
        f"row-sum {side}x{side} f32 (GB/s)": np_timed(lambda: m_np.sum(axis=1), reps),
        f"matmul {mm} f32 (GFLOP/s)": np_timed(lambda: x_np @ y_np, reps),
    }
    work = {  # bytes or flops per run, to turn seconds into rates
        f"relu(a*b+c)*0.5+a, {n16 >> 20}M f32 (GB/s)": 16 * n16,
        f"sum, {n16 >> 20}M f32 (GB/s)": 4 * n16,
        f"row-sum {side}x{side} f32 (GB/s)": 4 * side * side,
        f"matmul {mm} f32 (GFLOP/s)": 2 * mm**3,
    }
    results: dict[str, dict[str, float]] = {k: {} for k in ref}
    for dev in devices:
        a, b, c = (Tensor(v, device=dev) for v in (a_np, b_np, c_np))
        m, x, y, s = Tensor(m_np, device=dev), Tensor(x_np, device=dev), Tensor(y_np, device=dev), \
            Tensor(s_np, device=dev)
        await azyx.realize(a, b, c, m, x, y, s)
        cases: dict[str, Callable[[], Awaitable[Any]]] = {
            "10-op graph, 1024 f32, steady realize (us)": lambda: (((s * 1.5 + s) * 2 - s) / 3).realize(),
            f"relu(a*b+c)*0.5+a, {n16 >> 20}M f32 (GB/s)": lambda: ((a * b + c).relu() * 0.5 + a).realize(),
            f"sum, {n16 >> 20}M f32 (GB/s)": lambda: a.sum().realize(),
            f"row-sum {side}x{side} f32 (GB/s)": lambda: m.sum(axis=1).realize(),
            f"matmul {mm} f32 (GFLOP/s)": lambda: (x @ y).realize(),
        }
        for name, fn in cases.items():
            results[name][dev] = await timed(fn, reps * (20 if "10-op" in name else 1))
    for name, per_dev in results.items():
        unit_rate = name in work

        def fmt(t: float, name: str = name, unit_rate: bool = unit_rate) -> str:
            if unit_rate:
                return f"{work[name] / t / 1e9:.1f}"
            return f"{t * 1e6:.1f}"

        row = [name, *(fmt(per_dev[d]) for d in devices), fmt(ref[name])]
        row += [f"{ref[name] / per_dev[d]:.2f}x" for d in devices]
        rows.append(row)
    return rows


async def transfers(quick: bool) -> list[list[str]]:
    nbytes = (4 if quick else 64) << 20
    reps = 2 if quick else 7
    src_np = np.random.default_rng(1).random(nbytes // 4, dtype=F32)
    dst_np = np.empty_like(src_np)
    copy_t = np_timed(lambda: np.copyto(dst_np, src_np), reps)
    ex = RT.executor
    names = azyx.devices()
    pairs = [(s, d) for s in names for d in names if "c:1" not in (s, d) or (s, d) == ("c:0", "c:1")]
    rows = []
    for s, d in pairs:
        t = await transfer_time(src_np, s, d, reps)
        strategy = ex.sync_strategy(s, d).value
        rows.append([f"{s} -> {d}", strategy, f"{nbytes / t / 1e9:.1f}", f"{nbytes / copy_t / 1e9:.1f}",
                     f"{copy_t / t:.2f}x"])
    return rows


async def transfer_time(src_np: np.ndarray, s: str, d: str, reps: int, warmup: int = 2) -> float:
    """Seconds per `UnifiedExecutor.execute_transfer` of `src_np`'s bytes from device `s` to device `d` (median). The
    source is computed on `s`, so it is that device's own buffer: a Tensor of host data may still sit in host:0's
    pool, which would time a host route instead."""
    src_t = Tensor(src_np, device=s) + 1
    await src_t.realize()
    src = GRAPH[src_t.id].buffer
    assert src is not None
    dst_dev, ex = RT.device(d), RT.executor

    async def once() -> None:
        dst = dst_dev.alloc(src_np.nbytes)
        v = ex.execute_transfer(src, dst)
        await dst.device.timeline.wait(v)
        await azyx.synchronize()

    return await timed(once, reps, warmup)


from common import machine_line, write_section  # noqa: E402  (beside this script)


def table(header: list[str], rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=str(REPO / "bench" / "RESULTS.md"))
    args = ap.parse_args()
    azyx.configure({"c": {"devices": 2}})  # c:1 too, for the peer route
    devices = [d for d in azyx.devices() if d != "c:1"]
    w = await workloads(devices, args.quick)
    tr = await transfers(args.quick)
    text = "\n".join([
        START, "", f"## Devices side by side ({'quick' if args.quick else 'full'} run, "
        f"{time.strftime('%Y-%m-%d')}, devices {', '.join(devices)})", "", machine_line(), "",
        "Rates (higher is better) or microseconds; the ratio columns are speed relative to numpy.", "",
        table(["workload", *devices, "numpy", *(f"{d}/numpy" for d in devices)], w), "",
        "Transfers through `UnifiedExecutor.execute_transfer` (64 MiB; quick: 4 MiB), GB/s, beside a numpy copy "
        "of the same size:", "",
        table(["route", "sync strategy", "GB/s", "numpy copy GB/s", "ratio"], tr), "", END])
    print(text)
    write_section(Path(args.out), START, END, text)


if __name__ == "__main__":
    asyncio.run(main())
