"""Attention as one kernel, for dialects that declare it (C, CUDA): `softmax(q k^T * scale + mask) v` that never
holds more of the (L, S) score matrix than one block of it (the FlashAttention scheme: an online softmax).

A kernel of the IR whose one store is an "attention" value (azyx.ir.Attention, which azyx.schedule builds from an
ATTENTION node) renders here instead of through the generic C-family path; launch.py picks the template.

C (`render_c`): a parallel part is a block of BQ query rows of one batch point, laid out transposed so that the
vector lanes run along the queries: every step of the online softmax (a query's running maximum and sum, its rescaled
output) is lane-wise, with no horizontal reductions. The queries, times scale * log2(e) (the softmax is then a power
of 2), are packed once per part (Q^T, E x BQ). Per block of BK keys: the scores S^T (BK x BQ) by a register tile of
32 queries (3 keys x four 8-lane accumulators with AVX2, 4 keys x two 16-lane ones with AVX-512: C_TILES), each key's
element broadcast from k where it lies; the mask, the running maxima and sums and the powers (a polynomial exp2 on
the vector's lanes), the output O^T (Ev x BQ) rescaled, then O^T += V^T P^T by the same tile (output columns x 32
queries, v's elements broadcast where they lie). k and v are read in place when they are float32 along their last
axis, else each block is packed as float32 first. The inner loops are GCC vector extensions of the device's vector
width (Dialect.simd). Causal key blocks past a part's last query are skipped.

CUDA: FlashAttention-2's split, a block of 128 threads per block of query rows of one batch point, walking the keys
in tiles staged in shared memory. float16/bfloat16 with head dims that are multiples of 16 (`render_mma`): tensor cores
(mma.sync m16n8k16), a warp's 16 or 32 rows of q as fragments in registers (32: blocks of 128 rows, where there are
blocks enough), scores and powers in float32 accumulators that become the A fragments of the product with V, K and V
tiles of 64 keys copied two stages deep by cp.async. Otherwise (`render_cuda`) float32 FMA: q staged once, tiles of
32 keys converted to float32 as they are staged; a thread computes a 4 x 4 tile of the scores, the 8 threads of a row
group combine row maxima and sums by warp shuffles, the powers go through shared memory, and the thread accumulates
its 4 rows x Ev/8 output columns in registers.
"""

from __future__ import annotations

from azyx.codegen.dialect import Dialect
from azyx.codegen.templates.gemm_cuda import MMA_HELPERS
from azyx.dtypes import DType, dtypes
from azyx.ir import Attention, Kernel

LOG2E = 1.4426950408889634
# C: vector lanes -> a register tile's rows (keys, or output columns) x vectors (queries): 32 queries a tile either
# way, 12 accumulators of 8 lanes (AVX2) or 8 of 16 (AVX-512: half the instructions, eight chains of FMAs in flight)
C_TILES = {8: (3, 4), 16: (4, 2)}
C_BQ, C_BK = 64, 64  # C: query rows per part (two tiles), keys per block
C_MAX_HEAD = 256  # the longest E and Ev the C kernel takes (its blocks live on the stack)
CUDA_MAX_HEAD = 64  # (its tiles fill the 48 KiB of shared memory a kernel may declare)
MMA_MAX_HEAD = 128  # the tensor-core kernel's longest E and Ev (tiles of 32 keys, two stages, in 48 KiB)
CUDA_BQ, CUDA_BK, CUDA_THREADS = 64, 32, 128  # CUDA: query rows per block, keys per tile, threads per block


