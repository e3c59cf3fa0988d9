"""`azyx.stats()`: what the runtime holds, in one snapshot: live graph nodes, cached plans, jit traces, compiled
kernels, each device's pooled memory and the process's resident memory. A long run (a training loop, a service)
stays flat when these stop growing after warm-up; tests/test_longrun.py and bench/longrun.py check that."""

from __future__ import annotations

import os
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
