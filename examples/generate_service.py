"""A text-generation service on azyx: GPT-2 from a Hugging Face safetensors checkpoint, tokens streamed to many
clients at once as server-sent events, every client's sequence decoded in one batch per step.

    python examples/generate_service.py --model DIR --device c:0 --port 8766     # uvicorn on 127.0.0.1:8766
    curl -sN 127.0.0.1:8766/generate -d '{"prompt": "Hello", "max_new_tokens": 20, "temperature": 0.8}'

DIR holds `config.json`, `model.safetensors` and the tokenizer (`tokenizer.json`, or `vocab.json` + `merges.txt`),
as Hugging Face saves a GPT-2 model.

- Start-up: the server answers `GET /health` at once ({"ok": false, "loading": true}) while the weights stream
  from disk onto the device (`azyx.io`, off the loop); `POST /generate` answers 503 until they are in.
- `POST /generate {"prompt": str, "max_new_tokens": 16, "temperature": 0.0, "top_k": 0, "top_p": 1.0,
  "seed": null, "stop": [str, ...], "ignore_eos": false}` streams `data: {"token": id, "text": piece}` events, then
  `data: {"done": true, "finish_reason": ..., "tokens": n}`. The sampling numbers are per request and are data on
  the device (a new temperature compiles nothing). Bad input answers 400 naming the value.
- Continuous batching (`azyx.models.gpt2.Engine`): a request joins the running batch at the next step, a finished
  one leaves it; the KV cache is a bounded pool of slots, and requests past it wait for a slot in arrival order.
  A client that disconnects frees its slot at once (its stream's `finally`).
- `GET /stats`: slots in use, waiting requests, streams, tokens streamed, cancelled streams, and the loop's worst
  heartbeat lateness since the last /stats.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
from pathlib import Path
from typing import Any

import azyx
from azyx.models.gpt2 import GPT2, Engine, NoFreeSlotError, load_tokenizer
from azyx.stats import Heartbeat

WARM_PROMPTS = (1, 2, 4, 8, 16, 32)  # prompt-length buckets planned at start-up (longer ones at their first request)
FIELDS = {"max_new_tokens": int, "temperature": float, "top_k": int, "top_p": float, "seed": int, "ignore_eos": bool}


def _request(body: Any, tokenizer: Any) -> tuple[list[int], dict[str, Any]]:
    """The prompt's token ids and the sampling arguments of a /generate body; ValueError names what is wrong."""
    if not isinstance(body, dict) or not isinstance(body.get("prompt"), str):
        raise ValueError('expected {"prompt": str, ...}')
    args: dict[str, Any] = {}
    for name, kind in FIELDS.items():
        v = body.get(name)
        if v is None:
            continue
        if kind is bool:
            if not isinstance(v, bool):
                raise ValueError(f"{name} must be true or false, got {v!r}")
        elif isinstance(v, bool) or not isinstance(v, int | float) or (kind is int and not isinstance(v, int)):
            raise ValueError(f"{name} must be {'an integer' if kind is int else 'a number'}, got {v!r}")
        args[name] = kind(v)
    stop = body.get("stop", [])
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise ValueError(f"stop must be a list of non-empty strings, got {stop!r}")
    ids = [t for s in stop for t in tokenizer.encode(s).ids[:1]]  # a stop string ends at its first token
    if ids:
        args["stop_token_ids"] = ids
    return tokenizer.encode(body["prompt"]).ids, args


