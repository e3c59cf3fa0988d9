"""Generation benchmark (issue 19): GPT-2 in azyx (`azyx.models.gpt2`) beside transformers' GPT2LMHeadModel on the
same weights and the same device kind, in the same run.

    python bench/generate.py [--quick] [--device c:0] [--out bench/RESULTS.md] [--only static-b1]

The checkpoint is made here from a fixed seed in Hugging Face's layout (GPT-2 small: 12 layers, 768 wide, 50257
tokens; `--quick`: a 2-layer, 64-wide model), since no GPT-2 checkpoint can be installed from the package registries.
Rows, each against the issue's target:
- batch-1 decode tokens/s (greedy, KV cache): azyx's stream (time between the first and the last token) against
  transformers' `generate` (the time of N new tokens less the time of one);
- time to the first token of a 128-token prompt against transformers' forward over the prompt (its prefill);
- 32 concurrent streams through the engine's continuous batching against the same 32 requests one at a time
  (aggregate tokens/s), and the worst lateness of a 1 ms heartbeat on the loop meanwhile.
- the best PyTorch recipe (bench/torch_gpt2.py: a static KV cache, the whole step captured in one CUDA graph on a GPU,
  eager on a CPU; the token read back each step) at batch 1 and at the streams' batch, fp32 (and bf16 on a GPU):
  prompt and new tokens, whole requests timed on both sides, its tokens checked against azyx's.
`--only static-b1`: the batch-1 rows against the best PyTorch recipe alone (fp32, and bf16 on a GPU), printed, not
written. Every azyx result is checked first: its greedy tokens against transformers'. Times are medians; the script
never asserts them. transformers and torch are bench-only: without them the peer columns say so.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import gc
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))
from common import machine_line, write_section  # noqa: E402  (beside this script)

from azyx.models import GPT2, Engine  # noqa: E402
from azyx.stats import Heartbeat  # noqa: E402


def marks(device: str) -> tuple[str, str]:
    """The markers of this device's section of bench/RESULTS.md (one per device: a CPU and a GPU table)."""
    return f"<!-- bench:generate-{device}:start -->", f"<!-- bench:generate-{device}:end -->"


def make_checkpoint(directory: Path, quick: bool, torch: Any, transformers: Any) -> Any:
    """A GPT-2 with random weights (seed 0) saved in HF's layout; returns the transformers model."""
    torch.manual_seed(0)
    size = dict(n_layer=2, n_head=4, n_embd=64, vocab_size=512, n_positions=256) if quick else \
        dict(n_layer=12, n_head=12, n_embd=768, vocab_size=50257, n_positions=1024)
    cfg = transformers.GPT2Config(**size, initializer_range=0.2 if quick else 0.02)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    model.save_pretrained(directory, safe_serialization=True)
    return model


def torch_device(device: str) -> str:
    return "cuda" if device.startswith("cuda") else "cpu"


def hf_generate(torch: Any, hf: Any, prompt: list[int], n: int, dev: str) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt], device=dev), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                          eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()  # type: ignore[no-any-return]


def hf_sync(torch: Any, dev: str) -> None:
    if dev == "cuda":
        torch.cuda.synchronize()


async def stream_times(engine: Engine, prompt: list[int], n: int) -> tuple[list[int], float, float]:
    """(tokens, time to the first token, time from the first to the last) of one greedy stream."""
    t0 = time.perf_counter()
    tokens, first = [], 0.0
    async for t in engine.generate(prompt, max_new_tokens=n, ignore_eos=True):
        if not tokens:
            first = time.perf_counter()
        tokens.append(t)
    return tokens, first - t0, time.perf_counter() - first


async def token_stamps(engine: Engine, prompt: list[int], n: int) -> list[float]:
    """The clock at each token of one greedy stream."""
    out = []
    async for _ in engine.generate(prompt, max_new_tokens=n, ignore_eos=True):
        out.append(time.perf_counter())
    return out


