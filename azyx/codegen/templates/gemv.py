"""Small-M matrix products (decode's linear layers: a few rows of activation against a weight read once), with the
prologue and epilogue the scheduler fused into them, for GPU-style dialects that take it (Dialect.small_products).

`match` recognises a kernel of the IR that stores, for M <= GEMV_ROWS rows (the global loops but the last, flattened)
and N columns (the last global loop), `epilogue(sum_r A(i, r) * W(r, j))`: W an unmasked affine load of one parameter
contiguous along K (`x @ W.T` with W stored (N, K): nn.Linear, a tied head) or along N (`x @ W` with W stored (K, N):
GPT-2's Conv1D); A any expression of the row and r that does not move with j (the prologue: a layernorm, its row
statistics reduces of their own); the epilogue any expression of the sum and of loads at (i, j) (bias, GELU, a
residual). codegen.cgemv renders it: the block stages A for a chunk of K in shared memory (each element computed once
per block, the row statistics by the whole block first), then streams its slab of W's columns through wide loads along
W's contiguous axis, the M rows reusing every load, and accumulates in float32 whatever the dtype.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from azyx.dtypes import DType
from azyx.ir import Kernel, V, toposort
from azyx.symbolic import Lin, Var

GEMV_ROWS = 16  # rows (M) up to which a product is this kernel's (the tiled templates take more)
SPREAD_BLOCKS = 256  # a product whose slabs of columns make fewer blocks than this splits its rows over more blocks
THREADS = 256  # items a block (x @ W with few slabs of columns: up to MAX_THREADS)
MAX_THREADS = 1024
FEW_BLOCKS = 128  # x @ W in fewer blocks of THREADS than this (N = 768): more items a block, more loads in flight
ITEMS = 1 << 17  # x @ W: items its blocks hold together, at most, where `threads` adds items for a long K
WIDE_BLOCKS = 256  # x @ W.T: blocks of two columns a warp at least, for a warp to own two at one row
MIN_STEPS = 8  # rows of K an item reads, at least, when ITEMS adds items to a block
RED_BYTES = 16384  # x @ W: shared memory for the warps' partial sums (M x the slab's columns each)
WARP = 32
WARPS = THREADS // WARP
LOAD_BYTES = 16  # bytes per weight load: 4 float32, 8 float16 / bfloat16
MAX_ACC = 64  # float32 accumulators per item (M x columns) beyond which x @ W's loads narrow
ROW_BYTES = 64  # contiguous bytes of a weight row a block reads per row along N (x @ W)
STAGE_FLOATS = 4096  # one row's staged chunk of A: KC float32 in shared memory (16 KiB)
HALF_STAGE_FLOATS = 8192  # the same for a half-precision weight (32 KiB): see Gemv.chunk
SHARED_FLOATS = 8192  # rows' staged chunk, partial sums and statistics: float32 in a block's shared memory (32 KiB)
ROW_FLOATS = 256  # of SHARED_FLOATS, kept for the rows' statistics


@dataclass(frozen=True)
class Gemv:
    """One small-M product: `m` rows (`rows`: their loops, outer first), `n` columns (loop `col`), `k` summed (the
    product's loop `rv`); `product` its sum, `a` the activation's value (the prologue), `w` the weight's load at
    `w_off + r * w_sk + j * w_sj`; `along_k`: W is contiguous along K, else along N. A block computes `mb` of the
    rows (`spread`) for its slab of columns: the geometry below is a block's."""

    m: int
    n: int
    k: int
    rows: tuple[Var, ...]
    col: Var
    rv: Var
    product: V
    a: V
    w: V
    w_off: int
    w_sk: int
    w_sj: int
    along_k: bool
    dtype: DType  # the weight's
    mb: int = 0  # rows a block computes: set by `spread` (every product `match` makes is spread)

    def spread(self) -> Gemv:
        """This product with its rows split over blocks where its slabs of columns alone make fewer than
        SPREAD_BLOCKS (M = 16 rows of `x @ W` with N = 768: 24 slabs, each streaming K x 32 of the weight for all
        rows): groups of rows, each block of a group reading its slab again (from L2: the weight is read from memory
        about once), so that the product runs on about SPREAD_BLOCKS blocks. One row: unchanged."""
        whole = replace(self, mb=self.m)
        groups = min(self.m, -(-SPREAD_BLOCKS // whole.slabs))
        return replace(self, mb=-(-self.m // groups))

    @property
    def slabs(self) -> int:
        """Slabs of `block_cols` columns."""
        return -(-self.n // self.block_cols)

    @property
    def groups(self) -> int:
        """Groups of `mb` rows (the last one may hold fewer: `ragged`)."""
        return -(-self.m // self.mb)

    @property
    def ragged(self) -> bool:
        """Whether the last group of rows holds fewer than `mb`."""
        return self.m % self.mb != 0

    @property
    def vec(self) -> int:
        """Weight elements per load: 16 bytes where the layout keeps every vector whole and aligned, else 1."""
        v = LOAD_BYTES // self.dtype.itemsize
        if not self.along_k and self.mb * v > MAX_ACC:  # (a half weight's 8 columns x 16 rows: 8-byte loads)
            v //= 2
        if self.along_k:
            ok = self.k % v == 0 and self.w_sj % v == 0 and self.w_off % v == 0
        else:
            ok = self.n % v == 0 and self.w_sk % v == 0 and self.w_off % v == 0
        return v if ok else 1

    @property
    def cols_per_warp(self) -> int:
        """x @ W.T: columns each warp owns (its lanes split K), more where rows are many (each staged element of A
        read from shared memory then serves that many weight loads) or columns are (the blocks still many: each
        warp keeps twice the loads in flight; 8192 x 8192 on an H200: float32 3,120 -> 3,932 GB/s, bfloat16 3,040
        -> 3,548)."""
        return 2 if self.mb > 2 or self.n >= 2 * WARPS * WIDE_BLOCKS else 1

    @property
    def lanes_along_n(self) -> int:
        """x @ W: threads that read one weight row's run of the block's columns (ROW_BYTES contiguous)."""
        return min(WARP, max(1, ROW_BYTES // (self.vec * self.dtype.itemsize)))

    @property
    def block_cols(self) -> int:
        """Columns of C per block."""
        return WARPS * self.cols_per_warp if self.along_k else self.lanes_along_n * self.vec

    @property
    def chunk(self) -> int:
        """KC: elements of K staged per round (a multiple of 8: float4 reads of a staged row stay aligned): one row,
        STAGE_FLOATS; several, what SHARED_FLOATS leaves beside the partial sums, so that a decode layer's K is one
        chunk whose weight loads are issued before the prologue (16 x 768 @ 768 x 3072 on an H200: float32 10.6 ->
        7.5 us, bfloat16 11.4 -> 9.4; one row of float32 8192 x 8192 staged whole is slower, 3,999 -> 2,407 GB/s,
        not understood). One row against a half-precision weight stages up to HALF_STAGE_FLOATS: a K of 8192 is then
        one chunk with a constant bound (H200, cold L2, 8192 x 8192 x @ W: bfloat16 3,075 -> 3,720 GB/s, float16
        3,128 -> 3,694; 14,336 x 4,096 x @ W.T: bfloat16 2,721 -> 3,288; float32 x @ W fell 3,899 -> 2,398 with it)."""
        whole = -(-self.k // 8) * 8
        one = HALF_STAGE_FLOATS if self.dtype.itemsize == 2 else STAGE_FLOATS
        room = one if self.mb == 1 else SHARED_FLOATS - ROW_FLOATS - self.partials
        return max(8, min(room // self.mb // 8 * 8, whole))

    @property
    def partials(self) -> int:
        """Float32 partial sums the block combines in shared memory (codegen.cgemv's `res`, or `red`: a warp's)."""
        return self.partials_at(self.threads)

    def partials_at(self, threads: int) -> int:
        """`partials` for a block of `threads` items."""
        return self.mb * self.block_cols * (1 if self.along_k else threads // WARP)

    @property
    def threads(self) -> int:
        """Items a block: THREADS; x @ W whose slabs are few (a multiprocessor holds one block of them at most) up to
        MAX_THREADS, so that each has that many more loads in flight; and x @ W of a long K twice as many while
        the blocks then hold at most ITEMS and each item still reads MIN_STEPS rows (a half weight of 8192 x 8192:
        256 slabs of 32 columns, 1,891 -> 3,098 GB/s on an H200; 14,336 x 4,096: 1,685 -> 2,680); within RED_BYTES
        of partial sums."""
        t, blocks = THREADS, self.slabs * self.groups
        if self.along_k:
            return t
        if blocks < FEW_BLOCKS:
            t = MAX_THREADS
        while t < MAX_THREADS and blocks * 2 * t <= ITEMS and 2 * t // self.lanes_along_n * MIN_STEPS <= self.k:
            t *= 2
        while t > THREADS and self.partials_at(t) * 4 > RED_BYTES:
            t //= 2
        return t

    def grid(self, max_groups: int = 0) -> tuple[int, int, int]:
        """Blocks: one per slab of columns and group of rows (the slab the faster); where a dimension holds at most
        `max_groups` (0: no bound), rows of that many (the kernel's group id reads both dimensions; codegen.cgemv
        returns from those past the last)."""
        blocks = self.slabs * self.groups
        if max_groups and blocks > max_groups:
            return max_groups, -(-blocks // max_groups), 1
        return blocks, 1, 1


def above(root: V, stop: V) -> list[V]:
    """The values `root` is computed from without going below `stop` (kept), each after its sources."""
    order = toposort(root)
    reach = {id(root)}
    for v in reversed(order):
        if id(v) in reach and v is not stop:
            reach.update(id(s) for s in v.src)
    return [v for v in order if id(v) in reach]


def _weight(v: V, col: Var, rv: Var) -> tuple[int, int, int] | None:
    """(offset, stride along r, along j) of an unmasked load read along both r and j at an affine index, else None."""
    if v.op != "load" or not v.arg[2].always or not v.dtype.is_float:
        return None
    idx: Lin = v.arg[1]
    if set(idx.terms) != {col, rv}:
        return None
    return idx.const, idx.terms[rv], idx.terms[col]


def match(k: Kernel) -> Gemv | None:
    """The small-M product `k` computes (see the module docstring), or None."""
    if len(k.stores) != 1 or k.uvars or k.scatter is not None or k.inplace or k.check >= 0 or not k.gvars:
        return None
    out_idx, value = k.stores[0]
    order = toposort(value)
    if any(v.op in ("index", "attention") for v in order):
        return None
    col, rows = k.gvars[-1], tuple(k.gvars[:-1])
    products = [v for v in order if v.op == "reduce" and col in v.src[0].vars]
    if len(products) != 1:
        return None
    (p,) = products
    if p.arg[0] != "sum" or len(p.arg[1]) != 1 or p.src[0].op != "alu" or p.src[0].arg != "mul":
        return None
    rv = p.arg[1][0]
    x, y = p.src[0].src
    form = _weight(y, col, rv)
    if form is None:
        x, y, form = y, x, _weight(x, col, rv)
    if form is None or col in x.vars or rv not in x.vars:
        return None
    off, sk, sj = form
    if sk != 1 and sj != 1:
        return None
    # the epilogue reduces nothing of its own; the prologue's reduces (row statistics) do not move with r
    if any(v.op == "reduce" and v is not p for v in above(value, p)):
        return None
    if any(v.op == "reduce" and rv in v.vars for v in toposort(x)):
        return None
    m = 1
    for g in rows:
        m *= g.vmax + 1
    n, kk = col.vmax + 1, rv.vmax + 1
    if m > GEMV_ROWS:
        return None
    want, inner = {col: 1}, n
    for g in reversed(rows):
        want[g] = inner
        inner *= g.vmax + 1
    moving = {a: c for a, c in out_idx.terms.items() if c and (a is col or a.vmax > 0)}
    if out_idx.const != 0 or moving != {g: c for g, c in want.items() if g is col or g.vmax > 0}:
        return None
    return Gemv(m, n, kk, rows, col, rv, p, x, y, off, sk, sj, sk == 1, y.dtype).spread()
