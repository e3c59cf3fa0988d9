"""The float16/bfloat16 matrix product on Hopper (compute capability 9.0, code for sm_90a): `wgmma.mma_async` fed by
the tensor memory accelerator (TMA), for the products of `gemm.match` whose shapes and strides fit; others take
`gemm_cuda.render_mma`.

A persistent grid of one block per multiprocessor walks C's 128 x BN tiles (BN 256, or 128 where 256 would leave
multiprocessors idle) in groups of block-rows, so that the tiles in flight share their rows of A and columns of B in L2.
A block is three warpgroups. Warpgroup 0 produces: one thread copies 64-wide K slices of A and B with TMA into a ring
of shared-memory stages (128-byte swizzle, the layout wgmma reads), each completing on its stage's "full" mbarrier.
Warpgroups 1 and 2 consume, 64 rows of the tile each: per slice 4 m64nBNk16 wgmma with float32 accumulators in
registers, one batch left running while the next is issued, a stage handed back (its "empty" mbarrier) once the batch
that read it is done. The epilogue rounds C once to the inputs' dtype, stages it in shared memory and stores it with
TMA, which the next tile's main loop overlaps. The tensor maps of A, B and C (`TensorMap`, in `launch.Launch.maps`)
are kernel parameters, encoded at launch from the buffers' addresses.

Measured on an H200 beside torch.matmul (cuBLAS) in the same dtype, bf16 and f16, A @ B and x @ W.T: the kernel alone
0.88-1.25x at 4096^3 and 8192^3; through azyx (8 products in flight, host work included) 0.80-0.86x at 4096^3 and
0.98-1.01x at 8192^3, where the mma.sync kernel of gemm_cuda.render_mma made 0.37-0.45x.
"""

from __future__ import annotations

from dataclasses import dataclass

from azyx.codegen.templates.gemm import Gemm

BM = 128  # rows of C per block: 64 per consumer warpgroup (one m64 wgmma)
BK = 64  # K per stage: a 128-byte row of 16-bit elements, the swizzle's width
CONSUMERS = 2
THREADS = 128 * (1 + CONSUMERS)
REGS = (40, 232)  # setmaxnreg for the producer and the consumers: 40 x 128 + 232 x 256 registers fit the 65536
STAGES = {256: 3, 128: 5}  # BN -> stages: with C's staging tile, about 200 KiB of the 227 KiB a block may take
WIDE_TILES = 128  # BN 256 from this many tiles on (about a tile per multiprocessor); fewer take BN 128
GROUP = 16  # block-rows per group of the tile order


def fits(g: Gemm) -> bool:
    """Whether the kernel takes `g`: one float16/bfloat16 product (C in that dtype) whose M, N and K are multiples of
    its tiles, A with K contiguous, B with K or N contiguous (x @ W.T or A @ B), rows apart by at least their length
    and 16-byte aligned (what TMA reads)."""
    if not g.mma or g.out or g.batch != 1 or g.m % BM or g.n % 128 or g.k % BK:
        return False
    _, a_off, _, a_si, a_sk = g.a
    _, b_off, _, b_sk, b_sj = g.b
    b_ok = (b_sj == 1 and b_sk >= g.n and b_sk % 8 == 0) or (b_sk == 1 and b_sj >= g.k and b_sj % 8 == 0)
    return a_sk == 1 and a_si >= g.k and a_si % 8 == 0 and a_off % 8 == 0 and b_off % 8 == 0 and b_ok


@dataclass(frozen=True)
class TensorMap:
    """A TMA tensor map that the kernel takes by value after its buffers (`launch.Launch.maps`): a 2-d view of 16-bit
    elements of its buffer argument `arg` (0: C), 128-byte swizzle. It holds the buffer's address, so the backend
    encodes it at launch."""
    arg: int
    offset: int  # elements from the buffer's start
    dims: tuple[int, int]  # elements along the contiguous dimension, then rows
    row_bytes: int  # stride between rows
    box: tuple[int, int]  # the tile one copy moves, in the same order
    dtype: str  # float16 or bfloat16


def tile_n(g: Gemm) -> int:
    return 256 if g.n % 256 == 0 and g.m // BM * (g.n // 256) >= WIDE_TILES else 128


def smem_bytes(g: Gemm) -> int:
    """The stages, C's staging tile, a full and an empty mbarrier per stage, and slack to align the stages to 1024
    bytes (the swizzle's period)."""
    bn = tile_n(g)
    stages = STAGES[bn]
    return stages * (BM + bn) * BK * 2 + BM * bn * 2 + 16 * stages + 1024


