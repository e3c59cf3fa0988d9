"""Long-run benchmark (issue 13, "long runs stay flat"): a 10,000-step training loop per mode (awaited, pipelined,
azyx.jit) on each device, with a learning rate that changes every step, and `azyx.stats()` taken after 1,000 and
after 10,000 steps: live graph nodes, cached plans, jit traces, compiled kernels, the device's pool bytes (in use +
cached) and the process's RSS must not grow between the two; steps/s are shown for both windows.

Run from the repository root:

    python bench/longrun.py [--quick] [--devices c:0,opencl:0] [--steps 10000] [--out bench/RESULTS.md]

Each step: a fresh batch uploaded from numpy, an MLP 64-128-10 (batch 32) forward and backward, an Adam update whose
rate a cosine LambdaLR sets each step (a kernel argument: no new plan, compile or trace). The table goes into
bench/RESULTS.md between this script's markers (quick runs too, into `--out`). A row whose figures grew between the
two checkpoints says GREW; the script never asserts times.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import gc
import math
import platform
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))
from common import machine_line, write_section  # noqa: E402  (beside this script)

import azyx  # noqa: E402
from azyx import GradientTape, Tensor, nn, optim  # noqa: E402
from azyx.allocator import bucket  # noqa: E402

MARK_START = "<!-- bench:longrun:start -->"
MARK_END = "<!-- bench:longrun:end -->"
SIZES, BATCH = (64, 128, 10), 32
MODES = ("awaited", "pipelined", "jit")
IN_FLIGHT = 4  # pipelined: steps submitted before the oldest is awaited (a service's queue depth)
RSS_SLACK = 8 << 20  # RSS growth between the checkpoints that still counts as flat (allocator and interpreter noise)


class MLP(nn.Module):
    def __init__(self, device: str) -> None:
        self.l1 = nn.Linear(SIZES[0], SIZES[1], device=device)
        self.l2 = nn.Linear(SIZES[1], SIZES[2], device=device)

    def forward(self, x: Tensor) -> Tensor:
        return self.l2(self.l1(x).relu())


async def settled() -> azyx.Stats:
    """stats() once all queued work has run (queued work holds its buffers) and cycles are collected."""
    await azyx.synchronize()
    gc.collect()
    return azyx.stats()


async def run(mode: str, device: str, steps: int, checkpoints: tuple[int, int]) -> dict[str, Any]:
    """`steps` training steps in `mode`; stats and steps/s at each checkpoint (steps/s over the steps since the
    previous checkpoint), and the losses of the first and last batches."""
    azyx.manual_seed(0)
    rng = np.random.default_rng(0)
    batches = [(rng.standard_normal((BATCH, SIZES[0]), np.float32), rng.integers(0, SIZES[-1], BATCH).astype(np.int32))
               for _ in range(8)]
    model = MLP(device)
    opt = optim.Adam(model.parameters(), lr=3e-3)
    sched = optim.LambdaLR(opt, lambda e: 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * e / steps)))

    def build(x: Tensor, y: Tensor) -> Tensor:
        with GradientTape() as tape:
            loss = nn.cross_entropy(model(x), y)
        opt.step(tape.gradient(loss, opt.params))
        return loss

    jitted = azyx.jit(build)
    running: list[asyncio.Future[Any]] = []
    losses: list[float] = []
    out: dict[str, Any] = {"stats": [], "rates": []}
    t0, last = time.perf_counter(), 0
    for i in range(steps):
        xn, yn = batches[i % len(batches)]
        x, y = Tensor(xn, device=device), Tensor(yn, device=device)
        if mode == "jit":
            loss = await jitted(x, y)
        elif mode == "pipelined":
            loss = build(x, y)
            running.append(asyncio.ensure_future(azyx.realize(loss, *opt.tensors())))
            await asyncio.sleep(0)  # the task submits this step's plan; the next step is built while it runs
            if len(running) >= IN_FLIGHT:
                await running.pop(0)
        else:
            loss = build(x, y)
            await azyx.realize(loss, *opt.tensors())
        sched.step()
        if i < len(batches) or i >= steps - len(batches):
            losses.append(await loss.item())
        del loss, x, y
        if i + 1 in checkpoints:
            for task in running:
                await task
            running.clear()
            out["rates"].append((i + 1 - last) / (time.perf_counter() - t0))
            out["stats"].append(await settled())
            t0, last = time.perf_counter(), i + 1
    out["first"], out["last"] = losses[:len(batches)], losses[-len(batches):]
    out["replays"] = jitted.replays
    x, y = (Tensor(a, device=device) for a in batches[0])  # one more step, planned (not run): what a run allocates
    plan = azyx.schedule(build(x, y), *opt.tensors())
    out["step_bytes"] = sum(bucket(max(s.nbytes, 1)) for s in plan.slots[plan.n_inputs:] if s.device == device)
    return out


def growth(a: azyx.Stats, b: azyx.Stats, mode: str, device: str, step_bytes: int) -> list[str]:
    """What grew from checkpoint a to checkpoint b (empty: flat; the rule of tests/test_longrun.py)."""
    grew = [f"{k} {getattr(a, k)} -> {getattr(b, k)}" for k in ("plans", "traces", "kernels")
            if getattr(b, k) > getattr(a, k)]
    if b.nodes > a.nodes + 2:
        grew.append(f"nodes {a.nodes} -> {b.nodes}")
    for d in sorted(b.memory):
        if d not in a.memory or b.memory[d].in_use > a.memory[d].in_use:
            grew.append(f"{d} in use {a.memory.get(d)} -> {b.memory[d]}")
        # overlapping steps: the pool's high-water mark follows the devices' timing; the first checkpoint saw at least
        # one step's buffers live, and no more than IN_FLIGHT + 1 steps' fit
        slack = IN_FLIGHT * step_bytes if mode == "pipelined" and d == device else 0
        if b.pool_bytes(d) > a.pool_bytes(d) + slack:
            grew.append(f"{d} pool {a.pool_bytes(d)} -> {b.pool_bytes(d)}")
    if b.rss - a.rss > RSS_SLACK:
        grew.append(f"rss +{(b.rss - a.rss) / 2**20:.1f} MiB")
    return grew


def kib(n: int) -> str:
    return f"{n / 1024:.0f}"


def section(rows: list[list[str]], notes: list[str], quick: bool, checkpoints: tuple[int, int]) -> str:
    a, b = checkpoints
    head = ["device", "mode", "steps/s", "nodes", "plans", "traces", "kernels", "pool KiB (in use + cached)",
            "RSS MiB", "loss first -> last", "flat?"]
    lines = [MARK_START, "", f"## Long runs stay flat ({'quick' if quick else 'full'} run, written by "
             "bench/longrun.py)", "", f"- date: {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}",
             f"- {machine_line()}",
             f"- python {platform.python_version()}, numpy {np.__version__}; MLP {'-'.join(map(str, SIZES))}, batch "
             f"{BATCH}, Adam with a cosine LambdaLR (a new rate every step), a fresh batch uploaded each step; "
             f"pipelined keeps {IN_FLIGHT} steps in flight",
             f"- each cell: the figure after {a} steps -> after {b} steps (stats taken once all queued work has run); "
             f"steps/s over steps 1-{a} (compiles included) -> over steps {a + 1}-{b}; flat: no new plan, trace or "
             f"kernel, live nodes within 2, pool bytes in use not above the first figure and pool bytes in all not "
             f"above it (pipelined: within {IN_FLIGHT} steps' allocations, the high-water mark of overlapping steps), "
             f"RSS within "
             f"{RSS_SLACK >> 20} MiB",
             "", "| " + " | ".join(head) + " |", "|---|---|" + "---:|" * (len(head) - 3) + "---|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    lines += ["", "### Notes", ""] + [f"- {n}" for n in notes] + ["", MARK_END]
    return "\n".join(lines) + "\n"


async def main(args: argparse.Namespace) -> None:
    steps = 300 if args.quick else args.steps
    checkpoints = (steps // 10, steps)
    devices = [d for d in args.devices.split(",") if d in azyx.devices()]
    skipped = sorted(set(args.devices.split(",")) - set(devices))
    rows, notes = [], [f"{d}: not available here, skipped" for d in skipped]
    for device in devices:
        for mode in MODES:
            print(f"[longrun bench] {device} {mode}, {steps} steps ...", file=sys.stderr, flush=True)
            r = await run(mode, device, steps, checkpoints)
            a, b = r["stats"]
            grew = growth(a, b, mode, device, r["step_bytes"])
            learned = np.mean(r["last"]) < np.mean(r["first"])
            pool = f"{kib(a.memory[device].in_use)} + {kib(a.memory[device].cached)} -> " \
                   f"{kib(b.memory[device].in_use)} + {kib(b.memory[device].cached)}"
            rows.append([device, mode, f"{r['rates'][0]:.0f} -> {r['rates'][1]:.0f}", f"{a.nodes} -> {b.nodes}",
                         f"{a.plans} -> {b.plans}", f"{a.traces} -> {b.traces}", f"{a.kernels} -> {b.kernels}", pool,
                         f"{a.rss / 2**20:.1f} -> {b.rss / 2**20:.1f}",
                         f"{np.mean(r['first']):.3g} -> {np.mean(r['last']):.3g}",
                         ("yes" if not grew else "GREW: " + "; ".join(grew))
                         + ("" if learned else " (WRONG RESULT: the loss did not fall)")])
            if mode == "jit":
                notes.append(f"{device} jit: {r['replays']} of {steps} calls replayed the trace")
            rise = b.pool_bytes(device) - a.pool_bytes(device)
            if rise > 0 and not grew:
                notes.append(f"{device} {mode}: the pool's high-water mark rose {rise} bytes between the checkpoints "
                             f"(the steps in flight overlapped a little more once; a step allocates {r['step_bytes']} "
                             f"bytes there), its bytes in use did not move")
            print(" | ".join(rows[-1]), flush=True)
    notes.append("steps/s are of a shared machine (see the load average): compare the two figures of a row, not "
                 "rows of different runs")
    notes.append("stats are cumulative over the process (plans, kernels and traces of earlier rows stay): what matters "
                 "is that no figure moves between the two checkpoints of a row")
    text = section(rows, notes, args.quick, checkpoints)
    print(text)
    write_section(Path(args.out), MARK_START, MARK_END, text)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smoke run: 300 steps per mode")
    ap.add_argument("--devices", default="c:0,opencl:0")
    ap.add_argument("--steps", type=int, default=10_000, help="steps per mode (stats after a tenth and at the end)")
    ap.add_argument("--out", default=str(REPO / "bench" / "RESULTS.md"))
    asyncio.run(main(ap.parse_args()))
