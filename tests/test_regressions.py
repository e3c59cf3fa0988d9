"""Graphs a differential fuzzer found wrong (issue 13), each checked against numpy on every device."""

from __future__ import annotations

import numpy as np
import pytest

import azyx
from azyx import Tensor
from azyx.errors import DTypeError


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


async def test_a_zero_dim_bfloat16_tensor_round_trips(device: str) -> None:
    # found by tests/test_fuzz.py: numpy's ascontiguousarray makes a 0-d array 1-d, and >> makes it a numpy scalar
    t = Tensor(np.array(-1.5, np.float32), dtype="bfloat16", device=device)
    got = await t.T.numpy()
    assert got.shape == () and got.dtype == np.float32 and float(got) == -1.5


async def test_int_scalars_wrap_into_a_narrow_int_dtype_like_pytorch(device: str) -> None:
    # found by tests/test_fuzz.py: a scalar that does not fit its uint8/int8 kernel argument raised struct.error.
    # An unsigned dtype's negatives wrap as in PyTorch; an int outside the dtype's range raises DTypeError naming it
    # (numpy 2's rule: PyTorch would wrap 300 into 44 silently; issue 36)
    u = Tensor(np.array([1, 2], np.uint8), device=device)
    assert (await (u + -3).numpy()).tolist() == [254, 255]  # torch.tensor([1, 2], dtype=torch.uint8) + -3
    assert (await (u < -3).numpy()).tolist() == [True, True]  # -3 is 253 as a uint8, as in PyTorch
    with pytest.raises(DTypeError, match="300"):
        u * 300
    i8 = Tensor(np.array([1, 2], np.int8), device=device)
    with pytest.raises(DTypeError, match="300"):
        i8 + 300
    assert (await (i8 + 100).numpy()).tolist() == [101, 102]


async def test_a_zero_float_remainder_takes_the_divisors_sign(device: str) -> None:
    # found by tests/test_fuzz.py on opencl:0: fmod(-2, 1) is -0.0, and 1 / that was -inf; numpy and Python give +0.0
    x_np = np.array([-0.0, -2.0, 2.0, 0.0, -1.5], np.float32)
    x = Tensor(x_np, device=device)
    for y in (1.0, -1.0, 0.5):
        got = await (x % y).numpy()
        ref = np.mod(x_np, np.float32(y))
        np.testing.assert_array_equal(got, ref)
        np.testing.assert_array_equal(np.signbit(got), np.signbit(ref))


async def test_cat_and_stack_keep_negative_zeros(device: str) -> None:
    a_np = np.array([-0.0, 1.0], np.float32)
    b_np = np.array([-0.0, -0.0], np.float32)
    a, b, z = Tensor(a_np, device=device), Tensor(b_np, device=device), Tensor.zeros(2, device=device)
    for got, want in ((Tensor.stack([a, b]), np.stack([a_np, b_np])), (Tensor.cat([b, z, a]),
                      np.concatenate([b_np, np.zeros(2, np.float32), a_np]))):
        out = await got.numpy()
        np.testing.assert_array_equal(out, want)
        assert np.signbit(out).tolist() == np.signbit(want).tolist()


async def test_a_negative_float_cast_to_an_unsigned_int_wraps(device: str) -> None:
    x_np = np.array([-2.5, -1.0, 3.75, -128.0], np.float32)
    x = Tensor(x_np, device=device)
    want = x_np.astype(np.int64).astype(np.uint8)  # numpy and PyTorch: through a wide int (C and CUDA differ)
    assert (await x.cast("uint8").numpy()).tolist() == want.tolist()
    assert (await (x * 1.0).cast("uint8").cast("float16").numpy()).tolist() == want.astype(np.float16).tolist()


async def test_int_max_of_a_negation(device: str) -> None:
    # NVRTC rewrote max(-x, acc) from INT_MIN as -min(x, -acc): the max was the first element (125, not 343)
    x_np = np.array([-5, -7, -4, -2, 6])
    for dt in ("int16", "int32", "int64"):
        v = Tensor(x_np.astype(dt), device=device) ** 3
        await v.realize()
        want = -(x_np**3)
        assert (await (-v).max().numpy()).item() == want.max()
        assert (await (-v).min().numpy()).item() == want.min()
        assert (await (-v).maximum(Tensor.full((5,), -(2**15), dtype=dt, device=device)).numpy()).tolist() == \
            want.tolist()


async def test_kernels_of_one_source_launch_their_own_grids(device: str) -> None:
    # on CUDA a row-sum's rows and a batched product's batch are not in the kernel's source: several shapes share
    # one compiled function, and each must launch its own grid (the first one's was reused: rows left unwritten)
    rng = np.random.default_rng(0)
    for rows in (2, 5, 64, 3):
        x = rng.standard_normal((rows, 4096)).astype(np.float32)
        np.testing.assert_allclose(await Tensor(x, device=device).sum(1).numpy(), x.sum(1), rtol=1e-4, atol=1e-3)
    b = rng.standard_normal((1, 5, 5)).astype(np.float32)
    for batch in (2, 5, 3):
        a = rng.standard_normal((batch, 2, 5)).astype(np.float32)
        for _ in range(3):  # (a steady batch of launches becomes a graph: it must not be another shape's)
            got = await (Tensor(a, device=device) @ Tensor(b, device=device)).numpy()
            np.testing.assert_allclose(got, a @ b, rtol=1e-4, atol=1e-5)


