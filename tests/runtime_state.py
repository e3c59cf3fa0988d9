"""Shared by the async tests: what the runtime holds once all queued work has run."""

from __future__ import annotations

import gc

import azyx
from azyx.graph import GRAPH
from azyx.runtime import RT


def in_use() -> dict[str, int]:
    """Bytes in use per device allocator (host, C and OpenCL pools)."""
    return {n: d.allocator.in_use for n, d in RT.executor.devices.items() if hasattr(d, "allocator")}


async def settle() -> tuple[int, dict[str, int]]:
    """Graph node count and allocator use after every device finished its work (queued work holds buffers)."""
    await azyx.synchronize()
    gc.collect()
    return len(GRAPH), in_use()