def fits(dl: Dialect, L: int, S: int, E: int, Ev: int, dtype: DType | None = None) -> bool:
    """Whether the dialect's attention kernel takes these lengths for q of `dtype` (else the composed form runs). On a
    GPU, heads longer than CUDA_MAX_HEAD take the tensor-core kernel alone, which reads q, k and v with aligned rows
    (`rows_aligned`: the planner copies a view that is not)."""
    if not dl.attention:
        return False
    most = C_MAX_HEAD
    if dl.global_ids:
        tensor_cores = dl.tensor_cores and dtype in (dtypes.float16, dtypes.bfloat16) and E % 16 == 0 and Ev % 16 == 0
        most = MMA_MAX_HEAD if tensor_cores else CUDA_MAX_HEAD
    return 0 < E <= most and 0 < Ev <= most and L > 0 and S > 0


def rows_aligned(view: tuple[int, ...]) -> bool:
    """Whether an operand's view (offset, *strides) is read 16 bytes at a time by the tensor-core kernel: its last
    axis contiguous, the other strides and the offset multiples of 8 elements."""
    return view[-1] == 1 and all(s % 8 == 0 for s in view[:-1])


def render(k: Kernel, a: Attention, name: str, dl: Dialect) -> str:
    """The kernel's source in dialect `dl` (C or CUDA); its scale is scalar parameter sc0, or a literal."""
    s = k.stores[0][1].src[0]
    scale = "sc0" if s.op == "arg" else repr(float(s.arg))
    if dl.global_ids:
        if mma_fits(a, dl, k.params):
            return render_mma(a, name, dl, k.params, scale)
        return render_cuda(a, name, dl, k.params, scale)
    return render_c(a, name, dl, k.params, scale)


def cuda_grid(a: Attention) -> tuple[int, int, int]:
    """(blocks of CUDA_BQ query rows, batch points): the float32 kernel's grid, and at least as many blocks as the
    tensor-core kernel needs (it numbers its blocks flat; those past `mma_units` return at once)."""
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
typedef float azyx_v8u __attribute__((vector_size(32), aligned(4), may_alias));
static inline azyx_v8 azyx_ld8(const float* p) { return *(const azyx_v8*)p; }
static inline void azyx_st8(float* p, azyx_v8 x) { *(azyx_v8*)p = x; }
#define AZYX_V8(x) ((azyx_v8){x, x, x, x, x, x, x, x})
typedef int azyx_v8i __attribute__((vector_size(32), may_alias));
/* r[k] becomes column k of the 8 x 8 block whose rows were r[0..7] */
static inline void azyx_tr8(azyx_v8* r) {
  const azyx_v8i lo = {0, 8, 1, 9, 4, 12, 5, 13}, hi = {2, 10, 3, 11, 6, 14, 7, 15};
  const azyx_v8i l2 = {0, 1, 8, 9, 4, 5, 12, 13}, h2 = {2, 3, 10, 11, 6, 7, 14, 15};
  const azyx_v8i l4 = {0, 1, 2, 3, 8, 9, 10, 11}, h4 = {4, 5, 6, 7, 12, 13, 14, 15};
  azyx_v8 t[8], u[8];
  for (int k = 0; k < 8; k += 2)
    t[k] = __builtin_shuffle(r[k], r[k + 1], lo), t[k + 1] = __builtin_shuffle(r[k], r[k + 1], hi);
  for (int k = 0; k < 8; k += 4)
    for (int h = 0; h < 2; h++)
      u[k + 2 * h] = __builtin_shuffle(t[k + h], t[k + h + 2], l2),
      u[k + 2 * h + 1] = __builtin_shuffle(t[k + h], t[k + h + 2], h2);
  for (int k = 0; k < 4; k++)
    r[k] = __builtin_shuffle(u[k], u[k + 4], l4), r[k + 4] = __builtin_shuffle(u[k], u[k + 4], h4);
}
#endif
"""

# the lane-wise operations of the online softmax and the register tiles, per vector width (W lanes): {W} and {B}
# (bytes) filled in by _vector_helpers; the maximum is one instruction where the ISA has it (else a compare and blend)
_VECTOR_HELPERS = """#ifndef AZYX_ATTENTION_V{W}
#define AZYX_ATTENTION_V{W}
#if {W} != 8
typedef float azyx_v{W} __attribute__((vector_size({B}), may_alias));
typedef int azyx_v{W}i __attribute__((vector_size({B}), may_alias));
static inline azyx_v{W} azyx_ld{W}(const float* p) {{ return *(const azyx_v{W}*)p; }}
static inline void azyx_st{W}(float* p, azyx_v{W} x) {{ *(azyx_v{W}*)p = x; }}
#endif
static inline azyx_v{W} azyx_splat{W}(float x) {{ return x - (azyx_v{W}){{0}}; }}
#if {W} == 8 && defined(__AVX__) || {W} == 16 && defined(__AVX512F__)
#include <immintrin.h>
static inline azyx_v{W} azyx_max{W}(azyx_v{W} a, azyx_v{W} b) {{ return (azyx_v{W}){MAX}((__m{BITS})a, (__m{BITS})b); }}
#else
static inline azyx_v{W} azyx_max{W}(azyx_v{W} a, azyx_v{W} b) {{
  azyx_v{W}i gt = a > b; return (azyx_v{W})(((azyx_v{W}i)a & gt) | ((azyx_v{W}i)b & ~gt));
}}
#endif
/* 2^x on {W} lanes for x <= 0 (a score less the row's maximum): 2^round(x) by its exponent bits times a polynomial of
   the rest (degree 7, relative error ~1e-8 on [-1/2, 1/2]); x clamped to -127, whose exponent bits are 0: below
   -126.5 (a masked key's -inf too) it is 0 */
