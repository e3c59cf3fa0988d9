"""`nn.scaled_dot_product_attention` on a CUDA GPU against PyTorch's `F.scaled_dot_product_attention` on the same GPU,
in float32, float16 and bfloat16: the whole kernels (tensor cores for the halves, the float32 kernel, the composed
form past its head dims) at head dims 64 and 128, causal or not, bool and float masks, lengths off the tiles; and the
decode form (templates.attention_decode: one query row, or a few, against 1-4096 cached rows, batch 1-64, split
into chunks and combined, or one kernel), with a KV cache's valid lengths as a mask broadcast over heads and the keys
as views of a larger cache. Runs where a GPU and PyTorch with CUDA are present (the lent H100/H200); without one,
tests/test_attention_decode.py runs the CUDA decode kernels on the host and tests/test_attention.py compiles the
tensor-core kernel."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import azyx
from azyx import Tensor, nn
from azyx.ir import attention_of

GPUS = [d for d in azyx.devices() if d.startswith("cuda:")]
pytestmark = pytest.mark.skipif(not GPUS, reason="no CUDA device")
torch = pytest.importorskip("torch")
if not torch.cuda.is_available():  # pragma: no cover - depends on the machine
    pytest.skip("PyTorch has no CUDA", allow_module_level=True)
F = torch.nn.functional
torch.backends.cuda.matmul.allow_tf32 = False
TOL = {"float32": 1e-4, "float16": 4e-3, "bfloat16": 2e-2}  # relative to the output's norm, and elementwise


async def pair(x: np.ndarray, dtype: str) -> tuple[Tensor, Any]:
    """The same values on cuda:0 in azyx and in PyTorch, rounded to `dtype` on the device (the same bits)."""
    t = Tensor(x, device="cuda:0").cast(dtype)
    await t.realize()
    return t, torch.from_numpy(x).to("cuda:0").to(getattr(torch, dtype))


async def compare(out: Tensor, want: Any, dtype: str) -> None:
    got = await out.cast("float32").numpy()
    ref = want.float().cpu().numpy()
    assert got.shape == ref.shape
    tol = TOL[dtype]
    np.testing.assert_allclose(got, ref, rtol=tol, atol=tol)
    assert np.linalg.norm(got - ref) <= tol * np.linalg.norm(ref)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("mode", ["none", "causal", "bool", "float"])
@pytest.mark.parametrize("lengths", [(128, 128), (1000, 1000), (257, 131)])
async def test_attention_against_torch(dtype: str, dim: int, mode: str, lengths: tuple[int, int]) -> None:
    lq, lk = lengths
    if mode == "causal" and lq > lk:
        pytest.skip("(rows past the keys would keep none)")
    rng = np.random.default_rng(lq + dim)
    (q, tq), (k, tk), (v, tv) = [await pair(rng.standard_normal((2, 4, n, dim)).astype(np.float32), dtype)
                                 for n in (lq, lk, lk)]
    mask = tmask = None
    if mode == "bool":
        keep = rng.random((lq, lk)) < 0.7
        keep[:, 0] = True
        mask, tmask = Tensor(keep, device="cuda:0"), torch.from_numpy(keep).to("cuda:0")
    elif mode == "float":
        mask, tmask = await pair(rng.standard_normal((lq, lk)).astype(np.float32), dtype)
    out = nn.scaled_dot_product_attention(q, k, v, mask=mask, causal=mode == "causal")
    want = F.scaled_dot_product_attention(tq, tk, tv, attn_mask=tmask, is_causal=mode == "causal")
    await compare(out, want, dtype)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("batch", [1, 8, 64])
@pytest.mark.parametrize("cached", [1, 17, 256, 4096])
async def test_decode_against_torch(dtype: str, dim: int, batch: int, cached: int) -> None:
    """One query row per sequence against its cached rows (a view of a cache of max_len rows), each sequence's valid
    rows as a bool mask (batch, 1, 1, S); the decode form takes it (split where the rows leave the GPU idle)."""
    heads, max_len = 12, 4096
    rng = np.random.default_rng(batch * cached + dim)
    q, tq = await pair(rng.standard_normal((batch, heads, 1, dim)).astype(np.float32), dtype)
    cache = [await pair(rng.standard_normal((batch, heads, max_len, dim)).astype(np.float32), dtype) for _ in range(2)]
    (k, tk), (v, tv) = [(x[:, :, :cached], tx[:, :, :cached]) for x, tx in cache]
    lengths = rng.integers(1, cached + 1, batch)
    keep = (np.arange(cached)[None, :] < lengths[:, None]).reshape(batch, 1, 1, cached)
    out = nn.scaled_dot_product_attention(q, k, v, mask=Tensor(keep, device="cuda:0"), scale=0.125)
    specs = [attention_of(s.kernel) for s in azyx.schedule(out).kernels]
    assert any(a is not None and a.splits for a in specs), "the decode form did not take it"
    want = F.scaled_dot_product_attention(tq, tk, tv, attn_mask=torch.from_numpy(keep).to("cuda:0"), scale=0.125)
    await compare(out, want, dtype)
    out = nn.scaled_dot_product_attention(q, k, v)  # no mask
    await compare(out, F.scaled_dot_product_attention(tq, tk, tv), dtype)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
async def test_a_few_query_rows_causal_against_torch(dtype: str) -> None:
    rng = np.random.default_rng(3)
    (q, tq), (k, tk), (v, tv) = [await pair(rng.standard_normal((4, 12, n, 64)).astype(np.float32), dtype)
                                 for n in (3, 2000, 2000)]
    out = nn.scaled_dot_product_attention(q, k, v, causal=True)
    await compare(out, F.scaled_dot_product_attention(tq, tk, tv, is_causal=True), dtype)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
async def test_decode_through_the_cache_slots_against_torch(dtype: str) -> None:
    """A GPT-2 decode step's attention: each sequence's keys and values are its slot of the cache (gathered by an
    int32 index after the window is cut: the kernel reads the cache through the index, no gather kernel), its valid
    rows a mask; long enough to split."""
    slots, heads, max_len, dim, window = 8, 12, 4096, 64, 2048
    rng = np.random.default_rng(5)
    (ck, tck), (cv, tcv) = [await pair(rng.standard_normal((slots + 1, heads, max_len, dim)).astype(np.float32),
                                       dtype) for _ in range(2)]
    rows = np.array([3, 0, 7, 5, 1], np.int32)
    q, tq = await pair(rng.standard_normal((len(rows), heads, 1, dim)).astype(np.float32), dtype)
    pos = rng.integers(0, window, len(rows))
    keep = (np.arange(window)[None, :] <= pos[:, None]).reshape(len(rows), 1, 1, window)
    sl = Tensor(rows, device="cuda:0")
    out = nn.scaled_dot_product_attention(q, ck[:, :, :window][sl], cv[:, :, :window][sl],
                                          mask=Tensor(keep, device="cuda:0"))
    specs = [attention_of(s.kernel) for s in azyx.schedule(out).kernels]
    assert [a.gather for a in specs if a is not None and a.stage == 1] == [slots + 1]
    idx = torch.from_numpy(rows.astype(np.int64)).to("cuda:0")
    want = F.scaled_dot_product_attention(tq, tck[idx][:, :, :window], tcv[idx][:, :, :window],
                                          attn_mask=torch.from_numpy(keep).to("cuda:0"))
    await compare(out, want, dtype)