def grid(g: Gemm, sms: int) -> tuple[int, int, int]:
    """A block per multiprocessor, or per tile where there are fewer."""
    return min(g.m // BM * (g.n // tile_n(g)), sms), 1, 1


def tensor_maps(g: Gemm) -> tuple[TensorMap, TensorMap, TensorMap]:
    """A's, B's and C's tensor maps, in the kernel's parameter order."""
    bn = tile_n(g)
    pa, a_off, _, a_si, _ = g.a
    pb, b_off, _, b_sk, b_sj = g.b
    dt = g.dtype
    a = TensorMap(pa, a_off, (g.k, g.m), a_si * 2, (BK, BM), dt)
    if b_sj == 1:  # B (K, N) with N contiguous: boxes of [64 k][64 n], bn / 64 of them a stage (N-major operand)
        b = TensorMap(pb, b_off, (g.n, g.k), b_sk * 2, (64, BK), dt)
    else:  # W (N, K) with K contiguous, x @ W.T: boxes of [bn rows][64 k]
        b = TensorMap(pb, b_off, (g.k, g.n), b_sj * 2, (BK, bn), dt)
    c = TensorMap(0, 0, (g.n, g.m), g.n * 2, (64, BM // CONSUMERS), dt)
    return a, b, c


HELPERS = """#ifndef AZYX_SM90_HELPERS
#define AZYX_SM90_HELPERS
struct __align__(64) AzyxTensorMap { unsigned long long opaque[16]; };  /* a CUtensorMap, passed by value */
__device__ __forceinline__ unsigned azyx_sm90_smem(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void azyx_mbar_init(unsigned bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void azyx_mbar_expect_tx(unsigned bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void azyx_mbar_arrive(unsigned bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(bar) : "memory");
}
__device__ __forceinline__ void azyx_mbar_wait(unsigned bar, unsigned parity) {
  unsigned done = 0;
  while (!done)
    asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                 : "=r"(done) : "r"(bar), "r"(parity) : "memory");
}
__device__ __forceinline__ void azyx_tma_load(unsigned dst, const AzyxTensorMap* map, int c0, int c1, unsigned bar) {
  asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
               " [%0], [%1, {%2, %3}], [%4];" :: "r"(dst), "l"(map), "r"(c0), "r"(c1), "r"(bar) : "memory");
}
__device__ __forceinline__ void azyx_tma_store(const AzyxTensorMap* map, unsigned src, int c0, int c1) {
  asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%1, %2}], [%3];"
               :: "l"(map), "r"(c0), "r"(c1), "r"(src) : "memory");
}
__device__ __forceinline__ void azyx_sync_warpgroup(int id) { asm volatile("bar.sync %0, 128;" :: "r"(id) : "memory"); }
/* a shared-memory matrix descriptor: the address (16-byte units) and the constant fields (byte offsets, swizzle) */
__device__ __forceinline__ unsigned long long azyx_wgmma_desc(unsigned addr, unsigned long long fields) {
  return fields | (unsigned long long)((addr & 0x3FFFF) >> 4);
}
__device__ __forceinline__ unsigned azyx_pack_bf16(float lo, float hi) {
  unsigned r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}
__device__ __forceinline__ unsigned azyx_pack_f16(float lo, float hi) {
  unsigned r;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}
#endif
"""


def _wgmma(bn: int, ab: str, n_major: bool) -> tuple[str, str]:
    """(name, definition) of a function issuing one m64n{bn}k16 wgmma, D += A B, into accumulators d[bn / 2]."""
    name = f"azyx_wgmma_{bn}_{ab}_{'n' if n_major else 'k'}"
    regs = bn // 2
    outs = ", ".join(f"%{i}" for i in range(regs))
    binds = ", ".join(f'"+f"(d[{i}])' for i in range(regs))
    return name, f"""#ifndef {name.upper()}
#define {name.upper()}
__device__ __forceinline__ void {name}(float* d, unsigned long long da, unsigned long long db) {{
  asm volatile("{{ .reg .pred p; setp.ne.b32 p, 1, 0; wgmma.mma_async.sync.aligned.m64n{bn}k16.f32.{ab}.{ab} "
               "{{{outs}}}, %{regs}, %{regs + 1}, p, 1, 1, 0, {int(n_major)}; }}"
               : {binds} : "l"(da), "l"(db));
}}
#endif
"""


def _desc_fields(lbo: int, sbo: int) -> str:
    """A descriptor's constant bits: leading and stride byte offsets, 128-byte swizzle."""
    return f"{(lbo >> 4) << 16 | (sbo >> 4) << 32 | 1 << 62}ULL"


def render(g: Gemm, name: str) -> str:
    assert fits(g)
    bn = tile_n(g)
    stages = STAGES[bn]
    ab = "f16" if g.dtype == "float16" else "bf16"
    n_major = g.b[4] == 1
    wgmma, wgmma_def = _wgmma(bn, ab, n_major)
    a_bytes, b_bytes, rows = BM * BK * 2, bn * BK * 2, BM // CONSUMERS
    tm, tn = g.m // BM, g.n // bn
    # A (and W): K-major 128-byte rows, 8-row swizzle atoms 1024 bytes apart (the stride offset); a k16 step moves
    # 32 bytes along the row. B (K, N): N-major (transposed in wgmma's terms), as bn / 64 TMA boxes of [64 k][64 n]:
    # the leading offset is the box stride along N, the stride offset the 8-k-row atom's; a k16 step moves 16 rows
    a_fields = _desc_fields(16, 1024)
    b_fields, b_step = (_desc_fields(64 * BK * 2, 1024), 16 * 128) if n_major else (_desc_fields(16, 1024), 32)
    load_b = (f"for (int q = 0; q < {bn // 64}; q++) azyx_tma_load(sb + s * {b_bytes} + q * {64 * BK * 2}, &mb, "
              f"bj + q * 64, k0, full(s));" if n_major else f"azyx_tma_load(sb + s * {b_bytes}, &mb, k0, bj, full(s));")
    params = "".join(f", const unsigned short* __restrict__ d{i}" for i in range(1, 1 + max(g.a[0], g.b[0])))
    # the operands' offsets and strides live in the tensor maps: written here too, so that the kernel's name (a hash
    # of its source) tells kernels of different maps apart (a graph replay or a launch cache keyed by name)
    maps = "; ".join(f"d{m.arg} +{m.offset}, {m.dims[0]} x {m.dims[1]}, rows {m.row_bytes} B" for m in tensor_maps(g))
    text = HELPERS + wgmma_def + f"""// tensor maps: {maps}
extern "C" __global__ void __launch_bounds__({THREADS}, 1) {name}(
    unsigned short* __restrict__ C{params}, const __grid_constant__ AzyxTensorMap ma,
    const __grid_constant__ AzyxTensorMap mb, const __grid_constant__ AzyxTensorMap mc) {{
  extern __shared__ unsigned char azyx_dynamic[];
  // {stages} stages of A, then of B, then C's staging tile, then the mbarriers
  const unsigned sa = (azyx_sm90_smem(azyx_dynamic) + 1023) & ~1023u, sb = sa + {stages * a_bytes};
  const unsigned sc = sb + {stages * b_bytes}, bars = sc + {BM * bn * 2};
  auto full = [&](int s) {{ return bars + 8 * s; }};  // stage s has landed
  auto empty = [&](int s) {{ return bars + 8 * ({stages} + s); }};  // every consumer warp is done with stage s
  const int wg = threadIdx.x / 128, tid = threadIdx.x % 128;
  if (threadIdx.x == 0) {{
    for (int s = 0; s < {stages}; s++) {{ azyx_mbar_init(full(s), 1); azyx_mbar_init(empty(s), {4 * CONSUMERS}); }}
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");  // visible to the TMA unit
  }}
  __syncthreads();
  // tile t -> (bi, bj): groups of {GROUP} block-rows, walked down each column of the group, then to its next column
  auto tile = [&](int t, int& bi, int& bj) {{
    const int first = t / {GROUP * tn} * {GROUP}, rows = min({tm} - first, {GROUP});
    bi = (first + t % {GROUP * tn} % rows) * {BM};
    bj = t % {GROUP * tn} / rows * {bn};
  }};
"""
    return (text
            + _producer(a_bytes, load_b, stages, rows, tm, tn, g, b_bytes)
            + _consumer_loop(wgmma, a_bytes, a_fields, b_bytes, b_step, b_fields, stages, bn, tm, tn, g, rows)
            + _epilogue(rows, ab, bn))


def _producer(a_bytes: int, load_b: str, stages: int, rows: int, tm: int, tn: int, g: Gemm, b_bytes: int) -> str:
    """The producer warpgroup: one thread loads each tile's K slices by TMA into the ring of stages."""
    return f"""\
  if (wg == 0) {{  // the producer
    asm volatile("setmaxnreg.dec.sync.aligned.u32 {REGS[0]};");
    if (tid == 0) {{
      int s = 0;
      unsigned phase = 0;
      for (int t = blockIdx.x; t < {tm * tn}; t += gridDim.x) {{
        int bi, bj;
        tile(t, bi, bj);
        for (int k0 = 0; k0 < {g.k}; k0 += {BK}) {{
          azyx_mbar_wait(empty(s), phase ^ 1);  // (a fresh barrier passes a wait on the parity before its first phase)
          azyx_mbar_expect_tx(full(s), {a_bytes + b_bytes});
          azyx_tma_load(sa + s * {a_bytes}, &ma, k0, bi, full(s));
          {load_b}
          if (++s == {stages}) {{ s = 0; phase ^= 1; }}
        }}
      }}
    }}
  }} else {{  // the consumers: rows (wg - 1) * {rows}.. of the tile
"""


def _consumer_loop(wgmma: str, a_bytes: int, a_fields: str, b_bytes: int, b_step: int, b_fields: str, stages: int,
                   bn: int, tm: int, tn: int, g: Gemm, rows: int) -> str:
    """The consumer warpgroups' main loop: wgmma over each stage as it lands, the stage freed a batch later."""
    return f"""\
    asm volatile("setmaxnreg.inc.sync.aligned.u32 {REGS[1]};");
    const int cw = wg - 1, warp = tid / 32, lane = tid % 32;
    const unsigned mine = sc + cw * {rows * bn * 2};  // this warpgroup's part of C's staging tile
    float d[{bn // 2}];
    int s = 0, prev = 0;
    unsigned phase = 0;
    for (int t = blockIdx.x; t < {tm * tn}; t += gridDim.x) {{
      int bi, bj;
      tile(t, bi, bj);
      #pragma unroll
      for (int q = 0; q < {bn // 2}; q++) d[q] = 0.f;
      for (int k0 = 0; k0 < {g.k}; k0 += {BK}) {{
        azyx_mbar_wait(full(s), phase);
        asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
        #pragma unroll
        for (int ks = 0; ks < {BK // 16}; ks++)
          {wgmma}(d, azyx_wgmma_desc(sa + s * {a_bytes} + cw * {rows * 128} + ks * 32, {a_fields}),
                  azyx_wgmma_desc(sb + s * {b_bytes} + ks * {b_step}, {b_fields}));
        asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
        asm volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory");  // the batch before this one is done ...
        if (k0 > 0 && lane == 0) azyx_mbar_arrive(empty(prev));  // ... and its stage free
        prev = s;
        if (++s == {stages}) {{ s = 0; phase ^= 1; }}
      }}
      asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
      if (lane == 0) azyx_mbar_arrive(empty(prev));
"""


def _epilogue(rows: int, ab: str, bn: int) -> str:
    """C through shared memory, swizzled as the TMA store reads it, then stored by TMA."""
    return f"""\
      // C through shared memory: d[4j + 0, 1] are row warp * 16 + lane / 4, columns 8j + 2 (lane % 4) + 0, 1;
      // d[4j + 2, 3] 8 rows down. Staged as {bn // 64} boxes of [{rows} rows][64 columns] with the 128-byte swizzle
      // TMA undoes, so a warp's 8 rows x 16 bytes fall in 8 distinct bank groups
      if (tid == 0) asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");  // the last tile's store has read
      azyx_sync_warpgroup(1 + cw);
      const int r = warp * 16 + lane / 4;
      #pragma unroll
      for (int j = 0; j < {bn // 8}; j++) {{
        const unsigned at = mine + (j / 8) * {rows * 128} + r * 128 + (((j % 8) ^ (r % 8)) << 4) + (lane % 4) * 4;
        asm volatile("st.shared.u32 [%0], %1;" :: "r"(at), "r"(azyx_pack_{ab}(d[4 * j], d[4 * j + 1])) : "memory");
        asm volatile("st.shared.u32 [%0], %1;" :: "r"(at + 1024), "r"(azyx_pack_{ab}(d[4 * j + 2], d[4 * j + 3]))
                     : "memory");
      }}
      asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // the TMA unit reads what these stores wrote
      azyx_sync_warpgroup(1 + cw);
      if (tid == 0) {{
        for (int q = 0; q < {bn // 64}; q++)
          azyx_tma_store(&mc, mine + q * {rows * 128}, bj + q * 64, bi + cw * {rows});
        asm volatile("cp.async.bulk.commit_group;" ::: "memory");
      }}
    }}
    if (tid == 0) asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");  // stored before the block's memory goes
  }}
}}
"""
