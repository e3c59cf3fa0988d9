"""CUDA kernels of azyx's templates run on the host, for tests on a machine without a GPU: the rendered source compiled
as C++ (gcc) under a prelude that gives it CUDA's names, every thread of a block a fiber of one OS thread (a stack of
its own, switched to and from by hand). Blocks run one after another (a `__shared__` array is a static, shared by the
block's threads); `__syncthreads` is a barrier of the block's fibers, and `__shfl_xor_sync` / `__syncwarp` barriers
of the warp's 32 (each lane posts its value, reads its partner's), so a kernel whose warps shuffle in step computes
what the GPU does. A fiber runs until it waits at a barrier; the scheduler then resumes the next one that can go on,
in thread order, or reversed every other pass and block: a read of another thread's write that no barrier orders
reads the old value where the reader runs first (a later thread's write in thread order, an earlier one's reversed),
and a barrier that some thread never reaches fails the launch (where a GPU hangs). Inline PTX has no host meaning:
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

_MATH = ("exp", "exp2", "expm1", "log", "log2", "log10", "log1p", "sqrt", "cbrt", "sin", "cos", "tan", "asin", "acos",
         "atan", "sinh", "cosh", "tanh", "asinh", "acosh", "atanh", "erf", "erfc", "floor", "ceil", "round", "trunc",
         "rint", "fabs")
_MATH2 = ("pow", "fmax", "fmin", "fmod", "copysign", "atan2", "hypot")
# (libm's functions declared, not <cmath>'s 60k lines: those cost 0.5-1 s of each compile)
MATH = 'extern "C" {\n' + "".join(f"float {f}f(float); double {f}(double);\n" for f in _MATH) + "".join(
    f"float {f}f(float, float); double {f}(double, double);\n" for f in _MATH2) + """}
#define INFINITY __builtin_inff()
#define NAN __builtin_nanf("")
#define isnan(x) __builtin_isnan(x)
#define isinf(x) __builtin_isinf(x)
#define isfinite(x) __builtin_isfinite(x)
"""

PRELUDE = MATH + r"""#include <sys/mman.h>
template <class T> static inline T min(T a, T b) { return b < a ? b : a; }
template <class T> static inline T max(T a, T b) { return a < b ? b : a; }
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
static inline float atomicAdd(float* p, float v) { const float old = *p; *p = old + v; return old; }
struct dim3_ { unsigned x, y, z; };
static dim3_ threadIdx, blockIdx, gridDim, blockDim;  // (threadIdx: the running fiber's, set at each switch)
static inline float __uint_as_float(unsigned u) { float f; __builtin_memcpy(&f, &u, 4); return f; }
static inline unsigned __float_as_uint(float f) { unsigned u; __builtin_memcpy(&u, &f, 4); return u; }
static inline float __int_as_float(int u) { float f; __builtin_memcpy(&f, &u, 4); return f; }
static inline float bf2f(bf16_t x) { return __uint_as_float(((unsigned)x) << 16); }
static inline bf16_t f2bf(float f) {
  unsigned i = __float_as_uint(f);
  if (f != f) return (bf16_t)0x7fc0;
  return (bf16_t)((i + 0x7fffu + ((i >> 16) & 1u)) >> 16);
}
static inline float h2f(f16_t x) { _Float16 h; __builtin_memcpy(&h, &x, 2); return (float)h; }
static inline f16_t f2h(float f) { _Float16 h = (_Float16)f; f16_t x; __builtin_memcpy(&x, &h, 2); return x; }
static inline float azyx_ex2(float x) { return exp2f(x); }
#if defined(__x86_64__) && !defined(AZYX_UCONTEXT)
extern "C" __attribute__((visibility("hidden"))) void azyx_switch(void** save, void* to);
asm(".text\n.globl azyx_switch\n.hidden azyx_switch\n.type azyx_switch, @function\nazyx_switch:\n"
    "pushq %rbp\npushq %rbx\npushq %r12\npushq %r13\npushq %r14\npushq %r15\nmovq %rsp, (%rdi)\nmovq %rsi, %rsp\n"
    "popq %r15\npopq %r14\npopq %r13\npopq %r12\npopq %rbx\npopq %rbp\nret\n.size azyx_switch, .-azyx_switch\n");
