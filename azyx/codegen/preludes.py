"""The helper code every kernel of a dialect starts with (math the language lacks, dtype conversions, integer
power), as text: one constant per dialect, which the dialect rows (azyx.codegen.dialect) and the WGSL renderer take."""

from __future__ import annotations


def ipow(qualifiers: str, t: str) -> str:
    """Integer power in every C-family prelude (b < 0: only 1 and -1 have an integer result)."""
    return f"""{qualifiers} {t} ipow({t} a, {t} b) {{
  if (b < 0) return a == 1 ? 1 : (a == -1 ? ((b & 1) ? -1 : 1) : 0);
  {t} r = 1; while (b) {{ if (b & 1) r *= a; a *= a; b >>= 1; }} return r;
}}
"""



# The C dialect's streaming stores (Dialect.stream): 8 floats a store with AVX, 4 with SSE, else plain stores
C_STREAM = """#if defined(__AVX__)
#include <immintrin.h>
#define AZYX_NT 8
#define AZYX_NT_STORE(p, t) _mm256_stream_ps((p), _mm256_load_ps(t))
#define AZYX_NT_FENCE() _mm_sfence()
#elif defined(__SSE__)
#include <xmmintrin.h>
#define AZYX_NT 4
#define AZYX_NT_STORE(p, t) _mm_stream_ps((p), _mm_load_ps(t))
#define AZYX_NT_FENCE() _mm_sfence()
#else
#define AZYX_NT 1
#define AZYX_NT_STORE(p, t) (*(p) = *(t))
#define AZYX_NT_FENCE() ((void)0)
#endif
"""


C_PRELUDE = """#include <math.h>
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
""" + ipow("static inline", "long long")

CL_PRELUDE = """#pragma OPENCL EXTENSION cl_khr_fp64 : enable
inline float bf2f(ushort x) { return as_float(((uint)x) << 16); }
inline ushort f2bf(float f) {
  uint i = as_uint(f);
  if (f != f) return (ushort)0x7fc0;
  return (ushort)((i + 0x7fffu + ((i >> 16) & 1u)) >> 16);
}
inline float f16r(float x) {
  ushort h; vstore_half(x, 0, (__private half*)&h); return vload_half(0, (__private half*)&h);
}
""" + ipow("inline", "long")

CUDA_PRELUDE = """#define INFINITY __int_as_float(0x7f800000)
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
""" + ipow("__device__ inline", "long long") + "".join(
    f'__device__ inline {t} azyx_{op}({t} a, {t} b) {{ {t} r; asm("{op}.{p} %0, %1, %2;" : "={c}"(r) : "{c}"(a), '
    f'"{c}"(b)); return r; }}\n'
    for op in ("max", "min") for t, p, c in (("int", "s32", "r"), ("unsigned int", "u32", "r"),
                                             ("long long", "s64", "l"), ("unsigned long long", "u64", "l")))