def make_app(model_dir: str | Path, device: str = "c:0", slots: int = 8, waiting: int = 64) -> Any:
    """The service as an ASGI app (Starlette; serve it with uvicorn, `pip install 'azyx[serve]'`): `slots` sequences
    decode together, `waiting` more requests may wait for a slot (past that: 503). The model loads in the
    background at start-up; `app.state.ready` is set once it serves."""
    from contextlib import asynccontextmanager

    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route

    tokenizer = load_tokenizer(model_dir)
    state: dict[str, Any] = {"tokens": 0, "streams": 0, "cancelled": 0, "ended": 0}
    ready = asyncio.Event()
    ended = asyncio.Condition()  # notified as each stream's response ends (state["ended"] counts them)

    async def load() -> None:
        model = await GPT2.from_pretrained(model_dir, device=device)
        eng = Engine(model, slots=slots, max_waiting=waiting)
        # every decode batch shape and short prompts' prefill shapes planned and compiled before the first request
        await eng.warmup(prompt_lengths=WARM_PROMPTS, sampled=True)
        gc.collect()
        gc.freeze()  # what start-up made lives on: later full collections skip it (a pause of tens of ms)
        state["engine"] = eng
        ready.set()

    @asynccontextmanager
    async def lifespan(app: Any) -> Any:
        beat = Heartbeat()
        tasks = [asyncio.create_task(beat.run()), asyncio.create_task(load())]
        state["beat"] = beat
        try:
            yield
        finally:
            for t in tasks:
                t.cancel()
            if "engine" in state:
                await state["engine"].close()

    async def generate(request: Request) -> Response:
        if not ready.is_set():
            return JSONResponse({"error": "the model is loading"}, 503)
        try:
            body = await request.json()
        except ValueError:
            return JSONResponse({"error": "the body is not JSON"}, 400)
        try:
            prompt, args = _request(body, tokenizer)
            stream = state["engine"].generate(prompt, **args)
        except NoFreeSlotError as e:
            return JSONResponse({"error": str(e)}, 503)
        except (ValueError, azyx.AzyxError) as e:
            return JSONResponse({"error": str(e)}, 400)
        state["streams"] += 1

        async def gone() -> None:  # the client went away: its slot is free at once, not at the next token's send
            while (await request.receive())["type"] != "http.disconnect":
                pass
            stream.cancel()

        async def events() -> Any:
            watch = asyncio.create_task(gone())
            try:
                async for token in stream:
                    state["tokens"] += 1
                    yield f"data: {json.dumps({'token': token, 'text': tokenizer.decode([token])})}\n\n"
                done = {"done": True, "finish_reason": stream.finish_reason, "tokens": len(stream.tokens)}
                yield f"data: {json.dumps(done)}\n\n"
            finally:
                watch.cancel()
                if stream.finish_reason in (None, "cancelled"):
                    state["cancelled"] += 1
                stream.cancel()
                async with ended:
                    state["ended"] += 1
                    ended.notify_all()

        return StreamingResponse(events(), media_type="text/event-stream")

    async def health(request: Request) -> JSONResponse:
        return JSONResponse({"ok": ready.is_set(), "loading": not ready.is_set()})

    async def stats(request: Request) -> JSONResponse:
        eng = state.get("engine")
        use = {"active": len(eng.active), "waiting": len(eng.waiting), "slots": eng.cache.slots} if eng else {}
        counts = {k: state[k] for k in ("streams", "tokens", "cancelled")}
        return JSONResponse({**use, **counts, **state["beat"].reset()})

    app = Starlette(routes=[Route("/generate", generate, methods=["POST"]), Route("/health", health),
                            Route("/stats", stats)], lifespan=lifespan)
    app.state.ready, app.state.ended, app.state.service = ready, ended, state
    return app


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a directory with config.json, model.safetensors, tokenizer")
    p.add_argument("--device", default="c:0")
    p.add_argument("--slots", type=int, default=8, help="sequences decoded together (the KV cache's slots)")
    p.add_argument("--waiting", type=int, default=64, help="requests that may wait for a slot (past that: 503)")
    p.add_argument("--port", type=int, default=8766)
    args = p.parse_args()
    import uvicorn

    uvicorn.run(make_app(args.model, args.device, args.slots, args.waiting), host="127.0.0.1", port=args.port,
                log_level="warning")


if __name__ == "__main__":
    main()
