"""A GPU device of azyx (the CUDA backend; `--device vulkan:0` / `--device wgpu:0`: the Vulkan or WebGPU backend on the
same GPU) beside PyTorch's
CUDA on that GPU, in the same run (issue 6's table, and issue 15's for Vulkan).

    python bench/gpu.py [--quick] [--device cuda:0] [--out bench/RESULTS.md] [--only gemv,SDPA]

Two timings per workload, both wall-clock around the await (azyx) or the call plus `torch.cuda.synchronize()`
(PyTorch, every GPU synchronized), median of repeats after warm-up:
- "1 op": one realize awaited (host overhead included: what a request handler sees);
- "8 in flight": eight realizes submitted together and awaited together, per op (device throughput: the host
  work of one overlaps the GPU work of another), against eight PyTorch ops and one synchronize.
Ratios are PyTorch time over azyx time (> 1: azyx is faster). TF32 is off in PyTorch. `--only WORDS`: the workloads
whose name holds one of the comma-separated words alone (no transfers, searched or crowd rows; nothing written).
The matrix-vector rows (decode's linear layers: M = 1, 4, 16, 64 rows against a weight read once, in both layouts, alone
and with a layernorm prologue and a bias + GELU epilogue fused; GPT-2 small's other layers with their bias at M = 1, 4,
16) are also given as a share of the device's copy bandwidth
(a `copy` row is that ceiling as azyx reaches it); on CUDA a second table gives the same products' device time (each
kernel's own time through CUPTI, the weight cold in L2, host work left out on both sides: `gemv_device`). Transfers
run through `UnifiedExecutor.execute_transfer` for every pair of devices present
(peer between GPUs, host-staged to c:0).
Writes its table between `<!-- bench:cuda:start -->` and `<!-- bench:cuda:end -->` (`bench:vulkan-gpu` for a vulkan
device, `bench:wgpu-gpu` for a wgpu device). Never asserts: it reports.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from common import machine_line, write_section  # noqa: E402  (beside this script)
from crowd import crowd as crowd_rates  # noqa: E402
from crowd import graph, realize_timings  # noqa: E402
from devices import table, timed, transfer_time  # noqa: E402

import azyx  # noqa: E402
from azyx import Tensor  # noqa: E402
from azyx.runtime import RT  # noqa: E402

START, END = "<!-- bench:cuda:start -->", "<!-- bench:cuda:end -->"
VK_START, VK_END = "<!-- bench:vulkan-gpu:start -->", "<!-- bench:vulkan-gpu:end -->"
WG_START, WG_END = "<!-- bench:wgpu-gpu:start -->", "<!-- bench:wgpu-gpu:end -->"
GPU_KINDS = ("cuda", "vulkan", "wgpu")  # azyx device kinds that live on the GPU (PyTorch's cuda:0 here)
FLIGHT = 8


def sync_all(torch: Any) -> None:
    """Every GPU, each named: a bare synchronize() waits for the thread's current device only, and azyx makes the
    context of whichever device it last submitted to current on the loop's thread."""
    for i in range(torch.cuda.device_count()):
        torch.cuda.synchronize(i)


