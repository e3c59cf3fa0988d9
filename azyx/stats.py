"""`azyx.stats()`: what the runtime holds, in one snapshot: live graph nodes, cached plans, jit traces, compiled
kernels, each device's pooled memory and the process's resident memory. A long run (a training loop, a service)
stays flat when these stop growing after warm-up; tests/test_longrun.py and bench/longrun.py check that. And
`Heartbeat`: how late a 1 ms tick on a service's event loop wakes, the measure of a loop that never stalls."""

from __future__ import annotations

import asyncio
import os
import time
from collections import deque
from dataclasses import dataclass, field

from azyx.allocator import MemoryUsage
from azyx.graph import GRAPH
from azyx.jit import trace_count
from azyx.runtime import RT


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
    """A 1 ms tick on the event loop: how late it wakes is how long something held the loop. A service whose loop
    stalls answers every request late, whatever its throughput: run `asyncio.create_task(beat.run())` beside it and
    report `report()` (the services' GET /stats). The worst lateness since the start only grows (no reader can reset
    it); the worst over a recent window comes from per-second maxima kept for `keep` seconds. `reset()` starts a
    measurement anew, for a process timing itself (never for what a client can call)."""

    def __init__(self, period: float = 0.001, keep: int = 3600):
        self.period, self.worst_ms, self.ticks = period, 0.0, 0
        self.seconds: deque[tuple[int, float]] = deque(maxlen=keep)  # (whole second, worst lateness in it)
        self._since_reset = 0.0

    async def run(self) -> None:
        """Coroutine that never returns: tick every `period` seconds, recording how late each tick woke. Run it as a
        task."""
        while True:
            t0 = time.perf_counter()
            await asyncio.sleep(self.period)
            now = time.perf_counter()
            self.tick(now, (now - t0 - self.period) * 1e3)

    def tick(self, now: float, late_ms: float) -> None:
        """Record one tick that woke `late_ms` late at `now` (time.perf_counter())."""
        self.worst_ms, self.ticks = max(self.worst_ms, late_ms), self.ticks + 1
        self._since_reset = max(self._since_reset, late_ms)
        second = int(now)
        if self.seconds and self.seconds[-1][0] == second:
            self.seconds[-1] = (second, max(self.seconds[-1][1], late_ms))
        else:
            self.seconds.append((second, late_ms))

    def worst_within(self, seconds: float) -> float:
        """The worst lateness (ms) of the ticks of the last `seconds` (whole seconds: up to one more)."""
        start = int(time.perf_counter() - seconds)
        return max((w for s, w in self.seconds if s >= start), default=0.0)

    def report(self, window: float = 10.0) -> dict[str, float]:
        """The worst lateness (ms) since the start, the worst within the last `window` seconds, and the ticks; reading
        it changes nothing."""
        return {"worst_lateness_ms": self.worst_ms, "window_s": window,
                "window_lateness_ms": self.worst_within(window), "ticks": self.ticks}

    def reset(self) -> dict[str, float]:
        """The worst lateness (ms) since the last reset, and the ticks since the start; starts a measurement anew
        (what `report` says is kept)."""
        out = {"worst_lateness_ms": self._since_reset, "ticks": self.ticks}
        self._since_reset = 0.0
        return out