@pytest.mark.skipif("vulkan:0" not in azyx.devices(), reason="no vulkan device")
async def test_a_sum_past_llvmpipes_loop_bound_counts_every_element() -> None:
    """llvmpipe (lavapipe) ends a shader's loops after 65535 iterations, silently: a sum of 33.5M ones gave 131070
    before grouped reduces took enough steps per iteration to stay within it."""
    n = 33_558_531
    got = await Tensor(np.ones(n, np.float32), device="vulkan:0").sum().numpy()
    np.testing.assert_allclose(got, n, rtol=1e-6)  # (n is not a float32: rounding of the partial sums)
    rows = await Tensor(np.ones((2, 9_000_001), np.float32), device="vulkan:0").sum(axis=1).numpy()
    np.testing.assert_array_equal(rows, np.full(2, 9_000_001, np.float32))


async def test_a_matrix_product_longer_than_llvmpipes_loop_bound_counts_every_term(device: str) -> None:
    # found on vulkan:0 (lavapipe): a register-tiled product over K = 100000 gave 65535 (llvmpipe ends loops silently)
    a, b = np.ones((4, 100_000), np.float32), np.ones((100_000, 64), np.float32)
    got = await (Tensor(a, device=device) @ Tensor(b, device=device)).numpy()
    np.testing.assert_array_equal(got, np.full((4, 64), 100_000, np.float32))


INT_DTYPES = ["int8", "uint8", "int16", "int32", "int64"]


@pytest.mark.parametrize("dtype", INT_DTYPES)
async def test_relu_maximum_minimum_clip_of_integer_tensors(device: str, dtype: str) -> None:
    """Issue 42: the NaN-keeping form of relu was emitted for integer values on WebGPU (`isnan32` of an i32)."""
    rng = np.random.default_rng(0)
    src = rng.uniform(-1, 3, (4, 1, 3, 4)).astype(np.float32)
    ref = src.astype(dtype)  # (numpy's cast of a negative float to uint8 wraps, as azyx's cast does on each device)
    t = Tensor(src, device=device).cast(dtype)
    other_np = rng.integers(0, 3, (3, 4)).astype(dtype)
    other = Tensor(other_np, device=device)
    cases = {
        "relu": (t.relu(), np.maximum(ref, 0).astype(dtype)),
        "maximum": (t.maximum(other), np.maximum(ref, other_np)),
        "minimum": (t.minimum(other), np.minimum(ref, other_np)),
        "clip": (t.clip(1, 2), np.clip(ref, 1, 2).astype(dtype)),
    }
    for name, (got, want) in cases.items():
        out = await got.numpy()
        assert out.dtype == want.dtype, (name, out.dtype, want.dtype)
        np.testing.assert_array_equal(out, want, err_msg=name)


async def test_an_integer_argmax_added_to_a_float_and_reduced_again(device: str) -> None:
    """Issue 42's second graph: an argmax/argmin result (an integer) meets a float constant, then a max reduce and a
    relu over it."""
    x_np = np.random.default_rng(1).uniform(-3, 3, (5, 6)).astype(np.float32)
    x = Tensor(x_np, device=device)
    got = await ((x.argmax(axis=1) + 0.5).max() + (x.argmin(axis=0).relu() - 2).relu().sum()).numpy()
    want = (x_np.argmax(1) + 0.5).max() + np.maximum(np.maximum(x_np.argmin(0), 0) - 2, 0).sum()
    np.testing.assert_allclose(got, want, rtol=1e-6)


@pytest.mark.parametrize("dtype", INT_DTYPES)
async def test_gradients_of_relu_maximum_minimum_clip_beside_integer_tensors(device: str, dtype: str) -> None:
    """The gradients of the same ops where one operand is an integer tensor: they flow to the float operand only,
    through the promoted (float) op, as PyTorch's do."""
    rng = np.random.default_rng(2)
    x_np = rng.uniform(-3, 3, (3, 4)).astype(np.float32)
    k_np = rng.integers(0, 3, (3, 4)).astype(dtype)
    x, k = Tensor(x_np, device=device), Tensor(k_np, device=device)
    with azyx.GradientTape() as tape:
        loss = (x.maximum(k) * 2 + x.minimum(k) * 3 + x.relu() * 5 + x.clip(-1, 1) * 7).sum()
    (g,) = tape.gradient(loss, [x])
    kf = k_np.astype(np.float32)
    want = 2.0 * (x_np > kf) + 3.0 * (x_np < kf) + 5.0 * (x_np > 0) + 7.0 * ((x_np > -1) & (x_np < 1))
    np.testing.assert_allclose(await g.numpy(), want, atol=1e-6)