static inline azyx_v{W} azyx_exp2_{W}(azyx_v{W} x) {{
  x = azyx_max{W}(x, azyx_splat{W}(-127.f));
  azyx_v{W} n = (x + 12582912.f) - 12582912.f, f = x - n;
  azyx_v{W} p = f * 1.5252733804e-5f + 1.5403530393e-4f;
  p = p * f + 1.3333558146e-3f;
  p = p * f + 9.6181291076e-3f;
  p = p * f + 5.5504108665e-2f;
  p = p * f + 2.4022650696e-1f;
  p = p * f + 6.9314718056e-1f;
  p = p * f + 1.f;
  azyx_v{W}i e = (__builtin_convertvector(n, azyx_v{W}i) + 127) << 23;
  return p * (azyx_v{W})e;
}}
#endif
"""


def _vector_helpers(w: int) -> str:
    bits = 32 * w
    intrinsic = "_mm256_max_ps" if w == 8 else "_mm512_max_ps"
    return _VECTOR_HELPERS.format(W=w, B=4 * w, BITS=bits, MAX=intrinsic)


def _lanes(dl: Dialect) -> int:
    """The vector lanes of the C kernel: 16 where the device's registers are 64 bytes (AVX-512), else 8."""
    return 16 if dl.simd >= 64 else 8


def _tile(w: int, a_at: str, b_at: str, loop: str, out: str, load_acc: bool) -> str:
    """A register tile of w-lane vectors, C_TILES[w] (rows x vectors a row): c[r] += a(r, x) * b[x][lanes] over `loop`
    (x its variable), a(r, x) the scalar `a_at` with {r} (broadcast), b's lanes at address `b_at`; `out` with {r}: the
    address of row r's results (read first with `load_acc`)."""
    rows, vecs = range(C_TILES[w][0]), range(C_TILES[w][1])
    v_t = f"azyx_v{w}"
    init = [f"{v_t} c{r}{v} = " + (f"azyx_ld{w}({out.format(r=r)} + {w * v})" if load_acc else f"azyx_splat{w}(0.f)")
            + ";" for r in rows for v in vecs]
    body = [f"{{ const float x = {a_at.format(r=r)}; " + " ".join(f"c{r}{v} += x * b{v};" for v in vecs) + " }"
            for r in rows]
    store = [" ".join(f"azyx_st{w}({out.format(r=r)} + {w * v}, c{r}{v});" for v in vecs) for r in rows]
    loads = ", ".join(f"b{v} = azyx_ld{w}({b_at} + {w * v})" for v in vecs)
    return "\n".join(["{", *init, f"{loop} {{", f"  const {v_t} {loads};", *("  " + b for b in body), "}", *store,
                      "}"])


