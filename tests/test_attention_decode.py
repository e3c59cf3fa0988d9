"""Decode attention (flash-decoding: a few query rows against a long cache, the keys split into chunks and combined) on
every test device: `scaled_dot_product_attention` split and unsplit against numpy, with causal, bool (a KV cache's
valid lengths, broadcast over heads) and float masks, head dims 64 and 128, float32/float16/bfloat16; where the
dialect has the decode kernel (C and OpenCL here) it plans into one kernel unsplit and two split (chunks, then their
combine), elsewhere the composed split form (`nn._split_attention`) gives the same; a GPT-2 decode step's attention
(keys of the cache gathered by slot, a window, positions as a mask). The CUDA decode kernels run on the host through
tests/cuda_host.py (g++): every dtype, head dims 64/128/80, masks, causal, broadcast strides, split and unsplit."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from test_attention import sdpa_ref

import azyx
from azyx import Tensor, nn
from azyx.codegen.dialect import CUDA
from azyx.codegen.templates import attention, attention_decode
from azyx.dtypes import dtypes
from azyx.ir import Attention, attention_of
from azyx.runtime import RT

rng = np.random.default_rng(7)


def randn(*shape: int) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)


def has_kernel(device: str) -> bool:
    """Whether the device's dialect has the decode kernel (C, CUDA, OpenCL)."""
    dl = RT.device(device).dialect
    return dl is not None and (dl.attention or dl.decode)


def cache_mask(b: int, s: int, lengths: list[int]) -> np.ndarray:
    """(b, 1, 1, s) bool: row i keeps keys 0..lengths[i]-1 (a KV cache's valid rows)."""
    return (np.arange(s)[None, :] < np.array(lengths)[:, None]).reshape(b, 1, 1, s)


MODES = ["none", "causal", "lengths", "float"]


