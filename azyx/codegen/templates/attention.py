"""Attention as one kernel, for dialects that declare it (C here, CUDA in attention_cuda): `softmax(q k^T * scale +
mask) v` that never holds more of the (L, S) score matrix than one block of it (the FlashAttention scheme: an online
softmax).

A kernel of the IR whose one store is an "attention" value (azyx.ir.Attention, which azyx.schedule builds from an
ATTENTION node) renders here instead of through the generic C-family path; codegen.kernel picks the template.

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

A few query rows against a long cache (a decode step) take the decode form instead: templates.attention_decode.

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
from azyx.dtypes import DType, dtypes
from azyx.ir import Attention

LOG2E = 1.4426950408889634
# C: vector lanes -> a register tile's rows (keys, or output columns) x vectors (queries): 32 queries a tile either
# way, 12 accumulators of 8 lanes (AVX2) or 8 of 16 (AVX-512: half the instructions, eight chains of FMAs in flight)
C_TILES = {8: (3, 4), 16: (4, 2)}
C_BQ, C_BK = 64, 64  # C: query rows per part (two tiles), keys per block
C_MAX_HEAD = 256  # the longest E and Ev the C kernel takes (its blocks live on the stack)
CUDA_MAX_HEAD = 128  # (past 64, its tiles take dynamic shared memory: attention_cuda.cuda_smem)
MMA_MAX_HEAD = 128  # the tensor-core kernel's longest E and Ev (tiles of 64 keys, two stages: attention_cuda.MMA_SMEM)
CUDA_BQ, CUDA_BK, CUDA_THREADS = 64, 32, 128  # CUDA: query rows per block, keys per tile, threads per block


# the decode form (templates.attention_decode): query rows up to DECODE_ROWS against the cache, each row's keys cut
# into chunks of at least DECODE_CHUNK keys (a GPU block streams a chunk of bf16 heads of 64, 64 KiB, in about the
# time of the launch a split adds) so that the chunks of all rows number about DECODE_UNITS (host threads' parts, or
# blocks: eight per multiprocessor of an H100, over a wave of the ~5 its registers let in at once, so that a last
# partial wave costs little), DECODE_MAX_SPLITS at most; then combined
DECODE_ROWS, DECODE_MAX_SPLITS, DECODE_CHUNK = 4, 64, 256
DECODE_UNITS = {False: 64, True: 1056}
# CUDA's lane-group kernel (decode_lanes) splits only while the rows leave multiprocessors idle: chunks of at least
# DECODE_LANE_CHUNK keys, about DECODE_LANE_UNITS blocks in all (two per multiprocessor of an H200). GPT-2 small's
# batch-1 decode (12 rows, a window of 256 keys: 12 blocks unsplit) on one H200, fp32: 1.74-1.81x -> 1.94-1.96x the
# CUDA-graph peer with chunks of 64 (four splits); its batch 32 (384 rows) stays whole, as a split then only adds a
# combining kernel a layer
DECODE_LANE_CHUNK, DECODE_LANE_UNITS = 64, 264


def decode_takes(dl: Dialect, L: int, E: int, Ev: int, dtype: DType | None) -> bool:
    """Whether the dialect's decode kernel takes L query rows of heads E, Ev in `dtype`: a GPU's reads rows 16 bytes a
    lane (E and Ev multiples of 16 bytes, a row at most 32 lanes; `rows_aligned`, the planner copies a view that is
    not)."""
    if not (dl.attention or dl.decode) or L > DECODE_ROWS or dtype not in (dtypes.float32, dtypes.float16,
                                                                            dtypes.bfloat16):
        return False
    if not decode_lanes(dl):
        return 0 < E <= C_MAX_HEAD and 0 < Ev <= C_MAX_HEAD
    w = 16 // dtype.itemsize
    return 0 < E <= 32 * w and 0 < Ev <= 32 * w and E % w == 0 and Ev % w == 0


def decode_lanes(dl: Dialect) -> bool:
    """Whether `dl`'s decode kernel is CUDA's (a lane group per key, 16 bytes a lane), else the C one (a part, or a
    work item, per chunk: the host's, OpenCL's)."""
    return bool(dl.global_ids) and dl.attention


def decode_splits(dl: Dialect, rows: int, S: int) -> int:
    """The chunks each of `rows` query rows cuts its S keys into (see DECODE_UNITS, DECODE_LANE_UNITS), none
    empty."""
    if decode_lanes(dl):
        chunk, units = DECODE_LANE_CHUNK, DECODE_LANE_UNITS
    else:
        chunk, units = DECODE_CHUNK, DECODE_UNITS[bool(dl.global_ids)]
    n = max(1, min(DECODE_MAX_SPLITS, S // chunk, -(-units // rows)))
    return -(-S // -(-S // n))


def decode_chunk(a: Attention) -> int:
    """Keys per chunk of the decode form (the last chunk may be shorter)."""
    return -(-a.S // a.splits)


def fits(dl: Dialect, L: int, S: int, E: int, Ev: int, dtype: DType | None = None) -> bool:
    """Whether the dialect's attention kernel takes these lengths for q of `dtype` (else the composed form runs): its
    decode kernel (`decode_takes`: a few query rows, also on dialects without the whole kernel), or the whole kernel
    with heads up to the dialect's most (a GPU's: MMA_MAX_HEAD on tensor cores, CUDA_MAX_HEAD in float32)."""
    if S > 0 and decode_takes(dl, L, E, Ev, dtype):
        return True
    if not dl.attention:
        return False
    most = C_MAX_HEAD
    if dl.global_ids:
        tensor_cores = dl.tensor_cores and dtype in (dtypes.float16, dtypes.bfloat16) and E % 16 == 0 and Ev % 16 == 0
        most = MMA_MAX_HEAD if tensor_cores else CUDA_MAX_HEAD
    return 0 < E <= most and 0 < Ev <= most and L > 0 and S > 0


def copies_unaligned(dl: Dialect, E: int, Ev: int, dtype: DType, splits: int) -> bool:
    """Whether the planner copies an operand whose rows do not start on 16 bytes (`rows_aligned`) before the kernel:
    CUDA's decode kernel reads rows 16 bytes a lane; its tensor-core kernel does too, and for heads past 64 a copy
    costs less than the float32 kernel that would take the view instead."""
    if splits:
        return decode_lanes(dl)
    half = dtype in (dtypes.float16, dtypes.bfloat16) and E % 16 == 0 and Ev % 16 == 0
    return bool(dl.global_ids) and dl.tensor_cores and half and max(E, Ev) > 64


def rows_aligned(view: tuple[int, ...]) -> bool:
    """Whether an operand's view (offset, *strides) is read 16 bytes at a time by the tensor-core kernel: its last
    axis contiguous, the other strides and the offset multiples of 8 elements."""
    return view[-1] == 1 and all(s % 8 == 0 for s in view[:-1])


def cuda_grid(a: Attention) -> tuple[int, int, int]:
    """(blocks of CUDA_BQ query rows, batch points): the float32 kernel's grid, and at least as many blocks as the
    tensor-core kernel needs (it numbers its blocks flat; those past `mma_units` return at once). The decode form:
    (query rows, chunks) in stage 1, (query rows, 1) in stage 2."""
    if a.splits:
        return a.batch_size * a.L, a.splits if a.stage == 1 else 1, 1
    return -(-a.L // CUDA_BQ), a.batch_size, 1


def parts(a: Attention) -> int:
    """The C kernel's parallel parts: (batch point, block of query rows); the decode form's (query row, chunk) in stage
    1, query rows in stage 2."""
    if a.splits:
        return a.batch_size * a.L * (a.splits if a.stage == 1 else 1)
    return a.batch_size * -(-a.L // C_BQ)


def work(a: Attention) -> int:
    """Multiply-adds in all (for launch decisions and statistics)."""
    keys = a.S if not a.causal else min(a.S, (a.L + 1) // 2 + 1)
    return a.batch_size * a.L * keys * (a.E + a.Ev)


def batch_offsets(a: Attention, index: str, it: str, params: int = 0) -> list[str]:
    """Lines that set qo, ko, vo (and mo) to the element offsets of batch point `index` in each operand; k's and v's
    first batch axis through the gather index where `a.gather` (checked where the kernel's `params` take the check
    words: see `gather_check`)."""
    ops = [("qo", a.q), ("ko", a.k), ("vo", a.v)] + ([("mo", a.mask)] if a.mask is not None else [])
    lines = [f"{it} {name} = {spec[0]};" for name, spec in ops]
    if not a.batch:
        return lines
    lines.append(f"{it} rest = {index}, c;")
    for ax in reversed(range(len(a.batch))):
        lines.append(f"c = rest % {a.batch[ax]}; rest /= {a.batch[ax]};")
        gathered = ("ko", "vo") if ax == 0 and a.gather else ()
        lines += [f"{name} += c * {spec[1 + ax]};" for name, spec in ops if spec[1 + ax] and name not in gathered]
        if gathered:
            lines.append(_gathered_row(a, it, params))
    return lines


def gather_check(a: Attention, params: int) -> int | None:
    """The parameter of the check words among a kernel's `params` parameters (after the gather index), or None."""
    at = 5 + (a.mask is not None)
    return at if a.gather and params > at else None


