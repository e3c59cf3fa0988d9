"""How a kernel is launched, decided once, when it is rendered: the `Launch` record that each KernelStep carries and
each backend reads as it is (grid and group for GPU-style APIs; the shared loop's trip count and the parallel kind for
host kernels). Launch geometry is a fact of the kernel and its dialect, never re-derived at launch.

Beside it, the analysis both the renderers and the launch read: whether a kernel reduces by work groups (`group_size`),
its vector width (`vectorized`), its work-group size, whether its indices fit 32 bits, how a host kernel shares its
loops among threads (`parallel_kind`, `parallel_loop`)."""

from __future__ import annotations

from dataclasses import dataclass

from azyx.codegen.dialect import BLOCKED, ITEM_TILES, Dialect
from azyx.codegen.templates import gemm, gemm_host, gemm_sm90
from azyx.dtypes import dtypes
from azyx.ir import Kernel, V, toposort
from azyx.symbolic import Div, Lin, Mod, Var

# How a host kernel runs in parallel. SHARED: one of its global loops (parallel_loop) runs over a range [lo, hi) its
# caller passes, so that several threads share the loop, each calling it with its own part (the C backend's batches
# hand out parts to a pool of threads). OWN_REGION: it opens its own OpenMP region (a reduction of all its elements
# into one). SERIAL: one call does it all (too little work to share, or nothing to share).
SERIAL, SHARED, OWN_REGION = 0, 1, 2
PARALLEL_WORK = 1 << 15  # innermost iterations below which a kernel runs on one thread


@dataclass(frozen=True)
class Launch:
    grid: tuple[int, int, int] = (1, 1, 1)  # work groups (CUDA blocks) per dimension
    group: int = 1  # work items per group
    trip: int = 0  # a host kernel's shared loop: its iterations, which the device's threads share out
    parallel: int = SERIAL  # a host kernel's parallel kind: SERIAL, SHARED or OWN_REGION
    zero: int = 0  # bytes of the first output to zero before the kernel runs (a product whose K is split over groups)
    smem: int = 0  # CUDA: bytes of dynamic shared memory per block
    maps: tuple[gemm_sm90.TensorMap, ...] = ()  # CUDA: TMA tensor maps, the kernel's parameters after its buffers

    @property
    def items(self) -> int:
        """Work items in all (OpenCL's global size)."""
        return self.grid[0] * self.grid[1] * self.grid[2] * self.group