def mask_of(mode: str, b: int, lq: int, s: int) -> np.ndarray | None:
    if mode == "lengths":
        return cache_mask(b, s, [int(x) for x in rng.integers(1, s + 1, b)])
    return randn(lq, s) if mode == "float" else None


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shape", [(2, 3, 1, 1024, 64), (1, 2, 2, 768, 128)])
async def test_decode_split_and_unsplit_against_numpy(device: str, shape: tuple[int, ...], mode: str,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    b, h, lq, s, e = shape
    q, k, v = randn(b, h, lq, e), randn(b, h, s, e), randn(b, h, s, e)
    mask = mask_of(mode, b, lq, s)
    want = sdpa_ref(q, k, v, mask, mode == "causal")
    args = [Tensor(x, device=device) for x in (q, k, v)]
    tm = None if mask is None else Tensor(mask, device=device)
    for units in (1, 512):  # (the kernel's chunks: as few as the units allow, then several)
        monkeypatch.setitem(attention.DECODE_UNITS, False, units)
        monkeypatch.setitem(attention.DECODE_UNITS, True, units)
        monkeypatch.setattr(attention, "DECODE_LANE_UNITS", units)
        RT.plan_cache.clear()  # (a plan of the other chunking is cached for this graph)
        out = nn.scaled_dot_product_attention(*args, mask=tm, causal=mode == "causal")
        plan = azyx.schedule(out)
        if has_kernel(device):
            steps = [x for x in plan.kernels if attention_of(x.kernel) is not None]
            specs = [attention_of(x.kernel) for x in steps]
            assert specs and all(a is not None and a.splits for a in specs), plan.describe()
            assert len(steps) == (1 if units == 1 else 2), plan.describe()
        np.testing.assert_allclose(await out.numpy(), want, rtol=1e-4, atol=2e-5)
    for splits in (1, 4, 8):  # the composed split form, any device
        got = nn._split_attention(*args, tm, mode == "causal", None, splits)
        np.testing.assert_allclose(await got.numpy(), want, rtol=1e-4, atol=2e-5)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
async def test_half_decode_against_numpy(device: str, dtype: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(attention.DECODE_UNITS, False, 512)
    monkeypatch.setattr(attention, "DECODE_LANE_UNITS", 512)
    RT.plan_cache.clear()
    b, h, s, e = 3, 2, 600, 64
    halves = [Tensor(randn(*sh), device=device).cast(dtype) for sh in ((b, h, 1, e), (b, h, s, e), (b, h, s, e))]
    exact = [await t.cast("float32").numpy() for t in halves]
    mask = cache_mask(b, s, [1, 300, 600])
    out = nn.scaled_dot_product_attention(*halves, mask=Tensor(mask, device=device))
    assert out.dtype.name == dtype
    tol = 2e-3 if dtype == "float16" else 1e-2
    want = sdpa_ref(*exact, mask)
    np.testing.assert_allclose(await out.cast("float32").numpy(), want, rtol=tol, atol=tol)
    got = nn._split_attention(*halves, Tensor(mask, device=device), False, None, 6)
    np.testing.assert_allclose(await got.cast("float32").numpy(), want, rtol=tol, atol=tol)


async def test_decode_of_a_gathered_cache_window(device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A GPT-2 decode step's attention: each row's keys and values gathered from its slot of the cache, the first
    `window` rows, its valid rows as a mask from the positions (models.gpt2.Decode). Cut to the window first, the
    decode kernel reads the cache through the slots itself (no gather kernel; Attention.gather), split or not; a
    negative slot counts from the end."""
    slots, heads, max_len, e, window = 4, 2, 1024, 64, 512
    cache_k, cache_v = randn(slots + 1, heads, max_len, e), randn(slots + 1, heads, max_len, e)
    rows, pos = np.array([2, 0, -2]), np.array([5, 200, 255])
    q = randn(3, heads, 1, e)
    keep = (np.arange(window)[None, :] <= pos[:, None]).reshape(3, 1, 1, window)
    tk, tv = Tensor(cache_k, device=device), Tensor(cache_v, device=device)
    sl = Tensor(rows.astype(np.int32), device=device)
    args = (Tensor(q, device=device), Tensor(keep, device=device))
    want = sdpa_ref(q, cache_k[rows][:, :, :window], cache_v[rows][:, :, :window], keep, scale=0.2)
    for units in (1, 512):
        monkeypatch.setitem(attention.DECODE_UNITS, False, units)
        monkeypatch.setitem(attention.DECODE_UNITS, True, units)
        monkeypatch.setattr(attention, "DECODE_LANE_UNITS", units)
        RT.plan_cache.clear()
        for k, v in ((tk[sl][:, :, :window], tv[sl][:, :, :window]), (tk[:, :, :window][sl], tv[:, :, :window][sl])):
            out = nn.scaled_dot_product_attention(args[0], k, v, mask=args[1], scale=0.2)
            specs = [attention_of(s.kernel) for s in azyx.schedule(out).kernels]
            np.testing.assert_allclose(await out.numpy(), want, rtol=1e-4, atol=2e-5)
        if has_kernel(device):  # (the last: cut, then gathered)
            first = [a for a in specs if a is not None and a.stage == 1]
            assert [a.gather for a in first] == [slots + 1]
            assert len(specs) == 1 + (first[0].splits > 1), "a gather kernel ran"  # (the stages alone)


async def test_a_gathered_slot_out_of_range_raises(device: str) -> None:
    cache = Tensor(randn(3, 2, 64, 32), device=device)
    q = Tensor(randn(2, 2, 1, 32), device=device)
    for bad in (3, -4):
        sl = Tensor(np.array([0, bad], np.int32), device=device)
        with pytest.raises(azyx.IndexOutOfRange, match=f"index {bad} is out of range for an axis of size 3"):
            await nn.scaled_dot_product_attention(q, cache[sl], cache[sl]).realize()


def test_decode_splits_cover_the_cache() -> None:
    """Chunks: none empty, at least DECODE_CHUNK keys (CUDA's lane kernel: DECODE_LANE_CHUNK), as many as fill
    DECODE_UNITS (DECODE_LANE_UNITS), DECODE_MAX_SPLITS at most; CUDA splits a batch-1 decode's window of 256 keys
    and leaves a batch of 32 (384 rows) whole."""
    for dl in (CUDA, dataclasses.replace(CUDA, global_ids=""), dataclasses.replace(CUDA, attention=False)):
        lanes = attention.decode_lanes(dl)
        least = attention.DECODE_LANE_CHUNK if lanes else attention.DECODE_CHUNK
        units = attention.DECODE_LANE_UNITS if lanes else attention.DECODE_UNITS[bool(dl.global_ids)]
        for rows, s in ((1, 1), (12, 4096), (12, 255), (768, 4096), (1, 1 << 20), (3, 1000)):
            n = attention.decode_splits(dl, rows, s)
            chunk = -(-s // n)
            assert 1 <= n <= attention.DECODE_MAX_SPLITS and (n - 1) * chunk < s
            assert n == 1 or chunk >= least // 2
            if s >= attention.DECODE_MAX_SPLITS * least:
                assert n * rows >= min(units, attention.DECODE_MAX_SPLITS * rows)
    assert attention.decode_splits(CUDA, 12, 256) == 4 and attention.decode_splits(CUDA, 384, 256) == 1


# ------------------------------------------------------------------------------------------------ CUDA on the host


def as_stored(x: np.ndarray, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """(the buffer as the GPU holds it, its values as float64 rounded to `dtype`)."""
    if dtype == "float32":
        return x.astype(np.float32), x.astype(np.float64)
    if dtype == "float16":
        h = x.astype(np.float16)
        return h.view(np.uint16), h.astype(np.float64)
    bits = x.astype(np.float32).view(np.uint32)
    bf = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    return bf, (bf.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def from_stored(buf: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "float32":
        return buf.astype(np.float64)
    if dtype == "float16":
        return buf.view(np.float16).astype(np.float64)
    return (buf.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


CUDA_CASES = [  # (dtype, batch, heads, L, cache rows, S, E, Ev, mode, splits)
    ("bfloat16", 2, 3, 1, 300, 257, 64, 64, "lengths", 3),
    ("bfloat16", 1, 2, 1, 160, 160, 128, 128, "none", 1),
    ("float16", 2, 2, 2, 200, 190, 64, 64, "causal", 2),
    ("float16", 1, 2, 1, 130, 130, 128, 128, "float", 4),
    ("float32", 2, 2, 1, 256, 200, 64, 64, "lengths", 1),
    ("float32", 1, 3, 3, 100, 97, 128, 128, "float", 2),
    ("bfloat16", 2, 1, 1, 96, 96, 80, 48, "none", 2),  # E != Ev, pieces not a power of 2
    ("float16", 3, 2, 1, 200, 150, 64, 64, "gather", 3),  # the cache's slots read through an index
    ("float32", 2, 2, 1, 100, 64, 64, 64, "gather", 1),
]


@pytest.mark.parametrize("case", CUDA_CASES, ids=lambda c: "-".join(map(str, c)))
def test_cuda_decode_kernel_on_the_host(case: tuple) -> None:
    """Stage 1 (and stage 2 where split) of the CUDA decode kernel, run on the host (tests/cuda_host.py), against
    numpy: keys and values read as views of a larger cache (rows past S, a slot offset), a mask broadcast over heads."""
    from cuda_host import launch

    dt, b, h, lq, rows, s, e, ev, mode, splits = case
    d = getattr(dtypes, dt)
    qb, qx = as_stored(randn(b, h, lq, e), dt)
    kb, kx = as_stored(randn(b + 1, h, rows, e), dt)  # (slot 0 unused: an offset)
    vb, vx = as_stored(randn(b + 1, h, rows, ev), dt)
    mask = mask_of(mode, b, lq, s)
    kview = (h * rows * e, h * rows * e, rows * e, e, 1)
    vview = (h * rows * ev, h * rows * ev, rows * ev, ev, 1)
    mview = None
    bufs = [qb, kb, vb]
    params = [d] * 4
    if mode == "lengths":
        assert mask is not None
        bufs.append(mask.astype(np.uint8).reshape(-1))
        params.append(dtypes.bool)
        mview = (0, s, 0, 0, 1)
    elif mode == "float":
        assert mask is not None
        mb, mx = as_stored(mask, dt)
        mask = mx
        bufs.append(mb)
        params.append(d)
        mview = (0, 0, 0, s, 1)
    gather = 0
    if mode == "gather":  # batch point i reads slot slots[i] of b + 1 (the index's last: -1, the last slot)
        slots = np.array([2, 0, -1][:b], np.int32)
        bufs += [slots, np.zeros(4, np.int32)]
        params += [dtypes.int32, dtypes.int32]
        kview, vview, gather = (0, *kview[1:]), (0, *vview[1:]), b + 1
    a = Attention((b, h), lq, s, e, ev, (0, h * lq * e, lq * e, e, 1), kview, vview, mview, mode == "lengths",
                  mode == "causal", splits, 1, gather)
    assert attention.decode_takes(CUDA, lq, e, ev, d)
    scale = 0.3
    out = np.zeros(b * h * lq * ev, qb.dtype)
    if splits == 1:
        src = attention_decode.render_cuda(a, "decode1", CUDA, params, "sc0")
        launch(src, "decode1", attention.cuda_grid(a), attention.CUDA_THREADS, [out, *bufs], (scale,))
    else:
        part = np.full(b * h * lq * splits * (ev + 2), np.nan, np.float32)
        src = attention_decode.render_cuda(a, "decode1", CUDA, [dtypes.float32, *params[1:]], "sc0")
        launch(src, "decode1", attention.cuda_grid(a), attention.CUDA_THREADS, [part, *bufs], (scale,))
        assert not np.isnan(part).any()
        a2 = dataclasses.replace(a, stage=2)
        src2 = attention_decode.render_cuda(a2, "decode2", CUDA, [d, dtypes.float32], "sc0")
        launch(src2, "decode2", attention.cuda_grid(a2), attention.CUDA_THREADS, [out, part], (scale,))
    rows = slots if gather else np.arange(1, b + 1)
    want = sdpa_ref(qx, kx[rows, :, :s], vx[rows, :, :s], mask, mode == "causal", scale)
    if gather:
        assert not bufs[-1].any()  # (no index out of range)
    tol = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1e-2}[dt]
    np.testing.assert_allclose(from_stored(out, dt).reshape(b, h, lq, ev), want, rtol=tol, atol=tol)


@pytest.mark.parametrize("heads", [(128, 128, True), (96, 80, False), (64, 40, True)])
def test_cuda_float32_kernel_on_the_host(heads: tuple[int, int, bool]) -> None:
    """The whole float32 CUDA kernel (attention_cuda.render_cuda) on the host: heads past 64 take its tiles from
    dynamic shared memory (cuda_smem), heads of 64 and less declare them."""
    from cuda_host import launch

    from azyx.codegen.templates import attention_cuda

    e, ev, causal = heads
    b, h, lq, lk = 1, 2, 70, 45
    q, k, v = randn(b, h, lq, e), randn(b, h, lk, e), randn(b, h, lk, ev)
    a = Attention((b, h), lq, lk, e, ev, (0, h * lq * e, lq * e, e, 1), (0, h * lk * e, lk * e, e, 1),
                  (0, h * lk * ev, lk * ev, ev, 1), None, False, causal)
    assert (attention_cuda.cuda_smem(a) > 0) == (e > 64)
    src = attention_cuda.render_cuda(a, "whole", CUDA, [dtypes.float32] * 4, "sc0")
    out = np.zeros(b * h * lq * ev, np.float32)
    launch(src, "whole", attention.cuda_grid(a), attention.CUDA_THREADS, [out, q, k, v], (0.2,))
    np.testing.assert_allclose(out.reshape(b, h, lq, ev), sdpa_ref(q, k, v, None, causal, 0.2), rtol=1e-4, atol=1e-5)


def test_cuda_decode_kernels_compile() -> None:
    """NVRTC (sm_90, where installed) compiles the decode kernels of every dtype, mask kind and stage, and the float32
    kernel's dynamic shared memory form."""
    try:
        from cuda.bindings import nvrtc

        from azyx.backends.cuda_driver import nvrtc_compile

        nvrtc.nvrtcVersion()
    except Exception as e:  # (no cuda-bindings, or no NVRTC library)
        pytest.skip(f"NVRTC unavailable: {e}")
    from azyx.codegen.render import kernel_source
    from azyx.codegen.templates import attention_cuda

    sources = []
    for dt in (dtypes.float32, dtypes.float16, dtypes.bfloat16):
        for e, mask in ((64, None), (128, "bool"), (80, "float")):
            a = Attention((4, 12), 1, 4096, e, e, (0, 12 * e, e, e, 1), (0, 12 * 4096 * e, 4096 * e, e, 1),
                          (0, 12 * 4096 * e, 4096 * e, e, 1), None if mask is None else (0, 4096, 0, 0, 1),
                          mask == "bool", False, 6, 1)
            params = [dt] * 4 + ([] if mask is None else [dtypes.bool if mask == "bool" else dt])
            n = len(sources)
            sources.append(attention_decode.render_cuda(a, f"d{n}", CUDA, [dtypes.float32, *params[1:]], "sc0"))
            sources.append(attention_decode.render_cuda(dataclasses.replace(a, splits=1), f"d{n + 1}", CUDA, params,
                                                        "sc0"))
            sources.append(attention_decode.render_cuda(dataclasses.replace(a, stage=2), f"d{n + 2}", CUDA,
                                                        [dt, dtypes.float32], "sc0"))
    wide = Attention((2, 3), 200, 300, 128, 128, (0, 3 * 200 * 128, 200 * 128, 128, 1),
                     (0, 3 * 300 * 128, 300 * 128, 128, 1), (0, 3 * 300 * 128, 300 * 128, 128, 1), None, False, True)
    sources.append(attention_cuda.render_cuda(wide, "whole", CUDA, [dtypes.float32] * 4, "sc0"))
    assert nvrtc_compile(kernel_source(sources, CUDA), "sm_90")[:4] == b"\x7fELF"


async def test_decode_gradients_match_pytorch(device: str) -> None:
    """Gradients through a decode step's attention (the kernel forward where the device has it; autograd through the
    composed form, split over the keys where no kernel takes it) match PyTorch's."""
    torch = pytest.importorskip("torch")
    q, k, v = randn(2, 3, 1, 16), randn(2, 3, 600, 16), randn(2, 3, 600, 8)
    w = randn(2, 3, 1, 8)
    tq, tk, tv = (Tensor(x, device=device) for x in (q, k, v))
    with azyx.GradientTape() as tape:
        out = nn.scaled_dot_product_attention(tq, tk, tv, scale=0.4)
        loss = (out * Tensor(w, device=device)).sum()
    grads = [await g.numpy() for g in tape.gradient(loss, [tq, tk, tv])]
    pq, pk, pv = (torch.from_numpy(x).requires_grad_() for x in (q, k, v))
    ref = torch.nn.functional.scaled_dot_product_attention(pq, pk, pv, scale=0.4)
    (ref * torch.from_numpy(w)).sum().backward()
    np.testing.assert_allclose(await out.numpy(), ref.detach().numpy(), rtol=1e-4, atol=2e-5)
    for g, p in zip(grads, (pq, pk, pv)):
        np.testing.assert_allclose(g, p.grad.numpy(), rtol=1e-4, atol=2e-5)