def _gathered_row(a: Attention, it: str, params: int) -> str:
    """k's and v's row of the table for batch coordinate c: the index wrapped from the end and clamped; one out of
    [-rows, rows) writes the check words (ir.CHECK_WORDS: site 1, the value, the size) where the kernel has them."""
    n, ix, ck = a.gather, 4 + (a.mask is not None), gather_check(a, params)
    check = "" if ck is None else (f" if (at < -{n} || at > {n - 1}) {{ d{ck}[1] = at; d{ck}[2] = at < 0 ? -1 : 0; "
                                   f"d{ck}[3] = {n}; d{ck}[0] = 1; }}")
    return (f"{{ const int at = d{ix}[c]; {it} r = at < 0 ? at + {n} : at; r = r < 0 ? 0 : (r > {n - 1} ? {n - 1} : r);"
            f"{check} ko += r * {a.k[1]}; vo += r * {a.v[1]}; }}")


def kernel_params(dl: Dialect, params: list[DType], scale: str, written: int | None = None) -> list[str]:
    """The kernel's parameters: the output, the operands (read-only), the scale where it is a scalar argument;
    `written`: another parameter the kernel writes (the check words)."""
    out = [f"{dl.buffer_qual}{'const ' if i and i != written else ''}{dl.ctype(d)}* {dl.restrict} d{i}"
           for i, d in enumerate(params)]
    return out + ([f"float {scale}"] if scale.startswith("sc") else [])


