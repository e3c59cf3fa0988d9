"""azyx benchmark harness: azyx side by side with numpy (and PyTorch CPU when importable), checked against targets.

Run from the repository root:

    python bench/run.py [--quick] [--device c:0] [--out bench/RESULTS.md]

One asyncio run measures graph build cost, small-graph latency (first and steady), compile time of a long chain,
event-loop responsiveness while a large graph compiles and runs, fused elementwise bandwidth, reductions, matmul,
and the machine's copy bandwidth. The bench never asserts: it reports every target as met or not met, and an azyx
failure (exception, timeout or wrong result) is recorded in the report instead of stopping the run.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import gc
import importlib
import importlib.metadata
import math
import os
import platform
import random
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))
from common import cpu_model  # noqa: E402  (beside this script)

F32 = np.float32
MIB = 1 << 20
T = TypeVar("T")

MARK_START = "<!-- bench:results:start (written by bench/run.py; everything up to the end marker is replaced) -->"
MARK_END = "<!-- bench:results:end -->"
DEFAULT_HEADER = """# azyx benchmark results

Written by `bench/run.py`; the section between the markers below is replaced on every run, the rest is kept.
Reproduce from the repository root:

```
.venv/bin/pip install torch==2.13.0   # optional: adds the PyTorch CPU column (skipped when torch is not importable)
.venv/bin/python bench/run.py          # full run, at most about 3 minutes on 2 cores
.venv/bin/python bench/run.py --quick  # smoke run: smaller sizes and fewer repeats, not comparable with the targets
```

Options: `--device c:0` (azyx device, default `c:0`), `--out PATH` (this file). Times are medians of several repeats
after warm-up, taken with `time.perf_counter`; azyx times include `await t.realize()` returning with the result ready
and, for steady-state and throughput rows, rebuilding the graph from the same realized inputs every repeat.
Ratio columns are speed ratios (higher is better for azyx); they are shown only where the same work is compared.
Bandwidth counts 16 bytes/element for the fused chain (3 inputs read + 1 output written), the bytes read for the
reductions, and the bytes copied (once) for the copy; matmul counts 2*n^3 flops.
"""


# ----------------------------------------------------------------------------------------------------------------------
# configuration


@dataclass(frozen=True)
class Config:
    quick: bool
    device: str
    build_ops: int
    build_repeats: int
    small_n: int
    small_repeats: int
    chain_ops: int
    chain_reps: int
    heartbeat_n: int
    fused_n: int
    sum_n: int
    rowsum_side: int
    matmul_sizes: tuple[int, ...]
    copy_bytes: int
    repeats: int
    budget_s: float
    timeout_s: float  # most one azyx await may take; also cut so the whole run ends near `run_budget_s`
    run_budget_s: float


def make_config(quick: bool, device: str) -> Config:
    if quick:
        return Config(quick=True, device=device, build_ops=1000, build_repeats=2, small_n=1024, small_repeats=20,
                      chain_ops=400, chain_reps=1, heartbeat_n=4 * MIB, fused_n=1 * MIB, sum_n=1 * MIB,
                      rowsum_side=512, matmul_sizes=(128, 256), copy_bytes=16 * MIB, repeats=2, budget_s=1.0,
                      timeout_s=60.0, run_budget_s=45.0)
    return Config(quick=False, device=device, build_ops=1000, build_repeats=7, small_n=1024, small_repeats=300,
                  chain_ops=400, chain_reps=3, heartbeat_n=64 * MIB, fused_n=16 * MIB, sum_n=16 * MIB,
                  rowsum_side=4096, matmul_sizes=(1024, 2048), copy_bytes=256 * MIB, repeats=11, budget_s=8.0,
                  timeout_s=120.0, run_budget_s=200.0)


def size_label(n: int) -> str:
    return f"{n // MIB}M" if n % MIB == 0 else str(n)


def progress(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def tb_tail(exc: BaseException, n: int = 8) -> str:
    """The last `n` lines of a traceback, without the `^^^^` marker lines."""
    lines = "".join(traceback.format_exception(exc)).rstrip().splitlines()
    return "\n".join([ln for ln in lines if ln.strip(" ^~")][-n:])


# ----------------------------------------------------------------------------------------------------------------------
# report model


@dataclass
class Row:
    name: str
    unit: str
    higher_is_better: bool
    azyx: float | None = None
    numpy: float | None = None
    torch: float | None = None
    compare: bool = True  # ratio columns only when azyx/numpy/torch do the same work
    target_kind: str = ""  # "max": azyx <= v; "min": azyx >= v; "vs_numpy": speed ratio vs numpy >= v
    target_value: float = 0.0
    target_text: str = ""
    azyx_failed: bool = False

    def ratio(self, other: float | None) -> float | None:
        if not self.compare or self.azyx is None or other is None or self.azyx <= 0 or other <= 0:
            return None
        return self.azyx / other if self.higher_is_better else other / self.azyx

    def met(self) -> str:
        if not self.target_kind:
            return ""
        if self.azyx is None:
            return "no (azyx failed)" if self.azyx_failed else "n/a"
        if self.target_kind == "max":
            return "yes" if self.azyx <= self.target_value else "no"
        if self.target_kind == "min":
            return "yes" if self.azyx >= self.target_value else "no"
        r = self.ratio(self.numpy)
        if r is None:
            return "n/a"
        return "yes" if r >= self.target_value else "no"


@dataclass
class Report:
    cfg: Config
    rows: list[Row] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    failures: list[tuple[str, str]] = field(default_factory=list)

    def row(self, *args: Any, **kwargs: Any) -> Row:
        r = Row(*args, **kwargs)
        self.rows.append(r)
        return r

    def note(self, text: str) -> None:
        self.notes.append(text)
        progress(f"note: {text}")

    def fail(self, workload: str, exc: BaseException, row: Row | None = None) -> None:
        if isinstance(exc, TimeoutError) and exc.args:  # raised by `bounded`: the azyx traceback is only asyncio's
            tail = f"TimeoutError: {exc}"
        else:
            tail = tb_tail(exc)
        self.failures.append((workload, tail))
        if row is not None:
            row.azyx_failed = True
        progress(f"azyx FAILED in {workload}: {tail.splitlines()[-1] if tail else exc!r}")

    def mismatch(self, workload: str, err: float, tol: float, row: Row | None = None) -> None:
        msg = f"wrong result: max |azyx - numpy| / max |numpy| = {err:.3g} (tolerance {tol:g})"
        self.failures.append((workload, msg))
        if row is not None:
            row.azyx_failed = True
            row.azyx = None
        progress(f"azyx WRONG RESULT in {workload}: rel err {err:.3g}")


# ----------------------------------------------------------------------------------------------------------------------
# timing helpers


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def time_sync(fn: Callable[[], Any], repeats: int, number: int = 1, warmup: int = 1,
              budget_s: float | None = None) -> list[float]:
    """Per-call seconds of `fn`: `repeats` samples, each the mean over `number` back-to-back calls."""
    for _ in range(warmup):
        fn()
    times: list[float] = []
    start = time.perf_counter()
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(number):
            fn()
        times.append((time.perf_counter() - t0) / number)
        if budget_s is not None and time.perf_counter() - start > budget_s:
            break
    return times


class Deadline:
    """When the whole run should be over; azyx awaits get shorter timeouts as it nears (never under MIN_TIMEOUT_S)."""

    at: float = math.inf
    MIN_TIMEOUT_S = 5.0


async def bounded(aw: Awaitable[T], cfg: Config) -> T:
    """Await an azyx awaitable with a timeout; a hung realize is cancelled and reported instead of stalling the run."""
    timeout = max(Deadline.MIN_TIMEOUT_S, min(cfg.timeout_s, Deadline.at - time.perf_counter()))
    try:
        return await asyncio.wait_for(aw, timeout)
    except TimeoutError as e:
        raise TimeoutError(f"no result after {timeout:.0f} s (the await was cancelled)") from e


async def realize_bounded(t: Any, cfg: Config) -> Any:
    """A plain await inside timed loops: `guarded` bounds the whole workload, so no per-call wait_for (which
    would add a task per realize to what is measured)."""
    return await t.realize()


@dataclass
class AzyxTiming:
    first_s: float  # the first build+realize (includes compiling when the graph is new)
    times: list[float]  # steady build+realize per repeat, seconds
    result: Any  # the last realized output tensor, for checking


async def time_azyx(build: Callable[[], Any], cfg: Config, repeats: int, warmup: int = 2) -> AzyxTiming:
    """Build the graph from already-realized inputs and await its realize, `warmup` times, then `repeats` times timed.

    Every repeat rebuilds the graph (steady state: the compiled kernels are cached, the graph is not reused)."""
    first = -1.0
    y: Any = None
    for i in range(max(1, warmup)):
        y = None
        t0 = time.perf_counter()
        y = build()
        await realize_bounded(y, cfg)
        dt = time.perf_counter() - t0
        if i == 0:
            first = dt
    times: list[float] = []
    start = time.perf_counter()
    for _ in range(repeats):
        y = None  # drop the previous output so its buffer can be reused, like numpy's temporaries are
        t0 = time.perf_counter()
        y = build()
        await realize_bounded(y, cfg)
        times.append(time.perf_counter() - t0)
        if time.perf_counter() - start > cfg.budget_s:
            break
    return AzyxTiming(first, times, y)


def rel_err(got: np.ndarray, ref: np.ndarray) -> float:
    got = np.asarray(got, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    if got.shape != ref.shape:
        return float("inf")
    scale = max(float(np.max(np.abs(ref))) if ref.size else 0.0, 1e-30)
    return float(np.max(np.abs(got - ref))) / scale if ref.size else 0.0


async def check_result(report: Report, workload: str, t: Any, ref: np.ndarray, row: Row | None,
                       tol: float = 1e-3) -> None:
    """Compare an azyx result with numpy's (not timed); a mismatch voids the azyx number of `row`."""
    try:
        got = await bounded(t.numpy(), report.cfg)
    except Exception as e:  # the bench records every azyx failure and carries on
        report.fail(f"{workload} (reading the result back)", e, None)
        return
    err = rel_err(got, ref)
    if not err <= tol:
        report.mismatch(workload, err, tol, row)


