"""examples/generate_service.py on a real server stack: uvicorn serving the Starlette app on 127.0.0.1, a real HTTP
client (httpx) reading server-sent events. Streams are checked token for token against transformers' greedy
`generate` on the same checkpoint (tests/test_gpt2.py's), while more clients than the cache has slots share the
decode loop; a client that goes away frees its slot; memory stays flat over many streams and disconnects."""

from __future__ import annotations

import asyncio
import gc
import importlib.util
import json
import socket
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("starlette")
uvicorn = pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from test_gpt2 import build_checkpoint, hf_greedy, transformers  # noqa: E402  (the same small checkpoint)

import azyx  # noqa: E402
from azyx.models import load_tokenizer  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("generate_service", ROOT / "examples" / "generate_service.py")
assert spec is not None and spec.loader is not None
gs = importlib.util.module_from_spec(spec)
sys.modules["generate_service"] = gs
spec.loader.exec_module(gs)

@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("gpt2"))


@pytest.fixture(scope="module")
def reference(checkpoint: Path) -> Any:
    return transformers.GPT2LMHeadModel.from_pretrained(checkpoint).eval()


PROMPTS = ["the quick brown fox", "a lazy tensor waits", "one plan per shape", "tokens stream to", "every step the",
           "jumps over the lazy dog"]


@asynccontextmanager
async def serving(checkpoint: Path, slots: int, waiting: int = 16) -> AsyncIterator[tuple[Any, Any]]:
    """(the app, an httpx client) of the service on a free port of 127.0.0.1, the model loaded."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    app = gs.make_app(checkpoint, "c:0", slots=slots, waiting=waiting)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=120) as client:
            while not server.started:  # (uvicorn sets it once the lifespan has started: the load runs behind it)
                await asyncio.sleep(0.01)
            health = (await client.get("/health")).json()  # answers at once, whether the weights are in yet or not
            assert health["ok"] is not health["loading"]
            await app.state.ready.wait()
            assert (await client.get("/health")).json() == {"ok": True, "loading": False}
            yield app, client
    finally:
        server.should_exit = True
        await task


async def events(client: Any, body: dict[str, Any], keep: int | None = None) -> list[dict[str, Any]]:
    """The data of a /generate stream's events; with `keep`, the client goes away after that many."""
    out: list[dict[str, Any]] = []
    async with client.stream("POST", "/generate", json=body) as r:
        assert r.status_code == 200, await r.aread()
        assert r.headers["content-type"].startswith("text/event-stream")
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                out.append(json.loads(line[6:]))
                if keep is not None and len(out) >= keep:
                    break
    return out


async def test_streams_match_transformers_while_more_clients_than_slots_share_the_batch(checkpoint: Path,
                                                                                         reference: Any) -> None:
    tok = load_tokenizer(checkpoint)
    async with serving(checkpoint, slots=4) as (app, client):
        bodies = [{"prompt": p, "max_new_tokens": 10, "ignore_eos": True} for p in PROMPTS]  # 6 streams, 4 slots
        got = await asyncio.gather(*(events(client, b) for b in bodies))
        for p, evs in zip(PROMPTS, got):
            *tokens, done = evs
            assert done == {"done": True, "finish_reason": "length", "tokens": 10}
            ids = [e["token"] for e in tokens]
            assert ids == hf_greedy(reference, tok.encode(p).ids, 10), p
            assert "".join(e["text"] for e in tokens) == tok.decode(ids)
        # sampling: a seed reproduces a stream, whatever runs beside it; a new temperature is data
        sampled = [{"prompt": PROMPTS[0], "max_new_tokens": 8, "temperature": t, "top_k": 50, "top_p": 0.9,
                    "seed": 7, "ignore_eos": True} for t in (0.7, 0.7, 1.3)]
        a, b, c = await asyncio.gather(*(events(client, s) for s in sampled))
        assert a == b and len(a) == 9
        assert await events(client, sampled[2]) == c  # alone, in a batch of one
        plans, compiled = len(azyx.runtime.RT.plan_cache), azyx.runtime.RT.compiled
        await events(client, {**sampled[0], "temperature": 0.55, "top_k": 20, "top_p": 0.8, "seed": 8})
        assert (len(azyx.runtime.RT.plan_cache), azyx.runtime.RT.compiled) == (plans, compiled)
        stats = (await client.get("/stats")).json()
        assert stats["active"] == 0 and stats["waiting"] == 0 and stats["cancelled"] == 0
        assert stats["tokens"] >= 6 * 10 + 4 * 8
        bad = [{"prompt": 3}, {"prompt": "x", "temperature": "hot"}, {"prompt": "x", "temperature": -1.0},
               {"prompt": "x", "top_p": 0.0}, {"prompt": "x", "max_new_tokens": 2.5}, {"prompt": "x", "stop": "."},
               {"prompt": "x" * 400}]
        replies = [await client.post("/generate", json=body) for body in bad]
        assert [r.status_code for r in replies] == [400] * len(bad), [r.text for r in replies]
        assert "temperature" in replies[2].json()["error"] and "-1" in replies[2].json()["error"]
        assert (await client.post("/generate", content=b"{no")).status_code == 400
        assert len(await events(client, bodies[0])) == 11  # still serving