def load_expr(dl: Dialect, d: DType, buf: str, idx: str) -> str:
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


def _c_masks(a: Attention, dl: Dialect, params: list[DType], it: str) -> list[str]:
    """The C kernel's statements that mask a block of scores: causal (keys past a query's own index), and the mask
    operand's (a bool mask drops scores, another adds to them)."""
    masks = []
    if a.causal:  # keys past a query's own index
        masks.append(f"""if (k0 + kn - 1 > q0)
        for (int j = 0; j < kn; j++) {{
          const {it} lim = k0 + j - q0 < qv ? k0 + j - q0 : qv;
          for ({it} i = 0; i < lim; i++) PT[j][i] = -INFINITY;
        }}""")
    if a.mask is not None:
        mval = load_expr(dl, params[4], "d4", f"mo + (q0 + i) * {a.mask[-2]}L + (k0 + j) * {a.mask[-1]}L")
        op = f"if (!({mval})) PT[j][i] = -INFINITY;" if a.mask_bool else f"PT[j][i] += ({mval}) * {LOG2E}f;"
        masks.append(f"""for (int j = 0; j < kn; j++)
        for (int i = 0; i < qn; i++) {op}""")
    return masks


def _c_transposes(q_rows: bool, o_rows: bool, E: int, Ev: int, q_l: int) -> tuple[str, str]:
    """Whole groups of 8 rows of q (`q_rows`: float32 rows) and of the output (`o_rows`) transposed 8 x 8 at a time
    into and out of the kernel's blocks: the loops before the per-element ones (empty where the rows are not)."""
    q_fast = o_fast = ""
    if q_rows:
        q_fast = f"""for (int i0 = 0; i0 < qn / 8 * 8; i0 += 8)
      for (int e0 = 0; e0 < {E}; e0 += 8) {{
        azyx_v8 r[8];
        for (int k = 0; k < 8; k++) r[k] = *(const azyx_v8u*)(d1 + qo + (q0 + i0 + k) * {q_l}L + e0);
        azyx_tr8(r);
        for (int k = 0; k < 8; k++) azyx_st8(&QT[e0 + k][i0], r[k] * AZYX_V8(qs));
      }}
    """
    if o_rows:
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
    return q_fast, o_fast


