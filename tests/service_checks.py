"""Checks shared by the server tests (tests/test_openai_serve.py, tests/test_soak.py): bench/soak.py's helpers
(`soak.served`: an app on uvicorn with an httpx client; `soak.gen_stream`: a streamed /v1/completions request's
events) and a request sent as raw bytes whose body never finishes."""

from __future__ import annotations

import asyncio
import importlib.util
import sys
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