def launch_for(k: Kernel, dl: Dialect, threads: int = 1, g: gemm.Gemm | None = None) -> Launch:
    """How kernel `k` is launched on `dl`: the product template's geometry where `g` (its product) is given, else the
    generic rendering's (host: its shared loop; GPU: a work item per point, or a group per point that reduces)."""
    if g is not None and g.target == BLOCKED:  # blocks of C shared by the device's threads (one: a single call)
        return Launch(trip=gemm_host.trip(g), parallel=SHARED)
    if g is not None and g.target == ITEM_TILES:  # a work group of one item per tile of C
        return Launch((gemm_host.cl_items(g), 1, 1), 1)
    if g is not None:
        return Launch(g.grid(), g.threads, zero=4 * g.m * g.n * g.batch if g.split[0] > 1 else 0)
    if not dl.global_ids:  # host: the kernel loops itself; threads may share one of its loops
        loop = parallel_loop(k, dl, threads)
        return Launch(trip=0 if loop is None else k.gvars[loop].vmax + 1, parallel=parallel_kind(k, dl, threads))
    n = max(k.points, 1)
    group = work_group(k, dl)
    if group_size(k, dl):  # a group per output point (a warp per point: several points per group)
        groups = -(-n // (group // dl.warp)) if dl.warp and group_size(k, dl) == dl.warp else n
    else:  # one work item per point (several, vectorised)
        groups = -(-(n // (vectorized(k, dl) or 1)) // group)
    if dl.max_groups and groups > dl.max_groups:  # too many for one dimension: rows of max_groups
        return Launch((dl.max_groups, -(-groups // dl.max_groups), 1), group)
    return Launch((groups, 1, 1), group)


def group_size(k: Kernel, dl: Dialect) -> int:
    """The work-group size that reduces each output point of `k` on `dl`, or 0 for one work item per point.
    Grouped: every reduce is flat (no reduce in its body that its own loop moves: a statistic of a product's
    prologue, the same for every step of the product's loop, is computed before it, by the group too), at least a
    group long, and either its loads run
    contiguously along it, or they do not along the outputs (then neither layout coalesces, and a group at least
    spreads the work), or the outputs are too few to occupy the device."""
    size = dl.group_size
    if not size or k.uvars:
        return 0
    if k.rows:
        return row_group(k, dl)
    if dl.warp and k.global_size >= dl.warp_outputs:
        size = dl.warp  # outputs enough to fill the device with a warp each (no shared memory, no barrier)
    reduces = [v for v in toposort(*k.values) if v.op == "reduce"]
    if not reduces or any(v.op == "reduce" and v.vars & set(r.arg[1]) for r in reduces for v in toposort(r.src[0])):
        return 0
    if k.group >= 0:  # an optimisation action chose it (search_actions); a size the dialect cannot tree-reduce: none
        return k.group if group_fits(k.group, dl) else 0
    longest = max(reduces, key=lambda r: _numel(r.arg[1]))
    if _numel(longest.arg[1]) < size:
        return 0
    loads = [v.arg[1] for v in toposort(longest.src[0]) if v.op == "load"]
    along_r = any(x.terms.get(longest.arg[1][-1]) == 1 for x in loads)
    along_g = bool(k.gvars) and any(x.terms.get(k.gvars[-1]) == 1 for x in loads)
    return size if along_r or not along_g or k.global_size < size else 0


def row_group(k: Kernel, dl: Dialect) -> int:
    """The work items that walk each row of row kernel `k` (Kernel.rows) and reduce its statistics: the dialect's group,
    a warp where the rows are enough to fill the device with a warp each (as `group_size` does for outputs), or, for a
    short row, the least power of two that covers it (not below a warp, whose shuffles take 32 lanes)."""
    size = dl.warp if dl.warp and k.points >= dl.warp_outputs else dl.group_size
    row = k.gvars[-1].vmax + 1
    while size // 2 >= max(row, dl.warp, 2):
        size //= 2
    return size


def group_fits(size: int, dl: Dialect) -> bool:
    """Whether `dl` can reduce with work groups of `size` items: a power of two up to the dialect's group size, and
    whole warps where the dialect combines by warp shuffles."""
    if size == 0:
        return True
    if size < 2 or size & (size - 1) or size > max(dl.group_size, 256):
        return False
    return not dl.warp or size % dl.warp == 0


def vector_width(k: Kernel, dl: Dialect) -> int:
    """Elements per vector load and store of `k` on `dl`: the kernel's choice (an optimisation action, Kernel.vector),
    else the dialect's default; 0 for none (or a dialect without vector types)."""
    w = dl.vector_width if k.vector < 0 else k.vector
    return w if dl.vector and w in VECTOR_WIDTHS else 0


VECTOR_WIDTHS = (2, 4)


def vectorized(k: Kernel, dl: Dialect) -> int:
    """The vector width (0: none) at which `k` renders as a plain elementwise kernel with `vw` points per work item
    (see elementwise_vector_fits)."""
    w = vector_width(k, dl)
    return w if w and elementwise_vector_fits(k, w) else 0


def elementwise_vector_fits(k: Kernel, w: int) -> bool:
    """Whether `k` can take `w` points per work item with vector loads and stores: a plain elementwise kernel (no
    reduce, no upcast loop) over one global loop whose length is a multiple of `w`, writing float32 outputs exactly
    along that loop (offset 0, stride 1: each vector is aligned to its size)."""
    if len(k.gvars) != 1 or k.uvars or k.global_size % w or k.scatter is not None:
        return False
    if any(v.op == "reduce" for v in toposort(*k.values)):
        return False
    return all(k.params[i] is dtypes.float32 and _is_var(idx, k.gvars[0]) for i, (idx, _) in enumerate(k.stores))


# A host kernel whose output is at least this large stores it streaming (non-temporal: past the caches, no read for
# ownership of each line; see `streams`). Below it the output stays in the cache for the next kernel (the last level is
# 32 MiB on the EPYC hosts measured, shared with the inputs streaming through).
STREAM_BYTES = 8 << 20


def streams(k: Kernel, dl: Dialect) -> bool:
    """Whether host kernel `k` stores its output with the dialect's streaming stores (Dialect.stream): a plain
    elementwise kernel writing one float32 output whole along its one loop, at least STREAM_BYTES of it."""
    return bool(dl.stream) and len(k.stores) == 1 and 4 * k.global_size >= STREAM_BYTES and \
        elementwise_vector_fits(k, 1)


def reduce_vector_operands(k: Kernel, r: V, w: int, body: list[V]) -> set[int] | None:
    """The float32 parameters that reduce `r`'s body (`body`: its values) reads along its one reduce variable, each at
    an index that is a multiple of `w` once that variable is (so `w` neighbours are one aligned vector load); None
    where the reduce cannot step `w` elements at a time (several reduce variables, a length not divisible by `w`, an
    operand read along it otherwise, nothing to read along it)."""
    rvars = r.arg[1]
    if w < 2 or len(rvars) != 1 or (rvars[0].vmax + 1) % w:
        return None
    rv, along = rvars[0], set()
    for v in body:
        if v.op != "load" or rv not in v.arg[1].terms:
            continue
        idx = v.arg[1]
        aligned = idx.const % w == 0 and all(c % w == 0 for a, c in idx.terms.items() if a is not rv)
        if k.params[v.arg[0]] is not dtypes.float32 or idx.terms[rv] != 1 or not aligned or \
                not v.arg[2].always or not all(isinstance(a, Var) for a in idx.terms):
            return None
        along.add(v.arg[0])
    if not along or any(v.op == "load" and v.arg[0] in along and rv not in v.arg[1].terms for v in body):
        return None
    return along


def vector_fits(k: Kernel, w: int) -> bool:
    """Whether vector accesses of `w` elements (1: none) apply to `k`, on a dialect with vector types: a vectorisable
    elementwise kernel, or a flat reduce reading its operands along itself (used where it is grouped)."""
    if w == 1:
        return True
    if w not in VECTOR_WIDTHS:
        return False
    if elementwise_vector_fits(k, w):
        return True
    reduces = [v for v in toposort(*k.values) if v.op == "reduce"]
    return not k.uvars and any(not r.src[0].has_reduce and reduce_vector_operands(k, r, w, toposort(r.src[0]))
                               for r in reduces)


def along_loop(k: Kernel, order: list[V]) -> set[int]:
    """The float32 inputs of a `vectorized` kernel that it reads only along its loop (consecutive elements per work
    item: one vector load)."""
    g = k.gvars[0]
    along = {p for p in range(len(k.stores), len(k.params)) if k.params[p] is dtypes.float32 and all(
        _is_var(v.arg[1], g) and v.arg[2].always for v in order if v.op == "load" and v.arg[0] == p)}
    return along & {v.arg[0] for v in order if v.op == "load"}


def work_group(k: Kernel, dl: Dialect) -> int:
    """Work items per group of a GPU-style kernel, as its launch has them (launch.Launch.group)."""
    group = group_size(k, dl)
    if dl.warp and group == dl.warp:  # a warp per output point, several warps per group
        return dl.group_size
    if group:  # a group per output point (a grouped reduce)
        return group
    n = max(k.global_size, 1) // (vectorized(k, dl) or 1)
    return min(k.local or dl.block, max(n, 1))


def _is_var(x: Lin, g: Var) -> bool:
    """`x` is exactly `g` (offset 0, stride 1): the points of a vector are consecutive elements."""
    return x.const == 0 and x.terms == {g: 1}


def _numel(vs: tuple[Var, ...] | list[Var]) -> int:
    out = 1
    for v in vs:
        out *= v.vmax + 1
    return out


def _magnitude(x: Lin) -> int:
    """A bound on |x| and on every partial sum and product that evaluating it forms."""
    total = abs(x.const)
    for a, c in x.terms.items():
        inner = _magnitude(a.x) if isinstance(a, Div | Mod) else 0
        total += abs(c) * max(abs(a.vmin), abs(a.vmax), inner)
    return total


def index_fits(k: Kernel, group: int = 0) -> bool:
    """Whether every index `k` computes fits a 32-bit int (then GPU dialects use one: 64-bit division is slow)."""
    limit = (1 << 31) - 1
    sizes = [max(k.global_size, k.points * max(group, 1)), *(_magnitude(idx) for idx, _ in k.stores)]
    if k.scatter is not None:
        sizes.append(_magnitude(k.scatter[2]))
    for v in toposort(*k.values):
        if v.op == "load":
            sizes.append(_magnitude(v.arg[1]))
            sizes.extend(_magnitude(x) + abs(lo) + abs(hi) for x, lo, hi in v.arg[2].facts)
        elif v.op == "cond":
            sizes.extend(_magnitude(x) + abs(lo) + abs(hi) for x, lo, hi in v.arg.facts)
        elif v.op == "reduce":
            sizes.append(_numel(v.arg[1]) + group)
    return max(sizes) < limit


def parallel_kind(k: Kernel, dl: Dialect, threads: int) -> int:
    if not dl.pragmas or threads <= 1 or k.work < PARALLEL_WORK:
        return SERIAL
    if k.gvars:
        return SHARED
    if not k.uvars and sum(v.op == "reduce" for v in toposort(*k.values)) == 1:
        return OWN_REGION
    return SERIAL


def parallel_loop(k: Kernel, dl: Dialect, threads: int) -> int | None:
    """Which global loop of a SHARED kernel is shared out: the outermost, or the next one when the outermost is too
    short to give every thread a part (then each part runs all of the outermost)."""
    if parallel_kind(k, dl, threads) != SHARED:
        return None
    sizes = [v.vmax + 1 for v in k.gvars]
    return 1 if len(sizes) > 1 and sizes[0] < 2 * threads and sizes[1] > sizes[0] else 0


def loop_steps(k: Kernel, group: int, max_trips: int) -> int:
    """How many steps of each reduce loop one iteration takes (a power of two), so that a work item's loop iterations
    stay within `max_trips` (0: no bound). Mesa's llvmpipe (lavapipe) ends every shader's loops after 65535
    iterations in all, silently: a row of 34M elements summed by a group of 64 items would stop at 2M."""
    trips = sum(-(-_numel(v.arg[1]) // max(group, 1)) for v in toposort(*k.values) if v.op == "reduce")
    u = 1
    while max_trips and trips > (max_trips - 64) * u and u < 1024:  # (64: the trees' loops and a margin)
        u *= 2
    return u