GLSL_PRELUDE = """#version 450
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


# WGSL (azyx.codegen.wgsl): the helpers of every shader, then those of int64 and float64 kernels
WGSL_PRELUDE = """fn isnan32(x: f32) -> bool { return (bitcast<u32>(x) & 0x7fffffffu) > 0x7f800000u; }
fn wrap8(x: i32) -> i32 { return bitcast<i32>(bitcast<u32>(x) << 24u) >> 24u; }
fn wrap16(x: i32) -> i32 { return bitcast<i32>(bitcast<u32>(x) << 16u) >> 16u; }
fn f16r(x: f32) -> f32 {  // x rounded to float16 (to nearest even) in integer arithmetic, which no driver folds away
  let u = bitcast<u32>(x); let s = u & 0x80000000u; let a = u ^ s;  // (NVIDIA's folds pack2x16float and back)
  if (a >= 0x7f800000u || a == 0u) { return x; }
  if (a >= 0x477ff000u) { return bitcast<f32>(s | 0x7f800000u); }
  if (a >= 0x38800000u) { return bitcast<f32>(s | ((a + 0xfffu + ((a >> 13u) & 1u)) & 0xffffe000u)); }
  let sh = 126u - (a >> 23u);  // a float16 subnormal: a multiple of 2^-24
  if (sh > 24u) { return bitcast<f32>(s); }
  let m = (a & 0x7fffffu) | 0x800000u; let r = m & ((1u << sh) - 1u); let h = 1u << (sh - 1u);
  let q = (m >> sh) + select(0u, 1u, r > h || (r == h && ((m >> sh) & 1u) != 0u));
  return bitcast<f32>(s | bitcast<u32>(f32(q) * 5.9604644775390625e-8f));
}
fn f2bf(f: f32) -> u32 {
  let i = bitcast<u32>(f);
  if (isnan32(f)) { return 0x7fc0u; }
  return (i + 0x7fffu + ((i >> 16u) & 1u)) >> 16u;
}
fn bf16r(x: f32) -> f32 { return bitcast<f32>(f2bf(x) << 16u); }
fn azyx_fmod(a: f32, b: f32) -> f32 { return a - b * trunc(a / b); }
fn azyx_log1p(x: f32) -> f32 { let u = 1.0f + x; return select(log(u) * (x / (u - 1.0f)), x, u == 1.0f); }
fn azyx_erf(x: f32) -> f32 {  // Abramowitz and Stegun 7.1.26: |error| < 1.5e-7
  let t = 1.0f / (1.0f + 0.3275911f * abs(x));
  let y = 1.0f - ((((1.061405429f * t - 1.453152027f) * t + 1.421413741f) * t - 0.284496736f) * t + 0.254829592f) * t
    * exp(-x * x);
  return select(y, -y, x < 0.0f);
}
fn azyx_pow(x: f32, y: f32) -> f32 {  // C's pow: WGSL's is undefined for x <= 0
  if (y == 0.0f || x == 1.0f) { return 1.0f; }
  if (x == 0.0f) { return select(0.0f, bitcast<f32>(0x7f800000u), y < 0.0f); }
  var r = exp2(y * log2(abs(x)));
  if (x < 0.0f) { if (y != floor(y)) { return bitcast<f32>(0x7fc00000u); } if (azyx_fmod(y, 2.0f) != 0.0f) { r = -r; } }
  return r;
}
fn ipow(a0: i32, b0: i32) -> i32 {
  var a = a0; var b = b0;
  if (b < 0) { return select(select(0, select(1, -1, (b & 1) != 0), a == -1), 1, a == 1); }
  var r = 1; while (b != 0) { if ((b & 1) != 0) { r *= a; } a *= a; b >>= 1u; } return r;
}
"""

WGSL_PRELUDE_I64 = """fn ipow64(a0: i64, b0: i64) -> i64 {
  var a = a0; var b = b0;
  if (b < 0li) { return select(select(0li, select(1li, -1li, (b & 1li) != 0li), a == -1li), 1li, a == 1li); }
  var r = 1li; while (b != 0li) { if ((b & 1li) != 0li) { r *= a; } a *= a; b >>= 1u; } return r;
}
"""

# float64 math that SPIR-V's GLSL.std.450 lacks for doubles (its exp, log, sin... take 16/32-bit floats), to double
# precision (the GLSL renderer's routines, in WGSL)
WGSL_ISNAN64 = {  # by whether the device has 64-bit ints to look at the bits with
    True: "fn isnan64(x: f64) -> bool { return (bitcast<u64>(x) & 0x7ffffffffffffffflu) > 0x7ff0000000000000lu; }\n",
    False: "fn isnan64(x: f64) -> bool { return !(x == x); }\n"}
WGSL_PRELUDE_F64 = (
"""fn inf64() -> f64 { return f64(bitcast<f32>(0x7f800000u)); }  // (naga folds no bitcast in a const)
fn nan64() -> f64 { return f64(bitcast<f32>(0x7fc00000u)); }
fn azyx_fmod64(a: f64, b: f64) -> f64 { return a - b * trunc(a / b); }
fn azyx_exp64(x: f64) -> f64 {
  if (isnan64(x)) { return x; }
  if (x > 709.8lf) { return inf64(); }
  if (x < -745.2lf) { return 0.0lf; }
  let k = floor(x * 1.44269504088896338700lf + 0.5lf);
  let r = (x - k * 6.93147180369123816490e-01lf) - k * 1.90821492927058770002e-10lf;
  var p = 1.0lf / 6227020800.0lf;
  p = p * r + 1.0lf / 479001600.0lf; p = p * r + 1.0lf / 39916800.0lf; p = p * r + 1.0lf / 3628800.0lf;
  p = p * r + 1.0lf / 362880.0lf; p = p * r + 1.0lf / 40320.0lf; p = p * r + 1.0lf / 5040.0lf;
  p = p * r + 1.0lf / 720.0lf; p = p * r + 1.0lf / 120.0lf; p = p * r + 1.0lf / 24.0lf; p = p * r + 1.0lf / 6.0lf;
  p = p * r + 0.5lf; p = p * r + 1.0lf; p = p * r + 1.0lf;
  let e = i32(k);
  if (e > 1000) { return ldexp(ldexp(p, e - 1000), 1000); }
  if (e < -1000) { return ldexp(ldexp(p, e + 1000), -1000); }
  return ldexp(p, e);
}
fn azyx_log64(x: f64) -> f64 {
  if (isnan64(x) || x < 0.0lf) { return nan64(); }
  if (x == 0.0lf) { return -inf64(); }
  if (x == inf64()) { return x; }
  var m = x; var e = 0;  // m * 2^e == x, m in [0.5, 1) (frexp of f64 crashes lavapipe's compiler)
  while (m >= 18446744073709551616.0lf) { m *= 5.42101086242752217004e-20lf; e += 64; }
  while (m < 5.42101086242752217004e-20lf) { m *= 18446744073709551616.0lf; e -= 64; }
  let k = i32(floor(log2(f32(m))));
  m = ldexp(m, -k); e += k;
  while (m >= 1.0lf) { m *= 0.5lf; e += 1; }
  while (m < 0.5lf) { m *= 2.0lf; e -= 1; }
  if (m < 0.70710678118654752440lf) { m *= 2.0lf; e -= 1; }
  let t = (m - 1.0lf) / (m + 1.0lf); let t2 = t * t; var p = 1.0lf / 25.0lf;
  for (var n = 23; n >= 1; n -= 2) { p = p * t2 + 1.0lf / f64(n); }
  return 2.0lf * t * p + f64(e) * 1.90821492927058770002e-10lf + f64(e) * 6.93147180369123816490e-01lf;
}
fn azyx_exp264(x: f64) -> f64 { return azyx_exp64(x * 6.93147180559945309417e-01lf); }
fn azyx_log264(x: f64) -> f64 { return azyx_log64(x) * 1.44269504088896338700lf; }
fn azyx_sin_r(r: f64) -> f64 {  // |r| <= pi/4
  let r2 = r * r; var p = 1.0lf / 355687428096000.0lf;
  p = p * r2 - 1.0lf / 1307674368000.0lf; p = p * r2 + 1.0lf / 6227020800.0lf; p = p * r2 - 1.0lf / 39916800.0lf;
  p = p * r2 + 1.0lf / 362880.0lf; p = p * r2 - 1.0lf / 5040.0lf; p = p * r2 + 1.0lf / 120.0lf;
  p = p * r2 - 1.0lf / 6.0lf; p = p * r2 + 1.0lf;
  return r * p;
}
fn azyx_cos_r(r: f64) -> f64 {
  let r2 = r * r; var p = 1.0lf / 20922789888000.0lf;
  p = p * r2 - 1.0lf / 87178291200.0lf; p = p * r2 + 1.0lf / 479001600.0lf; p = p * r2 - 1.0lf / 3628800.0lf;
  p = p * r2 + 1.0lf / 40320.0lf; p = p * r2 - 1.0lf / 720.0lf; p = p * r2 + 1.0lf / 24.0lf;
  p = p * r2 - 0.5lf; p = p * r2 + 1.0lf;
  return p;
}
fn azyx_trig(x: f64, shift: i32) -> f64 {  // sin (shift 0) or cos (shift 1) by quadrant
  if (isnan64(x) || abs(x) == inf64()) { return nan64(); }
  let k = floor(x * 6.36619772367581382433e-01lf + 0.5lf);
  let r = ((x - k * 1.57079632673412561417e+00lf) - k * 6.07710050630396597660e-11lf)
    - k * 2.02226624871116645580e-21lf;
  let q = (i32(k) + shift) & 3;
  let v = select(azyx_cos_r(r), azyx_sin_r(r), (q & 1) == 0);
  return select(v, -v, q >= 2);
}
fn azyx_sin64(x: f64) -> f64 { return azyx_trig(x, 0); }
fn azyx_cos64(x: f64) -> f64 { return azyx_trig(x, 1); }
fn azyx_tan64(x: f64) -> f64 { return azyx_trig(x, 0) / azyx_trig(x, 1); }
fn azyx_tanh64(x: f64) -> f64 {
  let a = abs(x); var y: f64;
  if (a < 0.05lf) {
    let a2 = a * a;
    y = a * (1.0lf + a2 * (-1.0lf / 3.0lf + a2 * (2.0lf / 15.0lf + a2 * (-17.0lf / 315.0lf + a2 * (62.0lf / 2835.0lf
      + a2 * (-1382.0lf / 155925.0lf))))));
  } else if (a > 22.0lf) { y = 1.0lf; }
  else { let t = azyx_exp64(-2.0lf * a); y = (1.0lf - t) / (1.0lf + t); }
  if (isnan64(x)) { return x; }
  return select(y, -y, x < 0.0lf);
}
fn azyx_log1p64(x: f64) -> f64 { let u = 1.0lf + x; return select(azyx_log64(u) * (x / (u - 1.0lf)), x, u == 1.0lf); }
fn azyx_erf64(x: f64) -> f64 {
  let a = abs(x); var y: f64;
  if (isnan64(x)) { return x; }
  if (a < 2.0lf) {  // the Taylor series: 2/sqrt(pi) sum (-1)^n x^(2n+1) / (n! (2n+1))
    var term = a; var sum = a; let a2 = a * a;
    for (var n = 1; n < 40; n++) { term *= -a2 / f64(n); sum += term / f64(2 * n + 1); }
    y = sum * 1.12837916709551257390lf;
  } else if (a < 6.0lf) {  // erfc by its continued fraction, evaluated from the tail
    var f = a;
    for (var n = 80; n >= 1; n--) { f = a + (f64(n) * 0.5lf) / f; }
    y = 1.0lf - azyx_exp64(-a * a) / (f * 1.77245385090551602730lf);
  } else { y = 1.0lf; }
  return select(y, -y, x < 0.0lf);
}
fn azyx_pow64(x: f64, y: f64) -> f64 {
  if (y == 0.0lf || x == 1.0lf) { return 1.0lf; }
  if (x == 0.0lf) { return select(0.0lf, inf64(), y < 0.0lf); }
  var r = azyx_exp64(y * azyx_log64(abs(x)));
  if (x < 0.0lf) { if (y != floor(y)) { return nan64(); } if (azyx_fmod64(y, 2.0lf) != 0.0lf) { r = -r; } }
  return r;
}
""")
