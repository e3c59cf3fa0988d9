"""CUDA kernels of azyx's templates run on the host, for tests on a machine without a GPU: the rendered source compiled
as C++ (g++, C++20) under a prelude that gives it CUDA's names, every thread of a block a host thread. Blocks run one
after another (a `__shared__` array is a static, shared by the block's threads); `__syncthreads` is a barrier of the
block's threads, and `__shfl_xor_sync` / `__syncwarp` barriers of the warp's 32 (each lane posts its value, reads its
partner's), so a kernel whose warps shuffle in step computes what the GPU does. Inline PTX has no host meaning:
2^x (`azyx_ex2`) and the float16 conversions are the prelude's. Not for the tensor-core kernels (their ldmatrix and
mma are PTX: tests/test_mma_emulated.py reads those)."""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import subprocess
import tempfile
from pathlib import Path

import numpy as np

PRELUDE = r"""#include <atomic>
#include <barrier>
#include <cmath>
#include <cstring>
#include <thread>
#include <vector>
#include <algorithm>
using std::min; using std::max;
#define __global__
#define __device__
#define __launch_bounds__(n)
#define __restrict__ __restrict
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))
typedef unsigned short f16_t;
typedef unsigned short bf16_t;
struct uint4 { unsigned x, y, z, w; };
struct uint2 { unsigned x, y; };
struct float4 { float x, y, z, w; };
struct float2 { float x, y; };
static inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
static inline float2 make_float2(float x, float y) { return {x, y}; }
static inline float atomicAdd(float* p, float v) { return std::atomic_ref<float>(*p).fetch_add(v); }
struct dim3_ { unsigned x, y, z; };
static thread_local dim3_ threadIdx, blockIdx;
static dim3_ gridDim, blockDim;
static inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
static inline unsigned __float_as_uint(float f) { unsigned u; std::memcpy(&u, &f, 4); return u; }
static inline float __int_as_float(int u) { float f; std::memcpy(&f, &u, 4); return f; }
static inline float bf2f(bf16_t x) { return __uint_as_float(((unsigned)x) << 16); }
static inline bf16_t f2bf(float f) {
  unsigned i = __float_as_uint(f);
  if (f != f) return (bf16_t)0x7fc0;
  return (bf16_t)((i + 0x7fffu + ((i >> 16) & 1u)) >> 16);
}
static inline float h2f(f16_t x) { _Float16 h; std::memcpy(&h, &x, 2); return (float)h; }
static inline f16_t f2h(float f) { _Float16 h = (_Float16)f; f16_t x; std::memcpy(&x, &h, 2); return x; }
static inline float azyx_ex2(float x) { return std::exp2(x); }
struct Warp { std::barrier<> bar{32}; float slot[32]; };
static std::barrier<>* block_bar;
static Warp* warps;
static inline float __shfl_xor_sync(unsigned, float v, int x) {
  const unsigned t = threadIdx.x; Warp& w = warps[t / 32];
  w.slot[t % 32] = v; w.bar.arrive_and_wait();
  const float r = w.slot[(t % 32) ^ x]; w.bar.arrive_and_wait();
  return r;
}
static inline void __syncthreads() { block_bar->arrive_and_wait(); }
static inline void __syncwarp() { warps[threadIdx.x / 32].bar.arrive_and_wait(); }
"""

LAUNCHER = r"""
extern "C" void azyx_launch(void** b, const float* sc, unsigned gx, unsigned gy, unsigned gz, unsigned threads) {
  gridDim = {gx, gy, gz}; blockDim = {threads, 1, 1};
  for (unsigned z = 0; z < gz; z++) for (unsigned y = 0; y < gy; y++) for (unsigned x = 0; x < gx; x++) {
    std::barrier<> bar(threads); block_bar = &bar;
    std::vector<Warp> ws(threads / 32); warps = ws.data();
    std::vector<std::thread> ts;
    for (unsigned t = 0; t < threads; t++)
      ts.emplace_back([=] { threadIdx = {t, 0, 0}; blockIdx = {x, y, z}; CALL; });
    for (auto& th : ts) th.join();
  }
}
"""

_EX2 = re.compile(r"#ifndef AZYX_EX2\n.*?#endif\n", re.S)
_DYNAMIC = re.compile(r"extern __shared__ __align__\(16\) (\w+) (\w+)\[\];")  # (dynamic shared memory: 96 KiB here)


def _call(src: str, name: str) -> str:
    """The kernel's call from the launcher: buffer i cast to its parameter's type, then the scalars."""
    sig = re.search(name + r"\((.*?)\) \{", src)
    assert sig is not None, f"no kernel {name}"
    args, nbuf, nsc = [], 0, 0
    for p in sig[1].split(", "):
        if "*" in p:
            args.append(f"({p.rsplit('*', 1)[0]}*)b[{nbuf}]")
            nbuf += 1
        else:
            args.append(f"sc[{nsc}]")
            nsc += 1
    return f"{name}({', '.join(args)})"


def launch(src: str, name: str, grid: tuple[int, int, int], threads: int, buffers: list[np.ndarray],
           scalars: tuple[float, ...] = ()) -> None:
    """Run kernel `name` of `src` (a template's rendering, no dialect prelude) over `grid` blocks of `threads` on the
    host, with `buffers` as its buffer parameters in order (written in place) and then `scalars`."""
    src = _DYNAMIC.sub(lambda m: f"static {m[1]} {m[2]}[(96 << 10) / sizeof({m[1]})];", _EX2.sub("", src))
    text = PRELUDE + src + LAUNCHER.replace("CALL", _call(src, name))
    lib = _build(text)
    ptrs = (ctypes.c_void_p * len(buffers))(*(b.ctypes.data for b in buffers))
    sc = (ctypes.c_float * max(len(scalars), 1))(*scalars)
    lib.azyx_launch(ptrs, sc, *(ctypes.c_uint(g) for g in grid), ctypes.c_uint(threads))


def _build(text: str) -> ctypes.CDLL:
    key = hashlib.sha256(text.encode()).hexdigest()[:16]
    folder = Path(tempfile.gettempdir()) / f"azyx-cuda-host-{os.getuid()}"
    folder.mkdir(exist_ok=True)
    lib = folder / f"{key}.so"
    if not lib.exists():
        cpp = folder / f"{key}.cpp"
        cpp.write_text(text)
        tmp = folder / f"{key}.{os.getpid()}.so"
        r = subprocess.run(["g++", "-std=c++20", "-O1", "-pthread", "-shared", "-fPIC", "-Wno-unknown-pragmas",
                            str(cpp), "-o", str(tmp)], capture_output=True, text=True)
        assert r.returncode == 0, f"g++ failed on {cpp}:\n{r.stderr[-4000:]}"
        tmp.replace(lib)
    return ctypes.CDLL(str(lib))
