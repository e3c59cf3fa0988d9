"""Transformer-inference benchmark (issue 18): the workloads of a transformer's forward pass beside numpy and
PyTorch, each row against the issue's target: the token-embedding lookup (4096 ids from a 30522 x 384 float32
table, MiniLM's vocabulary and width), azyx's gather (`table[ids]`) against numpy's fancy indexing and
`torch.nn.functional.embedding` when torch is importable, and its gradient for the table (a scatter-add) against
`np.add.at` and PyTorch's backward; `nn.scaled_dot_product_attention` (8 heads x 64) against PyTorch's; and
all-MiniLM-L6-v2 (azyx.models.bert, written as PyTorch code) at batch 32 and 1 against the same weights in
`transformers`' BertModel with sentence-transformers' mean pooling and normalisation (what sentence-transformers
runs for this model; padded to the batch's longest sentence, as it pads), on the same number of CPU threads.

Run from the repository root:

    python bench/models.py [--quick] [--devices c:0] [--out bench/RESULTS.md]

Times are medians over repeats after warm-up (`time.perf_counter`); azyx's include building the lookup's graph from
the realized table and ids and `await realize()` returning with the rows ready (a new set of ids each repeat would
be an upload, which numpy does not pay either). Every azyx result is checked against numpy before it is timed. The
table goes into bench/RESULTS.md between this script's markers; the script never asserts times.
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
from common import machine_line, write_section  # noqa: E402  (beside this script)

import azyx  # noqa: E402
from azyx import Tensor  # noqa: E402


def marks(devices: list[str]) -> tuple[str, str]:
    """The section's markers: one section for CPU runs, another for runs with a CUDA device (a GPU machine's)."""
    name = "models-gpu" if any(d.startswith("cuda") for d in devices) else "models"
    return f"<!-- bench:{name}:start -->", f"<!-- bench:{name}:end -->"


VOCAB, DIM, IDS = 30522, 384, 4096
EMBEDDING_TARGET = 0.5  # azyx / numpy throughput (issue 18)
MINILM_TARGET = 1.2  # azyx / sentence-transformers' computation, batch 32 and 1 (issue 38)
MINILM_ROUNDS = 5
SENTENCES = ["The weather is lovely today.", "It's so sunny outside!", "He drove to the stadium.",
             "A man is playing a guitar on a quiet street corner late at night.", "Cats sleep most of the day.",
             "The committee postponed its decision until the budget report arrives next month."]


def median_time(fn: Callable[[], Any], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


async def median_time_async(fn: Callable[[], Awaitable[Any]], repeats: int) -> float:
    for _ in range(3):
        await fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        await fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def import_torch() -> Any:
    try:
        import torch
    except ImportError:
        return None
    return torch


async def embedding(device: str, repeats: int, torch: Any) -> list[str]:
    rng = np.random.default_rng(0)
    table = rng.standard_normal((VOCAB, DIM), dtype=np.float32)
    ids = rng.integers(0, VOCAB, IDS).astype(np.int32)
    t, i = Tensor(table, device=device), Tensor(ids, device=device)
    await azyx.realize(t, i)
    got = await t[i].numpy()
    np.testing.assert_array_equal(got, table[ids])  # the rows, exactly

    async def lookup() -> None:
        await t[i].realize()

    ta = await median_time_async(lookup, repeats)
    tn = median_time(lambda: table[ids], repeats)
    ratio = tn / ta
    gbs = IDS * DIM * 4 / ta / 1e9
    torch_cell = "-"
    if torch is not None:
        tt, ti = torch.from_numpy(table), torch.from_numpy(ids.astype(np.int64))
        tp = median_time(lambda: torch.nn.functional.embedding(ti, tt), repeats)
        torch_cell = f"{tp * 1e6:.0f} us ({tp / ta:.2f}x)"
    met = "met" if ratio >= EMBEDDING_TARGET else "NOT MET"
    target = f">= {EMBEDDING_TARGET}x numpy: {met}" if device.startswith("c:") else f"(CPU target; here {met})"
    return [f"embedding lookup, {IDS} ids from {VOCAB}x{DIM} f32", device, f"{ta * 1e6:.0f} us ({gbs:.1f} GB/s)",
            f"{tn * 1e6:.0f} us", torch_cell, f"{ratio:.2f}x", target]


async def embedding_grad(device: str, repeats: int, torch: Any) -> list[str]:
    """The lookup's gradient for the table: the upstream gradient of the 4096 rows added up at their ids (a
    scatter-add; repeated ids accumulate), against numpy's `np.add.at` into zeros."""
    rng = np.random.default_rng(1)
    table = Tensor(rng.standard_normal((VOCAB, DIM), dtype=np.float32), device=device)
    ids = rng.integers(0, VOCAB, IDS).astype(np.int32)
    up = rng.standard_normal((IDS, DIM), dtype=np.float32)
    i, g = Tensor(ids, device=device), Tensor(up, device=device)
    await azyx.realize(table, i, g)

    def grad() -> Tensor:
        with azyx.GradientTape() as tape:
            rows = table[i]
        return tape.gradient(rows, [table], seed=g)[0]

    def numpy_grad() -> np.ndarray:
        out = np.zeros((VOCAB, DIM), np.float32)
        np.add.at(out, ids, up)
        return out

    np.testing.assert_allclose(await grad().numpy(), numpy_grad(), rtol=1e-5, atol=1e-5)

    async def run() -> None:
        await grad().realize()

    ta = await median_time_async(run, repeats)
    tn = median_time(numpy_grad, max(3, repeats // 5))
    torch_cell = "-"
    if torch is not None:
        tt = torch.zeros((VOCAB, DIM), requires_grad=True)
        ti, tu = torch.from_numpy(ids.astype(np.int64)), torch.from_numpy(up)

        def torch_grad() -> None:
            tt.grad = None
            torch.nn.functional.embedding(ti, tt).backward(tu)

        tp = median_time(torch_grad, max(3, repeats // 5))
        torch_cell = f"{tp * 1e3:.1f} ms ({tp / ta:.2f}x)"
    return [f"embedding gradient (scatter-add), {IDS} ids into {VOCAB}x{DIM} f32", device, f"{ta * 1e3:.1f} ms",
            f"{tn * 1e3:.1f} ms (np.add.at)", torch_cell, f"{tn / ta:.2f}x", "-"]


def _vs_torch(ta: float, tp: float | None, what: str, device: str, targets: tuple[str, ...] = ("c:",),
              at_least: float = 1.0) -> tuple[str, str]:
    """The torch cell (its time and azyx's speed-up over it) and the target cell of a >= `at_least`x-PyTorch row (a
    target on the kinds of device `targets` names)."""
    if tp is None:
        return "-", "(no torch here)"
    met = "met" if tp / ta >= at_least else "NOT MET"
    target = f">= {at_least}x {what}: {met}" if device.startswith(targets) else f"(not a target here; {met})"
    return f"{tp * 1e3:.2f} ms ({tp / ta:.2f}x)", target


async def attention(device: str, length: int, repeats: int, torch: Any) -> list[str]:
    """softmax(q k^T / sqrt(64)) v over (1, 8, length, 64) float32, against torch's F.scaled_dot_product_attention."""
    rng = np.random.default_rng(2)
    q, k, v = (rng.standard_normal((1, 8, length, 64), dtype=np.float32) for _ in range(3))
    tq, tk, tv = (Tensor(a, device=device) for a in (q, k, v))
    await azyx.realize(tq, tk, tv)
    # (einsum: numpy's loops, not OpenBLAS, whose threads spin on both cores for ~0.1 s after a product: the timing
    # below would share the machine with them)
    s = np.einsum("bhld,bhsd->bhls", q, k) / 8.0
    p = np.exp(s - s.max(-1, keepdims=True))
    ref = np.einsum("bhls,bhsd->bhld", p / p.sum(-1, keepdims=True), v)
    np.testing.assert_allclose(await azyx.nn.scaled_dot_product_attention(tq, tk, tv).numpy(), ref, rtol=1e-4,
                               atol=1e-5)

    async def run() -> None:
        await azyx.nn.scaled_dot_product_attention(tq, tk, tv).realize()

    ta = await median_time_async(run, repeats)
    tp = None
    if torch is not None:
        pq, pk, pv = (torch.from_numpy(a) for a in (q, k, v))
        tp = median_time(lambda: torch.nn.functional.scaled_dot_product_attention(pq, pk, pv), repeats)
    torch_cell, target = _vs_torch(ta, tp, "torch", device)
    return [f"scaled_dot_product_attention, 8 heads x 64, length {length}, f32", device, f"{ta * 1e3:.2f} ms", "-",
            torch_cell, "-", target]


def _torch_minilm(torch: Any, directory: Path, device: str) -> Any:
    """The same weights in transformers' BertModel (float32, on the GPU for an azyx cuda device) with
    sentence-transformers' pooling: sentences -> embeddings on the host."""
    try:
        from tokenizers import Tokenizer
        from transformers import AutoModel
    except ImportError:
        return None
    where = "cuda" if device.startswith("cuda") else "cpu"
    bert = AutoModel.from_pretrained(str(directory), dtype=torch.float32).eval().to(where)
    tok = Tokenizer.from_file(str(directory / "tokenizer.json"))
    tok.enable_padding()
    tok.enable_truncation(256)

    def embed(sentences: list[str]) -> Any:
        enc = tok.encode_batch(sentences)
        ids = torch.tensor([e.ids for e in enc]).to(where)
        mask = torch.tensor([e.attention_mask for e in enc]).to(where)
        with torch.inference_mode():
            x = bert(input_ids=ids, attention_mask=mask).last_hidden_state
            m = mask.unsqueeze(-1).to(x.dtype)
            return torch.nn.functional.normalize((x * m).sum(1) / m.sum(1).clamp(min=1e-9), dim=-1).cpu().numpy()

    return embed


async def minilm(device: str, batches: tuple[int, ...], repeats: int, torch: Any,
                 directory: Path | None = None, rounds: int = MINILM_ROUNDS) -> list[list[str]]:
    """all-MiniLM-L6-v2 (azyx.models.bert) against transformers with sentence-transformers' pooling;
    `directory`: a checkpoint of it in another dtype (float16: 44 MB where the package's 88 MB cannot travel),
    computed in float32 on both sides."""
    try:
        from azyx.models.bert import MiniLM, model_dir

        model = await MiniLM.load(device, directory=directory, dtype="float32")
        directory = directory or model_dir()
    except Exception as e:  # the model package or tokenizers missing: say so, do not fail the run
        print(f"[models bench] MiniLM skipped: {e}", file=sys.stderr)
        return []
    peer = _torch_minilm(torch, directory, device) if torch is not None else None
    rows = []
    for batch in batches:
        sentences = [SENTENCES[i % len(SENTENCES)] for i in range(batch)]
        got = await model.embed(sentences)  # (the default: packed, MiniLM.pack)
        if peer is not None:
            want = peer(sentences)
            assert (got * want).sum(-1).min() >= 0.9999, "azyx's MiniLM embeddings differ from transformers'"
        # rounds that alternate azyx and the peer (a shared machine's load moves both alike within a round); the
        # medians over all rounds' repeats
        ta_all: list[float] = []
        tp_all: list[float] = []
        for _ in range(rounds):
            ta_all.append(await median_time_async(lambda: model.embed(sentences), max(1, repeats // 10)))
            if peer is not None:
                tp_all.append(median_time(lambda: peer(sentences), max(1, repeats // 10)))
        tp = statistics.median(tp_all) if tp_all else None
        ta = statistics.median(ta_all)
        torch_cell, target = _vs_torch(ta, tp, "sentence-transformers' computation", device, ("c:", "cuda:"),
                                       MINILM_TARGET)
        if tp_all:  # each round's ratio: a spread says the machine's other load moved one side (see the notes)
            ratios = [p / a for a, p in zip(ta_all, tp_all)]
            torch_cell += f"; rounds {min(ratios):.2f}-{max(ratios):.2f}x"
        blocks, block = model.pack(model.encode(sentences))[2].shape
        rows.append([f"all-MiniLM-L6-v2, batch {batch}, packed {blocks}x{block} tokens ({batch / ta:.0f} "
                     "sentences/s)", device, f"{ta * 1e3:.1f} ms", "-", torch_cell, "-", target])
    return rows


def section(rows: list[list[str]], quick: bool, torch: Any, devices: list[str]) -> str:
    head = ["workload", "device", "azyx", "numpy", "torch (azyx speed-up over it)", "azyx / numpy", "target"]
    versions = f"python {platform.python_version()}, numpy {np.__version__}" + \
        (f", torch {torch.__version__} ({torch.get_num_threads()} threads, OMP_WAIT_POLICY "
         f"{os.environ.get('OMP_WAIT_POLICY', 'unset')})" if torch is not None else "")
    start, end = marks(devices)
    run = "quick" if quick else "full"
    lines = [start, "", f"## Transformer inference: models on {', '.join(devices)} ({run} run, written by "
             "bench/models.py)", "", f"- date: {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}",
             f"- {machine_line()}", f"- {versions}",
             "- azyx: the graph built from realized inputs and realized each repeat; medians after warm-up; ratios are "
             "throughput (numpy's time / azyx's)",
             "", "| " + " | ".join(head) + " |", "|---|---|---:|---:|---:|---:|---|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    lines += ["", "### Notes", "",
              "- the issue's target is the CPU's (c:0); opencl:0 (PoCL) and vulkan:0 (lavapipe) are CPU "
              "implementations of GPU APIs, shown for the record",
              "- the machine is shared (see the load average): numpy's and PyTorch's times move with it as azyx's do; "
              "compare the ratios of one run",
              "- MiniLM: medians of MINILM_ROUNDS rounds that alternate the sides, each round's ratio's range beside; "
              "torch's OpenMP threads spin at barriers, so where another process holds a core the peer runs 4-16x "
              "slower (a wide range of round ratios; --omp-passive), which once read as azyx 4.11x at batch 32",
              "", end]
    return "\n".join(lines) + "\n"


async def main(args: argparse.Namespace) -> None:
    repeats, rounds = (3, 1) if args.quick else (50, MINILM_ROUNDS)
    if args.omp_passive:  # (read when torch loads its OpenMP runtime)
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    torch = import_torch()
    rows = []
    devices = [d for d in args.devices.split(",") if d in azyx.devices()]
    for device in args.devices.split(","):
        if device not in devices:
            print(f"[models bench] {device}: not available here, skipped", file=sys.stderr)
            continue
        if args.minilm_only:
            rows += await minilm(device, (32, 1), repeats, torch, args.minilm_dir, rounds)
            continue
        print(f"[models bench] {device} embedding ...", file=sys.stderr, flush=True)
        rows.append(await embedding(device, repeats, torch))
        print(" | ".join(rows[-1]), flush=True)
        rows.append(await embedding_grad(device, repeats, torch))
        print(" | ".join(rows[-1]), flush=True)
        for length in (128,) if args.quick else (128, 1024):
            rows.append(await attention(device, length, repeats, torch))
            print(" | ".join(rows[-1]), flush=True)
        if device.startswith(("c:", "cuda:")):  # (the model on the devices the targets name)
            for row in await minilm(device, (32, 1), repeats, torch, args.minilm_dir, rounds):
                rows.append(row)
                print(" | ".join(row), flush=True)
    text = section(rows, args.quick, torch, devices)
    print(text)
    if not args.minilm_only:
        write_section(Path(args.out), *marks(devices), text)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--devices", default="c:0")
    parser.add_argument("--out", default=str(REPO / "bench" / "RESULTS.md"))
    parser.add_argument("--minilm-only", action="store_true", help="only the MiniLM rows (writes nothing)")
    parser.add_argument("--omp-passive", action="store_true",
                        help="torch's OpenMP threads sleep at barriers (OMP_WAIT_POLICY=PASSIVE) rather than spin: "
                        "on a machine with more runnable threads than cores, spinning ones take the cores from the "
                        "threads they wait for (4-20x slower here at load 20)")
    parser.add_argument("--minilm-dir", type=Path, default=None,
                        help="an all-MiniLM-L6-v2 checkpoint directory other than the installed package's")
    asyncio.run(main(parser.parse_args()))