async def test_a_client_that_goes_away_frees_its_slot_and_memory_stays_flat(checkpoint: Path,
                                                                             reference: Any) -> None:
    tok = load_tokenizer(checkpoint)
    async with serving(checkpoint, slots=2, waiting=0) as (app, client):
        body = {"prompt": PROMPTS[1], "max_new_tokens": 50, "ignore_eos": True}
        service = app.state.service

        async def ended(n: int) -> None:  # until the server has ended n streams' responses
            async with app.state.ended:
                await app.state.ended.wait_for(lambda: service["ended"] >= n)

        # the engine paused (its lock held) with the stream two tokens in: the client leaves while it is active
        engine = service["engine"]
        await engine.lock.acquire()
        try:
            reading = asyncio.create_task(events(client, body, keep=2))
            for _ in range(100_000):  # loop turns until the request is in (no timer: a turn per round)
                if engine.waiting:
                    break
                await asyncio.sleep(0)
            for _ in range(3):  # and the runner task it started has run: it waits for the lock
                await asyncio.sleep(0)
            engine.lock.release()
            await engine.lock.acquire()  # (after the runner's turn: the prefill and one step, two tokens)
            assert len(engine.active) == 1
            assert len(await reading) == 2  # the client leaves after two tokens
            await ended(1)
            assert service["cancelled"] == 1 and not engine.active  # its slot is free, the engine still paused
        finally:
            engine.lock.release()
        # both slots serve new streams (with no waiting room: a slot still held would answer 503)
        want = hf_greedy(reference, tok.encode(PROMPTS[2]).ids, 6)
        two = await asyncio.gather(*(events(client, {"prompt": PROMPTS[2], "max_new_tokens": 6, "ignore_eos": True})
                                     for _ in range(2)))
        assert [[e["token"] for e in evs[:-1]] for evs in two] == [want, want]
        stats = (await client.get("/stats")).json()
        assert stats["cancelled"] == 1 and stats["active"] == 0
        assert stats["tokens"] < 12 + 50  # the stream that lost its client stopped before its 50 tokens

        async def cycles(n: int) -> None:
            for i in range(n):  # connect, read a token or two, go away; and streams that run to their end
                await events(client, {**body, "prompt": PROMPTS[i % len(PROMPTS)]}, keep=1 + i % 2)
                await ended(service["streams"])
                if i % 10 == 0:
                    await events(client, {"prompt": PROMPTS[i % 3], "max_new_tokens": 40, "ignore_eos": True})

        async def settled() -> azyx.Stats:
            await azyx.synchronize()
            gc.collect()
            return azyx.stats()

        await cycles(20)  # warm-up: every batch and prompt bucket planned
        before = await settled()
        await cycles(100)  # 100 disconnects and 10 streams of 40 tokens (1000+ tokens in all, with the warm-up)
        after = await settled()
        stats = (await client.get("/stats")).json()
        # every stream ended and gave its slot back (one whose 50 tokens were decoded before the server saw its
        # client go away ended as "length": the client here shares the server's loop)
        assert service["ended"] == service["streams"] and stats["active"] == stats["waiting"] == 0
        assert (after.plans, after.kernels) == (before.plans, before.kernels)
        assert abs(after.nodes - before.nodes) <= 2, (before, after)
        assert after.pool_bytes("c:0") <= before.pool_bytes("c:0"), (before, after)
        assert after.rss - before.rss < 16 << 20, f"RSS grew {(after.rss - before.rss) / 2**20:.1f} MiB"
