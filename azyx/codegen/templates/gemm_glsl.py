"""Vulkan's tiled matrix product (the SHADER_TILES family, codegen.templates.gemm's `Gemm`): the CUDA scheme as a
GLSL compute shader, without split K."""

from __future__ import annotations

from dataclasses import dataclass

from azyx.codegen.dialect import SHADER_TILES
from azyx.codegen.templates.gemm import BK, THREADS, Gemm, slot_heads


def render_glsl(g: Gemm, name: str, prelude: str, max_groups: int) -> str | None:
    """The tiled product as a Vulkan compute shader (the shader interface of `cfamily.glsl_interface`: buffers by
    device address from the words buffer, C first). Shared memory holds 4-float vectors, so a thread reads its
    register tile's operands 16 bytes at a time (a thread's columns of B and C interleave with its neighbours', so
    16 threads read 16 consecutive vectors: no bank conflicts, and C is written in whole lines); global loads are
    16 bytes wide where an operand's contiguous axis allows. K is never split (GLSL has no float atomics without an
    extension). None where the grid would exceed the device's groups per dimension."""
    assert g.target == SHADER_TILES
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
    text = f"""{prelude}
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
"""
    return (text
            + _main_loop(fma, tm, tn, a_load, b_load)
            + _epilogue(tm, store, g, tn))


def _main_loop(fma: str, tm: int, tn: int, a_load: _GlslLoad, b_load: _GlslLoad) -> str:
    """The main loop: each K slice multiplied from shared memory while the next is fetched into registers."""
    return f"""\
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
"""


def _epilogue(tm: int, store: str, g: Gemm, tn: int) -> str:
    """The register tile stored into C, whole 16-byte lines where C's rows allow."""
    return f"""\
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
    heads = slot_heads(vec, elems, t, "x", along_k, "int")
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