def torch_timed(torch: Any, fn: Callable[[], Any], repeats: int, n: int = 1, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    sync_all(torch)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        sync_all(torch)
        times.append((time.perf_counter() - t0) / n)
    return statistics.median(times)


async def workloads(torch: Any, dev: str, quick: bool, only: list[str]) -> tuple[list[list[str]], float]:
    rng = np.random.default_rng(0)
    n_chain = 1 << (22 if quick else 26)
    n_sum = 1 << (24 if quick else 28)
    side = 2048 if quick else 8192
    reps = 5 if quick else 20
    td = torch.device("cuda:0")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False

    def both(arr: np.ndarray) -> tuple[Tensor, Any]:
        return Tensor(arr, device=dev), torch.from_numpy(arr).to(td)

    (a, ta), (b, tb), (c, tc) = (both(rng.standard_normal(n_chain, dtype=np.float32)) for _ in range(3))
    s, ts = both(rng.standard_normal(n_sum, dtype=np.float32))
    m, tm = both(rng.standard_normal((side, side), dtype=np.float32))
    mats = {n: (both(rng.standard_normal((n, n), dtype=np.float32)), both(rng.standard_normal((n, n),
                                                                                            dtype=np.float32)))
            for n in ((512, 1024) if quick else (1024, 4096))}
    small, tsmall = both(rng.standard_normal(1024, dtype=np.float32))
    halves = {}  # tensor-core products: the same float32 values rounded to the dtype on each side, on the GPU
    for dt in ("bfloat16", "float16"):
        for n in ((1024, 2048) if quick else (4096, 8192)):
            pair = [both(rng.standard_normal((n, n), dtype=np.float32)) for _ in range(2)]
            halves[dt, n] = [(x.cast(dt), tx.to(getattr(torch, dt))) for x, tx in pair]
    heads = {}  # attention (issues 18, 38): (batch, heads, length, dim), the same values on each side, in each dtype
    # (batch, heads, L, S, dim, causal, masked: a KV cache's valid lengths as a (batch, 1, 1, S) bool mask)
    shapes = [(1, 8, 128, 128, 64, False, False), (8, 8, 1024, 1024, 64, False, False),
              (1, 12, 1, 4096, 64, False, False)]
    if not quick:
        shapes += [(1, 12, L, L, d, c, False) for L in (128, 1024, 8192) for d in (64, 128) for c in (False, True)]
        # decode (issue 38): 1 query against S cached rows, batch 1 and 64; a GPT-2 step's (its valid rows masked)
        shapes += [(1, 12, 1, S, d, False, False) for S in (1, 256, 4096) for d in (64, 128) if (S, d) != (4096, 64)]
        shapes += [(64, 12, 1, S, 64, False, False) for S in (1024, 4096)] + [(32, 12, 1, 1024, 64, False, True)]
    for dt in ("bfloat16", "float16", "float32"):
        for batch, nh, length, cached, dim, causal, masked in shapes:
            if dt == "float16" and (batch, length) in ((1, 128), (8, 1024)) and dim == 64 and not causal:
                continue  # (the first rows: bf16 and f32 as before)
            q = both(rng.standard_normal((batch, nh, length, dim), dtype=np.float32))
            kv = [both(rng.standard_normal((batch, nh, cached, dim), dtype=np.float32)) for _ in range(2)]
            qkv = [(x.cast(dt), tx.to(getattr(torch, dt))) for x, tx in (q, *kv)]
            if masked:
                valid = rng.integers(1, cached + 1, batch)
                keep = (np.arange(cached)[None, :] < valid[:, None]).reshape(batch, 1, 1, cached)
                qkv.append(both(keep))
            heads[dt, batch, nh, length, cached, dim, causal] = qkv
    vectors = {}  # matrix-vector products (decode's linear layers): (1, K) @ (K, N), the weight read once
    gemv = 4096 if quick else 8192
    for dt in ("float32", "bfloat16", "float16"):
        pair = [both(rng.standard_normal(shape, dtype=np.float32)) for shape in ((1, gemv), (gemv, gemv))]
        vectors[dt] = [(x.cast(dt), tx.to(getattr(torch, dt))) for x, tx in pair]
    decode = {}  # GPT-2 small's c_fc at decode time: M rows (sequences) of 768 against (768, 3072), both layouts
    for dt in ("float32", "bfloat16", "float16"):
        for m_rows in ((1, 16) if quick else (1, 4, 16, 64)):
            ops = [both(rng.standard_normal(shape, dtype=np.float32) * scale) for shape, scale in
                   (((m_rows, 768), 1.0), ((768, 3072), 0.05), ((3072, 768), 0.05), ((768,), 1.0), ((768,), 0.1),
                    ((3072,), 0.1))]
            decode[dt, m_rows] = [(x.cast(dt), tx.to(getattr(torch, dt))) for x, tx in ops]
    # GPT-2 small's other linear layers at decode time, as it stores them ((in, out), Conv1D) with their bias: c_attn,
    # attn.c_proj, mlp.c_proj (c_fc: the rows above), M sequences
    layers = {}
    for dt in ("float32", "bfloat16"):
        for m_rows in ((1,) if quick else (1, 4, 16)):
            for k_in, n_out in ((768, 2304), (768, 768), (3072, 768)):
                ops = [both(rng.standard_normal(shape, dtype=np.float32) * scale) for shape, scale in
                       (((m_rows, k_in), 1.0), ((k_in, n_out), 0.05), ((n_out,), 0.1))]
                layers[dt, m_rows, k_in, n_out] = [(x.cast(dt), tx.to(getattr(torch, dt))) for x, tx in ops]
    t0 = time.perf_counter()
    await azyx.realize(a, b, c, s, m, small, *(t for (x, y) in mats.values() for t in (x[0], y[0])),
                       *(x for pair in halves.values() for x, _ in pair),
                       *(x for qkv in heads.values() for x, _ in qkv),
                       *(x for pair in vectors.values() for x, _ in pair),
                       *(x for ops in decode.values() for x, _ in ops),
                       *(x for ops in layers.values() for x, _ in ops))
    print(f"uploaded the inputs in {time.perf_counter() - t0:.2f} s", flush=True)

    # the device's copy bandwidth, the ceiling of the memory-bound rows (bytes read + written)
    big = torch.empty(n_sum, dtype=torch.float32, device=td)
    copy_bw = 2 * 4 * n_sum / torch_timed(torch, lambda: big.copy_(ts), reps)

    cases: list[tuple[str, Callable[[], Tensor], Callable[[], Any], float, str]] = [
        (f"copy {n_sum >> 20}M f32 (s + 0.5: read + write)", lambda: s + 0.5, lambda: ts + 0.5, 8 * n_sum, "GB/s"),
        (f"relu(a*b+c)*0.5+a, {n_chain >> 20}M f32", lambda: (a * b + c).relu() * 0.5 + a,
         lambda: torch.relu(ta * tb + tc) * 0.5 + ta, 16 * n_chain, "GB/s"),
        (f"sum, {n_sum >> 20}M f32", lambda: s.sum(), lambda: ts.sum(), 4 * n_sum, "GB/s"),
        (f"row-sum {side}x{side} f32", lambda: m.sum(axis=1), lambda: tm.sum(dim=1), 4 * side * side, "GB/s"),
    ]
    for n, ((x, tx), (y, ty)) in mats.items():
        cases.append((f"sgemm {n} f32", lambda x=x, y=y: x @ y, lambda tx=tx, ty=ty: tx @ ty, 2 * n**3,
                      "GFLOP/s"))
    tolerance = {}
    for (dt, n), ((x, tx), (y, ty)) in halves.items():  # torch.matmul in the same dtype: cuBLAS on tensor cores
        name = f"matmul {n} {'bf16' if dt == 'bfloat16' else 'f16'} (tensor cores)"
        cases.append((name, lambda x=x, y=y: x @ y, lambda tx=tx, ty=ty: tx @ ty, 2 * n**3, "GFLOP/s"))
        tolerance[name] = 1e-2 if dt == "bfloat16" else 2e-3  # C rounded to 8 or 11 bits
    short = {"bfloat16": "bf16", "float16": "f16", "float32": "f32"}
    for (dt, batch, nh, length, cached, dim, causal), ((q, tq), (k, tk), (v, tv), *mask) in heads.items():
        # torch: its flash / efficient kernels (efficient or math under a mask)
        (keep, tkeep), = mask or [(None, None)]
        shape = f"L={length}" if length == cached else f"1 query x {cached} cached{', masked' if mask else ''}"
        name = f"SDPA {batch}x{nh} heads x {dim}, {shape}{', causal' if causal else ''} {short[dt]}"
        pairs = batch * nh * length * cached // (2 if causal else 1)
        work, unit = 4 * pairs * dim, "GFLOP/s"
        if length == 1:  # decode: bandwidth-bound, GB/s of the keys and values read
            work, unit = 2 * batch * nh * cached * dim * k.dtype.itemsize, "GB/s"
        cases.append((name, lambda q=q, k=k, v=v, c=causal, m=keep: azyx.nn.scaled_dot_product_attention(
                          q, k, v, mask=m, causal=c),
                      lambda tq=tq, tk=tk, tv=tv, c=causal, tm=tkeep: torch.nn.functional.scaled_dot_product_attention(
                          tq, tk, tv, attn_mask=tm, is_causal=c), work, unit))
        tolerance[name] = {"bfloat16": 1e-2, "float16": 2e-3}.get(dt, 1e-4)
    for dt, ((x, tx), (w, tw)) in vectors.items():  # bandwidth-bound: GB/s of the weight read
        for suffix, make, tfn in (("", lambda x=x, w=w: x @ w, lambda tx=tx, tw=tw: tx @ tw),
                                  (".T", lambda x=x, w=w: x @ w.T, lambda tx=tx, tw=tw: tx @ tw.T)):
            name = f"gemv (1, {gemv}) @ ({gemv}, {gemv}){suffix} {short[dt]}"
            cases.append((name, make, tfn, gemv * gemv * w.dtype.itemsize, "GB/s"))
            tolerance[name] = {"bfloat16": 1e-2, "float16": 2e-3}.get(dt, 1e-4)
    for (dt, m_rows), ((x, tx), (w, tw), (wt, twt), (g, tg), (beta, tbeta), (bias, tbias)) in decode.items():
        size = w.dtype.itemsize * (768 * 3072 + m_rows * (768 + 3072))  # bytes moved: the weight once, x, the output
        fused = (lambda x=x, w=w, g=g, beta=beta, bias=bias: ((x.layernorm() * g + beta) @ w + bias).gelu(
                     approximate="tanh"),
                 lambda tx=tx, tw=tw, tg=tg, tbeta=tbeta, tbias=tbias: torch.nn.functional.gelu(
                     torch.nn.functional.layer_norm(tx, (768,), tg, tbeta) @ tw + tbias, approximate="tanh"))
        for what, make, tfn in ((f"x @ W ({m_rows}, 768) @ (768, 3072)", lambda x=x, w=w: x @ w,
                                 lambda tx=tx, tw=tw: tx @ tw),
                                (f"x @ W.T ({m_rows}, 768) @ (3072, 768).T", lambda x=x, wt=wt: x @ wt.T,
                                 lambda tx=tx, twt=twt: tx @ twt.T),
                                (f"gelu(layernorm(x) @ W + b) ({m_rows}, 768) @ (768, 3072)", *fused)):
            name = f"gemv {what} {short[dt]}"
            cases.append((name, make, tfn, size, "GB/s"))
            tolerance[name] = {"bfloat16": 2e-2, "float16": 4e-3}.get(dt, 1e-4)
    for (dt, m_rows, k_in, n_out), ((x, tx), (w, tw), (bias, tbias)) in layers.items():
        name = f"gemv GPT-2 x @ W + b ({m_rows}, {k_in}) @ ({k_in}, {n_out}) {short[dt]}"
        size = w.dtype.itemsize * (k_in * n_out + m_rows * (k_in + n_out) + n_out)
        cases.append((name, lambda x=x, w=w, bias=bias: x @ w + bias,
                      lambda tx=tx, tw=tw, tbias=tbias: tx @ tw + tbias, size, "GB/s"))
        tolerance[name] = {"bfloat16": 2e-2}.get(dt, 1e-4)
    if only:
        cases = [c for c in cases if any(word in c[0] for word in only)]

    def ten_ops(s: Any) -> Any:  # azyx or torch
        return ((((s * 1.5 + s) * 2 - s) / 3).relu() * s + 1).exp().sqrt() - s

    if not only:
        cases.append(("10-op graph, 1024 f32, steady", lambda: ten_ops(small), lambda: ten_ops(tsmall), 0, "us"))
    rows = []
    full_reps = reps
    for name, make, tfn, work, unit in cases:
        print(f"timing {name}", flush=True)
        one = await timed(lambda make=make: make().realize(), 1, warmup=1)
        reps = 5 if one > 5e-3 else full_reps  # (long ops: fewer repeats keep the run inside its time)
        one = await timed(lambda make=make: make().realize(), reps, warmup=3)

        async def flight(make: Callable[[], Tensor] = make) -> None:
            await asyncio.gather(*(make().realize() for _ in range(FLIGHT)))

        many = await timed(flight, reps, warmup=3) / FLIGHT
        t_one = torch_timed(torch, tfn, reps)
        t_many = torch_timed(torch, tfn, reps, FLIGHT)

        def rate(t: float, work: float = work, unit: str = unit) -> str:
            return f"{t * 1e6:.1f}" if unit == "us" else f"{work / t / 1e9:.0f}"

        share = f" ({work / many / copy_bw:.0%} of copy)" if name.startswith("gemv") else ""
        rows.append([name, unit, rate(one), rate(t_one), f"{t_one / one:.2f}x", rate(many) + share, rate(t_many),
                     f"{t_many / many:.2f}x"])
    reps = full_reps
    if not only:
        rows += await searched(torch, mats, reps)
        rows += await realize_only(torch, ten_ops, small, tsmall, reps)
        rows += await crowd(torch, dev, quick)
    # correctness of what was timed, against PyTorch
    for name, make, tfn, _, _ in cases:
        got = await make().numpy()  # (bfloat16 widened to float32)
        want = tfn().float().cpu().numpy()
        err = float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))
        assert err < tolerance.get(name, 1e-4), f"{name}: relative error {err:.2e} against PyTorch"
    return rows, copy_bw


