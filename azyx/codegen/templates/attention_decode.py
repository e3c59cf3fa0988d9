"""Decode attention (flash-decoding): a few query rows (a decode step's one) against a long cache of keys and values,
where the whole kernel (templates.attention) would leave most of the device idle (one part or block per query row
walking every key) and, on the host, compute 32 query lanes for each row it has.

Each query row's keys are cut into `Attention.splits` chunks (attention.decode_splits). Stage 1 computes, per (row,
chunk), the chunk's running maximum m (of the scores times scale * log2(e)), its sum l of 2^(s - m) and the weighted
values o = sum 2^(s - m) v, and stores them as a partial (m, l, o[0..Ev-1], float32); stage 2 combines each row's
partials: M the largest m, out = sum 2^(m - M) o / sum 2^(m - M) l. With one chunk stage 1 stores the output itself
and there is no stage 2: one kernel. A chunk all masked has m = -inf, l = 0 and adds nothing; a row all masked is
0 / 0, NaN, as PyTorch's math kernel.

C (`render_c`): a part is a (row, chunk); the row's q scaled once, the keys in blocks of 16 (scores by a vectorised dot
product, the block's maximum, one rescale of o, then o += p v). CUDA (`render_cuda`): a block of CUDA_THREADS
threads per (row, chunk); a group of G lanes holds one key's row, 16 bytes a lane (G = the head's 16-byte pieces,
rounded up to a power of 2), so a warp takes 32 / G keys at a time, each group its own online softmax; the score is
summed across the group by shuffles; the groups of a warp combine by shuffles, the warps through shared memory."""

from __future__ import annotations

from azyx.codegen.dialect import Dialect
from azyx.codegen.templates.attention import (
    CUDA_THREADS,
    LOG2E,
    batch_offsets,
    decode_chunk,
    decode_lanes,
    gather_check,
    kernel_params,
    load_expr,
)
from azyx.codegen.templates.attention_cuda import EX2
from azyx.dtypes import DType
from azyx.ir import Attention

C_KEYS = 16  # C: keys per block (their scores held at once)
UNROLL = 4  # CUDA: keys a lane group loads before it computes (loads in flight)


def render(a: Attention, name: str, dl: Dialect, params: list[DType], scale: str) -> str:
    """Stage 1 or 2 of the decode form of `a` in dialect `dl`."""
    if decode_lanes(dl):
        return render_cuda(a, name, dl, params, scale)
    return render_c(a, name, dl, params, scale)


def _partial_width(a: Attention) -> int:
    return a.Ev + 2  # m, l, o


def _store(dl: Dialect, d: DType, idx: str, val: str) -> str:
    return dl.stores.get(d.name, "{buf}[{idx}] = {val};").format(buf="d0", idx=idx, val=val)


def _mask(a: Attention, dl: Dialect, params: list[DType], it: str, var: str, key: str, guard: str) -> str:
    """A statement masking score `var` of query row i and key `key` by the mask operand (where `guard` holds)."""
    if a.mask is None:
        return ""
    mval = load_expr(dl, params[4], "d4", f"mo + i * ({it}){a.mask[-2]} + {key} * ({it}){a.mask[-1]}")
    if a.mask_bool:
        return f"if ({guard} && !({mval})) {var} = -INFINITY;"
    return f"if ({guard}) {var} += ({mval}) * {LOG2E}f;"


# ------------------------------------------------------------------------------------------------ C


def _loop(dl: Dialect, var: str, n: int) -> str:
    """The loop over parts: the host's [lo, hi), or a work item's own (OpenCL: one trip, if any)."""
    if dl.global_ids:
        return f"for (long {var} = {dl.global_ids}; {var} < {n}; {var} += {n})"
    return f"for (long {var} = lo; {var} < hi; {var}++)"


