"""The C-family renderer: one linear pass from a `Kernel` to C99 (OpenCL C and CUDA C are dialects).

Placement: a value is computed in the outermost loop where all of its variables are defined; values that
depend on a reduce's variables live in that reduce's loop; values that depend on upcast (register-tile)
variables are computed inside small constant-bound loops that the compiler unrolls and vectorises.

GPU-style dialects (`global_ids`) run one work item per output point. Where a reduce is long and its loads
are contiguous along it (a row sum), or there are too few outputs to fill the device, a work group of
`group_size` items reduces each output instead ("grouped"): each item accumulates a strided share, then a tree
in shared memory combines them, so neighbouring items read neighbouring addresses (see `group_size`).

Facts that optimisation actions set (azyx.optimize) are read here as they are: `Kernel.unroll` steps of a reduce's
innermost loop per iteration (each step in braces of its own, in the loop's order: the accumulation order stays the
plain loop's), `Kernel.vector` elements per vector load and store (`vector_width`; where `vector_fits`).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from azyx.dtypes import DType, dtypes
from azyx.ir import Kernel, V, scalar_args, toposort
from azyx.ops import REDUCE
from azyx.symbolic import Cond, Div, Lin, Mod, Var


@dataclass(frozen=True)
class Dialect:
    name: str
    kernel_prefix: str
    buffer_qual: str
    restrict: str
    index_type: str
    types: dict[str, str]
    fn_suffix_f32: str  # math functions on float: "f" for C's expf, "" where names are overloaded
    prelude: str
    pragmas: bool  # OpenMP pragmas for host loops
    guarded_prefix: str = ""  # before kernels whose loads are guarded by index conditions (pads)
    global_ids: str = ""  # GPU-style: the expression of a work item's linear id; global loops become index math
    # hides a value from the optimiser ({x}): gcc turns the register-tiled reduce loop of a matmul into slow code
    # for some constant trip counts (18 instead of 270 GFLOP/s at K=784); an opaque bound keeps the fast form
    opaque: str = ""
    compute_types: dict[str, str] = field(default_factory=dict)  # where the compute type differs from storage
    # per storage dtype: how to load ({buf}, {idx}), store ({buf}, {idx}, {val}) and round to it ({x})
    loads: dict[str, str] = field(default_factory=dict)
    stores: dict[str, str] = field(default_factory=dict)
    rounds: dict[str, str] = field(default_factory=dict)
    narrow_index: str = ""  # a 32-bit index type for kernels whose indices fit (64-bit division is slow on GPUs)
    # grouped reductions: work-group size (0: none), group and local id, shared-memory qualifier, barrier
    group_size: int = 0
    block: int = 0  # GPU-style: work items per group of a kernel with one work item per output point
    gemm: bool = False  # matrix products get the tiled template of azyx.gemm
    tensor_cores: bool = False  # ... and float16/bfloat16 products its tensor-core kernel (CUDA: mma.sync, sm_80 on)
    attention: bool = False  # attention is one kernel of azyx.attention (else its composed form runs)
    simd: int = 16  # host: vector register width in bytes (the C device's ISA: 32 AVX2, 64 AVX-512), for azyx.gemm_host
    bf16_dot: bool = False  # host: the compiler targets AVX-512 BF16 (vdpbf16ps), for bfloat16 products (gemm_host)
    group_ids: tuple[str, str] = ("", "")
    shared: str = ""
    barrier: str = ""
    unroll: str = ""  # before a strided reduce loop, so several loads are in flight per work item
    shuffle: str = ""  # a warp's butterfly shuffle of {x} with lane ^ {o} (32 lanes): no barrier inside a warp
    warp: int = 0  # with `shuffle`: where outputs are many, a warp (not a whole group) reduces each output
    warp_outputs: int = 4096  # ... from this many outputs on
    # a reduce read along its outputs (a column sum) with a few thousand outputs runs in two stages, partial rows first
    # (schedule.column_parts): one work item per output walking its column leaves most of a GPU idle
    split_columns: bool = False
    # a vector of {n} floats: float32 kernels may move `vector_width` elements (2 or 4; 0: none unless the kernel asks,
    # Kernel.vector) per load and store; `vector_load`/`vector_store`: at {ptr} where a cast pointer will not do
    vector: str = ""
    vector_width: int = 0
    vector_load: str = ""
    vector_store: str = ""
    copies: int = 1  # a grouped reduce's steps per loop iteration (where the dialect has no unroll pragma: GLSL)
    max_trips: int = 0  # a driver's bound on a shader's loop iterations (llvmpipe stops loops silently past 65535)
    # integer max/min as azyx_max/azyx_min of the prelude: NVRTC (CUDA 13) miscompiles `(-x > acc ? -x : acc)` in
    # an unrolled reduce that starts at INT_MIN (max(-x, c) rewritten as -min(x, -c)); an asm max is opaque to it
    int_minmax: bool = False
    cast: str = "(({t}){x})"  # a conversion of {x} to type {t}
    fns: dict[str, str] = field(default_factory=dict)  # math functions under another name (GLSL: fabs is abs)
    int64_suffix: str = "LL"
    double_suffix: str = ""  # (GLSL: an unsuffixed literal is a float)
    glsl: bool = False  # buffers are addresses and scalars words of a words buffer, shared memory is global, entry main
    bools: tuple[str, str] = ("0", "1")  # false, true
    max_groups: int = 0  # work groups per grid dimension (0: no limit); a longer grid folds into the next dimension

    def ctype(self, d: DType) -> str:
        return self.types[d.name]

    def compute_type(self, d: DType) -> str:
        if d in (dtypes.float16, dtypes.bfloat16):
            return self.types["float32"]
        return self.compute_types.get(d.name) or self.types[d.name]


def _ipow(qualifiers: str, t: str) -> str:
    """Integer power in every C-family prelude (b < 0: only 1 and -1 have an integer result)."""
    return f"""{qualifiers} {t} ipow({t} a, {t} b) {{
  if (b < 0) return a == 1 ? 1 : (a == -1 ? ((b & 1) ? -1 : 1) : 0);
  {t} r = 1; while (b) {{ if (b & 1) r *= a; a *= a; b >>= 1; }} return r;
}}
"""


_C_PRELUDE = """#include <math.h>
#if defined(__x86_64__) && defined(__GLIBC__) && !defined(__FAST_MATH__)
/* glibc's vector math (libmvec, pulled in by -lm): loops that call these vectorise (without, one libm call per
   element: erff in a GELU ran 10x slower than the matrix product before it) */
#define AZYX_VEC __attribute__((__simd__("notinbranch"), __const__))
float expf(float) AZYX_VEC; float logf(float) AZYX_VEC; float sinf(float) AZYX_VEC; float cosf(float) AZYX_VEC;
float powf(float, float) AZYX_VEC; double exp(double) AZYX_VEC; double log(double) AZYX_VEC;
double sin(double) AZYX_VEC; double cos(double) AZYX_VEC; double pow(double, double) AZYX_VEC;
#if __GLIBC_PREREQ(2, 35)
float erff(float) AZYX_VEC; float tanhf(float) AZYX_VEC; float tanf(float) AZYX_VEC; float exp2f(float) AZYX_VEC;
float log2f(float) AZYX_VEC; float log1pf(float) AZYX_VEC; float expm1f(float) AZYX_VEC;
double erf(double) AZYX_VEC; double tanh(double) AZYX_VEC; double tan(double) AZYX_VEC; double exp2(double) AZYX_VEC;
double log2(double) AZYX_VEC; double log1p(double) AZYX_VEC; double expm1(double) AZYX_VEC;
#endif
#endif
typedef unsigned short bf16_t;
static inline float bf2f(bf16_t x) { union { unsigned int i; float f; } u; u.i = ((unsigned int)x) << 16; return u.f; }
static inline bf16_t f2bf(float f) {
  union { unsigned int i; float f; } u; u.f = f;
  if (f != f) return (bf16_t)0x7fc0;
  return (bf16_t)((u.i + 0x7fffu + ((u.i >> 16) & 1u)) >> 16);
}
#pragma omp declare reduction(nmaxf : float : omp_out = (omp_in > omp_out || omp_in != omp_in) ? omp_in : omp_out) \
  initializer(omp_priv = -INFINITY)
#pragma omp declare reduction(nminf : float : omp_out = (omp_in < omp_out || omp_in != omp_in) ? omp_in : omp_out) \
  initializer(omp_priv = INFINITY)
#pragma omp declare reduction(nmaxd : double : omp_out = (omp_in > omp_out || omp_in != omp_in) ? omp_in : omp_out) \
  initializer(omp_priv = -INFINITY)
#pragma omp declare reduction(nmind : double : omp_out = (omp_in < omp_out || omp_in != omp_in) ? omp_in : omp_out) \
  initializer(omp_priv = INFINITY)
