"""`azyx.tune(*tensors)`: search the kernels of these tensors' graph now (as torch.compile's max-autotune mode does
ahead of serving) and cache the winners on disk, so that realizing the graph, here or in a later process, runs them
without searching.

Reductions the planner splits in two stages (or could: schedule.Planner.split_parts) are searched first, by their
parts (search_actions.SPLIT): for each such reduction without a cached winner, plans of a plain reduction of its sizes
(its op and dtype over a contiguous tensor: `ROWS` kind as (outputs, r) reduced along its rows, `COLUMNS` as
(r, outputs) along its columns) are made with each number of parts (search_actions.split_candidates, and no split)
and timed whole (search.search_split); the graph is then planned again with the winners, and its kernels searched.
"""

from __future__ import annotations

import numpy as np

from azyx.codegen import search_actions
from azyx.config import SEARCH_LEVELS, SearchConfigError
from azyx.graph import GRAPH, GraphCopy
from azyx.plan import ExecutionPlan
from azyx.realize import run_sync
from azyx.runtime import RT
from azyx.schedule import make_plan
from azyx.search import SearchResult, search_split
from azyx.tensor import Tensor
from azyx.walk import Walk, canonicalize
from azyx.workers import in_worker_thread


async def tune(*tensors: Tensor, level: str | None = None) -> list[SearchResult]:
    """Search the kernels that realizing `tensors` would run (unrealized ones; `level` "quick" or "thorough", default
    the configured level, or "quick" where search is off), and the parts of the reductions they split, and cache the
    winners. Returns what each search found (a kernel or split already in the cache: `cached`, nothing searched).
    Nothing is computed.

    >>> import azyx
    >>> a, b = Tensor.ones(64, 64), Tensor.ones(64, 64)
    >>> found = azyx.tune_sync(a @ b)  # doctest: +SKIP
    """
    configured, budget_s = RT.search_settings()
    level = level or (configured if configured != "off" else "quick")
    if level not in SEARCH_LEVELS[1:]:
        raise SearchConfigError(f"tune(level=) must be 'quick' or 'thorough', got {level!r}")
    targets = list(dict.fromkeys(t.id for t in tensors if GRAPH[t.id].buffer is None))
    if not targets:
        return []
    walk = canonicalize(GRAPH, targets)
    plan = await _plan(walk, targets)
    splits, replan = await _search_splits(plan, level, budget_s)
    if replan:  # a split's winner differs from the heuristic's parts: the graph planned again with it
        plan = await _plan(walk, targets)
    _, results = await RT.search(plan, level, budget_s)
    if walk.key in RT.plan_cache:  # planned before the search: planned again, with the winners
        del RT.plan_cache[walk.key]
    return splits + results


async def _plan(walk: Walk, targets: list[int]) -> ExecutionPlan:
    copy = GraphCopy(GRAPH, [*walk.topo, *walk.leaves])  # planned on a worker, like a big realize's plan
    return await in_worker_thread(make_plan, RT, copy, Walk(copy, walk.key, walk.topo, walk.leaves, targets,
                                                            walk.scalars, walk.scalar_nodes, walk.donated), targets)


async def _search_splits(plan: ExecutionPlan, level: str, budget_s: float) -> tuple[list[SearchResult], bool]:
    """Search the parts of each reduction `plan` splits (or could) that has no cached winner on its device; returns
    the results and whether a winner differs from the heuristic's parts."""
    results: list[SearchResult] = []
    replan = False
    for device, site in plan.splits:
        dev = RT.device(device)
        if not dev.search_actions:
            continue
        heur = (search_actions.Opt(search_actions.SPLIT, 0, site.heuristic),)
        got = dev.winner_cache().get(site.key)
        if got is not None:
            results.append(SearchResult(dev.name, site.key, got, heur, 0.0, 0.0, 0, 0, 0.0, True))
            continue
        parts = [site.heuristic, *search_actions.split_candidates(site, level)]
        plans = [(p, split_plan(site, device, p)) for p in parts]
        r = await in_worker_thread(search_split, dev, site, plans, level, budget_s)
        results.append(r)
        replan |= r.winner != heur
    return results, replan


def split_plan(site: search_actions.SplitSite, device: str, parts: int) -> ExecutionPlan:
    """The plan of a plain reduction of `site`'s sizes on `device` (a contiguous input of zeros: the search times it
    on random data), split into `parts` (0: none)."""
    shape, axis = ((site.r, site.outputs), 0) if site.kind == search_actions.COLUMNS else ((site.outputs, site.r), 1)
    x = Tensor(np.zeros(shape, np.float32), dtype=site.dtype, device=device)
    t = getattr(x, site.op)(axis=axis)
    walk = canonicalize(GRAPH, [t.id])
    return make_plan(RT, GRAPH, walk, [t.id], {site.key: parts})


def tune_sync(*tensors: Tensor, level: str | None = None) -> list[SearchResult]:
    """`tune` for scripts (not from inside a running event loop)."""
    return run_sync(tune(*tensors, level=level))