# ----------------------------------------------------------------------------------------------------------------------
# graphs shared by the three libraries (only Python operators, so numpy arrays, torch and azyx tensors all work)


class Uniq:
    """Constants no earlier run has used, so azyx's on-disk compile cache cannot hold their kernels."""

    def __init__(self) -> None:
        seed = time.time_ns() ^ (os.getpid() << 32) ^ int.from_bytes(os.urandom(8), "little")
        self.rng = random.Random(seed)

    def const(self) -> float:
        # exactly representable in float32, in (1, 1.0079): hundreds of them multiplied stay finite
        return 1.0 + self.rng.randrange(1, 1 << 16) * 2.0**-23


Spec = list[tuple[str, str | float]]
_OPS = {"mul": "*", "add": "+", "sub": "-", "div": "/"}


def make_chain(spec: Spec) -> Callable[[Any, Any], Any]:
    """Straight-line `f(a, b)` applying `spec` to `a` (no per-op dispatch overhead inside the timed code)."""
    lines = ["def f(a, b):", "    y = a"]
    for op, arg in spec:
        operand = arg if isinstance(arg, str) else repr(float(arg))
        lines.append(f"    y = y {_OPS[op]} {operand}")
    lines.append("    return y")
    ns: dict[str, Any] = {}
    exec("\n".join(lines), ns)  # source generated from our own op table above
    fn: Callable[[Any, Any], Any] = ns["f"]
    return fn


def ten_op_spec(u: Uniq) -> Spec:
    spec: Spec = [("mul", u.const()), ("add", "b"), ("mul", u.const()), ("sub", "a"), ("mul", "b"),
                  ("add", u.const()), ("div", u.const()), ("sub", u.const()), ("mul", "a"), ("add", u.const())]
    u.rng.shuffle(spec)  # the op order is unique to this run too, in case constants are kernel arguments
    return spec


def long_chain_spec(u: Uniq, n_ops: int) -> Spec:
    return [(u.rng.choice(("mul", "add", "sub", "div")), u.const()) for _ in range(n_ops)]


