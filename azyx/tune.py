"""`azyx.tune(*tensors)`: search the kernels of these tensors' graph now (as torch.compile's max-autotune mode does
ahead of serving) and cache the winners on disk, so that realizing the graph, here or in a later process, runs them
without searching."""

from __future__ import annotations

from azyx.config import SEARCH_LEVELS, SearchConfigError
from azyx.graph import GraphCopy
from azyx.realize import run_sync
from azyx.runtime import GRAPH, RT
from azyx.schedule import make_plan
from azyx.search import SearchResult
from azyx.tensor import Tensor
from azyx.walk import Walk, canonicalize
from azyx.workers import in_worker_thread


async def tune(*tensors: Tensor, level: str | None = None) -> list[SearchResult]:
    """Search the kernels that realizing `tensors` would run (unrealized ones; `level` "quick" or "thorough", default
    the configured level, or "quick" where search is off) and cache the winners. Returns what each search found (a
    kernel already in the cache: `cached`, nothing searched). Nothing is computed.

    >>> a, b = Tensor.ones(64, 64), Tensor.ones(64, 64)
    >>> found = azyx.tune_sync(a @ b)
    """
    configured, budget_s = RT.search_settings()
    level = level or (configured if configured != "off" else "quick")
    if level not in SEARCH_LEVELS[1:]:
        raise SearchConfigError(f"tune(level=) must be 'quick' or 'thorough', got {level!r}")
    targets = list(dict.fromkeys(t.id for t in tensors if GRAPH[t.id].buffer is None))
    if not targets:
        return []
    walk = canonicalize(GRAPH, targets)
    copy = GraphCopy(GRAPH, [*walk.topo, *walk.leaves])  # planned on a worker, like a big realize's plan
    plan = await in_worker_thread(make_plan, RT, copy, Walk(copy, walk.key, walk.topo, walk.leaves, targets,
                                                            walk.scalars, walk.scalar_of, walk.donated), targets)
    _, results = await RT.search(plan, level, budget_s)
    if walk.key in RT.plan_cache:  # planned before the search: planned again, with the winners
        del RT.plan_cache[walk.key]
    return results


def tune_sync(*tensors: Tensor, level: str | None = None) -> list[SearchResult]:
    """`tune` for scripts (not from inside a running event loop)."""
    return run_sync(tune(*tensors, level=level))
