"""float16 and bfloat16 matrix products on a CUDA GPU's tensor cores (azyx.gemm.render_mma; on compute capability 9.0
the wgmma kernel of azyx.gemm_sm90 where a product fits it), against PyTorch's
`torch.matmul` in the same dtype on the same GPU (cuBLAS: float32 accumulation, C rounded once). Every layout the
kernel reads (A @ B, x @ W.T with W as stored, A.T @ B, A.T @ W.T), batched and broadcast products, sizes that are no
multiple of the tiles (17 x 65 x 33: element loads, guarded edges) and sizes that take the 16-byte copies. Runs where a
GPU and PyTorch with CUDA are present (the lent H100/H200); tests/test_cuda_compile.py checks the rendering without
one."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import azyx
from azyx import Tensor

GPUS = [d for d in azyx.devices() if d.startswith("cuda:")]
pytestmark = pytest.mark.skipif(not GPUS, reason="no CUDA device")
torch = pytest.importorskip("torch")
if not torch.cuda.is_available():  # pragma: no cover - depends on the machine
    pytest.skip("PyTorch has no CUDA", allow_module_level=True)

# cuBLAS accumulates in float32 throughout (no reduced-precision split-K reductions): the reference azyx matches
torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False
torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
EPS = {"float16": 2.0**-10, "bfloat16": 2.0**-7}  # a unit in the last place of C's dtype, relative


async def pair(shape: tuple[int, ...], dtype: str, seed: int) -> tuple[Tensor, Any]:
    """The same values as an azyx tensor on cuda:0 and a PyTorch tensor on its GPU, both rounded from float32 to
    `dtype` on the device (to nearest, ties to even: the same bits). Realized: a product of a pending cast would fuse
    the cast and read float32."""
    x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    t = Tensor(x, device="cuda:0").cast(dtype)
    await t.realize()
    return t, torch.from_numpy(x).to("cuda:0").to(getattr(torch, dtype))


async def check(out: Tensor, want: Any, k: int, dtype: str, mma: bool = True) -> None:
    """`out` computed by a tensor-core kernel (`mma`: mma.sync or wgmma; else a product of one row: a fused reduce, as
    PyTorch takes a GEMV), and within a couple of units in the last place of C's dtype of PyTorch's (C's entries are
    about sqrt(K) in size: the absolute tolerance scales with it)."""
    srcs = [s.src for s in azyx.schedule(out).kernels]
    took = any("mma.sync.aligned.m16n8k16" in s or "wgmma.mma_async" in s for s in srcs)
    assert took == mma, "the product did not take the tensor-core kernel" if mma else "a single row took tensor cores"
    await out.realize()
    got = await out.cast("float32").numpy()
    ref = want.float().cpu().numpy()
    assert got.shape == ref.shape
    eps = EPS[dtype]
    np.testing.assert_allclose(got, ref, rtol=2 * eps, atol=2 * eps * np.sqrt(k))
    assert np.linalg.norm(got - ref) <= 2 * eps * np.linalg.norm(ref) + 1e-6


LAYOUTS: dict[str, Callable[[Any, Any, Any, Any], Any]] = {  # (a, at, b, w) -> the product, for azyx and torch alike
    "a@b": lambda a, at, b, w: a @ b,
    "a@w.T": lambda a, at, b, w: a @ w.T,  # nn.Linear: the weight as stored, (out, in)
    "at.T@b": lambda a, at, b, w: at.T @ b,
    "at.T@w.T": lambda a, at, b, w: at.T @ w.T,
}


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("shape", [(17, 65, 33), (1, 40, 8), (64, 96, 48), (100, 37, 250), (256, 512, 384),
                                   (1000, 1024, 520), (2048, 2048, 2048)])
async def test_matmul_on_tensor_cores_matches_torch(dtype: str, layout: str, shape: tuple[int, int, int]) -> None:
    m, k, n = shape
    (a, ta), (at, tat), (b, tb), (w, tw) = [await pair(s, dtype, i) for i, s in enumerate([(m, k), (k, m), (k, n),
                                                                                         (n, k)])]
    f = LAYOUTS[layout]
    await check(f(a, at, b, w), f(ta, tat, tb, tw), k, dtype, mma=m > 1)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
async def test_batched_and_broadcast_products_match_torch(dtype: str) -> None:
    (x, tx), (y, ty), (w, tw) = [await pair(s, dtype, i) for i, s in enumerate([(3, 100, 72), (3, 72, 40), (40, 72)])]
    await check(x @ y, tx @ ty, 72, dtype)
    await check(x @ w.T, tx @ tw.T, 72, dtype)  # a Linear over a batch of sequences: W shared by every batch entry
    (q, tq), (kk, tk) = await pair((2, 4, 128, 64), dtype, 4), await pair((2, 4, 128, 64), dtype, 5)
    await check(q @ kk.transpose(-1, -2), tq @ tk.transpose(-1, -2), 64, dtype)  # attention scores, per head
    (p, tp), (v, tv) = await pair((8, 33, 17), dtype, 6), await pair((8, 17, 65), dtype, 7)
    await check(p @ v, tp @ tv, 17, dtype)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
async def test_views_with_offsets_and_odd_strides_match_torch(dtype: str) -> None:
    """Operands that are slices of larger tensors: an offset that is no multiple of 8 elements and row strides that
    are (16-byte copies) or are not (element loads)."""
    (big, tbig), (wb, twb) = await pair((300, 200), dtype, 8), await pair((150, 130), dtype, 9)
    a, ta = big[3:259, 5:133], tbig[3:259, 5:133]  # offset 3 * 200 + 5, row stride 200
    b, tb = wb[:128, :96], twb[:128, :96]  # row stride 130: not a multiple of 8
    await check(a @ b, ta @ tb, 128, dtype)
    await check(big[8:136, :128] @ big[:128, 64:192], tbig[8:136, :128] @ tbig[:128, 64:192], 128, dtype)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
async def test_hopper_products_take_wgmma_and_match_torch(dtype: str) -> None:
    """On compute capability 9.0, products that fit gemm_sm90 run its wgmma kernel: A @ B (B's N contiguous) and
    x @ W.T (K contiguous) with 128 x 128 tiles (few tiles) and 128 x 256 (more tiles than multiprocessors: a block
    walks several), and views at aligned offsets with row strides other than their widths."""
    if torch.cuda.get_device_capability(0) != (9, 0):
        pytest.skip("not a compute capability 9.0 GPU")
    (a, ta), (b, tb), (w, tw) = [await pair(s, dtype, 20 + i) for i, s in enumerate([(256, 1024), (1024, 384),
                                                                                      (384, 1024)])]
    (x, tx), (y, ty), (v, tv), (big, tbig) = [await pair(s, dtype, 30 + i) for i, s in
                                              enumerate([(4096, 192), (192, 4096), (4096, 192), (520, 1024)])]
    cases = [(a @ b, ta @ tb, 1024), (a @ w.T, ta @ tw.T, 1024), (x @ y, tx @ ty, 192), (x @ v.T, tx @ tv.T, 192),
             (big[8:264, :512] @ big[:512, 128:512], tbig[8:264, :512] @ tbig[:512, 128:512], 512)]
    for out, want, k in cases:
        srcs = [s.src for s in azyx.schedule(out).kernels]
        assert any("wgmma.mma_async" in s for s in srcs), "the product did not take the wgmma kernel"
        await check(out, want, k, dtype)


async def test_a_large_product_against_float64() -> None:
    """4096^3 in bfloat16 against a float64 product of the same rounded inputs, on the GPU: float32 accumulation
    keeps C within a unit or two of bfloat16 (a bfloat16 accumulation would be far off)."""
    (a, ta), (b, tb) = await pair((4096, 4096), "bfloat16", 10), await pair((4096, 4096), "bfloat16", 11)
    out = a @ b
    await out.realize()
    got = torch.from_numpy(await out.cast("float32").numpy()).to("cuda:0").double()
    ref = ta.double() @ tb.double()
    err = float(((got - ref).norm() / ref.norm()).item())
    assert err < 2 * EPS["bfloat16"], err


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
async def test_linear_with_bias_and_activation_matches_torch(dtype: str) -> None:
    """nn.Linear's x @ W.T + b with a ReLU after it: the product runs on the tensor cores as a kernel of its own (C
    rounded to the dtype, as PyTorch's matmul rounds it), the bias and the activation read it."""
    (x, tx), (w, tw), (b, tb) = await pair((256, 512), dtype, 12), await pair((384, 512), dtype, 13), \
        await pair((384,), dtype, 14)
    await check((x @ w.T + b).relu(), torch.relu(tx @ tw.T + tb), 512, dtype)
    (h, th) = await pair((4, 100, 512), dtype, 15)
    await check(h @ w.T + b, th @ tw.T + tb, 512, dtype)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("layout", ["a@b", "a@w.T"])
@pytest.mark.parametrize("shape", [(32, 768, 768), (32, 768, 2304), (64, 3072, 768), (33, 387, 72), (17, 768, 3072)])
async def test_small_m_products_split_over_k_match_torch(dtype: str, layout: str, shape: tuple[int, int, int]) -> None:
    """Decode's linear layers at 17-64 rows (issue 38): K split over blocks (gemm.split_k from the GPU's
    multiprocessors), the tensor-core kernel storing float32 partial sums, the sum and the one rounding in the
    consumer's kernel; alone and under GELU and a residual, against PyTorch."""
    m, k, n = shape
    (a, ta), (b, tb), (w, tw), (bias, tbias), (r, tr) = [
        await pair(s, dtype, 20 + i) for i, s in enumerate([(m, k), (k, n), (n, k), (n,), (m, n)])]
    f = LAYOUTS[layout]
    out = f(a, None, b, w)
    srcs = [s.src for s in azyx.schedule(out).kernels]
    assert any("mma.sync" in s and "float* __restrict__ C" in s for s in srcs), "the product was not split over K"
    await check(out, f(ta, None, tb, tw), k, dtype)
    gelu = torch.nn.functional.gelu
    await check((f(a, None, b, w) + bias).gelu(approximate="tanh") + r,
                gelu(f(ta, None, tb, tw) + tbias, approximate="tanh") + tr, k, dtype)