async def searched(torch: Any, mats: dict[int, Any], reps: int) -> list[list[str]]:
    """The products again with the kernel search's winners (`azyx.tune`, then realized as usual): rows with the
    search's time per kernel; the rows above are the heuristic kernels (search off, or this machine's cache)."""
    rows = []
    for n, ((x, tx), (y, ty)) in mats.items():
        print(f"searching sgemm {n}", flush=True)
        found = await azyx.tune(x @ y)
        one = await timed(lambda x=x, y=y: (x @ y).realize(), reps, warmup=3)
        t_one = torch_timed(torch, lambda tx=tx, ty=ty: tx @ ty, reps)
        secs = ", ".join("cached" if r.cached else f"{r.seconds:.1f} s" for r in found)
        rows.append([f"sgemm {n} f32, searched (search {secs})", "GFLOP/s", f"{2 * n**3 / one / 1e9:.0f}",
                     f"{2 * n**3 / t_one / 1e9:.0f}", f"{t_one / one:.2f}x", "", "", ""])
        got = await (x @ y).numpy()
        want = (tx @ ty).cpu().numpy()
        err = float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))
        assert err < 1e-4, f"searched sgemm {n}: relative error {err:.2e} against PyTorch"
    return rows


async def realize_only(torch: Any, fn: Callable[[Any], Any], small: Tensor, tsmall: Any, reps: int
                       ) -> list[list[str]]:
    """The 10-op graph with its building left out of the timing: what `await t.realize()` itself costs once the
    plan is cached; and the same function under `azyx.jit`, whose replay builds nothing. Beside PyTorch replaying
    the same ops captured as a CUDA graph."""
    jitted = azyx.jit(fn)
    ours = await realize_timings(fn, jitted, small, reps, FLIGHT)
    with torch.cuda.device(0):  # the tensors' device (streams and graphs belong to the current one)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up off the default stream, as capture wants
            for _ in range(3):
                fn(tsmall)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn(tsmall)
        t_one, t_many = torch_timed(torch, graph.replay, reps), torch_timed(torch, graph.replay, reps, FLIGHT)
    assert jitted.replays > 0
    rows = []
    for what, one, many in (("realize only (built before the clock)", ours[0], ours[1]),
                            ("azyx.jit replay (nothing built)", ours[2], ours[3])):
        rows.append([f"10-op graph, {what}; torch: CUDA graph replay", "us", f"{one * 1e6:.1f}", f"{t_one * 1e6:.1f}",
                     f"{t_one / one:.2f}x", f"{many * 1e6:.1f}", f"{t_many * 1e6:.1f}", f"{t_many / many:.2f}x"])
    return rows


