"""A matmul kernel with shared-memory and register tiling, for GPU dialects that declare one (CUDA, Vulkan's GLSL).

`match` recognises a kernel of the IR that is a (batched) matrix product, `C[b, i, j] = sum_r A[..] * B[..]` with
affine, unmasked loads and a contiguous output, whatever the operands' strides (a transposed operand is read
where it lies). `render_cuda` (and `render_glsl`, the same scheme as a Vulkan compute shader) fills a classic tiled
kernel for it: a block computes a BM x BN tile of C, stepping over K in slices of BK that the block stages in shared
memory (the next slice is fetched into registers while the current one is multiplied); each thread accumulates a
TM x TN register tile (on CUDA a warp owns a sub-tile of the block's, SimtTile). Loads are 16 bytes wide where an
operand's contiguous axis allows it. Anything else renders through the generic C-family path.

A product of few rows against one weight (a linear layer at decode, 17-64 rows) whose tiles would leave most of a CUDA
device idle is split over K by the planner (`split_k` decides the parts from the shape and the device's
multiprocessors; schedule.Planner.split_product): each part a batch element of this kernel writing float32 partial
sums (16-bit operands on tensor cores: `Gemm.out`), which the product's consumer adds up with its epilogue.

The block tile is a heuristic's (`Gemm.tile`, variant 0); the kernel search tries the other rows of the target's table
(`tile_variants`: CUDA's SimtTiles, the tensor-core tiles, Vulkan's tiles), which search_actions.BLOCK selects through
`Kernel.variant` (v: row v - 1), as it selects the host template's block sizes.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from azyx.codegen.dialect import BLOCKED, SHADER_TILES, WARP_TILES
from azyx.dtypes import DType, dtypes
from azyx.ir import Kernel, V
from azyx.symbolic import Lin, Var

THREADS = 256
BK = 8
MMA_BK = 32  # the tensor-core kernel's K slice
MMA_STAGES = 3  # K slices in shared memory: one multiplied while the next two are copied
# a product of few rows (decode's linear layers, SPLIT_ROWS or fewer) is a stream of its weight: its blocks, about one a
# multiprocessor, keep as many slices in flight as the shared memory a kernel may declare holds (MMA_SHARED bytes)
MMA_DEEP_STAGES = 8
MMA_SHARED = 48 << 10
# block tile -> warps along M x N (a warp: 64 x 32, 32 x 32, 32 x 16)
MMA_WARPS = {(128, 128): (2, 4), (64, 64): (2, 2), (32, 64): (1, 4)}


@dataclass(frozen=True)
class Gemm:
    m: int
    n: int
    k: int
    batch: int
    a: tuple[int, int, int, int, int]  # parameter, offset, stride along b, along i, along r
    b: tuple[int, int, int, int, int]  # parameter, offset, stride along b, along r, along j
    # the template family (codegen.dialect.PRODUCT_FAMILIES): WARP_TILES (CUDA), SHADER_TILES (Vulkan: no float atomics
    # to split K with), BLOCKED (host: gemm_host) or ITEM_TILES (OpenCL on a CPU: gemm_host.render_cl)
    target: str = WARP_TILES
    dtype: str = "float32"  # float16 / bfloat16: the tensor-core kernel (render_mma), C in that dtype; host: packed
    simd: int = 32  # host: vector register width in bytes (the micro-kernel's shape: gemm_host.HOST_BLOCKS)
    workers: int = 1  # host: threads that share the kernel's blocks
    variant: int = 0  # which block sizes (host) or block tile (GPU: tile_variants) (Kernel.variant, set by search)
    bf16_dot: bool = False  # host: bfloat16 packed in pairs along K, for AVX-512 BF16 (gemm_host.render_c)
    # C's dtype where it is not the operands': float32, the partial sums of a float16/bfloat16 product split over K
    # (split_k: each part a batch element, its operands cast to float32 in the IR; render_mma stores them unrounded)
    out: str = ""

    @property
    def c_dtype(self) -> str:
        return self.out or self.dtype

    @property
    def mma(self) -> bool:
        return self.dtype != "float32" and self.target == WARP_TILES

    @property
    def stages(self) -> int:
        """The tensor-core kernel's K slices in shared memory: MMA_STAGES, or for a product of SPLIT_ROWS rows or fewer
        as many as MMA_SHARED holds (up to MMA_DEEP_STAGES)."""
        if self.m > SPLIT_ROWS:
            return MMA_STAGES
        bm, bn = self.tile
        return max(MMA_STAGES, min(MMA_DEEP_STAGES, MMA_SHARED // ((bm + bn) * MMA_BK * 2)))

    @property
    def threads(self) -> int:
        if self.mma:
            return MMA_WARPS[self.tile][0] * MMA_WARPS[self.tile][1] * 32
        return self.simt.threads if self.target == WARP_TILES else THREADS

    @property
    def simt(self) -> SimtTile:
        """The float32 CUDA kernel's shape (render_simt): its tile's, with slices of 8 k where a 128-row tile's
        operands both run along k (both transposed as they are stored: more registers held across the slice; H200
        1024^3 x @ W.T in 128 x 64 tiles 0.83x cuBLAS at 16, 0.88x at 8; x @ y 1.14x at 16, 1.01x at 8); a searched
        variant's row of CUDA_VARIANTS as it is."""
        if self.variant and not self.mma and self.target == WARP_TILES:
            return CUDA_VARIANTS[(self.variant - 1) % len(CUDA_VARIANTS)]
        c = CUDA_TILES[self.tile]
        return replace(c, bk=8) if self.a[4] == 1 and self.b[3] == 1 and c.bm == 128 else c

    @property
    def tile(self) -> tuple[int, int]:
        """Rows x columns of C per block: 128 x 128 where that makes a block per multiprocessor or more, else
        128 x 64 where that makes half as many, else 64 x 64 (measured on the H200 with 8 products in flight:
        1024^3 at 128 x 64 21 TFLOP/s against 14 at 128 x 128 with K split in 4; 2048^3 at 128 x 128 31 against 27;
        the kernel of 4 warps (SimtTile) alone, x @ y 1024^3: 128 x 64 32 TFLOP/s, 128 x 128 21 (K split in 2: 30),
        64 x 64 28; cuBLAS 28).
        Tensor cores: 128 x 128 where that makes a block per multiprocessor or more, else 64 x 64. 64 rows or fewer
        (decode's linear layers; split over K where the tiles are few: split_k): 64 x 64, on tensor cores 32 x 64 for
        32 rows or fewer (every warp's rows real: H200, 32 x 768 @ 768 x 3072 bf16 3.8 us against 4.4).
        A searched variant (Kernel.variant > 0): that row of the target's table (tile_variants)."""
        if self.variant and self.target in (WARP_TILES, SHADER_TILES):
            if self.target == WARP_TILES and not self.mma:
                c = CUDA_VARIANTS[(self.variant - 1) % len(CUDA_VARIANTS)]
                return c.bm, c.bn
            table = MMA_TILES if self.mma else GLSL_TILES
            return table[(self.variant - 1) % len(table)]
        if self.m <= 64 and self.target == WARP_TILES:  # (a 128-row tile of so few rows would be mostly zeros)
            return few_rows_tile(self.m, self.n, self.mma)
        if self.mma:
            return (128, 128) if -(-self.m // 128) * -(-self.n // 128) * self.batch >= 128 else (64, 64)
        tiles = ((128, 128, 128), (128, 64, 64)) if self.target == WARP_TILES else ((128, 64, 64),)
        for bm, bn, least in tiles:  # (NVIDIA's Vulkan: 128 x 128 ran 2.0 TFLOP/s at 4096^3, 128 x 64 7.0 at 1024^3)
            if -(-self.m // bm) * -(-self.n // bn) * self.batch >= least:
                return bm, bn
        return 64, 64

    @property
    def split(self) -> tuple[int, int]:
        """(parts, slice) of K: where even 64 x 64 tiles leave most multiprocessors idle, each part of K gets its own
        blocks and adds its partial tile into C atomically (C is zeroed first); a part is a whole number of BK-slices,
        at least 4. (Splitting where the tiles alone fill the GPU measured slower: the atomics and the zeroing.)"""
        bm, bn = self.tile
        tiles = -(-self.m // bm) * -(-self.n // bn) * self.batch
        bk = self.simt.bk if self.target == WARP_TILES and not self.mma else BK
        # (tensor cores: C is 16-bit, no atomics; a product of few rows against one weight is split by the planner
        # instead, split_k, whose parts make tiles enough here)
        if tiles >= 64 or self.target != WARP_TILES or self.mma:
            parts = 1
        else:
            parts = max(1, min(8, 128 // tiles, self.k // (4 * bk)))
        per = -(-self.k // parts)
        chunk = -(-per // bk) * bk
        return -(-self.k // chunk), chunk

    def grid(self) -> tuple[int, int, int]:
        bm, bn = self.tile
        return -(-self.n // bn), -(-self.m // bm), self.batch * self.split[0]


SPLIT_SLICES = 4  # K slices (of the kernel's BK) a part of a product split over K holds at least
# the most rows a product split over K has: one 64-row tile (Gemm.tile's for so few rows, which the tensor-core kernel
# renders with float32 partials; a larger product on compute capability 9.0 takes gemm_sm90's wgmma kernel, which
# stores C in the operands' dtype)
SPLIT_ROWS = 64


# a float32 product of 32 rows or fewer whose 32 x 64 tiles along N number this many or more keeps them (the LM
# head's 786); narrower ones take 32 x 128 tiles (CUDA_TILES' figures)
WIDE = 256


def few_rows_tile(m: int, n: int, mma: bool) -> tuple[int, int]:
    """Gemm.tile's block tile for a CUDA product of 64 rows or fewer: 64 x 64, or for 32 rows or fewer 32-row tiles
    (no lane computes rows of zeros): 32 x 64 on tensor cores and for a wide product in float32, else 32 x 128."""
    if m > 32:
        return 64, 64
    return (32, 64) if mma or -(-n // 64) >= WIDE else (32, 128)


def split_k(m: int, n: int, k: int, dtype: str, sms: int) -> int:
    """The parts (1: none) that a product of `m` rows against one `k` x `n` weight (a linear layer at decode: 17 to
    SPLIT_ROWS rows) splits K into on a CUDA device of `sms` multiprocessors, each part its own blocks writing its
    float32 partial sums, which the product's consumer adds up (schedule.Planner.product_split; float16/bfloat16 C
    is rounded once, after the sum). Where C's tiles (few_rows_tile's) fill fewer than half the multiprocessors (32 x
    768 @ 768 x 768: 12 blocks, each walking all of K, on an H200's 132), as many parts as bring the blocks up to
    about one per multiprocessor: the largest divisor of K up to that whose parts hold SPLIT_SLICES slices of the
    kernel's K step or more, and stay multiples of 8 elements where K is (16-byte loads of each part, as of the
    whole)."""
    bm, bn = few_rows_tile(m, n, dtype != "float32")  # (Gemm.tile's for so few rows, each part a batch element)
    tiles = -(-m // bm) * -(-n // bn)
    if sms <= 0 or m > SPLIT_ROWS or 2 * tiles > sms:
        return 1
    step = MMA_BK if dtype != "float32" else CUDA_TILES[(bm, bn)].bk
    most = min(-(-sms // tiles), k // (SPLIT_SLICES * step))
    return next((d for d in range(most, 1, -1) if k % d == 0 and (k % 8 or k // d % 8 == 0)), 1)


def _affine(x: Lin, allowed: dict[Var, str]) -> dict[str, int] | None:
    out = {"off": x.const}
    for a, c in x.terms.items():
        if not isinstance(a, Var) or a not in allowed:
            return None
        out[allowed[a]] = c
    return out


def _operand(v: V, dt: DType) -> V | None:
    return v if v.op == "load" and v.dtype is dt and v.arg[2].always else None


def _widened(v: V) -> V | None:
    """The float16/bfloat16 load that `v` casts to float32 (a product split over K: split_k), else None."""
    if v.op != "cast" or v.dtype is not dtypes.float32:
        return None
    return _operand(v.src[0], v.src[0].dtype) if v.src[0].dtype in (dtypes.float16, dtypes.bfloat16) else None


def product_dtypes(target: str, tensor_cores: bool = False) -> tuple[DType, ...]:
    """The dtypes of the products `target`'s kernel computes: float32; float16 and bfloat16 too on tensor cores (CUDA,
    sm_80 on: accumulated in float32, C rounded once, like cuBLAS) and on the host (widened to float32 as packed)."""
    if target == BLOCKED or (tensor_cores and target == WARP_TILES):
        return dtypes.float32, dtypes.float16, dtypes.bfloat16
    return (dtypes.float32,)


def match(k: Kernel, target: str = WARP_TILES, tensor_cores: bool = False, simd: int = 32, workers: int = 1
          ) -> Gemm | None:
    """The product `k` computes, or None (dtypes: product_dtypes). `simd` and `workers`: the host's (target BLOCKED)."""
    if len(k.stores) != 1:
        return None
    out_idx, r = k.stores[0]
    dt = r.dtype
    if dt not in product_dtypes(target, tensor_cores):
        return None
    if r.op != "reduce" or r.arg[0] != "sum" or k.uvars or len(r.arg[1]) != 1 or len(k.gvars) < 2:
        return None
    body = r.src[0]
    if body.op != "alu" or body.arg != "mul":
        return None
    x, y = (_operand(s, dt) for s in body.src)
    wide = ""  # C's dtype where it is not the operands'
    if (x is None or y is None) and dt is dtypes.float32 and target == WARP_TILES and tensor_cores:
        # float16/bfloat16 operands widened to float32: tensor cores, C (partial sums) in float32
        x, y = (_widened(s) for s in body.src)
        wide = "float32"
        if x is not None and y is not None and x.dtype is y.dtype:
            dt = x.dtype
    if x is None or y is None or any(p is not dt for p in k.params[1:]) or k.params[0].name != (wide or dt.name):
        return None
    rv = r.arg[1][0]
    *gbs, gi, gj = k.gvars
    names = {gi: "i", gj: "j", rv: "r", **{g: f"b{d}" for d, g in enumerate(gbs)}}
    fx, fy = _affine(x.arg[1], names), _affine(y.arg[1], names)
    if fx is None or fy is None:
        return None
    if "j" in fx or "i" in fy:  # x must be the left operand: swap when written the other way round
        x, y, fx, fy = y, x, fy, fx
    if "j" in fx or "i" in fy or "r" not in fx or "r" not in fy:
        return None
    m, n, kk = gi.vmax + 1, gj.vmax + 1, rv.vmax + 1
    out = _affine(out_idx, names)
    if out is None or out.get("off") != 0 or out.get("i") != n or out.get("j") != 1:
        return None
    strides = _batch_strides([g.vmax + 1 for g in gbs], [f"b{d}" for d in range(len(gbs))], fx, fy, out)
    if strides is None:
        return None
    batch, (xb, yb, ob) = strides
    if batch > 1 and ob != m * n:
        return None
    if batch > 1 and yb == 0 and fx.get("i", 0) != 0 and xb == m * fx["i"]:
        # `x @ W.T` over a (B, T, C) activation: the batch's rows are one M of B*T rows against one weight, packed
        # and tiled once instead of once per batch element
        m, batch, xb = m * batch, 1, 0
    return Gemm(m, n, kk, batch,
                (x.arg[0], fx["off"], xb, fx.get("i", 0), fx["r"]),
                (y.arg[0], fy["off"], yb, fy["r"], fy.get("j", 0)), target, dt.name, simd, workers, k.variant,
                out=wide)


def _batch_strides(sizes: list[int], names: list[str], *maps: dict[str, int]) -> tuple[int, tuple[int, ...]] | None:
    """The batch of a product with several batch axes (heads within sequences: (B, H, T, D) @ (B, H, D, S)) as one
    axis, when they merge: in each operand and the output an outer axis's stride is the next inner one's times that
    one's size (a broadcast operand's are all 0). (batch, each map's stride along it), or None."""
    batch, strides = 1, tuple(0 for _ in maps)
    for size, name in zip(reversed(sizes), reversed(names)):
        coefs = tuple(mp.get(name, 0) for mp in maps)
        if batch == 1:
            strides = coefs
        elif coefs != tuple(st * batch for st in strides):
            return None
        batch *= size
    return batch, strides


@dataclass(frozen=True)
class SimtTile:
    """The shape of the float32 CUDA kernel (render_cuda) for one block tile: `wm` x `wn` warps share the block's
    `bm` x `bn` tile of C, a warp's lanes `lm` x (32 / `lm`) (along M x N) its warp tile, each lane a `tm` x `tn`
    register tile made of 4 x 4 sub-blocks (runs of 4 rows / columns, a run per 4 * lanes), so that the lanes of a
    warp read consecutive 16-byte vectors of shared memory (no bank conflicts) and reuse each in 4 products. K steps
    by slices of `bk` through two shared-memory buffers."""
    bm: int
    bn: int
    wm: int
    wn: int
    lm: int = 8
    bk: int = 16

    @property
    def threads(self) -> int:
        return 32 * self.wm * self.wn

    @property
    def tm(self) -> int:
        return self.bm // self.wm // self.lm

    @property
    def tn(self) -> int:
        return self.bn // self.wn // (32 // self.lm)


# 4 warps a block; in 128 x 128 tiles a warp per 64 x 64, 16 x 8 a lane (128 accumulators, as cuBLAS's SIMT kernels).
# H200, kernel alone against cuBLAS, 4096^3 x @ y / x @ W.T: 8 x 16 a lane 0.87x / 0.91x (16 k a slice: 0.91x /
# 0.67x), 16 x 8 0.96x / 0.95x (16 k: 0.94x / 0.76x); 256 threads of 8 x 8 0.78-0.91x; 2048^3 16 x 8 0.96-1.08x
# 32 rows or fewer (decode's linear layers at batch 17-32): 32-row tiles, every lane's rows real (a 64 x 64 tile
# computes as many rows of zeros): H200, float32 C's kernel time, 64 x 64 / 32 x 64 (2 warps) / 32 x 128 (4 warps):
# 32 x 768 @ 768 x 3072 + b 26.0 / 20.8 / 16.1 us, 32 x 3072 @ 3072 x 768 28.0 / 27.4 / 16.7, 32 x 768 @ 768 x 50257
# (786 tiles of 32 x 64, few_rows_tile's WIDE) 187 / 98.9 / 105.9; torch (TF32 off) 19.9, 26.4, 84.6
CUDA_TILES = {(128, 128): SimtTile(128, 128, 2, 2, lm=4, bk=8), (128, 64): SimtTile(128, 64, 2, 2),
              (64, 64): SimtTile(64, 64, 2, 2), (32, 64): SimtTile(32, 64, 1, 2), (32, 128): SimtTile(32, 128, 1, 4)}
# the block tiles the kernel search tries (Kernel.variant v > 0: row v - 1): CUDA's float32 kernel (the heuristic's
# three, 128 x 64 in slices of 8 k, and 64 x 128), the tensor-core kernel's, Vulkan's (256 threads, 16 x 16)
CUDA_VARIANTS = (SimtTile(128, 128, 2, 2, lm=4, bk=8), SimtTile(128, 64, 2, 2), SimtTile(64, 64, 2, 2),
                 SimtTile(128, 64, 2, 2, bk=8), SimtTile(64, 128, 2, 2), SimtTile(32, 64, 1, 2),
                 SimtTile(32, 128, 1, 4))
MMA_TILES = ((128, 128), (64, 64), (32, 64))  # (32 x 64: half a 64 x 64 tile's rows, for products of 32 rows or fewer)
GLSL_TILES = ((128, 64), (64, 64), (128, 128), (64, 128))


def tile_variants(g: Gemm) -> int:
    """How many block tiles the search may try for `g` (Kernel.variant 1 .. this; 0: the heuristic's), 0 where the
    target has no table (the host templates choose their block sizes by gemm_host.variants)."""
    if g.target == WARP_TILES:
        return len(MMA_TILES) if g.mma else len(CUDA_VARIANTS)
    return len(GLSL_TILES) if g.target == SHADER_TILES else 0


def tile_config(g: Gemm) -> tuple[object, ...]:
    """What `g`'s kernel's shape depends on (its tile, the float32 kernel's SimtTile, K's split; a tensor-core product
    of variant 0 may take gemm_sm90's kernel instead): variants of one configuration render the same kernel."""
    return (g.tile, g.simt if g.target == WARP_TILES and not g.mma else None, g.split, g.mma and not g.variant)


def slot_heads(vec: int, elems: int, t: int, ax: str, along_k: bool, int_t: str, threads: int = THREADS,
                bk: int = BK, pairs: bool = False) -> list[str]:
    """The opening of each of a thread's loads of a tile slice (`elems` loads, `threads` at a time): its guard
    where the last round is partial, then its element `e`, and `ax` and `kk`, the element's position in the slice.
    `pairs`: a slice of more than two 4-vectors along k is read two vectors (32 bytes) a row at a time."""
    per = bk // vec if along_k else t // vec
    pos = (f"{int_t} {ax} = e / {per}, kk = (e % {per}) * {vec};" if along_k else
           f"{int_t} kk = e / {per}, {ax} = (e % {per}) * {vec};")
    if pairs and along_k and vec == 4 and per > 2:
        # 16 rows x 2 vectors of k a warp: its transposing stores (4 rows of the slice, 16 + 16 columns) fall in
        # distinct banks, where 8 rows x 4 vectors put two lanes on each bank
        pos = f"{int_t} {ax} = (e / 2) % {t}, kk = ((e / {2 * t}) * 2 + e % 2) * {vec};"
    heads = []
    for s in range(-(-elems // threads)):
        guard = f"if (tid + {s * threads} < {elems}) " if (s + 1) * threads > elems else ""
        heads.append(f"{guard}{{ {int_t} e = tid + {s * threads}; {pos} ")
    return heads


# ------------------------------------------------------------------------------------------------ tensor cores
# PTX through inline asm: NVRTC needs no header for it. Guarded, so several products in one module define them once
# (the attention kernel on tensor cores uses them too).
