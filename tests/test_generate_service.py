"""examples/generate_service.py on a real server stack: uvicorn serving the Starlette app on 127.0.0.1, a real HTTP
client (httpx) reading server-sent events. Streams are checked token for token against transformers' greedy
`generate` on the same checkpoint (tests/test_gpt2.py's), while more clients than the cache has slots share the
decode loop; a client that goes away frees its slot; memory stays flat over many streams and disconnects."""

from __future__ import annotations

import asyncio
import gc
import json
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("starlette")
uvicorn = pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from service_checks import check_lateness_is_kept, raw_request, soak  # noqa: E402
from test_gpt2 import build_checkpoint, hf_greedy, transformers  # noqa: E402  (the same small checkpoint)

import azyx  # noqa: E402
from azyx.models import load_tokenizer  # noqa: E402
from azyx.models.service import Limits  # noqa: E402

gs = soak.load_example("generate_service")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("gpt2"))


@pytest.fixture(scope="module")
def reference(checkpoint: Path) -> Any:
    return transformers.GPT2LMHeadModel.from_pretrained(checkpoint).eval()


PROMPTS = ["the quick brown fox", "a lazy tensor waits", "one plan per shape", "tokens stream to", "every step the",
           "jumps over the lazy dog"]


@asynccontextmanager
async def serving(checkpoint: Path, slots: int, waiting: int = 16, limits: Any = None
                  ) -> AsyncIterator[tuple[Any, Any]]:
    """(the app, an httpx client) of the service on a free port of 127.0.0.1, the model loaded."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    app = gs.make_app(checkpoint, "c:0", slots=slots, waiting=waiting, limits=limits)
    app.state.port = port
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


events = soak.gen_stream  # (client, body, keep=None): a /generate stream's events; `keep`: the client leaves then


async def test_streams_match_transformers_while_more_clients_than_slots_share_the_batch(checkpoint: Path,
                                                                                         reference: Any) -> None:
    tok = load_tokenizer(checkpoint)
    async with serving(checkpoint, slots=4) as (app, client):
        bodies = [{"prompt": p, "max_new_tokens": 10, "ignore_eos": True} for p in PROMPTS]  # 6 streams, 4 slots
        got = await asyncio.gather(*(events(client, b) for b in bodies))
        for p, evs in zip(PROMPTS, got):
            *tokens, done = evs
            assert {k: done[k] for k in ("done", "finish_reason", "tokens")} == \
                {"done": True, "finish_reason": "length", "tokens": 10}
            ids = [e["token"] for e in tokens]
            assert ids == hf_greedy(reference, tok.encode(p).ids, 10), p
            assert "".join(e["text"] for e in evs) == tok.decode(ids)
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


def text_of(evs: list[dict[str, Any]]) -> str:
    return "".join(e.get("text", "") for e in evs)


async def test_bad_requests_fail_alone_with_400s_naming_the_field(checkpoint: Path, reference: Any) -> None:
    """The attacks: top_k >= 2**31 killed the shared decode runner (4 other streams cut, the offender hung); scale
    and temperature 1e39 or 10**400, JSON nested 100k deep and lone surrogates answered 500; a 100 MB body was read
    whole before validation; a body that never finished held its connection."""
    tok = load_tokenizer(checkpoint)
    limits = gs.RequestLimits(body=Limits(max_body_bytes=64 << 10, body_timeout=1.0), max_prompt_chars=2000)
    async with serving(checkpoint, slots=4, limits=limits) as (app, client):
        good = {"prompt": PROMPTS[0], "max_new_tokens": 12, "ignore_eos": True}
        want = hf_greedy(reference, tok.encode(PROMPTS[0]).ids, 12)
        cases = [(b'{"prompt": "x", "top_k": 2147483648}', 400, "top_k"),
                 (b'{"prompt": "x", "top_k": 1' + b"0" * 400 + b"}", 400, "top_k"),
                 (b'{"prompt": "x", "temperature": 1e39}', 400, "temperature"),
                 (b'{"prompt": "x", "temperature": 1' + b"0" * 400 + b"}", 400, "temperature"),
                 (b'{"prompt": "x", "temperature": NaN}', 400, "temperature"),
                 (b'{"prompt": "x", "max_new_tokens": 4294967296}', 400, "max_new_tokens"),
                 (b'{"prompt": "x", "seed": -1}', 400, "seed"),
                 (b'{"prompt": "x", "top_p": 0}', 400, "top_p"),
                 (b'{"prompt": "\\ud800"}', 400, "prompt"),
                 (b'{"prompt": "x", "stop": ["ok", "\\udfff"]}', 400, "stop[1]"),
                 (b'{"prompt": "x", "stop": [""]}', 400, "stop[0]"),
                 (b'{"prompt": "x", "stop": ' + json.dumps(["s"] * 17).encode() + b"}", 413, "stop"),
                 (b"[" * 30_000 + b"]" * 30_000, 400, "body"),  # (100k deep is over this body limit: 413)
                 (json.dumps({"prompt": "y" * 5000}).encode(), 413, "prompt"),
                 (b'{"prompt": "x", "ignore_eos": 1}', 400, "ignore_eos")]

        async def bad(content: bytes) -> Any:
            return await client.post("/generate", content=content)

        # the bad requests arrive among good streams: those run to their end, token for token
        results = await asyncio.gather(*(events(client, good) for _ in range(4)), *(bad(c) for c, _, _ in cases))
        for evs in results[:4]:
            assert [e["token"] for e in evs[:-1]] == want and evs[-1]["finish_reason"] == "length"
        for (content, status, name), r in zip(cases, results[4:]):
            assert (r.status_code, r.json()["field"]) == (status, name), (content[:50], r.text)
        # bodies over the limit: by their Content-Length before reading, or as they stream in
        r = await client.post("/generate", content=b" " * (1 << 20))
        assert r.status_code == 413

        async def chunks() -> AsyncIterator[bytes]:
            for _ in range(64):
                yield b" " * 4096

        assert (await client.post("/generate", content=chunks())).status_code == 413
        # a body that never finishes: 408 after the body timeout
        reply = await raw_request(app.state.port, b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n",
                                  b"{")
        assert reply.startswith(b"HTTP/1.1 408"), reply[:80]
        # the runner still serves; nothing is held
        assert [e["token"] for e in (await events(client, good))[:-1]] == want
        stats = (await client.get("/stats")).json()
        assert stats["live"] == 0 and stats["free_slots"] == 4


async def test_stop_strings_match_the_text_and_streamed_text_is_whole_characters(checkpoint: Path,
                                                                                  reference: Any) -> None:
    """The attack: stop strings matched their first token only: a stop string that never occurs ended a stream after
    5 tokens, and a word stop did not match its space-prefixed token. Now: matched on the decoded text across token
    boundaries, never sent; and the streamed text is whole characters (valid UTF-8), equal to decoding the tokens."""
    tok = load_tokenizer(checkpoint)
    async with serving(checkpoint, slots=4) as (app, client):
        body = {"prompt": PROMPTS[3], "max_new_tokens": 30, "ignore_eos": True}
        ids = hf_greedy(reference, tok.encode(PROMPTS[3]).ids, 30)
        full = tok.decode(ids)
        # a stop string that never occurs: the whole stream (it shares its first token with the text's start)
        never = full[:3] + "\u2603never"
        evs = await events(client, {**body, "stop": [never]})
        assert [e["token"] for e in evs[:-1]] == ids and evs[-1]["finish_reason"] == "length"
        assert text_of(evs) == full
        # a stop string spanning two tokens, starting inside one: cut before it, never sent
        pieces = [tok.decode(ids[: i + 1]) for i in range(len(ids))]
        boundary = next(i for i in range(3, len(ids))
                        if len(pieces[i - 1]) >= 3 and len(pieces[i]) > len(pieces[i - 1]))
        start = len(pieces[boundary - 1]) - 2
        stop = full[start: len(pieces[boundary - 1]) + 1]
        first = full.index(stop)
        evs = await events(client, {**body, "stop": ["zzz never", stop]})
        assert evs[-1]["finish_reason"] == "stop" and text_of(evs) == full[:first]
        assert stop not in text_of(evs) and len(evs) - 1 < 30
        # a word stop matches inside a space-prefixed token
        word = next(w for w in full.split() if len(w) > 2)
        evs = await events(client, {**body, "stop": [word]})
        assert evs[-1]["finish_reason"] == "stop" and text_of(evs) == full[: full.index(word)]
        # whole characters: a prompt of multi-byte characters, streamed pieces that each encode, joined = decoded
        for prompt in ("héllo wörld 日本語 🎉", "ça va? ∑ ≠ ∞"):
            evs = await events(client, {"prompt": prompt, "max_new_tokens": 20, "ignore_eos": True})
            got = [e["token"] for e in evs[:-1]]
            assert got == hf_greedy(reference, tok.encode(prompt).ids, 20)
            for e in evs:
                e.get("text", "").encode("utf-8")
            assert text_of(evs) == tok.decode(got)
        stats = (await client.get("/stats")).json()
        assert stats["live"] == 0 and stats["free_slots"] == 4


async def test_stats_lateness_is_no_clients_to_reset(checkpoint: Path) -> None:
    """The attack: any client reset /stats' worst lateness with a plain GET. A stall of the loop (this test shares
    it with the server) stays reported however often /stats is read."""
    async with serving(checkpoint, slots=1) as (app, client):
        await check_lateness_is_kept(client)