async def crowd(torch: Any, dev: str, quick: bool) -> list[list[str]]:
    """Concurrent small requests, as a service sees them: each its own 1,024 floats and its own scalar through a 10-op
    graph, read back. azyx: one task per request on the loop; PyTorch: eager, each request in a thread pool (the way
    services run torch today). Requests per second, every result checked against numpy."""
    n_req = 50 if quick else 200
    td = torch.device("cuda:0")

    def theirs(x: np.ndarray, a: float) -> np.ndarray:
        return graph(torch.from_numpy(x).to(td), a).cpu().numpy()  # type: ignore[no-any-return]

    a, t = await crowd_rates(dev, n_req, 5 if quick else 15, 1024, theirs)
    return [[f"{n_req} concurrent requests (10 ops on 1,024 f32, own scalar, read back); torch: eager in a 16-thread "
             "pool", "req/s", f"{a:.0f}", f"{t:.0f}", f"{a / t:.2f}x", "", "", ""]]


def torch_device(name: str) -> str:
    """PyTorch's name for the memory an azyx device holds (a vulkan or wgpu device's GPU is cuda:0 to PyTorch here)."""
    return "cpu" if name.startswith("c:") else "cuda:0" if name.split(":")[0] in ("vulkan", "wgpu") else name


L2_COLD = 120 << 20  # bytes of weight copies cycled through (over twice an H100's or H200's L2): each read from memory


