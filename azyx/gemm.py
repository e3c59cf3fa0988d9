"""A matmul kernel with shared-memory and register tiling, for GPU dialects that declare one (CUDA, Vulkan's GLSL).

`match` recognises a kernel of the IR that is a (batched) matrix product, `C[b, i, j] = sum_r A[..] * B[..]` with
affine, unmasked loads and a contiguous output, whatever the operands' strides (a transposed operand is read
where it lies). `render_cuda` (and `render_glsl`, the same scheme as a Vulkan compute shader) fills a classic tiled
kernel for it: a block computes a BM x BN tile of C, stepping over K in slices of BK that the block stages in shared
memory (the next slice is fetched into registers while the current one is multiplied); each thread accumulates a
TM x TN register tile (on CUDA a warp owns a sub-tile of the block's, SimtTile). Loads are 16 bytes wide where an
operand's contiguous axis allows it. Anything else renders through the generic C-family path.

The block tile is a heuristic's (`Gemm.tile`, variant 0); the kernel search tries the other rows of the target's table
(`tile_variants`: CUDA's SimtTiles, the tensor-core tiles, Vulkan's tiles), which optimize.BLOCK selects through
`Kernel.variant` (v: row v - 1), as it selects the host template's block sizes.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from azyx.dtypes import DType, dtypes
from azyx.ir import Kernel, V
from azyx.symbolic import Lin, Var

THREADS = 256
BK = 8
MMA_BK = 32  # the tensor-core kernel's K slice
MMA_STAGES = 3  # K slices in shared memory: one multiplied while the next two are copied
MMA_WARPS = {(128, 128): (2, 4), (64, 64): (2, 2)}  # block tile -> warps along M x N (a warp: 64 x 32 or 32 x 32)


@dataclass(frozen=True)
class Gemm:
    m: int
    n: int
    k: int
    batch: int
    a: tuple[int, int, int, int, int]  # parameter, offset, stride along b, along i, along r
    b: tuple[int, int, int, int, int]  # parameter, offset, stride along b, along r, along j
    target: str = "cuda"  # "cuda", "glsl" (Vulkan: no float atomics to split K with), "c" (host: gemm_host) or "cl"
    # (OpenCL on a CPU: gemm_host.render_cl)
    dtype: str = "float32"  # float16 / bfloat16: the tensor-core kernel (render_mma), C in that dtype; host: packed
    simd: int = 32  # host: vector register width in bytes (the micro-kernel's shape: gemm_host.HOST_BLOCKS)
    workers: int = 1  # host: threads that share the kernel's blocks
    variant: int = 0  # which block sizes (host) or block tile (GPU: tile_variants) (Kernel.variant, set by search)
    bf16_dot: bool = False  # host: bfloat16 packed in pairs along K, for AVX-512 BF16 (gemm_host.render_c)

    @property
    def mma(self) -> bool:
        return self.dtype != "float32" and self.target == "cuda"

    @property
    def threads(self) -> int:
        if self.mma:
            return MMA_WARPS[self.tile][0] * MMA_WARPS[self.tile][1] * 32
        return self.simt.threads if self.target == "cuda" else THREADS

    @property
    def simt(self) -> SimtTile:
        """The float32 CUDA kernel's shape (render_simt): its tile's, with slices of 8 k where a 128-row tile's
        operands both run along k (both transposed as they are stored: more registers held across the slice; H200
        1024^3 x @ W.T in 128 x 64 tiles 0.83x cuBLAS at 16, 0.88x at 8; x @ y 1.14x at 16, 1.01x at 8); a searched
        variant's row of CUDA_VARIANTS as it is."""
        if self.variant and not self.mma and self.target == "cuda":
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
        Tensor cores: 128 x 128 where that makes a block per multiprocessor or more, else 64 x 64.
        A searched variant (Kernel.variant > 0): that row of the target's table (tile_variants)."""
        if self.variant and self.target in ("cuda", "glsl"):
            if self.target == "cuda" and not self.mma:
                c = CUDA_VARIANTS[(self.variant - 1) % len(CUDA_VARIANTS)]
                return c.bm, c.bn
            table = MMA_TILES if self.mma else GLSL_TILES
            return table[(self.variant - 1) % len(table)]
        if self.mma:
            return (128, 128) if -(-self.m // 128) * -(-self.n // 128) * self.batch >= 128 else (64, 64)
        tiles = ((128, 128, 128), (128, 64, 64)) if self.target == "cuda" else ((128, 64, 64),)
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
        bk = self.simt.bk if self.target == "cuda" and not self.mma else BK
        if tiles >= 64 or self.target != "cuda" or self.mma:  # (tensor cores: C is float16, no atomics)
            parts = 1
        else:
            parts = max(1, min(8, 128 // tiles, self.k // (4 * bk)))
        per = -(-self.k // parts)
        chunk = -(-per // bk) * bk
        return -(-self.k // chunk), chunk

    def grid(self) -> tuple[int, int, int]:
        bm, bn = self.tile
        return -(-self.n // bn), -(-self.m // bm), self.batch * self.split[0]


def _affine(x: Lin, allowed: dict[Var, str]) -> dict[str, int] | None:
    out = {"off": x.const}
    for a, c in x.terms.items():
        if not isinstance(a, Var) or a not in allowed:
            return None
        out[allowed[a]] = c
    return out


def _operand(v: V, dt: DType) -> V | None:
    return v if v.op == "load" and v.dtype is dt and v.arg[2].always else None


def product_dtypes(target: str, tensor_cores: bool = False) -> tuple[DType, ...]:
    """The dtypes of the products `target`'s kernel computes: float32; float16 and bfloat16 too on tensor cores (CUDA,
    sm_80 on: accumulated in float32, C rounded once, like cuBLAS) and on the host (widened to float32 as packed)."""
    if target == "c" or (tensor_cores and target == "cuda"):
        return dtypes.float32, dtypes.float16, dtypes.bfloat16
    return (dtypes.float32,)


def match(k: Kernel, target: str = "cuda", tensor_cores: bool = False, simd: int = 32, workers: int = 1
          ) -> Gemm | None:
    """The product `k` computes, or None (dtypes: product_dtypes). `simd` and `workers`: the host's (target "c")."""
    if len(k.stores) != 1:
        return None
    out_idx, r = k.stores[0]
    dt = r.dtype
    if dt not in product_dtypes(target, tensor_cores):
        return None
    if r.op != "reduce" or r.arg[0] != "sum" or k.uvars or len(r.arg[1]) != 1:
        return None
    if len(k.gvars) < 2 or any(p is not dt for p in k.params):
        return None
    body = r.src[0]
    if body.op != "alu" or body.arg != "mul":
        return None
    x, y = (_operand(s, dt) for s in body.src)
    if x is None or y is None:
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
                (y.arg[0], fy["off"], yb, fy["r"], fy.get("j", 0)), target, dt.name, simd, workers, k.variant)


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
CUDA_TILES = {(128, 128): SimtTile(128, 128, 2, 2, lm=4, bk=8), (128, 64): SimtTile(128, 64, 2, 2),
              (64, 64): SimtTile(64, 64, 2, 2)}
# the block tiles the kernel search tries (Kernel.variant v > 0: row v - 1): CUDA's float32 kernel (the heuristic's
# three, 128 x 64 in slices of 8 k, and 64 x 128), the tensor-core kernel's, Vulkan's (256 threads, 16 x 16)
CUDA_VARIANTS = (SimtTile(128, 128, 2, 2, lm=4, bk=8), SimtTile(128, 64, 2, 2), SimtTile(64, 64, 2, 2),
                 SimtTile(128, 64, 2, 2, bk=8), SimtTile(64, 128, 2, 2))
MMA_TILES = ((128, 128), (64, 64))
GLSL_TILES = ((128, 64), (64, 64), (128, 128), (64, 128))


def tile_variants(g: Gemm) -> int:
    """How many block tiles the search may try for `g` (Kernel.variant 1 .. this; 0: the heuristic's), 0 where the
    target has no table (the host templates choose their block sizes by gemm_host.variants)."""
    if g.target == "cuda":
        return len(MMA_TILES) if g.mma else len(CUDA_VARIANTS)
    return len(GLSL_TILES) if g.target == "glsl" else 0


def tile_config(g: Gemm) -> tuple[object, ...]:
    """What `g`'s kernel's shape depends on (its tile, the float32 kernel's SimtTile, K's split; a tensor-core product
    of variant 0 may take azyx.gemm_sm90's kernel instead): variants of one configuration render the same kernel."""
    return (g.tile, g.simt if g.target == "cuda" and not g.mma else None, g.split, g.mma and not g.variant)


def render_cuda(g: Gemm, name: str) -> str:
    if g.mma:
        return render_mma(g, name)
    return render_simt(g, name, g.simt, g.split)


def render_simt(g: Gemm, name: str, c: SimtTile, split: tuple[int, int]) -> str:
    """The float32 product on CUDA cores (SimtTile says the shape). A slice of each operand moves global memory ->
    registers -> shared memory: the next slice's loads are in flight while the current one is multiplied, then
    stored into the other buffer (one barrier per slice). Loads are 16 bytes wide where an operand's contiguous
    axis allows; an operand contiguous along K is transposed as it is stored, so that both are read as 16-byte
    vectors along M and N. `split`: (parts, slice) of K (Gemm.split); parts > 1 adds into C atomically."""
    tr, tc, bk, threads = c.bm, c.bn, c.bk, c.threads
    tm, tn, lm, ln = c.tm, c.tn, c.lm, 32 // c.lm
    assert tm % 4 == 0 and tn % 4 == 0 and c.bm % (c.wm * lm) == 0 and c.bn % (c.wn * ln) == 0
    pa, a_off, a_sb, a_si, a_sk = g.a
    pb, b_off, b_sb, b_sk, b_sj = g.b
    # A's slice is bk x t (k-major in shared memory); a 16-byte load takes 4 consecutive k (A's k contiguous) or
    # 4 consecutive rows (A's rows contiguous); otherwise single elements
    a_vec = 4 if (a_sk == 1 and a_si % 4 == 0 and a_off % 4 == 0 and a_sb % 4 == 0 and g.k % 4 == 0) else 1
    b_vec = 4 if (b_sj == 1 and b_sk % 4 == 0 and b_off % 4 == 0 and b_sb % 4 == 0 and g.n % 4 == 0) else 1
    a_elems, b_elems = bk * tr // a_vec, bk * tc // b_vec
    parts, chunk = split
    # guards only where a slice can pass the edge (the shapes are the kernel's); 32-bit offsets where they fit
    k_edge = g.k % chunk != 0 or chunk % bk != 0
    it = "int" if max(_reach(g.a, g.m, g.k), _reach(g.b, g.k, g.n)) < 2**31 else "long long"
    a_load = _tile_load("A", "As", a_vec, a_elems, "m", tr, "i", a_si, a_sk, g.m, a_sk == 1, threads, bk,
                        g.m % tr != 0, k_edge, it)
    b_load = _tile_load("B", "Bs", b_vec, b_elems, "n", tc, "j", b_sj, b_sk, g.n, b_sj != 1, threads, bk,
                        g.n % tc != 0, k_edge, it)
    params = ", ".join(f"const float* __restrict__ d{i}" for i in range(1, 1 + max(pa, pb)))
    return f"""extern "C" __global__ void __launch_bounds__({threads}) {name}(float* __restrict__ C, {params}) {{
  __shared__ __align__(16) float As[2][{bk}][{tr + 4}];
  __shared__ __align__(16) float Bs[2][{bk}][{tc + 4}];
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  // the lane's first row / column in the block's tile: its warp's tile, then its run of 4
  const int ar = (warp / {c.wn}) * {tr // c.wm} + (lane / {ln}) * 4;
  const int br = (warp % {c.wn}) * {tc // c.wn} + (lane % {ln}) * 4;
  const int bi = blockIdx.y * {tr}, bj = blockIdx.x * {tc};
  const long long bz = blockIdx.z / {parts};
  const int kbeg = (blockIdx.z % {parts}) * {chunk}, kend = min({g.k}, kbeg + {chunk});
  const float* A = d{pa} + {a_off}LL + bz * {a_sb}LL;
  const float* B = d{pb} + {b_off}LL + bz * {b_sb}LL;
  float acc[{tm}][{tn}];
  #pragma unroll
  for (int m = 0; m < {tm}; m++)
    #pragma unroll
    for (int n = 0; n < {tn}; n++) acc[m][n] = 0.f;
  float ra[{-(-a_elems // threads)}][{a_vec}], rb[{-(-b_elems // threads)}][{b_vec}];
  {a_load.fetch.replace("@K0@", "kbeg")}
  {b_load.fetch.replace("@K0@", "kbeg")}
  {a_load.store.replace("@BUF@", "0")}
  {b_load.store.replace("@BUF@", "0")}
  __syncthreads();
  int buf = 0;
  for (int k0 = kbeg; k0 < kend; k0 += {bk}) {{
    const bool more = k0 + {bk} < kend;
    if (more) {{
      {a_load.fetch.replace("@K0@", f"k0 + {bk}")}
      {b_load.fetch.replace("@K0@", f"k0 + {bk}")}
    }}
    #pragma unroll
    for (int kk = 0; kk < {bk}; kk++) {{
      float a[{tm}], b[{tn}];
      #pragma unroll
      for (int m = 0; m < {tm}; m += 4) *(float4*)&a[m] = *(const float4*)&As[buf][kk][ar + (m / 4) * {4 * lm}];
      #pragma unroll
      for (int n = 0; n < {tn}; n += 4) *(float4*)&b[n] = *(const float4*)&Bs[buf][kk][br + (n / 4) * {4 * ln}];
      #pragma unroll
      for (int m = 0; m < {tm}; m++)
        #pragma unroll
        for (int n = 0; n < {tn}; n++) acc[m][n] += a[m] * b[n];
    }}
    if (more) {{
      buf ^= 1;
      {a_load.store.replace("@BUF@", "buf")}
      {b_load.store.replace("@BUF@", "buf")}
    }}
    __syncthreads();
  }}
  float* Cb = C + bz * {g.m * g.n}LL;
  #pragma unroll
  for (int m = 0; m < {tm}; m++) {{
    const int i = bi + ar + (m / 4) * {4 * lm} + m % 4;
    if (i >= {g.m}) continue;
    #pragma unroll
    for (int n = 0; n < {tn}; n += 4) {{
      const int j = bj + br + (n / 4) * {4 * ln};
      {_store(g, parts)}
    }}
  }}
}}
"""


def _store(g: Gemm, parts: int) -> str:
    """Four accumulators (columns j..j+3 of row i) into C: added atomically when K is split, else stored (one
    16-byte store where the row allows it)."""
    at = f"Cb[(long long)i * {g.n} + j + q]"
    if parts > 1:
        return f"for (int q = 0; q < 4; q++) if (j + q < {g.n}) atomicAdd(&{at}, acc[m][n + q]);"
    whole = f"*(float4*)&Cb[(long long)i * {g.n} + j] = make_float4(acc[m][n], acc[m][n + 1], acc[m][n + 2], " \
            "acc[m][n + 3]);"
    part = f"for (int q = 0; q < 4; q++) if (j + q < {g.n}) {at} = acc[m][n + q];"
    return f"if (j + 3 < {g.n}) {{ {whole} }} else {{ {part} }}" if g.n % 4 == 0 else part


@dataclass(frozen=True)
class _Load:
    fetch: str  # global memory -> registers (@K0@: the slice's first k)
    store: str  # registers -> shared memory slice (@BUF@)


def _reach(op: tuple[int, int, int, int, int], rows: int, cols: int) -> int:
    """One past the farthest element an operand's view reaches from its batch element's origin."""
    return op[1] + abs(op[3]) * (rows - 1) + abs(op[4]) * (cols - 1) + 1


def _tile_load(mat: str, sh: str, vec: int, elems: int, ax: str, t: int, gv: str, s_outer: int, s_k: int,
               extent: int, along_k: bool, threads: int, bk: int, edge: bool = True, k_edge: bool = True,
               it: str = "long long") -> _Load:
    """Moving one bk x t slice of an operand: `elems` loads of `vec` floats, `threads` at a time. `along_k`: a
    load's consecutive elements (and consecutive threads) run along k; else along the operand's row/column axis.
    `edge`, `k_edge`: whether a slice can pass the operand's last row (column) or the part's last k (guarded loads
    read zeros there); `it`: the type of an element's offset."""
    base = "bi" if gv == "i" else "bj"
    fetch, store = [], []
    for s, head in enumerate(_slot_heads(vec, elems, t, ax, along_k, "const int", threads, bk, True)):
        idx = f"({it})({base} + {ax}) * {s_outer} + ({it})(@K0@ + kk) * {s_k}"
        ok = " && ".join([f"{base} + {ax} < {extent}"] * edge + ["@K0@ + kk < kend"] * k_edge) or "true"
        if vec == 4:
            get = (f"{{ float4 v = ({ok}) ? *(const float4*)&{mat}[{idx}] : make_float4(0.f, 0.f, 0.f, 0.f); "
                   f"r{mat.lower()}[{s}][0] = v.x; r{mat.lower()}[{s}][1] = v.y; r{mat.lower()}[{s}][2] = v.z; "
                   f"r{mat.lower()}[{s}][3] = v.w; }}")
        else:
            get = f"r{mat.lower()}[{s}][0] = ({ok}) ? {mat}[{idx}] : 0.f;"
        fetch.append(f"{head}{get} }}")
        if vec == 4 and along_k:
            put = "; ".join(f"{sh}[@BUF@][kk + {q}][{ax}] = r{mat.lower()}[{s}][{q}]" for q in range(4)) + ";"
        elif vec == 4:
            put = f"*(float4*)&{sh}[@BUF@][kk][{ax}] = *(const float4*)&r{mat.lower()}[{s}][0];"
        else:
            put = f"{sh}[@BUF@][kk][{ax}] = r{mat.lower()}[{s}][0];"
        store.append(f"{head}{put} }}")
    return _Load(" ".join(fetch), " ".join(store))


def _slot_heads(vec: int, elems: int, t: int, ax: str, along_k: bool, int_t: str, threads: int = THREADS,
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
MMA_HELPERS = """#ifndef AZYX_MMA_HELPERS
#define AZYX_MMA_HELPERS
__device__ inline unsigned azyx_smem(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }
__device__ inline void azyx_cp16(unsigned dst, const void* src, int bytes) {  /* bytes < 16: the rest zero-filled */
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" :: "r"(dst), "l"(src), "r"(bytes) : "memory");
}
__device__ inline void azyx_ldm4(unsigned* r, unsigned a) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a) : "memory");
}
__device__ inline void azyx_ldm4t(unsigned* r, unsigned a) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a) : "memory");
}
""" + "".join(f"""__device__ inline void azyx_mma_{t}(float* c, const unsigned* a, const unsigned* b) {{
  asm("mma.sync.aligned.m16n8k16.row.col.f32.{t}.{t}.f32 {{%0, %1, %2, %3}}, {{%4, %5, %6, %7}}, {{%8, %9}}, "
      "{{%0, %1, %2, %3}};" : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}}
""" for t in ("f16", "bf16")) + "#endif\n"


@dataclass(frozen=True)
class _MmaOperand:
    """How one operand's BK-slice reaches shared memory, and how a warp reads it back as mma fragments."""
    decl: str  # the shared array (MMA_STAGES stages) and any registers
    fetch: str  # start moving the slice at k @K0@ into stage @S@ (cp.async), or into registers
    put: str  # registers -> stage @S@ (element loads only)
    frag: str  # the ldmatrix of fragment {f} at row/column {x} of the warp's tile, k {ks} of stage {s}
    async_copy: bool


def _mma_operand(mat: str, origin: str, extent: int, s_outer: int, s_k: int, off: int, s_b: int, g: Gemm,
                 t: int, threads: int) -> _MmaOperand:
    """Operand `mat` (A: rows i; B: columns j, `t` of them per block) in shared memory as rows of k ("k-major", read
    by ldmatrix) or as rows along i/j ("outer-major", read by ldmatrix.trans), whichever its contiguous axis is: 16
    bytes per cp.async where that axis has stride 1 and the other strides and the offset are multiples of 8 elements
    (a partial chunk at an edge is zero-filled); else element by element through registers. A row's 16-byte chunks
    are permuted (XOR swizzle) so that the 8 rows an ldmatrix reads fall in distinct banks without padding (three
    stages of 128 x 128 tiles fill the 48 KiB a kernel may declare)."""
    aligned = off % 8 == 0 and s_b % 8 == 0
    if s_k == 1 and s_outer % 8 == 0 and aligned:
        k_major, async_copy = True, True
    elif s_outer == 1 and s_k % 8 == 0 and aligned:
        k_major, async_copy = False, True
    else:
        k_major, async_copy = abs(s_k) <= abs(s_outer), False
    bk, sh = MMA_BK, f"{mat}s"
    rows, cols = (t, bk) if k_major else (bk, t)
    decl = f"__shared__ __align__(16) unsigned short {sh}[{MMA_STAGES}][{rows}][{cols}];"

    def swizzled(r: str, c: str) -> str:
        """Where element c of shared row r lies: its chunk c / 8 XORed with bits of r (k-major rows are 64 bytes, two
        to a 128-byte line of banks: bits 1-2 of r; outer-major rows fill whole lines: bits 0-2)."""
        bits = f"(({r} >> 1) & 3)" if k_major else f"({r} & 7)"
        return f"(((({c}) >> 3) ^ {bits}) << 3 | (({c}) & 7))"

    per = (bk if k_major else t) // (8 if async_copy else 1)  # loads per shared row
    rounds = rows * per // threads  # loads per thread (the tiles are whole multiples of the block's threads)
    assert rounds * threads == rows * per
    step, reg = 8 if async_copy else 1, f"r{mat.lower()}"
    pos = (f"row = e / {per}, kk = @K0@ + e % {per} * {step}, x = {origin} + row" if k_major else
           f"row = e / {per}, kk = @K0@ + row, x = {origin} + e % {per} * {step}")
    col = "kk - @K0@" if k_major else f"x - {origin}"
    head = f"#pragma unroll\n  for (int q = 0; q < {rounds}; q++) {{ const int e = tid + q * {threads}, {pos}; "
    addr = f"(long long)x * {s_outer} + (long long)kk * {s_k}"
    if async_copy:
        along, bound, other, obound = ("kk", g.k, "x", extent) if k_major else ("x", extent, "kk", g.k)
        fetch = (f"{head}const int b = {other} < {obound} ? min(max({bound} - {along}, 0), 8) * 2 : 0; "
                 f"azyx_cp16(azyx_smem(&{sh}[@S@][row][{swizzled('row', col)}]), b ? {mat} + {addr} : {mat}, b); }}")
        put = ""
    else:
        fetch = f"{head}{reg}[q] = x < {extent} && kk < {g.k} ? {mat}[{addr}] : (unsigned short)0; }}"
        put = f"{head}{sh}[@S@][row][{swizzled('row', col)}] = {reg}[q]; }}"
        decl += f" unsigned short {reg}[{rounds}];"
    # ldmatrix.x4: lane l gives the address of one 8-element row of one of four 8 x 8 matrices (lanes 8q..8q+7:
    # matrix q); for A they are rows 0-7 / 8-15 x k 0-7 / 8-15 (a0..a3 of mma.m16n8k16), for B two n8 tiles x k 0-7 /
    # 8-15 (b0, b1 of tile 0, then of tile 1)
    if mat == "A":
        lo, hi = "(lane & 15)", "(lane >> 4) * 8"  # k-major: row of the 16, k half
        tr_k, tr_x = "(lane & 7) + (lane >> 4) * 8", "((lane >> 3) & 1) * 8"
    else:
        lo, hi = "(lane & 7) + (lane >> 4) * 8", "((lane >> 3) & 1) * 8"
        tr_k, tr_x = "(lane & 7) + ((lane >> 3) & 1) * 8", "(lane >> 4) * 8"
    r, c = (f"{{x}} + {lo}", f"{{ks}} + {hi}") if k_major else (f"{{ks}} + {tr_k}", f"{{x}} + {tr_x}")
    frag = (f"{{{{ const int r = {r}, c = {c}; azyx_ldm4{'' if k_major else 't'}({{f}}, "
            f"azyx_smem(&{sh}[{{s}}][r][{swizzled('r', 'c')}])); }}}}")
    return _MmaOperand(decl, fetch, put, frag, async_copy)


def render_mma(g: Gemm, name: str) -> str:
    """The product of float16 or bfloat16 operands on tensor cores (sm_80 on): `mma.sync.m16n8k16` with float32
    accumulators. A block of 8 warps (2 x 4) computes a 128 x 128 tile of C, each warp 64 x 32 (4 x 4 mma tiles); a
    small product takes 64 x 64 tiles of 4 warps, 32 x 32 each. K steps by slices of 32 through three shared-memory
    stages: the next two slices' copies (cp.async) are in flight while one is multiplied. Blocks run in
    groups of 8 block-rows, so the blocks resident at once share their A rows and B columns in L2. Edges: loads past
    M, N or K read zeros, stores are guarded; C is rounded to its dtype once."""
    assert g.mma and g.split[0] == 1
    bm, bn = g.tile
    wms, wns = MMA_WARPS[g.tile]
    wtm, wtn = bm // wms, bn // wns
    mi, ni = wtm // 16, wtn // 8
    threads = g.threads
    pa, a_off, a_sb, a_si, a_sk = g.a
    pb, b_off, b_sb, b_sk, b_sj = g.b
    a = _mma_operand("A", "bi", g.m, a_si, a_sk, a_off, a_sb, g, bm, threads)
    b = _mma_operand("B", "bj", g.n, b_sj, b_sk, b_off, b_sb, g, bn, threads)
    kind = "f16" if g.dtype == "float16" else "bf16"
    cvt = "f2h" if g.dtype == "float16" else "f2bf"
    params = ", ".join(f"const unsigned short* __restrict__ d{i}" for i in range(1, 1 + max(pa, pb)))
    gx, gy = -(-g.n // bn), -(-g.m // bm)
    frags_a = "\n".join("      " + a.frag.format(f=f"fa[{i}]", s="s", x=f"wm * {wtm} + {i * 16}", ks="ks")
                        for i in range(mi))
    frags_b = "\n".join("      " + b.frag.format(f=f"fb[{j}]", s="s", x=f"wn * {wtn} + {j * 16}", ks="ks")
                        for j in range(ni // 2))
    row = f"(Cb + (long long)i * {g.n} + j)"
    if g.n % 2 == 0:  # j is even: a pair of C's elements is one aligned 4-byte store
        store = (f"if (j < {g.n}) *(unsigned*)({row}) = (unsigned){cvt}(c[0]) | ((unsigned){cvt}(c[1]) << 16);")
    else:
        store = f"if (j < {g.n}) {row}[0] = {cvt}(c[0]); if (j + 1 < {g.n}) {row}[1] = {cvt}(c[1]);"
    ahead = (MMA_STAGES - 1) * MMA_BK  # the slice copied while slice k0 is multiplied: k0 + ahead
    put = "" if a.async_copy and b.async_copy else f"""    if (more) {{
      {a.put.replace("@K0@", "k1").replace("@S@", "sn")}
      {b.put.replace("@K0@", "k1").replace("@S@", "sn")}
    }}
"""
    commit = 'asm volatile("cp.async.commit_group;" ::: "memory");'
    first = []  # the first slices into stages 0.., a commit group each (empty past K: the count of groups stays)
    for p in range(MMA_STAGES - 1):
        copies = "\n  ".join(x for x in (a.fetch, a.put, b.fetch, b.put) if x)
        if p * MMA_BK < g.k:
            first.append(f"{{ const int k1 = {p * MMA_BK};\n  {copies.replace('@K0@', 'k1').replace('@S@', str(p))} }}")
        first.append(commit)
    # two blocks of 8 warps per multiprocessor (128 registers a thread) where both operands are copied by cp.async;
    # element loads stage a slice in registers, which 128 would spill
    two = ", 2" if threads == 256 and a.async_copy and b.async_copy else ""
    return MMA_HELPERS + f"""extern "C" __global__ void __launch_bounds__({threads}{two}) \
{name}(unsigned short* __restrict__ C, {params}) {{
  {a.decl}
  {b.decl}
  const int tid = threadIdx.x, lane = tid & 31, wm = (tid >> 5) / {wns}, wn = (tid >> 5) % {wns};
  // groups of 8 block-rows: consecutive blocks walk down a group's rows, then to its next column
  const int id = blockIdx.y * {gx} + blockIdx.x, first = id / {8 * gx} * 8, rows = min({gy} - first, 8);
  const int bi = (first + id % {8 * gx} % rows) * {bm}, bj = id % {8 * gx} / rows * {bn};
  const long long bz = blockIdx.z;
  const unsigned short* A = d{pa} + {a_off}LL + bz * {a_sb}LL;
  const unsigned short* B = d{pb} + {b_off}LL + bz * {b_sb}LL;
  float acc[{mi}][{ni}][4];
  #pragma unroll
  for (int m = 0; m < {mi}; m++)
    #pragma unroll
    for (int n = 0; n < {ni}; n++)
      #pragma unroll
      for (int q = 0; q < 4; q++) acc[m][n][q] = 0.f;
  {chr(10).join("  " + x for x in first).lstrip()}
  int s = 0;  // the stage of slice k0
  for (int k0 = 0; k0 < {g.k}; k0 += {MMA_BK}) {{
    asm volatile("cp.async.wait_group {MMA_STAGES - 2};" ::: "memory");  // slice k0 has landed
    __syncthreads();  // ... for all; and every warp is done with slice k0 - {MMA_BK}: its stage sn takes slice k1
    const int sn = s == 0 ? {MMA_STAGES - 1} : s - 1, k1 = k0 + {ahead};
    const bool more = k1 < {g.k};
    if (more) {{
      {a.fetch.replace("@K0@", "k1").replace("@S@", "sn")}
      {b.fetch.replace("@K0@", "k1").replace("@S@", "sn")}
    }}
    {commit}
    #pragma unroll
    for (int ks = 0; ks < {MMA_BK}; ks += 16) {{
      unsigned fa[{mi}][4], fb[{ni // 2}][4];
{frags_a}
{frags_b}
      #pragma unroll
      for (int m = 0; m < {mi}; m++)
        #pragma unroll
        for (int n = 0; n < {ni}; n++) azyx_mma_{kind}(acc[m][n], fa[m], &fb[n >> 1][(n & 1) * 2]);
    }}
{put}    s = s == {MMA_STAGES - 1} ? 0 : s + 1;
  }}
  unsigned short* Cb = C + bz * {g.m * g.n}LL;
  #pragma unroll
  for (int m = 0; m < {mi}; m++)
    #pragma unroll
    for (int n = 0; n < {ni}; n++)
      #pragma unroll
      for (int h = 0; h < 2; h++) {{  // c0, c1: row lane / 4, columns 2 (lane % 4) and + 1; c2, c3: 8 rows down
        const int i = bi + wm * {wtm} + m * 16 + (lane >> 2) + h * 8, j = bj + wn * {wtn} + n * 8 + (lane & 3) * 2;
        const float* c = &acc[m][n][2 * h];
        if (i < {g.m}) {{ {store} }}
      }}
}}
"""


def render_glsl(g: Gemm, name: str, prelude: str, max_groups: int) -> str | None:
    """The tiled product as a Vulkan compute shader (the shader interface of `cstyle.glsl_interface`: buffers by
    device address from the words buffer, C first). Shared memory holds 4-float vectors, so a thread reads its
    register tile's operands 16 bytes at a time (a thread's columns of B and C interleave with its neighbours', so
    16 threads read 16 consecutive vectors: no bank conflicts, and C is written in whole lines); global loads are
    16 bytes wide where an operand's contiguous axis allows. K is never split (GLSL has no float atomics without an
    extension). None where the grid would exceed the device's groups per dimension."""
    assert g.target == "glsl"
    if max(g.grid()) > max_groups:
        return None
    tr, tc = g.tile
    tm, tn = tr // 16, tc // 16
    pa, a_off, a_sb, a_si, a_sk = g.a
    pb, b_off, b_sb, b_sk, b_sj = g.b
    a_vec = 4 if (a_sk == 1 and a_si % 4 == 0 and a_off % 4 == 0 and a_sb % 4 == 0 and g.k % 4 == 0) else 1
    b_vec = 4 if (b_sj == 1 and b_sk % 4 == 0 and b_off % 4 == 0 and b_sb % 4 == 0 and g.n % 4 == 0) else 1
    reach = max(a_off + (g.batch - 1) * abs(a_sb) + (g.m - 1) * abs(a_si) + (g.k - 1) * abs(a_sk),
                b_off + (g.batch - 1) * abs(b_sb) + (g.k - 1) * abs(b_sk) + (g.n - 1) * abs(b_sj),
                g.batch * g.m * g.n)
    it = "int" if reach < 2**31 else "int64_t"
    a_elems, b_elems = BK * tr // a_vec, BK * tc // b_vec
    a_load = _glsl_tile_load("A", a_vec, a_elems, tr, "bi", a_si, a_sk, g.m, a_sk == 1, f"{a_off} + bz * {a_sb}", it)
    b_load = _glsl_tile_load("B", b_vec, b_elems, tc, "bj", b_sj, b_sk, g.n, b_sj != 1, f"{b_off} + bz * {b_sb}", it)
    fma = "\n".join(f"      acc[{m}][{q}] += a[{m // 4}][{m % 4}] * b[{q}];" for m in range(tm) for q in range(tn // 4))
    row = f"bz * {g.m * g.n} + {it}(i) * {g.n} + j"
    whole = f"C4.v[({row}) >> 2] = acc[m][q];"
    part = f"for (int c = 0; c < 4; c++) if (j + c < {g.n}) C.v[{row} + c] = acc[m][q][c];"
    store = f"if (j + 3 < {g.n}) {{ {whole} }} else {{ {part} }}" if g.n % 4 == 0 else part
    return f"""{prelude}
// {name}
layout(local_size_x = {THREADS}) in;
layout(std430, set = 0, binding = 0) restrict readonly buffer W {{ uint sw[]; }};
layout(buffer_reference, std430, buffer_reference_align = 4) restrict buffer BC {{ float v[]; }};
layout(buffer_reference, std430, buffer_reference_align = 16) restrict buffer QC {{ vec4 v[]; }};
layout(buffer_reference, std430, buffer_reference_align = 4) restrict readonly buffer BI {{ float v[]; }};
layout(buffer_reference, std430, buffer_reference_align = 16) restrict readonly buffer QI {{ vec4 v[]; }};
shared vec4 As[2][{BK}][{tr // 4 + 1}];
shared vec4 Bs[2][{BK}][{tc // 4 + 1}];
uint64_t address(int i) {{ return packUint2x32(uvec2(sw[2 * i], sw[2 * i + 1])); }}
void main() {{
  BC C = BC(address(0)); QC C4 = QC(address(0));
  BI A = BI(address({pa})); QI A4 = QI(address({pa}));
  BI B = BI(address({pb})); QI B4 = QI(address({pb}));
  int tid = int(gl_LocalInvocationID.x), ty = tid / 16, tx = tid % 16;
  int bi = int(gl_WorkGroupID.y) * {tr}, bj = int(gl_WorkGroupID.x) * {tc};
  {it} bz = {it}(gl_WorkGroupID.z);
  int kend = {g.k};
  vec4 acc[{tm}][{tn // 4}];
  for (int m = 0; m < {tm}; m++)
    for (int q = 0; q < {tn // 4}; q++) acc[m][q] = vec4(0.0);
  {a_load.decl}
  {b_load.decl}
  {a_load.fetch.replace("@K0@", "0")}
  {b_load.fetch.replace("@K0@", "0")}
  {a_load.store.replace("@BUF@", "0")}
  {b_load.store.replace("@BUF@", "0")}
  barrier();
  int buf = 0;
  for (int k0 = 0; k0 < kend; k0 += {BK}) {{
    bool more = k0 + {BK} < kend;
    if (more) {{
      {a_load.fetch.replace("@K0@", f"k0 + {BK}")}
      {b_load.fetch.replace("@K0@", f"k0 + {BK}")}
    }}
    for (int kk = 0; kk < {BK}; kk++) {{
      vec4 a[{tm // 4}], b[{tn // 4}];
      for (int m = 0; m < {tm // 4}; m++) a[m] = As[buf][kk][ty * {tm // 4} + m];
      for (int q = 0; q < {tn // 4}; q++) b[q] = Bs[buf][kk][q * 16 + tx];
{fma}
    }}
    if (more) {{
      buf ^= 1;
      {a_load.store.replace("@BUF@", "buf")}
      {b_load.store.replace("@BUF@", "buf")}
    }}
    barrier();
  }}
  for (int m = 0; m < {tm}; m++) {{
    int i = bi + ty * {tm} + m;
    if (i >= {g.m}) continue;
    for (int q = 0; q < {tn // 4}; q++) {{
      int j = bj + (q * 16 + tx) * 4;
      {store}
    }}
  }}
}}
"""


@dataclass(frozen=True)
class _GlslLoad:
    decl: str  # the registers a slice passes through
    fetch: str  # global memory -> registers (@K0@: the slice's first k)
    store: str  # registers -> shared memory slice (@BUF@)


def _glsl_tile_load(mat: str, vec: int, elems: int, t: int, base: str, s_outer: int, s_k: int, extent: int,
                    along_k: bool, origin: str, it: str) -> _GlslLoad:
    """`_tile_load` for GLSL: `elems` loads of `vec` floats into registers, THREADS at a time, then into the shared
    slice of 4-float vectors (a row or column's element `x` is component x % 4 of vector x / 4)."""
    reg, sh = f"r{mat.lower()}", f"{mat}s"
    heads = _slot_heads(vec, elems, t, "x", along_k, "int")
    fetch, store = [], []
    for s, head in enumerate(heads):
        idx = f"{origin} + {it}({base} + x) * {s_outer} + {it}(@K0@ + kk) * {s_k}"
        ok = f"{base} + x < {extent} && @K0@ + kk < kend"
        if vec == 4:
            get = f"{reg}[{s}] = ({ok}) ? {mat}4.v[({idx}) >> 2] : vec4(0.0);"
        else:
            get = f"{reg}[{s}] = ({ok}) ? {mat}.v[{idx}] : 0.0;"
        fetch.append(f"{head}{get} }}")
        if vec == 4 and along_k:
            put = " ".join(f"{sh}[@BUF@][kk + {q}][x >> 2][x & 3] = {reg}[{s}][{q}];" for q in range(4))
        elif vec == 4:
            put = f"{sh}[@BUF@][kk][x >> 2] = {reg}[{s}];"
        else:
            put = f"{sh}[@BUF@][kk][x >> 2][x & 3] = {reg}[{s}];"
        store.append(f"{head}{put} }}")
    decl = f"{'vec4' if vec == 4 else 'float'} {reg}[{len(heads)}];"
    return _GlslLoad(decl, " ".join(fetch), " ".join(store))
