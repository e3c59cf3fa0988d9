"""The tensor-core product kernel (gemm_cuda.render_mma) run on the host by an emulator of what it does: its rendered
source is read statement by statement (block order, each thread's copies into shared memory, the ldmatrix address
each lane gives, the mma calls, the guarded stores of C), and ldmatrix and mma.sync.m16n8k16 act as the PTX ISA
defines their fragments. Integer-valued operands make every product exact, so C must equal numpy's exactly. This
checks the kernel's index arithmetic and fragment layouts without a GPU (tests/test_cuda_tensor_cores.py runs it on
one); NVRTC's compile is tests/test_cuda_compile.py's."""

from __future__ import annotations

import functools
import re
from dataclasses import replace
from typing import Any

import numpy as np
import pytest

from azyx.codegen.dialect import WARP_TILES
from azyx.codegen.templates import gemm, gemm_cuda

# ------------------------------------------------------------------------------------------------ C -> Python


@functools.cache
def py(expr: str) -> Any:
    """An integer C expression of the kernel (casts, /, &&, ?:, min/max) as compiled Python."""
    e = expr.replace("(long long)", "").replace("LL", "").replace("(unsigned short)", "").replace("&&", " and ")
    e = re.sub(r"(?<![/])/(?![/])", "//", e)
    m = re.fullmatch(r"(.*?) \? (.*) : (.*)", e)
    if m:
        e = f"(({m[2]}) if ({m[1]}) else ({m[3]}))"
    return compile(e, "<kernel>", "eval")


def run(code: Any, env: dict[str, int]) -> int:
    return int(eval(code, {"min": min, "max": max}, env))


def split_top(s: str) -> list[str]:
    """`a = x, b = y` at its top-level commas."""
    out, depth, cur = [], 0, ""
    for ch in s:
        depth += ch in "([" and 1 or 0
        depth -= ch in ")]" and 1 or 0
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    return [*out, cur.strip()]


# ------------------------------------------------------------------------------------------------ PTX semantics


def ldmatrix(sh: np.ndarray, addr: list[tuple[int, int]], trans: bool) -> list[list[tuple[float, float]]]:
    """ldmatrix.sync.aligned.m8n8.x4(.trans).b16: lanes 8q..8q+7 give the rows of matrix q (8 elements from each
    address); lane t receives, of each matrix, row t/4's elements 2(t%4) and +1 (with .trans: column t/4's)."""
    mats = [np.array([sh[r, c:c + 8] for r, c in addr[8 * q:8 * q + 8]]) for q in range(4)]
    for mat in mats:
        assert mat.shape == (8, 8)
    regs = []
    for t in range(32):
        g, c = t // 4, 2 * (t % 4)
        regs.append([(mq[c, g], mq[c + 1, g]) if trans else (mq[g, c], mq[g, c + 1]) for mq in mats])
    return regs


def mma(acc: list[list[float]], a: list[list[tuple[float, float]]], b: list[list[tuple[float, float]]]) -> None:
    """mma.sync.aligned.m16n8k16.row.col: lane t (group g = t/4, c = 2(t%4)) holds A's (g, c..c+1), (g+8, c..),
    (g, c+8..), (g+8, c+8..), B's (k c..c+1, n g), (k c+8.., n g), and C's (g, c..c+1), (g+8, c..c+1)."""
    am, bm = np.zeros((16, 16)), np.zeros((16, 8))
    for t in range(32):
        g, c = t // 4, 2 * (t % 4)
        for q, (r, k) in enumerate([(g, c), (g + 8, c), (g, c + 8), (g + 8, c + 8)]):
            am[r, k:k + 2] = a[t][q]
        for q, k in enumerate([c, c + 8]):
            bm[k:k + 2, g] = b[t][q]
    d = am @ bm
    for t in range(32):
        g, c = t // 4, 2 * (t % 4)
        acc[t][0] += d[g, c]
        acc[t][1] += d[g, c + 1]
        acc[t][2] += d[g + 8, c]
        acc[t][3] += d[g + 8, c + 1]


# ------------------------------------------------------------------------------------------------ the kernel


def assign(decls: str, env: dict[str, int]) -> dict[str, int]:
    """`env` with the kernel's `a = x, b = y` declarations evaluated in order."""
    for d in split_top(decls.replace("blockIdx.x", "blockIdx_x").replace("blockIdx.y", "blockIdx_y")):
        name, e = d.split(" = ", 1)
        env[name] = run(py(e), env)
    return env