def render_c(a: Attention, name: str, dl: Dialect, params: list[DType], scale: str) -> str:
    """Stage 1 (`name(lo, hi, out or partials, q, k, v[, mask], scalars...)` over parts (row, chunk)) or stage 2
    (`name(lo, hi, out, partials, scalars...)` over rows); on OpenCL a work item per part, no lo and hi."""
    it, w, E, Ev = "long", _partial_width(a), a.E, a.Ev
    sig = [*([] if dl.global_ids else [f"{it} lo", f"{it} hi"]),
           *kernel_params(dl, params, scale, gather_check(a, len(params)) if a.stage == 1 else None)]
    head, g = f"{dl.kernel_prefix} {name}({', '.join(sig)}) {{", dl.buffer_qual
    rows = a.batch_size * a.L
    if a.stage == 2:
        return head + _c_combine(a, dl, params[0], rows)
    out_t, qt = params[:2]
    chunk = decode_chunk(a)
    if a.splits == 1:
        store = f"for (int c = 0; c < {Ev}; c++) {_store(dl, out_t, f'unit * {Ev}L + c', 'o[c] / l')}"
    else:
        store = f"""{g}float* P = d0 + (unit * {a.splits} + s) * {w}L;
    P[0] = m, P[1] = l;
    for (int c = 0; c < {Ev}; c++) P[2 + c] = o[c];"""
    offsets = "\n    ".join(batch_offsets(a, "b", it, len(params)))
    return head + f"""
  const float qs = (float)({scale}) * {LOG2E}f;
  {_loop(dl, "part", rows * a.splits)} {{
    const {it} unit = part / {a.splits}, b = unit / {a.L};
    const int i = (int)(unit % {a.L}), s = (int)(part % {a.splits});
    {offsets}
    const {it} k0 = ({it})s * {chunk};
    {it} k1 = k0 + {chunk} < {a.S} ? k0 + {chunk} : {a.S};
    {"if (k1 > i + 1) k1 = i + 1;" if a.causal else ""}
    float qv[{E}], o[{Ev}], sc[{C_KEYS}], m = -INFINITY, l = 0.f;
    for (int e = 0; e < {E}; e++) qv[e] = {load_expr(dl, qt, "d1", f"qo + i * {a.q[-2]}L + e * {a.q[-1]}L")} * qs;
    for (int c = 0; c < {Ev}; c++) o[c] = 0.f;
{_c_keys(a, dl, params, it)}
    {store}
  }}
}}
"""


def _c_keys(a: Attention, dl: Dialect, params: list[DType], it: str) -> str:
    """Stage 1's loop over its chunk's keys, C_KEYS at a time: their scores (masked), then the online softmax's
    rescale and the values they weigh."""
    exp2, simd = f"exp2{dl.fn_suffix_f32}", "#pragma omp simd" if dl.pragmas else ""
    kval = load_expr(dl, params[2], "d2", f"ko + key * {a.k[-2]}L + e * {a.k[-1]}L")
    vval = load_expr(dl, params[3], "d3", f"vo + key * {a.v[-2]}L + c * {a.v[-1]}L")
    return f"""    for ({it} j0 = k0; j0 < k1; j0 += {C_KEYS}) {{
      const int n = k1 - j0 < {C_KEYS} ? (int)(k1 - j0) : {C_KEYS};
      float mx = m;
      for (int j = 0; j < n; j++) {{
        const {it} key = j0 + j;
        float d = 0.f;
        {simd}{" reduction(+:d)" if simd else ""}
        for (int e = 0; e < {a.E}; e++) d += qv[e] * {kval};
        {_mask(a, dl, params, it, "d", "key", "1")}
        sc[j] = d;
        mx = d > mx ? d : mx;
      }}
      const float ms = mx == -INFINITY ? 0.f : mx, alpha = {exp2}(m - ms);
      l *= alpha;
      for (int c = 0; c < {a.Ev}; c++) o[c] *= alpha;
      for (int j = 0; j < n; j++) {{
        const {it} key = j0 + j;
        const float p = {exp2}(sc[j] - ms);
        l += p;
        {simd}
        for (int c = 0; c < {a.Ev}; c++) o[c] += p * {vval};
      }}
      m = mx;
    }}"""


def _c_combine(a: Attention, dl: Dialect, out_t: DType, rows: int) -> str:
    """Stage 2's body: per row, the chunks' partials (max, sum, weighted values) combined into the output."""
    w, Ev, g, exp2 = _partial_width(a), a.Ev, dl.buffer_qual, f"exp2{dl.fn_suffix_f32}"
    return f"""
  {_loop(dl, "unit", rows)} {{
    {g}const float* P = d1 + unit * {a.splits * w}L;
    float mx = -INFINITY, l = 0.f, o[{Ev}];
    for (int s = 0; s < {a.splits}; s++) mx = P[s * {w}] > mx ? P[s * {w}] : mx;
    const float ms = mx == -INFINITY ? 0.f : mx;
    for (int c = 0; c < {Ev}; c++) o[c] = 0.f;
    for (int s = 0; s < {a.splits}; s++) {{
      const float f = {exp2}(P[s * {w}] - ms);
      l += f * P[s * {w} + 1];
      for (int c = 0; c < {Ev}; c++) o[c] += f * P[s * {w} + 2 + c];
    }}
    for (int c = 0; c < {Ev}; c++) {_store(dl, out_t, f"unit * {Ev}L + c", "o[c] / l")}
  }}
}}
"""


# ------------------------------------------------------------------------------------------------ CUDA


