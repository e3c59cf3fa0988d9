"""Attention as one kernel, for dialects that declare it (C, CUDA): `softmax(q k^T * scale + mask) v` that never
holds more of the (L, S) score matrix than one block of it (the FlashAttention scheme: an online softmax).

A kernel of the IR whose one store is an "attention" value (azyx.ir.Attention, which azyx.schedule builds from an
ATTENTION node) renders here instead of through the generic C-family path; launch.py picks the template.

C (`render_c`): a parallel part is a block of BQ query rows of one batch point. The rows, scaled by scale * log2(e)
(so the softmax is a power of 2), are packed into a contiguous float block; keys and values come in blocks of BK,
packed too (k transposed, so a score row is a run of vector lanes; any layout and dtype is read once, as float).
Per key block: the BQ x BK scores by a register-tiled product (6 rows x 16 keys: twelve 8-lane accumulators), the
mask, the running row maxima and sums, and the output block rescaled and accumulated by a second register-tiled
product (6 rows x 16 columns). The inner loops are GCC vector extensions (AVX2 where the machine has it) and a
polynomial exp2 on 8 lanes. Causal key blocks past a query block's last row are skipped.

CUDA (`render_cuda`): FlashAttention-2's split, on float32 FMA: a block of 128 threads owns 64 query rows (staged in
shared memory once, scaled) and walks the keys in tiles of 32 (K and V staged in shared memory, any dtype converted to
float32 as it is staged). A thread computes a 4 x 4 tile of the scores (rows ty*4.., keys tx, tx+8, ..), the 8 threads
of a row group combine row maxima and sums by warp shuffles, the powers go through shared memory, and the thread
accumulates its 4 rows x Ev/8 columns of the output in registers, rescaled as the maxima grow.
"""

from __future__ import annotations

from azyx.cstyle import Dialect
from azyx.dtypes import DType
from azyx.ir import Attention, Kernel

LOG2E = 1.4426950408889634
C_BQ, C_BK, C_ROWS = 48, 64, 6  # C: query rows per part, keys per block, rows of a register tile
C_MAX_HEAD = 256  # the longest E and Ev the C kernel takes (its blocks live on the stack)
CUDA_MAX_HEAD = 64  # (its tiles fill the 48 KiB of shared memory a kernel may declare)
CUDA_BQ, CUDA_BK, CUDA_THREADS = 64, 32, 128  # CUDA: query rows per block, keys per tile, threads per block


def fits(dl: Dialect, L: int, S: int, E: int, Ev: int) -> bool:
    """Whether the dialect's attention kernel takes these lengths (else the composed form runs)."""
    if not dl.attention:
        return False
    most = CUDA_MAX_HEAD if dl.global_ids else C_MAX_HEAD
    return 0 < E <= most and 0 < Ev <= most and L > 0 and S > 0


def render(k: Kernel, a: Attention, name: str, dl: Dialect) -> str:
    """The kernel's source in dialect `dl` (C or CUDA); its scale is scalar parameter sc0, or a literal."""
    s = k.stores[0][1].src[0]
    scale = "sc0" if s.op == "arg" else repr(float(s.arg))
    if dl.global_ids:
        return render_cuda(a, name, dl, k.params, scale)
    return render_c(a, name, dl, k.params, scale)