async def gemv_device(torch: Any, dev: str, quick: bool, copy_bw: float) -> list[list[str]]:
    """Matrix-vector products' device time: each kernel's own time (CUPTI, through torch.profiler; the realize's
    host work is left out on both sides) with the weight cold in L2 (copies of it cycled through, as a decode step's
    weights are), azyx's product beside torch's (`addmm` where there is a bias) on the same values, as GB/s of the
    weight and a share of the copy bandwidth (target >= 80%, issue 38)."""
    from torch.profiler import ProfilerActivity, profile

    def kernel_time(run: Callable[[], int]) -> float:  # seconds of GPU kernels per product
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            n = run()
        return sum(e.device_time_total for e in prof.events() if e.device_type.name == "CUDA") / n * 1e-6

    rng = np.random.default_rng(7)
    shapes = [(1, 8192, 8192, False, False), (1, 8192, 8192, True, False), (1, 768, 2304, False, True),
              (1, 768, 768, False, True), (1, 768, 3072, False, True), (1, 3072, 768, False, True),
              (1, 768, 50257, True, False), (16, 768, 3072, False, True)]
    if quick:
        shapes = [(1, 1024, 1024, False, False), (1, 1024, 1024, True, False)]
    loop = asyncio.get_running_loop()
    rows = []
    for dt in ("float32", "bfloat16", "float16"):
        tdt = getattr(torch, dt)
        for m, k, n, trans, bias in shapes:
            size = k * n * (4 if dt == "float32" else 2)
            copies = max(2, -(-L2_COLD // size))
            x = rng.standard_normal((m, k), dtype=np.float32)
            w = rng.standard_normal((n, k) if trans else (k, n), dtype=np.float32) * 0.05
            b = rng.standard_normal(n, dtype=np.float32)
            ax, ab = Tensor(x, device=dev).cast(dt), Tensor(b, device=dev).cast(dt)
            aws = [(Tensor(w, device=dev) * (1 + i / 64)).cast(dt) for i in range(copies)]
            await azyx.realize(ax, ab, *aws)
            tx, tb = torch.tensor(x, device="cuda").to(tdt), torch.tensor(b, device="cuda").to(tdt)
            tws = [(torch.tensor(w, device="cuda") * (1 + i / 64)).to(tdt) for i in range(copies)]

            def make(aw: Tensor) -> Tensor:
                y = ax @ (aw.T if trans else aw)
                return y + ab if bias else y

            def peer(tw: Any) -> Any:
                tw = tw.T if trans else tw
                return torch.addmm(tb, tx, tw) if bias else tx @ tw

            async def ours() -> int:
                for aw in aws * 3:
                    await make(aw).realize()
                return 3 * len(aws)

            def theirs() -> int:
                for tw in tws * 3:
                    peer(tw)
                sync_all(torch)
                return 3 * len(tws)

            got = await make(aws[0]).numpy()
            want = peer(tws[0]).float().cpu().numpy()
            err = float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))
            assert err < (1e-4 if dt == "float32" else 2e-2), f"gemv {dt} {m}x{k}x{n}: relative error {err:.2e}"
            await ours()
            theirs()
            def from_thread() -> int:  # (the profiler's thread; the realizes run on the loop)
                return asyncio.run_coroutine_threadsafe(ours(), loop).result()

            t_az = await asyncio.to_thread(kernel_time, from_thread)
            t_pt = kernel_time(theirs)
            share = size / t_az / copy_bw
            name = f"({m}, {k}) @ ({n}, {k}).T" if trans else f"({m}, {k}) @ ({k}, {n})"
            rows.append([name + (" + b" if bias else ""), dt,
                         f"{t_az * 1e6:.1f} us ({size / t_az / 1e9:.0f} GB/s, {share:.0%} of copy)",
                         f"{t_pt * 1e6:.1f} us ({size / t_pt / 1e9:.0f} GB/s, {size / t_pt / copy_bw:.0%})",
                         f"{t_pt / t_az:.2f}x", "met" if share >= 0.8 else "NOT met"])
    return rows


