"""Attention as one CUDA kernel (see codegen.templates.attention for the scheme): float32 FMA (`render_cuda`), or
tensor cores where q, k and v are float16 or bfloat16 with head dims that are multiples of 16 (`render_mma`)."""

from __future__ import annotations

from azyx.codegen.dialect import Dialect
from azyx.codegen.templates.attention import (
    CUDA_BK,
    CUDA_BQ,
    CUDA_THREADS,
    LOG2E,
    batch_offsets,
    kernel_params,
    load_expr,
    rows_aligned,
)
from azyx.codegen.templates.gemm_cuda import MMA_HELPERS
from azyx.dtypes import DType, dtypes
from azyx.ir import Attention


def render_cuda(a: Attention, name: str, dl: Dialect, params: list[DType], scale: str) -> str:
    """The CUDA kernel (see the module docstring): grid (query blocks, batch points), CUDA_THREADS threads."""
    bq, bk, threads = CUDA_BQ, CUDA_BK, CUDA_THREADS
    E, Ev, L, S = a.E, a.Ev, a.L, a.S
    cols = -(-Ev // 8)  # output columns per thread: tx, tx + 8, ...
    it = "long long"
    out_t, qt, kt, vt = params[:4]
    sig = kernel_params(dl, params, scale)
    q_l, q_e = a.q[-2], a.q[-1]
    k_s, k_e = a.k[-2], a.k[-1]
    v_s, v_e = a.v[-2], a.v[-1]
    masks = ["if (key >= kend) s[r][c] = -INFINITY;"]
    if a.causal:
        masks.append("if (key > row) s[r][c] = -INFINITY;")
    if a.mask is not None:
        mval = load_expr(dl, params[4], "d4", f"mo + row * {a.mask[-2]}LL + key * {a.mask[-1]}LL")
        if a.mask_bool:
            masks.append(f"if (key < kend && row < {L} && !({mval})) s[r][c] = -INFINITY;")
        else:
            masks.append(f"if (key < kend && row < {L}) s[r][c] += ({mval}) * {LOG2E}f;")
    store = dl.stores.get(out_t.name, "{buf}[{idx}] = {val};").format(
        buf="d0", idx=f"b * {L * Ev}LL + row * {Ev}LL + col", val="o[r][j] * inv")
    kend = f"min({S}, q0 + {bq})" if a.causal else f"{S}"
    offsets = "\n  ".join(batch_offsets(a, "b", it))
    if cuda_smem(a):  # (past the 48 KiB a kernel may declare: dynamic shared memory, carved)
        shared = f"""extern __shared__ __align__(16) float azyx_dsm[];
  float (*Qs)[{E + 1}] = (float (*)[{E + 1}])azyx_dsm;
  float (*Ks)[{E + 1}] = (float (*)[{E + 1}])(azyx_dsm + {bq * (E + 1)});
  float (*Vs)[{cols * 8}] = (float (*)[{cols * 8}])(azyx_dsm + {(bq + bk) * (E + 1)});
  float (*Ps)[{bk + 1}] = (float (*)[{bk + 1}])(azyx_dsm + {(bq + bk) * (E + 1) + bk * cols * 8});"""
    else:
        shared = f"""__shared__ float Qs[{bq}][{E + 1}];
  __shared__ float Ks[{bk}][{E + 1}];
  __shared__ float Vs[{bk}][{cols * 8}];
  __shared__ float Ps[{bq}][{bk + 1}];"""
    text = f"""extern "C" __global__ void __launch_bounds__({threads}) {name}({", ".join(sig)}) {{
  {shared}
  const int tid = threadIdx.x, ty = tid >> 3, tx = tid & 7;
  const {it} b = blockIdx.y;
  const int q0 = blockIdx.x * {bq};  /* (rows and keys in int: lengths under 2^31; addresses in 64 bits) */
  {offsets}
  const float qs = (float)({scale}) * {LOG2E}f;
  for (int x = tid; x < {bq * E}; x += {threads}) {{
    const int i = x / {E}, e = x % {E};
    Qs[i][e] = q0 + i < {L} ? {load_expr(dl, qt, "d1", f"qo + (q0 + i) * {q_l}LL + e * {q_e}LL")} * qs : 0.f;
  }}
  float o[4][{cols}], m[4], l[4];
  #pragma unroll
  for (int r = 0; r < 4; r++) {{
    m[r] = -INFINITY, l[r] = 0.f;
    #pragma unroll
    for (int j = 0; j < {cols}; j++) o[r][j] = 0.f;
  }}
"""
    return (text
            + _cuda_scores(kend, bk, threads, E, Ev, dl, kt, cols, vt, k_s, k_e, v_s, v_e)
            + _cuda_softmax(cols, bk, masks)
            + _cuda_epilogue(L, cols, Ev, store))


def cuda_smem(a: Attention) -> int:
    """The float32 kernel's (`render_cuda`) dynamic shared memory in bytes: its tiles where they pass the 48 KiB a
    kernel may declare (heads over 64), else 0 (declared)."""
    nbytes = 4 * ((CUDA_BQ + CUDA_BK) * (a.E + 1) + CUDA_BK * -(-a.Ev // 8) * 8 + CUDA_BQ * (CUDA_BK + 1))
    return nbytes if nbytes > 48 << 10 else 0


def _cuda_scores(kend: str, bk: int, threads: int, E: int, Ev: int, dl: Dialect, kt: DType, cols: int, vt: DType,
                 k_s: int, k_e: int, v_s: int, v_e: int) -> str:
    """The main loop, first half: a tile of keys and values staged as float32, a thread's 4 x 4 scores."""
    return f"""\
  const int kend = {kend};
  for (int k0 = 0; k0 < kend; k0 += {bk}) {{
    __syncthreads();  /* the last tile's products are done (and, the first time, Qs is written) */
    for (int x = tid; x < {bk * E}; x += {threads}) {{
      const int j = x / {E}, e = x % {E};
      Ks[j][e] = k0 + j < kend ? {load_expr(dl, kt, "d2", f"ko + (k0 + j) * {k_s}LL + e * {k_e}LL")} : 0.f;
    }}
    for (int x = tid; x < {bk * cols * 8}; x += {threads}) {{
      const int j = x / {cols * 8}, c = x % {cols * 8};
      Vs[j][c] = k0 + j < kend && c < {Ev} ? {load_expr(dl, vt, "d3", f"vo + (k0 + j) * {v_s}LL + c * {v_e}LL")} : 0.f;
    }}
    __syncthreads();
    float s[4][4];
    #pragma unroll
    for (int r = 0; r < 4; r++)
      #pragma unroll
      for (int c = 0; c < 4; c++) s[r][c] = 0.f;
    #pragma unroll 8
    for (int e = 0; e < {E}; e++) {{
      float qv[4], kv[4];
      #pragma unroll
      for (int r = 0; r < 4; r++) qv[r] = Qs[ty * 4 + r][e];
      #pragma unroll
      for (int c = 0; c < 4; c++) kv[c] = Ks[tx + 8 * c][e];
      #pragma unroll
      for (int r = 0; r < 4; r++)
        #pragma unroll
        for (int c = 0; c < 4; c++) s[r][c] += qv[r] * kv[c];
    }}
"""


def _cuda_softmax(cols: int, bk: int, masks: list[str]) -> str:
    """The main loop, second half: the tile masked, the online softmax by the row group's shuffles, the powers
    through shared memory into the output rows."""
    return f"""\
    #pragma unroll
    for (int r = 0; r < 4; r++) {{
      const int row = q0 + ty * 4 + r;
      float top = -INFINITY;
      #pragma unroll
      for (int c = 0; c < 4; c++) {{
        const int key = k0 + tx + 8 * c;
        {" ".join(masks)}
        top = fmaxf(top, s[r][c]);
      }}
      #pragma unroll
      for (int w = 1; w < 8; w <<= 1) top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, w));
      const float mnew = fmaxf(m[r], top), ms = mnew == -INFINITY ? 0.f : mnew, alpha = exp2f(m[r] - ms);
      float sum = 0.f;
      #pragma unroll
      for (int c = 0; c < 4; c++) {{
        const float p = exp2f(s[r][c] - ms);
        Ps[ty * 4 + r][tx + 8 * c] = p;
        sum += p;
      }}
      #pragma unroll
      for (int w = 1; w < 8; w <<= 1) sum += __shfl_xor_sync(0xffffffffu, sum, w);
      l[r] = l[r] * alpha + sum, m[r] = mnew;
      #pragma unroll
      for (int j = 0; j < {cols}; j++) o[r][j] *= alpha;
    }}
    __syncwarp();  /* a row group's powers come from its own warp */
    #pragma unroll 4
    for (int j = 0; j < {bk}; j++) {{
      float pv[4];
      #pragma unroll
      for (int r = 0; r < 4; r++) pv[r] = Ps[ty * 4 + r][j];
      #pragma unroll
      for (int c = 0; c < {cols}; c++) {{
        const float vv = Vs[j][tx + 8 * c];
        #pragma unroll
        for (int r = 0; r < 4; r++) o[r][c] += pv[r] * vv;
      }}
    }}
  }}
"""


def _cuda_epilogue(L: int, cols: int, Ev: int, store: str) -> str:
    """The output rows divided by their sums and stored."""
    return f"""\
  #pragma unroll
  for (int r = 0; r < 4; r++) {{
    const int row = q0 + ty * 4 + r;
    const float inv = 1.f / l[r];
    if (row < {L})
      #pragma unroll
      for (int j = 0; j < {cols}; j++) {{
        const int col = tx + 8 * j;
        if (col < {Ev}) {store}
      }}
  }}
}}
"""


def mma_fits(a: Attention, dl: Dialect, params: list[DType]) -> bool:
    """Whether the tensor-core kernel (`render_mma`) takes `a`: float16/bfloat16 q, k, v on a dialect with tensor
    cores, E and Ev multiples of 16, rows read 16 bytes at a time (the last axis contiguous, the other strides and the
    offsets multiples of 8 elements)."""
    half = params[1] in (dtypes.float16, dtypes.bfloat16)
    aligned = all(rows_aligned(x) for x in (a.q, a.k, a.v))
    return dl.tensor_cores and half and a.E % 16 == 0 and a.Ev % 16 == 0 and aligned


def render_mma(a: Attention, name: str, dl: Dialect, params: list[DType], scale: str) -> str:
    """FlashAttention-2 on tensor cores (mma.sync m16n8k16, sm_80 on): a block of 128 threads (4 warps) walks the
    keys in tiles of BK, staged in shared memory by cp.async two stages deep (the next tile lands while this one is
    multiplied); a warp owns WM query rows (`mma_tiles`: 32 where they fit, so that each K and V fragment it reads
    from shared memory feeds two m16 tiles), q's fragments in registers. Its scores are float32 accumulators,
    scaled, masked (only on a tile that crosses the keys' end or the causal diagonal, or under a mask), turned into
    powers of 2 (ex2.approx) in registers (a row's maximum and sum across the 4 lanes that hold it) and reused as the A
    fragments (f16/bf16 pairs) of the product with V (ldmatrix.trans); the output rows are rescaled as the maxima grow
    and divided by the sums once, at the end. K and V rows are padded by 16 bytes (the 8 rows an ldmatrix reads fall
    in distinct banks); a causal tile past a warp's last row is skipped. Blocks are numbered flat, so any grid of at
    least `mma_units` blocks works (`cuda_grid`'s, of 64-row blocks, has as many or more): batch point by batch point,
    or, causal, the longest rows first."""
    kind = "f16" if params[1] is dtypes.float16 else "bf16"
    sig = kernel_params(dl, params, scale)
    return MMA_HELPERS + f"""#ifndef AZYX_ATTENTION_{kind.upper()}
#define AZYX_ATTENTION_{kind.upper()}
__device__ inline unsigned azyx_half2_{kind}(float lo, float hi) {{  /* two floats as {kind} halves, lo first */
  unsigned r; asm("cvt.rn.{kind}x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo)); return r;
}}
#endif
{EX2}extern "C" __global__ void __launch_bounds__({CUDA_THREADS}) {name}({", ".join(sig)}) {{
{_mma_body(a, dl, params, scale, kind)}
}}
"""


EX2 = """#ifndef AZYX_EX2
#define AZYX_EX2
__device__ inline float azyx_ex2(float x) { float y; asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x)); return y; }
#endif
"""  # 2^x (of x = -inf: 0), the one instruction


# the tensor-core kernel's shared memory: up to 99 KiB, the most a block may take on every GPU of compute capability
# 8.0 on (8.6 and 8.9's limit); past the 48 KiB a kernel may declare, dynamic (`mma_smem_bytes`)
MMA_SMEM = 99 << 10
MMA_MIN_BLOCKS = 132  # (an H100's multiprocessors)


def _mma_smem(a: Attention, wm: int, bk: int) -> tuple[int, int, int]:
    """The mma.sync body's shared memory in elements: (one stage of K and V, where q's rows lie, in all); q's rows
    share stage 1's space where they fit in it (their fragments are in registers before that stage is filled)."""
    stg = bk * (a.E + 8) + bk * (a.Ev + 8)
    q = 4 * wm * (a.E + 8)
    return (stg, stg, 2 * stg) if q <= stg else (stg, 2 * stg, 2 * stg + q)


def mma_tiles(a: Attention) -> tuple[int, int]:
    """(query rows per warp, keys per tile) of the mma.sync body: 32 rows (a block of 128: each K and V fragment
    read from shared memory feeds two m16 tiles) where registers and shared memory allow and there are blocks enough
    to fill the GPU, else 16; 64 keys where two stages fit, else 32."""
    def fits(wm: int, bk: int) -> bool:
        return 2 * _mma_smem(a, wm, bk)[2] <= MMA_SMEM

    wm = 32 if a.E <= 64 and a.Ev <= 64 and fits(32, 64) and mma_units(a, 32) >= MMA_MIN_BLOCKS else 16
    return wm, 64 if fits(wm, 64) else 32


def mma_smem_bytes(a: Attention) -> int:
    """The tensor-core kernel's dynamic shared memory in bytes (0: declared, within 48 KiB)."""
    nbytes = 2 * _mma_smem(a, *mma_tiles(a))[2]
    return nbytes if nbytes > 48 << 10 else 0


def mma_units(a: Attention, wm: int) -> int:
    """The mma.sync body's blocks: (batch point, block of 4 * wm query rows)."""
    return a.batch_size * -(-a.L // (4 * wm))


def _common(a: Attention, dl: Dialect, params: list[DType], scale: str, kind: str, bq: int) -> dict[str, str]:
    """The block's unit (batch point and first row), the operands, the store of a pair of output columns (`at`: the
    element offset; the values o0, o1)."""
    it = "long long"
    nqb = -(-a.L // bq)
    out_t = params[0]
    if out_t is params[1]:  # the output in q's half dtype: two columns a 32-bit store
        store = f"*(unsigned*)(d0 + at) = azyx_half2_{kind}(o0, o1);"
    else:
        store = " ".join(dl.stores.get(out_t.name, "{buf}[{idx}] = {val};").format(buf="d0", idx=f"at + {c}",
                                                                                     val=f"o{c}") for c in range(2))
    if a.causal:
        unit = f"const int qb = {nqb - 1} - id / {a.batch_size}; const {it} b = id % {a.batch_size};"
    else:
        unit = f"const int qb = id % {nqb}; const {it} b = id / {nqb};"
    offsets = "\n  ".join(batch_offsets(a, "b", it))
    head = f"""  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int id = blockIdx.y * gridDim.x + blockIdx.x;
  if (id >= {nqb * a.batch_size}) return;
  {unit}
  const int q0 = qb * {bq};  /* the block's first row (rows and keys in int; addresses in 64 bits) */
  {offsets}
  const float qs = (float)({scale}) * {LOG2E}f;
  const unsigned short* Q = (const unsigned short*)d1;
  const unsigned short* K = (const unsigned short*)d2;
  const unsigned short* V = (const unsigned short*)d3;
  const int kend = {f"min({a.S}, q0 + {bq})" if a.causal else a.S};"""
    return {"head": head, "store": store}


def _stage(buf: str, off: str, origin: str, stride: int, width: int, rows: int, bound: str, at: str) -> str:
    """Start copying rows origin.. of an operand (at element `off`) into shared memory, 16 bytes (8 elements) a
    cp.async, zeros past `bound`; `at`: the shared byte address of row r's chunk c (elements)."""
    per = width // 8
    return f"""#pragma unroll
    for (int x = tid; x < {rows * per}; x += {CUDA_THREADS}) {{
      const int r = x / {per}, c = x % {per} * 8;
      const bool ok = {origin} + r < {bound};
      azyx_cp16({at}, ok ? {buf} + {off} + ({origin} + r) * {stride}LL + c : {buf}, ok ? 16 : 0);
    }}"""


def _softmax(a: Attention, dl: Dialect, params: list[DType], groups: int, bk: int, row0: str, masked: bool) -> str:
    """Scores sc[i][n][q] of row group i (its first row `row0`, with i) -> their maxima (ms: 0 for a row all masked so
    far) and the rescales alpha of earlier sums and outputs."""
    body = "float s = sc[i][n][q] * qs;"
    if masked:
        body = f"const int key = k0 + n * 8 + (lane & 3) * 2 + (q & 1);\n              {body}"
        body += "\n              if (key >= kend) s = -INFINITY;"
        if a.causal or a.mask is not None:
            body = f"const int row = {row0} + (lane >> 2) + 8 * (q >> 1);\n              {body}"
        if a.causal:
            body += "\n              if (key > row) s = -INFINITY;"
        if a.mask is not None:
            mval = load_expr(dl, params[4], "d4", f"mo + row * {a.mask[-2]}LL + key * {a.mask[-1]}LL")
            body += (f"\n              if (key < kend && row < {a.L} && !({mval})) s = -INFINITY;" if a.mask_bool
                     else f"\n              if (key < kend && row < {a.L}) s += ({mval}) * {LOG2E}f;")
    return f"""float top[{groups}][2];
        #pragma unroll
        for (int i = 0; i < {groups}; i++) top[i][0] = top[i][1] = -INFINITY;
        #pragma unroll
        for (int i = 0; i < {groups}; i++)
          #pragma unroll
          for (int n = 0; n < {bk // 8}; n++)
            #pragma unroll
            for (int q = 0; q < 4; q++) {{
              {body}
              sc[i][n][q] = s;
              top[i][q >> 1] = fmaxf(top[i][q >> 1], s);
            }}
        #pragma unroll
        for (int i = 0; i < {groups}; i++)
          #pragma unroll
          for (int h = 0; h < 2; h++) {{
            float t = fmaxf(top[i][h], __shfl_xor_sync(0xffffffffu, top[i][h], 1));
            t = fmaxf(t, __shfl_xor_sync(0xffffffffu, t, 2));
            const float mnew = fmaxf(m[i][h], t);
            ms[i][h] = mnew == -INFINITY ? 0.f : mnew;
            alpha[i][h] = azyx_ex2(m[i][h] - ms[i][h]);
            m[i][h] = mnew;
          }}"""


def _powers(groups: int, bk: int, ev: int, kind: str) -> str:
    """The scores' powers of 2 as A fragments pf (the accumulators' layout is the A operand's), the sums and the
    output rows rescaled."""
    return f"""#pragma unroll
      for (int i = 0; i < {groups}; i++) {{
        float s0 = 0.f, s1 = 0.f;
        #pragma unroll
        for (int n = 0; n < {bk // 8}; n++) {{
          const float p0 = azyx_ex2(sc[i][n][0] - ms[i][0]), p1 = azyx_ex2(sc[i][n][1] - ms[i][0]);
          const float p2 = azyx_ex2(sc[i][n][2] - ms[i][1]), p3 = azyx_ex2(sc[i][n][3] - ms[i][1]);
          s0 += p0 + p1, s1 += p2 + p3;
          pf[i][n >> 1][(n & 1) * 2] = azyx_half2_{kind}(p0, p1);
          pf[i][n >> 1][(n & 1) * 2 + 1] = azyx_half2_{kind}(p2, p3);
        }}
        l[i][0] = l[i][0] * alpha[i][0] + s0, l[i][1] = l[i][1] * alpha[i][1] + s1;
        #pragma unroll
        for (int n = 0; n < {ev // 8}; n++)
          #pragma unroll
          for (int q = 0; q < 4; q++) o[i][n][q] *= alpha[i][q >> 1];
      }}"""


def _epilogue(groups: int, ev: int, L: int, row0: str, store: str) -> str:
    """The rows' sums across their 4 lanes, the output rows divided by them and stored."""
    return f"""  float inv[{groups}][2];
  #pragma unroll
  for (int i = 0; i < {groups}; i++)
    #pragma unroll
    for (int h = 0; h < 2; h++) {{
      float t = l[i][h] + __shfl_xor_sync(0xffffffffu, l[i][h], 1);
      t += __shfl_xor_sync(0xffffffffu, t, 2);
      inv[i][h] = 1.f / t;
    }}
  #pragma unroll
  for (int i = 0; i < {groups}; i++)
    #pragma unroll
    for (int h = 0; h < 2; h++) {{
      const int row = {row0} + (lane >> 2) + 8 * h;
      if (row < {L})
        #pragma unroll
        for (int n = 0; n < {ev // 8}; n++) {{
          const long long at = b * {L * ev}LL + row * {ev}LL + n * 8 + (lane & 3) * 2;
          const float o0 = o[i][n][2 * h] * inv[i][h], o1 = o[i][n][2 * h + 1] * inv[i][h];
          {store}
        }}
    }}"""


def _state(groups: int, ev: int) -> str:
    return f"""  float o[{groups}][{ev // 8}][4], m[{groups}][2], l[{groups}][2];
  #pragma unroll
  for (int i = 0; i < {groups}; i++) {{
    m[i][0] = m[i][1] = -INFINITY, l[i][0] = l[i][1] = 0.f;
    #pragma unroll
    for (int n = 0; n < {ev // 8}; n++)
      #pragma unroll
      for (int q = 0; q < 4; q++) o[i][n][q] = 0.f;
  }}"""


def _mma_body(a: Attention, dl: Dialect, params: list[DType], scale: str, kind: str) -> str:
    """mma.sync m16n8k16: a warp owns WM query rows (`mma_tiles`), q's fragments in registers; its K and V fragments
    by ldmatrix from rows padded by 16 bytes (the 8 rows an ldmatrix reads fall in distinct banks); a causal tile
    past the warp's last row is skipped."""
    (wm, bk), mt = mma_tiles(a), mma_tiles(a)[0] // 16
    bq, E, Ev = 4 * wm, a.E, a.Ev
    rk, rv = E + 8, Ev + 8  # shared row strides (elements)
    stg, q_at, total = _mma_smem(a, wm, bk)
    c = _common(a, dl, params, scale, kind, bq)
    live = f"k0 <= w0 + {wm - 1}" if a.causal else "true"
    edge = "true" if a.mask is not None else "k1 > kend" + (" || k1 - 1 > w0" if a.causal else "")
    row0 = "w0 + i * 16"
    qfrag = "\n".join(f"    azyx_ldm4(qf[i][{kk}], qa + {kk * 32});" for kk in range(E // 16))
    decl = "extern __shared__ __align__(16) unsigned short sm[]" if mma_smem_bytes(a) else \
        f"__shared__ __align__(16) unsigned short sm[{total}]"
    text = f"""  {decl};  /* 2 stages of K ({bk} x {rk}), V; q */
{c["head"]}
  const int w0 = q0 + warp * {wm};  /* the warp's first row */
  const unsigned sb = azyx_smem(sm);
  {_stage("Q", "qo", "q0", a.q[-2], E, bq, str(a.L), f"sb + ({q_at} + r * {rk} + c) * 2")}
  {_stage("K", "ko", "0", a.k[-2], E, bk, "kend", f"sb + (r * {rk} + c) * 2")}
  {_stage("V", "vo", "0", a.v[-2], Ev, bk, "kend", f"sb + ({bk * rk} + r * {rv} + c) * 2")}
  asm volatile("cp.async.commit_group;" ::: "memory");
  asm volatile("cp.async.wait_group 0;" ::: "memory");
  __syncthreads();
  unsigned qf[{mt}][{E // 16}][4];
  #pragma unroll
  for (int i = 0; i < {mt}; i++) {{
    const unsigned qa = sb + ({q_at} + (warp * {wm} + i * 16 + (lane & 15)) * {rk} + (lane >> 4) * 8) * 2;
{qfrag}
  }}
  __syncthreads();  /* (q's rows may share stage 1's space) */
{_state(mt, Ev)}
  /* a lane's ldmatrix rows: K (keys, non-transposed) and V (keys, transposed), as byte offsets in a stage */
  const unsigned kl = (((lane & 7) + (lane >> 4) * 8) * {rk} + ((lane >> 3) & 1) * 8) * 2;
  const unsigned vl = {bk * rk * 2} + (((lane & 7) + ((lane >> 3) & 1) * 8) * {rv} + (lane >> 4) * 8) * 2;
"""
    return (text
            + _mma_key_tiles(bk, live, mt, kind, edge, stg, E, Ev, rk, a, dl, params, row0, rv, c))


def _mma_key_tiles(bk: int, live: str, mt: int, kind: str, edge: str, stg: int, E: int, Ev: int, rk: int, a: Attention,
                   dl: Dialect, params: list[DType], row0: str, rv: int, c: dict[str, str]) -> str:
    """The main loop over tiles of keys, the next copied into the other stage meanwhile: scores on tensor cores,
    the online softmax, the powers times V on tensor cores; then the epilogue."""
    return f"""\
  for (int k0 = 0, st = 0; k0 < kend; k0 += {bk}, st ^= 1) {{
    const int k1 = k0 + {bk};
    if (k1 < kend) {{  /* the next tile into the other stage, which every warp is done with */
      const unsigned nb = sb + (st ^ 1) * {stg * 2};
      {_stage("K", "ko", "k1", a.k[-2], E, bk, "kend", f"nb + (r * {rk} + c) * 2")}
      {_stage("V", "vo", "k1", a.v[-2], Ev, bk, "kend", f"nb + ({bk * rk} + r * {rv} + c) * 2")}
    }}
    asm volatile("cp.async.commit_group;" ::: "memory");
    if ({live}) {{  /* (causal: a tile past the warp's last row is skipped) */
      const unsigned cb = sb + st * {stg * 2};
      float sc[{mt}][{bk // 8}][4];
      #pragma unroll
      for (int i = 0; i < {mt}; i++)
        #pragma unroll
        for (int n = 0; n < {bk // 8}; n++)
          #pragma unroll
          for (int q = 0; q < 4; q++) sc[i][n][q] = 0.f;
      #pragma unroll
      for (int kk = 0; kk < {E // 16}; kk++)
        #pragma unroll
        for (int np = 0; np < {bk // 16}; np++) {{
          unsigned fb[4];
          azyx_ldm4(fb, cb + kl + (np * {16 * rk} + kk * 16) * 2);
          #pragma unroll
          for (int i = 0; i < {mt}; i++) {{
            azyx_mma_{kind}(sc[i][2 * np], qf[i][kk], fb);
            azyx_mma_{kind}(sc[i][2 * np + 1], qf[i][kk], fb + 2);
          }}
        }}
      float ms[{mt}][2], alpha[{mt}][2];
      if ({edge}) {{
        {_softmax(a, dl, params, mt, bk, row0, True)}
      }} else {{
        {_softmax(a, dl, params, mt, bk, row0, False)}
      }}
      unsigned pf[{mt}][{bk // 16}][4];
      {_powers(mt, bk, Ev, kind)}
      #pragma unroll
      for (int t = 0; t < {bk // 16}; t++)
        #pragma unroll
        for (int np = 0; np < {Ev // 16}; np++) {{
          unsigned fb[4];
          azyx_ldm4t(fb, cb + vl + (t * {16 * rv} + np * 16) * 2);
          #pragma unroll
          for (int i = 0; i < {mt}; i++) {{
            azyx_mma_{kind}(o[i][2 * np], pf[i][t], fb);
            azyx_mma_{kind}(o[i][2 * np + 1], pf[i][t], fb + 2);
          }}
        }}
    }}
    asm volatile("cp.async.wait_group 0;" ::: "memory");  /* the next tile has landed */
    __syncthreads();  /* ... for every thread, and every warp is done with this stage */
  }}
{_epilogue(mt, Ev, a.L, row0, c["store"])}"""