def _lane_load(kind: str) -> str:
    """`azyx_ld16_{kind}(p, f)`: the 16 bytes at element pointer p (16-byte aligned) as floats f[0..]."""
    if kind == "float32":
        body = "const float4 r = *(const float4*)p; f[0] = r.x, f[1] = r.y, f[2] = r.z, f[3] = r.w;"
        ptr = "const float*"
    else:
        lo, hi = (("__uint_as_float(w[t] << 16)", "__uint_as_float(w[t] & 0xffff0000u)") if kind == "bfloat16" else
                  ("h2f((f16_t)(w[t] & 0xffffu))", "h2f((f16_t)(w[t] >> 16))"))
        body = (f"const uint4 r = *(const uint4*)p; const unsigned w[4] = {{r.x, r.y, r.z, r.w}};\n"
                f"  #pragma unroll\n  for (int t = 0; t < 4; t++) f[2 * t] = {lo}, f[2 * t + 1] = {hi};")
        ptr = "const unsigned short*"
    return f"""#ifndef AZYX_LD16_{kind.upper()}
#define AZYX_LD16_{kind.upper()}
__device__ inline void azyx_ld16_{kind}({ptr} p, float* f) {{
  {body}
}}
#endif
"""


def lane_groups(a: Attention, dtype: DType) -> tuple[int, int, int, int]:
    """(elements a lane reads: 16 bytes, q/k pieces, v pieces, the lane group's size G: the pieces of the longer head
    rounded up to a power of 2)."""
    w = 16 // dtype.itemsize
    nq, nv = a.E // w, a.Ev // w
    g = 1
    while g < max(nq, nv):
        g *= 2
    return w, nq, nv, g


def render_cuda(a: Attention, name: str, dl: Dialect, params: list[DType], scale: str) -> str:
    """Stage 1 (grid (rows, chunks): each block's online softmax over its chunk, then its partial or the output) or
    stage 2 (grid (rows, 1): the partials combined)."""
    it, pw, Ev = "long long", _partial_width(a), a.Ev
    sig = ", ".join(kernel_params(dl, params, scale, gather_check(a, len(params)) if a.stage == 1 else None))
    if a.stage == 2:
        return EX2 + f"""extern "C" __global__ void __launch_bounds__({CUDA_THREADS}) {name}({sig}) {{
  const {it} unit = blockIdx.x;
  const float* P = d1 + unit * {a.splits * pw}LL;
  float mx = -INFINITY, l = 0.f;
  for (int s = 0; s < {a.splits}; s++) mx = fmaxf(mx, P[s * {pw}]);
  const float ms = mx == -INFINITY ? 0.f : mx;
  for (int s = 0; s < {a.splits}; s++) l += azyx_ex2(P[s * {pw}] - ms) * P[s * {pw} + 1];
  for (int c = threadIdx.x; c < {Ev}; c += {CUDA_THREADS}) {{
    float o = 0.f;
    for (int s = 0; s < {a.splits}; s++) o += azyx_ex2(P[s * {pw}] - ms) * P[s * {pw} + 2 + c];
    {_store(dl, params[0], f"unit * {Ev}LL + c", "o / l")}
  }}
}}
"""
    kind = params[1].name
    w, nq, nv, g = lane_groups(a, params[1])
    kpw, warps = 32 // g, CUDA_THREADS // 32  # keys a warp takes at once
    step = warps * kpw  # keys the block takes at once
    chunk = decode_chunk(a)
    if a.splits == 1:
        store = " ".join(_store(dl, params[0], f"unit * {Ev}LL + lane * {w} + {t}", f"acc[{t}] / sum")
                         for t in range(w))
    else:
        store = f"""float* P = d0 + (unit * {a.splits} + s) * {pw}LL;
    if (lane == 0) P[0] = mx, P[1] = sum;
    #pragma unroll
    for (int t = 0; t < {w}; t++) P[2 + lane * {w} + t] = acc[t];"""
    offsets = "\n  ".join(batch_offsets(a, "b", it, len(params)))
    head = f"""extern "C" __global__ void __launch_bounds__({CUDA_THREADS}) {name}({sig}) {{
  __shared__ float red[{warps}][{Ev + 2}];  /* each warp's m, l, o */
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane & {g - 1}, grp = lane / {g};
  const {it} unit = blockIdx.x, b = unit / {a.L};
  const int i = (int)(unit % {a.L}), s = blockIdx.y;
  {offsets}
  const float qs = (float)({scale}) * {LOG2E}f;
  const int k0 = s * {chunk};
  int k1 = min({a.S}, k0 + {chunk});
  {"k1 = min(k1, i + 1);" if a.causal else ""}
  float qv[{w}], o[{w}], m = -INFINITY, l = 0.f;
  if (g < {nq}) azyx_ld16_{kind}(d1 + qo + i * {a.q[-2]}LL + g * {w}, qv);
  #pragma unroll
  for (int t = 0; t < {w}; t++) qv[t] = g < {nq} ? qv[t] * qs : 0.f, o[t] = 0.f;
"""
    return EX2 + _lane_load(kind) + head + _cuda_keys(a, dl, params, it, kind, w, nq, nv, g, step) + \
        _cuda_combine(g, w, nv, warps) + f"""    {store}
  }}
}}
"""