def build_fixed_chain(x: Any, n_ops: int) -> Any:
    y = x
    for _ in range(n_ops // 4):
        y = y * 1.0001
        y = y + 0.5
        y = y - 0.25
        y = y / 1.0001
    return y


# ----------------------------------------------------------------------------------------------------------------------
# optional imports


def import_azyx() -> tuple[Any, str | None]:
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    try:
        ax = importlib.import_module("azyx")
    except Exception as e:  # a broken azyx must not stop the numpy/torch columns
        return None, tb_tail(e)
    missing = [name for name in ("Tensor", "realize") if not hasattr(ax, name)]
    if missing:  # e.g. azyx/ without __init__.py imports as an empty namespace package
        where = getattr(ax, "__file__", None) or list(getattr(ax, "__path__", []))
        return None, f"azyx imported from {where} but lacks {', '.join(missing)} (package incomplete)"
    return ax, None


def import_torch() -> tuple[Any, str | None]:
    try:
        return importlib.import_module("torch"), None
    except Exception as e:
        return None, f"{type(e).__name__}: {e}"


# ----------------------------------------------------------------------------------------------------------------------
# workloads


class Bench:
    def __init__(self, cfg: Config, report: Report, ax: Any, torch: Any) -> None:
        self.cfg = cfg
        self.report = report
        self.ax = ax
        self.torch = torch
        self.uniq = Uniq()
        self.rng = np.random.default_rng(1234)
        self.copy_gbs: float | None = None
        self.fused: Row | None = None

    # helpers -----------------------------------------------------------------------------------------------------

    def tensor(self, arr: np.ndarray) -> Any:
        return self.ax.Tensor(arr, device=self.cfg.device)

    async def inputs(self, *arrs: np.ndarray) -> list[Any]:
        ts = [self.tensor(a) for a in arrs]
        await bounded(self.ax.realize(*ts), self.cfg)
        return ts

    def th(self, arr: np.ndarray) -> Any:
        return self.torch.from_numpy(arr)

    async def guarded(self, workload: str, row: Row | None, fn: Callable[[], Coroutine[Any, Any, None]]) -> None:
        """Run the azyx half of a workload; any exception is recorded against `row`, and the bench goes on."""
        if self.ax is None:
            if row is not None:
                row.azyx_failed = True
            return
        try:
            await bounded(fn(), self.cfg)
        except Exception as e:
            self.report.fail(workload, e, row)
        finally:
            gc.collect()

    # 8. copy bandwidth (measured first: the fused chain is compared with it) ------------------------------------

    async def copy_bandwidth(self) -> None:
        nbytes = self.cfg.copy_bytes
        progress(f"copy bandwidth: np.copyto of {nbytes // MIB} MiB")
        src = np.full(nbytes // 4, 1.5, dtype=F32)
        dst = np.empty_like(src)
        times = time_sync(lambda: np.copyto(dst, src), self.cfg.repeats, warmup=2)
        self.copy_gbs = nbytes / median(times) / 1e9
        self.report.row(f"copy bandwidth, np.copyto {nbytes // MIB} MiB (GB/s copied)", "GB/s", True,
                        numpy=self.copy_gbs, compare=False)

    # 1. graph build ---------------------------------------------------------------------------------------------

    async def graph_build(self) -> None:
        cfg = self.cfg
        n_ops = cfg.build_ops
        progress(f"graph build: {n_ops}-op elementwise chain, no realize")
        row = self.report.row(f"graph build, {n_ops}-op chain on {cfg.small_n} f32, no realize (us/op)", "us", False,
                              compare=False, target_kind="max", target_value=2.0, target_text="<= 2 us/op")
        x_np = np.ones(cfg.small_n, dtype=F32)
        if self.torch is not None:
            xt = self.th(x_np)
            times = time_sync(lambda: build_fixed_chain(xt, n_ops), cfg.build_repeats, warmup=1)
            row.torch = median(times) / n_ops * 1e6
            self.report.note("graph build: the torch column is eager execution per op (context, not the same work)")

        async def run() -> None:
            x = self.tensor(x_np)  # a lazy leaf: building never touches the device
            y: Any = build_fixed_chain(x, n_ops)  # warm-up
            times: list[float] = []
            for _ in range(cfg.build_repeats):
                y = None  # free the previous graph outside the timed region
                t0 = time.perf_counter()
                y = build_fixed_chain(x, n_ops)
                times.append(time.perf_counter() - t0)
            row.azyx = median(times) / n_ops * 1e6
            del y

        await self.guarded("graph build", row, run)

    # 2. 10-op graph, first and steady ---------------------------------------------------------------------------

    async def small_graph(self) -> None:
        cfg = self.cfg
        n = cfg.small_n
        progress(f"10-op graph on {n} f32: first realize and steady state")
        spec = ten_op_spec(self.uniq)
        fn = make_chain(spec)
        a_np = self.rng.uniform(0.5, 1.5, n).astype(F32)
        b_np = self.rng.uniform(0.5, 1.5, n).astype(F32)
        ref = fn(a_np, b_np)
        first = self.report.row(f"10-op graph, {n} f32: first realize, new graph incl. compile (ms)", "ms", False,
                                compare=False)
        steady = self.report.row(f"10-op graph, {n} f32: steady realize only (us)", "us", False,
                                 target_kind="max", target_value=20.0, target_text="<= 20 us")
        total = self.report.row(f"10-op graph, {n} f32: steady build+realize (us)", "us", False)
        np_times = time_sync(lambda: fn(a_np, b_np), 7, number=200)
        steady.numpy = total.numpy = median(np_times) * 1e6
        if self.torch is not None:
            at, bt = self.th(a_np), self.th(b_np)
            th_times = time_sync(lambda: fn(at, bt), 7, number=200)
            steady.torch = total.torch = median(th_times) * 1e6

        async def run() -> None:
            a, b = await self.inputs(a_np, b_np)
            t0 = time.perf_counter()
            y = fn(a, b)
            t1 = time.perf_counter()
            await realize_bounded(y, cfg)
            t2 = time.perf_counter()
            first.azyx = (t2 - t1) * 1e3
            self.report.note(f"10-op graph: first build {(t1 - t0) * 1e6:.0f} us, first realize "
                             f"{(t2 - t1) * 1e3:.2f} ms (graph structure and constants unique to this run, "
                             "so the compile cache cannot hit)")
            await check_result(self.report, "10-op graph (first realize)", y, ref, first)
            for _ in range(5):  # warm-up of the steady state
                y = fn(a, b)
                await realize_bounded(y, cfg)
            real: list[float] = []
            both: list[float] = []
            start = time.perf_counter()
            for _ in range(cfg.small_repeats):
                y = None
                t0 = time.perf_counter()
                y = fn(a, b)
                t1 = time.perf_counter()
                await realize_bounded(y, cfg)
                t2 = time.perf_counter()
                real.append(t2 - t1)
                both.append(t2 - t0)
                if t2 - start > cfg.budget_s:
                    break
            steady.azyx = median(real) * 1e6
            total.azyx = median(both) * 1e6
            await check_result(self.report, "10-op graph (steady)", y, ref, steady)
            if steady.azyx is None:
                total.azyx = None

        await self.guarded("10-op graph", steady, run)
        for r in (first, steady, total):
            r.azyx_failed = r.azyx is None

    # 3. first realize of a long chain ---------------------------------------------------------------------------

    async def long_chain(self) -> None:
        cfg = self.cfg
        n, n_ops = cfg.small_n, cfg.chain_ops
        progress(f"{n_ops}-op chain on {n} f32: first realize (never cached), {cfg.chain_reps} fresh graph(s)")
        row = self.report.row(f"{n_ops}-op chain, {n} f32: first realize incl. compile (s)", "s", False,
                              compare=False, target_kind="max", target_value=0.3, target_text="<= 0.3 s")
        a_np = self.rng.uniform(0.5, 1.5, n).astype(F32)
        fn0 = make_chain(long_chain_spec(self.uniq, n_ops))
        row.numpy = median(time_sync(lambda: fn0(a_np, a_np), 5, number=5))
        if self.torch is not None:
            at = self.th(a_np)
            row.torch = median(time_sync(lambda: fn0(at, at), 5, number=5))
        self.report.note(f"{n_ops}-op chain: numpy/torch columns are eager execution of the same {n_ops} ops (context)")

        async def run() -> None:
            (a,) = await self.inputs(a_np)
            builds: list[float] = []
            reals: list[float] = []
            start = time.perf_counter()
            for i in range(cfg.chain_reps):
                fn = make_chain(long_chain_spec(self.uniq, n_ops))  # fresh constants: a never-seen graph each time
                t0 = time.perf_counter()
                y = fn(a, a)
                t1 = time.perf_counter()
                await realize_bounded(y, cfg)
                t2 = time.perf_counter()
                builds.append(t1 - t0)
                reals.append(t2 - t1)
                if i == 0:
                    await check_result(self.report, f"{n_ops}-op chain", y, fn(a_np, a_np), row)
                    if row.azyx_failed:
                        return
                if time.perf_counter() - start > max(cfg.budget_s, 3 * reals[0]) or reals[0] > 5.0:
                    break
            row.azyx = median(reals)
            self.report.note(f"{n_ops}-op chain: {len(reals)} fresh graph(s), first realize "
                             + ", ".join(f"{r:.3f}" for r in reals) + f" s; build {median(builds) * 1e3:.2f} ms")

        await self.guarded(f"{n_ops}-op chain", row, run)

    # 4. event-loop lateness while a big graph compiles and runs -------------------------------------------------

    @staticmethod
    async def heartbeat(stop: asyncio.Event, beats: list[tuple[float, float]], period: float = 0.001) -> None:
        """Sleep `period` in a loop; record (wake time, lateness) of every wake-up."""
        while not stop.is_set():
            t0 = time.perf_counter()
            await asyncio.sleep(period)
            t1 = time.perf_counter()
            beats.append((t1, t1 - t0 - period))

    @staticmethod
    def lateness_stats(lates: list[float]) -> tuple[float, float]:
        arr = np.asarray(lates, dtype=np.float64) * 1e3
        return float(arr.max()), float(np.percentile(arr, 99))

    async def event_loop_lateness(self) -> None:
        cfg = self.cfg
        n = cfg.heartbeat_n
        progress(f"heartbeat: 1 ms asyncio.sleep loop while a never-seen {size_label(n)}-element f32 graph realizes")
        worst = self.report.row(f"heartbeat lateness, worst, during a new {size_label(n)} f32 graph's realize (ms)",
                                "ms", False, compare=False, target_kind="max", target_value=5.0,
                                target_text="<= 5 ms")
        p99 = self.report.row(f"heartbeat lateness, p99, during a new {size_label(n)} f32 graph's realize (ms)", "ms",
                              False, compare=False)

        # idle baseline: what the loop and the OS give with nothing else running
        stop = asyncio.Event()
        beats: list[tuple[float, float]] = []
        task = asyncio.create_task(self.heartbeat(stop, beats))
        await asyncio.sleep(0.3)
        stop.set()
        await task
        b_worst, b_p99 = self.lateness_stats([late for _, late in beats])
        self.report.note(f"heartbeat: idle baseline (no work) worst {b_worst:.3f} ms, p99 {b_p99:.3f} ms "
                         f"over {len(beats)} beats")

        async def run() -> None:
            x_np = self.rng.random(n, dtype=F32)
            (x,) = await self.inputs(x_np)
            del x_np
            u = self.uniq
            spec: Spec = [("mul", u.const()), ("add", "b"), ("mul", u.const()), ("sub", u.const()),
                          ("mul", "b"), ("add", u.const()), ("div", u.const()), ("sub", "b")]
            fn = make_chain(spec)
            stop = asyncio.Event()
            beats: list[tuple[float, float]] = []
            gc.collect()
            gc.freeze()  # as a service does once it has started (README), and as the other heartbeat rows do
            task = asyncio.create_task(self.heartbeat(stop, beats))
            try:
                await asyncio.sleep(0.05)
                t0 = time.perf_counter()
                y = fn(x, x)
                await realize_bounded(y, cfg)
                t1 = time.perf_counter()
                await asyncio.sleep(0.005)
            finally:
                stop.set()
                await task
                gc.unfreeze()
            during = [late for wake, late in beats if wake >= t0]
            if not during:
                raise RuntimeError("no heartbeat woke up during the realize")
            worst.azyx, p99.azyx = self.lateness_stats(during)
            self.report.note(f"heartbeat: realize of the new {size_label(n)} graph took {t1 - t0:.3f} s (build, "
                             f"compile and run, input already realized); {len(during)} beats during it")
            del y, x

        await self.guarded("heartbeat", worst, run)
        p99.azyx_failed = p99.azyx is None

    async def upload_lateness(self) -> None:
        """The heartbeat while host data of `copy_bytes` is realized onto the device and read back with numpy(): the
        staging copies run on workers, never on the loop (building the tensor, a synchronous copy of the caller's
        array, is outside the measure)."""
        cfg = self.cfg
        nbytes = cfg.copy_bytes
        progress(f"heartbeat: 1 ms asyncio.sleep loop while {nbytes // MIB} MiB are uploaded and read back")
        worst = self.report.row(f"heartbeat lateness, worst, during a {nbytes // MIB} MiB upload and read-back (ms)",
                                "ms", False, compare=False, target_kind="max", target_value=5.0,
                                target_text="<= 5 ms")

        async def run() -> None:
            data = self.rng.integers(0, 1 << 30, nbytes // 4, dtype=np.int32)
            x = self.tensor(data)
            stop = asyncio.Event()
            beats: list[tuple[float, float]] = []
            gc.collect()
            gc.freeze()  # as a service does once it has started (README)
            task = asyncio.create_task(self.heartbeat(stop, beats))
            try:
                await asyncio.sleep(0.01)
                t0 = time.perf_counter()
                await bounded(x.realize(), cfg)
                back = await bounded(x.numpy(), cfg)
                t1 = time.perf_counter()
                await asyncio.sleep(0.005)
            finally:
                stop.set()
                await task
                gc.unfreeze()
            if not np.array_equal(back, data):
                raise AssertionError("the data read back differs from the data uploaded")
            during = [late for wake, late in beats if wake >= t0]
            worst.azyx = self.lateness_stats(during)[0] if during else None
            self.report.note(f"upload: {nbytes // MIB} MiB realized on {cfg.device} and read back in "
                             f"{(t1 - t0) * 1e3:.0f} ms; {len(during)} beats during it")

        await self.guarded("upload heartbeat", worst, run)

    # numbers are data: per-request scalars and learning-rate schedules ----------------------------------------

    async def scalar_requests(self) -> None:
        """200 concurrent requests, each ((x * a + b).relu() * 0.5).sum() with its own a, b, against the same requests
        with one a, b for all: scalars are kernel arguments, so distinct values must cost (almost) nothing more."""
        cfg, ax = self.cfg, self.ax
        n_req, n = (50, 4096) if cfg.quick else (200, 4096)
        progress(f"{n_req} concurrent requests with distinct vs equal scalars")
        row = self.report.row(f"{n_req} concurrent requests, distinct / equal scalars (time ratio)", "x", False,
                              compare=False, target_kind="max", target_value=1.2, target_text="<= 1.2x")
        late = self.report.row(f"heartbeat lateness, worst, during {n_req} concurrent requests with distinct scalars "
                               "(ms)", "ms", False, compare=False, target_kind="max", target_value=5.0,
                               target_text="<= 5 ms")
        x_np = self.rng.standard_normal(n).astype(F32)

        async def run() -> None:
            (x,) = await self.inputs(x_np)

            async def one(a: float, b: float) -> float:  # (`guarded` bounds the whole workload: no wait_for each)
                return float(await ((x * a + b).relu() * 0.5).sum().item())

            async def batch(pairs: list[tuple[float, float]]) -> tuple[float, list[float]]:
                t0 = time.perf_counter()
                got = await asyncio.gather(*[one(a, b) for a, b in pairs])
                return time.perf_counter() - t0, got

            def check(pairs: list[tuple[float, float]], got: list[float]) -> None:
                """numpy's results (the client's work, checked once the heartbeat has stopped: 200 of them hold the
                loop for milliseconds)"""
                want = [float((np.maximum(x_np.astype(np.float64) * a + b, 0) * 0.5).sum()) for a, b in pairs]
                if not np.allclose(got, want, rtol=1e-4, atol=1e-3):
                    raise AssertionError("a request's result differs from numpy's")

            await batch([(1.5, 0.25)] * 4)  # compile once
            equal, distinct, lates = [], [], []
            gc.collect()
            gc.freeze()  # as a service does once it has started (README): a full collection is not the loop's work
            try:
                for _ in range(3 if cfg.quick else 7):
                    same = [(1.5, 0.25)] * n_req
                    dt, got = await batch(same)
                    equal.append(dt)
                    check(same, got)
                    pairs = [(float(self.rng.uniform(0.5, 2)), float(self.rng.uniform(-1, 1))) for _ in range(n_req)]
                    stop = asyncio.Event()
                    beats: list[tuple[float, float]] = []
                    task = asyncio.create_task(self.heartbeat(stop, beats))
                    await asyncio.sleep(0.01)
                    t0 = time.perf_counter()
                    dt, got = await batch(pairs)
                    stop.set()
                    await task
                    distinct.append(dt)
                    check(pairs, got)
                    lates += [lt for wake, lt in beats if wake >= t0]
            finally:
                gc.unfreeze()
            row.azyx = median(distinct) / median(equal)
            late.azyx = self.lateness_stats(lates)[0] if lates else None
            self.report.note(f"{n_req} concurrent requests: equal scalars {median(equal) * 1e3:.1f} ms, distinct "
                             f"{median(distinct) * 1e3:.1f} ms (medians; plan cache {len(ax.runtime.RT.plan_cache)})")

        await self.guarded("scalar requests", row, run)
        late.azyx_failed = late.azyx is None

    async def lr_schedule(self) -> None:
        """An Adam training step whose learning rate changes every step (LambdaLR) against the same step with a fixed
        rate: the rate is a kernel argument, so the schedule costs no plan and no compile."""
        cfg, ax = self.cfg, self.ax
        steps = 30 if cfg.quick else 200
        progress(f"lr-scheduled vs fixed Adam step, {steps} steps each")
        row = self.report.row("training step with an lr schedule / fixed lr (time ratio)", "x", False,
                              compare=False, target_kind="max", target_value=1.1, target_text="<= 1.1x")

        async def run() -> None:
            nn, optim = ax.nn, ax.optim
            x_np = self.rng.standard_normal((64, 128)).astype(F32)
            y_np = self.rng.integers(0, 10, 64).astype(np.int32)
            x, y = await self.inputs(x_np, y_np)

            async def train(schedule: bool) -> float:
                ax.manual_seed(0)
                model = nn.Sequential(nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 10))
                opt = optim.Adam(model.parameters(), lr=1e-3)
                sched = optim.LambdaLR(opt, lambda e: 0.99 ** e) if schedule else None
                times = []
                for _ in range(steps):
                    t0 = time.perf_counter()
                    with ax.GradientTape() as tape:
                        loss = nn.cross_entropy(model(x), y)
                    await bounded(ax.realize(loss, *opt.step(tape.gradient(loss, opt.params))), cfg)
                    if sched is not None:
                        sched.step()
                    times.append(time.perf_counter() - t0)
                return median(times[steps // 3:])

            await train(True)  # plans and kernels exist from here on
            fixed, scheduled = [], []
            for _ in range(3):
                fixed.append(await train(False))
                scheduled.append(await train(True))
            row.azyx = median(scheduled) / median(fixed)
            self.report.note(f"lr schedule: a step takes {median(scheduled) * 1e6:.0f} us with LambdaLR, "
                             f"{median(fixed) * 1e6:.0f} us with a fixed rate (Adam, MLP 128-64-10, batch 64)")

        await self.guarded("lr schedule", row, run)

    # 5. fused elementwise chain ---------------------------------------------------------------------------------

    async def fused_chain(self) -> None:
        cfg = self.cfg
        n = cfg.fused_n
        progress(f"fused chain relu(a*b+c)*0.5+a on {size_label(n)} f32")
        row = self.report.row(f"relu(a*b+c)*0.5+a, {size_label(n)} f32 (GB/s, 16 B/elem)", "GB/s", True,
                              target_kind="vs_numpy", target_value=3.0, target_text=">= 3x numpy")
        frac = self.report.row("relu(a*b+c)*0.5+a bandwidth / copy bandwidth", "x", True, compare=False,
                               target_kind="min", target_value=0.8, target_text=">= 0.8 of copy")
        self.fused = row
        a_np, b_np, c_np = (self.rng.standard_normal(n, dtype=F32) for _ in range(3))
        nbytes = 16 * n
        ref = np.maximum(a_np * b_np + c_np, 0) * 0.5 + a_np
        row.numpy = nbytes / median(time_sync(lambda: np.maximum(a_np * b_np + c_np, 0) * 0.5 + a_np,
                                              cfg.repeats)) / 1e9
        if self.torch is not None:
            torch = self.torch
            at, bt, ct = self.th(a_np), self.th(b_np), self.th(c_np)
            row.torch = nbytes / median(time_sync(lambda: torch.relu(at * bt + ct) * 0.5 + at, cfg.repeats)) / 1e9

        async def run() -> None:
            a, b, c = await self.inputs(a_np, b_np, c_np)
            tm = await time_azyx(lambda: (a * b + c).relu() * 0.5 + a, cfg, cfg.repeats)
            row.azyx = nbytes / median(tm.times) / 1e9
            self.report.note(f"fused chain: first build+realize (compile) {tm.first_s:.3f} s; steady median "
                             f"{median(tm.times) * 1e3:.2f} ms over {len(tm.times)} repeats")
            await check_result(self.report, "fused chain", tm.result, ref, row)

        await self.guarded("fused chain", row, run)
        if self.copy_gbs:
            for attr in ("azyx", "numpy", "torch"):
                v = getattr(row, attr)
                setattr(frac, attr, None if v is None else v / self.copy_gbs)
        frac.azyx_failed = frac.azyx is None

    # 6. reductions ----------------------------------------------------------------------------------------------

    async def total_sum(self) -> None:
        cfg = self.cfg
        n = cfg.sum_n
        progress(f"sum of {size_label(n)} f32")
        row = self.report.row(f"sum, {size_label(n)} f32 (GB/s read)", "GB/s", True, target_kind="vs_numpy",
                              target_value=1.5, target_text=">= 1.5x numpy")
        x_np = self.rng.random(n, dtype=F32)
        np_ms = median(time_sync(lambda: x_np.sum(), cfg.repeats)) * 1e3
        row.numpy = 4 * n / np_ms / 1e6
        if self.torch is not None:
            xt = self.th(x_np)
            row.torch = 4 * n / median(time_sync(lambda: xt.sum(), cfg.repeats)) / 1e9

        async def run_sum() -> None:
            (x,) = await self.inputs(x_np)
            tm = await time_azyx(lambda: x.sum(), cfg, cfg.repeats)
            row.azyx = 4 * n / median(tm.times) / 1e9
            self.report.note(f"sum: azyx steady {median(tm.times) * 1e3:.3f} ms, numpy "
                             f"{np_ms:.3f} ms (first incl. compile {tm.first_s:.3f} s)")
            await check_result(self.report, "sum", tm.result, np.asarray(x_np.sum(dtype=np.float64)), row)

        await self.guarded("sum", row, run_sum)

    async def row_sum(self) -> None:
        cfg = self.cfg
        s = cfg.rowsum_side
        progress(f"row-sum of {s}x{s} f32")
        rrow = self.report.row(f"row-sum axis=1, {s}x{s} f32 (GB/s read)", "GB/s", True, target_kind="vs_numpy",
                               target_value=1.5, target_text=">= 1.5x numpy")
        m_np = self.rng.random((s, s), dtype=F32)
        np_ms = median(time_sync(lambda: m_np.sum(axis=1), cfg.repeats)) * 1e3
        rrow.numpy = 4 * s * s / np_ms / 1e6
        if self.torch is not None:
            mt = self.th(m_np)
            rrow.torch = 4 * s * s / median(time_sync(lambda: mt.sum(dim=1), cfg.repeats)) / 1e9

        async def run_rowsum() -> None:
            (m,) = await self.inputs(m_np)
            tm = await time_azyx(lambda: m.sum(axis=1), cfg, cfg.repeats)
            rrow.azyx = 4 * s * s / median(tm.times) / 1e9
            self.report.note(f"row-sum: azyx steady {median(tm.times) * 1e3:.3f} ms, numpy "
                             f"{np_ms:.3f} ms (first incl. compile {tm.first_s:.3f} s)")
            await check_result(self.report, "row-sum", tm.result, m_np.sum(axis=1, dtype=np.float64), rrow)

        await self.guarded("row-sum", rrow, run_rowsum)

    # 7. matmul --------------------------------------------------------------------------------------------------

    async def matmuls(self) -> None:
        cfg = self.cfg
        for n in cfg.matmul_sizes:
            progress(f"matmul {n}x{n} f32")
            flops = 2.0 * n**3
            row = self.report.row(f"matmul {n}x{n} f32 (GFLOP/s)", "GFLOP/s", True, target_kind="vs_numpy",
                                  target_value=0.5, target_text=">= 0.5x numpy")
            a_np = self.rng.standard_normal((n, n), dtype=F32)
            b_np = self.rng.standard_normal((n, n), dtype=F32)
            row.numpy = flops / median(time_sync(lambda: a_np @ b_np, cfg.repeats, budget_s=cfg.budget_s)) / 1e9
            if self.torch is not None:
                at, bt = self.th(a_np), self.th(b_np)
                row.torch = flops / median(time_sync(lambda: at @ bt, cfg.repeats, budget_s=cfg.budget_s)) / 1e9
            ref = a_np.astype(np.float64) @ b_np.astype(np.float64)

            async def run(a_np: np.ndarray = a_np, b_np: np.ndarray = b_np, row: Row = row, n: int = n,
                          ref: np.ndarray = ref, flops: float = flops) -> None:
                a, b = await self.inputs(a_np, b_np)
                tm = await time_azyx(lambda: a @ b, cfg, cfg.repeats, warmup=1)
                row.azyx = flops / median(tm.times) / 1e9
                self.report.note(f"matmul {n}: azyx steady {median(tm.times) * 1e3:.2f} ms over {len(tm.times)} "
                                 f"repeats (first incl. compile {tm.first_s:.3f} s)")
                await check_result(self.report, f"matmul {n}", tm.result, ref, row)

            await self.guarded(f"matmul {n}", row, run)


    async def bf16_matmuls(self) -> None:
        """bfloat16 products (inputs and output bfloat16, float32 accumulation) against PyTorch's CPU bfloat16 matmul:
        the square sizes and MiniLM's `x @ W.T` (32 sequences of 128 tokens, 384 -> 1536); the device's widening
        path (bfloat16 widened to float32 as packed) measured beside the AVX-512 BF16 one where the device has it,
        and numpy's float32 product as context (notes)."""
        cfg = self.cfg
        tokens = 512 if cfg.quick else 32 * 128
        shapes = [(f"{n}x{n}", n, n, n, False) for n in cfg.matmul_sizes] + [
            (f"{tokens}x384 @ W.T (1536x384, MiniLM)", tokens, 384, 1536, True)]
        for label, m, k, n, transposed in shapes:
            progress(f"matmul {label} bf16")
            flops = 2.0 * m * n * k
            row = self.report.row(f"matmul {label} bf16 (GFLOP/s)", "GFLOP/s", True)
            a_np = self.rng.standard_normal((m, k), dtype=F32)
            b_np = self.rng.standard_normal((n, k) if transposed else (k, n), dtype=F32)
            np_gflops = flops / median(time_sync(lambda: a_np @ (b_np.T if transposed else b_np), cfg.repeats,
                                                 budget_s=cfg.budget_s)) / 1e9
            torch_b16: Any = None
            if self.torch is not None:
                at, bt = self.th(a_np).bfloat16(), self.th(b_np).bfloat16()
                row.torch = flops / median(time_sync(lambda: at @ (bt.T if transposed else bt), cfg.repeats,
                                                     budget_s=cfg.budget_s)) / 1e9
                torch_b16 = (at @ (bt.T if transposed else bt)).float().numpy()

            async def run(a_np: np.ndarray = a_np, b_np: np.ndarray = b_np, row: Row = row, label: str = label,
                          transposed: bool = transposed, flops: float = flops, np_gflops: float = np_gflops,
                          torch_b16: Any = torch_b16) -> None:
                a, b = (t.cast("bfloat16") for t in await self.inputs(a_np, b_np))
                await bounded(self.ax.realize(a, b), cfg)
                ra = np.asarray(await bounded(a.cast("float32").numpy(), cfg), dtype=np.float64)
                rb = np.asarray(await bounded(b.cast("float32").numpy(), cfg), dtype=np.float64)
                ref = ra @ (rb.T if transposed else rb)
                dev = self.ax.runtime.RT.device(cfg.device)
                paths = [("AVX-512 BF16", dev.dialect), ("widening", None)] if getattr(dev.dialect, "bf16_dot", False) \
                    else [("widening", dev.dialect)]
                found: dict[str, float] = {}
                saved = dev.dialect
                try:
                    for name, dialect in paths:
                        dev.dialect = dialect or dataclasses.replace(saved, bf16_dot=False)
                        self.ax.runtime.RT.plan_cache.clear()
                        tm = await time_azyx(lambda: a @ (b.T if transposed else b), cfg, cfg.repeats, warmup=1)
                        found[name] = flops / median(tm.times) / 1e9
                        await check_result(self.report, f"matmul {label} bf16 ({name})",
                                           tm.result.cast("float32"), ref, row, tol=1e-2)
                finally:
                    dev.dialect = saved
                    self.ax.runtime.RT.plan_cache.clear()
                row.azyx = found[paths[0][0]] if not row.azyx_failed else None
                paths_text = ", ".join(f"{name} {g:.0f}" for name, g in found.items())
                torch_text = ""
                if torch_b16 is not None:
                    torch_text = f"; torch bf16 vs the float32 product of the same bf16 inputs: rel err " \
                                 f"{rel_err(torch_b16, ref):.2g}"
                self.report.note(f"matmul {label} bf16: azyx {paths_text} GFLOP/s; numpy float32 {np_gflops:.0f} "
                                 f"GFLOP/s (context: other dtype){torch_text}")

            await self.guarded(f"matmul {label} bf16", row, run)

    async def searched_matmuls(self) -> None:
        """The same products with the kernel search's winners: bench/search.py measures them in fresh processes over
        an empty cache (search off, `azyx.tune`, search on), then a second process that must find the cache."""
        cfg = self.cfg
        import search as search_bench

        for n in cfg.matmul_sizes:
            progress(f"matmul {n}x{n} f32 searched")
            row = self.report.row(f"matmul {n}x{n} f32, searched (GFLOP/s)", "GFLOP/s", True, target_kind="vs_numpy",
                                  target_value=1.0, target_text=">= 1.0x numpy")

            async def run(n: int = n, row: Row = row) -> None:
                r = await asyncio.to_thread(search_bench.measure, cfg.device, n, "quick", 5.0 if cfg.quick else 60.0,
                                            3 if cfg.quick else 7)
                row.azyx, row.numpy, row.torch = r["on"], r["numpy"], r["torch"]
                ks = r["kernels"]
                secs = ", ".join(f"{k['seconds']:.1f}" for k in ks)
                self.report.note(f"matmul {n} searched: {r['off']:.1f} GFLOP/s with search off, {r['on']:.1f} on "
                                 f"(numpy {r['numpy']:.1f}, same process); search "
                                 f"{secs} s per kernel, winner "
                                 f"{'; '.join(k['winner'] for k in ks)}; a second process searched "
                                 f"{r['hit_searches']} kernels ({r['hit_on']:.1f} GFLOP/s)")
                if max(r["error"], r["error_on"], r["hit_error"]) > 1e-4 or r["hit_searches"]:
                    raise AssertionError(f"searched matmul {n}: wrong result or a search in the second process: {r}")

            await self.guarded(f"matmul {n} searched", row, run)


# ----------------------------------------------------------------------------------------------------------------------
# output


def fmt(v: float | None) -> str:
    if v is None:
        return "—"
    a = abs(v)
    if a >= 100:
        return f"{v:.0f}"
    if a >= 10:
        return f"{v:.1f}"
    if a >= 1:
        return f"{v:.2f}"
    return f"{v:.3g}"


def fmt_ratio(v: float | None) -> str:
    return "—" if v is None else f"{v:.2f}x"


HEADERS = ["workload", "azyx", "numpy", "torch", "azyx/numpy", "azyx/torch", "target", "met?"]


def table_cells(report: Report) -> list[list[str]]:
    cells = []
    for r in report.rows:
        az = "FAILED" if r.azyx is None and r.azyx_failed else fmt(r.azyx)
        cells.append([r.name, az, fmt(r.numpy), fmt(r.torch), fmt_ratio(r.ratio(r.numpy)),
                      fmt_ratio(r.ratio(r.torch)), r.target_text, r.met()])
    return cells


def text_table(report: Report) -> str:
    cells = [HEADERS, *table_cells(report)]
    widths = [max(len(row[i]) for row in cells) for i in range(len(HEADERS))]

    def line(row: list[str]) -> str:
        padded = [c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))]
        return " | ".join(padded)

    out = [line(cells[0]), "-+-".join("-" * w for w in widths)]
    out += [line(r) for r in cells[1:]]
    return "\n".join(out)


def markdown_table(report: Report) -> str:
    out = ["| " + " | ".join(HEADERS) + " |", "|" + "|".join(["---"] + ["---:"] * 5 + ["---", "---"]) + "|"]
    out += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in table_cells(report)]
    return "\n".join(out)


def mem_total_gib() -> str:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return f"{int(line.split()[1]) / (1 << 20):.1f} GiB"
    except (OSError, ValueError, IndexError):
        pass
    return "unknown"


def git_rev() -> str:
    try:
        out = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             timeout=5)
        dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain"], capture_output=True, text=True,
                               timeout=5)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    if out.returncode != 0:
        return "no commit"
    return out.stdout.strip() + (" (with uncommitted changes)" if dirty.stdout.strip() else "")