def render_c(a: Attention, name: str, dl: Dialect, params: list[DType], scale: str) -> str:
    """The C kernel (see the module docstring): `name(lo, hi, out, q, k, v[, mask], scalars...)` over parts lo..hi."""
    bq, bk, w = C_BQ, C_BK, _lanes(dl)
    E, Ev, L, S = a.E, a.Ev, a.L, a.S
    tr, lanes = C_TILES[w][0], w * C_TILES[w][1]
    evt = -(-Ev // tr) * tr  # (the output's columns, computed tr at a time: the last few read column Ev - 1 again)
    nqb = -(-L // bq)
    it = "long"
    out_t, qt, kt, vt = params[:4]
    sig = [f"{it} lo", f"{it} hi", *_params(dl, params, scale)]
    q_l, q_e = a.q[-2], a.q[-1]
    k_s, k_e = a.k[-2], a.k[-1]
    v_s, v_e = a.v[-2], a.v[-1]
    f32 = dtypes.float32
    k_here = kt is f32 and k_e == 1  # read in place, else packed block by block as float32
    v_here = vt is f32 and v_e == 1
    masks = []
    if a.causal:  # keys past a query's own index
        masks.append(f"""if (k0 + kn - 1 > q0)
        for (int j = 0; j < kn; j++) {{
          const {it} lim = k0 + j - q0 < qv ? k0 + j - q0 : qv;
          for ({it} i = 0; i < lim; i++) PT[j][i] = -INFINITY;
        }}""")
    if a.mask is not None:
        mval = _load(dl, params[4], "d4", f"mo + (q0 + i) * {a.mask[-2]}L + (k0 + j) * {a.mask[-1]}L")
        op = f"if (!({mval})) PT[j][i] = -INFINITY;" if a.mask_bool else f"PT[j][i] += ({mval}) * {LOG2E}f;"
        masks.append(f"""for (int j = 0; j < kn; j++)
        for (int i = 0; i < qn; i++) {op}""")
    store = dl.stores.get(out_t.name, "{buf}[{idx}] = {val};").format(
        buf="d0", idx=f"oo + (q0 + i) * {Ev}L + c", val="OT[c][i] * inv")
    kend = f"q0 + qn < {S} ? q0 + qn : {S}" if a.causal else str(S)
    k_rows = " ".join(f"const float* k{r} = kp + (j0 + {r} < kn ? j0 + {r} : kn - 1) * {k_s if k_here else E}L;"
                      for r in range(tr))
    v_cols = " ".join(f"const float* v{r} = vp + (c0 + {r} < {Ev} ? c0 + {r} : {Ev - 1});" for r in range(tr))
    qk = _tile(w, "k{r}[e]", "&QT[e][i0]", f"for (int e = 0; e < {E}; e++)", "&PT[j0 + {r}][i0]", False)
    pv = _tile(w, f"v{{r}}[j * {v_s if v_here else Ev}L]", "&PT[j][i0]", "for (int j = 0; j < kn; j++)",
               "&OT[c0 + {r}][i0]", True)
    q_fast = o_fast = ""  # whole groups of 8 rows transposed 8 x 8 at a time where q (the output) is float32 rows
    if qt is f32 and q_e == 1 and E % 8 == 0:
        q_fast = f"""for (int i0 = 0; i0 < qn / 8 * 8; i0 += 8)
      for (int e0 = 0; e0 < {E}; e0 += 8) {{
        azyx_v8 r[8];
        for (int k = 0; k < 8; k++) r[k] = *(const azyx_v8u*)(d1 + qo + (q0 + i0 + k) * {q_l}L + e0);
        azyx_tr8(r);
        for (int k = 0; k < 8; k++) azyx_st8(&QT[e0 + k][i0], r[k] * AZYX_V8(qs));
      }}
    """
    if out_t is f32 and Ev % 8 == 0:
        o_fast = f"""for (int i0 = 0; i0 < qn / 8 * 8; i0 += 8) {{
      const azyx_v8 inv = AZYX_V8(1.f) / azyx_ld8(l + i0);
      for (int c0 = 0; c0 < {Ev}; c0 += 8) {{
        azyx_v8 r[8];
        for (int k = 0; k < 8; k++) r[k] = azyx_ld8(&OT[c0 + k][i0]) * inv;
        azyx_tr8(r);
        for (int k = 0; k < 8; k++) *(azyx_v8u*)(d0 + oo + (q0 + i0 + k) * {Ev}L + c0) = r[k];
      }}
    }}
    """
    k_block = _block(dl, "k", kt, "d2", k_here, k_s, k_e, E)
    v_block = _block(dl, "v", vt, "d3", v_here, v_s, v_e, Ev)
    offsets = "\n    ".join(_offsets(a, "b", it))
    return _C_HELPERS + _vector_helpers(w) + f"""{dl.kernel_prefix} {name}({", ".join(sig)}) {{
  _Alignas(64) float QT[{E}][{bq}];  /* the query rows, transposed, times scale * log2(e) */
  _Alignas(64) float PT[{bk + tr}][{bq}];  /* scores of a key block, transposed; then their powers of 2 */
  _Alignas(64) float OT[{evt}][{bq}];  /* the output rows, transposed */
  _Alignas(64) float m[{bq}], l[{bq}];  /* per query: the running maximum and sum */
  {f"_Alignas(64) float Kb[{bk}][{E}];" if not k_here else ""}
  {f"_Alignas(64) float Vb[{bk}][{Ev}];" if not v_here else ""}
  const float qs = (float)({scale}) * {LOG2E}f;
  for ({it} part = lo; part < hi; part++) {{
    const {it} b = part / {nqb}, q0 = part % {nqb} * {bq};
    const int qn = {L} - q0 < {bq} ? (int)({L} - q0) : {bq}, qv = (qn + {w - 1}) / {w} * {w};
    const int qt = (qn + {lanes - 1}) / {lanes} * {lanes};
    const {it} oo = b * {L * Ev}L;
    {offsets}
    {q_fast}for (int i = {"qn / 8 * 8" if q_fast else "0"}; i < {bq}; i++)
      for (int e = 0; e < {E}; e++)
        QT[e][i] = i < qn ? {_load(dl, qt, "d1", f"qo + (q0 + i) * {q_l}L + e * {q_e}L")} * qs : 0.f;
    for (int i = 0; i < {bq}; i++) m[i] = -INFINITY, l[i] = 0.f;
    for (int c = 0; c < {evt}; c++)
      for (int i = 0; i < {bq}; i++) OT[c][i] = 0.f;
    const {it} kend = {kend};
    for ({it} k0 = 0; k0 < kend; k0 += {bk}) {{
      const int kn = kend - k0 < {bk} ? (int)(kend - k0) : {bk};
      {k_block}
      for (int j0 = 0; j0 < kn; j0 += {tr}) {{
        {k_rows}
        for (int i0 = 0; i0 < qt; i0 += {lanes})
{_indent(qk, 10)}
      }}
      {chr(10).join("      " + x for x in masks).strip()}
      for (int i0 = 0; i0 < qv; i0 += {w}) {{
        const azyx_v{w} m0 = azyx_ld{w}(m + i0);
        azyx_v{w} mx = m0;
        for (int j = 0; j < kn; j++) mx = azyx_max{w}(mx, azyx_ld{w}(&PT[j][i0]));
        const azyx_v{w} ms = (azyx_v{w})((azyx_v{w}i)mx & ~(mx == azyx_splat{w}(-INFINITY)));  /* a row all masked: 0 */
        const azyx_v{w} alpha = azyx_exp2_{w}(m0 - ms);
        azyx_v{w} sum = azyx_splat{w}(0.f);
        for (int j = 0; j < kn; j++) {{
          const azyx_v{w} p = azyx_exp2_{w}(azyx_ld{w}(&PT[j][i0]) - ms);
          azyx_st{w}(&PT[j][i0], p);
          sum += p;
        }}
        azyx_st{w}(l + i0, azyx_ld{w}(l + i0) * alpha + sum);
        azyx_st{w}(m + i0, mx);
        for (int c = 0; c < {evt}; c++) azyx_st{w}(&OT[c][i0], azyx_ld{w}(&OT[c][i0]) * alpha);
      }}
      {v_block}
      for (int c0 = 0; c0 < {evt}; c0 += {tr}) {{
        {v_cols}
        for (int i0 = 0; i0 < qt; i0 += {lanes})
{_indent(pv, 10)}
      }}
    }}
    {o_fast}for (int i = {"qn / 8 * 8" if o_fast else "0"}; i < qn; i++) {{
      const float inv = 1.f / l[i];
      for (int c = 0; c < {Ev}; c++) {store}
    }}
  }}
}}
"""


def _block(dl: Dialect, x: str, d: DType, buf: str, here: bool, s_row: int, s_col: int, n: int) -> str:
    """C lines that point `{x}p` at the rows of k or v of the key block at k0: where they lie, or packed as float32."""
    if here:
        return f"const float* {x}p = {buf} + {x}o + k0 * {s_row}L;"
    at = f"{x}o + (k0 + j) * {s_row}L + c * {s_col}L"
    return f"""for (int j = 0; j < kn; j++)
        for (int c = 0; c < {n}; c++) {x.upper()}b[j][c] = {_load(dl, d, buf, at)};
      const float* {x}p = &{x.upper()}b[0][0];"""


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
    kend = f"min({S}, q0 + {bq})" if a.causal else f"{S}"
    offsets = "\n  ".join(_offsets(a, "b", it))
    return f"""extern "C" __global__ void __launch_bounds__({threads}) {name}({", ".join(sig)}) {{
  __shared__ float Qs[{bq}][{E + 1}];
  __shared__ float Ks[{bk}][{E + 1}];
  __shared__ float Vs[{bk}][{cols * 8}];
  __shared__ float Ps[{bq}][{bk + 1}];
  const int tid = threadIdx.x, ty = tid >> 3, tx = tid & 7;
  const {it} b = blockIdx.y;
  const int q0 = blockIdx.x * {bq};  /* (rows and keys in int: lengths under 2^31; addresses in 64 bits) */
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
  const int kend = {kend};
  for (int k0 = 0; k0 < kend; k0 += {bk}) {{
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
    sig = _params(dl, params, scale)
    return MMA_HELPERS + f"""#ifndef AZYX_ATTENTION_{kind.upper()}
#define AZYX_ATTENTION_{kind.upper()}
__device__ inline unsigned azyx_half2_{kind}(float lo, float hi) {{  /* two floats as {kind} halves, lo first */
  unsigned r; asm("cvt.rn.{kind}x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo)); return r;
}}
#endif
#ifndef AZYX_EX2
#define AZYX_EX2
__device__ inline float azyx_ex2(float x) {{ float y; asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x)); return y; }}
#endif
extern "C" __global__ void __launch_bounds__({CUDA_THREADS}) {name}({", ".join(sig)}) {{
{_mma_body(a, dl, params, scale, kind)}
}}
"""


MMA_SMEM = 48 << 10  # the shared memory a kernel may declare
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
    offsets = "\n  ".join(_offsets(a, "b", it))
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
            mval = _load(dl, params[4], "d4", f"mo + row * {a.mask[-2]}LL + key * {a.mask[-1]}LL")
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
    return f"""  __shared__ __align__(16) unsigned short sm[{total}];  /* 2 stages of K ({bk} x {rk}), V; q */
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
