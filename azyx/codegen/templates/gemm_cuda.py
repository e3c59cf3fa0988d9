"""CUDA's tiled matrix products (the WARP_TILES family, codegen.templates.gemm's `Gemm`): float32 on CUDA cores
(`render_simt`: SimtTile warp tiles, K split over blocks with atomic adds where tiles are few) and float16/bfloat16 on
tensor cores (`render_mma`: mma.sync m16n8k16, K slices copied Gemm.stages deep by cp.async; float32 C where the
planner split the product over K, gemm.split_k)."""

from __future__ import annotations

from dataclasses import dataclass

from azyx.codegen.templates.gemm import MMA_BK, MMA_WARPS, Gemm, SimtTile, slot_heads


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
    text = f"""extern "C" __global__ void __launch_bounds__({threads}) {name}(float* __restrict__ C, {params}) {{
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
"""
    return (text
            + _simt_main_loop(bk, tm, tn, lm, ln, a_load, b_load)
            + _simt_epilogue(tm, tn, lm, g, ln, parts))


def _simt_main_loop(bk: int, tm: int, tn: int, lm: int, ln: int, a_load: _Load, b_load: _Load) -> str:
    """The main loop: each K slice multiplied from shared memory while the next is fetched into registers."""
    return f"""\
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
"""


