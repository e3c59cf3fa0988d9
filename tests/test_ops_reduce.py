"""Reductions against numpy: sum mean max min prod var std logsumexp argmax argmin over axis None/int/negative/tuple,
keepdim, corrections, ties, dtypes, 0-d, size-1 and size-0 inputs. softmax/log_softmax live in test_ops_nn.py."""

import dataclasses

import numpy as np
import pytest
from compare import assert_matches, sample

import azyx
from azyx import Tensor
from azyx.runtime import RT


def logsumexp_ref(x, axis=None, keepdims=False):
    m = np.max(x, axis=axis, keepdims=True)
    out = np.log(np.sum(np.exp(x - m), axis=axis, keepdims=True)) + m
    return out if keepdims else np.squeeze(out, axis=axis)


# name, op on a Tensor with (axis, keepdim), float64 reference with (axis, keepdims)
REDUCTIONS = [
    ("sum", lambda t, a, k: t.sum(axis=a, keepdim=k), lambda x, a, k: np.sum(x, axis=a, keepdims=k)),
    ("mean", lambda t, a, k: t.mean(axis=a, keepdim=k), lambda x, a, k: np.mean(x, axis=a, keepdims=k)),
    ("max", lambda t, a, k: t.max(axis=a, keepdim=k), lambda x, a, k: np.max(x, axis=a, keepdims=k)),
    ("min", lambda t, a, k: t.min(axis=a, keepdim=k), lambda x, a, k: np.min(x, axis=a, keepdims=k)),
    ("prod", lambda t, a, k: t.prod(axis=a, keepdim=k), lambda x, a, k: np.prod(x, axis=a, keepdims=k)),
    ("var", lambda t, a, k: t.var(axis=a, keepdim=k), lambda x, a, k: np.var(x, axis=a, keepdims=k, ddof=1)),
    ("std", lambda t, a, k: t.std(axis=a, keepdim=k), lambda x, a, k: np.std(x, axis=a, keepdims=k, ddof=1)),
    ("logsumexp", lambda t, a, k: t.logsumexp(axis=a, keepdim=k), logsumexp_ref),
]
AXES = [None, 0, 1, -1, (0, 2), (-2, -1)]


def reduce_input(rng, shape, dtype="float32"):
    # magnitudes in [0.5, 1.5] with random signs: prod neither overflows nor underflows, max/min see negatives
    return (sample(rng, shape, "unit", "float64") * rng.choice([-1.0, 1.0], size=shape)).astype(dtype)


