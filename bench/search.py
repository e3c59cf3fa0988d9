"""Kernel search benchmark: matmul f32 with the heuristic kernels (search off) and with the searched winner, the
search's own time per kernel, and a second process that finds the winner in the disk cache (it must search nothing).

Run from the repository root:

    python bench/search.py [--quick] [--devices c:0,opencl:0] [--sizes 1024,2048] [--level quick] [--out PATH]

Each (device, size) runs in fresh processes over an empty cache directory (XDG_CACHE_HOME), so that the search really
happens: the first process times the heuristic kernel, runs `azyx.tune` and times the winner, beside numpy and PyTorch
(CPU) in the same process; the second, with AZYX_SEARCH on, realizes the same product and reports how many kernels it
searched. Ratios are measured in the same run; nothing is asserted about times. `--quick` (CI): one small product on
c:0, a short budget, and nothing written.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))
from common import machine_line, write_section  # noqa: E402  (beside this script)

MARK_START = "<!-- bench:search:start (written by bench/search.py) -->"
MARK_END = "<!-- bench:search:end -->"
NOTE = ("search off: the heuristic kernels (no cache entry); search on: the winner `azyx.tune` found and cached (the "
        "heuristic's own actions where nothing beat them by 3%). search time: the search's own seconds for the "
        "product's kernel (compiling every candidate on worker threads, timing each on the device, checking its output "
        "against the heuristic kernel's). 2nd process: a new process over the same cache with AZYX_SEARCH on: the "
        "kernels it searched (0: the disk cache served the winner) and its GFLOP/s. The machine is shared (see its "
        "load average): figures move by up to 2x between runs; the ratios are within one process.")


def _steady(fn: Any, repeats: int) -> float:
    fn()  # (warm: a BLAS's threads, a plan)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def child(device: str, n: int, level: str, repeats: int, phase: str) -> dict[str, Any]:
    """One process's measurements (the parent gives it its environment: the cache directory, AZYX_SEARCH)."""
    import azyx
    from azyx import Tensor, search

    rng = np.random.default_rng(0)
    a_np, b_np = rng.standard_normal((n, n), dtype=np.float32), rng.standard_normal((n, n), dtype=np.float32)
    a, b = Tensor(a_np, device=device).realize_sync(), Tensor(b_np, device=device).realize_sync()
    flops = 2.0 * n ** 3
    out: dict[str, Any] = {"device": device, "n": n}
    step = _stepper(f"{phase} process, {device} n={n}")
    step("first realize")
    t0 = time.perf_counter()
    got = (a @ b).numpy_sync()
    out["first_s"] = time.perf_counter() - t0  # plan, compile (and, with search on, search or a cache hit)
    ref = a_np.astype(np.float64) @ b_np.astype(np.float64)
    out["error"] = float(np.abs(got - ref).max() / np.abs(ref).max())
    if phase == "search":
        step("search off")
        out["off"] = flops / _steady(lambda: (a @ b).realize_sync(), repeats) / 1e9
        step("tune")
        t0 = time.perf_counter()
        found = azyx.tune_sync(a @ b, level=level)
        out["tune_s"] = time.perf_counter() - t0
        out["kernels"] = [{"seconds": r.seconds, "tried": r.tried, "rejected": r.rejected, "speedup": r.speedup,
                           "winner": repr(list(r.winner)), "heuristic": repr(list(r.heuristic))} for r in found]
        step("search on")
        got = (a @ b).numpy_sync()
        out["error_on"] = float(np.abs(got - ref).max() / np.abs(ref).max())
        out["on"] = flops / _steady(lambda: (a @ b).realize_sync(), repeats) / 1e9
        step("peers")
        out["numpy"] = flops / _steady(lambda: a_np @ b_np, repeats) / 1e9
        try:
            import torch

            at, bt = torch.from_numpy(a_np), torch.from_numpy(b_np)
            out["torch"] = flops / _steady(lambda: at @ bt, repeats) / 1e9
        except ImportError:
            out["torch"] = None
    else:
        step("cached winner")
        out["on"] = flops / _steady(lambda: (a @ b).realize_sync(), repeats) / 1e9
    out["searches"] = search.searches
    step("done")
    return out


def _stepper(what: str) -> Any:
    """Prints each stage a child process enters, with the seconds since it started (stderr: where a hang was)."""
    t0 = time.perf_counter()

    def step(stage: str) -> None:
        print(f"search bench: {what}: {stage} at {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    return step


def measure(device: str, n: int, level: str, budget_s: float, repeats: int) -> dict[str, Any]:
    """Both processes for one product, over a fresh cache directory: the first's figures with the second's added
    (`hit_searches`, `hit_first_s`, `hit_on`)."""
    with tempfile.TemporaryDirectory(prefix="azyx-search-bench-") as cache:
        path = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])  # (the caller's kept)
        env = {**os.environ, "XDG_CACHE_HOME": cache, "AZYX_SEARCH_BUDGET": str(budget_s), "PYTHONPATH": path}
        runs = []
        for phase, search_env in (("search", "off"), ("hit", level)):
            cmd = [sys.executable, __file__, "--child", device, str(n), level, str(repeats), phase]
            # (its stderr is this process's: what it printed, or the stacks a hang's SIGABRT dumps, stays visible)
            proc = subprocess.run(cmd, env={**env, "AZYX_SEARCH": search_env}, stdout=subprocess.PIPE, text=True,
                                  timeout=1800)
            if proc.returncode != 0:
                raise RuntimeError(f"{phase} process for {device} {n} failed (exit {proc.returncode}; its stderr "
                                   f"above)")
            runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    first, hit = runs
    first.update(hit_searches=hit["searches"], hit_first_s=hit["first_s"], hit_on=hit["on"], hit_error=hit["error"])
    return first