async def transfers(torch: Any, dev: str, quick: bool) -> list[list[str]]:
    """`dev` to and from c:0 and every other GPU device (the other CUDA GPUs; CUDA and Vulkan on one GPU)."""
    nbytes = (64 if quick else 1024) << 20
    reps = 3 if quick else 10
    src_np = np.random.default_rng(1).random(nbytes // 4, dtype=np.float32)
    ex = RT.executor
    gpus = [d for d in azyx.devices() if d.split(":")[0] in GPU_KINDS and d != dev]
    pairs = [(g, h) for g in (dev, *gpus) for h in (dev, *gpus) if g != h and dev in (g, h)]
    pairs += [(dev, "c:0"), ("c:0", dev)]
    rows = []
    for s, d in pairs:
        t = await transfer_time(src_np, s, d, reps, warmup=3)
        ts = torch.from_numpy(src_np).to(torch_device(s))
        tt = torch_timed(torch, lambda ts=ts, d=d: ts.to(torch_device(d), copy=True), reps)
        rows.append([f"{s} -> {d}", ex.sync_strategy(s, d).value, f"{nbytes / t / 1e9:.1f}",
                     f"{nbytes / tt / 1e9:.1f}", f"{tt / t:.2f}x"])
    return rows


async def main() -> None:
    import faulthandler

    import torch

    faulthandler.dump_traceback_later(600, exit=True)  # a hang shows every thread's stack
    os.environ.setdefault("AZYX_SEARCH_BUDGET", "30")  # seconds of search per product (the searched rows)
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=str(REPO / "bench" / "RESULTS.md"))
    ap.add_argument("--device", default="cuda:0", help="the azyx device to time (cuda:N, vulkan:N or wgpu:N)")
    ap.add_argument("--only", default="", help="comma-separated words: the workloads whose name holds one, alone")
    args = ap.parse_args()
    dev = args.device
    only = [w for w in args.only.split(",") if w]
    label = RT.device(dev).label  # type: ignore[attr-defined]
    w, copy_bw = await workloads(torch, dev, args.quick, only)
    tr = [] if only else await transfers(torch, dev, args.quick)
    gd = await gemv_device(torch, dev, args.quick, copy_bw) if dev.startswith("cuda") and (
        not only or "gemv" in only) else []
    api = dev.split(":")[0]
    kind = {"cuda": "CUDA", "vulkan": f"{dev} (Vulkan)", "wgpu": f"{dev} (WebGPU)"}.get(api, dev)
    start, end = {"cuda": (START, END), "vulkan": (VK_START, VK_END), "wgpu": (WG_START, WG_END)}.get(api, (START, END))
    text = "\n".join([
        start, "", f"## {kind} beside PyTorch {torch.__version__} ({'quick' if args.quick else 'full'} run, "
        f"{time.strftime('%Y-%m-%d')}, {label} x{len(RT.executor.devices) and torch.cuda.device_count()})", "",
        f"Host {machine_line()}.", "",
        f"Device copy bandwidth (PyTorch copy_, bytes read + written): {copy_bw / 1e9:.0f} GB/s. Rates: higher is "
        "better; ratio = PyTorch time / azyx time.", "",
        table(["workload", "unit", "azyx 1 op", "torch 1 op", "ratio", f"azyx {FLIGHT} in flight",
               f"torch {FLIGHT} in flight", "ratio"], w), "",
        "Transfers (GB/s of payload) through `UnifiedExecutor.execute_transfer`, beside PyTorch's `.to()`:", "",
        table(["route", "sync strategy", "azyx GB/s", "torch GB/s", "ratio"], tr), "",
        *(["Matrix-vector products, device time (`gemv_device`: each kernel's own time through CUPTI, the weight cold "
           "in L2; host work left out on both sides):", "",
           table(["product", "dtype", "azyx", "torch", "ratio", ">= 80% of copy"], gd), ""] if gd else []), end])
    print(text)
    if not only:
        write_section(Path(args.out), start, end, text)


if __name__ == "__main__":
    asyncio.run(main())