LOOP = re.compile(r"for \(int q = 0; q < (\d+); q\+\+\) \{ const int e = tid \+ q \* (\d+), (.*?); (.*?) \}\n")
COPY = re.compile(r"const int b = (.*); azyx_cp16\(azyx_smem\(&(\w)s\[(\w+)\]\[row\]\[(.*)\]\), "
                  r"b \? \w \+ (.*) : \w, b\);")
FETCH = re.compile(r"r(\w)\[q\] = (.*) \? (\w)\[(.*)\] : \(unsigned short\)0;")
PUT = re.compile(r"(\w)s\[(\w+)\]\[row\]\[(.*)\] = r(\w)\[q\];")


class Kernel:
    """The statements of a rendered tensor-core kernel that decide where data goes."""

    def __init__(self, src: str, g: gemm.Gemm):
        body = src.split("__global__", 1)[1]
        self.g = g
        self.shared = {m[1]: (int(m[2]), int(m[3]), int(m[4]))
                       for m in re.finditer(r"unsigned short (\w)s\[(\d)\]\[(\d+)\]\[(\d+)\];", body)}
        self.warp = re.search(r"const int tid = threadIdx.x, lane = tid & 31, (.*);", body)[1]  # type: ignore[index]
        self.block = (re.search(r"const int (id = .*);\n", body)[1] + ", "  # type: ignore[index]
                      + re.search(r"const int (bi = .*);\n", body)[1])  # type: ignore[index]
        self.bases = {m[1]: (int(m[2]), int(m[3]), int(m[4])) for m in re.finditer(
            r"const unsigned short\* (\w) = d(\d) \+ (-?\d+)LL \+ bz \* (-?\d+)LL;", body)}
        head, loop = body.split("int s = 0;", 1)
        # before the loop: the first slices (k1) into their stages; in it, the copies of slice k1 ahead into stage sn,
        # the products of stage s, then the element loads' puts into stage sn
        self.first = [(int(m[1]), LOOP.findall(m[2] + "\n")) for m in re.finditer(
            r"\{ const int k1 = (\d+);\n(.*?) \}\n  asm volatile", head, re.S)]
        parts = loop.split("if (more) {")
        self.fetches, self.puts = LOOP.findall(parts[1]), LOOP.findall(parts[2]) if len(parts) > 2 else []
        ahead = re.search(r"const int (sn = .*), k1 = k0 \+ (\d+);", loop)
        assert ahead is not None
        self.sn, self.ahead = ahead[1], int(ahead[2])
        self.next_s = re.search(r"\n    (s = .*);\n  \}", loop)[1]  # type: ignore[index]
        self.frags = re.findall(r"\{ const int r = (.*?), c = (.*?); azyx_ldm4(t?)\(f(\w)\[(\d+)\], "
                                r"azyx_smem\(&\ws\[s\]\[r\]\[(.*?)\]\)\); \}", body)
        assert "acc[m][n], fa[m], &fb[n >> 1][(n & 1) * 2]" in body
        acc = re.search(r"float acc\[(\d+)\]\[(\d+)\]\[4\];", body)
        assert acc is not None
        self.mi, self.ni = int(acc[1]), int(acc[2])
        self.ij = re.search(r"const int (i = .*), (j = .*);\n", body)[0][len("const int "):-2]  # type: ignore[index]
        self.pair = "*(unsigned*)" in body or "*(float2*)" in body

    def copy(self, loops: list, env0: dict[str, int], sh: dict[str, np.ndarray], regs: dict, mem: dict) -> None:
        """Every thread's copies of `loops` (of the slice at env0's k1: cp.async into shared memory at once, element
        loads into registers, puts from registers)."""
        origin = {mat: off + env0["bz"] * sb for mat, (_, off, sb) in self.bases.items()}
        for rounds, step, pos, stmt in loops:
            for tid in range(self.g.threads):
                for q in range(int(rounds)):
                    env = assign(pos, {**env0, "tid": tid, "q": q, "e": tid + q * int(step)})
                    if cp := COPY.fullmatch(stmt):  # cp.async of 16 bytes, zero-filled past its first b bytes
                        mat, nbytes, stage, col = cp[2], run(py(cp[1]), env), run(py(cp[3]), env), run(py(cp[4]), env)
                        at = origin[mat] + run(py(cp[5]), env)
                        for u in range(8):
                            sh[mat][stage, env["row"], col + u] = \
                                mem[self.bases[mat][0]][at + u] if 2 * u < nbytes else 0.0
                    elif ld := FETCH.fullmatch(stmt):
                        mat = ld[3]
                        at = origin[mat] + run(py(ld[4]), env)
                        regs[(mat, tid, q)] = mem[self.bases[mat][0]][at] if run(py(ld[2]), env) else 0.0
                    elif put := PUT.fullmatch(stmt):
                        sh[put[1]][run(py(put[2]), env), env["row"], run(py(put[3]), env)] = regs[(put[1], tid, q)]
                    else:
                        raise AssertionError(stmt)

    def lanes(self, w: int, env0: dict[str, int]) -> list[dict[str, int]]:
        return [assign(self.warp, {**env0, "tid": 32 * w + lane, "lane": lane}) for lane in range(32)]

    def multiply(self, sh: dict[str, np.ndarray], accs: dict[int, list], env0: dict[str, int]) -> None:
        """Every warp's ldmatrix fragments of the slice and its mma products into its accumulators."""
        for w in accs:
            lanes = self.lanes(w, env0)
            for ks in range(0, gemm.MMA_BK, 16):
                fr = {}
                for row, col, trans, mat, idx, at in self.frags:  # each lane's shared row r, its chunk's place
                    rc = [assign(f"r = {row}, c = {col}", {**e, "ks": ks}) for e in lanes]
                    addr = [(x["r"], run(py(at), x)) for x in rc]
                    fr[(mat, int(idx))] = ldmatrix(sh[mat.upper()], addr, trans == "t")
                for m in range(self.mi):
                    for n in range(self.ni):
                        b = [list(fr[("b", n >> 1)][t][(n & 1) * 2:(n & 1) * 2 + 2]) for t in range(32)]
                        mma(accs[w][m * self.ni + n], fr[("a", m)], b)

    def store(self, accs: dict[int, list], env0: dict[str, int], c_out: np.ndarray) -> None:
        """The guarded stores of each lane's accumulators into C."""
        g = self.g
        for w in accs:
            for lane, env in enumerate(self.lanes(w, env0)):
                for m in range(self.mi):
                    for n in range(self.ni):
                        for h in range(2):
                            e = assign(self.ij, {**env, "m": m, "n": n, "h": h})
                            i, j, c = e["i"], e["j"], accs[w][m * self.ni + n][lane][2 * h:2 * h + 2]
                            for u in range(2):
                                if i < g.m and ((j < g.n) if self.pair else (j + u < g.n)):  # a pair: N and j even
                                    at = env0["bz"] * g.m * g.n + i * g.n + j + u
                                    assert np.isnan(c_out[at]), "two threads store one element of C"
                                    c_out[at] = c[u]