def _cuda_keys(a: Attention, dl: Dialect, params: list[DType], it: str, kind: str, w: int, nq: int, nv: int, g: int,
               step: int) -> str:
    """The loop over the chunk's keys: UNROLL keys a lane group loaded, scored (summed across the group), masked, and
    taken into the group's online softmax. The loop's bounds are the warp's (every lane shuffles)."""
    return f"""  for (int j0 = k0 + warp * {32 // g}; j0 < k1; j0 += {step * UNROLL}) {{
    float kf[{UNROLL}][{w}], vf[{UNROLL}][{w}], sc[{UNROLL}];
    #pragma unroll
    for (int u = 0; u < {UNROLL}; u++) {{
      const int key = j0 + grp + u * {step};
      if (key < k1 && g < {nq}) azyx_ld16_{kind}(d2 + ko + key * {a.k[-2]}LL + g * {w}, kf[u]);
      else
        #pragma unroll
        for (int t = 0; t < {w}; t++) kf[u][t] = 0.f;
      if (key < k1 && g < {nv}) azyx_ld16_{kind}(d3 + vo + key * {a.v[-2]}LL + g * {w}, vf[u]);
      else
        #pragma unroll
        for (int t = 0; t < {w}; t++) vf[u][t] = 0.f;
    }}
    float mx = m;
    #pragma unroll
    for (int u = 0; u < {UNROLL}; u++) {{
      const int key = j0 + grp + u * {step};
      float d = 0.f;
      #pragma unroll
      for (int t = 0; t < {w}; t++) d += qv[t] * kf[u][t];
      #pragma unroll
      for (int x = {g // 2}; x > 0; x >>= 1) d += __shfl_xor_sync(0xffffffffu, d, x);
      if (key >= k1) d = -INFINITY;
      {_mask(a, dl, params, it, "d", "key", "key < k1")}
      sc[u] = d;
      mx = fmaxf(mx, d);
    }}
    const float ms = mx == -INFINITY ? 0.f : mx, alpha = azyx_ex2(m - ms);
    l *= alpha;
    #pragma unroll
    for (int t = 0; t < {w}; t++) o[t] *= alpha;
    #pragma unroll
    for (int u = 0; u < {UNROLL}; u++) {{
      const float p = azyx_ex2(sc[u] - ms);
      l += p;
      #pragma unroll
      for (int t = 0; t < {w}; t++) o[t] += p * vf[u][t];
    }}
    m = mx;
  }}
"""


def _cuda_combine(g: int, w: int, nv: int, warps: int) -> str:
    """The lane groups of each warp combined by shuffles, then the warps through shared memory (warp 0's first nv
    lanes, a piece of the output each)."""
    return f"""  #pragma unroll
  for (int x = {g}; x < 32; x <<= 1) {{
    const float m2 = __shfl_xor_sync(0xffffffffu, m, x), l2 = __shfl_xor_sync(0xffffffffu, l, x);
    const float mx = fmaxf(m, m2), ms = mx == -INFINITY ? 0.f : mx, f = azyx_ex2(m - ms), f2 = azyx_ex2(m2 - ms);
    l = l * f + l2 * f2;
    #pragma unroll
    for (int t = 0; t < {w}; t++) o[t] = o[t] * f + __shfl_xor_sync(0xffffffffu, o[t], x) * f2;
    m = mx;
  }}
  if (lane == 0) red[warp][0] = m, red[warp][1] = l;
  if (lane < {nv})
    #pragma unroll
    for (int t = 0; t < {w}; t++) red[warp][2 + lane * {w} + t] = o[t];
  __syncthreads();
  if (warp == 0 && lane < {nv}) {{
    float mx = -INFINITY, sum = 0.f, acc[{w}];
    #pragma unroll
    for (int v = 0; v < {warps}; v++) mx = fmaxf(mx, red[v][0]);
    const float ms = mx == -INFINITY ? 0.f : mx;
    #pragma unroll
    for (int t = 0; t < {w}; t++) acc[t] = 0.f;
    #pragma unroll
    for (int v = 0; v < {warps}; v++) {{
      const float f = azyx_ex2(red[v][0] - ms);
      sum += f * red[v][1];
      #pragma unroll
      for (int t = 0; t < {w}; t++) acc[t] += f * red[v][2 + lane * {w} + t];
    }}
"""
