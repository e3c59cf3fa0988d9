"""Graphs a differential fuzzer found wrong (issue 13), each checked against numpy on every device."""

from __future__ import annotations

import numpy as np

from azyx import Tensor


async def test_negative_constants_never_merge_with_the_operator_before_them(device: str) -> None:
    x_np = np.arange(4, dtype=np.float32)
    x = Tensor(x_np, device=device)
    np.testing.assert_allclose(await (x - (-0.75)).numpy(), x_np + 0.75)
    got = await x.pad(((2, 0),), value=-1.0)[:2].sigmoid().numpy()
    np.testing.assert_allclose(got, 1 / (1 + np.exp(np.float32(1.0))) * np.ones(2, np.float32), rtol=1e-6)
    np.testing.assert_allclose(await (-Tensor.full((3,), -2.0, device=device)).silu().numpy(),
                               np.full(3, 2 / (1 + np.exp(-2.0)), np.float32), rtol=1e-6)


async def test_indexing_and_gather_of_a_bool_tensor_stay_bool(device: str) -> None:
    b_np = np.array([True, False, True])
    got = await Tensor(b_np, device=device)[Tensor(np.array([1, 0, 2], np.int32), device=device)].numpy()
    assert got.dtype == np.bool_ and got.tolist() == b_np[[1, 0, 2]].tolist()
    m_np = np.array([[True, False], [False, True]])
    idx = np.array([[1, 0], [0, 0]], np.int32)
    got = await Tensor(m_np, device=device).gather(1, Tensor(idx, device=device)).numpy()
    assert got.dtype == np.bool_ and got.tolist() == np.take_along_axis(m_np, idx, 1).tolist()


async def test_argmax_of_a_computed_float16_tensor(device: str) -> None:
    h_np = np.array([0.1915, 0.3, 0.2, 0.1], np.float16)
    h = Tensor(h_np, device=device) + 0.5  # fused, computed in float32: rounded to float16 at the op, like numpy
    ref = h_np + np.float16(0.5)
    assert int(await h.argmax().item()) == int(ref.argmax()) == 1
    assert int(await h.argmin().item()) == int(ref.argmin())
    assert (await (h == h.max()).numpy()).tolist() == (ref == ref.max()).tolist()


async def test_float16_reductions_accumulate_in_float32(device: str) -> None:
    ones = Tensor(np.ones(70000, np.float16), device=device)
    mean = await ones.mean().numpy()
    assert mean.dtype == np.float16 and float(mean) == 1.0
    assert float(await ones.var().numpy()) == 0.0 and float(await ones.std().numpy()) == 0.0
    sm = await Tensor(np.zeros(70000, np.float16), device=device).softmax().numpy()
    assert sm.dtype == np.float16
    np.testing.assert_allclose(sm.astype(np.float32), np.float16(1 / 70000), rtol=1e-2)
    lse = await Tensor(np.zeros(70000, np.float16), device=device).logsumexp().numpy()
    np.testing.assert_allclose(float(lse), np.log(70000), rtol=1e-3)


async def test_a_transposed_matmul_plans(device: str) -> None:
    rng = np.random.default_rng(3)
    for sa, sb in [((8, 2), (2, 2)), ((64, 8), (8, 2)), ((5, 3), (3, 7))]:
        a_np, b_np = rng.standard_normal(sa).astype(np.float32), rng.standard_normal(sb).astype(np.float32)
        got = await (Tensor(a_np, device=device) @ Tensor(b_np, device=device)).T.numpy()
        np.testing.assert_allclose(got, (a_np @ b_np).T, rtol=1e-5, atol=1e-6)
