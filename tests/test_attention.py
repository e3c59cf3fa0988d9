"""Attention and the transformer layers of azyx.nn on every test device: `scaled_dot_product_attention` against a
numpy reference (and PyTorch's `F.scaled_dot_product_attention` where torch is installed) with bool and float masks,
causal, odd lengths, broadcast batch axes, a custom scale, head dims 32/64/80 and float16/bfloat16 inputs; on devices
whose dialect has the attention kernel (azyx.attention) it is one kernel with no (L, S) buffer, elsewhere the composed
form; a new scale compiles nothing; gradients match PyTorch's; bad shapes raise; `MultiheadAttention` loads PyTorch's
state dict and gives its outputs and weights; GELU, SiLU and RMSNorm."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

import azyx
from azyx import GradientTape, Tensor, nn
from azyx.errors import ArgumentError, ShapeError
from azyx.graph import GRAPH
from azyx.ir import attention_of
from azyx.runtime import RT

try:
    import torch
    import torch.nn.functional as F
except ImportError:
    torch = None  # type: ignore[assignment]
    F = None  # type: ignore[assignment]

needs_torch = pytest.mark.skipif(torch is None, reason="torch is not importable (pip install torch==2.13.0)")
rng = np.random.default_rng(11)


def randn(*shape: int) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)


def sdpa_ref(q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray | None = None, causal: bool = False,
             scale: float | None = None) -> np.ndarray:
    s = (q.astype(np.float64) @ np.swapaxes(k, -1, -2)) * (1 / math.sqrt(q.shape[-1]) if scale is None else scale)
    if causal:
        mask = np.tril(np.ones((q.shape[-2], k.shape[-2]), bool))
    if mask is not None:
        s = np.where(mask, s, -np.inf) if mask.dtype == bool else s + mask
    with np.errstate(invalid="ignore"):
        e = np.exp(s - s.max(-1, keepdims=True))
        return (e / e.sum(-1, keepdims=True)) @ v


CASES = [  # (q shape, k shape, v shape)
    ((2, 3, 7, 8), (2, 3, 11, 8), (2, 3, 11, 5)),  # odd lengths, Ev != E
    ((4, 16, 16), (4, 16, 16), (4, 16, 16)),
    ((2, 1, 5, 4), (1, 3, 6, 4), (1, 3, 6, 4)),  # batch axes broadcast
    ((9, 8), (9, 8), (9, 8)),
]


@pytest.mark.parametrize("shapes", CASES)
async def test_attention_matches_numpy(device: str, shapes: tuple[tuple[int, ...], ...]) -> None:
    q, k, v = (randn(*s) for s in shapes)
    tq, tk, tv = (Tensor(x, device=device) for x in (q, k, v))
    got = await nn.scaled_dot_product_attention(tq, tk, tv).numpy()
    np.testing.assert_allclose(got, sdpa_ref(q, k, v), rtol=1e-4, atol=1e-5)
    L, S = q.shape[-2], k.shape[-2]
    if L <= S:  # (every query row keeps a key)
        got = await nn.scaled_dot_product_attention(tq, tk, tv, causal=True).numpy()
        np.testing.assert_allclose(got, sdpa_ref(q, k, v, causal=True), rtol=1e-4, atol=1e-5)
    keep = rng.random((L, S)) < 0.7
    keep[:, 0] = True
    got = await nn.scaled_dot_product_attention(tq, tk, tv, mask=Tensor(keep, device=device)).numpy()
    np.testing.assert_allclose(got, sdpa_ref(q, k, v, keep), rtol=1e-4, atol=1e-5)
    bias = randn(L, S)
    got = await nn.scaled_dot_product_attention(tq, tk, tv, mask=Tensor(bias, device=device), scale=0.3).numpy()
    np.testing.assert_allclose(got, sdpa_ref(q, k, v, bias, scale=0.3), rtol=1e-4, atol=1e-5)


async def test_a_new_scale_compiles_nothing(device: str) -> None:
    q, k, v = randn(2, 6, 4), randn(2, 9, 4), randn(2, 9, 4)
    tq, tk, tv = (Tensor(x, device=device) for x in (q, k, v))
    for _ in range(2):  # (the first run may upload host data to the device: the second plans as all later)
        await nn.scaled_dot_product_attention(tq, tk, tv, scale=0.3).numpy()
    plans, compiled = len(RT.plan_cache), RT.compiled
    for scale in (0.1, 0.25, 0.7, 1.3):
        got = await nn.scaled_dot_product_attention(tq, tk, tv, scale=scale).numpy()
        np.testing.assert_allclose(got, sdpa_ref(q, k, v, scale=scale), rtol=1e-4, atol=1e-5)
    assert (len(RT.plan_cache), RT.compiled) == (plans, compiled), "a new scale compiled a kernel"


async def test_a_fully_masked_row_is_nan_as_in_pytorch(device: str) -> None:
    q, k, v = randn(3, 4), randn(5, 4), randn(5, 2)
    keep = np.ones((3, 5), bool)
    keep[1] = False
    got = await nn.scaled_dot_product_attention(*(Tensor(x, device=device) for x in (q, k, v)),
                                                mask=Tensor(keep, device=device)).numpy()
    assert np.isnan(got[1]).all()
    np.testing.assert_allclose(got[[0, 2]], sdpa_ref(q, k, v, keep)[[0, 2]], rtol=1e-4, atol=1e-5)


async def test_attention_gradients_against_finite_differences() -> None:
    q, k, v = (randn(2, 3, 4).astype(np.float64) for _ in range(3))
    tq, tk, tv = (Tensor(x) for x in (q, k, v))
    w = randn(2, 3, 4).astype(np.float64)
    with GradientTape() as tape:
        loss = (nn.scaled_dot_product_attention(tq, tk, tv, causal=True) * Tensor(w)).sum()
    grads = [await g.numpy() for g in tape.gradient(loss, [tq, tk, tv])]

    def f(qq: np.ndarray, kk: np.ndarray, vv: np.ndarray) -> float:
        return float((sdpa_ref(qq, kk, vv, causal=True) * w).sum())

    for i, g in enumerate(grads):
        args = [q, k, v]
        num = np.zeros_like(args[i])
        for idx in np.ndindex(*num.shape):
            plus, minus = [a.copy() for a in args], [a.copy() for a in args]
            plus[i][idx] += 1e-6
            minus[i][idx] -= 1e-6
            num[idx] = (f(*plus) - f(*minus)) / 2e-6
        np.testing.assert_allclose(g, num, rtol=1e-5, atol=1e-7)


def test_bad_attention_inputs_raise() -> None:
    q, k = Tensor(randn(3, 4)), Tensor(randn(5, 4))
    with pytest.raises(ShapeError, match=r"\(3, 4\)"):
        nn.scaled_dot_product_attention(q, Tensor(randn(5, 3)), k)
    with pytest.raises(ShapeError, match="6 keys"):
        nn.scaled_dot_product_attention(q, k, Tensor(randn(6, 4)))
    with pytest.raises(ArgumentError, match="not both"):
        nn.scaled_dot_product_attention(q, k, k, mask=Tensor(np.ones((3, 5), bool)), causal=True)
    with pytest.raises(ArgumentError, match="num_heads=3"):
        nn.MultiheadAttention(8, 3)


@needs_torch
@pytest.mark.parametrize("causal", [False, True])
async def test_attention_matches_pytorch(device: str, causal: bool) -> None:
    q, k, v = randn(2, 4, 33, 16), randn(2, 4, 33, 16), randn(2, 4, 33, 16)
    want = F.scaled_dot_product_attention(*(torch.from_numpy(x) for x in (q, k, v)), is_causal=causal).numpy()
    got = await nn.scaled_dot_product_attention(*(Tensor(x, device=device) for x in (q, k, v)), causal=causal).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


FUSED_CASES = [  # (q shape, k shape, v shape): lengths around the kernels' blocks, L != S, head dims 32/64/80
    ((2, 3, 129, 64), (2, 3, 77, 64), (2, 3, 77, 64)),
    ((1, 2, 1, 32), (1, 2, 129, 32), (1, 2, 129, 32)),  # one query row
    ((3, 7, 80), (3, 130, 80), (3, 130, 80)),
    ((2, 1, 50, 32), (1, 3, 66, 32), (1, 3, 66, 48)),  # batch axes broadcast, Ev != E
]


def fused_here(device: str) -> bool:
    dl = RT.device(device).dialect
    return dl is not None and dl.attention


def mask_for(mode: str, lq: int, lk: int) -> np.ndarray | None:
    if mode == "bool":  # (1, L, S): broadcast over the batch axes; every row keeps a key
        keep = rng.random((1, lq, lk)) < 0.6
        keep[..., 0] = True
        return keep
    return randn(lq, lk) if mode == "float" else None


@pytest.mark.parametrize("mode", ["none", "causal", "bool", "float"])
@pytest.mark.parametrize("shapes", FUSED_CASES)
async def test_attention_fused_against_numpy_and_pytorch(device: str, shapes: tuple[tuple[int, ...], ...],
                                                         mode: str) -> None:
    q, k, v = (randn(*s) for s in shapes)
    mask = mask_for(mode, q.shape[-2], k.shape[-2])
    scale = 0.3 if mode == "float" else None
    got = await nn.scaled_dot_product_attention(*(Tensor(x, device=device) for x in (q, k, v)), causal=mode == "causal",
                                                mask=None if mask is None else Tensor(mask, device=device),
                                                scale=scale).numpy()
    np.testing.assert_allclose(got, sdpa_ref(q, k, v, mask, mode == "causal", scale), rtol=1e-4, atol=2e-5)
    if torch is not None:
        want = F.scaled_dot_product_attention(*(torch.from_numpy(x) for x in (q, k, v)), is_causal=mode == "causal",
                                              attn_mask=None if mask is None else torch.from_numpy(mask), scale=scale)
        np.testing.assert_allclose(got, want.numpy(), rtol=1e-4, atol=2e-5)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
async def test_half_attention_against_pytorch(device: str, dtype: str) -> None:
    shapes = ((2, 4, 65, 64), (2, 4, 70, 64), (2, 4, 70, 64))
    keep = rng.random((65, 70)) < 0.7
    keep[:, 0] = True
    halves = [Tensor(randn(*s), device=device).cast(dtype) for s in shapes]
    exact = [(await t.cast("float32").numpy()) for t in halves]  # the inputs as rounded to the half dtype
    for kw in ({}, {"causal": True}, {"mask": keep}):
        mask = kw.get("mask")
        out = nn.scaled_dot_product_attention(*halves, causal=bool(kw.get("causal")),
                                              mask=None if mask is None else Tensor(mask, device=device))
        assert out.dtype.name == dtype
        got = await out.cast("float32").numpy()
        want = sdpa_ref(*exact, mask, bool(kw.get("causal")))
        if torch is not None:
            ref = F.scaled_dot_product_attention(*(torch.from_numpy(x).to(getattr(torch, dtype)) for x in exact),
                                                 is_causal=bool(kw.get("causal")),
                                                 attn_mask=None if mask is None else torch.from_numpy(mask))
            np.testing.assert_allclose(ref.float().numpy(), want, atol=3e-2)  # (torch's own rounding)
        # fused: float32 throughout, rounded once; composed: each step rounded to the half dtype
        tol = (2e-3 if dtype == "float16" else 1e-2) if fused_here(device) else 6e-2
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
async def test_half_attention_of_long_heads_and_unaligned_views(device: str, dtype: str) -> None:
    """Heads of 128 (past the float32 CUDA kernel's tiles: the tensor-core kernel alone takes them) and q, k, v as
    views whose rows start at odd elements (copied first where the kernel reads rows 16 bytes at a time)."""
    big = Tensor(randn(2, 4, 70, 136), device=device).cast(dtype)
    await big.realize()
    exact = await big.cast("float32").numpy()
    for causal in (False, True):
        q, k, v = big[..., :128], big[..., 8:136], big[..., 1:129]
        got = await nn.scaled_dot_product_attention(q, k, v, causal=causal).cast("float32").numpy()
        want = sdpa_ref(exact[..., :128], exact[..., 8:136], exact[..., 1:129], None, causal)
        tol = (2e-3 if dtype == "float16" else 1e-2) if fused_here(device) else 6e-2
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol)


@pytest.mark.parametrize("mode", ["none", "causal", "bool", "float"])
async def test_fused_attention_is_one_kernel_without_a_score_buffer(device: str, mode: str) -> None:
    b, h, lq, lk, e = 2, 4, 96, 80, 32
    q, k, v = randn(b, h, lq, e), randn(b, h, lk, e), randn(b, h, lk, e)
    mask = mask_for(mode, lq, lk)
    tq, tk, tv = (Tensor(x, device=device) for x in (q, k, v))
    tm = None if mask is None else Tensor(mask, device=device)
    out = nn.scaled_dot_product_attention(tq, tk, tv, mask=tm, causal=mode == "causal")
    plan = azyx.schedule(out)  # (the inputs are still host data: moved to the device whole, the mask not per head)
    scores = b * h * lq * lk * 4
    if fused_here(device):
        assert len(plan.kernels) == 1 and attention_of(plan.kernels[0].kernel) is not None, plan.describe()
        assert len(GRAPH[out.id].src) == 4 + (mask is not None), "no tape records: no composed form was built"
        assert max(s.nbytes for s in plan.slots) < scores, plan.describe()
    else:  # the composed form: scores, softmax, product
        assert len(plan.kernels) >= 3 and attention_of(plan.kernels[0].kernel) is None
    np.testing.assert_allclose(await out.numpy(), sdpa_ref(q, k, v, mask, mode == "causal"), rtol=1e-4, atol=2e-5)


async def test_fused_attention_reads_projected_heads_in_place(device: str) -> None:
    """q, k, v as a model makes them, views of one projection ((N, L, 3, H, E) permuted): the kernel reads them through
    their strides (no copies), and the output feeds the next product."""
    n, lq, h, e = 2, 33, 4, 16
    x, w = randn(n, lq, h * e), randn(3 * h * e, h * e) * 0.2
    qkv = (Tensor(x, device=device) @ Tensor(w, device=device).T).reshape(n, lq, 3, h, e).permute(2, 0, 3, 1, 4)
    out = nn.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], causal=True).transpose(1, 2).reshape(n, lq, h * e)
    y = out @ Tensor(w[: h * e], device=device)
    ref_qkv = (x @ w.T).reshape(n, lq, 3, h, e).transpose(2, 0, 3, 1, 4)
    ref = sdpa_ref(*ref_qkv, causal=True).transpose(0, 2, 1, 3).reshape(n, lq, h * e) @ w[: h * e]
    np.testing.assert_allclose(await y.numpy(), ref, rtol=1e-4, atol=1e-4)


async def test_a_new_scale_of_the_fused_kernel_compiles_nothing(device: str) -> None:
    q, k, v = randn(2, 3, 40, 32), randn(2, 3, 50, 32), randn(2, 3, 50, 32)
    keep = rng.random((40, 50)) < 0.7
    keep[:, 0] = True
    tq, tk, tv, tm = (Tensor(x, device=device) for x in (q, k, v, keep))
    for _ in range(2):
        await nn.scaled_dot_product_attention(tq, tk, tv, mask=tm, scale=0.3).numpy()
    plans, compiled = len(RT.plan_cache), RT.compiled
    for scale in (0.05, 0.2, 1.1):
        got = await nn.scaled_dot_product_attention(tq, tk, tv, mask=tm, scale=scale).numpy()
        np.testing.assert_allclose(got, sdpa_ref(q, k, v, keep, scale=scale), rtol=1e-4, atol=2e-5)
    assert (len(RT.plan_cache), RT.compiled) == (plans, compiled), "a new scale compiled a kernel"


async def test_a_jitted_attention_replays_with_a_new_scale(device: str) -> None:
    @azyx.jit
    def f(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
        return nn.scaled_dot_product_attention(q, k, v, causal=True, scale=scale)

    q, k, v = randn(2, 20, 16), randn(2, 20, 16), randn(2, 20, 16)
    tq, tk, tv = (Tensor(x, device=device) for x in (q, k, v))
    compiled = 0
    for i, scale in enumerate((0.25, 0.5, 0.9, 1.1)):
        got = await (await f(tq, tk, tv, scale)).numpy()
        np.testing.assert_allclose(got, sdpa_ref(q, k, v, causal=True, scale=scale), rtol=1e-4, atol=2e-5)
        if i == 1:  # (a device that the host data moves to plans its first run apart: the second is as all later)
            compiled = RT.compiled
    assert f.replays >= 2 and RT.compiled == compiled  # the scale is a traced scalar: no new trace, no compile


@needs_torch
@pytest.mark.parametrize("mode", ["causal", "float"])
async def test_attention_gradients_match_pytorch(device: str, mode: str) -> None:
    q, k, v = randn(2, 3, 9, 16), randn(2, 3, 11, 16), randn(2, 3, 11, 8)
    w = randn(2, 3, 9, 8)
    bias = randn(9, 11) if mode == "float" else None
    tq, tk, tv = (Tensor(x, device=device) for x in (q, k, v))
    with GradientTape() as tape:
        out = nn.scaled_dot_product_attention(tq, tk, tv, causal=mode == "causal", scale=0.4,
                                              mask=None if bias is None else Tensor(bias, device=device))
        loss = (out * Tensor(w, device=device)).sum()
    grads = [await g.numpy() for g in tape.gradient(loss, [tq, tk, tv])]
    pq, pk, pv = (torch.from_numpy(x).requires_grad_() for x in (q, k, v))
    ref = F.scaled_dot_product_attention(pq, pk, pv, is_causal=mode == "causal", scale=0.4,
                                         attn_mask=None if bias is None else torch.from_numpy(bias))
    (ref * torch.from_numpy(w)).sum().backward()
    np.testing.assert_allclose(await out.numpy(), ref.detach().numpy(), rtol=1e-4, atol=2e-5)
    for g, p in zip(grads, (pq, pk, pv)):
        np.testing.assert_allclose(g, p.grad.numpy(), rtol=1e-4, atol=2e-5)


@needs_torch
@pytest.mark.parametrize("batch_first", [False, True])
async def test_multihead_attention_loads_pytorch_state_and_matches(device: str, batch_first: bool) -> None:
    torch.manual_seed(0)
    ref = torch.nn.MultiheadAttention(16, 4, batch_first=batch_first)
    with torch.no_grad():  # (PyTorch zeroes the biases: give them values)
        ref.in_proj_bias.normal_()
        ref.out_proj.bias.normal_()
    mine = nn.MultiheadAttention(16, 4, batch_first=batch_first, device=device)
    mine.load_state_dict({n: t.detach().numpy() for n, t in ref.state_dict().items()})
    shape_q, shape_k = ((3, 5, 16), (3, 7, 16)) if batch_first else ((5, 3, 16), (7, 3, 16))
    x, mem = randn(*shape_q), randn(*shape_k)
    pad = np.zeros((3, 7), bool)
    pad[1, 5:] = True  # the last keys of the second sequence are padding
    want, want_w = ref(torch.from_numpy(x), torch.from_numpy(mem), torch.from_numpy(mem),
                       key_padding_mask=torch.from_numpy(pad))
    got, got_w = mine(Tensor(x, device=device), Tensor(mem, device=device), Tensor(mem, device=device),
                      key_padding_mask=Tensor(pad, device=device))
    assert got_w is not None
    np.testing.assert_allclose(await got.numpy(), want.detach().numpy(), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(await got_w.numpy(), want_w.detach().numpy(), rtol=1e-4, atol=1e-5)
    causal = torch.nn.Transformer.generate_square_subsequent_mask(5)
    want, _ = ref(*(torch.from_numpy(x),) * 3, attn_mask=causal, need_weights=False)
    got, none = mine(*(Tensor(x, device=device),) * 3, attn_mask=Tensor(causal.numpy(), device=device),
                     need_weights=False)
    assert none is None
    np.testing.assert_allclose(await got.numpy(), want.detach().numpy(), rtol=1e-4, atol=1e-5)


async def test_gelu_silu_rmsnorm_layers(device: str) -> None:
    x = randn(4, 6) * 3
    t = Tensor(x, device=device)
    erf = np.vectorize(math.erf)
    np.testing.assert_allclose(await nn.GELU()(t).numpy(), x * 0.5 * (1 + erf(x / math.sqrt(2))), rtol=1e-5,
                               atol=1e-6)
    tanh_form = 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))
    np.testing.assert_allclose(await nn.GELU("tanh")(t).numpy(), tanh_form, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(await nn.SiLU()(t).numpy(), x / (1 + np.exp(-x)), rtol=1e-5, atol=1e-6)
    norm = nn.RMSNorm(6, device=device)
    norm.weight = Tensor(randn(6), device=device)
    want = x / np.sqrt((x * x).mean(-1, keepdims=True) + np.finfo(np.float32).eps) * (await norm.weight.numpy())
    np.testing.assert_allclose(await norm(t).numpy(), want, rtol=1e-5, atol=1e-6)
    with pytest.raises(ShapeError, match=r"\(4, 5\)"):
        nn.RMSNorm(6)(Tensor(randn(4, 5)))
    with pytest.raises(ArgumentError, match="'exact'"):
        nn.GELU("exact")
    if torch is not None:
        ref = torch.nn.RMSNorm(6, eps=1e-3)
        with torch.no_grad():
            ref.weight.normal_()
        mine = nn.RMSNorm(6, eps=1e-3, device=device)
        mine.load_state_dict({"weight": ref.weight.detach().numpy()})
        np.testing.assert_allclose(await mine(t).numpy(), ref(torch.from_numpy(x)).detach().numpy(), rtol=1e-5,
                                   atol=1e-6)


@pytest.mark.parametrize("simd", [32, 64])
async def test_the_c_kernel_of_each_vector_width(simd: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The C kernel's 8-lane (AVX2) and 16-lane (AVX-512) forms both give the reference, with every mask kind and odd
    lengths (c:1 made to render each: gcc splits 16-lane vectors where the CPU has no AVX-512)."""
    dev = RT.device("c:1")
    monkeypatch.setattr(dev, "dialect", dataclasses.replace(dev.dialect, simd=simd))
    RT.plan_cache.clear()
    try:
        q, k, v = randn(2, 3, 77, 64), randn(2, 3, 131, 64), randn(2, 3, 131, 40)
        for mode in ("none", "causal", "bool", "float"):
            mask = mask_for(mode, 77, 131)
            out = nn.scaled_dot_product_attention(*(Tensor(x, device="c:1") for x in (q, k, v)),
                                                  causal=mode == "causal",
                                                  mask=None if mask is None else Tensor(mask, device="c:1"))
            (step,) = azyx.schedule(out).kernels
            assert f"azyx_v{simd // 4} c00" in step.src
            np.testing.assert_allclose(await out.numpy(), sdpa_ref(q, k, v, mask, mode == "causal"), rtol=1e-4,
                                       atol=2e-5)
    finally:
        RT.plan_cache.clear()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_the_tensor_core_kernel_tiles_and_compiles(dtype: str) -> None:
    """The CUDA tensor-core kernel takes 32 query rows per warp (blocks of 128) where there are blocks enough to fill
    an H100, else 16; the grid of 64-row blocks covers its blocks (numbered flat) either way; its two stages fit the
    99 KiB of shared memory every GPU of compute capability 8.0 on gives a block (dynamic past 48 KiB: heads of 128);
    and it compiles (NVRTC, sm_90, where installed) with each mask kind, causal, odd lengths,
    E != Ev and both row counts."""
    from azyx.codegen.dialect import CUDA
    from azyx.codegen.render import kernel_source
    from azyx.codegen.templates import attention, attention_cuda
    from azyx.dtypes import dtypes
    from azyx.ir import Attention

    def spec(b: int, h: int, lq: int, lk: int, e: int, ev: int, causal: bool = False, mask: str | None = None
             ) -> Attention:
        return Attention((b, h), lq, lk, e, ev, (0, h * lq * e, lq * e, e, 1), (0, h * lk * e, lk * e, e, 1),
                         (0, h * lk * ev, lk * ev, ev, 1), (0, 0, 0, lk, 1) if mask else None, mask == "bool", causal)

    assert attention_cuda.mma_tiles(spec(8, 8, 1024, 1024, 64, 64)) == (32, 64)
    assert attention_cuda.mma_tiles(spec(1, 8, 128, 128, 64, 64)) == (16, 64)  # (8 blocks of 128 rows: too few)
    long_heads = spec(1, 12, 8192, 8192, 128, 128)  # (64 keys a tile: two stages in dynamic shared memory)
    assert attention_cuda.mma_tiles(long_heads) == (16, 64) and attention_cuda.mma_smem_bytes(long_heads) > 48 << 10
    assert attention_cuda.mma_smem_bytes(spec(8, 8, 1024, 1024, 64, 64)) == 0
    half = getattr(dtypes, dtype)
    sources = []
    for a in (spec(8, 8, 1024, 1024, 64, 64, True), spec(8, 8, 1000, 77, 64, 64, mask="bool"), long_heads,
              spec(1, 8, 129, 131, 64, 64, mask="float"), spec(64, 4, 100, 66, 32, 48, True),
              spec(2, 3, 129, 77, 64, 64)):
        wm, bk = attention_cuda.mma_tiles(a)
        grid = attention.cuda_grid(a)
        assert attention_cuda.mma_units(a, wm) <= grid[0] * grid[1] * grid[2]
        assert 2 * attention_cuda._mma_smem(a, wm, bk)[2] <= attention_cuda.MMA_SMEM
        params = [half] * 4 + ([] if a.mask is None else [dtypes.bool if a.mask_bool else half])
        sources.append(attention_cuda.render_mma(a, f"attention{len(sources)}", CUDA, params, "sc0"))
    try:
        from cuda.bindings import nvrtc

        from azyx.backends.cuda_driver import nvrtc_compile

        nvrtc.nvrtcVersion()
    except Exception as e:  # (no cuda-bindings, or no NVRTC library)
        pytest.skip(f"NVRTC unavailable: {e}")
    assert nvrtc_compile(kernel_source(sources, CUDA), "sm_90")[:4] == b"\x7fELF"  # (a cubin is an ELF image)
