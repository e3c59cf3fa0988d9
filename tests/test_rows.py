"""Row kernels (issue 38 item 1: a decode step in as few kernels as the math allows): an elementwise kernel that reads
statistics of its own rows (a layernorm's mean and variance, a softmax's maximum and sum, an RMSNorm's mean square) is
one kernel on a GPU-style device (azyx.schedule: KernelBuild.row_statistic; a work group per row computes each
statistic, then its items walk the row), where it was a kernel per statistic and one for the outputs. Counted (the
plan's kernels) and checked against numpy on every device (a host device keeps its kernels), odd row counts and rows
that are no multiple of the work group included; the CUDA source of the same plans run on the host
(tests/cuda_host.py); a GPT-2 layer's decode step at batch 32 planned for CUDA, each layernorm one kernel."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
from test_attention_decode import as_stored, from_stored
from test_fusion import PassThrough, gpu_style
from test_gemv import DEV, run_on_host

import azyx
from azyx import Tensor, nn
from azyx.codegen.dialect import CUDA
from azyx.codegen.kernel import small_product

TOL = {"float32": 2e-5, "bfloat16": 2e-2, "float16": 4e-3}


def np_layernorm(x: np.ndarray, eps: float = 1e-5) -> np.ndarray:
    mu = x.mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + eps)


def np_softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def np_rmsnorm(x: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps)


def rmsnorm(x: Tensor) -> Tensor:
    """An RMSNorm written in azyx's ops (nn.RMSNorm is one too, with a weight)."""
    return x * (x.square().mean(-1, keepdim=True) + 1e-6).rsqrt()


def layer_norm(x: Tensor) -> Tensor:
    """nn.LayerNorm over the last axis, its weight and bias ones and zeros (as made)."""
    return nn.LayerNorm(x.shape[-1], dtype=x.dtype, device=x.device)(x)


OPS: dict[str, tuple[Callable[[Tensor], Tensor], Callable[[np.ndarray], np.ndarray]]] = {
    "layernorm": (lambda x: x.layernorm(), np_layernorm),
    "nn.LayerNorm": (layer_norm, np_layernorm),
    "softmax": (lambda x: x.softmax(-1), np_softmax),
    "rmsnorm": (rmsnorm, np_rmsnorm),
}
CASES = [("layernorm", 5, 768, "float32"), ("nn.LayerNorm", 3, 1000, "bfloat16"), ("softmax", 7, 1000, "float32"),
         ("softmax", 2, 4096, "float16"), ("rmsnorm", 1, 4096, "float32"), ("rmsnorm", 9, 768, "bfloat16"),
         ("layernorm", 3, 4096, "float16"), ("softmax", 4, 37, "float32")]


@pytest.mark.parametrize("op, rows, n, dtype", CASES)
async def test_a_row_statistic_is_one_kernel(device: str, op: str, rows: int, n: int, dtype: str) -> None:
    """A layernorm, nn.LayerNorm, softmax or RMSNorm of (rows, n): one row kernel on a GPU-style device (no row kernel
    on a host device, whose kernels stay as they were), equal to numpy on the rounded inputs."""
    fn, ref = OPS[op]
    stored, x = as_stored(np.random.default_rng(rows * n).standard_normal((rows, n)) * 3, dtype)
    t = Tensor(x.astype(np.float32), device=device).cast(dtype)
    await t.realize()
    out = fn(t)
    kernels = azyx.schedule(out).kernels
    if gpu_style(device):
        assert len(kernels) == 1 and kernels[0].kernel.rows
    else:
        assert len(kernels) > 1 and not any(s.kernel.rows for s in kernels)
    got = (await out.cast("float32").numpy()).astype(np.float64)
    np.testing.assert_allclose(got, ref(x), atol=TOL[dtype] * 4, rtol=TOL[dtype])


