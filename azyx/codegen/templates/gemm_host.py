"""The matrix product for host dialects (C): a packed, cache-blocked kernel in the GotoBLAS/BLIS scheme.

`gemm.match(k, BLOCKED)` recognises the product (any strides, batched); `render_c` fills the kernel. C is cut in blocks
of MC rows x NC columns; the shared loop (launch.SHARED: the C backend's threads take parts of it) runs over those
blocks, batch outermost, then column panels, row blocks innermost, so that one call's consecutive blocks share their
panel of B. For each slice of KC along K, a call packs the KC x NC panel of B it works on (zero-padded to whole
NR-column strips, each strip KC rows of NR contiguous floats) into thread-local scratch, then for each of its row
blocks the MC x KC block of A (MR-row strips, k-major), and runs the register micro-kernel over every MR x NR tile:
NR/VL vector accumulators per row, one broadcast of A and NR/VL loads of B per k, fused multiply-adds (GCC vector
extensions: gcc -O3 -march=native makes AVX2/AVX-512 code of them). Operands are packed where they lie, whatever their
strides: `x @ W.T` costs what `x @ W` does. Half operands are widened to float32 as they are packed; C accumulates in
float32 and is stored once (float16/bfloat16 outputs: K is not sliced then, so C is rounded once, as the generic
kernel rounds it). The first K slice stores C's tile, later ones add to it (K sliced: exact to reassociation).

Where the C device's compiler targets AVX-512 BF16 (Dialect.bf16_dot, decided from the device's CPU flags and the
compiler's predefined macros), a bfloat16 product is not widened: both operands are packed as stored, two consecutive
k of a row of A or a column of B in one 32-bit word (an odd K's last word half zero), and the micro-kernel multiplies
a broadcast pair of A with NR pairs of B per `_mm512_dpbf16_ps`, accumulating in float32 (products of bfloat16 are
exact in float32; vdpbf16ps treats denormal inputs and results as zero). Elsewhere, and for float16, the widening path.

Block sizes are data (`HOST_BLOCKS`, per vector register width, and `DOT_BLOCKS`), the first of each the default; the
kernel search tries the others (BLOCK sets `Kernel.variant`). `blocks` fits them to a product: even row and
column blocks, enough of them for every thread to have a few.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from azyx.codegen.dialect import BLOCKED, ITEM_TILES
from azyx.codegen.templates import gemm
from azyx.codegen.templates.gemm import Gemm
from azyx.ir import Kernel


@dataclass(frozen=True)
class Blocks:
    mr: int  # the register tile: MR rows x NR columns of C (NR a multiple of the vector width)
    nr: int
    mc: int  # rows of A per packed block (L2)
    kc: int  # K per slice (the micro-kernel's loop; a B strip KC x NR stays in L1)
    nc: int  # columns of B per packed panel (L3)


# vector register width in bytes -> the block sizes tried, the default first. AVX2 (16 ymm registers): 6 x 16 takes
# 12 accumulators, 2 of B and a broadcast; AVX-512 (32 zmm): 12 x 32, 24 accumulators; 16-byte vectors (SSE, NEON):
# 6 x 8. (AMD EPYC, 2 threads, 1024^3 to 2048^3 and MiniLM's shapes: KC of 384-512 ran 10-25% faster than 256; MC
# and NC within the noise of a shared machine. The AVX-512 and 16-byte rows are not measured.)
HOST_BLOCKS: dict[int, tuple[Blocks, ...]] = {
    32: (Blocks(6, 16, 96, 384, 1024), Blocks(6, 16, 72, 512, 512), Blocks(6, 16, 144, 256, 1024),
         Blocks(6, 16, 48, 512, 256)),
    64: (Blocks(12, 32, 144, 384, 2048), Blocks(12, 32, 96, 512, 2048), Blocks(12, 32, 192, 256, 1024)),
    16: (Blocks(6, 8, 96, 256, 1024), Blocks(6, 8, 48, 512, 512)),
}
# the AVX-512 BF16 micro-kernel's blocks (12 x 32: 24 accumulators, a k pair a step): larger row blocks than float32's,
# so that each thread packs B's panel less often (AMD EPYC with avx512_bf16, 2 threads, 1024^3, 2048^3, MiniLM's
# 4096 x 384 x 1536 and 4096 x 1536 x 384: MC 288 / NC 1024 ran 5-20% faster than float32's 144 / 2048)
DOT_BLOCKS = (Blocks(12, 32, 288, 384, 1024), Blocks(12, 32, 144, 384, 2048), Blocks(12, 32, 144, 384, 512),
              Blocks(12, 32, 192, 384, 1024))
VERSION = 4  # part of the C and OpenCL CPU devices' identity: winners found for another template are not reused
HALF_SCRATCH = 1 << 20
PARTS_PER_THREAD = 4  # blocks of C per thread at least, where the product has that many MR x NR tiles
FLOAT_LOADS = {"float32": "{x}", "float16": "(float)({x})", "bfloat16": "bf2f({x})"}
FLOAT_STORES = {"float32": "{x}", "float16": "(_Float16)({x})", "bfloat16": "f2bf({x})"}


MIN_ROWS, MIN_COLS, MIN_K = 16, 16, 16  # smaller products stay on the generic path (see `product`)
# `x @ W.T` (W as nn.Linear stores it) from 2 rows: the generic path copies W.T whole first, where the template reads
# W in place (up to a register tile's rows: `skinny`) or packs it panel by panel. (AMD EPYC, 2 threads, against
# 1536 x 384, 384 x 1536 and GPT-2's 50257 x 768: 2 to 12 rows ran 1.3-5x faster; one row stays generic: a dot
# product per output, W read once)
MIN_ROWS_TRANSPOSED = 2


def product(k: Kernel, simd: int, workers: int, bf16_dot: bool = False) -> Gemm | None:
    """The product `k` computes where this kernel takes it: at least MIN_ROWS rows (a decode step's `x @ W`, one row,
    runs as fast on the generic path's column tiles, without packing all of W), MIN_COLS columns and MIN_K long; with
    a right operand stored transposed (`x @ W.T`, W as `nn.Linear` keeps it) from MIN_ROWS_TRANSPOSED rows: the
    generic path would copy W.T whole first, where packing transposes each thread's panels of it in cache.
    `bf16_dot`: the device has AVX-512 BF16 (Dialect.bf16_dot): a bfloat16 product with AVX-512's micro-kernel uses
    it."""
    g = gemm.match(k, BLOCKED, simd=simd, workers=workers)
    if g is None or g.n < MIN_COLS or g.k < MIN_K or not takes(g.m, g.b[3] == 1 and g.b[4] != 1):
        return None  # (B's strides along K, along columns)
    return replace(g, bf16_dot=True) if bf16_dot and g.dtype == "bfloat16" and _width(simd) == 64 else g


def takes(rows: int, transposed: bool) -> bool:
    """Whether a product of `rows` rows takes the template (the scheduler gives it a kernel of its own)."""
    return rows >= (MIN_ROWS_TRANSPOSED if transposed else MIN_ROWS)


def variants(simd: int, bf16_dot: bool = False) -> int:
    return len(DOT_BLOCKS if bf16_dot else HOST_BLOCKS[_width(simd)])


def _width(simd: int) -> int:
    return simd if simd in HOST_BLOCKS else 16


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def blocks(g: Gemm) -> Blocks:
    """`g`'s block sizes: its variant's, fitted to the product (MC and NC the even share of whole blocks, rounded up
    to whole register tiles; smaller blocks where there would be fewer than PARTS_PER_THREAD per thread; K unsliced
    where it is barely longer than a slice, or where C is not float32: then blocks of HALF_SCRATCH floats at most)."""
    table = DOT_BLOCKS if g.bf16_dot else HOST_BLOCKS[_width(g.simd)]
    b = table[g.variant % len(table)]
    mc, nc = b.mc, b.nc
    if g.dtype != "float32":  # K unsliced: A's block and B's panel at most HALF_SCRATCH words each (a float, a pair)
        kw = _cdiv(g.k, 2) if g.bf16_dot else g.k
        mc = min(mc, max(b.mr, HALF_SCRATCH // kw // b.mr * b.mr))
        nc = min(nc, max(b.nr, HALF_SCRATCH // kw // b.nr * b.nr))
    n_k = 1 if g.dtype != "float32" else _cdiv(g.k, b.kc) if g.k > b.kc * 5 // 4 else 1
    n_i, n_j = _cdiv(g.m, mc), _cdiv(g.n, nc)
    want = PARTS_PER_THREAD * g.workers
    while g.batch * n_i * n_j < want:  # split the longer of the two while its blocks stay a few tiles wide
        rows, cols = g.m / (n_i * b.mr), g.n / (n_j * b.nr)
        if cols >= 4 and cols >= rows:
            n_j += 1
        elif rows >= 4:
            n_i += 1
        else:
            break
    mc = _cdiv(_cdiv(g.m, n_i), b.mr) * b.mr
    nc = _cdiv(_cdiv(g.n, n_j), b.nr) * b.nr
    return Blocks(b.mr, b.nr, mc, _cdiv(g.k, n_k), nc)


def trip(g: Gemm) -> int:
    """Blocks of C the shared loop runs over: batch x column panels x row blocks (skinny: batch x column blocks)."""
    if skinny(g):
        return g.batch * _cdiv(g.n, _skinny_cols(g))
    bl = blocks(g)
    return g.batch * _cdiv(g.n, bl.nc) * _cdiv(g.m, bl.mc)


def skinny(g: Gemm) -> bool:
    """Whether `g` takes the dot-product form: a float32 `x @ W.T` (both operands contiguous along K) of no more rows
    than a register tile holds. Each column of C is then dot products of W's row with x's few rows, vectorised along
    K: W is read once, in place, where packing it would write and read all of it again (MiniLM at batch 1: its
    products ran 2-4x faster so)."""
    return (g.dtype == "float32" and g.m <= HOST_BLOCKS[_width(g.simd)][0].mr and g.a[4] == 1 and g.b[3] == 1
            and g.b[4] != 1 and g.k >= _width(g.simd) // 4)


def _skinny_cols(g: Gemm) -> int:
    """Columns of C per part of the skinny form: an even number, PARTS_PER_THREAD parts a thread where N allows."""
    return max(2, _cdiv(_cdiv(g.n, PARTS_PER_THREAD * g.workers), 2) * 2)


def render_skinny(g: Gemm, name: str, ctype: str) -> str:
    """The dot-product form (see `skinny`): `name(lo, hi, C, operands...)` over blocks of columns; two columns of C
    at a time, each row's partial sums in one vector per column, summed across the lanes at the end."""
    vl = _width(g.simd) // 4
    vt, vu = f"azyx_v{vl}", f"azyx_v{vl}u"
    pa, a_off, a_sb, a_si, _ = g.a
    pb, b_off, b_sb, _, b_sj = g.b
    cols, n_j, kv = _skinny_cols(g), _cdiv(g.n, _skinny_cols(g)), g.k // vl * vl
    params = ", ".join(f"const {ctype}* restrict d{i}" for i in range(1, 1 + max(pa, pb)))
    rows = range(g.m)
    decl = " ".join(f"{vt} s{i}_0 = {{0}}, s{i}_1 = {{0}};" for i in rows)
    fmas = "\n".join(f"        {{ const {vt} a = *(const {vu}*)(A + {i * a_si}L + k); "
                      f"s{i}_0 += a * w0; s{i}_1 += a * w1; }}" for i in rows)
    tails = "\n".join(f"        r{i}_0 += A[{i * a_si}L + k] * b0[k]; r{i}_1 += A[{i * a_si}L + k] * b1[k];"
                       for i in rows)
    sums = "\n".join(f"      float r{i}_0 = 0.f, r{i}_1 = 0.f;\n"
                      f"      for (int l = 0; l < {vl}; l++) r{i}_0 += s{i}_0[l], r{i}_1 += s{i}_1[l];" for i in rows)
    stores = "\n".join(f"      C[{i * g.n}L + j] = r{i}_0; if (two) C[{i * g.n}L + j + 1] = r{i}_1;" for i in rows)
    return _HELPERS + f"""
void {name}(long lo, long hi, float* restrict d0, {params}) {{
  for (long t = lo; t < hi; t++) {{
    const long bz = t / {n_j}, j0 = t % {n_j} * {cols}, j1 = j0 + {cols} < {g.n} ? j0 + {cols} : {g.n};
    const float* A = d{pa} + {a_off}L + bz * {a_sb}L;
    const float* B = d{pb} + {b_off}L + bz * {b_sb}L;
    float* C = d0 + bz * {g.m * g.n}L;
    for (long j = j0; j < j1; j += 2) {{
      const int two = j + 1 < j1;
      const float* b0 = B + j * {b_sj}L;
      const float* b1 = two ? b0 + {b_sj}L : b0;
      {decl}
      for (long k = 0; k < {kv}; k += {vl}) {{
        const {vt} w0 = *(const {vu}*)(b0 + k), w1 = *(const {vu}*)(b1 + k);
{fmas}
      }}
{sums}
      for (long k = {kv}; k < {g.k}; k++) {{
{tails}
      }}
{stores}
    }}
  }}
}}
"""


_HELPERS = """#ifndef AZYX_HOST_GEMM
#define AZYX_HOST_GEMM
#include <pthread.h>
#include <stdlib.h>
typedef float azyx_v16 __attribute__((vector_size(64)));
typedef float azyx_v8 __attribute__((vector_size(32)));
typedef float azyx_v4 __attribute__((vector_size(16)));
typedef float azyx_v16u __attribute__((vector_size(64), aligned(4)));
typedef float azyx_v8u __attribute__((vector_size(32), aligned(4)));
typedef float azyx_v4u __attribute__((vector_size(16), aligned(4)));
typedef int azyx_i16 __attribute__((vector_size(64)));
typedef int azyx_i8 __attribute__((vector_size(32)));
typedef int azyx_i4 __attribute__((vector_size(16)));
/* Thread-local packing scratch, 64-byte aligned, grown as needed, freed when the thread ends. */
static pthread_key_t azyx_scratch_key;
static pthread_once_t azyx_scratch_once = PTHREAD_ONCE_INIT;
typedef struct { float* p[2]; size_t n[2]; } azyx_scratch_t;
static void azyx_scratch_free(void* s) { free(((azyx_scratch_t*)s)->p[0]); free(((azyx_scratch_t*)s)->p[1]); free(s); }
static void azyx_scratch_init(void) { pthread_key_create(&azyx_scratch_key, azyx_scratch_free); }
static float* azyx_scratch(int slot, size_t floats) {
  pthread_once(&azyx_scratch_once, azyx_scratch_init);
  azyx_scratch_t* s = (azyx_scratch_t*)pthread_getspecific(azyx_scratch_key);
  if (!s) { s = (azyx_scratch_t*)calloc(1, sizeof(azyx_scratch_t)); pthread_setspecific(azyx_scratch_key, s); }
  if (s->n[slot] < floats) {
    free(s->p[slot]);
    s->n[slot] = (floats + 15) / 16 * 16;
    s->p[slot] = (float*)aligned_alloc(64, s->n[slot] * sizeof(float));
  }
  return s->p[slot];
}
#endif
"""


def render_c(g: Gemm, name: str, ctype: str) -> str:
    """The product as a SHARED C kernel, `name(lo, hi, C, operands...)`: blocks [lo, hi) of `trip(g)`. `ctype`: the C
    type of the dtype's storage (the C dialect's table)."""
    if skinny(g):
        return render_skinny(g, name, ctype)
    bl = blocks(g)
    vl = _width(g.simd) // 4
    tile, micro = _micro_kernel(bl.mr, bl.nr, vl, g.bf16_dot)
    intrinsics = "#include <immintrin.h>\n" if g.bf16_dot else ""
    return _HELPERS + intrinsics + micro + _blocked_loops(g, name, ctype, bl, tile)


def _micro_kernel(mr: int, nr: int, vl: int, dot: bool) -> tuple[str, str]:
    """(name, source) of the register tile of an MR x NR block of C: per k (per k pair: AVX-512 BF16), a row of A's
    strip broadcast against NR/VL vectors of B's; C's tile set or added once, a partial one through a spill."""
    nv = nr // vl
    vt, vu = f"azyx_v{vl}", f"azyx_v{vl}u"
    acc = [[f"c{i}_{v}" for v in range(nv)] for i in range(mr)]
    decl = " ".join(f"{vt} {', '.join(f'{x} = {{0}}' for x in row)};" for row in acc)
    bload = " ".join(f"const {vt} b{v} = *(const {vt}*)(b + {v * vl});" for v in range(nv))
    fmas = [" ".join(f"{x} += a * b{v};" for v, x in enumerate(row)) for row in acc]
    fma = "\n".join(f"      {{ const float a = ap[{i}]; {f} }}" for i, f in enumerate(fmas))
    cells = [(i, v, x) for i in range(mr) for v, x in enumerate(acc[i])]
    full_set = "\n".join(f"    *({vu}*)(c + {i} * ldc + {v * vl}) = {x};" for i, v, x in cells)
    full_add = "\n".join(f"    *({vu}*)(c + {i} * ldc + {v * vl}) += {x};" for i, v, x in cells)
    spill = "\n".join(f"    *({vt}*)(t + {i * nr + v * vl}) = {x};" for i, v, x in cells)
    tile = f"azyx_tile_{'bf16_' if dot else ''}{mr}x{nr}_{vl}"
    word = "unsigned int" if dot else "float"
    if dot:  # per k pair: A's pair broadcast, B's pairs of NR columns loaded, NR/VL dot products per row
        bload = " ".join(f"const __m512bh b{v} = (__m512bh)*(const __m512i*)(b + {v * vl});" for v in range(nv))
        fma = "\n".join(f"      {{ const __m512bh a = (__m512bh)_mm512_set1_epi32((int)ap[{i}]); "
                        + " ".join(f"{x} = _mm512_dpbf16_ps({x}, a, b{v});" for v, x in enumerate(row)) + " }"
                        for i, row in enumerate(acc))
    return tile, f"""#ifndef {tile.upper()}
#define {tile.upper()}
static inline __attribute__((always_inline)) void {tile}(long kn, const {word}* restrict ap, const {word}* restrict b,
    float* restrict c, long ldc, int first, long rows, long cols) {{
  {decl}
  for (long i = 0; i < rows; i++) {{  /* C's tile is read or written after the loop: on its way meanwhile */
    __builtin_prefetch(c + i * ldc, 1);
    __builtin_prefetch(c + i * ldc + cols - 1, 1);
  }}
  for (long p = 0; p < kn; p++, ap += {mr}, b += {nr}) {{
    {bload}
{fma}
  }}
  if (rows == {mr} && cols == {nr}) {{
    if (first) {{
{full_set}
    }} else {{
{full_add}
    }}
    return;
  }}
  float t[{mr * nr}] __attribute__((aligned(64)));
{spill}
  for (long i = 0; i < rows; i++)
    for (long j = 0; j < cols; j++) c[i * ldc + j] = first ? t[i * {nr} + j] : c[i * ldc + j] + t[i * {nr} + j];
}}
#endif
"""


def _blocked_loops(g: Gemm, name: str, ctype: str, bl: Blocks, tile: str) -> str:
    """The kernel around the micro-kernel: for each of its blocks of C, K in slices of KC, B's KC x NC panel packed
    once per slice, A's MC x KC block per row block, then the micro-kernel over the block's MR x NR tiles."""
    mr, nr, mc, kc, nc = bl.mr, bl.nr, bl.mc, bl.kc, bl.nc
    pa, a_off, a_sb, a_si, a_sk = g.a
    pb, b_off, b_sb, b_sk, b_sj = g.b
    n_i, n_j = _cdiv(g.m, mc), _cdiv(g.n, nc)
    load, store = FLOAT_LOADS[g.dtype], FLOAT_STORES[g.dtype]
    params = ", ".join(f"const {ctype}* restrict d{i}" for i in range(1, 1 + max(pa, pb)))
    # packing: A's block -> strips of MR rows, each k-major (MR floats per k); B's panel -> strips of NR columns (NR
    # floats per k); zero-padded to whole strips
    dot = g.bf16_dot
    if dot:  # bfloat16 pairs along K, one 32-bit word per (row or column, k pair): what vdpbf16ps multiplies
        a_pack = _pack_pairs("A", "ap", "i0", "rows_ic", mr, a_si, a_sk)
        b_pack = _pack_pairs("B", "bp", "j0", "cols_jc", nr, b_sj, b_sk)
    else:
        a_pack = _pack("A", "ap", "i0", "rows_ic", mr, a_si, a_sk, load, _width(g.simd) // 4)
        b_pack = _pack("B", "bp", "j0", "cols_jc", nr, b_sj, b_sk, load, _width(g.simd) // 4)
    f32 = g.dtype == "float32"
    # C's block: float32 C is written in place (a later K slice adds to it); another dtype goes through a float32
    # block (K unsliced: one pass), rounded once
    cblock = "float* cb = C + (long)i0 * ldc + j0;" if f32 else "float* cb = cf;"
    ldc = g.n if f32 else nc
    out_round = "" if f32 else f"""
      for (long i = 0; i < rows_ic; i++) for (long j = 0; j < cols_jc; j++)
        Co[(long)(i0 + i) * {g.n} + j0 + j] = {store.format(x=f"cf[i * {nc} + j]")};"""
    word, kw, kws = ("unsigned int", "kp", _cdiv(kc, 2)) if dot else ("float", "kn", kc)  # (a packed k's type, count)
    return f"""
__attribute__((optimize("no-tree-loop-distribute-patterns")))  /* (a strip's row: no call to memcpy) */
void {name}(long lo, long hi, {ctype}* restrict d0, {params}) {{
  {word}* bp = ({word}*)azyx_scratch(0, {kws * _cdiv(nc, nr) * nr});
  {word}* ap = ({word}*)azyx_scratch(1, {kws * _cdiv(mc, mr) * mr + (0 if f32 else mc * nc)});
  {"" if f32 else f"float* cf = (float*)(ap + {kws * _cdiv(mc, mr) * mr});"}
  const long ldc = {ldc};
  for (long t = lo; t < hi;) {{
    const long bz = t / {n_i * n_j}, jb = t / {n_i} % {n_j}, ib0 = t % {n_i};
    const long ib1 = ib0 + (hi - t) < {n_i} ? ib0 + (hi - t) : {n_i};
    const {ctype}* A = d{pa} + {a_off}L + bz * {a_sb}L;
    const {ctype}* B = d{pb} + {b_off}L + bz * {b_sb}L;
    {"float* C = (float*)d0 + bz * " + str(g.m * g.n) + "L;" if f32 else f"{ctype}* Co = d0 + bz * {g.m * g.n}L;"}
    const long j0 = jb * {nc}, cols_jc = {g.n} - j0 < {nc} ? {g.n} - j0 : {nc};
    for (long k0 = 0; k0 < {g.k}; k0 += {kc}) {{
      const long kn = {g.k} - k0 < {kc} ? {g.k} - k0 : {kc};{" const long kp = (kn + 1) / 2;" if dot else ""}
      {b_pack}
      for (long ib = ib0; ib < ib1; ib++) {{
        const long i0 = ib * {mc}, rows_ic = {g.m} - i0 < {mc} ? {g.m} - i0 : {mc};
        {a_pack}
        {cblock}
        for (long js = 0; js < cols_jc; js += {nr})
          for (long is = 0; is < rows_ic; is += {mr})
            {tile}({kw}, ap + is * {kw}, bp + js * {kw}, cb + is * ldc + js, ldc, k0 == 0,
                   rows_ic - is < {mr} ? rows_ic - is : {mr},
                   cols_jc - js < {nr} ? cols_jc - js : {nr});{out_round}
      }}
    }}
    t += ib1 - ib0;
  }}
}}
"""


def _pack(src: str, dst: str, x0: str, n: str, width: int, s_x: int, s_k: int, load: str, vl: int = 0) -> str:
    """The loops that pack `n` rows (A) or columns (B) of operand `src` from `x0` on, K slice [k0, k0 + kn), into
    strips of `width` (strip s holds element (x, k) at `dst[s * width * kn + k * width + x % width]`; the last strip
    zero-padded). The loop along the operand's contiguous axis innermost, over the whole block where that is x (B as
    stored, A transposed: rows of the operand read whole, in order), else strip by strip (A as stored, B transposed:
    `width` rows read along k side by side)."""
    el = load.format(x=f"s[{'x' if s_x == 1 else f'x * {s_x}L'}]")
    head = f"""{{
        const long n = {n}, full = n / {width} * {width};
        if (full < n) for (long q = full * kn; q < (full + {width}) * kn; q++) {dst}[q] = 0.f;"""
    if s_x == 1 and abs(s_k) != 1:
        return f"""{head}
        for (long k = 0; k < kn; k++) {{
          const __typeof__({src}[0])* s = {src} + (k0 + k) * {s_k}L + {x0};
          for (long x0 = 0; x0 < full; x0 += {width}, s += {width}) {{
            float* restrict d = {dst} + x0 * kn + k * {width};
            for (long x = 0; x < {width}; x++) d[x] = {el};
          }}
          for (long x = 0; x < n - full; x++) {dst}[full * kn + k * {width} + x] = {el};
        }}
      }}"""
    el = load.format(x=f"s[{'k' if s_k == 1 else f'k * {s_k}L'}]")
    scalar = f"""for (long x = 0; x < {width} && x0 + x < n; x++) {{
            const __typeof__({src}[0])* s = {src} + ({x0} + x0 + x) * {s_x}L + k0 * {s_k}L;
            for (long k = k1; k < kn; k++) d[k * {width} + x] = {el};
          }}"""
    if not (s_k == 1 and load == "{x}" and vl > 1 and (width % vl == 0 or width < vl)):
        return f"""{head}
        for (long x0 = 0; x0 < n; x0 += {width}) {{
          float* restrict d = {dst} + x0 * kn;
          const long k1 = 0;
          {scalar}
        }}
      }}"""
    # float32 read along k (B as `x @ W.T` reads W, A as stored): VL x VL tiles of the operand transposed in vector
    # registers, a whole strip at a time; a partial strip and K's last elements as above. A strip narrower than a
    # vector (A's MR rows) stores whole vectors, each row's spill past the strip's width overwritten by the next row's
    # store, the last one's by the scalar loop (which the vector loop leaves at least one k)
    rows, last = min(width, vl), "<=" if width >= vl else "<"
    return f"""{head}
        for (long x0 = 0; x0 < n; x0 += {width}) {{
          float* restrict d = {dst} + x0 * kn;
          long k1 = 0;
          if (x0 + {width} <= n)
            for (; k1 + {vl} {last} kn; k1 += {vl})
              for (long g = 0; g < {width}; g += {vl}) {{
                const float* s = {src} + ({x0} + x0 + g) * {s_x}L + k0 + k1;
                {_transpose(vl, rows, s_x, f"d + k1 * {width} + g", width)}
              }}
          {scalar}
        }}
      }}"""


def _transpose(vl: int, rows: int, stride: int, out: str, ld: int) -> str:
    """C statements: the `rows` x VL tile at `s` (rows `stride` floats apart; its last row read again for the VL -
    rows past it) stored transposed at `out` (VL rows of VL floats, `ld` floats apart, in order), through VL vector
    registers: log2(VL) rounds of two-input shuffles, round h swapping the off-diagonal h x h blocks of every 2h x 2h
    block (row bit h with column bit h)."""
    vt, vu = f"azyx_v{vl}", f"azyx_v{vl}u"
    lines = [f"{vt} r{i} = *(const {vu}*)(s + {min(i, rows - 1) * stride}L);" for i in range(vl)]
    h = vl // 2
    while h:
        lo = ", ".join(str(j if j & h == 0 else vl + j - h) for j in range(vl))  # row i: [A, C]
        hi = ", ".join(str(j + h if j & h == 0 else vl + j) for j in range(vl))  # row i + h: [B, D]
        for i in range(vl):
            if i & h == 0:
                lines.append(f"{{ const {vt} t = r{i}; r{i} = __builtin_shuffle(t, r{i + h}, (azyx_i{vl}){{{lo}}}); "
                             f"r{i + h} = __builtin_shuffle(t, r{i + h}, (azyx_i{vl}){{{hi}}}); }}")
        h //= 2
    lines += [f"*({vu}*)({out} + {i * ld}) = r{i};" for i in range(vl)]
    return "\n                ".join(lines)


def _pack_pairs(src: str, dst: str, x0: str, n: str, width: int, s_x: int, s_k: int) -> str:
    """`_pack` for the AVX-512 BF16 micro-kernel: bfloat16 as stored, two consecutive k of one row (A) or column (B)
    in one 32-bit word, k even in its low half (strip s holds the pair (x, k pair p) at `dst[s * width * kp + p * width
    + x % width]`, kp = ceil(kn / 2)); an odd slice's last word has a zero high half, the last strip is zero-padded."""
    head = f"""{{
        const long n = {n}, full = n / {width} * {width}, kh = kn / 2;
        if (full < n) for (long q = full * kp; q < (full + {width}) * kp; q++) {dst}[q] = 0;"""
    if s_x == 1 and abs(s_k) != 1:  # two rows of the operand read side by side, interleaved
        def rows(hi: str) -> str:
            pair = f"s[x] | (unsigned int)s[x + {s_k}L] << 16" if hi else "s[x]"
            return f"""for (long xs = 0; xs < full; xs += {width}, s += {width}) {{
            unsigned int* restrict d = {dst} + xs * kp + p * {width};
            for (long x = 0; x < {width}; x++) d[x] = {pair};
          }}
          for (long x = 0; x < n - full; x++) {dst}[full * kp + p * {width} + x] = {pair};"""
        return f"""{head}
        for (long p = 0; p < kp; p++) {{
          const __typeof__({src}[0])* s = {src} + (k0 + 2 * p) * {s_k}L + {x0};
          if (p < kh) {{
          {rows("hi")}
          }} else {{
          {rows("")}
          }}
        }}
      }}"""
    word = ("({ unsigned int w; __builtin_memcpy(&w, s + 2 * p, 4); w; })" if s_k == 1 else
            f"s[2 * p * {s_k}L] | (unsigned int)s[(2 * p + 1) * {s_k}L] << 16")  # (x86: little-endian)
    return f"""{head}
        for (long xs = 0; xs < n; xs += {width}) {{
          unsigned int* restrict d = {dst} + xs * kp;
          for (long x = 0; x < {width} && xs + x < n; x++) {{
            const __typeof__({src}[0])* s = {src} + ({x0} + xs + x) * {s_x}L + k0 * {s_k}L;
            for (long p = 0; p < kh; p++) d[p * {width} + x] = {word};
            if (kh < kp) d[kh * {width} + x] = s[2 * kh * {s_k}L];
          }}
        }}
      }}"""


# OpenCL on a CPU (PoCL): vector width in bytes -> (MR rows, lanes of a vector); a tile is MR rows x two vectors
CL_TILES = {64: (12, 16), 32: (6, 8), 16: (6, 4)}


def product_cl(k: Kernel, simd: int) -> Gemm | None:
    """The product `k` computes where the OpenCL template takes it (float32, B contiguous along its columns: `x @ W.T`
    with W as stored gets W.T copied first, as on the generic path), else None."""
    g = gemm.match(k, ITEM_TILES, simd=simd)
    if g is None or g.b[4] != 1 or g.m < MIN_ROWS or g.n < MIN_COLS or g.k < MIN_K:
        return None
    return g


def cl_items(g: Gemm) -> int:
    """Work items of the OpenCL product: one per MR x NR tile of C."""
    mr, vl = CL_TILES[_width(g.simd)]
    return g.batch * _cdiv(g.m, mr) * _cdiv(g.n, 2 * vl)


def render_cl(g: Gemm, name: str) -> str:
    """The product for OpenCL on a CPU: a work item (a work group of one) computes an MR x 2VL tile of C in vector
    registers, A's elements broadcast and B's rows loaded VL at a time where they lie (no packing: PoCL runs each work
    group as one thread's loop). Items run rows first, so the ones a thread takes in a row share B's panel in its
    cache. An edge tile reads the last row and column again for those past C's edge and stores only C's own cells.
    (AMD EPYC with AVX-512, 2 threads: 1024^3 to 1536^3 at 420-500 GFLOP/s, about the C backend's packed kernel.)"""
    mr, vl = CL_TILES[_width(g.simd)]
    nr, vt = 2 * vl, f"float{vl}"
    pa, a_off, a_sb, a_si, a_sk = g.a
    pb, b_off, b_sb, b_sk, _ = g.b
    n_i, n_j = _cdiv(g.m, mr), _cdiv(g.n, nr)
    params = ", ".join(f"__global const float* restrict d{i}" for i in range(1, 1 + max(pa, pb)))
    acc = [(f"c{i}_0", f"c{i}_1") for i in range(mr)]
    decl = " ".join(f"{vt} {x} = 0.f, {y} = 0.f;" for x, y in acc)

    def fmas(row: str) -> str:
        return "\n".join(f"      {{ const float a = A[{row.format(i=i)} * {a_si}L + k * {a_sk}L]; "
                         f"{x} = fma(({vt})a, b0, {x}); {y} = fma(({vt})a, b1, {y}); }}"
                         for i, (x, y) in enumerate(acc))

    full = "\n".join(f"    vstore{vl}({x}, 0, C + (i0 + {i}) * {g.n}L + j0); "
                     f"vstore{vl}({y}, 0, C + (i0 + {i}) * {g.n}L + j0 + {vl});" for i, (x, y) in enumerate(acc))
    edge = "\n".join(f"  if (i0 + {i} < {g.m}) {{ vstore{vl}({x}, 0, t); vstore{vl}({y}, 0, t + {vl}); "
                     f"for (int j = 0; j < {nr} && j0 + j < {g.n}; j++) C[(i0 + {i}) * {g.n}L + j0 + j] = t[j]; }}"
                     for i, (x, y) in enumerate(acc))
    return f"""__kernel __attribute__((reqd_work_group_size(1, 1, 1)))
void {name}(__global float* restrict d0, {params}) {{
  const long t0 = get_global_id(0);
  const long bz = t0 / {n_i * n_j}, j0 = t0 / {n_i} % {n_j} * {nr}, i0 = t0 % {n_i} * {mr};
  __global const float* A = d{pa} + {a_off}L + bz * {a_sb}L;
  __global const float* B = d{pb} + {b_off}L + bz * {b_sb}L;
  __global float* C = d0 + bz * {g.m * g.n}L;
  {decl}
  if (i0 + {mr} <= {g.m} && j0 + {nr} <= {g.n}) {{
    for (long k = 0; k < {g.k}; k++) {{
      const {vt} b0 = vload{vl}(0, B + k * {b_sk}L + j0), b1 = vload{vl}(0, B + k * {b_sk}L + j0 + {vl});
{fmas("(i0 + {i})")}
    }}
{full}
    return;
  }}
  float t[{nr}];
  for (long k = 0; k < {g.k}; k++) {{
    for (int j = 0; j < {nr}; j++) t[j] = B[k * {b_sk}L + min(j0 + j, {g.n - 1}L)];
    const {vt} b0 = vload{vl}(0, t), b1 = vload{vl}(0, t + {vl});
{fmas("min(i0 + {i}, " + str(g.m - 1) + "L)")}
  }}
{edge}
}}
"""