async def static_rows(torch: Any, hf: Any, path: str, device: str, dtype: str, prompts: list[list[int]], n_new: int,
                      repeats: int, batches: tuple[int, ...] | None = None) -> list[list[str]]:
    """Batch 1 and batch len(prompts) greedy decoding: azyx (`Engine`, weights in `dtype`, a batch's prompts prefilled
    in one plan as the peer prefills them) against the static-cache PyTorch peer (bench/torch_gpt2.py) in the same
    dtype, its tokens checked equal to azyx's."""
    from torch_gpt2 import StaticGPT2

    dev = torch_device(device)
    model = await GPT2.from_pretrained(path, device=device, dtype=dtype)
    batch = len(prompts)
    sizes = batches or (1, batch)
    engine = Engine(model, slots=max(sizes), prefill_batch=max(sizes))
    await engine.warmup(prompt_lengths=[len(prompts[0])])
    gc.collect()
    gc.freeze()  # (as main's streams, and a service once started: README)
    short = "bf16" if dtype == "bfloat16" else "fp32"
    recipe = "static KV cache + one CUDA graph per step" if dev == "cuda" else "static KV cache, eager"
    rows = []
    for b in sizes:
        peer = StaticGPT2(torch, hf, b, len(prompts[0]) + n_new + 1, getattr(torch, dtype), dev)
        peer.capture()
        want = peer.generate(prompts[:b], n_new)
        got = await asyncio.gather(*(stream_times(engine, p, n_new) for p in prompts[:b]))
        same = "same tokens" if [g[0] for g in got] == want else "tokens DIFFER"
        az, pt = [], []
        for _ in range(repeats):  # decode only, both sides: from the first new token to the last
            stamps = await asyncio.gather(*(token_stamps(engine, p, n_new) for p in prompts[:b]))
            az.append(max(s[-1] for s in stamps) - min(s[0] for s in stamps))
            peer.generate(prompts[:b], n_new)
            pt.append(peer.decode_seconds)
        az_tps, pt_tps = b * (n_new - 1) / statistics.median(az), b * (n_new - 1) / statistics.median(pt)
        met = "met" if az_tps >= 1.5 * pt_tps else "NOT MET"
        rows.append([f"decode, batch {b}, greedy, {short}, {n_new} tokens (tokens/s); peer: PyTorch {recipe} ({same})",
                     f"{az_tps:.1f}", f"{pt_tps:.1f}", f"{az_tps / pt_tps:.2f}x", f">= 1.5x: {met}"])
        del peer
    await engine.close()
    return rows