async def test_a_new_eps_is_a_new_value_not_a_new_kernel(device: str) -> None:
    """eps is a scalar argument of the row kernel: a layernorm with another one plans the same source, and each gives
    its own values."""
    x = np.random.default_rng(1).standard_normal((6, 300)).astype(np.float32) * 0.01
    t = Tensor(x, device=device)
    a, b = t.layernorm(eps=1e-5), t.layernorm(eps=1e-3)
    assert [s.src for s in azyx.schedule(a).kernels] == [s.src for s in azyx.schedule(b).kernels]
    np.testing.assert_allclose(await a.numpy(), np_layernorm(x.astype(np.float64), 1e-5), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(await b.numpy(), np_layernorm(x.astype(np.float64), 1e-3), rtol=1e-4, atol=1e-4)


async def test_a_statistic_read_along_the_row_is_no_row_kernel(device: str) -> None:
    """A column statistic (x - x.mean(0): the same down a column, not along a row) and a row longer than ROW_MAX keep
    their kernels of their own; values as numpy's."""
    rng = np.random.default_rng(2)
    x = rng.standard_normal((40, 24)).astype(np.float32)
    long = rng.standard_normal((2, 9000)).astype(np.float32)
    col = Tensor(x, device=device) - Tensor(x, device=device).mean(0)
    wide = Tensor(long, device=device).softmax(-1)
    for out in (col, wide):
        assert not any(s.kernel.rows for s in azyx.schedule(out).kernels)
    np.testing.assert_allclose(await col.numpy(), x - x.mean(0), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(await wide.numpy(), np_softmax(long.astype(np.float64)), rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("op, rows, n, dtype", [("layernorm", 5, 1000, "float32"), ("softmax", 3, 768, "bfloat16"),
                                                ("rmsnorm", 2, 4096, "float16"), ("affine", 1, 768, "float32"),
                                                ("softmax", 33, 20, "float32")])
def test_row_kernels_on_the_cuda_kernel(cuda_planning: None, op: str, rows: int, n: int, dtype: str) -> None:
    """The row kernel planned for CUDA (one; a block per row, or a warp per row of a short row) run on the host as
    CUDA runs it: equal to numpy. ("affine": a layernorm with a weight and a bias, as nn.LayerNorm's.)"""
    rng = np.random.default_rng(rows + n)
    stored, x = as_stored(rng.standard_normal((rows, n)) * 3, dtype)
    t = Tensor(x.astype(np.float32), dtype=dtype, device=DEV)
    data = {t.id: stored}
    if op == "affine":
        (gs, g), (bs, b) = as_stored(rng.standard_normal(n), dtype), as_stored(rng.standard_normal(n), dtype)
        tg, tb = (Tensor(v.astype(np.float32), dtype=dtype, device=DEV) for v in (g, b))
        data |= {tg.id: gs, tb.id: bs}
        out, want = t.layernorm() * tg + tb, np_layernorm(x) * g + b
    else:
        fn, ref = OPS[op]
        out, want = fn(t), ref(x)
    step, got = run_on_host(out, data, rows * n)
    assert step.kernel.rows
    np.testing.assert_allclose(from_stored(got, dtype).reshape(rows, n), want, atol=TOL[dtype] * 4, rtol=TOL[dtype])


@pytest.mark.parametrize("batch, rows, total", [(32, 2, 10), (4, 0, 4)])
def test_a_decode_steps_layernorms_are_a_kernel_each(cuda_planning: None, batch: int, rows: int, total: int) -> None:
    """A GPT-2 layer at decode time planned for CUDA (attention aside): at batch 32 ln_1 and ln_2 are one row kernel
    each (they were three kernels each: mean, variance, normalize; 14 kernels in all); at a few rows they stay in the
    small-M products' prologues (no row kernel, a kernel per linear layer)."""
    from azyx.models.gpt2 import Block, GPT2Config

    e = 96
    config = GPT2Config(n_layer=1, n_head=4, n_embd=e, vocab_size=64, n_positions=16)
    block = Block(config, 0, azyx.dtypes.bfloat16, DEV)
    for _, p in block.named_parameters():
        p.assign(Tensor(np.zeros(p.shape, np.float32), dtype="bfloat16", device=DEV))
    out = block(Tensor(np.zeros((batch, 1, e), np.float32), dtype="bfloat16", device=DEV), PassThrough())
    kernels = azyx.schedule(out).kernels
    assert sum(s.kernel.rows for s in kernels) == rows and len(kernels) == total
    if rows:  # (the statistics are in the row kernels: no other kernel reduces a row of e elements)
        assert all(small_product(s.kernel, CUDA) is None for s in kernels)


async def test_rows_of_a_higher_rank_tensor(device: str) -> None:
    """A layernorm over the last axis of a (3, 5, 200) tensor plus a residual, and a softmax over the last axis of a
    (2, 3, 40) one scaled: on a GPU-style device each one row kernel (its outer axes one loop of rows), as numpy."""
    rng = np.random.default_rng(3)
    x, r, s = (rng.standard_normal(shape).astype(np.float32) for shape in ((3, 5, 200), (3, 5, 200), (2, 3, 40)))
    outs = [Tensor(x, device=device).layernorm() + Tensor(r, device=device), (Tensor(s, device=device) * 0.5).softmax()]
    for out in outs:
        kernels = azyx.schedule(out).kernels
        assert not gpu_style(device) or (len(kernels) == 1 and kernels[0].kernel.rows)
    want = [np_layernorm(x.astype(np.float64)) + r, np_softmax(s.astype(np.float64) * 0.5)]
    for out, w in zip(outs, want):
        np.testing.assert_allclose(await out.numpy(), w, rtol=1e-4, atol=1e-5)