def emulate(src: str, g: gemm.Gemm, mem: dict[int, np.ndarray], blocks: list[tuple[int, int, int]]) -> np.ndarray:
    """C (flat, NaN where no block of `blocks` wrote) from the kernel source `src`, with parameter i's memory mem[i].
    The K loop runs in program order over the stages in shared memory, each phase for all threads at once (a cp.async
    lands at once: what the waits and barriers are for is not checked, which stage each slice goes through is)."""
    k = Kernel(src, g)
    c_out = np.full(g.batch * g.m * g.n, np.nan)
    for bx, by, bz in blocks:
        env0 = assign(k.block, {"bz": bz, "blockIdx_x": bx, "blockIdx_y": by})
        accs = {w: [[[0.0] * 4 for _ in range(32)] for _ in range(k.mi * k.ni)] for w in range(g.threads // 32)}
        sh = {m: np.full(shape, np.nan) for m, shape in k.shared.items()}
        regs: dict = {}
        for k1, loops in k.first:
            k.copy(loops, {**env0, "k1": k1}, sh, regs, mem)
        s = 0
        for k0 in range(0, g.k, gemm.MMA_BK):
            env = {**env0, "s": s, "k0": k0, "k1": k0 + k.ahead}
            env["sn"] = run(py(k.sn.split(" = ", 1)[1]), env)
            if env["k1"] < g.k:
                k.copy(k.fetches, env, sh, regs, mem)
            k.multiply({m: x[s] for m, x in sh.items()}, accs, env0)
            if env["k1"] < g.k:
                k.copy(k.puts, env, sh, regs, mem)
            s = run(py(k.next_s.split(" = ", 1)[1]), env)
        k.store(accs, env0, c_out)
    return c_out


CASES = {  # name: (m, k, n, batch, A's strides (b, i, r), B's strides (b, r, j), offsets)
    "a@b odd": (33, 65, 17, 1, (0, 65, 1), (0, 17, 1), (0, 0)),
    "a@w.T odd": (33, 65, 17, 1, (0, 65, 1), (0, 1, 65), (0, 0)),
    "at.T@b odd": (33, 65, 17, 1, (0, 1, 33), (0, 17, 1), (0, 0)),
    "a@b aligned": (72, 48, 80, 1, (0, 48, 1), (0, 80, 1), (0, 0)),
    "a@w.T aligned": (72, 48, 80, 1, (0, 48, 1), (0, 1, 48), (0, 0)),
    "at.T@b aligned": (72, 48, 80, 1, (0, 1, 72), (0, 80, 1), (0, 0)),
    "at.T@w.T aligned": (72, 48, 80, 1, (0, 1, 72), (0, 1, 48), (0, 0)),
    "batched, offsets": (40, 40, 24, 3, (1600, 40, 1), (960, 24, 1), (8, 16)),
    "broadcast B, ragged K": (24, 44, 16, 2, (1056, 48, 1), (0, 1, 48), (0, 0)),
    # (products of 64 rows or fewer take Gemm.stages deep pipelines: 16 slices through 8 stages, then 6)
    "a@w.T long K": (16, 488, 24, 1, (0, 488, 1), (0, 1, 488), (0, 0)),
    "at.T@b long K, odd": (17, 457, 9, 1, (0, 1, 17), (0, 9, 1), (0, 0)),
    "a@b long K, 64 rows": (40, 457, 24, 1, (0, 457, 1), (0, 24, 1), (0, 0)),
}


def operands(case: tuple) -> tuple[gemm.Gemm, dict[int, np.ndarray], np.ndarray]:
    """The product of a case, the memory of its operands (small integers) and numpy's C."""
    m, k, n, batch, (a_sb, a_si, a_sk), (b_sb, b_sk, b_sj), (a_off, b_off) = case
    g = gemm.Gemm(m, n, k, batch, (1, a_off, a_sb, a_si, a_sk), (2, b_off, b_sb, b_sk, b_sj), WARP_TILES, "bfloat16")
    rng = np.random.default_rng(0)
    size = lambda off, sb, s1, s2, e1, e2: off + (batch - 1) * sb + (e1 - 1) * s1 + (e2 - 1) * s2 + 1 + 8  # noqa: E731
    mem = {1: rng.integers(-3, 4, size(a_off, a_sb, a_si, a_sk, m, k)).astype(np.float64),
           2: rng.integers(-3, 4, size(b_off, b_sb, b_sk, b_sj, k, n)).astype(np.float64)}
    ib, ii, ir = np.ix_(range(batch), range(m), range(k))
    a = mem[1][a_off + ib * a_sb + ii * a_si + ir * a_sk]
    jb, jr, jj = np.ix_(range(batch), range(k), range(n))
    b = mem[2][b_off + jb * b_sb + jr * b_sk + jj * b_sj]
    return g, mem, (a @ b).reshape(-1)


@pytest.mark.parametrize("case", list(CASES))
def test_the_tensor_core_kernel_emulated_equals_numpy(case: str) -> None:
    g, mem, want = operands(CASES[case])
    assert g.tile == ((32, 64) if g.m <= 32 else (64, 64))
    gx, gy, gz = g.grid()
    blocks = [(x, y, z) for z in range(gz) for y in range(gy) for x in range(gx)]
    got = emulate(gemm_cuda.render_mma(g, "k"), g, mem, blocks)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("layout", [((0, 40, 1), (0, 1536, 1)), ((0, 1, 1576), (0, 1, 40))])
def test_the_large_tile_kernel_emulated_equals_numpy(layout: tuple) -> None:
    """128 x 128 tiles of 8 warps (a product of 13 x 12 of them): the first block, one in the middle and the last
    (partial) one; and every block writes a tile of its own (the grouped block order is a permutation)."""
    g, mem, want = operands((1576, 40, 1536, 1, *layout, (0, 0)))
    assert g.tile == (128, 128) and g.threads == 256
    gx, gy, _ = g.grid()
    got = emulate(gemm_cuda.render_mma(g, "k"), g, mem, [(0, 0, 0), (5, 7, 0), (gx - 1, gy - 1, 0)])
    done = ~np.isnan(got)
    assert done.sum() == 2 * 128 * 128 + 40 * 128
    np.testing.assert_array_equal(got[done], want[done])
    block = Kernel(gemm_cuda.render_mma(g, "k"), g).block
    tiles = set()
    for y in range(gy):
        for x in range(gx):
            env = assign(block, {"blockIdx_x": x, "blockIdx_y": y})
            tiles.add((env["bi"], env["bj"]))
    assert tiles == {(i * 128, j * 128) for i in range(gy) for j in range(gx)}


@pytest.mark.parametrize("dtype, m, k, n, parts, transposed", [
    ("bfloat16", 1, 192, 40, 3, False), ("float16", 16, 256, 24, 4, True), ("bfloat16", 17, 99, 24, 3, False),
    ("float16", 17, 99, 24, 3, True), ("bfloat16", 32, 384, 72, 3, True), ("float16", 33, 160, 17, 5, False),
    ("bfloat16", 64, 129, 64, 3, True), ("float16", 64, 256, 40, 2, False)])
def test_a_product_split_over_k_sums_to_numpy(dtype: str, m: int, k: int, n: int, parts: int,
                                              transposed: bool) -> None:
    """The split form of `x @ W` / `x @ W.T` (gemm.split_k; schedule.Planner.split_product): K in `parts` parts, a
    batch element each, A's and B's batch strides a part of K; the kernel stores float32 partial sums (Gemm.out:
    float C, no rounding), whose sum over the parts is numpy's product, as the unsplit kernel's C is. Odd parts of K
    (99 / 3, 129 / 3: element loads), ragged M (17, 33) and N (17), M = 1..64."""
    kp = k // parts
    b_strides = (kp, 1, k) if transposed else (kp * n, n, 1)
    rng = np.random.default_rng(m + k + n)
    mem = {1: rng.integers(-3, 4, m * k + 8).astype(np.float64), 2: rng.integers(-3, 4, k * n + 8).astype(np.float64)}
    a = mem[1][:m * k].reshape(m, k)
    w = mem[2][:k * n].reshape(n, k).T if transposed else mem[2][:k * n].reshape(k, n)
    split = gemm.Gemm(m, n, kp, parts, (1, 0, kp, k, 1), (2, 0, *b_strides), WARP_TILES, dtype, out="float32")
    whole = replace(split, k=k, batch=1, out="")
    for g in (split, whole):
        assert g.tile == ((32, 64) if m <= 32 else (64, 64)) and g.split[0] == 1
        src = gemm_cuda.render_mma(g, "k")
        assert ("float* __restrict__ C" in src) == (g is split)
        gx, gy, gz = g.grid()
        assert gz == g.batch
        got = emulate(src, g, mem, [(x, y, z) for z in range(gz) for y in range(gy) for x in range(gx)])
        np.testing.assert_array_equal(got.reshape(g.batch, m, n).sum(0), a @ w)


@pytest.mark.parametrize("case", ["a@b odd", "a@w.T odd", "at.T@b odd", "at.T@w.T aligned", "batched, offsets"])
def test_the_32_row_tile_emulated_equals_numpy(case: str) -> None:
    """The 32 x 64 tile (gemm.MMA_TILES: 4 warps of 32 x 16; a product of 32 rows or fewer takes it, any other as a
    searched variant), its rows of 64 bytes swizzled in every layout (A's outer-major rows too)."""
    g, mem, want = operands(CASES[case])
    g = replace(g, variant=gemm.MMA_TILES.index((32, 64)) + 1)
    assert g.tile == (32, 64) and g.threads == 128
    gx, gy, gz = g.grid()
    blocks = [(x, y, z) for z in range(gz) for y in range(gy) for x in range(gx)]
    np.testing.assert_array_equal(emulate(gemm_cuda.render_mma(g, "k"), g, mem, blocks), want)
