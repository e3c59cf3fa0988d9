"""Training-step benchmark: an MLP 784-256-10, batch 128, forward + backward + optimiser update, azyx beside PyTorch
CPU eager doing the same work from the same init and data in the same run.

Run from the repository root:

    python bench/train.py [--quick] [--device c:0] [--steps 60] [--out bench/RESULTS.md]

azyx builds each step lazily (GradientTape, nn.cross_entropy, a lazy optimiser step) and realizes the loss, the
parameters and the optimiser state together: one ExecutionPlan per step, a plan-cache hit from the second step on.
The table goes into bench/RESULTS.md between this script's own markers (appended when absent; nothing else in the
file is touched). The bench never asserts; it reports whether the target (>= 1.0x PyTorch) is met.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import platform
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))
from common import cpu_model, write_section  # noqa: E402  (beside this script)

import azyx  # noqa: E402
from azyx import GradientTape, Tensor, nn, optim  # noqa: E402

MARK_START = "<!-- bench:train:start -->"
MARK_END = "<!-- bench:train:end -->"
SIZES = (784, 256, 10)
BATCH = 128
TARGET = 1.0  # azyx steps/s over PyTorch steps/s


class MLP(nn.Module):
    def __init__(self, device: str) -> None:
        self.l1 = nn.Linear(SIZES[0], SIZES[1], device=device)
        self.l2 = nn.Linear(SIZES[1], SIZES[2], device=device)

    def forward(self, x: Tensor) -> Tensor:
        return self.l2(self.l1(x).relu())


def make_optimizer(kind: str, params: list[Any], lib: Any) -> Any:
    if kind == "sgd":
        return lib.SGD(params, lr=0.01, momentum=0.9)
    return lib.Adam(params, lr=1e-3)


def data(n_batches: int) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(0)
    return [(rng.standard_normal((BATCH, SIZES[0]), np.float32), rng.integers(0, SIZES[-1], BATCH).astype(np.int32))
            for _ in range(n_batches)]


async def time_steps(step: Callable[[int], Awaitable[Any]], steps: int, repeats: int,
                     phases: dict[str, Any] | None = None) -> list[float]:
    """Steps per second, `repeats` samples of `steps` back-to-back steps each. With `phases`, its per-step build and
    realize times are kept for the median repeat (other processes on a shared machine make some repeats slow)."""
    out, i, per_repeat = [], 0, []
    for _ in range(repeats):
        if phases is not None:
            phases.update(build_s=0.0, realize_s=0.0, n=0)
        t0 = time.perf_counter()
        for _ in range(steps):
            await step(i)
            i += 1
        await azyx.synchronize()
        out.append(steps / (time.perf_counter() - t0))
        if phases is not None:
            per_repeat.append(dict(phases))
    if phases is not None:
        phases.update(per_repeat[sorted(range(repeats), key=out.__getitem__)[repeats // 2]])
    return out


async def bench_azyx(kind: str, device: str, batches: list[Any], steps: int, repeats: int, mode: str = "awaited"
                     ) -> tuple[list[float], dict[str, Any], list[np.ndarray], list[np.ndarray]]:
    """awaited: each step's realize is awaited before the next step is built. pipelined: step i's realize runs as a
    task while step i+1 is built (its cached plan is submitted before the task first waits), then it is awaited.
    jit: the step is an `azyx.jit` function, awaited: from its second call on, the traced plan is bound to the step's
    batch and submitted without building the graph."""
    azyx.manual_seed(0)
    model = MLP(device)
    init = [await p.numpy() for p in model.parameters()]
    opt = make_optimizer(kind, model.parameters(), optim)
    xs = [(Tensor(x, device=device), Tensor(y, device=device)) for x, y in batches]
    phases = {"build_s": 0.0, "realize_s": 0.0, "n": 0}
    running: list[asyncio.Future[Any]] = []  # pipelined: the step whose realize has not been awaited yet

    def build(x: Tensor, y: Tensor) -> Tensor:
        with GradientTape() as tape:
            loss = nn.cross_entropy(model(x), y)
        opt.step(tape.gradient(loss, opt.params))
        return loss

    jitted = azyx.jit(build)

    async def step(i: int) -> Tensor:
        x, y = xs[i % len(xs)]
        t0 = time.perf_counter()
        if mode == "jit":
            loss = await jitted(x, y)
            phases["realize_s"] += time.perf_counter() - t0
            phases["n"] += 1
            return loss
        loss = build(x, y)
        targets = opt.tensors()
        t1 = time.perf_counter()
        if mode == "pipelined":
            running.append(asyncio.ensure_future(azyx.realize(loss, *targets)))
            await asyncio.sleep(0)  # the task submits this step's plan, then waits; the last step's wait ends here
            if len(running) > 1:
                await running.pop(0)
        else:
            await azyx.realize(loss, *targets)  # forward, backward and update: one plan
        phases["build_s"] += t1 - t0
        phases["realize_s"] += time.perf_counter() - t1
        phases["n"] += 1
        return loss

    for i in range(3):  # compile, then the cached plan
        await step(i)
    with GradientTape() as tape:  # one more step, scheduled first to count its plan's kernels
        loss = nn.cross_entropy(model(xs[0][0]), xs[0][1])
    targets = [loss, *opt.step(tape.gradient(loss, opt.params))]
    kernels = len(azyx.schedule(*targets).kernels)
    await azyx.realize(*targets)
    plans = len(azyx.runtime.RT.plan_cache)
    rates = await time_steps(step, steps, repeats, phases)
    for task in running:
        await task
    phases.update(plans_before=plans, plans_after=len(azyx.runtime.RT.plan_cache), kernels=kernels)
    return rates, phases, init, [await p.numpy() for p in opt.tensors()]


def bench_torch(kind: str, init: list[np.ndarray], batches: list[Any], steps: int, repeats: int) -> list[float]:
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(SIZES[0], SIZES[1]), torch.nn.ReLU(),
                                torch.nn.Linear(SIZES[1], SIZES[2]))
    with torch.no_grad():
        for p, v in zip(model.parameters(), init):
            p.copy_(torch.from_numpy(v))
    opt = make_optimizer(kind, list(model.parameters()), torch.optim)
    data = [(torch.from_numpy(x), torch.from_numpy(y.astype(np.int64))) for x, y in batches]

    def step(i: int) -> None:
        x, y = data[i % len(data)]
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    for i in range(3):
        step(i)
    out, i = [], 0
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(steps):
            step(i)
            i += 1
        out.append(steps / (time.perf_counter() - t0))
    return out


def section(rows: list[dict[str, Any]], notes: list[str], quick: bool, device: str, torch_line: str, load: str
            ) -> str:
    lines = [MARK_START, "", f"## Training step ({'quick' if quick else 'full'} run, written by bench/train.py)", "",
             f"- date: {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}",
             f"- MLP {'-'.join(map(str, SIZES))}, batch {BATCH}, float32, cross entropy; azyx on {device}, "
             f"{torch_line}; {cpu_model()}, {os.cpu_count()} logical cores, load average at start {load}",
             f"- python {platform.python_version()}, numpy {np.__version__}; steps/s are medians of repeats after "
             "warm-up; one step = forward + backward + update, realized (azyx) or run eagerly (torch)", "",
             "| workload | azyx steps/s | torch steps/s | azyx/torch | target | met? |", "|---|---:|---:|---:|---|---|"]
    for r in rows:
        ratio = f"{r['azyx'] / r['torch']:.2f}x" if r.get("torch") else "—"
        torch_col = f"{r['torch']:.0f}" if r.get("torch") else "—"
        met = ("yes" if r["azyx"] / r["torch"] >= TARGET else "no") if r.get("torch") else "n/a"
        lines.append(f"| {r['name']} | {r['azyx']:.0f} | {torch_col} | {ratio} | >= {TARGET:.1f}x torch | {met} |")
    lines += ["", "### Notes", ""] + [f"- {n}" for n in notes] + ["", MARK_END]
    return "\n".join(lines) + "\n"


async def main(args: argparse.Namespace) -> None:
    steps, repeats = (10, 3) if args.quick else (args.steps, 5)
    load = " ".join(f"{x:.2f}" for x in os.getloadavg()) + " (other processes make the numbers noisy)"
    batches = data(8)
    try:
        import torch

        torch_line = f"torch {torch.__version__} CPU eager ({torch.get_num_threads()} threads)"
    except ImportError as e:
        torch, torch_line = None, f"torch not importable ({e}): column skipped"
    rows, notes = [], []
    modes = {"awaited": "", "pipelined": ", pipelined: step i+1 built while step i runs",
             "jit": ", azyx.jit: the traced step replayed, awaited"}
    for kind, label in (("sgd", "SGD momentum 0.9"), ("adam", "Adam")):
        results = {}
        for mode in modes:
            print(f"[train bench] azyx {label}, {mode} ...", file=sys.stderr, flush=True)
            results[mode] = await bench_azyx(kind, args.device, batches, steps, repeats, mode)
        init, final = results["awaited"][2], results["awaited"][3]
        t_rate = statistics.median(bench_torch(kind, init, batches, steps, repeats)) if torch is not None else None
        name = f"MLP {'-'.join(map(str, SIZES))} b{BATCH}, {label}"
        for mode, what in modes.items():
            rates, p, _, got = results[mode]
            same = all(np.array_equal(a, b) for a, b in zip(final, got))
            row: dict[str, Any] = {"name": name + what + ("" if same else " (WRONG: parameters differ from the "
                                                                              "awaited loop)"),
                                   "azyx": statistics.median(rates)}
            if t_rate is not None:
                row["torch"] = t_rate
            rows.append(row)
            n = max(p["n"], 1)
            if mode == "jit":
                notes.append(f"azyx {label}, jit (median repeat): {p['realize_s'] / n * 1e3:.2f} ms per step (bind, "
                             f"submit, kernels, wait); {p['kernels']} kernels in the step's plan; plan cache "
                             f"{p['plans_before']} -> {p['plans_after']} entries over the timed steps")
            else:
                notes.append(f"azyx {label}{what.split(':')[0]} (median repeat): per step {p['build_s'] / n * 1e3:.2f} "
                             f"ms building the graph (forward, GradientTape.gradient, optimiser step) + "
                             f"{p['realize_s'] / n * 1e3:.2f} ms " + ("realizing (plan-cache lookup, submit, kernels)"
                                                                     if mode == "awaited" else "submitting and "
                                                                     "awaiting the previous step")
                             + f"; {p['kernels']} kernels in the step's plan; plan cache {p['plans_before']} -> "
                             f"{p['plans_after']} entries over the timed steps")
            if mode != "awaited":
                notes.append(f"azyx {label}, {mode}: final parameters and optimiser state "
                             + ("bit-identical to the awaited loop's (same steps, same data)" if same else
                                "NOT identical to the awaited loop's: the row is wrong"))
    write_section(Path(args.out), MARK_START, MARK_END, section(rows, notes, args.quick, args.device, torch_line, load))
    for r in rows:
        print(f"{r['name']}: azyx {r['azyx']:.0f} steps/s" + (f", torch {r['torch']:.0f} steps/s, "
                                                            f"{r['azyx'] / r['torch']:.2f}x" if "torch" in r else ""))


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smoke run: fewer steps and repeats")
    ap.add_argument("--device", default="c:0")
    ap.add_argument("--steps", type=int, default=60, help="steps per timed repeat")
    ap.add_argument("--out", default=str(REPO / "bench" / "RESULTS.md"))
    asyncio.run(main(ap.parse_args()))