def machine_info(cfg: Config, ax: Any, ax_err: str | None, torch: Any, torch_err: str | None) -> list[str]:
    try:
        affinity = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        affinity = os.cpu_count() or 0
    if ax is not None:
        try:
            ax_ver = str(getattr(ax, "__version__", None) or importlib.metadata.version("azyx"))
        except importlib.metadata.PackageNotFoundError:
            ax_ver = "unknown version"
        try:
            devs = ", ".join(ax.devices())
        except Exception as e:
            devs = f"azyx.devices() failed: {type(e).__name__}: {e}"
        here = Path(ax.__file__).resolve().parent if getattr(ax, "__file__", None) else None
        where = "this checkout" if here is not None and here.parent == REPO else "an installed copy"  # no host paths
        ax_line = f"azyx {ax_ver} from {where}; device {cfg.device}; azyx.devices(): {devs}"
    else:
        ax_line = f"azyx: import failed ({(ax_err or '').splitlines()[-1] if ax_err else '?'})"
    if torch is not None:
        torch_line = f"torch {torch.__version__} ({torch.get_num_threads()} threads)"
    else:
        torch_line = f"torch: not importable, column skipped ({torch_err})"
    try:
        load = " ".join(f"{x:.2f}" for x in os.getloadavg()) + " (other processes running make the numbers noisy)"
    except OSError:
        load = "unknown"
    mode = "QUICK smoke run (reduced sizes and repeats; not comparable with the targets)" if cfg.quick else "full"
    return [
        f"date: {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}",
        f"mode: {mode}",
        f"machine: {cpu_model()}, {os.cpu_count()} logical cores ({affinity} usable), {mem_total_gib()} RAM, "
        f"{platform.system()} {platform.release()}, load average at start {load}",
        f"python {platform.python_version()}, numpy {np.__version__}, {torch_line}",
        ax_line,
        f"git: {git_rev()}",
    ]