""" + _ipow("static inline", "long long")

C = Dialect(
    name="c",
    kernel_prefix="void",
    buffer_qual="",
    restrict="restrict",
    index_type="long",
    types={"bool": "_Bool", "int8": "signed char", "uint8": "unsigned char", "int16": "short", "int32": "int",
           "uint32": "unsigned int", "int64": "long long", "float16": "_Float16", "bfloat16": "bf16_t",
           "float32": "float", "float64": "double"},
    fn_suffix_f32="f",
    prelude=_C_PRELUDE,
    pragmas=True,
    gemm=True,
    opaque='__asm__("" : "+r"({x}));',
    loads={"float16": "(float){buf}[{idx}]", "bfloat16": "bf2f({buf}[{idx}])"},
    stores={"float16": "{buf}[{idx}] = (_Float16){val};", "bfloat16": "{buf}[{idx}] = f2bf({val});"},
    rounds={"float16": "((float)(_Float16){x})", "bfloat16": "bf2f(f2bf((float){x}))"},
    # gcc 12.2 vectorises loop nests whose loads are guarded by range tests on an outer loop index wrongly (whole
    # rows read as zeros) under its default cost model; the cheapest model compiles them right
    guarded_prefix='__attribute__((optimize("vect-cost-model=very-cheap"))) ',
    attention=True,
)

_CL_PRELUDE = """#pragma OPENCL EXTENSION cl_khr_fp64 : enable
inline float bf2f(ushort x) { return as_float(((uint)x) << 16); }
inline ushort f2bf(float f) {
  uint i = as_uint(f);
  if (f != f) return (ushort)0x7fc0;
  return (ushort)((i + 0x7fffu + ((i >> 16) & 1u)) >> 16);
}
inline float f16r(float x) {
  ushort h; vstore_half(x, 0, (__private half*)&h); return vload_half(0, (__private half*)&h);
}
""" + _ipow("inline", "long")

OPENCL = Dialect(
    name="opencl",
    kernel_prefix="__kernel void",
    buffer_qual="__global ",
    restrict="restrict",
    index_type="long",
    types={"bool": "uchar", "int8": "char", "uint8": "uchar", "int16": "short", "int32": "int", "uint32": "uint",
           "int64": "long", "float16": "half", "bfloat16": "ushort", "float32": "float", "float64": "double"},
    fn_suffix_f32="",
    prelude=_CL_PRELUDE,
    pragmas=False,
    global_ids="get_global_id(0)",
    block=64,  # a multiple of every SIMD width seen
    compute_types={"bool": "bool"},
    loads={"float16": "vload_half({idx}, {buf})", "bfloat16": "bf2f({buf}[{idx}])"},
    stores={"float16": "vstore_half({val}, {idx}, {buf});", "bfloat16": "{buf}[{idx}] = f2bf({val});"},
    rounds={"float16": "f16r({x})", "bfloat16": "bf2f(f2bf((float){x}))"},
    narrow_index="int",
    group_size=64,
    group_ids=("get_group_id(0)", "get_local_id(0)"),
    shared="__local",
    barrier="barrier(CLK_LOCAL_MEM_FENCE);",
    vector="float{n}",  # (none by default: PoCL vectorises work items itself; the search may try it)
    vector_load="vload{n}(0, {ptr})",
    vector_store="vstore{n}({val}, 0, {ptr});",
)

_CUDA_PRELUDE = """#define INFINITY __int_as_float(0x7f800000)
#define NAN __int_as_float(0x7fffffff)
typedef unsigned short f16_t;
typedef unsigned short bf16_t;
__device__ inline float bf2f(bf16_t x) { return __uint_as_float(((unsigned int)x) << 16); }
__device__ inline bf16_t f2bf(float f) {
  unsigned int i = __float_as_uint(f);
  if (f != f) return (bf16_t)0x7fc0;
  return (bf16_t)((i + 0x7fffu + ((i >> 16) & 1u)) >> 16);
}
__device__ inline float h2f(f16_t x) { float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x)); return f; }
__device__ inline f16_t f2h(float f) { f16_t h; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f)); return h; }
""" + _ipow("__device__ inline", "long long") + "".join(
    f'__device__ inline {t} azyx_{op}({t} a, {t} b) {{ {t} r; asm("{op}.{p} %0, %1, %2;" : "={c}"(r) : "{c}"(a), '
    f'"{c}"(b)); return r; }}\n'
    for op in ("max", "min") for t, p, c in (("int", "s32", "r"), ("unsigned int", "u32", "r"),
                                             ("long long", "s64", "l"), ("unsigned long long", "u64", "l")))

CUDA = Dialect(
    name="cuda",
    kernel_prefix='extern "C" __global__ void',
    buffer_qual="",
    restrict="__restrict__",
    index_type="long long",
    types={"bool": "bool", "int8": "signed char", "uint8": "unsigned char", "int16": "short", "int32": "int",
           "uint32": "unsigned int", "int64": "long long", "float16": "f16_t", "bfloat16": "bf16_t",
           "float32": "float", "float64": "double"},
    fn_suffix_f32="f",
    prelude=_CUDA_PRELUDE,
    pragmas=False,
    global_ids="((long long)blockIdx.x*blockDim.x+threadIdx.x)",
    block=256,
    gemm=True,
    tensor_cores=True,  # (a device older than sm_80 turns it off)
    attention=True,
    loads={"float16": "h2f({buf}[{idx}])", "bfloat16": "bf2f({buf}[{idx}])"},
    stores={"float16": "{buf}[{idx}] = f2h({val});", "bfloat16": "{buf}[{idx}] = f2bf({val});"},
    rounds={"float16": "h2f(f2h({x}))", "bfloat16": "bf2f(f2bf((float){x}))"},
    narrow_index="int",
    group_size=256,
    group_ids=("blockIdx.x", "threadIdx.x"),
    shared="__shared__",
    barrier="__syncthreads();",
    unroll="#pragma unroll 8",
    shuffle="__shfl_xor_sync(0xffffffffu, {x}, {o})",
    warp=32,
    split_columns=True,
    vector="float{n}",
    vector_width=4,
    int_minmax=True,
)


_GLSL_PRELUDE = """#version 450
#extension GL_EXT_shader_explicit_arithmetic_types : require
#extension GL_EXT_shader_8bit_storage : require
#extension GL_EXT_shader_16bit_storage : require
#extension GL_EXT_buffer_reference : require
#define INFINITY uintBitsToFloat(0x7f800000u)
#define NAN uintBitsToFloat(0x7fc00000u)
float bf2f(uint16_t x) { return uintBitsToFloat(uint(x) << 16); }
uint16_t f2bf(float f) {
  uint i = floatBitsToUint(f);
  if (f != f) return uint16_t(0x7fc0);
  return uint16_t((i + 0x7fffu + ((i >> 16) & 1u)) >> 16);
}
float f16r(float x) {  /* x rounded to float16 (to nearest even) in integer arithmetic, which no driver folds away
                          (NVIDIA's folds a float16 conversion and back, and packHalf2x16/unpackHalf2x16) */
  uint u = floatBitsToUint(x), s = u & 0x80000000u, a = u ^ s;
  if (a >= 0x7f800000u || a == 0u) return x;
  if (a >= 0x477ff000u) return uintBitsToFloat(s | 0x7f800000u);
  if (a >= 0x38800000u) return uintBitsToFloat(s | ((a + 0xfffu + ((a >> 13) & 1u)) & 0xffffe000u));
  int sh = 126 - int(a >> 23);  /* a float16 subnormal: a multiple of 2^-24 */
  if (sh > 24) return uintBitsToFloat(s);
  uint m = (a & 0x7fffffu) | 0x800000u, q = m >> uint(sh), r = m & ((1u << uint(sh)) - 1u), h = 1u << uint(sh - 1);
  if (r > h || (r == h && (q & 1u) != 0u)) q += 1u;
  return uintBitsToFloat(s | floatBitsToUint(float(q) * 5.9604644775390625e-8));
}
float azyx_fmod(float a, float b) { return a - b * trunc(a / b); }
double azyx_fmod(double a, double b) { return a - b * trunc(a / b); }
float azyx_copysign(float a, float b) { return (floatBitsToUint(b) >> 31) != 0u ? -abs(a) : abs(a); }
double azyx_copysign(double a, double b) { return (unpackDouble2x32(b).y >> 31) != 0u ? -abs(a) : abs(a); }
float azyx_log1p(float x) { float u = 1.0 + x; return u == 1.0 ? x : log(u) * (x / (u - 1.0)); }
float azyx_erf(float x) {  /* Abramowitz and Stegun 7.1.26: |error| < 1.5e-7 */
  float t = 1.0 / (1.0 + 0.3275911 * abs(x));
  float y = 1.0 - ((((1.061405429 * t - 1.453152027) * t + 1.421413741) * t - 0.284496736) * t + 0.254829592) * t
    * exp(-x * x);
  return x < 0.0 ? -y : y;
}
float azyx_pow(float x, float y) {  /* C's pow: GLSL's is undefined for x <= 0 */
  if (y == 0.0 || x == 1.0) return 1.0;
  if (x == 0.0) return y < 0.0 ? INFINITY : 0.0;
  float r = exp2(y * log2(abs(x)));
  if (x < 0.0) { if (y != floor(y)) return NAN; if (mod(y, 2.0) == 1.0) r = -r; }
  return r;
}
/* float64 math GLSL lacks (its exp, log, sin... take float only), to double precision; float calls the builtins */
const double LN2_HI = 6.93147180369123816490e-01lf, LN2_LO = 1.90821492927058770002e-10lf;
const double PIO2_1 = 1.57079632673412561417e+00lf, PIO2_2 = 6.07710050630396597660e-11lf;
const double PIO2_3 = 2.02226624871116645580e-21lf;
float azyx_exp(float x) { return exp(x); }
double azyx_exp(double x) {
  if (x != x) return x;
  if (x > 709.8lf) return double(INFINITY);
  if (x < -745.2lf) return 0.0lf;
  double k = floor(x * 1.44269504088896338700lf + 0.5lf);
  double r = (x - k * LN2_HI) - k * LN2_LO;
  double p = 1.0lf / 6227020800.0lf;
  p = p * r + 1.0lf / 479001600.0lf; p = p * r + 1.0lf / 39916800.0lf; p = p * r + 1.0lf / 3628800.0lf;
  p = p * r + 1.0lf / 362880.0lf; p = p * r + 1.0lf / 40320.0lf; p = p * r + 1.0lf / 5040.0lf;
  p = p * r + 1.0lf / 720.0lf; p = p * r + 1.0lf / 120.0lf; p = p * r + 1.0lf / 24.0lf; p = p * r + 1.0lf / 6.0lf;
  p = p * r + 0.5lf; p = p * r + 1.0lf; p = p * r + 1.0lf;
  int e = int(k);
  return e > 1000 ? ldexp(ldexp(p, e - 1000), 1000) : (e < -1000 ? ldexp(ldexp(p, e + 1000), -1000) : ldexp(p, e));
}
float azyx_log(float x) { return log(x); }
double azyx_log(double x) {
  if (x != x || x < 0.0lf) return double(NAN);
  if (x == 0.0lf) return -double(INFINITY);
  if (isinf(x)) return x;
  int e; double m = frexp(x, e);
  if (m < 0.70710678118654752440lf) { m *= 2.0lf; e -= 1; }
  double t = (m - 1.0lf) / (m + 1.0lf), t2 = t * t, p = 1.0lf / 25.0lf;
  for (int n = 23; n >= 1; n -= 2) p = p * t2 + 1.0lf / double(n);
  return 2.0lf * t * p + double(e) * LN2_LO + double(e) * LN2_HI;
}
float azyx_exp2(float x) { return exp2(x); }
double azyx_exp2(double x) { return azyx_exp(x * 6.93147180559945309417e-01lf); }
float azyx_log2(float x) { return log2(x); }
double azyx_log2(double x) { return azyx_log(x) * 1.44269504088896338700lf; }
double azyx_sin_r(double r) {  /* |r| <= pi/4 */
  double r2 = r * r, p = 1.0lf / 355687428096000.0lf;
  p = p * r2 - 1.0lf / 1307674368000.0lf; p = p * r2 + 1.0lf / 6227020800.0lf; p = p * r2 - 1.0lf / 39916800.0lf;
  p = p * r2 + 1.0lf / 362880.0lf; p = p * r2 - 1.0lf / 5040.0lf; p = p * r2 + 1.0lf / 120.0lf;
  p = p * r2 - 1.0lf / 6.0lf; p = p * r2 + 1.0lf;
  return r * p;
}
double azyx_cos_r(double r) {
  double r2 = r * r, p = 1.0lf / 20922789888000.0lf;
  p = p * r2 - 1.0lf / 87178291200.0lf; p = p * r2 + 1.0lf / 479001600.0lf; p = p * r2 - 1.0lf / 3628800.0lf;
  p = p * r2 + 1.0lf / 40320.0lf; p = p * r2 - 1.0lf / 720.0lf; p = p * r2 + 1.0lf / 24.0lf;
  p = p * r2 - 0.5lf; p = p * r2 + 1.0lf;
  return p;
}
double azyx_trig(double x, int shift) {  /* sin (shift 0) or cos (shift 1) by quadrant */
  if (isinf(x) || x != x) return double(NAN);
  double k = floor(x * 6.36619772367581382433e-01lf + 0.5lf);
  double r = ((x - k * PIO2_1) - k * PIO2_2) - k * PIO2_3;
  int q = (int(k) + shift) & 3;
  double v = (q & 1) == 0 ? azyx_sin_r(r) : azyx_cos_r(r);
  return q >= 2 ? -v : v;
}
float azyx_sin(float x) { return sin(x); }
double azyx_sin(double x) { return azyx_trig(x, 0); }
float azyx_cos(float x) { return cos(x); }
double azyx_cos(double x) { return azyx_trig(x, 1); }
float azyx_tan(float x) { return tan(x); }
double azyx_tan(double x) { return azyx_trig(x, 0) / azyx_trig(x, 1); }
float azyx_tanh(float x) { return tanh(x); }
double azyx_tanh(double x) {
  double a = abs(x), y;
  if (a < 0.05lf) {
    double a2 = a * a;
    y = a * (1.0lf + a2 * (-1.0lf / 3.0lf + a2 * (2.0lf / 15.0lf + a2 * (-17.0lf / 315.0lf + a2 * (62.0lf / 2835.0lf
      + a2 * (-1382.0lf / 155925.0lf))))));
  } else if (a > 22.0lf) { y = 1.0lf; }
  else { double t = azyx_exp(-2.0lf * a); y = (1.0lf - t) / (1.0lf + t); }
  return x < 0.0lf ? -y : (x != x ? x : y);
}
double azyx_log1p(double x) { double u = 1.0lf + x; return u == 1.0lf ? x : azyx_log(u) * (x / (u - 1.0lf)); }
double azyx_erf(double x) {
  double a = abs(x), y;
  if (x != x) return x;
  if (a < 2.0lf) {  /* the Taylor series: 2/sqrt(pi) sum (-1)^n x^(2n+1) / (n! (2n+1)) */
    double term = a, sum = a, a2 = a * a;
    for (int n = 1; n < 40; n++) { term *= -a2 / double(n); sum += term / double(2 * n + 1); }
    y = sum * 1.12837916709551257390lf;
  } else if (a < 6.0lf) {  /* erfc by its continued fraction, evaluated from the tail */
    double f = a;
    for (int n = 80; n >= 1; n--) f = a + (double(n) * 0.5lf) / f;
    y = 1.0lf - azyx_exp(-a * a) / (f * 1.77245385090551602730lf);
  } else { y = 1.0lf; }
  return x < 0.0lf ? -y : y;
}
double azyx_pow(double x, double y) {
  if (y == 0.0lf || x == 1.0lf) return 1.0lf;
  if (x == 0.0lf) return y < 0.0lf ? double(INFINITY) : 0.0lf;
  double r = azyx_exp(y * azyx_log(abs(x)));
  if (x < 0.0lf) { if (y != floor(y)) return double(NAN); if (mod(y, 2.0lf) == 1.0lf) r = -r; }
  return r;
}
int64_t ipow(int64_t a, int64_t b) {
  if (b < 0) return a == 1 ? 1 : (a == -1 ? ((b & 1) != 0 ? -1 : 1) : 0);
  int64_t r = 1; while (b != 0) { if ((b & 1) != 0) r *= a; a *= a; b >>= 1; } return r;
}
"""

GLSL = Dialect(
    name="glsl",
    kernel_prefix="",
    buffer_qual="",
    restrict="",
    index_type="int64_t",
    types={"bool": "uint8_t", "int8": "int8_t", "uint8": "uint8_t", "int16": "int16_t", "int32": "int",
           "uint32": "uint", "int64": "int64_t", "float16": "float16_t", "bfloat16": "uint16_t", "float32": "float",
           "float64": "double"},
    fn_suffix_f32="",
    prelude=_GLSL_PRELUDE,
    pragmas=False,
    global_ids="gl_GlobalInvocationID.x + gl_GlobalInvocationID.y * gl_NumWorkGroups.x * gl_WorkGroupSize.x",
    block=64,
    gemm=True,
    vector="vec{n}",
    vector_width=4,
    compute_types={"bool": "bool"},
    loads={"bool": "({buf}[{idx}]!=uint8_t(0))", "float16": "float({buf}[{idx}])", "bfloat16": "bf2f({buf}[{idx}])"},
    stores={"bool": "{buf}[{idx}] = uint8_t({val});", "float16": "{buf}[{idx}] = float16_t({val});",
            "bfloat16": "{buf}[{idx}] = f2bf({val});"},
    rounds={"float16": "f16r(float({x}))", "bfloat16": "bf2f(f2bf(float({x})))"},
    narrow_index="int",
    group_size=64,
    group_ids=("(gl_WorkGroupID.x + gl_WorkGroupID.y * gl_NumWorkGroups.x)", "gl_LocalInvocationID.x"),
    shared="shared",
    barrier="memoryBarrierShared(); barrier();",
    cast="{t}({x})",
    fns={"fabs": "abs", "rint": "roundEven", "fmod": "azyx_fmod", "copysign": "azyx_copysign", "log1p": "azyx_log1p",
         "erf": "azyx_erf", "pow": "azyx_pow", "exp": "azyx_exp", "log": "azyx_log", "exp2": "azyx_exp2",
         "log2": "azyx_log2", "sin": "azyx_sin", "cos": "azyx_cos", "tan": "azyx_tan", "tanh": "azyx_tanh"},
    int64_suffix="l",
    double_suffix="lf",
    glsl=True,
    bools=("false", "true"),
    max_groups=65535,
)


def _literal(v: object, d: DType, dl: Dialect) -> str:
    """A constant in source, parenthesised when negative: `x - (-0.75)` must not render as `x--0.75f`."""
    s = _literal_text(v, d, dl)
    return f"({s})" if s.startswith("-") else s


def _literal_text(v: object, d: DType, dl: Dialect) -> str:
    if d.is_bool:
        return dl.bools[bool(v)]
    if d.is_int:
        iv = int(v)  # type: ignore[call-overload]
        if d.itemsize == 8:
            sfx = dl.int64_suffix
            return f"{iv}{sfx}" if iv != -(2**63) else f"(-9223372036854775807{sfx}-1)"
        if iv == -(2**31) and d.itemsize == 4:
            return "(-2147483647-1)"
        text = f"{iv}u" if d.kind == "u" else str(iv)
        return dl.cast.format(t=dl.ctype(d), x=text) if dl.glsl and d.itemsize < 4 else text  # (no 8/16-bit literals)
    fv = float(v)  # type: ignore[arg-type]
    single = dl.compute_type(d) == dl.types["float32"]
    if math.isnan(fv):
        return "NAN" if single else dl.cast.format(t=dl.types["float64"], x="NAN")
    if math.isinf(fv):
        s = "-" if fv < 0 else ""
        return f"({s}INFINITY)" if single else f"({s}{dl.cast.format(t=dl.types['float64'], x='INFINITY')})"
    r = repr(fv)
    if "e" not in r and "." not in r:
        r += ".0"
    return f"{r}f" if single else r + dl.double_suffix


def _fn(name: str, d: DType, dl: Dialect) -> str:
    return dl.fns.get(name, name) + (dl.fn_suffix_f32 if dl.compute_type(d) == dl.types["float32"] else "")


_BOOL_AS_INT = {"add", "sub", "mul", "lt", "le", "gt", "ge", "max", "min"}


def alu_expr(op: str, d: DType, a: list[str], dl: Dialect, src_dtype: DType) -> str:
    """Source text of one elementwise op; `d` is the result dtype, `src_dtype` the operands' dtype."""
    if dl.glsl and src_dtype.is_bool and op in _BOOL_AS_INT:  # GLSL has no arithmetic or ordering on bool
        e = alu_expr(op, dtypes.int32, [dl.cast.format(t="int", x=x) for x in a], dl, dtypes.int32)
        return f"({e}!=0)" if d.is_bool and op in ("add", "sub", "mul", "max", "min") else e
    x = a[0]
    sd = src_dtype
    t = dl.compute_type(sd)
    fl = sd.is_float

    def c(e: str) -> str:  # `e` converted to the operands' compute type
        return dl.cast.format(t=t, x=e)

    if op == "neg":
        return f"(-{x})"
    if op == "abs":
        return f"{_fn('fabs', sd, dl)}({x})" if fl else f"({x}<0?-{x}:{x})"
    if op == "not":
        return f"(!{x})" if sd.is_bool else f"(~{x})"
    if op == "square":
        return f"({x}*{x})"
    if op == "sign":
        sign = f"({c(f'{x}>0')}-{c(f'{x}<0')})"
        return sign if not fl else f"({x}!={x}?{x}:{sign})"
    if op == "relu":
        return f"({x}<0?{c('0')}:{x})"  # NaN stays NaN
    if op in ("exp", "log", "exp2", "log2", "sqrt", "sin", "cos", "tan", "tanh", "erf", "floor", "ceil"):
        return f"{_fn(op, sd, dl)}({x})"
    if op == "round":
        return f"{_fn('rint', sd, dl)}({x})"
    if op == "rsqrt":
        return f"({c('1')}/{_fn('sqrt', sd, dl)}({x}))"
    if op == "reciprocal":
        return f"({c('1')}/{x})"
    if op == "sigmoid":
        return f"({c('1')}/({c('1')}+{_fn('exp', sd, dl)}(-{x})))"
    if op == "silu":
        return f"({x}/({c('1')}+{_fn('exp', sd, dl)}(-{x})))"
    if op == "gelu":
        return f"({c('0.5')}*{x}*({c('1')}+{_fn('erf', sd, dl)}({x}*{c('0.7071067811865476')})))"
    if op == "gelu_tanh":  # 0.5*x*(1+tanh(z)) == x*sigmoid(2z): no cancellation in 1+tanh for very negative x
        return (f"({x}/({c('1')}+{_fn('exp', sd, dl)}({c('-1.5957691216057308')}*"
                f"({x}+{c('0.044715')}*{x}*{x}*{x}))))")
    if op == "softplus":
        return f"(({x}>0?{x}:{c('0')})+{_fn('log1p', sd, dl)}({_fn('exp', sd, dl)}(-{_fn('fabs', sd, dl)}({x}))))"
    y = a[1] if len(a) > 1 else ""
    binops = {"add": "+", "sub": "-", "mul": "*", "truediv": "/", "lt": "<", "le": "<=", "gt": ">", "ge": ">=",
              "eq": "==", "ne": "!="}
    if op in binops:
        return f"({x}{binops[op]}{y})"
    if op in ("and", "or", "xor"):
        if sd.is_bool:
            return {"and": f"({x}&&{y})", "or": f"({x}||{y})", "xor": f"({x}!={y})"}[op]
        return f"({x}{ {'and': '&', 'or': '|', 'xor': '^'}[op] }{y})"
    if op in ("max", "min") and not fl:
        return _combine(op, sd, dl).format(a=y, b=x)
    if op == "max":
        return f"(({x}>{y}||{x}!={x})?{x}:{y})"
    if op == "min":
        return f"(({x}<{y}||{x}!={x})?{x}:{y})"
    # C's truncated remainder (GLSL's % is undefined for negative operands: glslang emits OpSMod, floored on NVIDIA's
    # driver and truncated on lavapipe's; its / truncates, as SPIR-V's OpSDiv does)
    rem = f"({x}-({x}/{y})*{y})" if dl.glsl else f"({x}%{y})"
    if op == "floordiv":
        if fl:
            return f"{_fn('floor', sd, dl)}({x}/{y})"
        return f"({y}==0?{c('0')}:{c(f'{x}/{y}-' + c(f'({rem}!=0)&&(({x}<0)!=({y}<0))'))})"
    if op == "mod":
        if fl:
            r = f"{_fn('fmod', sd, dl)}({x},{y})"  # a zero remainder takes the divisor's sign (numpy, Python)
            return f"(({r}!=0)?((({r}<0)!=({y}<0))?{r}+{y}:{r}):{_fn('copysign', sd, dl)}({c('0')},{y}))"
        r = rem
        return f"({y}==0?{c('0')}:(({r}!=0&&(({r}<0)!=({y}<0)))?{c(f'{r}+{y}')}:{r}))"
    if op == "pow":
        return f"{_fn('pow', sd, dl)}({x},{y})" if fl else c(f"ipow({x},{y})")
    raise AssertionError(f"no rendering for op {op}")