async def main(args: argparse.Namespace) -> None:
    try:
        import torch
        import transformers
    except ImportError:
        print("[generate bench] torch and transformers are needed to make the checkpoint: skipped", file=sys.stderr)
        return
    device, quick = args.device, args.quick
    dev = torch_device(device)
    n_new, repeats, streams = (8, 2, 8) if quick else (64, 5, 32)
    rows: list[list[str]] = []
    with tempfile.TemporaryDirectory() as tmp:
        hf = make_checkpoint(Path(tmp), quick, torch, transformers).to(dev)
        if args.only == "static-b1":
            vocab = hf.config.vocab_size
            prompts = [[j * 17 % vocab for j in range(8)]]
            for dtype in (("float32", "bfloat16") if dev == "cuda" else ("float32",)):
                rows += await static_rows(torch, hf, tmp, device, dtype, prompts, n_new, repeats, (1,))
            print("\n".join("| " + " | ".join(r) + " |" for r in rows))
            return
        model = await GPT2.from_pretrained(tmp, device=device)
        engine = Engine(model, slots=streams, prefill_batch=streams)  # (a crowd's prompts start in one plan)
        await engine.warmup(prompt_lengths=[8, 128])  # every batch shape planned before the clock (as a service does)
        gc.collect()
        gc.freeze()  # as a service does once it has started (README): a full collection of torch's heap is ~0.5 s
        vocab = model.config.vocab_size
        prompt = [(i * 7919 + 13) % vocab for i in range(8)]
        want = hf_generate(torch, hf, prompt, n_new, dev)
        got, _, _ = await stream_times(engine, prompt, n_new)
        verdict = "same tokens" if got == want else "WRONG RESULT"
        print(f"[generate bench] greedy {n_new} tokens against transformers: {verdict}", flush=True)

        # 1. batch-1 decode
        decode = [await stream_times(engine, prompt, n_new) for _ in range(repeats)]
        az_tps = (n_new - 1) / statistics.median(d[2] for d in decode)

        def hf_time(n: int) -> float:
            times = []
            for _ in range(repeats):
                hf_sync(torch, dev)
                t0 = time.perf_counter()
                hf_generate(torch, hf, prompt, n, dev)
                hf_sync(torch, dev)
                times.append(time.perf_counter() - t0)
            return statistics.median(times)

        hf_tps = (n_new - 1) / max(hf_time(n_new) - hf_time(1), 1e-9)
        met = "met" if az_tps >= hf_tps else "NOT MET"
        rows.append([f"decode, batch 1, greedy, {n_new} tokens (tokens/s)", f"{az_tps:.1f}", f"{hf_tps:.1f}",
                     f"{az_tps / hf_tps:.2f}x", f">= 1.0x: {met}"])

        # 2. time to the first token of a 128-token prompt
        long_prompt = [(i * 104729 + 3) % vocab for i in range(128)]
        ttft = statistics.median([(await stream_times(engine, long_prompt, 1))[1] for _ in range(repeats + 1)][1:])
        with torch.no_grad():
            ids = torch.tensor([long_prompt], device=dev)
            hf(ids)
            times = []
            for _ in range(repeats):
                hf_sync(torch, dev)
                t0 = time.perf_counter()
                hf(ids)
                hf_sync(torch, dev)
                times.append(time.perf_counter() - t0)
        pre = statistics.median(times)
        met = "met" if ttft <= pre else "NOT MET"
        rows.append(["time to first token, 128-token prompt (ms); transformers: its prefill forward",
                     f"{ttft * 1e3:.1f}", f"{pre * 1e3:.1f}", f"{pre / ttft:.2f}x", f"<= transformers: {met}"])

        # 3. concurrent streams through continuous batching, against one at a time
        prompts = [[(i * 31 + j * 17) % vocab for j in range(8)] for i in range(streams)]
        t0 = time.perf_counter()
        for p in prompts[: max(2, streams // 8)]:
            await stream_times(engine, p, n_new)
        serial = max(2, streams // 8) * n_new / (time.perf_counter() - t0)
        beat = Heartbeat()
        ticking = asyncio.create_task(beat.run())
        await asyncio.sleep(0.01)
        beat.reset()
        t0 = time.perf_counter()
        await asyncio.gather(*(stream_times(engine, p, n_new) for p in prompts))
        together = streams * n_new / (time.perf_counter() - t0)
        lateness = beat.reset()["worst_lateness_ms"]
        ticking.cancel()
        target = ">= 4x" + (" (cuda:0's target)" if not device.startswith("cuda") else "")
        rows.append([f"{streams} concurrent streams, continuous batching (prompts prefilled together), aggregate "
                     "tokens/s; peer: azyx one at a time",
                     f"{together:.1f}", f"{serial:.1f}", f"{together / serial:.2f}x", target])
        rows.append([f"heartbeat lateness, worst, during the {streams} streams (ms)", f"{lateness:.2f}", "-", "-",
                     f"<= 5 ms: {'met' if lateness <= 5 else 'NOT MET'}"])
        await engine.close()

        # 4. the best PyTorch recipe: static KV cache, the step captured as one CUDA graph (eager on a CPU)
        for dtype in (("float32", "bfloat16") if dev == "cuda" else ("float32",)):
            rows += await static_rows(torch, hf, tmp, device, dtype, prompts, n_new, repeats)
    size = "2 layers x 64 (quick)" if quick else "GPT-2 small: 12 layers x 768, vocab 50257"
    start, end = marks(device)
    lines = [start, "", f"## Generation: GPT-2 ({'quick' if quick else 'full'} run, written by bench/generate.py)",
             "", f"- date: {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}",
             f"- {machine_line()}", f"- azyx device {device}; transformers {transformers.__version__}, torch "
             f"{torch.__version__} on {dev} ({torch.get_num_threads()} threads); model {size}, random weights "
             f"(seed 0); greedy tokens checked against transformers: {verdict}", "",
             "| workload | azyx | peer (transformers unless named) | ratio | target |", "|---|---:|---:|---:|---|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    lines += ["", end]
    text = "\n".join(lines) + "\n"
    print(text)
    write_section(Path(args.out), start, end, text)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--device", default="c:0")
    parser.add_argument("--out", default=str(REPO / "bench" / "RESULTS.md"))
    parser.add_argument("--only", choices=["static-b1"], help="static-b1: the batch-1 rows against the best PyTorch "
                        "recipe alone, printed (not written)")
    asyncio.run(main(parser.parse_args()))
