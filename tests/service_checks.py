"""Checks shared by the services' tests (tests/test_serve.py, tests/test_generate_service.py, tests/test_soak.py):
bench/soak.py's helpers (`soak.served`: an app on uvicorn with an httpx client; `soak.gen_stream`: a /generate
stream's events; `soak.load_example`), a request sent as raw bytes whose body never finishes, and /stats figures
that no GET resets."""

from __future__ import annotations

import asyncio
import importlib.util
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def _load_soak() -> Any:
    if "soak" not in sys.modules:
        spec = importlib.util.spec_from_file_location("soak", ROOT / "bench" / "soak.py")
        assert spec is not None and spec.loader is not None
        sys.modules["soak"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules["soak"])
    return sys.modules["soak"]


soak = _load_soak()


async def raw_request(port: int, head: bytes, body_part: bytes) -> bytes:
    """What the server on 127.0.0.1:`port` answers a request whose headers and first body bytes are sent and the
    rest never is."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(head + body_part)
        await writer.drain()
        return await asyncio.wait_for(reader.read(1 << 16), 30)
    finally:
        writer.close()


async def check_lateness_is_kept(client: Any) -> None:
    """A stall of the loop (the caller shares it with the server) stays reported however often /stats is read (a
    plain GET used to reset it), and a bad window is a 400."""
    time.sleep(0.06)  # (the stall itself: nothing waits for it)
    first = (await client.get("/stats")).json()
    second = (await client.get("/stats")).json()
    assert first["worst_lateness_ms"] >= 50 and second["worst_lateness_ms"] >= first["worst_lateness_ms"]
    assert second["window_lateness_ms"] >= 50
    assert (await client.get("/stats?window=-1")).status_code == 400
