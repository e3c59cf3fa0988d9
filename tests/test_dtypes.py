"""Dtypes: defaults from data, the three spellings of `dtype=`, round trips, casts (incl. bfloat16 rounding), and
PyTorch-style promotion between tensors, with Python scalars, in float-only ops and in reductions."""

import numpy as np
import pytest
from compare import assert_matches

from azyx import Tensor, dtypes

ALL_NAMES = ["float16", "bfloat16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "bool"]
NUMPY_NAMES = [n for n in ALL_NAMES if n != "bfloat16"]  # numpy has no bfloat16


@pytest.mark.parametrize("name", ALL_NAMES)
def test_every_dtype_name_exists_and_compares_equal(name):
    dt = getattr(dtypes, name)
    assert dt == getattr(dtypes, name)
    assert all(dt != getattr(dtypes, other) for other in ALL_NAMES if other != name)


@pytest.mark.parametrize("name", ["float16", "float32", "float64", "int8", "int16", "int32", "uint8", "bool"])
def test_numpy_input_keeps_its_dtype(device, name):
    x = (np.arange(6).reshape(2, 3) % 4).astype(name)
    assert_matches(Tensor(x, device=device), x, dtype=name)


@pytest.mark.parametrize("name", NUMPY_NAMES)
def test_explicit_dtype_round_trip(device, name):
    data = [[0, 1, 2], [3, 5, 7]]
    assert_matches(Tensor(data, dtype=name, device=device), np.array(data).astype(name), dtype=name)


@pytest.mark.parametrize("spelling", ["dtypes", "numpy_type", "numpy_dtype", "string"])
@pytest.mark.parametrize("name", ["float16", "float64", "int8", "uint8", "bool"])
def test_dtype_argument_spellings(device, name, spelling):
    dt = {
        "dtypes": getattr(dtypes, name),
        "numpy_type": np.dtype(name).type,
        "numpy_dtype": np.dtype(name),
        "string": name,
    }[spelling]
    x = np.array([0.0, 1.0, 3.0])
    assert_matches(Tensor(x, dtype=dt, device=device), x.astype(name), dtype=name)
    assert_matches(Tensor(x, device=device).cast(dt), x.astype(name), dtype=name)
    assert_matches(Tensor.zeros(2, dtype=dt, device=device), np.zeros(2, name), dtype=name)


# ---- casts ------------------------------------------------------------------------------------------------------

CAST_NAMES = ["float16", "float32", "float64", "int8", "int32", "uint8", "bool"]
NONNEGATIVE = np.array([0.0, 1.0, 2.7, 5.5, 100.25, 127.0])  # fits every CAST_NAMES type; floats truncate toward 0
SIGNED = np.array([-3.7, -1.0, -0.5, 0.0, 2.2, -100.9])


@pytest.mark.parametrize("dst", CAST_NAMES)
@pytest.mark.parametrize("src", CAST_NAMES)
def test_cast_nonnegative(device, src, dst):
    x = NONNEGATIVE.astype(src)
    assert_matches(Tensor(x, device=device).cast(dst), x.astype(dst), dtype=dst)


@pytest.mark.parametrize("dst", ["float16", "float64", "int8", "int32", "bool"])
@pytest.mark.parametrize("src", ["float32", "float64", "int32"])
def test_cast_negative_values_truncate_toward_zero(device, src, dst):
    x = SIGNED.astype(src)
    assert_matches(Tensor(x, device=device).cast(dst), x.astype(dst), dtype=dst)


def test_cast_methods(device):
    f = np.array([-2.7, -0.5, 0.0, 0.5, 2.7, 100.9], np.float32)
    i = np.array([-3, 0, 2, 7], np.int32)
    tf, ti = Tensor(f, device=device), Tensor(i, device=device)
    assert_matches(tf.int(), f.astype(np.int32), dtype="int32")
    assert_matches(tf.half(), f.astype(np.float16), dtype="float16")
    assert_matches(tf.bool(), f != 0, dtype="bool")
    assert_matches(ti.float(), i.astype(np.float32), dtype="float32")
    assert_matches(ti.bool(), i != 0, dtype="bool")
    assert_matches((tf > 0).float(), (f > 0).astype(np.float32), dtype="float32")
    assert_matches((tf > 0).int(), (f > 0).astype(np.int32), dtype="int32")


def to_bfloat16(x):
    """float32 -> the nearest bfloat16 (ties to even), returned as float32."""
    bits = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    return bits.astype(np.uint32).view(np.float32)


def test_bfloat16_rounds_to_nearest_even(device):
    # 1 + 2**-8 and 1 + 3 * 2**-8 are exact ties between neighbouring bfloat16 values
    x = np.array([1.0, 1.00390625, 1.01171875, 3.14159, -2.71828, 1e-3, 0.1, 65504.0, 1e30, -1e-30], np.float32)
    ref = to_bfloat16(x)
    assert_matches(Tensor(x, device=device).cast("bfloat16").float(), ref, dtype="float32", rtol=0, atol=0)
    assert_matches(Tensor(x, dtype=dtypes.bfloat16, device=device).float(), ref, dtype="float32", rtol=0, atol=0)


def test_bfloat16_arithmetic(device):
    a, b = np.array([1.5, -2.0, 3.25], np.float32), np.array([0.5, 4.0, -1.0], np.float32)
    ta, tb = Tensor(a, dtype="bfloat16", device=device), Tensor(b, dtype="bfloat16", device=device)
    out = ta * tb + ta
    assert out.dtype == dtypes.bfloat16
    assert_matches(out.float(), a * b + a, dtype="float32")  # every value here is exact in bfloat16


# ---- promotion --------------------------------------------------------------------------------------------------

# dtype of a, dtype of b, dtype of a + b (PyTorch's table)
TENSOR_PROMOTION = [
    ("int32", "float32", "float32"),
    ("int32", "float16", "float16"),
    ("int32", "float64", "float64"),
    ("float16", "float32", "float32"),
    ("float32", "float64", "float64"),
    ("bfloat16", "float16", "float32"),
    ("bfloat16", "float32", "float32"),
    ("int8", "int32", "int32"),
    ("int16", "uint8", "int16"),
    ("uint8", "int8", "int16"),
    ("int32", "int64", "int64"),
    ("bool", "int32", "int32"),
    ("bool", "uint8", "uint8"),
    ("bool", "float16", "float16"),
    ("bool", "bool", "bool"),
]


@pytest.mark.parametrize("da,db,want", TENSOR_PROMOTION, ids=str)
def test_tensor_tensor_promotion(device, da, db, want):
    a, b = np.array([0, 1, 2, 3]), np.array([1, 1, 0, 2])
    ta, tb = Tensor(a, dtype=da, device=device), Tensor(b, dtype=db, device=device)
    a, b = a.astype(da.replace("bfloat16", "float32")), b.astype(db.replace("bfloat16", "float32"))
    for out, ref in ((ta + tb, a + b), (tb + ta, b + a), (ta * tb, a * b)):
        assert_matches(out, ref.astype(want), dtype=want)


# tensor dtype, Python scalar, dtype of tensor + scalar: a scalar only lifts the category (bool < int < float)
SCALAR_PROMOTION = [
    ("int32", 2, "int32"),
    ("int32", 2.5, "float32"),
    ("int8", 2, "int8"),
    ("uint8", 2, "uint8"),
    ("int8", 2.5, "float32"),
    ("float16", 2, "float16"),
    ("float16", 2.5, "float16"),
    ("float64", 2.5, "float64"),
    ("bool", 2, "int32"),
    ("bool", 2.5, "float32"),
    ("bool", True, "bool"),
    ("int32", True, "int32"),
]


@pytest.mark.parametrize("dt,scalar,want", SCALAR_PROMOTION, ids=str)
def test_tensor_scalar_promotion(device, dt, scalar, want):
    x = np.array([0, 1, 3]).astype(dt)
    t = Tensor(x, device=device)
    ref = x.astype(np.float64) + scalar
    assert_matches(t + scalar, ref.astype(want), dtype=want)
    assert_matches(scalar + t, ref.astype(want), dtype=want)


@pytest.mark.parametrize(
    "name,op,ref",
    [
        ("sqrt", lambda t: t.sqrt(), np.sqrt),
        ("exp", lambda t: t.exp(), np.exp),
        ("log", lambda t: t.log(), np.log),
        ("sin", lambda t: t.sin(), np.sin),
        ("sigmoid", lambda t: t.sigmoid(), lambda x: 1.0 / (1.0 + np.exp(-x))),
        ("truediv", lambda t: t / t, lambda x: x / x),
    ],
)
def test_float_ops_on_ints_give_float32(device, name, op, ref):
    x = np.array([1, 4, 9, 2], np.int32)
    assert_matches(op(Tensor(x, device=device)), ref(x.astype(np.float64)), dtype="float32")


def test_int_ops_keep_int(device):
    x = np.array([-3, 0, 2, 7], np.int32)
    t = Tensor(x, device=device)
    assert_matches(t.abs(), np.abs(x), dtype="int32")
    assert_matches(-t, -x, dtype="int32")
    assert_matches(t.square(), x * x, dtype="int32")
    assert_matches(t.clip(-1, 3), np.clip(x, -1, 3), dtype="int32")
    assert_matches(t.maximum(Tensor(np.array([0, 0, 5, 5], np.int32), device=device)), [0, 0, 5, 7], dtype="int32")


@pytest.mark.parametrize("dt", ["int8", "int16", "uint8", "int32"])
def test_int_reductions_keep_their_type(device, dt):
    x = np.array([[1, 2, 3], [4, 5, 6]]).astype(dt)
    t = Tensor(x, device=device)
    assert_matches(t.sum(), np.array(21, dt), dtype=dt)
    assert_matches(t.sum(axis=0), x.sum(axis=0).astype(dt), dtype=dt)
    assert_matches(t.max(axis=1), x.max(axis=1), dtype=dt)


def test_float16_reductions_stay_float16(device):
    x = np.linspace(-1.0, 1.0, 64).astype(np.float16).reshape(8, 8)
    t = Tensor(x, device=device)
    assert_matches(t.sum(axis=1), x.astype(np.float64).sum(axis=1), dtype="float16")
    assert_matches(t.mean(), x.astype(np.float64).mean(), dtype="float16")
    assert_matches(t.max(axis=0), x.max(axis=0), dtype="float16")


def test_small_int_arithmetic_wraps(device):
    u = Tensor(np.array([250, 3], np.uint8), device=device)
    assert_matches(u + 10, np.array([4, 13], np.uint8), dtype="uint8")
    assert_matches(u - 5, np.array([245, 254], np.uint8), dtype="uint8")
    i = Tensor(np.array([100, -100], np.int8), device=device)
    assert_matches(i + i, np.array([-56, 56], np.int8), dtype="int8")


def test_float64_keeps_its_precision(device):
    x = np.array([1.0, 3.0, -2.0])
    t = Tensor(x, device=device)
    assert_matches((t + 1e-9) - t, np.full(3, 1e-9), dtype="float64", rtol=1e-6, atol=0)
    assert_matches((t * 1e-10).exp() - 1.0, np.expm1(x * 1e-10), dtype="float64", rtol=1e-5, atol=0)
    assert_matches((t + 1e8).sum() - 2e8 - 1e8, np.array(2.0), dtype="float64", rtol=0, atol=1e-6)


def test_int64_keeps_values_beyond_int32(device):
    x = np.array([2**40, -(2**40) + 3, 7], np.int64)
    t = Tensor(x, dtype="int64", device=device)
    assert_matches(t + 1, x + 1, dtype="int64")
    assert_matches(t.sum(), np.array(x.sum()), dtype="int64")
    assert_matches(t // 3, x // 3, dtype="int64")