def ratio(a: float | None, b: float | None) -> str:
    return "—" if not a or not b else f"{a / b:.2f}x"


def table(results: list[dict[str, Any]], level: str, budget_s: float) -> str:
    lines = [MARK_START, "", "## Kernel search", "",
             f"{machine_line()}; search level `{level}`, budget {budget_s:g} s per kernel. Written by "
             "`bench/search.py`; GFLOP/s of `a @ b` (f32, square), medians of steady realizes.", "",
             "| device | n | search off | search on | numpy | torch | off/numpy | on/numpy | on/torch | search time "
             "(s, per kernel) | tried | winner | 2nd process: searches, GFLOP/s |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in results:
        if "failed" in r:
            lines.append(f"| {r['device']} | {r['n']} | FAILED: {r['failed']} |" + " |" * 10)
            continue
        ks = r["kernels"]
        torch = f"{r['torch']:.1f}" if r["torch"] else "—"
        secs = ", ".join(f"{k['seconds']:.1f}" for k in ks)
        lines.append(f"| {r['device']} | {r['n']} | {r['off']:.1f} | {r['on']:.1f} | {r['numpy']:.1f} | {torch} | "
                     f"{ratio(r['off'], r['numpy'])} | {ratio(r['on'], r['numpy'])} | {ratio(r['on'], r['torch'])} | "
                     f"{secs} | {', '.join(str(k['tried']) for k in ks)} | {'; '.join(k['winner'] for k in ks)} | "
                     f"{r['hit_searches']}, {r['hit_on']:.1f} |")
    by = {(r["device"], r["n"]): r for r in results if "failed" not in r}
    for (dev, n), r in sorted(by.items()):
        c = by.get(("c:0", n))
        if dev != "c:0" and c is not None:
            lines.append(f"\n{dev} searched at n={n}: {ratio(r['on'], c['on'])} of c:0 searched "
                         f"({ratio(r['off'], c['off'])} with search off).")
    lines += ["", NOTE, "", MARK_END]
    return "\n".join(lines) + "\n"


def main(args: argparse.Namespace) -> int:
    if args.child:
        device, n, level, repeats, phase = args.child
        print(json.dumps(child(device, int(n), level, int(repeats), phase)))
        return 0
    devices = args.devices.split(",") if args.devices else (["c:0"] if args.quick else ["c:0", "opencl:0"])
    sizes = [int(s) for s in args.sizes.split(",")] if args.sizes else ([128] if args.quick else [1024, 2048])
    budget_s = args.budget if args.budget else (5.0 if args.quick else 60.0)
    repeats = 3 if args.quick else 7
    results = []
    for device in devices:
        for n in sizes:
            if device != "c:0" and n > 1024 and not args.quick:
                continue  # (the other backends' comparison is at 1024)
            print(f"search bench: {device} n={n}", file=sys.stderr, flush=True)
            try:
                results.append(measure(device, n, args.level, budget_s, repeats))
            except Exception as e:  # recorded in the table, never stopping the run
                results.append({"device": device, "n": n, "failed": str(e).splitlines()[0]})
    text = table(results, args.level, budget_s)
    print(text)
    failed = [r for r in results if "failed" in r or r.get("hit_searches") != 0 or max(
        r.get("error", 0), r.get("error_on", 0), r.get("hit_error", 0)) > 1e-4]
    if failed:
        print(f"FAILED: {failed}")
        return 1
    if not args.quick:
        write_section(Path(args.out), MARK_START, MARK_END, text)
        print(f"wrote {args.out}")
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="azyx kernel search benchmark")
    p.add_argument("--quick", action="store_true", help="smoke run: one small product on c:0, writes nothing")
    p.add_argument("--devices", default="", help="comma-separated devices (default c:0,opencl:0)")
    p.add_argument("--sizes", default="", help="comma-separated sizes (default 1024,2048; other devices 1024 only)")
    p.add_argument("--level", default="quick", choices=["quick", "thorough"])
    p.add_argument("--budget", type=float, default=0.0, help="seconds of search per kernel (default 60, quick 5)")
    p.add_argument("--out", default=str(REPO / "bench" / "RESULTS.md"))
    p.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    return p.parse_args(argv)


if __name__ == "__main__":
    sys.exit(main(parse_args()))
