"""A text-generation service on azyx: GPT-2 from a Hugging Face safetensors checkpoint behind `azyx serve`
(azyx.serve), so that any OpenAI client can use it (`POST /v1/completions`, `/v1/chat/completions`), tokens streamed
to many clients at once, every client's sequence decoded in one batch per step.

    python examples/generate_service.py --model DIR --device c:0 --port 8766     # uvicorn on 127.0.0.1:8766

    from openai import OpenAI
    client = OpenAI(base_url="http://127.0.0.1:8766/v1", api_key="unused")
    for chunk in client.completions.create(model="DIR's name", prompt="Hello", max_tokens=20, temperature=0.8,
                                           stream=True):
        print(chunk.choices[0].text, end="", flush=True)

DIR holds `config.json`, `model.safetensors` and the tokenizer (`tokenizer.json`, or `vocab.json` + `merges.txt`),
as Hugging Face saves a GPT-2 model; its name (the requests' `model`, GET /v1/models) is the directory's name. This
script is `azyx serve --model DIR --slots N`.

What serves it: `azyx.models.gpt2.Engine` (continuous batching: a request joins the running batch at the next step,
a finished one leaves it; the KV cache a bounded pool of slots, requests past it waiting in arrival order; the
sampling numbers data on the device, so a new temperature compiles nothing), behind `azyx.serve.make_app`: GET
/health answers at once while the weights stream in (503 on the /v1 routes until they are); streamed text is whole
characters and stop strings are matched on it across token boundaries; every bound is checked before work (400
naming the field, 413, 429 with Retry-After when slots and waiting places are taken); a client that disconnects
frees its slot at once; GET /metrics counts tokens, time to first token and the loop's heartbeat lateness. It prints
its time to ready: the seconds from start to the first answered request (ready.py).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import ready  # (first: its clock starts at its import; beside this script)

from azyx.serve import KEEP_ALIVE_S, ServeConfig, make_app


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a directory with config.json, model.safetensors, tokenizer")
    p.add_argument("--device", default="c:0")
    p.add_argument("--slots", type=int, default=8, help="sequences decoded together (the KV cache's slots)")
    p.add_argument("--waiting", type=int, default=64, help="requests that may wait for a slot (past that: 429)")
    p.add_argument("--port", type=int, default=8766)
    args = p.parse_args()
    import uvicorn

    cfg = ServeConfig(models=(args.model,), device=args.device, slots=args.slots, waiting=args.waiting,
                      port=args.port)
    ready.watch(f"http://{cfg.host}:{cfg.port}", "/v1/completions",
                {"model": Path(args.model).resolve().name, "prompt": "Hello", "max_tokens": 1})
    uvicorn.run(make_app(cfg), host=cfg.host, port=cfg.port, log_level="warning", loop="asyncio",
                timeout_keep_alive=KEEP_ALIVE_S)


if __name__ == "__main__":
    main()