def results_section(report: Report, info: list[str], elapsed_s: float) -> str:
    parts = [MARK_START, "", f"## Results ({'quick' if report.cfg.quick else 'full'} run)", ""]
    parts += [f"- {line}" for line in info]
    parts += [f"- bench wall time: {elapsed_s:.0f} s", "", markdown_table(report), ""]
    if report.notes:
        parts += ["### Notes", ""] + [f"- {n}" for n in report.notes] + [""]
    parts += ["### azyx failures", ""]
    if report.failures:
        for workload, tail in report.failures:
            parts += [f"- **{workload}**", "", "  ```", *[f"  {ln}" for ln in tail.splitlines()], "  ```", ""]
    else:
        parts += ["none", ""]
    parts.append(MARK_END)
    return "\n".join(parts) + "\n"


def write_results(path: Path, section: str) -> None:
    old = path.read_text() if path.exists() else ""
    start = old.find(MARK_START.split(" (")[0])
    end = old.find(MARK_END)
    if start >= 0 and end > start:
        text = old[:start] + section.rstrip("\n") + old[end + len(MARK_END):]
        if not text.endswith("\n"):
            text += "\n"
    else:
        text = DEFAULT_HEADER + "\n" + section
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


# ----------------------------------------------------------------------------------------------------------------------
# main