def cuda_grid(a: Attention) -> tuple[int, int, int]:
    return -(-a.L // CUDA_BQ), a.batch_size, 1


def parts(a: Attention) -> int:
    """The C kernel's parallel parts: (batch point, block of query rows)."""
    return a.batch_size * -(-a.L // C_BQ)


def work(a: Attention) -> int:
    """Multiply-adds in all (for launch decisions and statistics)."""
    keys = a.S if not a.causal else min(a.S, (a.L + 1) // 2 + 1)
    return a.batch_size * a.L * keys * (a.E + a.Ev)


def _offsets(a: Attention, index: str, it: str) -> list[str]:
    """Lines that set qo, ko, vo (and mo) to the element offsets of batch point `index` in each operand."""
    ops = [("qo", a.q), ("ko", a.k), ("vo", a.v)] + ([("mo", a.mask)] if a.mask is not None else [])
    lines = [f"{it} {name} = {spec[0]};" for name, spec in ops]
    if not a.batch:
        return lines
    lines.append(f"{it} rest = {index}, c;")
    for ax in reversed(range(len(a.batch))):
        lines.append(f"c = rest % {a.batch[ax]}; rest /= {a.batch[ax]};")
        lines += [f"{name} += c * {spec[1 + ax]};" for name, spec in ops if spec[1 + ax]]
    return lines


def _params(dl: Dialect, params: list[DType], scale: str) -> list[str]:
    """The kernel's parameters: the output, the operands (read-only), the scale where it is a scalar argument."""
    out = [f"{'const ' if i else ''}{dl.ctype(d)}* {dl.restrict} d{i}" for i, d in enumerate(params)]
    return out + ([f"float {scale}"] if scale.startswith("sc") else [])


def _load(dl: Dialect, d: DType, buf: str, idx: str) -> str:
    return dl.loads.get(d.name, "{buf}[{idx}]").format(buf=buf, idx=idx)


_C_HELPERS = """#ifndef AZYX_ATTENTION_HELPERS
#define AZYX_ATTENTION_HELPERS
typedef float azyx_v8 __attribute__((vector_size(32), may_alias));
typedef int azyx_v8i __attribute__((vector_size(32), may_alias));
#define AZYX_V8(x) ((azyx_v8){x, x, x, x, x, x, x, x})
static inline azyx_v8 azyx_ld8(const float* p) { return *(const azyx_v8*)p; }
static inline void azyx_st8(float* p, azyx_v8 x) { *(azyx_v8*)p = x; }
static inline azyx_v8 azyx_max8(azyx_v8 a, azyx_v8 b) {
  azyx_v8i gt = a > b; return (azyx_v8)(((azyx_v8i)a & gt) | ((azyx_v8i)b & ~gt));
}
/* 2^x on 8 lanes for x <= 0 (a score less the row's maximum): 2^round(x) by its exponent bits times a polynomial of
   the rest (degree 7, relative error ~1e-8 on [-1/2, 1/2]); below -126 (a masked key's -inf too) it is 0 */
static inline azyx_v8 azyx_exp2_8(azyx_v8 x) {
  azyx_v8i low = x < AZYX_V8(-126.f);
  x = (azyx_v8)(((azyx_v8i)x & ~low) | ((azyx_v8i)AZYX_V8(-126.f) & low));
  azyx_v8 n = (x + AZYX_V8(12582912.f)) - AZYX_V8(12582912.f), f = x - n;
  azyx_v8 p = f * AZYX_V8(1.5252733804e-5f) + AZYX_V8(1.5403530393e-4f);
  p = p * f + AZYX_V8(1.3333558146e-3f);
  p = p * f + AZYX_V8(9.6181291076e-3f);
  p = p * f + AZYX_V8(5.5504108665e-2f);
  p = p * f + AZYX_V8(2.4022650696e-1f);
  p = p * f + AZYX_V8(6.9314718056e-1f);
  p = p * f + AZYX_V8(1.f);
  azyx_v8i e = (__builtin_convertvector(n, azyx_v8i) + 127) << 23;
  return (azyx_v8)((azyx_v8i)(p * (azyx_v8)e) & ~low);
}
static inline float azyx_hmax8(azyx_v8 x) {
  float m = x[0]; for (int i = 1; i < 8; i++) m = x[i] > m ? x[i] : m; return m;
}
static inline float azyx_hsum8(azyx_v8 x) {
  return ((x[0] + x[4]) + (x[1] + x[5])) + ((x[2] + x[6]) + (x[3] + x[7]));
}
#endif
"""


def _tile(rows: int, a_row: str, a_col: str, b_at: str, loop: str, out: str, load_acc: bool) -> str:
    """A register tile: `rows` x 16 accumulators (two 8-lane vectors a row) += a[r][x] * b[x][16 lanes] over `loop`.
    a_row: the row r's pointer expression with {r}; a_col: the index along x; b_at: the address of b's row x."""
    r_ = range(rows)
    init = [f"azyx_v8 c{r}0 = {'azyx_ld8(' + out.format(r=r) + ')' if load_acc else 'AZYX_V8(0.f)'}, "
            f"c{r}1 = {'azyx_ld8(' + out.format(r=r) + ' + 8)' if load_acc else 'AZYX_V8(0.f)'};" for r in r_]
    body = [f"{{ const float x = {a_row.format(r=r)}[{a_col}]; c{r}0 += x * b0; c{r}1 += x * b1; }}" for r in r_]
    store = [f"azyx_st8({out.format(r=r)}, c{r}0); azyx_st8({out.format(r=r)} + 8, c{r}1);" for r in r_]
    return "\n".join([
        "{", *init, f"{loop} {{",
        f"  const azyx_v8 b0 = azyx_ld8({b_at}), b1 = azyx_ld8({b_at} + 8);",
        *("  " + b for b in body), "}", *store, "}"])


def render_c(a: Attention, name: str, dl: Dialect, params: list[DType], scale: str) -> str:
    """The C kernel (see the module docstring): `name(lo, hi, out, q, k, v[, mask], scalars...)` over parts lo..hi."""
    bq, bk, R = C_BQ, C_BK, C_ROWS
    E, Ev, L, S = a.E, a.Ev, a.L, a.S
    evp = -(-Ev // 16) * 16
    nqb = -(-L // bq)
    it = "long"
    out_t, qt, kt, vt = params[:4]
    sig = [f"{it} lo", f"{it} hi", *_params(dl, params, scale)]
    q_l, q_e = a.q[-2], a.q[-1]
    k_s, k_e = a.k[-2], a.k[-1]
    v_s, v_e = a.v[-2], a.v[-1]
    mask_lines = []
    if a.mask is not None:
        m_l, m_s = a.mask[-2], a.mask[-1]
        at = f"mo + (q0 + i) * {m_l}L + (k0 + j) * {m_s}L"
        mval = _load(dl, params[4], "d4", at)
        if a.mask_bool:
            mask_lines.append(f"if (j < kn && !({mval})) row[j] = -INFINITY;")
        else:
            mask_lines.append(f"if (j < kn) row[j] += ({mval}) * {LOG2E}f;")
    need = ["kn < " + str(bk)]
    if a.causal:
        mask_lines.append("if (k0 + j > q0 + i) row[j] = -INFINITY;")
        need.append(f"k0 + {bk - 1} > q0 + i")
    if a.mask is not None:
        need = ["1"]
    mask_lines.append("if (j >= kn) row[j] = -INFINITY;")
    store = dl.stores.get(out_t.name, "{buf}[{idx}] = {val};").format(
        buf="d0", idx=f"oo + (q0 + i) * {Ev}L + c", val="O[i][c] * inv")
    kend = f"q0 + qn < {S} ? q0 + qn : {S}" if a.causal else str(S)
    qk = _tile(R, "Q[i0 + {r}]", "e", "&KT[e][j0]", f"for (int e = 0; e < {E}; e++)", "&P[i0 + {r}][j0]", False)
    pv = _tile(R, "P[i0 + {r}]", "j", "&Vb[j][c0]", "for (int j = 0; j < kn; j++)", "&O[i0 + {r}][c0]", True)
    offsets = "\n    ".join(_offsets(a, "b", it))
    return _C_HELPERS + f"""{dl.kernel_prefix} {name}({", ".join(sig)}) {{
  _Alignas(64) float Q[{bq}][{E}];  /* the query rows, times scale * log2(e) */
  _Alignas(64) float KT[{E}][{bk}];  /* the key block, transposed */
  _Alignas(64) float Vb[{bk}][{evp}];
  _Alignas(64) float P[{bq}][{bk}];  /* scores, then their powers of 2 */
  _Alignas(64) float O[{bq}][{evp}];
  float m[{bq}], l[{bq}];
  const float qs = (float)({scale}) * {LOG2E}f;
  for ({it} part = lo; part < hi; part++) {{
    const {it} b = part / {nqb}, q0 = part % {nqb} * {bq};
    const int qn = {L} - q0 < {bq} ? (int)({L} - q0) : {bq}, qr = (qn + {R - 1}) / {R} * {R};
    const {it} oo = b * {L * Ev}L;
    {offsets}
    for (int i = 0; i < {bq}; i++)
      for (int e = 0; e < {E}; e++)
        Q[i][e] = i < qn ? {_load(dl, qt, "d1", f"qo + (q0 + i) * {q_l}L + e * {q_e}L")} * qs : 0.f;
    for (int i = 0; i < {bq}; i++) {{
      m[i] = -INFINITY, l[i] = 0.f;
      for (int c = 0; c < {evp}; c++) O[i][c] = 0.f;
    }}
    const {it} kend = {kend};
    for ({it} k0 = 0; k0 < kend; k0 += {bk}) {{
      const int kn = kend - k0 < {bk} ? (int)(kend - k0) : {bk};
      for (int j = 0; j < {bk}; j++) {{
        for (int e = 0; e < {E}; e++)
          KT[e][j] = j < kn ? {_load(dl, kt, "d2", f"ko + (k0 + j) * {k_s}L + e * {k_e}L")} : 0.f;
        for (int c = 0; c < {evp}; c++)
          Vb[j][c] = j < kn && c < {Ev} ? {_load(dl, vt, "d3", f"vo + (k0 + j) * {v_s}L + c * {v_e}L")} : 0.f;
      }}
      for (int i0 = 0; i0 < qr; i0 += {R})
        for (int j0 = 0; j0 < {bk}; j0 += 16)
{_indent(qk, 10)}
      for (int i = 0; i < qn; i++) {{
        float* row = P[i];
        if ({" || ".join(need)})
          for (int j = 0; j < {bk}; j++) {{
            {" ".join(mask_lines)}
          }}
        azyx_v8 mx = azyx_ld8(row);
        for (int j = 8; j < {bk}; j += 8) mx = azyx_max8(mx, azyx_ld8(row + j));
        const float top = azyx_hmax8(mx), mnew = top > m[i] ? top : m[i], ms = mnew == -INFINITY ? 0.f : mnew;
        const float alpha = exp2f(m[i] - ms);
        azyx_v8 sum = AZYX_V8(0.f);
        for (int j = 0; j < {bk}; j += 8) {{
          const azyx_v8 p = azyx_exp2_8(azyx_ld8(row + j) - AZYX_V8(ms));
          azyx_st8(row + j, p);
          sum += p;
        }}
        l[i] = l[i] * alpha + azyx_hsum8(sum), m[i] = mnew;
        if (alpha != 1.f)
          for (int c = 0; c < {evp}; c++) O[i][c] *= alpha;
      }}
      for (int i0 = 0; i0 < qr; i0 += {R})
        for (int c0 = 0; c0 < {evp}; c0 += 16)
{_indent(pv, 10)}
    }}
    for (int i = 0; i < qn; i++) {{
      const float inv = 1.f / l[i];
      for (int c = 0; c < {Ev}; c++) {store}
    }}
  }}
}}
"""


def _indent(text: str, n: int) -> str:
    return "\n".join(" " * n + line for line in text.splitlines())


def render_cuda(a: Attention, name: str, dl: Dialect, params: list[DType], scale: str) -> str:
    """The CUDA kernel (see the module docstring): grid (query blocks, batch points), CUDA_THREADS threads."""
    bq, bk, threads = CUDA_BQ, CUDA_BK, CUDA_THREADS
    E, Ev, L, S = a.E, a.Ev, a.L, a.S
    cols = -(-Ev // 8)  # output columns per thread: tx, tx + 8, ...
    it = "long long"
    out_t, qt, kt, vt = params[:4]
    sig = _params(dl, params, scale)
    q_l, q_e = a.q[-2], a.q[-1]
    k_s, k_e = a.k[-2], a.k[-1]
    v_s, v_e = a.v[-2], a.v[-1]
    masks = ["if (key >= kend) s[r][c] = -INFINITY;"]
    if a.causal:
        masks.append("if (key > row) s[r][c] = -INFINITY;")
    if a.mask is not None:
        mval = _load(dl, params[4], "d4", f"mo + row * {a.mask[-2]}LL + key * {a.mask[-1]}LL")
        if a.mask_bool:
            masks.append(f"if (key < kend && row < {L} && !({mval})) s[r][c] = -INFINITY;")
        else:
            masks.append(f"if (key < kend && row < {L}) s[r][c] += ({mval}) * {LOG2E}f;")
    store = dl.stores.get(out_t.name, "{buf}[{idx}] = {val};").format(
        buf="d0", idx=f"b * {L * Ev}LL + row * {Ev}LL + col", val="o[r][j] * inv")
    kend = f"min({S}LL, q0 + {bq}LL)" if a.causal else f"{S}LL"
    offsets = "\n  ".join(_offsets(a, "b", it))
    return f"""extern "C" __global__ void __launch_bounds__({threads}) {name}({", ".join(sig)}) {{
  __shared__ float Qs[{bq}][{E + 1}];
  __shared__ float Ks[{bk}][{E + 1}];
  __shared__ float Vs[{bk}][{cols * 8}];
  __shared__ float Ps[{bq}][{bk + 1}];
  const int tid = threadIdx.x, ty = tid >> 3, tx = tid & 7;
  const {it} b = blockIdx.y, q0 = (long long)blockIdx.x * {bq};
  {offsets}
  const float qs = (float)({scale}) * {LOG2E}f;
  for (int x = tid; x < {bq * E}; x += {threads}) {{
    const int i = x / {E}, e = x % {E};
    Qs[i][e] = q0 + i < {L} ? {_load(dl, qt, "d1", f"qo + (q0 + i) * {q_l}LL + e * {q_e}LL")} * qs : 0.f;
  }}
  float o[4][{cols}], m[4], l[4];
  #pragma unroll
  for (int r = 0; r < 4; r++) {{
    m[r] = -INFINITY, l[r] = 0.f;
    #pragma unroll
    for (int j = 0; j < {cols}; j++) o[r][j] = 0.f;
  }}
  const {it} kend = {kend};
  for ({it} k0 = 0; k0 < kend; k0 += {bk}) {{
    __syncthreads();  /* the last tile's products are done (and, the first time, Qs is written) */
    for (int x = tid; x < {bk * E}; x += {threads}) {{
      const int j = x / {E}, e = x % {E};
      Ks[j][e] = k0 + j < kend ? {_load(dl, kt, "d2", f"ko + (k0 + j) * {k_s}LL + e * {k_e}LL")} : 0.f;
    }}
    for (int x = tid; x < {bk * cols * 8}; x += {threads}) {{
      const int j = x / {cols * 8}, c = x % {cols * 8};
      Vs[j][c] = k0 + j < kend && c < {Ev} ? {_load(dl, vt, "d3", f"vo + (k0 + j) * {v_s}LL + c * {v_e}LL")} : 0.f;
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
    #pragma unroll
    for (int r = 0; r < 4; r++) {{
      const {it} row = q0 + ty * 4 + r;
      float top = -INFINITY;
      #pragma unroll
      for (int c = 0; c < 4; c++) {{
        const {it} key = k0 + tx + 8 * c;
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
  #pragma unroll
  for (int r = 0; r < 4; r++) {{
    const {it} row = q0 + ty * 4 + r;
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