struct Ctx { void* sp; };
static inline void ctx_switch(Ctx& from, Ctx& to) { azyx_switch(&from.sp, to.sp); }
static void ctx_make(Ctx& c, char* stack, size_t size, void (*entry)()) {
  void** sp = (void**)(((unsigned long)(stack + size)) & ~15ul);
  *--sp = nullptr;  // (entry's return address: it never returns)
  *--sp = (void*)entry;  // (azyx_switch's: its ret starts the fiber)
  for (int i = 0; i < 6; i++) *--sp = nullptr;  // (the callee-saved registers it pops)
  c.sp = sp;
}
#else
#include <ucontext.h>
struct Ctx { ucontext_t uc; };
static inline void ctx_switch(Ctx& from, Ctx& to) { swapcontext(&from.uc, &to.uc); }
static void ctx_make(Ctx& c, char* stack, size_t size, void (*entry)()) {
  getcontext(&c.uc); c.uc.uc_stack.ss_sp = stack; c.uc.uc_stack.ss_size = size; c.uc.uc_link = nullptr;
  makecontext(&c.uc, entry, 0);
}
#endif
struct Fiber { Ctx ctx; const unsigned* wait; unsigned gen, parity; bool done; };
struct Bar { unsigned need, count, gen; };
static Fiber azyx_fibers[1024];
static Ctx azyx_main;
static Bar block_bar, warp_bar[32];
static float warp_slot[32][2][32];
static inline void azyx_arrive(Bar& b) {  // a fiber waits (yields to the scheduler) until all `need` arrived
  const unsigned g = b.gen;
  if (++b.count == b.need) { b.count = 0; b.gen = g + 1; return; }
  Fiber& f = azyx_fibers[threadIdx.x];
  f.wait = &b.gen; f.gen = g;
  ctx_switch(f.ctx, azyx_main);
  asm volatile("" ::: "memory");  // (what the other fibers wrote is read again)
}
static inline float __shfl_xor_sync(unsigned, float v, int x) {  // (slots alternate: the next shuffle's writes
  const unsigned t = threadIdx.x;                                 // wait at its barrier for every lane's read)
  float* s = warp_slot[t / 32][azyx_fibers[t].parity ^= 1];
  s[t % 32] = v; azyx_arrive(warp_bar[t / 32]);
  return s[(t % 32) ^ x];
}
static inline void __syncthreads() { azyx_arrive(block_bar); }
static inline void __syncwarp() { azyx_arrive(warp_bar[threadIdx.x / 32]); }
"""

LAUNCHER = r"""
static void** azyx_b;
static const float* azyx_sc;
static void azyx_entry() {
  CALL;
  Fiber& f = azyx_fibers[threadIdx.x];
  f.done = true;
  ctx_switch(f.ctx, azyx_main);
  __builtin_unreachable();
}
extern "C" int azyx_launch(void** b, const float* sc, unsigned gx, unsigned gy, unsigned gz, unsigned threads) {
  const size_t page = 4096, size = STACK;
  if (threads == 0 || threads > 1024) return 2;
  char* mem = (char*)mmap(nullptr, size * threads, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                          -1, 0);
  if (mem == MAP_FAILED) return 3;
  for (unsigned t = 0; t < threads; t++) mprotect(mem + t * size, page, PROT_NONE);  // (an overflow faults)
  azyx_b = b; azyx_sc = sc;
  gridDim = {gx, gy, gz}; blockDim = {threads, 1, 1};
  int rc = 0;
  for (unsigned z = 0; z < gz && !rc; z++) for (unsigned y = 0; y < gy && !rc; y++)
    for (unsigned x = 0; x < gx && !rc; x++) {
      blockIdx = {x, y, z};
      block_bar = {threads, 0, 0};
      for (unsigned w = 0; w < 32; w++) warp_bar[w] = {threads > 32 * w + 32 ? 32 : threads - 32 * w, 0, 0};
      for (unsigned t = 0; t < threads; t++) {
        Fiber& f = azyx_fibers[t];
        ctx_make(f.ctx, mem + t * size + page, size - page, azyx_entry);
        f.wait = nullptr; f.parity = 0; f.done = false;
      }
      for (unsigned left = threads, pass = x + y + z; left && !rc; pass++) {  // each pass runs every fiber that
        bool moved = false;  // can go to its next barrier, in thread order or (every other pass and block) reversed
        for (unsigned i = 0; i < threads; i++) {
          const unsigned t = pass % 2 ? threads - 1 - i : i;
          Fiber& f = azyx_fibers[t];
          if (f.done || (f.wait && *f.wait == f.gen)) continue;
          f.wait = nullptr; threadIdx = {t, 0, 0};
          ctx_switch(azyx_main, f.ctx);
          moved = true; left -= f.done;
        }
        rc = !moved;  // (a barrier that some thread never reaches)
      }
    }
  munmap(mem, size * threads);
  return rc;
}
"""
STACK = 256 << 10  # (a fiber's stack: the kernel's register arrays live there; a guard page below it)

_EX2 = re.compile(r"#ifndef AZYX_EX2\n.*?#endif\n", re.S)
_DYNAMIC = re.compile(r"extern __shared__ __align__\(16\) (\w+) (\w+)\[\];")  # (dynamic shared memory: 96 KiB here)


def _call(src: str, name: str) -> str:
    """The kernel's call from the launcher: buffer i cast to its parameter's type, then the scalars."""
    sig = re.search(name + r"\((.*?)\) \{", src)
    assert sig is not None, f"no kernel {name}"
    args, nbuf, nsc = [], 0, 0
    for p in sig[1].split(", "):
        if "*" in p:
            args.append(f"({p.rsplit('*', 1)[0]}*)azyx_b[{nbuf}]")
            nbuf += 1
        else:
            args.append(f"azyx_sc[{nsc}]")
            nsc += 1
    return f"{name}({', '.join(args)})"


def launch(src: str, name: str, grid: tuple[int, int, int], threads: int, buffers: list[np.ndarray],
           scalars: tuple[float, ...] = ()) -> None:
    """Run kernel `name` of `src` (a template's rendering, no dialect prelude) over `grid` blocks of `threads` on the
    host, with `buffers` as its buffer parameters in order (written in place) and then `scalars`."""
    src = _DYNAMIC.sub(lambda m: f"static {m[1]} {m[2]}[(96 << 10) / sizeof({m[1]})];", _EX2.sub("", src))
    text = PRELUDE + src + LAUNCHER.replace("CALL", _call(src, name)).replace("STACK", str(STACK))
    lib = _build(text)
    ptrs = (ctypes.c_void_p * len(buffers))(*(b.ctypes.data for b in buffers))
    sc = (ctypes.c_float * max(len(scalars), 1))(*scalars)
    rc = lib.azyx_launch(ptrs, sc, *(ctypes.c_uint(g) for g in grid), ctypes.c_uint(threads))
    assert rc == 0, {1: f"{name}: a barrier that not every thread of a block reaches (a deadlock on the GPU)",
                     2: f"{threads} threads a block: 1..1024", 3: "no memory for the threads' stacks"}[rc]


# (-O0: 0.13 s of CPU a compile against 0.23 at -O1, and the suite's 80 kernels run in 2.8 s against 2.0: a fresh
# machine compiles each once. gcc, not g++: no libstdc++ to link)
GCC = ["gcc", "-x", "c++", "-std=c++20", "-O0", "-fno-exceptions", "-shared", "-fPIC", "-Wno-unknown-pragmas"]


def _build(text: str) -> ctypes.CDLL:
    key = hashlib.sha256("\0".join([*GCC, text]).encode()).hexdigest()[:16]  # (the flags too: a change rebuilds)
    folder = Path(tempfile.gettempdir()) / f"azyx-cuda-host-{os.getuid()}"
    folder.mkdir(exist_ok=True)
    lib = folder / f"{key}.so"
    if not lib.exists():
        cpp = folder / f"{key}.cpp"
        cpp.write_text(text)
        tmp = folder / f"{key}.{os.getpid()}.so"
        r = subprocess.run([*GCC, str(cpp), "-o", str(tmp), "-lm"], capture_output=True, text=True)
        assert r.returncode == 0, f"gcc failed on {cpp}:\n{r.stderr[-4000:]}"
        tmp.replace(lib)
    return ctypes.CDLL(str(lib))
