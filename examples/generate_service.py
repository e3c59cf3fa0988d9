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
  `data: {"done": true, "finish_reason": ..., "tokens": n, "text": rest}`. The text is whole characters only (a
  multi-byte character split across tokens comes with the token that completes it; `rest` is what was held back
  at the end); a stop string is matched on the text across token boundaries and never sent (finish_reason "stop").
  The sampling numbers are per request and are data on the device (a new temperature compiles nothing).
- Bounds (`RequestLimits`), checked before any work: body bytes (413, by its Content-Length before reading, and as
  it streams), seconds to send it (408), prompt characters (413; its tokens at most the cache's max_len), stop
  strings; every field within what the kernels take (int32 counts, finite float32 numbers, strings that encode):
  a bad one answers 400 naming it ({"error", "field"}). Long prompts are tokenized on a worker thread.
- Continuous batching (`azyx.models.gpt2.Engine`): a request joins the running batch at the next step, a finished
  one leaves it; the KV cache is a bounded pool of slots, and requests past it wait for a slot in arrival order.
  A client that disconnects frees its slot at once, whatever its sequence's state (waiting, prefilling, decoding);
  a request that fails (its own values) fails alone.
- `GET /stats`: slots in use, waiting requests, streams, tokens streamed, cancelled streams, and the loop's worst
  heartbeat lateness since the start and within the last `?window=` seconds (reading it resets nothing).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import azyx
from azyx.models import service as svc
from azyx.models.gpt2 import GPT2, Engine, NoFreeSlotError, load_tokenizer
from azyx.models.service import Limits
from azyx.models.text import TextStream
from azyx.stats import Heartbeat

WARM_PROMPTS = (1, 2, 4, 8, 16, 32)  # prompt-length buckets planned at start-up (longer ones at their first request)
TOKENIZE_ON_LOOP_CHARS = 2048  # a longer prompt is tokenized on a worker thread


@dataclass(frozen=True)
class RequestLimits:
    """The generation service's per-request bounds (see `make_app`): body bytes and seconds, prompt characters (its
    tokens are bounded by the KV cache's max_len), stop strings and their characters."""

    body: Limits = field(default_factory=lambda: Limits(max_body_bytes=256 << 10))
    max_prompt_chars: int = 32_768
    max_stop: int = 16
    max_stop_chars: int = 256


def _request(body: Any, limits: RequestLimits) -> tuple[str, dict[str, Any], list[str]]:
    """The prompt, the sampling arguments and the stop strings of a /generate body; BadRequest names the field."""
    body = svc.body_object(body, '{"prompt": str, ...}')
    prompt = svc.text(body, "prompt", limits.max_prompt_chars)
    assert prompt is not None
    args: dict[str, Any] = {
        "max_new_tokens": svc.integer(body, "max_new_tokens", 16),
        "temperature": svc.number(body, "temperature", 0.0, low=0.0),
        "top_k": svc.integer(body, "top_k", 0),
        "top_p": svc.number(body, "top_p", 1.0, low=0.0, high=1.0, low_open=True),
        "seed": svc.integer(body, "seed", None, high=(1 << 63) - 1),
        "ignore_eos": svc.flag(body, "ignore_eos", False),
    }
    stop = svc.texts(body, "stop", limits.max_stop, limits.max_stop_chars, default=[], non_empty=True)
    return prompt, args, stop


def make_app(model_dir: str | Path, device: str = "c:0", slots: int = 8, waiting: int = 64,
             limits: RequestLimits | None = None) -> Any:
    """The service as an ASGI app (Starlette; serve it with uvicorn, `pip install 'azyx[serve]'`): `slots` sequences
    decode together, `waiting` more requests may wait for a slot (past that: 503). The model loads in the
    background at start-up; `app.state.ready` is set once it serves. Per-request bounds: `limits`."""
    from contextlib import asynccontextmanager

    from starlette.applications import Starlette
    from starlette.requests import ClientDisconnect, Request
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route

    lim = limits or RequestLimits()
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

    def encode(prompt: str) -> list[int]:
        try:
            ids: list[int] = tokenizer.encode(prompt).ids
        except Exception as e:  # (the tokenizer's own failure: this request's)
            raise svc.BadRequest("prompt", f"cannot be tokenized ({svc.short(str(e), 80)})") from None
        return ids

    async def generate(request: Request) -> Response:
        if not ready.is_set():
            return JSONResponse({"error": "the model is loading"}, 503)
        try:
            body = await svc.read_json(request.headers, request.stream(), lim.body)
            prompt, args, stop = _request(body, lim)
            ids = await asyncio.to_thread(encode, prompt) if len(prompt) > TOKENIZE_ON_LOOP_CHARS else encode(prompt)
            stream = state["engine"].generate(ids, **args)
        except svc.BadRequest as e:
            return JSONResponse({"error": str(e), "field": e.field}, e.status)
        except NoFreeSlotError as e:
            return JSONResponse({"error": str(e)}, 503, headers={"Retry-After": "1"})
        except azyx.AzyxError as e:
            return JSONResponse({"error": str(e)}, 400)
        except ClientDisconnect:
            return Response(status_code=499)  # (nobody reads it)
        state["streams"] += 1
        text = TextStream(tokenizer, stop)

        async def gone() -> None:  # the client went away: its slot is free at once, not at the next token's send
            await svc.until_disconnect(request.receive)
            stream.cancel()

        def event(data: dict[str, Any]) -> str:
            return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"

        async def events() -> Any:
            watch = asyncio.create_task(gone())
            try:
                async for token in stream:
                    state["tokens"] += 1
                    yield event({"token": token, "text": text.push(token)})
                    if text.stopped is not None:  # a stop string completed on the text: it was never sent
                        stream.cancel("stop")
                        break
                done = {"done": True, "finish_reason": stream.finish_reason, "tokens": len(stream.tokens),
                        "text": text.flush()}
                yield event(done)
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
        try:
            window = svc.query_number(request.query_params, "window", 10.0, low=0.0, high=86400.0)
        except svc.BadRequest as e:
            return JSONResponse({"error": str(e), "field": e.field}, 400)
        eng = state.get("engine")
        use = {"active": len(eng.active), "waiting": len(eng.waiting), "live": len(eng.live),
               "free_slots": len(eng.cache.free), "slots": eng.cache.slots} if eng else {}
        counts = {k: state[k] for k in ("streams", "tokens", "cancelled")}
        return JSONResponse({**use, **counts, **state["beat"].report(window)})

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