def _simt_epilogue(tm: int, tn: int, lm: int, g: Gemm, ln: int, parts: int) -> str:
    """The register tile stored into C (added atomically where K is split)."""
    return f"""\
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
    for s, head in enumerate(slot_heads(vec, elems, t, ax, along_k, "const int", threads, bk, True)):
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
    decl: str  # the shared array (Gemm.stages stages) and any registers
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
    assert MMA_BK == 32 and t % 32 == 0
    aligned = off % 8 == 0 and s_b % 8 == 0
    if s_k == 1 and s_outer % 8 == 0 and aligned:
        k_major, async_copy = True, True
    elif s_outer == 1 and s_k % 8 == 0 and aligned:
        k_major, async_copy = False, True
    else:
        k_major, async_copy = abs(s_k) <= abs(s_outer), False
    bk, sh = MMA_BK, f"{mat}s"
    rows, cols = (t, bk) if k_major else (bk, t)
    decl = f"__shared__ __align__(16) unsigned short {sh}[{g.stages}][{rows}][{cols}];"

    def swizzled(r: str, c: str) -> str:
        """Where element c of shared row r lies: its chunk c / 8 XORed with bits of r (rows of 64 bytes, k-major ones
        and a 32-wide tile's outer-major ones, lie two to a 128-byte line of banks: bits 1-2 of r; longer rows fill
        whole lines: bits 0-2)."""
        bits = f"(({r} >> 1) & 3)" if cols == 32 else f"({r} & 7)"
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


def _pair_store(g: Gemm, cvt: str) -> str:
    """A lane's two neighbouring elements of C (c[0], c[1] at row i, columns j, j + 1) rounded by `cvt` and stored:
    one aligned 4-byte store where j is even (float32 C, a split product's partial sums: unrounded, 8 bytes)."""
    row = f"(Cb + (long long)i * {g.n} + j)"
    if g.c_dtype == "float32":
        if g.n % 2 == 0:
            return f"if (j < {g.n}) *(float2*)({row}) = make_float2(c[0], c[1]);"
        return f"if (j < {g.n}) {row}[0] = c[0]; if (j + 1 < {g.n}) {row}[1] = c[1];"
    if g.n % 2 == 0:  # j is even: a pair of C's elements is one aligned 4-byte store
        return (f"if (j < {g.n}) *(unsigned*)({row}) = (unsigned){cvt}(c[0]) | ((unsigned){cvt}(c[1]) << 16);")
    else:
        return f"if (j < {g.n}) {row}[0] = {cvt}(c[0]); if (j + 1 < {g.n}) {row}[1] = {cvt}(c[1]);"


def _first_slices(g: Gemm, a: _MmaOperand, b: _MmaOperand, commit: str) -> list[str]:
    """The first slices copied into stages 0.., a commit group each (empty past K: the count of groups stays)."""
    first = []
    for p in range(g.stages - 1):
        copies = "\n  ".join(x for x in (a.fetch, a.put, b.fetch, b.put) if x)
        if p * MMA_BK < g.k:
            first.append(f"{{ const int k1 = {p * MMA_BK};\n  {copies.replace('@K0@', 'k1').replace('@S@', str(p))} }}")
        first.append(commit)
    return first


def render_mma(g: Gemm, name: str) -> str:
    """The product of float16 or bfloat16 operands on tensor cores (sm_80 on): `mma.sync.m16n8k16` with float32
    accumulators. A block of 8 warps (2 x 4) computes a 128 x 128 tile of C, each warp 64 x 32 (4 x 4 mma tiles); a
    small product takes 64 x 64 tiles of 4 warps, 32 x 32 each (32 rows or fewer: 32 x 64, 32 x 16 each). K steps by
    slices of 32 through `g.stages` shared-memory stages (three; a product of few rows, a stream of its weight, as
    many as 48 KiB holds): the next slices' copies (cp.async) are in flight while one is multiplied. Blocks run in
    groups of 8 block-rows, so the blocks resident at once share their A rows and B columns in L2. Edges: loads past
    M, N or K read zeros, stores are guarded; C is rounded to its dtype once (a split product's float32 partial sums,
    Gemm.out, are stored as they are: gemm.split_k)."""
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
    store = _pair_store(g, cvt)
    ahead = (g.stages - 1) * MMA_BK  # the slice copied while slice k0 is multiplied: k0 + ahead
    put = "" if a.async_copy and b.async_copy else f"""    if (more) {{
      {a.put.replace("@K0@", "k1").replace("@S@", "sn")}
      {b.put.replace("@K0@", "k1").replace("@S@", "sn")}
    }}
"""
    commit = 'asm volatile("cp.async.commit_group;" ::: "memory");'
    first = _first_slices(g, a, b, commit)
    # two blocks of 8 warps per multiprocessor (128 registers a thread) where both operands are copied by cp.async;
    # element loads stage a slice in registers, which 128 would spill
    two = ", 2" if threads == 256 and a.async_copy and b.async_copy else ""
    c_type = "float" if g.c_dtype == "float32" else "unsigned short"
    text = MMA_HELPERS + f"""extern "C" __global__ void __launch_bounds__({threads}{two}) \
{name}({c_type}* __restrict__ C, {params}) {{
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
"""
    return (text
            + _mma_main_loop(ahead, commit, mi, frags_a, frags_b, ni, kind, put, g, a, b)
            + _mma_epilogue(mi, ni, wtm, wtn, store, g))


def _mma_main_loop(ahead: int, commit: str, mi: int, frags_a: str, frags_b: str, ni: int, kind: str, put: str, g: Gemm,
                   a: _MmaOperand, b: _MmaOperand) -> str:
    """The main loop: per K slice, the slice two ahead copied into the stage freed, then mma.sync over the slice."""
    return f"""\
  int s = 0;  // the stage of slice k0
  for (int k0 = 0; k0 < {g.k}; k0 += {MMA_BK}) {{
    asm volatile("cp.async.wait_group {g.stages - 2};" ::: "memory");  // slice k0 has landed
    __syncthreads();  // ... for all; and every warp is done with slice k0 - {MMA_BK}: its stage sn takes slice k1
    const int sn = s == 0 ? {g.stages - 1} : s - 1, k1 = k0 + {ahead};
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
{put}    s = s == {g.stages - 1} ? 0 : s + 1;
  }}
"""


def _mma_epilogue(mi: int, ni: int, wtm: int, wtn: int, store: str, g: Gemm) -> str:
    """The accumulators rounded to C's dtype (float32: as they are) and stored, two elements a store where they are
    aligned."""
    return f"""\
  {"float" if g.c_dtype == "float32" else "unsigned short"}* Cb = C + bz * {g.m * g.n}LL;
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
