"""The C backend's packed, cache-blocked matrix product (azyx.gemm_host): every layout, odd sizes, half storage,
batches, under an epilogue, each block-size variant and each micro-kernel width, all against numpy; and which products
take it (the rendered source says). OpenCL on a CPU (PoCL): its register-tiled template, likewise."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import azyx
from azyx import Tensor
from azyx.backends import c as c_backend
from azyx.codegen import kernel, search_actions
from azyx.codegen.dialect import BLOCKED
from azyx.codegen.launch import SHARED
from azyx.codegen.templates import gemm, gemm_host
from azyx.plan import KernelStep
from azyx.runtime import RT

DEV = "c:0"
TILE = "azyx_tile_"  # the micro-kernel's name in a rendered product
PRODUCT = "#define AZYX_HOST_GEMM"  # the template's helpers: in every product it renders, packed or skinny


def arr(*shape: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def kernels(*targets: Tensor) -> list[KernelStep]:
    return azyx.schedule(*targets).kernels


def products(*targets: Tensor) -> list[KernelStep]:
    return [s for s in kernels(*targets) if PRODUCT in s.src]


def close(got: np.ndarray, ref: np.ndarray, k: int, tol: float = 1e-5) -> None:
    """Equal up to float32 reassociation over a reduce of `k` terms (relative to the largest term's scale)."""
    scale = max(float(np.abs(ref).max()), 1.0)
    np.testing.assert_allclose(got, ref, rtol=0, atol=tol * scale * max(k, 1) ** 0.5 * 4)


@pytest.mark.parametrize("shape", [(16, 16, 16), (65, 129, 300), (129, 300, 65), (300, 65, 129), (17, 700, 33),
                                   (96, 513, 48)])
def test_every_layout_against_numpy(shape: tuple[int, int, int]) -> None:
    """A @ B, x @ W.T (W as stored), A.T @ B and A.T @ W.T, operands sliced out of larger tensors (offsets, row
    strides), one flipped (negative strides), and A @ A.T (one buffer, both operands): each the template, each numpy's
    product; K past a slice (700: three slices, each added into C)."""
    m, k, n = shape
    a, b, w, at = arr(m, k, seed=1), arr(k, n, seed=2), arr(n, k, seed=3), arr(k, m, seed=4)
    big = arr(m + 5, k + 9, seed=5)
    wide = arr(k + 3, 2 * n + 1, seed=6)
    ta, tb, tw, tat, tbig, twide = (Tensor(x, device=DEV) for x in (a, b, w, at, big, wide))
    outs = [ta @ tb, ta @ tw.T, tat.T @ tb, tat.T @ tw.T, tbig[3:3 + m, 5:5 + k] @ twide[2:2 + k, 1:1 + n],
            ta @ twide[1:1 + k, ::2][:, :n], ta.flip(1) @ tb, ta @ ta.T]
    refs = [a @ b, a @ w.T, at.T @ b, at.T @ w.T, big[3:3 + m, 5:5 + k] @ wide[2:2 + k, 1:1 + n],
            a @ wide[1:1 + k, ::2][:, :n], a[:, ::-1] @ b, a @ a.T]
    steps = products(*outs)
    assert len(steps) == len(outs)
    for s in steps:
        assert s.launch.parallel == SHARED and s.launch.trip >= 1
    for t, ref in zip(outs, refs):
        close(t.numpy_sync(), ref, k)


@pytest.mark.parametrize("dims", [(1, 7, 13), (7, 65, 129), (13, 1, 65), (129, 300, 1), (1, 1, 1), (15, 64, 200)])
def test_small_products_stay_on_the_generic_path_and_are_right(dims: tuple[int, int, int]) -> None:
    """Fewer than MIN_ROWS rows (a decode step's x @ W), columns or K: the generic kernel, still numpy's product;
    `x @ W.T` with W as stored takes the template from MIN_ROWS_TRANSPOSED rows (else W.T would be copied whole)."""
    m, k, n = dims
    a, b, w = arr(m, k), arr(k, n, seed=1), arr(n, k, seed=2)
    ta, tb, tw = (Tensor(x, device=DEV) for x in (a, b, w))
    assert products(ta @ tb) == []
    packed = m >= gemm_host.MIN_ROWS_TRANSPOSED and n >= gemm_host.MIN_COLS and k >= gemm_host.MIN_K
    assert len(products(ta @ tw.T)) == packed
    close((ta @ tb).numpy_sync(), a @ b, k)
    close((ta @ tw.T).numpy_sync(), a @ w.T, k)


def test_batched_products_and_broadcast_batch_axes() -> None:
    """Batches: (b, m, k) @ (b, k, n); a 2-D right operand broadcast over the batch (stride 0); attention's per-head
    products (B, H, T, D) @ (B, H, D, S), two batch axes that merge into one; K of q @ k^T along both operands' rows."""
    x, y = arr(3, 40, 70), arr(3, 70, 24, seed=1)
    w = arr(33, 70, seed=2)
    q, kk, v = arr(2, 4, 48, 32, seed=3), arr(2, 4, 48, 32, seed=4), arr(2, 4, 48, 32, seed=5)
    tx, ty, tw, tq, tk, tv = (Tensor(t, device=DEV) for t in (x, y, w, q, kk, v))
    scores = tq @ tk.transpose(-1, -2)
    outs = [tx @ ty, tx @ tw.T, scores, scores @ tv]
    refs = [x @ y, x @ w.T, q @ kk.swapaxes(-1, -2), (q @ kk.swapaxes(-1, -2)) @ v]
    steps = products(*outs)
    assert len(steps) == 4
    g = gemm.match(steps[2].kernel, BLOCKED)
    assert g is not None and (g.batch, g.m, g.n, g.k) == (8, 48, 48, 32)
    g = gemm.match(steps[1].kernel, BLOCKED)  # the weight shared by the batch: one product of its 3 x 40 rows
    assert g is not None and (g.batch, g.m, g.n, g.k) == (1, 120, 33, 70)
    for t, ref in zip(outs, refs):
        close(t.numpy_sync(), ref, 70)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_storage_computes_in_float32_and_rounds_once(dtype: str) -> None:
    """float16/bfloat16 operands widen to float32 as they are packed; C accumulates in float32 (K unsliced) and is
    rounded to the dtype once: numpy's float32 product of the rounded inputs, rounded."""
    m, k, n = 37, 1100, 45
    a, w = arr(m, k), arr(n, k, seed=1)
    ta, tw = (Tensor(x, device=DEV).cast(dtype) for x in (a, w))
    out = ta @ tw.T
    (step,) = products(out)
    g = gemm.match(step.kernel, BLOCKED)
    assert g is not None and g.dtype == dtype and gemm_host.blocks(g).kc == k
    ra, rw = ta.cast("float32").numpy_sync(), tw.cast("float32").numpy_sync()
    got = out.cast("float32").numpy_sync()
    ref = Tensor(ra @ rw.T, device=DEV).cast(dtype).cast("float32").numpy_sync()
    ulp = 2.0 ** (-10 if dtype == "float16" else -7)
    np.testing.assert_allclose(got, ref, rtol=ulp * 1.01, atol=1e-2)


def test_a_product_under_an_epilogue_is_a_kernel_of_its_own() -> None:
    """A Linear of many rows, bias and GELU: the product takes the template (a kernel of its own), the epilogue is
    another kernel; a product with K under 64 fuses into its consumer as the generic path does."""
    x, w, bias = arr(64, 256), arr(96, 256, seed=1), arr(96, seed=2)
    tx, tw, tb = (Tensor(t, device=DEV) for t in (x, w, bias))
    out = (tx @ tw.T + tb).gelu()
    steps = kernels(out)
    assert [TILE in s.src for s in steps] == [True, False]
    h = x @ w.T + bias
    ref = 0.5 * h * (1 + np.vectorize(__import__("math").erf)(h / np.sqrt(2)))
    close(out.numpy_sync(), ref.astype(np.float32), 256)
    short = (tx[:, :32] @ tw[:, :32].T + tb).relu()
    assert products(short) == []
    close(short.numpy_sync(), np.maximum(x[:, :32] @ w[:, :32].T + bias, 0), 32)


@pytest.fixture
def c1_dialect(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    RT.plan_cache.clear()
    yield
    RT.plan_cache.clear()


@pytest.mark.parametrize("simd", [16, 32, 64])
def test_other_vector_widths(simd: int, c1_dialect: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """The micro-kernels of 16-byte vectors (SSE, NEON: 6 x 8), AVX2 (6 x 16) and AVX-512 (12 x 32; gcc splits its
    vectors where the CPU has no AVX-512) give numpy's products too (c:1 made to render them); `x @ W.T` packs both
    operands (read along K) through transposes in vector registers."""
    dev = RT.device("c:1")
    monkeypatch.setattr(dev, "dialect", dataclasses.replace(dev.dialect, simd=simd))
    m, k, n = 77, 400, 70
    a, w, b = arr(m, k), arr(n, k, seed=1), arr(k, n, seed=2)
    ta, tw, tb = (Tensor(x, device="c:1") for x in (a, w, b))
    steps = products(ta @ tw.T, ta @ tb)
    mr, nr = gemm_host.HOST_BLOCKS[simd][0].mr, gemm_host.HOST_BLOCKS[simd][0].nr
    assert len(steps) == 2 and all(f"{TILE}{mr}x{nr}_{simd // 4}" in s.src for s in steps)
    assert "__builtin_shuffle" in steps[0].src
    close((ta @ tw.T).numpy_sync(), a @ w.T, k)
    close((ta @ tb).numpy_sync(), a @ b, k)
    few = Tensor(a[:4], device="c:1") @ tw.T  # the dot-product form of this width
    (step,) = products(few)
    assert TILE not in step.src and f"azyx_v{simd // 4}u" in step.src
    close(few.numpy_sync(), a[:4] @ w.T, k)


def test_blocks_cover_the_product_and_give_every_thread_parts() -> None:
    """Blocks are whole register tiles, cover C, and there are at least a few per thread where the product allows."""
    for (m, n, k, batch) in [(1024, 1024, 1024, 1), (128, 2304, 768, 1), (4096, 384, 1536, 1), (16, 16, 16, 1),
                             (128, 128, 64, 384), (17, 4000, 33, 1)]:
        for v in range(gemm_host.variants(32)):
            g = gemm.Gemm(m, n, k, batch, (1, 0, 0, k, 1), (2, 0, 0, n, 1), "c", "float32", 32, 2, v)
            bl = gemm_host.blocks(g)
            assert bl.mc % bl.mr == 0 and bl.nc % bl.nr == 0 and bl.kc <= k
            n_i, n_j = -(-m // bl.mc), -(-n // bl.nc)
            assert gemm_host.trip(g) == batch * n_i * n_j and (n_i - 1) * bl.mc < m and (n_j - 1) * bl.nc < n
            if m * n >= 8 * 4 * bl.mr * bl.nr:
                assert gemm_host.trip(g) >= gemm_host.PARTS_PER_THREAD * 2


def test_the_search_tries_block_sizes_and_each_gives_numpys_product(fresh_cache: Path) -> None:
    """The kernel search's candidates for a host product are its other block sizes (BLOCK), never register tiles;
    each renders its own kernel, and every one gives the default's result (the search rejects none); the winner, from
    the cache, still gives numpy's product."""
    m, k, n = 200, 900, 150
    a, w = arr(m, k), arr(n, k, seed=1)
    ta, tw = Tensor(a, device=DEV), Tensor(w, device=DEV)
    (step,) = products(ta @ tw.T)
    base = step.kernel.base or step.kernel
    dev = RT.device(DEV)
    cands = search_actions.candidates(base, dev.dialect, dev.search_actions, "thorough")
    block = search_actions.BLOCK
    assert cands == [(search_actions.Opt(block, 0, v),) for v in range(1, gemm_host.variants(dev.dialect.simd))]
    srcs = {dev.render_ir(search_actions.apply(base, c))[1] for c in cands} | {step.src}
    assert len(srcs) == len(cands) + 1 and all(TILE in s for s in srcs)
    (found,) = azyx.tune_sync(ta @ tw.T, level="quick")
    assert not found.cached and found.rejected == 0 and found.tried == len(cands) + 1
    RT.plan_cache.clear()  # (planned again: with the winner)
    (again,) = products(ta @ tw.T)
    assert again.src == dev.render_ir(search_actions.apply(base, found.winner))[1]
    close((ta @ tw.T).numpy_sync(), a @ w.T, k)


@pytest.mark.parametrize("dims", [(2, 384, 1536), (5, 67, 33), (12, 130, 17), (3, 16, 100)])
def test_a_few_rows_against_a_stored_weight_take_the_dot_product_form(dims: tuple[int, int, int]) -> None:
    """`x @ W.T` of 2 up to a register tile's rows (a short sequence through nn.Linear): W is read in place, each
    column of C dot products along K (no micro-kernel, no packing), with odd columns and a K that is no multiple of
    the vector; batch axes over one weight fold into the rows; x transposed (not contiguous along K) is packed."""
    m, k, n = dims
    x, w = arr(m, k), arr(n, k, seed=1)
    tx, tw = Tensor(x, device=DEV), Tensor(w, device=DEV)
    (step,) = products(tx @ tw.T)
    skinny = m <= gemm_host.HOST_BLOCKS[RT.device(DEV).dialect.simd][0].mr
    assert (TILE not in step.src) == skinny
    close((tx @ tw.T).numpy_sync(), x @ w.T, k)
    xb = arr(2, 1, k, seed=3)  # (2, 1, K): two rows of a batch against one weight
    (step,) = products(Tensor(xb, device=DEV) @ tw.T)
    assert TILE not in step.src
    close((Tensor(xb, device=DEV) @ tw.T).numpy_sync(), xb @ w.T, k)
    xt = arr(k, m, seed=4)
    (step,) = products(Tensor(xt, device=DEV).T @ tw.T)
    assert TILE in step.src
    close((Tensor(xt, device=DEV).T @ tw.T).numpy_sync(), xt.T @ w.T, k)


CL = "opencl:0"
needs_cl_cpu = pytest.mark.skipif(CL not in azyx.devices() or not RT.device(CL).dialect.gemm,
                                  reason="no OpenCL CPU device (PoCL)")


@needs_cl_cpu
@pytest.mark.parametrize("dims", [(64, 64, 64), (77, 65, 33), (100, 300, 250), (16, 1000, 17)])
def test_opencl_products_take_the_cpu_template_in_every_layout(dims: tuple[int, int, int]) -> None:
    """On PoCL a product of float32 operands is one work item per tile of C (a work group of one): A @ B, A.T @ B, a
    sliced and a flipped operand, a batch, a weight broadcast over the batch; `x @ W.T` copies W.T first (as the
    generic path does) and then takes it too; edge tiles of odd sizes store only C's own cells."""
    m, k, n = dims
    a, b, w, at = arr(m, k), arr(k, n, seed=1), arr(n, k, seed=2), arr(k, m, seed=3)
    big = arr(m + 3, k + 2, seed=4)
    ta, tb, tw, tat, tbig = (Tensor(x, device=CL) for x in (a, b, w, at, big))
    xb, yb = arr(3, m, k, seed=5), arr(3, k, n, seed=6)
    txb, tyb = Tensor(xb, device=CL), Tensor(yb, device=CL)
    outs = [ta @ tb, tat.T @ tb, tbig[2:2 + m, 1:1 + k] @ tb, ta.flip(1) @ tb, txb @ tyb, txb @ tb, ta @ tw.T]
    refs = [a @ b, at.T @ b, big[2:2 + m, 1:1 + k] @ b, a[:, ::-1] @ b, xb @ yb, xb @ b, a @ w.T]
    for t, ref in zip(outs, refs):
        steps = kernels(t)
        assert sum("reqd_work_group_size(1, 1, 1)" in s.src for s in steps) == 1, [s.src[:200] for s in steps]
        close(t.numpy_sync(), ref, k)


@needs_cl_cpu
def test_opencl_small_and_half_products_stay_generic() -> None:
    """Fewer than MIN_ROWS rows, or half operands: the generic OpenCL kernels, still numpy's products."""
    a, b = arr(5, 64), arr(64, 40, seed=1)
    ta, tb = Tensor(a, device=CL), Tensor(b, device=CL)
    assert not any("reqd_work_group_size" in s.src for s in kernels(ta @ tb))
    close((ta @ tb).numpy_sync(), a @ b, 64)
    h = ta.cast("float16") @ tb.cast("float16")
    assert not any("reqd_work_group_size" in s.src for s in kernels(Tensor(arr(32, 64), device=CL).cast("float16")
                                                                     @ tb.cast("float16")))
    np.testing.assert_allclose(h.cast("float32").numpy_sync(), a @ b, rtol=2e-2, atol=2e-2 * 8)



# bfloat16 products: AVX-512 BF16 (vdpbf16ps) where the device has it, else widened to float32 as packed ---------------

DOT = "_mm512_dpbf16_ps"
HAS_BF16_DOT = "avx512_bf16" in c_backend._cpu()["isa"].split() and RT.device(DEV).dialect.bf16_dot


def bf16(x: np.ndarray) -> np.ndarray:
    """float32 rounded to bfloat16's values (to nearest, ties to even), as float32."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return (((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16).astype(np.uint32).view(np.float32)


def bf16_close(got: np.ndarray, ref: np.ndarray, k: int) -> None:
    """`got` equals float32 products of bfloat16-rounded inputs (`ref`, exact: float64) rounded to bfloat16, within
    one bfloat16 rounding (2^-8 relative, either way: float32 accumulation may land on the other side of a tie)
    and float32 reassociation (near zero)."""
    want = bf16(ref.astype(np.float32))
    scale = max(float(np.abs(ref).max()), 1.0)
    np.testing.assert_allclose(got, want, rtol=2.0 ** -7 * 1.01, atol=1e-6 * scale * max(k, 1) ** 0.5 * 4)


@pytest.fixture(params=[("c:0", True), ("c:0", False), ("c:1", True), ("c:1", False)],
                ids=["c0-dot", "c0-widen", "c1-dot", "c1-widen"])
def bf16_device(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A C device rendering bfloat16 products with AVX-512 BF16 (where this CPU has it) or on the widening path (its
    dialect made to lack it: what a CPU without avx512_bf16 renders)."""
    name, dot = request.param
    if dot and not HAS_BF16_DOT:
        pytest.skip("this CPU (or compiler) has no AVX-512 BF16")
    dev = RT.device(name)
    RT.plan_cache.clear()
    monkeypatch.setattr(dev, "dialect", dataclasses.replace(dev.dialect, bf16_dot=dot))
    yield name
    RT.plan_cache.clear()


@pytest.mark.parametrize("shape", [(16, 16, 16), (65, 301, 129), (37, 1101, 45), (129, 17, 300), (300, 64, 33),
                                   (16, 384, 1536), (128, 384, 1536), (97, 513, 80)])
def test_bfloat16_products_in_every_layout(shape: tuple[int, int, int], bf16_device: str) -> None:
    """bfloat16 A @ B, x @ W.T (W as nn.Linear stores it), A.T @ B, operands sliced at odd offsets and strided, a
    flipped operand, one buffer as both operands, batches (a weight broadcast over a (B, T, C) activation too): each
    the product of its rounded inputs in float32, rounded once; odd K pads its last pair with zero; the path the
    device renders (the intrinsic) is the one its dialect says."""
    m, k, n = shape
    dev = bf16_device
    a, b, w, at = (bf16(arr(*s, seed=i)) for i, s in enumerate([(m, k), (k, n), (n, k), (k, m)]))
    big, wide = bf16(arr(m + 5, k + 9, seed=5)), bf16(arr(k + 3, 2 * n + 1, seed=6))
    xb, yb = bf16(arr(3, m, k, seed=7)), bf16(arr(3, k, n, seed=8))
    ta, tb, tw, tat, tbig, twide, txb, tyb = (Tensor(x, device=dev).cast("bfloat16")
                                              for x in (a, b, w, at, big, wide, xb, yb))
    outs = [ta @ tb, ta @ tw.T, tat.T @ tb, tbig[3:3 + m, 5:5 + k] @ twide[1:1 + k, 1:1 + n],
            ta @ twide[2:2 + k, ::2][:, :n], tbig[3:3 + m, 5:5 + k] @ tw.T, ta.flip(1) @ tb, ta @ ta.T,
            txb @ tyb, txb @ tw.T]
    f64 = np.float64
    refs = [a.astype(f64) @ b, a.astype(f64) @ w.T, at.T.astype(f64) @ b,
            big[3:3 + m, 5:5 + k].astype(f64) @ wide[1:1 + k, 1:1 + n], a.astype(f64) @ wide[2:2 + k, ::2][:, :n],
            big[3:3 + m, 5:5 + k].astype(f64) @ w.T, a[:, ::-1].astype(f64) @ b, a.astype(f64) @ a.T,
            xb.astype(f64) @ yb, xb.astype(f64) @ w.T]
    steps = [s for s in kernels(*outs) if PRODUCT in s.src]
    assert len(steps) == len(outs)
    assert all((DOT in s.src) == RT.device(dev).dialect.bf16_dot for s in steps)
    for t, ref in zip(outs, refs):  # (realized first: a cast after it would fuse into a generic kernel)
        assert t.dtype.name == "bfloat16"
        bf16_close(t.realize_sync().cast("float32").numpy_sync(), ref, k)


@pytest.mark.parametrize("rows", [2, 5, 12])
def test_a_few_bfloat16_rows_against_a_stored_weight(rows: int, bf16_device: str) -> None:
    """`x @ W.T` of a short sequence (nn.Linear, bfloat16 activations and weights) takes the packed template from 2
    rows (bfloat16 has no dot-product form), batch axes folded into its rows: the rounded float32 product."""
    k, n = 385, 130
    x, xb, w = bf16(arr(rows, k)), bf16(arr(2, rows, k, seed=1)), bf16(arr(n, k, seed=2))
    tx, txb, tw = (Tensor(v, device=bf16_device).cast("bfloat16").realize_sync() for v in (x, xb, w))
    for out, ref in [(tx @ tw.T, x.astype(np.float64) @ w.T), (txb @ tw.T, xb.astype(np.float64) @ w.T)]:
        (step,) = products(out)
        assert TILE in step.src and (DOT in step.src) == RT.device(bf16_device).dialect.bf16_dot
        bf16_close(out.realize_sync().cast("float32").numpy_sync(), ref, k)


def test_bfloat16_products_match_torch(bf16_device: str) -> None:
    """The same products as PyTorch's CPU bfloat16 matmul (x @ y, and x @ W.T of nn.Linear), within one bfloat16
    rounding of each other."""
    torch = pytest.importorskip("torch")
    for m, k, n in [(64, 384, 1536), (33, 129, 70)]:
        x, y, w = bf16(arr(m, k)), bf16(arr(k, n, seed=1)), bf16(arr(n, k, seed=2))
        tx, ty, tw = (Tensor(v, device=bf16_device).cast("bfloat16") for v in (x, y, w))
        hx, hy, hw = (torch.from_numpy(v).bfloat16() for v in (x, y, w))
        for got, want in [(tx @ ty, hx @ hy), (tx @ tw.T, hx @ hw.T)]:
            bf16_close(got.realize_sync().cast("float32").numpy_sync(), want.float().numpy().astype(np.float64), k)


@pytest.mark.skipif(not HAS_BF16_DOT, reason="this CPU (or compiler) has no AVX-512 BF16")
def test_avx512_bf16_is_taken_where_the_cpu_has_it() -> None:
    """On a CPU with avx512_bf16 (gcc -march=native defines __AVX512BF16__), c:0's bfloat16 products (x @ y, x @ W.T)
    multiply with vdpbf16ps; float16 and float32 products do not; the device identity (winner caches) says so."""
    dev = RT.device(DEV)
    assert dev.identity()["bf16_dot"] is True and "avx512_bf16" in dev.identity()["isa"].split()
    x, y, w = arr(40, 200), arr(200, 48, seed=1), arr(48, 200, seed=2)
    tx, ty, tw = (Tensor(v, device=DEV) for v in (x, y, w))
    for out in [tx.cast("bfloat16") @ ty.cast("bfloat16"), tx.cast("bfloat16") @ tw.cast("bfloat16").T]:
        (step,) = products(out)
        assert DOT in step.src and "#include <immintrin.h>" in step.src
    for dt in ("float16", "float32"):
        (step,) = products(tx.cast(dt) @ ty.cast(dt))
        assert DOT not in step.src


def test_without_avx512_bf16_the_widening_path_is_rendered(monkeypatch: pytest.MonkeyPatch) -> None:
    """A device whose CPU flags lack avx512_bf16, whose flags do not ask for the CPU's own ISA, or whose compiler is
    told not to target it, renders bfloat16 products on the widening path (bfloat16 widened to float32 as packed),
    which any x86-64 or ARM compiler builds; its identity differs from one with the dot product."""
    isa = c_backend._cpu()["isa"]
    native = ["-O3", "-march=native"]
    without = " ".join(f for f in isa.split() if f != "avx512_bf16")
    assert not c_backend.bf16_dot(without, native)
    assert not c_backend.bf16_dot(isa + " avx512_bf16 avx512f", ["-O3"])
    assert not c_backend.bf16_dot(isa + " avx512_bf16 avx512f", [*native, "-mno-avx512bf16"])
    assert c_backend.bf16_dot(isa, native) == HAS_BF16_DOT
    dev = RT.device(DEV)
    x, w = Tensor(arr(40, 201), device=DEV).cast("bfloat16"), Tensor(arr(48, 201, seed=1), device=DEV).cast("bfloat16")
    (step,) = products(x @ w.T)
    base = step.kernel.base or step.kernel
    plain = dataclasses.replace(dev.dialect, bf16_dot=False)
    _, src, _ = kernel.render_kernel(base, plain, dev.threads)
    assert DOT not in src and "immintrin" not in src and "bf2f(" in src and TILE in src
    with_dot = dev.identity()
    monkeypatch.setattr(dev, "dialect", plain)
    assert dev.identity() != with_dot or not HAS_BF16_DOT