async def main(args: argparse.Namespace) -> int:
    t_start = time.perf_counter()
    cfg = make_config(args.quick, args.device)
    Deadline.at = t_start + cfg.run_budget_s
    report = Report(cfg)
    torch, torch_err = import_torch()
    ax, ax_err = import_azyx()
    if ax is None:
        report.failures.append(("import azyx", ax_err or "unknown error"))
        progress("azyx could not be imported; only the numpy/torch columns will be measured")
    info = machine_info(cfg, ax, ax_err, torch, torch_err)
    for line in info:
        progress(line)

    bench = Bench(cfg, report, ax, torch)
    await bench.copy_bandwidth()
    await bench.graph_build()
    await bench.small_graph()
    await bench.long_chain()
    await bench.event_loop_lateness()
    await bench.upload_lateness()
    await bench.scalar_requests()
    await bench.lr_schedule()
    await bench.fused_chain()
    await bench.total_sum()
    await bench.row_sum()
    await bench.matmuls()
    await bench.bf16_matmuls()
    await bench.searched_matmuls()
    for r in report.rows:
        ratio = r.ratio(r.numpy)
        if r.higher_is_better and ratio is not None and ratio > 10:
            report.note(f"{r.name}: azyx is {ratio:.0f}x numpy, implausibly fast for this machine; check that a "
                        "rebuilt graph is really recomputed (not served from a result cache)")
    # the copy row reads best last, next to the bandwidth rows it is the reference for
    report.rows.sort(key=lambda r: r.name.startswith("copy bandwidth"))

    elapsed = time.perf_counter() - t_start
    print()
    print("\n".join(info))
    print()
    print(text_table(report))
    print()
    if report.notes:
        print("notes:")
        print("\n".join(f"  - {n}" for n in report.notes))
    if report.failures:
        print("azyx failures:")
        for workload, tail in report.failures:
            print(f"  - {workload}:")
            print("\n".join(f"      {ln}" for ln in tail.splitlines()))
    out = Path(args.out)
    write_results(out, results_section(report, info, elapsed))
    print(f"\nwrote {out} ({elapsed:.0f} s)")
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="azyx benchmark vs numpy (and PyTorch CPU when importable)")
    p.add_argument("--quick", action="store_true", help="fast smoke run: smaller sizes, fewer repeats")
    p.add_argument("--device", default="c:0", help="azyx device to run on (default c:0)")
    p.add_argument("--out", default=str(Path("bench") / "RESULTS.md"), help="markdown file to write the results to")
    return p.parse_args(argv)


if __name__ == "__main__":
    sys.exit(asyncio.run(main(parse_args())))