@pytest.mark.parametrize("keepdim", [False, True])
@pytest.mark.parametrize("axis", AXES, ids=str)
@pytest.mark.parametrize("name,op,ref", REDUCTIONS, ids=[r[0] for r in REDUCTIONS])
def test_reduce(device, name, op, ref, axis, keepdim):
    x = reduce_input(np.random.default_rng(0), (3, 4, 5))
    out = op(Tensor(x, device=device), axis, keepdim)
    assert_matches(out, ref(x.astype(np.float64), axis, keepdim), dtype="float32", rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", ["float64", "float16"])
@pytest.mark.parametrize("name,op,ref", REDUCTIONS, ids=[r[0] for r in REDUCTIONS])
def test_reduce_other_float_dtypes(device, name, op, ref, dtype):
    x = reduce_input(np.random.default_rng(1), (6, 11), dtype)
    tol = {"float64": {}, "float16": {"rtol": 1e-2, "atol": 1e-2}}[dtype]
    assert_matches(op(Tensor(x, device=device), 1, False), ref(x.astype(np.float64), 1, False), dtype=dtype, **tol)


@pytest.mark.parametrize("name", ["sum", "max", "min", "prod"])
@pytest.mark.parametrize("axis", [None, 0, -1])
def test_reduce_int32_keeps_int32(device, name, axis):
    x = sample(np.random.default_rng(2), (4, 6), "int", "int32")
    _, op, ref = next(r for r in REDUCTIONS if r[0] == name)
    if name == "prod":
        x = np.clip(x, -3, 3)  # keep the product inside int32
    assert_matches(op(Tensor(x, device=device), axis, False), ref(x, axis, False).astype(np.int32), dtype="int32")


@pytest.mark.parametrize("axis", [None, 0, 1])
def test_sum_of_bool_counts_in_int32(device, axis):
    x = sample(np.random.default_rng(3), (5, 7), "bool")
    assert_matches(Tensor(x, device=device).sum(axis=axis), np.sum(x, axis=axis).astype(np.int32), dtype="int32")


@pytest.mark.parametrize("correction", [0, 1, 2])
@pytest.mark.parametrize("axis", [None, 1, (0, 2)], ids=str)
def test_var_std_correction(device, correction, axis):
    x = reduce_input(np.random.default_rng(4), (3, 4, 5))
    t, x64 = Tensor(x, device=device), x.astype(np.float64)
    tol = {"rtol": 1e-5, "atol": 1e-6}
    assert_matches(t.var(axis=axis, correction=correction), np.var(x64, axis=axis, ddof=correction), **tol)
    assert_matches(t.std(axis=axis, correction=correction), np.std(x64, axis=axis, ddof=correction), **tol)


@pytest.mark.parametrize("keepdim", [False, True])
@pytest.mark.parametrize("axis", [None, 0, 1, -1])
@pytest.mark.parametrize("name", ["argmax", "argmin"])
@pytest.mark.parametrize("dtype", ["float32", "int32"])
def test_arg_reductions_pick_first_index_on_ties(device, name, axis, keepdim, dtype):
    x = np.random.default_rng(5).integers(0, 3, size=(4, 5, 6)).astype(dtype)  # three values: ties everywhere
    out = getattr(Tensor(x, device=device), name)(axis=axis, keepdim=keepdim)
    ref = getattr(np, name)(x, axis=axis, keepdims=keepdim)
    assert out.dtype in (azyx.dtypes.int32, azyx.dtypes.int64)
    assert_matches(out, ref)


def test_arg_reductions_with_constant_rows_and_infinities(device):
    x = np.array(
        [[1.0, 1.0, 1.0], [-np.inf, -np.inf, 2.0], [np.inf, 0.0, np.inf], [-3.0, -np.inf, -np.inf]], np.float32
    )
    t = Tensor(x, device=device)
    assert_matches(t.argmax(axis=1), np.argmax(x, axis=1))
    assert_matches(t.argmin(axis=1), np.argmin(x, axis=1))
    assert_matches(t.max(axis=1), np.max(x, axis=1))
    assert_matches(t.min(axis=1), np.min(x, axis=1))


def test_nan_propagates_through_reductions(device):
    # numpy and PyTorch alike: a NaN makes max/min/sum NaN, and argmax/argmin point at the first NaN
    x = np.array([[1.0, np.nan, 3.0, np.inf], [2.0, -1.0, np.nan, np.nan], [0.5, 4.0, -np.inf, 1.0]], np.float32)
    t = Tensor(x, device=device)
    for name in ["max", "min", "sum"]:
        assert_matches(getattr(t, name)(axis=1), getattr(np, name)(x, axis=1))
        assert_matches(getattr(t, name)(), getattr(np, name)(x))
    assert_matches(t.argmax(axis=1), np.argmax(x, axis=1))
    assert_matches(t.argmin(axis=1), np.argmin(x, axis=1))


def test_logsumexp_is_stable_for_large_inputs(device):
    x = np.array(
        [[1000.0, 1000.0, -1000.0], [-1000.0, -1001.0, -1002.0], [88.0, 89.0, 90.0], [-np.inf, 0.0, 1.0]], np.float32
    )
    t = Tensor(x, device=device)
    assert_matches(t.logsumexp(axis=1), logsumexp_ref(x.astype(np.float64), axis=1), dtype="float32")
    assert_matches(t.logsumexp(), logsumexp_ref(x.astype(np.float64)), dtype="float32")


@pytest.mark.parametrize("name,op,ref", REDUCTIONS, ids=[r[0] for r in REDUCTIONS])
def test_reduce_0d(device, name, op, ref):
    x = np.array(0.75, np.float32)
    if name in ("var", "std"):  # one element with correction=1 is nan in numpy and PyTorch alike; use correction=0
        out = getattr(Tensor(x, device=device), name)(correction=0)
        assert_matches(out, np.zeros((), np.float32))
        return
    assert_matches(op(Tensor(x, device=device), None, False), ref(x.astype(np.float64), None, False))
    assert_matches(op(Tensor(x, device=device), None, True), ref(x.astype(np.float64), None, True))


SIZE1_CASES = [(n, a) for n in ("sum", "max", "mean") for a in (None, 0, 1, (0, 2), 2)] + [
    ("argmax", a) for a in (None, 0, 1, 2)
]


@pytest.mark.parametrize("name,axis", SIZE1_CASES, ids=str)
def test_reduce_size1_dims(device, name, axis):
    x = reduce_input(np.random.default_rng(6), (1, 5, 1))
    out = getattr(Tensor(x, device=device), name)(axis=axis)
    assert_matches(out, getattr(np, name)(x.astype(np.float64), axis=axis))


def test_reduce_size0(device):
    x = np.zeros((0, 3), np.float32)
    t = Tensor(x, device=device)
    assert_matches(t.sum(axis=0), np.zeros(3, np.float32), dtype="float32")
    assert_matches(t.sum(), np.zeros((), np.float32), dtype="float32")
    assert_matches(t.prod(axis=0), np.ones(3, np.float32), dtype="float32")
    assert_matches(t.sum(axis=1), np.zeros(0, np.float32), dtype="float32")
    assert_matches(t.max(axis=1), np.zeros(0, np.float32), dtype="float32")
    assert_matches(t.sum(axis=0, keepdim=True), np.zeros((1, 3), np.float32), dtype="float32")


def test_large_reductions_accumulate_accurately(device):
    x = np.random.default_rng(7).random((256, 256), dtype=np.float32)
    t, x64 = Tensor(x, device=device), x.astype(np.float64)
    assert_matches(t.sum(), x64.sum(), rtol=5e-5)  # float32 sum of 65536 values in [0, 1)
    assert_matches(t.mean(axis=0), x64.mean(axis=0), rtol=1e-5)
    assert_matches(t.max(axis=1), x64.max(axis=1))
    assert_matches(t.std(), x64.std(ddof=1), rtol=1e-4)


@pytest.mark.parametrize("shape,axis", [((3, 4099), 1), ((4099, 3), 0), ((4099,), 0)], ids=str)
def test_long_reduction_axis(device, shape, axis):
    x = np.random.default_rng(10).random(shape, dtype=np.float32)
    t, x64 = Tensor(x, device=device), x.astype(np.float64)
    assert_matches(t.sum(axis=axis), x64.sum(axis=axis), rtol=2e-5)
    assert_matches(t.max(axis=axis), x64.max(axis=axis))
    assert_matches(t.argmin(axis=axis), np.argmin(x, axis=axis))


# column reductions with many outputs: on a dialect with `split_columns` (CUDA) they run in two stages, partial rows
# first (schedule.column_parts); `split_columns` forces that on every GPU-style device here
COLUMN_CASES = {
    "sum0": (lambda t: t.sum(axis=0), lambda x: x.sum(axis=0)),
    "mean0+1": (lambda t: t.mean(axis=0) + 1, lambda x: x.mean(axis=0) + 1),
    "max0": (lambda t: t.max(axis=0), lambda x: x.max(axis=0)),
    "min0": (lambda t: t.min(axis=0), lambda x: x.min(axis=0)),
    "prod0": (lambda t: (t * 0.02 + 1).prod(axis=0), lambda x: (x * 0.02 + 1).prod(axis=0)),
    "T.sum1": (lambda t: t.T.sum(axis=1), lambda x: x.T.sum(axis=1)),
    "sq.sum0": (lambda t: (t * t).sum(axis=0, keepdim=True), lambda x: (x * x).sum(axis=0, keepdims=True)),
    "argmax0": (lambda t: t.argmax(axis=0), lambda x: x.argmax(axis=0)),
    "var0": (lambda t: t.var(axis=0), lambda x: x.var(axis=0, ddof=1)),
}


@pytest.mark.parametrize("split", [False, True], ids=["default", "split_columns"])
@pytest.mark.parametrize("case", list(COLUMN_CASES))
def test_column_reductions_with_many_outputs(device, monkeypatch, case, split):
    dev = RT.device(device)
    if split:
        if dev.dialect is None or not dev.dialect.global_ids:
            pytest.skip("a column split is for GPU-style devices")
        monkeypatch.setattr(dev, "dialect", dataclasses.replace(dev.dialect, split_columns=True))
        RT.plan_cache.clear()
    op, ref = COLUMN_CASES[case]
    x = reduce_input(np.random.default_rng(12), (512, 320))
    try:
        assert_matches(op(Tensor(x, device=device)), ref(x.astype(np.float64)), rtol=2e-5, atol=1e-5)
        y = reduce_input(np.random.default_rng(13), (32, 24, 260))  # two reduced axes, many outputs
        assert_matches(op(Tensor(y, device=device).reshape(768, 260)), ref(y.reshape(768, 260).astype(np.float64)),
                       rtol=2e-5, atol=1e-5)
        assert_matches(Tensor(y, device=device).sum(axis=(0, 1)), y.astype(np.float64).sum(axis=(0, 1)), rtol=2e-5,
                       atol=1e-5)
    finally:
        RT.plan_cache.clear()


def test_var_is_stable_for_a_large_mean(device):
    # 1000 + U(0, 1): E[x^2] - E[x]^2 in float32 loses every digit; a two-pass or Welford variance does not
    x = (1000.0 + np.random.default_rng(11).random(1000)).astype(np.float32)
    t, x64 = Tensor(x, device=device), x.astype(np.float64)
    assert_matches(t.var(), x64.var(ddof=1), rtol=1e-3)
    assert_matches(t.std(), x64.std(ddof=1), rtol=1e-3)


def test_reduction_feeding_elementwise(device):
    # a reduce result broadcast back against its input (the softmax / layernorm pattern)
    x = reduce_input(np.random.default_rng(8), (7, 9))
    t, x64 = Tensor(x, device=device), x.astype(np.float64)
    out = (t - t.mean(axis=1, keepdim=True)) / (t.max(axis=0, keepdim=True) - t.min(axis=0, keepdim=True))
    ref = (x64 - x64.mean(axis=1, keepdims=True)) / (x64.max(axis=0, keepdims=True) - x64.min(axis=0, keepdims=True))
    assert_matches(out, ref, rtol=1e-5, atol=1e-6)
    assert_matches(t.sum(axis=1).max(), x64.sum(axis=1).max(), rtol=1e-5)


async def test_reductions_realized_together(device):
    x = reduce_input(np.random.default_rng(9), (5, 6))
    t = Tensor(x, device=device)
    s, m, a = t.sum(axis=0), t.max(axis=1), t.argmin()
    await azyx.realize(s, m, a)
    np.testing.assert_allclose(await s.numpy(), x.astype(np.float64).sum(axis=0), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(await m.numpy(), x.max(axis=1))
    assert await a.item() == int(np.argmin(x))