_COMBINE = {"sum": "{a}+{b}", "prod": "{a}*{b}", "max": "(({b}>{a}||{b}!={b})?{b}:{a})",
            "min": "(({b}<{a}||{b}!={b})?{b}:{a})"}
_COMBINE_INT = {"max": "({b}>{a}?{b}:{a})", "min": "({b}<{a}?{b}:{a})"}
_OMP_RED = {"sum": "+", "prod": "*", "max": "max", "min": "min"}


def _combine(op: str, d: DType, dl: Dialect) -> str:
    """How a reduce of `op` over dtype `d` folds a new value {b} into its accumulator {a}."""
    if d.is_float or op not in _COMBINE_INT:
        return _COMBINE[op]
    return f"azyx_{op}({{a}},{{b}})" if dl.int_minmax and not d.is_bool else _COMBINE_INT[op]


def omp_reduction(op: str, d: DType) -> str:
    """The OpenMP reduction identifier: floats' max/min use NaN-propagating declared reductions (see prelude)."""
    if op in ("max", "min") and d.is_float:
        return f"n{op}{'d' if d is dtypes.float64 else 'f'}"
    return _OMP_RED[op]


class _Renderer:
    def __init__(self, k: Kernel, name: str, dl: Dialect, threads: int):
        self.k, self.name, self.dl, self.threads = k, name, dl, threads
        self.scalars = scalar_args(k)  # by-value parameters after the buffers, bound on every run
        self.names: dict[int, str] = {id(v): f"sc{i}" for i, v in enumerate(self.scalars)}
        self.lines: list[str] = []
        self.globals: list[str] = []  # declarations a GLSL shader has outside main (shared memory)
        self.vec_params: set[int] = set()  # GLSL: parameters also read or written as vectors (vec_load, vec_store)
        self.vw = vector_width(k, dl)  # elements per vector access where the kernel has them
        self.depth = 1
        self.count = 0
        self.uset = set(k.uvars)
        # the innermost register-tile loop is the one to vectorise (gcc may otherwise pick an outer one)
        self.simd = "#pragma omp simd"
        self.group = group_size(k, dl)
        self.it = dl.narrow_index if dl.narrow_index and index_fits(k, self.group) else dl.index_type

    def cond(self, c: Cond) -> str:
        if not self.dl.glsl:
            return c.render()
        below = "uint({x})<{n}u" if self.it == "int" else "uint64_t({x})<{n}ul"
        return c.render(below, *self.dl.bools)

    def cast(self, t: str, x: str) -> str:
        return self.dl.cast.format(t=t, x=x)

    def emit(self, line: str) -> None:
        self.lines.append("  " * self.depth + line)

    def open(self, line: str) -> None:
        self.emit(line + " {")
        self.depth += 1

    def close(self) -> None:
        self.depth -= 1
        self.emit("}")

    def loop(self, v: Var, pragma: str = "", opaque: bool = False, shared: bool = False, step: int = 1) -> None:
        """A loop over `v`; `shared`: only over the caller's range of it, [lo, hi) (see parallel_loop); `step` > 1:
        over `v`_u, every `step`-th value (an unrolled loop: its body sets `v` for each of the steps)."""
        if pragma and self.dl.pragmas:
            self.emit(pragma)
        it = self.it
        bound = str(v.vmax + 1)
        if opaque and self.dl.opaque:
            bound = f"{v.name}_n"
            self.emit(f"{it} {bound} = {v.vmax + 1}; {self.dl.opaque.format(x=bound)}")
        if shared:
            self.open(f"for ({it} {v.name} = lo; {v.name} < hi; {v.name}++)")
            return
        if step > 1:
            self.open(f"for ({it} {v.name}_u = 0; {v.name}_u < {bound}; {v.name}_u += {step})")
            return
        self.open(f"for ({it} {v.name} = 0; {v.name} < {bound}; {v.name}++)")

    def ref(self, v: V) -> str:
        if v.op == "const":
            return _literal(v.arg, v.dtype, self.dl)
        return self.names[id(v)]

    def expr(self, v: V) -> str:
        dl = self.dl
        if v.op == "load":
            param, idx, cond = v.arg
            # A masked load (under a pad) reads a clamped, always valid index; the pad's select above it picks
            # the fill value. No conditional memory access: gcc 12 -O3 -march=native vectorises `c ? p[i] : 0`
            # wrongly when `c` depends on an outer loop.
            i = idx.render() if cond.always else f"({self.cond(cond)})?{idx.render()}:0"
            return dl.loads.get(v.dtype.name, "{buf}[{idx}]").format(buf=f"d{param}", idx=i)
        if v.op == "cond":
            return f"({self.cond(v.arg)})"
        if v.op == "cast":
            s, t = v.src[0], dl.compute_type(v.dtype)
            if v.dtype.is_bool:
                return f"({self.ref(s)}!=0)"
            if v.dtype.name in dl.rounds:  # computed in float, but rounded like the storage type
                return dl.rounds[v.dtype.name].format(x=self.ref(s))
            if s.dtype.is_float and v.dtype.is_int and v.dtype.itemsize < 8:
                # float -> narrow int through int64, then wrap: C leaves an out-of-range conversion undefined (x86
                # wraps, a GPU saturates: -2.5 -> uint8 is 254 on one, 0 on the other); numpy and PyTorch wrap
                return dl.cast.format(t=t, x=dl.cast.format(t=dl.compute_type(dtypes.int64), x=self.ref(s)))
            return dl.cast.format(t=t, x=self.ref(s))
        if v.op == "where":
            c, a, b = (self.ref(s) for s in v.src)
            return f"({c}?{a}:{b})"
        if v.op == "alu":
            e = alu_expr(v.arg, v.dtype, [self.ref(s) for s in v.src], dl, v.src[0].dtype)
            # a float16/bfloat16 result is computed in float32 but rounded like its dtype at every op, as PyTorch and
            # numpy do: else a fused value and the same value read back from a buffer differ (h == h.max() false)
            rnd = dl.rounds.get(v.dtype.name)
            return rnd.format(x=e) if rnd else e
        raise AssertionError(v.op)

    def stmt(self, v: V) -> None:
        if v.op in ("const", "reduce") or id(v) in self.names:
            return
        if v.op == "index":  # an address read from memory: wrapped from the end, then clamped into its buffer
            x, top, it = self.ref(v.src[0]), v.arg.vmax, self.it
            if v.src[0].dtype.kind == "u":
                e = f"({x}>{top}?{top}:{x})"
            else:
                e = f"({x}<0?{x}+{top + 1}:{x})"
                e = f"({e}<0?0:({e}>{top}?{top}:{e}))"
            self.emit(f"{it} {v.arg.name} = {self.cast(it, e)};")
            self.names[id(v)] = v.arg.name
            if self.k.check >= 0:
                self.check_index(v)
            return
        name = f"v{self.count}"
        self.count += 1
        self.emit(f"{self.dl.compute_type(v.dtype)} {name} = {self.expr(v)};")
        self.names[id(v)] = name

    def check_index(self, v: V) -> None:
        """An index out of range (outside [-size, size)) writes the check words (ir.Kernel.check): site + 1, the
        value's low and high 32 bits, the size. Plain stores: where several are out of range, one of them is kept."""
        x, n, src, dl = self.ref(v.src[0]), v.arg.vmax + 1, v.src[0].dtype, self.dl
        i32 = dl.compute_type(dtypes.int32)
        bad = f"{x}>{n - 1}" if src.kind == "u" else f"{x}<-{n}||{x}>{n - 1}"
        lo = dl.cast.format(t=i32, x=x)
        hi = dl.cast.format(t=i32, x=f"({x}>>32)") if src.itemsize == 8 else "0" if src.kind == "u" else \
            f"({x}<0?-1:0)"
        c = f"d{self.k.check}"
        self.emit(f"if ({bad}) {{ {c}[1] = {lo}; {c}[2] = {hi}; {c}[3] = {n}; {c}[0] = {int(v.arg.name[2:]) + 1}; }}")

    def block(self, nodes: list[V], inner: Callable[[], list[str]]) -> None:
        """Emit `nodes` (topological order) nested in upcast loops by how many upcast vars each needs, then the
        statements `inner` makes, innermost."""
        uvars = self.k.uvars
        depth = {id(v): max((uvars.index(u) + 1 for u in v.vars if u in self.uset), default=0) for v in nodes}
        saved = dict(self.names)
        for d in range(len(uvars) + 1):
            if d > 0:
                self.loop(uvars[d - 1], self.simd if d == len(uvars) else "")
            for v in nodes:
                if depth[id(v)] == d:
                    self.stmt(v)
        for line in inner():
            self.emit(line)
        for _ in uvars:
            self.close()
        self.names = saved  # names declared inside the block's braces go out of scope

    def render(self) -> str:
        k, dl = self.k, self.dl
        order = toposort(*k.values)
        gindex = {v: i for i, v in enumerate(k.gvars)}
        n = len(k.gvars)
        reduces = [v for v in order if v.op == "reduce"]
        owner: dict[Var, V] = {rv: r for r in reduces for rv in r.arg[1]}
        place: dict[int, object] = {}  # id -> level (int) | reduce V (its body) | "U" (per block)
        dep_red: dict[int, bool] = {}
        for v in order:
            dr = v.op == "reduce" or any(dep_red[id(s)] for s in v.src)
            dep_red[id(v)] = dr
            own = next((owner[x] for x in v.vars if x in owner), None)
            if v.op == "reduce":
                place[id(v)] = n
            elif own is not None:
                place[id(v)] = own
            elif v.vars & self.uset:
                place[id(v)] = "U"
            else:
                place[id(v)] = n if dr else max((gindex[x] + 1 for x in v.vars if x in gindex), default=0)

        shared = parallel_loop(k, dl, self.threads)
        guarded = any(v.op == "cond" or (v.op == "load" and not v.arg[2].always) for v in order)
        header = self.signature(shared, guarded)
        if k.scatter is not None:
            return self.scatter_body(order, shared, header)

        par = self._parallel_plan(reduces, place, order)
        # the innermost loop of a plain elementwise kernel vectorises along itself: left to choose, gcc vectorises the
        # loop around it instead where the inner one reads with a stride (a transposing copy: 15x slower); not where
        # loads are guarded (see C.guarded_prefix)
        simd = "#pragma omp simd" if not k.uvars and not reduces and not guarded else ""
        it = self.it
        if self.group and self.group == dl.warp:  # a warp per output point, the group's size / warp points a group
            per = dl.group_size // dl.warp
            self.emit(f"{it} gid = {self.cast(it, dl.group_ids[0])} * {per} + ({self.cast(it, dl.group_ids[1])} / "
                      f"{dl.warp}), lid = {self.cast(it, dl.group_ids[1])} % {dl.warp};")
            self.emit(f"if (gid >= {k.global_size}) return;  /* whole warps return: their shuffles stay uniform */")
        elif self.group:  # one work group per point of the global loops; no early return (all reach the barriers)
            self.emit(f"{it} gid = {self.cast(it, dl.group_ids[0])}, lid = {self.cast(it, dl.group_ids[1])};")
            if dl.max_groups:  # a folded grid's groups past the last point (whole groups: before any barrier)
                self.emit(f"if (gid >= {k.global_size}) return;")
        elif vectorized(k, dl):  # `vw` points per work item, vector loads and stores
            self.vector_body(order)
            return f"{self.glsl_interface()}{header} {{\n" + "\n".join(self.lines) + "\n}\n"
        elif dl.global_ids and n:  # one work item per point of the global loops
            self.emit(f"{it} gid = {self.cast(it, dl.global_ids)};")
            self.emit(f"if (gid >= {k.global_size}) return;")
        for lvl in range(n + 1):
            items = [v for v in order if place[id(v)] == lvl]
            if lvl < n:
                for v in items:
                    self.stmt(v)
                if dl.global_ids:
                    g = k.gvars[lvl]
                    stride = 1
                    for later in k.gvars[lvl + 1 :]:
                        stride *= later.vmax + 1
                    idx = "gid" if stride == 1 else f"(gid/{stride})"
                    self.emit(f"{it} {g.name} = {idx if lvl == 0 else f'{idx}%{g.vmax + 1}'};")
                else:
                    self.loop(k.gvars[lvl], par.get(lvl, "") or (simd if lvl == n - 1 else ""), shared=lvl == shared)
                continue
            for v in items:
                if v.op == "reduce":
                    self.reduce_block(v, order, place, par.get("reduce", ""))
                else:
                    self.stmt(v)
        # epilogue: everything that depends on upcast vars, then the stores
        epi = self.collect(k.values, place, None)
        only = "if (lid == 0) " if self.group else ""  # the group's result is in every item: one stores it
        self.block(epi, lambda: [only + self.dl.stores.get(k.params[i].name, "{buf}[{idx}] = {val};").format(
            buf=f"d{i}", idx=idx.render(), val=self.store_value(v)) for i, (idx, v) in enumerate(k.stores)])
        if not dl.global_ids:
            for _ in k.gvars:
                self.close()
        body = "\n".join(self.lines)
        return f"{self.glsl_interface()}{header} {{\n{body}\n}}\n"

    def signature(self, shared: int | None, guarded: bool) -> str:
        """The kernel's header (GLSL: main, after which the parameters' addresses and the scalars are read)."""
        k, dl = self.k, self.dl
        if dl.glsl:
            self.emit_scalar_words()
            return "void main()"
        params = [] if shared is None else [f"{dl.index_type} lo", f"{dl.index_type} hi"]
        for i, d in enumerate(k.params):
            const = "" if k.writes(i) else "const "
            params.append(f"{dl.buffer_qual}{const}{dl.ctype(d)}* {dl.restrict} d{i}")
        params += [f"{dl.compute_type(v.dtype)} sc{i}" for i, v in enumerate(self.scalars)]
        return f"{dl.guarded_prefix if guarded else ''}{dl.kernel_prefix} {self.name}({', '.join(params)})"

    def scatter_body(self, order: list[V], shared: int | None, header: str) -> str:
        """A scatter-add (Kernel.scatter): each point of the global loops (outer: the axes before the scattered one,
        inner: those after it) owns the output's elements along the scattered axis at its coordinates, so it zeroes
        them, then adds its values in order at the rows its index reads (repeated rows accumulate): no two points
        write one element, no atomics. Host loops keep the inner axes innermost (contiguous, vectorised), inside
        the rows: a thread that shares out a loop owns its part of it for every row."""
        k, dl, it = self.k, self.dl, self.it
        j, r, zero_idx = k.scatter  # type: ignore[misc]
        outer, inner = k.gvars
        (idx, value), = k.stores
        store = dl.stores.get(k.params[0].name, "{buf}[{idx}] = {val};")
        if dl.global_ids:
            self.emit(f"{it} gid = {self.cast(it, dl.global_ids)};")
            self.emit(f"if (gid >= {k.global_size}) return;")
            self.emit(f"{it} {outer.name} = gid/{inner.vmax + 1}, {inner.name} = gid%{inner.vmax + 1};")
        else:
            self.loop(outer, shared=shared == 0)
        self.loop(r)
        if not dl.global_ids:
            self.loop(inner, "#pragma omp simd" if shared != 1 else "", shared=shared == 1)
        self.emit(store.format(buf="d0", idx=zero_idx.render(), val=_literal(0, k.params[0], dl)))
        self.close()
        if not dl.global_ids:
            self.close()
        self.loop(j)
        for v in order:  # what one row of the index needs, then (host) the inner loop for the rest
            if dl.global_ids or inner not in v.vars:
                self.stmt(v)
        if not dl.global_ids:
            self.loop(inner, "#pragma omp simd" if shared != 1 else "", shared=shared == 1)
            for v in order:
                if inner in v.vars:
                    self.stmt(v)
        old = dl.loads.get(k.params[0].name, "{buf}[{idx}]").format(buf="d0", idx=idx.render())
        self.emit(store.format(buf="d0", idx=idx.render(), val=f"({old}+{self.ref(value)})"))
        self.close()
        if not dl.global_ids:
            self.close()
            self.close()
        return f"{self.glsl_interface()}{header} {{\n" + "\n".join(self.lines) + "\n}\n"

    def glsl_interface(self) -> str:
        """A GLSL shader's part before main: its name (a comment, so the source names its kernel), the prelude, the
        work group size, a buffer reference type per parameter (outputs first, inputs read-only: buffers are device
        addresses, so neither a binding count nor a binding's range limits a kernel), the words buffer (binding 0:
        the parameters' addresses, then the scalars; each a 64-bit word of two uints), and shared memory."""
        if not self.dl.glsl:
            return ""
        k, dl = self.k, self.dl
        out = [dl.prelude, f"// {self.name}", f"layout(local_size_x = {work_group(k, dl)}) in;",
               "layout(std430, set = 0, binding = 0) restrict readonly buffer W { uint sw[]; };"]
        for i, d in enumerate(k.params):
            access = "restrict" if k.writes(i) else "restrict readonly"
            out.append(f"layout(buffer_reference, std430, buffer_reference_align = {d.itemsize}) {access} buffer "
                       f"B{i} {{ {dl.ctype(d)} v[]; }};")
            out.append(f"#define d{i} p{i}.v")
            if i in self.vec_params:  # the same address read a vector at a time (vector_body)
                out.append(f"layout(buffer_reference, std430, buffer_reference_align = {4 * self.vw}) {access} buffer "
                           f"Q{i} {{ {dl.vector.format(n=self.vw)} v[]; }};")
        out += self.globals
        return "\n".join(out) + "\n"

    def emit_scalar_words(self) -> None:
        """GLSL: each parameter's address, then each scalar argument, from two 32-bit words of the words buffer
        (SCALAR_CODES: a scalar's bytes, zero padded)."""
        n = len(self.k.params)
        for i in range(n):
            self.emit(f"B{i} p{i} = B{i}({self.address(i)});")
        for j, v in enumerate(self.scalars):
            t, lo, hi = self.dl.compute_type(v.dtype), f"sw[{2 * (n + j)}]", f"sw[{2 * (n + j) + 1}]"
            if v.dtype.is_float:
                x = f"packDouble2x32(uvec2({lo}, {hi}))" if v.dtype.itemsize == 8 else f"uintBitsToFloat({lo})"
            elif v.dtype.itemsize == 8:
                x = f"{t}(packUint2x32(uvec2({lo}, {hi})))"
            else:
                x = f"{t}({lo})" if v.dtype.kind != "i" or v.dtype.itemsize == 4 else f"{t}(int({lo}))"
            self.emit(f"{t} sc{j} = {x};")

    @staticmethod
    def address(i: int) -> str:
        return f"packUint2x32(uvec2(sw[{2 * i}], sw[{2 * i + 1}]))"

    def vec_ptr(self, p: int, idx: str, element: bool) -> str:
        """Where parameter `p`'s vector at `idx` lies (in vectors; in elements, a multiple of the width, where
        `element`), as an element address."""
        return f"d{p} + ({idx})" if element else f"d{p} + ({idx}) * {self.vw}"

    def vec_load(self, p: int, idx: str, element: bool = False) -> str:
        """Parameter `p` read as a vector of `vw` floats at `idx` (see vec_ptr). GLSL reads the same address through a
        buffer reference of vectors."""
        dl, vec = self.dl, self.dl.vector.format(n=self.vw)
        if dl.glsl:
            self.vec_params.add(p)
            return f"Q{p}({self.address(p)}).v[{f'({idx}) >> {self.vw.bit_length() - 1}' if element else idx}]"
        if dl.vector_load:
            return dl.vector_load.format(n=self.vw, ptr=self.vec_ptr(p, idx, element))
        const = "const " if p >= len(self.k.stores) else ""
        return f"*({dl.buffer_qual}{const}{vec}*)(d{p} + {idx})" if element else \
            f"(({dl.buffer_qual}{const}{vec}*)d{p})[{idx}]"

    def vec_store(self, p: int, idx: str, val: str) -> str:
        """A statement storing vector `val` at vector `idx` of output `p`."""
        dl = self.dl
        if dl.glsl:
            self.vec_params.add(p)
            return f"Q{p}({self.address(p)}).v[{idx}] = {val};"
        if dl.vector_store:
            return dl.vector_store.format(n=self.vw, ptr=self.vec_ptr(p, idx, False), val=val)
        return f"(({dl.buffer_qual}{dl.vector.format(n=self.vw)}*)d{p})[{idx}] = {val};"

    def vector_body(self, order: list[V]) -> None:
        """A plain elementwise float32 kernel over one loop (see `vectorized`), `vw` points per work item: each
        operand read along the loop is one vector load, each output one vector store, and the body is computed
        for each of the lanes (other loads, broadcast ones, stay per lane)."""
        k, dl, it, w = self.k, self.dl, self.it, self.vw
        vec = dl.vector.format(n=w)
        g = k.gvars[0]
        self.emit(f"{it} gid = {self.cast(it, dl.global_ids)};")
        self.emit(f"if (gid >= {k.global_size // w}) return;")
        along = along_loop(k, order)
        for p in sorted(along):
            self.emit(f"{vec} l{p} = {self.vec_load(p, 'gid')};")
        for i in range(len(k.stores)):
            self.emit(f"{vec} s{i};")
        for lane, c in enumerate("xyzw"[:w]):
            self.open("")
            self.emit(f"{it} {g.name} = gid * {w} + {lane};")
            saved = dict(self.names)
            for v in order:
                if v.op == "load" and v.arg[0] in along:
                    self.names[id(v)] = f"l{v.arg[0]}.{c}"
            for v in order:
                self.stmt(v)
            for i, (_, v) in enumerate(k.stores):
                self.emit(f"s{i}.{c} = {self.store_value(v)};")
            self.names = saved
            self.close()
        for i in range(len(k.stores)):
            self.emit(self.vec_store(i, "gid", f"s{i}"))

    def store_value(self, v: V) -> str:
        return self.ref(v) if (v.op == "const" or id(v) in self.names) else self.expr(v)

    def collect(self, roots: list[V], place: dict[int, object], body_of: V | None) -> list[V]:
        """Nodes of one block: those placed in it, plus per-block ("U") nodes it needs, in topological order."""
        out: list[V] = []
        seen: set[int] = set()
        for r in roots:
            self._collect(r, place, body_of, seen, out)
        return [v for v in out if v.op != "reduce"]

    def _collect(self, v: V, place: dict[int, object], body_of: V | None, seen: set[int], out: list[V]) -> None:
        # a method, not a recursive closure: that would be a reference cycle left to the cyclic GC per kernel
        if id(v) in seen:
            return
        seen.add(id(v))
        p = place.get(id(v))
        if v.op == "reduce" and v is not body_of:
            return
        if not (p == "U" or (body_of is not None and p is body_of) or (body_of is None and p is None)):
            return
        for s in v.src:
            self._collect(s, place, body_of, seen, out)
        out.append(v)

    def grouped_reduce(self, r: V, place: dict[int, object], acc_t: str, init: str, name: str) -> None:
        """The work group's items accumulate strided shares of the reduce (neighbours read neighbouring elements),
        then combine them in a tree in shared memory; every item ends with the result."""
        op, rvars = r.arg
        dl, it, size = self.dl, self.it, self.group
        comb = _combine(op, r.dtype, dl)
        total = 1
        for rv in rvars:
            total *= rv.vmax + 1
        self.emit(f"{acc_t} {name} = {init};")
        if dl.unroll:
            self.emit(dl.unroll)
        body = self.collect([r.src[0]], place, r)
        vector = reduce_vector_operands(self.k, r, self.vw, body) if self.vw else None
        trip = total // self.vw if vector is not None else total  # steps of the reduce, `size` items at a time
        copies = dl.copies if trip >= dl.copies * size else 1
        if self.k.unroll > 1:  # an optimisation action chose the steps per iteration (azyx.optimize.UNROLL)
            copies = self.k.unroll
        if dl.max_trips:  # enough steps per iteration to stay within the driver's bound
            copies = max(copies, -(-trip // (size * dl.max_trips)))
        if copies > 1:  # `copies` steps per iteration, so that their loads are in flight together
            self.emit(f"{it} rl0 = lid;")
            self.open(f"for (; rl0 + {(copies - 1) * size} < {trip}; rl0 += {copies * size})")
            for u in range(copies):
                self.open("")
                self.emit(f"{it} rl = rl0 + {u * size};")
                self.reduce_step(r, body, vector, name, comb)
                self.close()
            self.close()
            self.open(f"for (; rl0 < {trip}; rl0 += {size})")
            self.emit(f"{it} rl = rl0;")
        else:
            self.open(f"for ({it} rl = lid; rl < {trip}; rl += {size})")
        self.reduce_step(r, body, vector, name, comb)
        self.close()
        self.combine_group(r, name, comb, acc_t)

    def reduce_step(self, r: V, body: list[V], vector: set[int] | None, name: str, comb: str) -> None:
        """One step `rl` of a work item's share of a grouped reduce: an element (`vw`, in vectors), into `name`."""
        dl, it, rvars = self.dl, self.it, r.arg[1]
        along = vector or set()
        saved_step = dict(self.names)
        if vector is not None:  # `vw` elements per step, each operand read along the reduce in one vector load
            (rv,) = rvars
            w = self.vw
            self.emit(f"{it} {rv.name} = rl * {w};")
            loads = {p: v for v in body if v.op == "load" and (p := v.arg[0]) in along}
            for p, v in sorted(loads.items()):
                self.emit(f"{dl.vector.format(n=w)} l{p} = {self.vec_load(p, v.arg[1].render(), element=True)};")
            lanes: list[tuple[str, int]] = [(c, i) for i, c in enumerate("xyzw"[:w])]
        else:
            inner = 1
            for rv in reversed(rvars):  # the flat index back into the reduce's own variables
                n = rv.vmax + 1
                idx = "rl" if inner == 1 else f"(rl/{inner})"
                self.emit(f"{it} {rv.name} = {idx if rv is rvars[0] else f'{idx}%{n}'};")
                inner *= n
            lanes = [("", 0)]
        for c, lane in lanes:
            saved = dict(self.names)
            if c:  # one lane of the vectors: its own copy of the reduce variable and of the values computed from it
                self.open("")
                self.emit(f"{it} {rvars[0].name} = rl * {self.vw} + {lane};")
                for v in body:
                    if v.op == "load" and v.arg[0] in along:
                        self.names[id(v)] = f"l{v.arg[0]}.{c}"
            for v in body:
                self.stmt(v)
            body_v = r.src[0]
            val = self.ref(body_v) if (body_v.op == "const" or id(body_v) in self.names) else self.expr(body_v)
            val = self.cast("int", val) if r.dtype.is_bool else val
            self.emit(f"{name} = {comb.format(a=name, b=val)};")
            if c:
                self.close()
            self.names = saved
        self.names = saved_step

    def combine_group(self, r: V, name: str, comb: str, acc_t: str) -> None:
        """The group's items' shares of a reduce, in `name`, combined: every item ends with the result."""
        dl, size = self.dl, self.group
        sh = f"{name}_s"
        if size == dl.warp:  # a warp per output: the butterfly leaves the result in every lane
            self._warp_tree(name, comb, acc_t)
            self.names[id(r)] = f"({name}!=0)" if r.dtype.is_bool else name
            return
        if dl.shuffle:  # within each warp by shuffles, then the warps' results in one warp
            warps = size // dl.warp
            self.declare_shared(f"{dl.shared} {acc_t} {sh}[{warps}];")
            self._warp_tree(name, comb, acc_t)
            self.emit(f"if (lid % {dl.warp} == 0) {sh}[lid / {dl.warp}] = {name};")
            self.emit(dl.barrier)
            self.emit(f"{name} = {sh}[lid % {warps}];")
            self._warp_tree(name, comb, acc_t, warps)
            self.emit(dl.barrier)  # every item has read before a later reduce of this kernel writes shared memory
        else:  # a tree in shared memory
            self.declare_shared(f"{dl.shared} {acc_t} {sh}[{size}];")
            self.emit(f"{sh}[lid] = {name};")
            self.emit(dl.barrier)
            self.open(f"for (int s = {size // 2}; s > 0; s >>= 1)")
            self.emit(f"if (lid < s) {sh}[lid] = {comb.format(a=f'{sh}[lid]', b=f'{sh}[lid+s]')};")
            self.emit(dl.barrier)
            self.close()
            self.emit(f"{name} = {sh}[0];")
        self.names[id(r)] = f"({name}!=0)" if r.dtype.is_bool else name

    def declare_shared(self, line: str) -> None:
        """Shared memory: declared where it is used, but at global scope in GLSL."""
        if self.dl.glsl:
            self.globals.append(line)
        else:
            self.emit(line)

    def _warp_tree(self, name: str, comb: str, acc_t: str, lanes: int = 0) -> None:
        """Combine `lanes` values of a warp (each lane holding one, repeating every `lanes` lanes) into every lane:
        a butterfly, each lane shuffling exactly once per step (no divergence)."""
        self.emit("#pragma unroll")
        self.open(f"for (int o = {(lanes or self.dl.warp) // 2}; o > 0; o >>= 1)")
        self.emit(f"{acc_t} other = {self.dl.shuffle.format(x=name, o='o')};")
        self.emit(f"{name} = {comb.format(a=name, b='other')};")
        self.close()

    def reduce_block(self, r: V, order: list[V], place: dict[int, object], pragma: str) -> None:
        op, rvars = r.arg
        acc_t = self.dl.compute_type(r.dtype) if not r.dtype.is_bool else "int"
        init = _literal(REDUCE[op][0](r.dtype), r.dtype if not r.dtype.is_bool else dtypes.int32, self.dl)
        name = f"acc{self.count}"
        self.count += 1
        if self.group:
            self.grouped_reduce(r, place, acc_t, init, name)
            return
        dims = "".join(f"[{u.vmax + 1}]" for u in self.k.uvars)
        if dims:
            self.emit(f"{acc_t} {name}{dims};")
            self.block([], lambda: [f"{name}{''.join(f'[{u.name}]' for u in self.k.uvars)} = {init};"])
        else:
            self.emit(f"{acc_t} {name} = {init};")
        use_red = not dims and self.dl.pragmas
        last = rvars[-1]
        # the innermost loop unrolled `unroll` times (an optimisation action, Kernel.unroll; a divisor of its length):
        # each step in braces of its own, in the loop's order, so the accumulation order is the plain loop's
        unroll = self.k.unroll if self.k.unroll > 1 and (last.vmax + 1) % self.k.unroll == 0 else 1
        for i, rv in enumerate(rvars):
            p = ""
            if i == 0 and pragma:
                p = pragma.replace("ACC", name)
            elif i == len(rvars) - 1 and use_red:
                p = f"#pragma omp simd reduction({omp_reduction(op, r.dtype)}:{name})"
            self.loop(rv, p, opaque=bool(dims), step=unroll if rv is last else 1)
        body = self.collect([r.src[0]], place, r)
        body_v = r.src[0]
        ref = f"{name}{''.join(f'[{u.name}]' for u in self.k.uvars)}"
        comb = _combine(op, r.dtype, self.dl)

        def step() -> list[str]:  # (the body value is referenced after emission inside the block)
            val = self.store_value(body_v)
            return [f"{ref} = {comb.format(a=ref, b=self.cast('int', val) if r.dtype.is_bool else val)};"]

        for j in range(unroll):
            if unroll > 1:
                self.open("")
                self.emit(f"{self.it} {last.name} = {last.name}_u + {j};")
            self.block(body, step)
            if unroll > 1:
                self.close()
        for _ in rvars:
            self.close()
        self.names[id(r)] = f"({ref}!=0)" if r.dtype.is_bool else ref

    def _parallel_plan(self, reduces: list[V], place: dict[int, object], order: list[V]) -> dict[object, str]:
        if parallel_kind(self.k, self.dl, self.threads) == OWN_REGION:
            op = reduces[0].arg[0]
            return {"reduce": f"#pragma omp parallel for simd reduction({omp_reduction(op, reduces[0].dtype)}:ACC)"}
        return {}


def group_size(k: Kernel, dl: Dialect) -> int:
    """The work-group size that reduces each output point of `k` on `dl`, or 0 for one work item per point.
    Grouped: every reduce is flat (no reduce in its body), at least a group long, and either its loads run
    contiguously along it, or they do not along the outputs (then neither layout coalesces, and a group at least
    spreads the work), or the outputs are too few to occupy the device."""
    size = dl.group_size
    if not size or k.uvars:
        return 0
    if dl.warp and k.global_size >= dl.warp_outputs:
        size = dl.warp  # outputs enough to fill the device with a warp each (no shared memory, no barrier)
    reduces = [v for v in toposort(*k.values) if v.op == "reduce"]
    if not reduces or any(r.src[0].has_reduce for r in reduces):
        return 0
    if k.group >= 0:  # an optimisation action chose it (azyx.optimize); a size the dialect cannot tree-reduce: none
        return k.group if group_fits(k.group, dl) else 0
    longest = max(reduces, key=lambda r: _numel(r.arg[1]))
    if _numel(longest.arg[1]) < size:
        return 0
    loads = [v.arg[1] for v in toposort(longest.src[0]) if v.op == "load"]
    along_r = any(x.terms.get(longest.arg[1][-1]) == 1 for x in loads)
    along_g = bool(k.gvars) and any(x.terms.get(k.gvars[-1]) == 1 for x in loads)
    return size if along_r or not along_g or k.global_size < size else 0


def group_fits(size: int, dl: Dialect) -> bool:
    """Whether `dl` can reduce with work groups of `size` items: a power of two up to the dialect's group size, and
    whole warps where the dialect combines by warp shuffles."""
    if size == 0:
        return True
    if size < 2 or size & (size - 1) or size > max(dl.group_size, 256):
        return False
    return not dl.warp or size % dl.warp == 0


def vector_width(k: Kernel, dl: Dialect) -> int:
    """Elements per vector load and store of `k` on `dl`: the kernel's choice (an optimisation action, Kernel.vector),
    else the dialect's default; 0 for none (or a dialect without vector types)."""
    w = dl.vector_width if k.vector < 0 else k.vector
    return w if dl.vector and w in VECTOR_WIDTHS else 0


VECTOR_WIDTHS = (2, 4)


def vectorized(k: Kernel, dl: Dialect) -> int:
    """The vector width (0: none) at which `k` renders as a plain elementwise kernel with `vw` points per work item
    (see elementwise_vector_fits)."""
    w = vector_width(k, dl)
    return w if w and elementwise_vector_fits(k, w) else 0


def elementwise_vector_fits(k: Kernel, w: int) -> bool:
    """Whether `k` can take `w` points per work item with vector loads and stores: a plain elementwise kernel (no
    reduce, no upcast loop) over one global loop whose length is a multiple of `w`, writing float32 outputs exactly
    along that loop (offset 0, stride 1: each vector is aligned to its size)."""
    if len(k.gvars) != 1 or k.uvars or k.global_size % w or k.scatter is not None:
        return False
    if any(v.op == "reduce" for v in toposort(*k.values)):
        return False
    return all(k.params[i] is dtypes.float32 and _is_var(idx, k.gvars[0]) for i, (idx, _) in enumerate(k.stores))


def reduce_vector_operands(k: Kernel, r: V, w: int, body: list[V]) -> set[int] | None:
    """The float32 parameters that reduce `r`'s body (`body`: its values) reads along its one reduce variable, each at
    an index that is a multiple of `w` once that variable is (so `w` neighbours are one aligned vector load); None
    where the reduce cannot step `w` elements at a time (several reduce variables, a length not divisible by `w`, an
    operand read along it otherwise, nothing to read along it)."""
    rvars = r.arg[1]
    if w < 2 or len(rvars) != 1 or (rvars[0].vmax + 1) % w:
        return None
    rv, along = rvars[0], set()
    for v in body:
        if v.op != "load" or rv not in v.arg[1].terms:
            continue
        idx = v.arg[1]
        aligned = idx.const % w == 0 and all(c % w == 0 for a, c in idx.terms.items() if a is not rv)
        if k.params[v.arg[0]] is not dtypes.float32 or idx.terms[rv] != 1 or not aligned or \
                not v.arg[2].always or not all(isinstance(a, Var) for a in idx.terms):
            return None
        along.add(v.arg[0])
    if not along or any(v.op == "load" and v.arg[0] in along and rv not in v.arg[1].terms for v in body):
        return None
    return along


def vector_fits(k: Kernel, w: int) -> bool:
    """Whether vector accesses of `w` elements (1: none) apply to `k`, on a dialect with vector types: a vectorisable
    elementwise kernel, or a flat reduce reading its operands along itself (used where it is grouped)."""
    if w == 1:
        return True
    if w not in VECTOR_WIDTHS:
        return False
    if elementwise_vector_fits(k, w):
        return True
    reduces = [v for v in toposort(*k.values) if v.op == "reduce"]
    return not k.uvars and any(not r.src[0].has_reduce and reduce_vector_operands(k, r, w, toposort(r.src[0]))
                               for r in reduces)


def along_loop(k: Kernel, order: list[V]) -> set[int]:
    """The float32 inputs of a `vectorized` kernel that it reads only along its loop (consecutive elements per work
    item: one vector load)."""
    g = k.gvars[0]
    along = {p for p in range(len(k.stores), len(k.params)) if k.params[p] is dtypes.float32 and all(
        _is_var(v.arg[1], g) and v.arg[2].always for v in order if v.op == "load" and v.arg[0] == p)}
    return along & {v.arg[0] for v in order if v.op == "load"}


def work_group(k: Kernel, dl: Dialect) -> int:
    """Work items per group of a GPU-style kernel, as its launch has them (launch.Launch.group)."""
    group = group_size(k, dl)
    if dl.warp and group == dl.warp:  # a warp per output point, several warps per group
        return dl.group_size
    if group:  # a group per output point (a grouped reduce)
        return group
    n = max(k.global_size, 1) // (vectorized(k, dl) or 1)
    return min(k.local or dl.block, max(n, 1))


def _is_var(x: Lin, g: Var) -> bool:
    """`x` is exactly `g` (offset 0, stride 1): the points of a vector are consecutive elements."""
    return x.const == 0 and x.terms == {g: 1}


def _numel(vs: tuple[Var, ...] | list[Var]) -> int:
    out = 1
    for v in vs:
        out *= v.vmax + 1
    return out


def _magnitude(x: Lin) -> int:
    """A bound on |x| and on every partial sum and product that evaluating it forms."""
    total = abs(x.const)
    for a, c in x.terms.items():
        inner = _magnitude(a.x) if isinstance(a, Div | Mod) else 0
        total += abs(c) * max(abs(a.vmin), abs(a.vmax), inner)
    return total


def index_fits(k: Kernel, group: int = 0) -> bool:
    """Whether every index `k` computes fits a 32-bit int (then GPU dialects use one: 64-bit division is slow)."""
    limit = (1 << 31) - 1
    sizes = [k.global_size * max(group, 1), *(_magnitude(idx) for idx, _ in k.stores)]
    if k.scatter is not None:
        sizes.append(_magnitude(k.scatter[2]))
    for v in toposort(*k.values):
        if v.op == "load":
            sizes.append(_magnitude(v.arg[1]))
            sizes.extend(_magnitude(x) + abs(lo) + abs(hi) for x, lo, hi in v.arg[2].facts)
        elif v.op == "cond":
            sizes.extend(_magnitude(x) + abs(lo) + abs(hi) for x, lo, hi in v.arg.facts)
        elif v.op == "reduce":
            sizes.append(_numel(v.arg[1]) + group)
    return max(sizes) < limit


# How a host kernel runs in parallel. SHARED: one of its global loops (parallel_loop) runs over a range [lo, hi) its
# caller passes, so that several threads share the loop, each calling it with its own part (the C backend's batches
# hand out parts to a pool of threads). OWN_REGION: it opens its own OpenMP region (a reduction of all its elements
# into one). SERIAL: one call does it all (too little work to share, or nothing to share).
SERIAL, SHARED, OWN_REGION = 0, 1, 2
PARALLEL_WORK = 1 << 15  # innermost iterations below which a kernel runs on one thread


def parallel_kind(k: Kernel, dl: Dialect, threads: int) -> int:
    if not dl.pragmas or threads <= 1 or k.work < PARALLEL_WORK:
        return SERIAL
    if k.gvars:
        return SHARED
    if not k.uvars and sum(v.op == "reduce" for v in toposort(*k.values)) == 1:
        return OWN_REGION
    return SERIAL


def parallel_loop(k: Kernel, dl: Dialect, threads: int) -> int | None:
    """Which global loop of a SHARED kernel is shared out: the outermost, or the next one when the outermost is too
    short to give every thread a part (then each part runs all of the outermost)."""
    if parallel_kind(k, dl, threads) != SHARED:
        return None
    sizes = [v.vmax + 1 for v in k.gvars]
    return 1 if len(sizes) > 1 and sizes[0] < 2 * threads and sizes[1] > sizes[0] else 0


def render(k: Kernel, name: str, dl: Dialect, threads: int = 1) -> str:
    return _Renderer(k, name, dl, threads).render()


def kernel_source(kernels: list[str], dl: Dialect) -> str:
    return dl.prelude + "\n" + "\n".join(kernels)


def kernel_name(src: str, prefix: str = "k") -> str:
    """A kernel's name: a hash of its source, so equal kernels share one compiled program."""
    return f"{prefix}_{hashlib.sha256(src.encode()).hexdigest()[:16]}"
