"""Kernel optimisation actions as data: what a schedule may change in a kernel, applied to the IR in one place.

An `Opt` is one action: upcast a global loop into a register tile (`UPCAST`, amount = tile length), put the
column tiles outermost (`SWAP`), set the work items per group of a one-item-per-point GPU kernel (`LOCAL`), the work
items that reduce each output point together (`GROUP`: 0 for one item per point), pick a matrix product's block sizes
(`BLOCK`, amount = a row of gemm_host's table on the host, a block tile of templates.gemm's tables on CUDA and Vulkan
GPUs, v > 0 being row v - 1 there; such a product takes no register tiles), unroll each reduce's innermost loop
(`UNROLL`, amount = steps per iteration, a divisor of each reduce's innermost loop length; a grouped reduce unrolls its
work item's strided loop, the remainder in a second loop: every C-family dialect and WGSL), or set the float32
elements per vector load and store (`VECTOR`, amount 2 or 4, 1 for none: elementwise kernels over one contiguous loop,
and grouped reduces reading their operands along the reduce, aligned, where the dialect has vector types: OpenCL
float2/float4 by vloadn/vstoren, CUDA float2/float4, GLSL vec2/vec4, WGSL vec2/vec4 (elementwise only); provable from
the IR's affine indices, launch.vector_fits). The steps keep each reduce's accumulation order: results equal the
plain kernel's.
`apply(base, opts)` makes the kernel the actions describe from the kernel without them; renderers read the result as
facts (its upcast loops, `Kernel.local`, `Kernel.group`, `Kernel.variant`, `Kernel.unroll`, `Kernel.vector`) and stay
single linear passes. The scheduler's heuristics are one list of actions (schedule.Planner.tile_for); the search
(azyx.search) tries others, and `WinnerCache` keeps what won on disk, per device identity, keyed by the kernel's
structure (`kernel_key`: never a scalar's value, which is an argument).

One action is the plan's, not a kernel's: `SPLIT` (amount = parts, 0 for none) is how many partial results a
reduction of many elements into few outputs is split into (schedule.Planner.split_parts). Its winners are cached under
a `SplitSite.key` (the reduce's kind, op, dtype and sizes) in the same cache; azyx.tune times the alternatives
(`split_candidates`) on plain reductions of those sizes (search.search_split).
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from azyx import debug
from azyx.codegen.dialect import SHADER_TILES, WARP_TILES, Dialect
from azyx.codegen.launch import group_fits, vector_fits
from azyx.codegen.templates import gemm, gemm_host, gemv
from azyx.config import cache_dir
from azyx.ir import Kernel, V, ValueBuilder, format_kernel, has_index, toposort
from azyx.symbolic import Cond, Div, Lin, Mod, Var, var

UPCAST, SWAP, LOCAL, GROUP, BLOCK = "upcast", "swap", "local", "group", "block"
UNROLL, VECTOR, SPLIT = "unroll", "vector", "split"
KINDS = (UPCAST, SWAP, LOCAL, GROUP, BLOCK, UNROLL, VECTOR, SPLIT)
# the winner cache's file format; a file of another format is ignored (2: UNROLL, VECTOR, GPU BLOCK and SPLIT; caches
# searched without them are searched again)
FORMAT = 2
VERSION = "0.1.0"  # azyx's version, part of every cache file's identity (a new azyx searches again)


class OptError(ValueError):
    """An action that does not apply to a kernel (a cached entry for another structure, a corrupt entry)."""


@dataclass(frozen=True)
class Opt:
    kind: str  # one of KINDS
    axis: int = 0  # UPCAST: the global loop of the base kernel (outer first)
    # UPCAST: tile length; LOCAL: work items per group; GROUP: items per output point; BLOCK: variant; UNROLL: steps
    # per iteration; VECTOR: elements per access (1: none); SPLIT: parts (0: none)
    amount: int = 0

    def __repr__(self) -> str:
        return f"{self.kind}({self.axis},{self.amount})" if self.kind == UPCAST else f"{self.kind}({self.amount})"


Opts = tuple[Opt, ...]


def searchable(k: Kernel) -> bool:
    """Whether actions may apply to `k`: a plain loop nest (no gather, scatter or assignment, no tile yet; no row
    kernel, Kernel.rows, whose last loop is its work groups')."""
    return not k.uvars and not has_index(k) and bool(k.gvars) and not k.rows


def apply(base: Kernel, opts: Sequence[Opt]) -> Kernel:
    """The kernel that `opts` make of `base`: each UPCAST loop g of length n becomes g' (n / t) and an upcast loop u
    (t), every index reading g' * t + u; SWAP exchanges the last two global loops (column tiles outermost: a tile of
    the right operand stays in cache over all rows); LOCAL, GROUP and BLOCK become the kernel's `local`, `group` and
    `variant` (a product's block sizes or tile), UNROLL and VECTOR its `unroll` and `vector`.
    Raises OptError where an action does not fit `base` (SPLIT is the plan's: never a kernel's)."""
    if not opts:
        return base
    subst: dict[Var, Lin] = {}
    gvars: list[Var] = []
    uvars: list[Var] = []
    ups = {o.axis: o.amount for o in opts if o.kind == UPCAST and o.amount > 1}
    for o in opts:
        if o.kind not in KINDS or not isinstance(o.axis, int) or not isinstance(o.amount, int) or o.amount < 0:
            raise OptError(f"not an action: {o!r}")
        if o.kind == SPLIT:
            raise OptError(f"{o!r} is a plan's action (the parts of a split reduction), not a kernel's")
    if ups and not searchable(base):
        raise OptError("register tiles apply to plain loop nests without tiles only")
    if any(a >= len(base.gvars) or a < 0 for a in ups):
        raise OptError(f"no global loop {max(ups)} in a kernel of {len(base.gvars)}")
    for i, g in enumerate(base.gvars):
        t = ups.get(i, 1)
        if t > 1:
            n = g.vmax + 1
            if n % t:
                raise OptError(f"a tile of {t} does not divide loop {g.name} of {n}")
            outer, u = Var(g.name, n // t), Var(f"u{i}", t)
            subst[g] = var(outer) * t + var(u)
            gvars.append(outer)
            uvars.append(u)
        else:
            gvars.append(g)
    if any(o.kind == SWAP for o in opts) and len(gvars) > 1:
        gvars[-2], gvars[-1] = gvars[-1], gvars[-2]
    local = next((o.amount for o in opts if o.kind == LOCAL), base.local)
    group = next((o.amount for o in opts if o.kind == GROUP), base.group)
    variant = next((o.amount for o in opts if o.kind == BLOCK), base.variant)
    unroll = next((o.amount for o in opts if o.kind == UNROLL), base.unroll)
    vector = next((o.amount for o in opts if o.kind == VECTOR), base.vector)
    if unroll > 1:
        _check_unroll(base, unroll)
    stores = _substitute(base, subst) if subst else base.stores
    out = Kernel(base.params, gvars, uvars, stores, base.work, base.scatter, base.inplace, local=local, group=group,
                 variant=variant, unroll=unroll, vector=vector, base=base, opts=tuple(opts))
    if vector >= 0 and not vector_fits(out, vector):
        raise OptError(f"vector accesses of {vector} elements do not fit the kernel (float32 elements read and written "
                       "along its loop, or along a reduce, aligned, a multiple of it long)")
    return out


MAX_UNROLL = 32


def _check_unroll(k: Kernel, unroll: int) -> None:
    """UNROLL fits a kernel whose reduces are flat (no reduce in their body) and whose innermost loops' lengths it
    divides."""
    reduces = [v for v in toposort(*k.values) if v.op == "reduce"]
    if not reduces or unroll > MAX_UNROLL or any(r.src[0].has_reduce for r in reduces):
        raise OptError(f"an unroll of {unroll} applies to flat reduces only (up to {MAX_UNROLL} steps)")
    for r in reduces:
        last = r.arg[1][-1]
        if (last.vmax + 1) % unroll:
            raise OptError(f"an unroll of {unroll} does not divide reduce loop {last.name} of {last.vmax + 1}")


def _substitute(k: Kernel, subst: dict[Var, Lin]) -> list[tuple[Lin, V]]:
    """`k`'s stores with every index rewritten by `subst` (its value DAG built again, interned)."""
    vb = ValueBuilder()
    new: dict[int, V] = {}
    for v in toposort(*k.values):
        s = tuple(new[id(x)] for x in v.src)
        if v.op == "const":
            nv = vb.const(v.arg, v.dtype)
        elif v.op == "arg":
            nv = vb.arg(v.arg, v.dtype)
        elif v.op == "load":
            param, idx, cond = v.arg
            nv = vb.load(param, v.dtype, _lin(idx, subst), _cond(cond, subst))
        elif v.op == "cond":
            nv = vb.cond(_cond(v.arg, subst), v.dtype)
        elif v.op == "alu":
            nv = vb.alu(v.arg, v.dtype, *s)
        elif v.op == "cast":
            nv = vb.cast(s[0], v.dtype)
        elif v.op == "where":
            nv = vb.where(*s)
        elif v.op == "reduce":
            nv = vb.reduce(v.arg[0], v.dtype, s[0], v.arg[1])
        else:
            raise OptError(f"cannot rewrite a value of op {v.op}")
        new[id(v)] = nv
    return [(_lin(idx, subst), new[id(v)]) for idx, v in k.stores]


def _lin(x: Lin, subst: dict[Var, Lin]) -> Lin:
    out = Lin({}, x.const)
    for a, c in x.terms.items():
        if isinstance(a, Var):
            out = out + (subst[a] if a in subst else var(a)) * c
        elif isinstance(a, Div):
            out = out + (_lin(a.x, subst) // a.n) * c
        elif isinstance(a, Mod):
            out = out + (_lin(a.x, subst) % a.n) * c
        else:
            raise OptError(f"cannot rewrite index atom {a!r}")
    return out


def _cond(c: Cond, subst: dict[Var, Lin]) -> Cond:
    if c.never:
        return c
    out = Cond()
    for x, lo, hi in c.facts:
        out = out.add(_lin(x, subst), lo, hi)
    return out


def kernel_key(k: Kernel) -> str:
    """The kernel's structure (loops, value DAG, parameters' dtypes; scalars by position, never by value) as a hash."""
    text = f"{format_kernel(k)}|{k.scatter is not None}|{k.inplace}|{len(k.stores)}"
    return hashlib.sha256(text.encode()).hexdigest()[:32]


# ------------------------------------------------------------------------------------------------ candidates
# rows x columns of a register tile, likelier winners first (a budget may end the list): 4 x 16 and 8 x 8 fill AVX2's
# 16 vector registers, 8 x 32 and 16 x 16 AVX-512's 32
QUICK_TILES = ((4, 16), (8, 8), (2, 32), (8, 16), (4, 32), (8, 32), (4, 8), (2, 16), (1, 32), (16, 16), (1, 1))
# GPU-style: neighbouring work items on neighbouring columns (no SWAP), a few outputs each
QUICK_ITEM_TILES = ((4, 4), (8, 4), (4, 1), (8, 1), (2, 4), (4, 2))
ROW_TILES, COL_TILES = (1, 2, 4, 8, 16), (1, 2, 4, 8, 16, 32, 64)
QUICK_LOCAL, THOROUGH_LOCAL = (32, 64, 128, 256), (16, 32, 64, 128, 256)
QUICK_GROUP, THOROUGH_GROUP = (0, 32, 64, 128, 256), (0, 16, 32, 64, 128, 256)
QUICK_UNROLL, THOROUGH_UNROLL = (4,), (2, 4, 8)


def candidates(k: Kernel, dl: Dialect | None, actions: frozenset[str], level: str, heuristic: Opts = ()) -> list[Opts]:
    """The action lists to try on base kernel `k` for a device that understands `actions` (a subset of KINDS), the
    fewer the quicker (`level` "quick" or "thorough"); `heuristic`: the scheduler's own list, which the caller times
    first. Where the heuristic tiles, quick tries other tiles and work-group sizes with its tile, never an untiled
    kernel (a product without register tiles is slow to even time). Unrolls and vector widths are tried on the
    heuristic's own actions; a product template's kernel only by its block sizes or tiles."""
    if not searchable(k) or (dl is not None and dl.small_products and gemv.match(k) is not None):
        return [()]  # (the small-M product's kernel, templates.gemv, has no choices the actions set)
    if BLOCK in actions and dl is not None and dl.gemm and not dl.global_ids \
            and (g := gemm_host.product(k, dl.simd, 1, dl.bf16_dot)) is not None:  # the host template: block sizes
        n = 0 if gemm_host.skinny(g) else gemm_host.variants(dl.simd, g.bf16_dot)
        return [(Opt(BLOCK, 0, v),) for v in range(1, n)]
    if BLOCK in actions and dl is not None and dl.gemm and dl.global_ids and (g := _gpu_product(k, dl)) is not None:
        return _tile_variants(g)
    reduces = [v for v in toposort(*k.values) if v.op == "reduce"]
    thorough = level == "thorough"
    tiled = any(o.kind == UPCAST for o in heuristic)
    flat = bool(reduces) and not any(r.src[0].has_reduce for r in reduces)
    out: list[Opts] = [()] if thorough or not tiled else []
    bound = dl.max_trips if dl is not None else 0  # (llvmpipe ends longer loops silently: the grouped reduce there)
    long = bool(bound) and any(_numel([x.vmax + 1 for x in r.arg[1]]) > bound for r in reduces)
    tiles = _tiles(k, thorough, SWAP in actions) if UPCAST in actions and flat and not long else []
    if tiles and dl is not None and dl.global_ids and not thorough:
        tiles += _tiles(k, False, False, QUICK_ITEM_TILES)
    out += tiles
    # (on the host, only where register tiles vectorise: gcc vectorises a plain reduce along itself, which an unroll in
    # the source defeats: a row sum 20x slower on c:0)
    if UNROLL in actions and flat and (tiled or (dl is not None and dl.global_ids)):
        out += [(*heuristic, Opt(UNROLL, 0, u)) for u in (THOROUGH_UNROLL if thorough else QUICK_UNROLL)
                if _fits(k, (*heuristic, Opt(UNROLL, 0, u)))]
    if VECTOR in actions and dl is not None:
        default = dl.vector_width or 1
        widths = [w for w in (1, 2, 4) if w != default] if thorough else [4 if default == 1 else 1]
        # (none, 1, only where the default's vectors fit: else it is the default kernel)
        out += [(*heuristic, Opt(VECTOR, 0, w)) for w in widths
                if _fits(k, (*heuristic, Opt(VECTOR, 0, w if w > 1 else default)))]
    if dl is None or not dl.global_ids:
        return list(dict.fromkeys(out))
    if GROUP in actions and flat and (thorough or not tiled):
        out += [(Opt(GROUP, 0, g),) for g in (THOROUGH_GROUP if thorough else QUICK_GROUP) if group_fits(g, dl)]
    if LOCAL in actions and (not reduces or k.global_size >= 1024 or tiled):
        sizes = [n for n in (THOROUGH_LOCAL if thorough else QUICK_LOCAL) if not dl.warp or n % dl.warp == 0]
        for opts in ([heuristic] + tiles if thorough else [heuristic]):
            points = max(k.global_size // _numel([o.amount for o in opts if o.kind == UPCAST]), 1)
            out += [(*opts, Opt(LOCAL, 0, n)) for n in sizes if n <= points]
    return list(dict.fromkeys(out))


def _fits(k: Kernel, opts: Opts) -> bool:
    try:
        apply(k, opts)
    except OptError:
        return False
    return True


def _gpu_product(k: Kernel, dl: Dialect) -> gemm.Gemm | None:
    """The product `k` computes where a GPU dialect's tiled template (templates.gemm: CUDA, Vulkan) takes it."""
    return gemm.match(k, dl.products, dl.tensor_cores) if dl.products in (WARP_TILES, SHADER_TILES) else None


def _tile_variants(g: gemm.Gemm) -> list[Opts]:
    """BLOCK actions for each block tile of `g`'s table whose kernel differs from the heuristic's and from earlier
    rows'."""
    seen = {gemm.tile_config(replace(g, variant=0))}
    out: list[Opts] = []
    for v in range(1, gemm.tile_variants(g) + 1):
        cfg = gemm.tile_config(replace(g, variant=v))
        if cfg not in seen:
            seen.add(cfg)
            out.append((Opt(BLOCK, 0, v),))
    return out


def _numel(sizes: list[int]) -> int:
    out = 1
    for s in sizes:
        out *= s
    return out


def _tiles(k: Kernel, thorough: bool, swap: bool, quick: tuple[tuple[int, int], ...] = QUICK_TILES) -> list[Opts]:
    sizes = [g.vmax + 1 for g in k.gvars]
    pairs = [(a, b) for a in ROW_TILES for b in COL_TILES] if thorough else list(quick)
    out: list[Opts] = []
    for ta, tb in pairs:
        if len(sizes) == 1:  # one loop: a tile of outputs along it (column_tile's shape)
            if ta == 1 and tb > 1 and sizes[0] % tb == 0 and sizes[0] >= 2 * tb:
                out.append((Opt(UPCAST, 0, tb),))
            continue
        a, b = sizes[-2], sizes[-1]
        if a % ta or b % tb or (ta, tb) == (1, 1):
            continue
        opts = tuple(Opt(UPCAST, i, t) for i, t in ((len(sizes) - 2, ta), (len(sizes) - 1, tb)) if t > 1)
        out.append(opts + (Opt(SWAP),) if swap else opts)
        if thorough and swap:
            out.append(opts)
    return out


def heuristic(tile: tuple[int, int] | None, n_loops: int) -> Opts:
    """The scheduler's register tile (rows, columns of the last two global loops) as actions."""
    if tile is None:
        return ()
    if n_loops == 1:
        return (Opt(UPCAST, 0, tile[1]),) if tile[1] > 1 else ()
    ups = tuple(Opt(UPCAST, n_loops - 2 + j, t) for j, t in enumerate(tile) if t > 1)
    return ups + (Opt(SWAP),)


# ------------------------------------------------------------------------------------------------ split reductions
ROWS, COLUMNS = "rows", "columns"
QUICK_ROW_PARTS, THOROUGH_ROW_PARTS = (256, 2048), (128, 256, 512, 1024, 2048, 4096)
QUICK_COLUMN_PARTS, THOROUGH_COLUMN_PARTS = (16, 64), (4, 8, 16, 32, 64, 128)


@dataclass(frozen=True)
class SplitSite:
    """A reduction that the planner may split into two stages (schedule.Planner.split_parts): `ROWS`, few outputs of
    many elements each (a whole-tensor sum, row sums of a few long rows: parts of each output's elements first), or
    `COLUMNS`, many outputs read along them (column sums: partial rows first); its op, dtype, outputs and elements
    reduced into each, and the planner's own parts (0: none)."""

    kind: str
    op: str
    dtype: str
    outputs: int
    r: int
    heuristic: int

    @property
    def key(self) -> str:
        """What the winner is cached under (with the device's identity: the file's)."""
        return f"split:{self.kind}:{self.op}:{self.dtype}:{self.outputs}x{self.r}"

    def fits(self, parts: int) -> bool:
        """Whether `parts` is a split of this reduce: 0 (none), or a divisor of its elements, of two or more each."""
        return parts == 0 or (2 <= parts <= self.r // 2 and self.r % parts == 0)


def split_candidates(site: SplitSite, level: str) -> list[int]:
    """The parts to time for `site` after its heuristic's: no split, then the largest divisor of its elements (16 or
    more parts for rows, 2 or more for columns) up to each target (quick: two of them)."""
    thorough = level == "thorough"
    if site.kind == ROWS:
        targets, least = (THOROUGH_ROW_PARTS if thorough else QUICK_ROW_PARTS), 16
    else:
        targets, least = (THOROUGH_COLUMN_PARTS if thorough else QUICK_COLUMN_PARTS), 2
    out = [0]
    for t in targets:
        d = next((d for d in range(min(t, site.r // 2), least - 1, -1) if site.r % d == 0), None)
        if d is not None:
            out.append(d)
    return [p for p in dict.fromkeys(out) if p != site.heuristic and site.fits(p)]


# ------------------------------------------------------------------------------------------------ disk cache
def encode(opts: Opts) -> list[list[Any]]:
    return [[o.kind, o.axis, o.amount] for o in opts]


def decode(data: Any) -> Opts:
    """Actions from their JSON form; OptError where it is not a list of [kind, axis, amount]."""
    if not isinstance(data, list):
        raise OptError(f"not a list of actions: {data!r}")
    out = []
    for item in data:
        if not (isinstance(item, list) and len(item) == 3 and item[0] in KINDS and
                all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in item[1:])):
            raise OptError(f"not an action: {item!r}")
        out.append(Opt(item[0], item[1], item[2]))
    return tuple(out)


def cache_root() -> Path:
    """Where the winner caches of every device identity live."""
    return cache_dir() / "search"


class WinnerCache:
    """The winning actions per kernel structure for one device identity, in one JSON file under the azyx cache
    (`search/<hash of identity and version>.json`): read once, written whole and atomically (a temporary file, then
    a rename) after each search. A file that is unreadable, of another format, version or identity is ignored (a
    debug line says why) and replaced by the next write."""

    def __init__(self, identity: dict[str, Any]):
        self.identity = {**identity, "azyx": VERSION}
        blob = json.dumps(self.identity, sort_keys=True)
        self.path = cache_root() / f"{hashlib.sha256(blob.encode()).hexdigest()[:24]}.json"
        self.lock = threading.Lock()
        self.entries: dict[str, Any] | None = None  # kernel key -> JSON actions, read lazily

    def _load(self) -> dict[str, Any]:
        if self.entries is not None:
            return self.entries
        entries: dict[str, Any] = {}
        try:
            data = json.loads(self.path.read_text())
            if not isinstance(data, dict) or data.get("format") != FORMAT or data.get("identity") != self.identity \
                    or not isinstance(data.get("winners"), dict):
                debug.log(debug.SEARCH, f"search cache {self.path} is stale or of another format: ignored")
            else:
                entries = data["winners"]
        except FileNotFoundError:
            pass
        except (OSError, ValueError) as e:
            debug.log(debug.SEARCH, f"search cache {self.path} is unreadable ({e}): ignored")
        self.entries = entries
        return entries

    def __len__(self) -> int:
        return len(self._load())

    def get(self, key: str) -> Opts | None:
        """The cached actions for kernel `key`, or None (no entry, or a corrupt one: a debug line, never trusted)."""
        raw = self._load().get(key)
        if raw is None:
            return None
        try:
            return decode(raw.get("opts") if isinstance(raw, dict) else raw)
        except OptError as e:
            debug.log(debug.SEARCH, f"search cache entry {key} is corrupt ({e}): ignored")
            return None

    def put(self, key: str, opts: Opts, info: dict[str, Any]) -> None:
        with self.lock:
            entries = dict(self._load())
            try:  # entries other processes wrote meanwhile are kept
                data = json.loads(self.path.read_text())
                if isinstance(data, dict) and data.get("format") == FORMAT and data.get("identity") == self.identity:
                    entries = {**data.get("winners", {}), **entries}
            except (OSError, ValueError):
                pass
            entries[key] = {"opts": encode(opts), **info}
            self.entries = entries
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
            try:
                tmp.write_text(json.dumps({"format": FORMAT, "identity": self.identity, "winners": entries},
                                          indent=1, sort_keys=True))
                os.replace(tmp, self.path)
            finally:
                tmp.unlink(missing_ok=True)
