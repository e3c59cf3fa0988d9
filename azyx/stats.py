"""`azyx.stats()`: what the runtime holds, in one snapshot: live graph nodes, cached plans, jit traces, compiled
kernels, each device's pooled memory and the process's resident memory. A long run (a training loop, a service)
stays flat when these stop growing after warm-up; tests/test_longrun.py and bench/longrun.py check that. And
`Heartbeat`: how late a 1 ms tick on a service's event loop wakes, the measure of a loop that never stalls."""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass, field

from azyx.allocator import MemoryUsage
from azyx.jit import trace_count
from azyx.runtime import GRAPH, RT


@dataclass(frozen=True)
class Stats:
    """One snapshot of the runtime (`azyx.stats()`)."""

    nodes: int  # live graph nodes (tensor handles, lazy nodes and the leaves they keep)
    plans: int  # ExecutionPlans in the plan cache
    traces: int  # azyx.jit traces held by live jitted functions
    kernels: int  # kernels handed to a device's compiler since start (a cached plan or a new scalar adds none)
    memory: dict[str, MemoryUsage] = field(default_factory=dict)  # device -> pool bytes (in use, cached)
    rss: int = 0  # the process's resident set size, bytes

    def pool_bytes(self, device: str) -> int:
        """What `device`'s pool holds: bytes in use plus bytes cached for reuse."""
        m = self.memory.get(device)
        return m.in_use + m.cached if m is not None else 0

    def __str__(self) -> str:
        mem = ", ".join(f"{d} {m.in_use >> 10}+{m.cached >> 10} KiB" for d, m in self.memory.items())
        return (f"nodes {self.nodes}, plans {self.plans}, traces {self.traces}, kernels {self.kernels}, "
                f"pools (in use+cached) [{mem}], rss {self.rss / 2**20:.1f} MiB")


def stats() -> Stats:
    """A snapshot of what the runtime holds. Devices that have not started report no memory (this starts nothing).
    Queued work holds its buffers until it has run: `await azyx.synchronize()` first for settled pool figures.

    >>> import azyx
    >>> s = azyx.stats()
    >>> s.nodes >= 0 and s.rss > 0
    True
    """
    memory = {name: dev.memory() for name, dev in RT.started_devices().items()}
    return Stats(len(GRAPH), len(RT.plan_cache), trace_count(), RT.compiled, memory, rss_bytes())


def rss_bytes() -> int:
    """The process's resident set size now (Linux: /proc/self/statm), else its peak (getrusage)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        import resource
        import sys

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024


class Heartbeat:
    """A 1 ms tick on the event loop: how late it wakes is how long something held the loop (the worst since the
    last reset, in ms). A service whose loop stalls answers every request late, whatever its throughput: run
    `asyncio.create_task(beat.run())` beside it and report `reset()` (examples/embed_service.py's /stats)."""

    def __init__(self, period: float = 0.001):
        self.period, self.worst_ms, self.ticks = period, 0.0, 0

    async def run(self) -> None:
        """Coroutine that never returns: tick every `period` seconds, recording how late each tick woke. Run it as a
        task."""
        while True:
            t0 = time.perf_counter()
            await asyncio.sleep(self.period)
            late = (time.perf_counter() - t0 - self.period) * 1e3
            self.worst_ms, self.ticks = max(self.worst_ms, late), self.ticks + 1

    def reset(self) -> dict[str, float]:
        """The worst lateness (ms) and the ticks since the last reset; starts counting anew."""
        out = {"worst_lateness_ms": self.worst_ms, "ticks": self.ticks}
        self.worst_ms, self.ticks = 0.0, 0
        return out