def render_c(a: Attention, name: str, dl: Dialect, params: list[DType], scale: str) -> str:
    """The C kernel (see the module docstring): `name(lo, hi, out, q, k, v[, mask], scalars...)` over parts lo..hi."""
    bq, bk, w = C_BQ, C_BK, _lanes(dl)
    E, Ev, L, S = a.E, a.Ev, a.L, a.S
    tr, lanes = C_TILES[w][0], w * C_TILES[w][1]
    evt = -(-Ev // tr) * tr  # (the output's columns, computed tr at a time: the last few read column Ev - 1 again)
    nqb = -(-L // bq)
    it = "long"
    out_t, qt, kt, vt = params[:4]
    sig = [f"{it} lo", f"{it} hi", *kernel_params(dl, params, scale)]
    q_l, q_e = a.q[-2], a.q[-1]
    k_s, k_e = a.k[-2], a.k[-1]
    v_s, v_e = a.v[-2], a.v[-1]
    f32 = dtypes.float32
    k_here = kt is f32 and k_e == 1  # read in place, else packed block by block as float32
    v_here = vt is f32 and v_e == 1
    masks = _c_masks(a, dl, params, it)
    store = dl.stores.get(out_t.name, "{buf}[{idx}] = {val};").format(
        buf="d0", idx=f"oo + (q0 + i) * {Ev}L + c", val="OT[c][i] * inv")
    kend = f"q0 + qn < {S} ? q0 + qn : {S}" if a.causal else str(S)
    k_rows = " ".join(f"const float* k{r} = kp + (j0 + {r} < kn ? j0 + {r} : kn - 1) * {k_s if k_here else E}L;"
                      for r in range(tr))
    v_cols = " ".join(f"const float* v{r} = vp + (c0 + {r} < {Ev} ? c0 + {r} : {Ev - 1});" for r in range(tr))
    qk = _tile(w, "k{r}[e]", "&QT[e][i0]", f"for (int e = 0; e < {E}; e++)", "&PT[j0 + {r}][i0]", False)
    pv = _tile(w, f"v{{r}}[j * {v_s if v_here else Ev}L]", "&PT[j][i0]", "for (int j = 0; j < kn; j++)",
               "&OT[c0 + {r}][i0]", True)
    q_rows, o_rows = qt is f32 and q_e == 1 and E % 8 == 0, out_t is f32 and Ev % 8 == 0  # (float32 rows)
    q_fast, o_fast = _c_transposes(q_rows, o_rows, E, Ev, q_l)
    k_block = _block(dl, "k", kt, "d2", k_here, k_s, k_e, E)
    v_block = _block(dl, "v", vt, "d3", v_here, v_s, v_e, Ev)
    offsets = "\n    ".join(batch_offsets(a, "b", it))
    text = _C_HELPERS + _vector_helpers(w) + f"""{dl.kernel_prefix} {name}({", ".join(sig)}) {{
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
        QT[e][i] = i < qn ? {load_expr(dl, qt, "d1", f"qo + (q0 + i) * {q_l}L + e * {q_e}L")} * qs : 0.f;
    for (int i = 0; i < {bq}; i++) m[i] = -INFINITY, l[i] = 0.f;
    for (int c = 0; c < {evt}; c++)
      for (int i = 0; i < {bq}; i++) OT[c][i] = 0.f;
"""
    return (text
            + _c_key_blocks(it, kend, bk, k_block, tr, k_rows, lanes, w, evt, v_block, v_cols, qk, pv, masks)
            + _c_epilogue(o_fast, Ev, store))


def _c_key_blocks(it: str, kend: str, bk: int, k_block: str, tr: int, k_rows: str, lanes: int, w: int, evt: int,
                  v_block: str, v_cols: str, qk: str, pv: str, masks: list[str]) -> str:
    """The main loop over blocks of keys: scores by register tiles, the mask, the online softmax, the output rescaled
    and accumulated."""
    return f"""\
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
"""


def _c_epilogue(o_fast: str, Ev: int, store: str) -> str:
    """The output rows divided by their sums and stored (transposed back 8 x 8 where they are float32 rows)."""
    return f"""\
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
        for (int c = 0; c < {n}; c++) {x.upper()}b[j][c] = {load_expr(dl, d, buf, at)};
      const float* {x}p = &{x.upper()}b[0][0];"""


def _indent(text: str, n: int) -> str:
    return "\n".join(" " * n + line for line in text.splitlines())
