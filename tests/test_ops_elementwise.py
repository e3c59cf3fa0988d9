"""Elementwise ops against numpy: unary math, binary operators with tensors and Python scalars, broadcasting,
comparisons, bitwise ops, where/clip/maximum/minimum, and fused chains. Dtype promotion rules: test_dtypes.py."""

import math
import operator

import numpy as np
import pytest
from compare import assert_matches, sample

from azyx import Tensor

erf = np.vectorize(math.erf, otypes=[np.float64])


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


# name, op on a Tensor, float64 numpy reference, input domain
UNARY = [
    ("neg", lambda t: -t, np.negative, "any"),
    ("abs", lambda t: t.abs(), np.abs, "any"),
    ("exp", lambda t: t.exp(), np.exp, "any"),
    ("log", lambda t: t.log(), np.log, "pos"),
    ("exp2", lambda t: t.exp2(), np.exp2, "any"),
    ("log2", lambda t: t.log2(), np.log2, "pos"),
    ("sqrt", lambda t: t.sqrt(), np.sqrt, "pos"),
    ("rsqrt", lambda t: t.rsqrt(), lambda x: 1.0 / np.sqrt(x), "pos"),
    ("reciprocal", lambda t: t.reciprocal(), lambda x: 1.0 / x, "nonzero"),
    ("sin", lambda t: t.sin(), np.sin, "any"),
    ("cos", lambda t: t.cos(), np.cos, "any"),
    ("tan", lambda t: t.tan(), np.tan, "small"),
    ("tanh", lambda t: t.tanh(), np.tanh, "any"),
    ("erf", lambda t: t.erf(), erf, "any"),
    ("sigmoid", lambda t: t.sigmoid(), sigmoid, "any"),
    ("relu", lambda t: t.relu(), lambda x: np.maximum(x, 0.0), "any"),
    ("gelu", lambda t: t.gelu(), lambda x: 0.5 * x * (1.0 + erf(x / np.sqrt(2.0))), "any"),
    (
        "gelu_tanh",
        lambda t: t.gelu(approximate="tanh"),
        lambda x: 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x**3))),
        "any",
    ),
    ("silu", lambda t: t.silu(), lambda x: x * sigmoid(x), "any"),
    ("softplus", lambda t: t.softplus(), lambda x: np.logaddexp(0.0, x), "any"),
    ("sign", lambda t: t.sign(), np.sign, "any"),
    ("floor", lambda t: t.floor(), np.floor, "any"),
    ("ceil", lambda t: t.ceil(), np.ceil, "any"),
    ("round", lambda t: t.round(), np.round, "any"),
    ("square", lambda t: t.square(), np.square, "any"),
]
UNARY_BY_NAME = {u[0]: u for u in UNARY}


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16"])
@pytest.mark.parametrize("name,op,ref,domain", UNARY, ids=[u[0] for u in UNARY])
def test_unary(device, name, op, ref, domain, dtype):
    x = sample(np.random.default_rng(0), (5, 37), domain, dtype)
    assert_matches(op(Tensor(x, device=device)), ref(x.astype(np.float64)), dtype=dtype)


@pytest.mark.parametrize("name", ["sigmoid", "tanh", "erf", "softplus", "silu", "gelu", "gelu_tanh", "relu"])
def test_unary_stays_finite_on_extreme_inputs(device, name):
    _, op, ref, _ = UNARY_BY_NAME[name]
    x = np.array([-100.0, -30.0, -5.0, 0.0, 5.0, 30.0, 100.0], np.float32)
    out = assert_matches(op(Tensor(x, device=device)), ref(x.astype(np.float64)), dtype="float32")
    assert np.isfinite(out).all(), out


@pytest.mark.parametrize("name", ["round", "floor", "ceil"])
def test_rounding_at_halves_and_beyond_int32(device, name):
    # halves round to even; 0.49999997 breaks floor(x + 0.5); 2**23 + 1 and 1e10 break an int round trip
    x = np.array(
        [-2.5, -1.5, -0.5, 0.5, 1.5, 2.5, 3.5, 0.49999997, -0.49999997, -0.7, 0.7, 8388609.0, -8388609.0, 1e10, -1e10],
        np.float32,
    )
    _, op, ref, _ = UNARY_BY_NAME[name]
    assert_matches(op(Tensor(x, device=device)), ref(x), dtype="float32")


def test_nan_propagates_through_relu_clip_maximum_minimum(device):
    # numpy and PyTorch alike return NaN wherever an operand is NaN
    x = np.array([np.nan, -1.0, 0.5, np.inf, -np.inf, np.nan], np.float32)
    y = np.array([0.0, np.nan, 0.25, 1.0, np.nan, np.nan], np.float32)
    tx, ty = Tensor(x, device=device), Tensor(y, device=device)
    assert_matches(tx.relu(), np.maximum(x, 0.0))
    assert_matches(tx.clip(-0.5, 0.75), np.clip(x, -0.5, 0.75))
    assert_matches(tx.maximum(ty), np.maximum(x, y))
    assert_matches(tx.minimum(ty), np.minimum(x, y))
    assert_matches(tx + ty, x + y)


def test_unary_on_size0_and_0d(device):
    empty = np.zeros((0, 3), np.float32)
    assert_matches(Tensor(empty, device=device).exp(), np.exp(empty), dtype="float32")
    scalar = np.array(0.75, np.float32)
    assert_matches(Tensor(scalar, device=device).sqrt(), np.sqrt(scalar), dtype="float32")
    assert_matches(-Tensor(1.5, device=device), np.array(-1.5, np.float32), dtype="float32")


# name, op, numpy reference, domain of a, domain of b
BINARY = [
    ("add", operator.add, np.add, "any", "any"),
    ("sub", operator.sub, np.subtract, "any", "any"),
    ("mul", operator.mul, np.multiply, "any", "any"),
    ("truediv", operator.truediv, np.true_divide, "any", "nonzero"),
    ("floordiv", operator.floordiv, np.floor_divide, "any", "nonzero"),
    ("mod", operator.mod, np.mod, "any", "nonzero"),
    ("pow", operator.pow, np.power, "pos", "any"),
    ("maximum", lambda a, b: a.maximum(b), np.maximum, "any", "any"),
    ("minimum", lambda a, b: a.minimum(b), np.minimum, "any", "any"),
]
BROADCAST_SHAPES = [
    ((5, 37), (5, 37)),
    ((3, 1, 5), (4, 1)),
    ((1, 4), (3, 1)),
    ((), (2, 3)),
    ((2, 3), ()),
    ((0, 3), (3,)),
]


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("shapes", BROADCAST_SHAPES, ids=str)
@pytest.mark.parametrize("name,op,ref,dom_a,dom_b", BINARY, ids=[b[0] for b in BINARY])
def test_binary_float(device, name, op, ref, dom_a, dom_b, shapes, dtype):
    rng = np.random.default_rng(1)
    a, b = sample(rng, shapes[0], dom_a, dtype), sample(rng, shapes[1], dom_b, dtype)
    out = op(Tensor(a, device=device), Tensor(b, device=device))
    assert_matches(out, ref(a.astype(np.float64), b.astype(np.float64)), dtype=dtype)


@pytest.mark.parametrize("name", ["add", "sub", "mul", "truediv", "maximum", "minimum"])
def test_binary_float16(device, name):
    _, op, ref, dom_a, dom_b = next(b for b in BINARY if b[0] == name)
    rng = np.random.default_rng(2)
    a, b = sample(rng, (3, 1, 5), dom_a, "float16"), sample(rng, (4, 1), dom_b, "float16")
    out = op(Tensor(a, device=device), Tensor(b, device=device))
    assert_matches(out, ref(a.astype(np.float64), b.astype(np.float64)), dtype="float16")


# name, op, numpy reference (the same operator on int32 arrays has Python's floor semantics), domain of b
INT_BINARY = [
    ("add", operator.add, "int"),
    ("sub", operator.sub, "int"),
    ("mul", operator.mul, "int"),
    ("floordiv", operator.floordiv, "int_nonzero"),
    ("mod", operator.mod, "int_nonzero"),
    ("pow", operator.pow, "int_exp"),
    ("maximum", np.maximum, "int"),
    ("minimum", np.minimum, "int"),
    ("and", operator.and_, "int"),
    ("or", operator.or_, "int"),
    ("xor", operator.xor, "int"),
]
TENSOR_METHODS = {np.maximum: lambda a, b: a.maximum(b), np.minimum: lambda a, b: a.minimum(b)}


@pytest.mark.parametrize("shapes", [((5, 37), (5, 37)), ((3, 1, 5), (4, 1))], ids=str)
@pytest.mark.parametrize("name,op,dom_b", INT_BINARY, ids=[b[0] for b in INT_BINARY])
def test_binary_int32(device, name, op, dom_b, shapes):
    rng = np.random.default_rng(3)
    a, b = sample(rng, shapes[0], "int", "int32"), sample(rng, shapes[1], dom_b, "int32")
    out = TENSOR_METHODS.get(op, op)(Tensor(a, device=device), Tensor(b, device=device))
    assert_matches(out, op(a, b), dtype="int32")


INT_BINARY_NO_POW = [(name, op) for name, op, _ in INT_BINARY if name != "pow"]  # pow overflows small ints


@pytest.mark.parametrize("dtype", ["int8", "int16", "uint8", "int64"])
@pytest.mark.parametrize("name,op", INT_BINARY_NO_POW, ids=[b[0] for b in INT_BINARY_NO_POW])
def test_binary_other_int_dtypes(device, name, op, dtype):
    rng = np.random.default_rng(16)
    lo = 0 if dtype == "uint8" else -9
    a = rng.integers(lo, 10, size=(3, 1, 5)).astype(dtype)
    b = rng.integers(1, 10, size=(4, 1)) * (1 if dtype == "uint8" else rng.choice([-1, 1], size=(4, 1)))
    out = TENSOR_METHODS.get(op, op)(Tensor(a, device=device), Tensor(b.astype(dtype), device=device))
    assert_matches(out, op(a, b.astype(dtype)), dtype=dtype)


def test_int_floor_division_and_modulo_follow_python_signs(device):
    a = np.array([7, -7, 7, -7, 0, 9, -9, 1], np.int32)
    b = np.array([2, 2, -2, -2, 3, -4, 4, -5], np.int32)
    ta, tb = Tensor(a, device=device), Tensor(b, device=device)
    assert_matches(ta // tb, [x // y for x, y in zip(a.tolist(), b.tolist(), strict=True)], dtype="int32")
    assert_matches(ta % tb, [x % y for x, y in zip(a.tolist(), b.tolist(), strict=True)], dtype="int32")


def test_float_floor_division_and_modulo_follow_python_signs(device):
    a = np.array([7.5, -7.5, 7.5, -7.5, 0.0, 2.25, -2.25], np.float32)
    b = np.array([2.0, 2.0, -2.0, -2.0, 3.0, -0.5, 0.5], np.float32)
    ta, tb = Tensor(a, device=device), Tensor(b, device=device)
    assert_matches(ta // tb, [x // y for x, y in zip(a.tolist(), b.tolist(), strict=True)], dtype="float32")
    assert_matches(ta % tb, [x % y for x, y in zip(a.tolist(), b.tolist(), strict=True)], dtype="float32")


def test_int_true_division_gives_float32(device):
    a, b = np.array([7, -7, 1, 0], np.int32), np.array([2, 2, 3, 5], np.int32)
    assert_matches(Tensor(a, device=device) / Tensor(b, device=device), a / b, dtype="float32")


BOOL_BINARY = [
    ("and", operator.and_),
    ("or", operator.or_),
    ("xor", operator.xor),
    ("add", operator.add),  # logical or, like PyTorch and numpy
    ("mul", operator.mul),  # logical and
    ("eq", operator.eq),
    ("ne", operator.ne),
]


@pytest.mark.parametrize("name,op", BOOL_BINARY, ids=[b[0] for b in BOOL_BINARY])
def test_binary_bool(device, name, op):
    rng = np.random.default_rng(4)
    a, b = sample(rng, (3, 1, 5), "bool"), sample(rng, (4, 1), "bool")
    assert_matches(op(Tensor(a, device=device), Tensor(b, device=device)), op(a, b), dtype="bool")


@pytest.mark.parametrize("dtype", ["bool", "int32"])
def test_invert(device, dtype):
    x = sample(np.random.default_rng(5), (4, 9), "bool" if dtype == "bool" else "int", dtype)
    assert_matches(~Tensor(x, device=device), ~x, dtype=dtype)


COMPARISONS = [
    ("lt", operator.lt),
    ("le", operator.le),
    ("gt", operator.gt),
    ("ge", operator.ge),
    ("eq", operator.eq),
    ("ne", operator.ne),
]


@pytest.mark.parametrize("dtype", ["float32", "int32"])
@pytest.mark.parametrize("shapes", [((4, 6), (4, 6)), ((3, 1, 5), (4, 1))], ids=str)
@pytest.mark.parametrize("name,op", COMPARISONS, ids=[c[0] for c in COMPARISONS])
def test_comparison_returns_bool(device, name, op, shapes, dtype):
    rng = np.random.default_rng(6)
    # values from {-2..2} so that ties are frequent
    a, b = (rng.integers(-2, 3, size=s).astype(dtype) for s in shapes)
    assert_matches(op(Tensor(a, device=device), Tensor(b, device=device)), op(a, b), dtype="bool")


# id, input domain, input dtype, op (applied to the Tensor and to the float64/int64 numpy input alike), result dtype
SCALAR_CASES = [
    ("f+2", "any", "float32", lambda t: t + 2, "float32"),
    ("2+f", "any", "float32", lambda t: 2 + t, "float32"),
    ("f-2.5", "any", "float32", lambda t: t - 2.5, "float32"),
    ("2.5-f", "any", "float32", lambda t: 2.5 - t, "float32"),
    ("3*f", "any", "float32", lambda t: 3 * t, "float32"),
    ("f/4", "any", "float32", lambda t: t / 4, "float32"),
    ("4/f", "nonzero", "float32", lambda t: 4 / t, "float32"),
    ("f//0.7", "any", "float32", lambda t: t // 0.7, "float32"),
    ("5//f", "nonzero", "float32", lambda t: 5 // t, "float32"),
    ("f%0.7", "any", "float32", lambda t: t % 0.7, "float32"),
    ("-5%f", "nonzero", "float32", lambda t: -5 % t, "float32"),
    ("f**2", "any", "float32", lambda t: t**2, "float32"),
    ("f**3", "any", "float32", lambda t: t**3, "float32"),
    ("f**0.5", "pos", "float32", lambda t: t**0.5, "float32"),
    ("f**-1", "nonzero", "float32", lambda t: t**-1, "float32"),
    ("2**f", "any", "float32", lambda t: 2**t, "float32"),
    ("f<0.5", "any", "float32", lambda t: t < 0.5, "bool"),
    ("0.5<f", "any", "float32", lambda t: 0.5 < t, "bool"),
    ("f>=-1", "any", "float32", lambda t: t >= -1, "bool"),
    ("f==0", "any", "float32", lambda t: t == 0, "bool"),
    ("f!=0", "any", "float32", lambda t: t != 0, "bool"),
    ("i+2", "int", "int32", lambda t: t + 2, "int32"),
    ("i+2.5", "int", "int32", lambda t: t + 2.5, "float32"),
    ("2.5*i", "int", "int32", lambda t: 2.5 * t, "float32"),
    ("2.5-i", "int", "int32", lambda t: 2.5 - t, "float32"),
    ("i/2", "int", "int32", lambda t: t / 2, "float32"),
    ("7/i", "int_nonzero", "int32", lambda t: 7 / t, "float32"),
    ("i//3", "int", "int32", lambda t: t // 3, "int32"),
    ("i//-3", "int", "int32", lambda t: t // -3, "int32"),
    ("-7//i", "int_nonzero", "int32", lambda t: -7 // t, "int32"),
    ("i%3", "int", "int32", lambda t: t % 3, "int32"),
    ("i%-3", "int", "int32", lambda t: t % -3, "int32"),
    ("7%i", "int_nonzero", "int32", lambda t: 7 % t, "int32"),
    ("i**2", "int", "int32", lambda t: t**2, "int32"),
    ("2**i", "int_exp", "int32", lambda t: 2**t, "int32"),
    ("i&3", "int", "int32", lambda t: t & 3, "int32"),
    ("i|4", "int", "int32", lambda t: t | 4, "int32"),
    ("i^5", "int", "int32", lambda t: t ^ 5, "int32"),
    ("i<2.5", "int", "int32", lambda t: t < 2.5, "bool"),  # 2 < 2.5: the scalar must not be truncated to int
    ("i>-1.5", "int", "int32", lambda t: t > -1.5, "bool"),
    ("i==2", "int", "int32", lambda t: t == 2, "bool"),
    ("b+1", "bool", "bool", lambda t: t + 1, "int32"),
    ("b*2.5", "bool", "bool", lambda t: t * 2.5, "float32"),
]


@pytest.mark.parametrize("name,domain,in_dtype,op,out_dtype", SCALAR_CASES, ids=[c[0] for c in SCALAR_CASES])
def test_python_scalar_operands(device, name, domain, in_dtype, op, out_dtype):
    x = sample(np.random.default_rng(7), (4, 9), domain, in_dtype)
    wide = x.astype({"f": np.float64, "i": np.int64, "b": np.bool_}[x.dtype.kind])
    assert_matches(op(Tensor(x, device=device)), op(wide), dtype=out_dtype)


@pytest.mark.parametrize("dtype,lo,hi", [("float32", -0.5, 0.75), ("int32", -2, 3)])
def test_maximum_minimum_with_python_scalar(device, dtype, lo, hi):
    x = sample(np.random.default_rng(13), (4, 9), "any" if dtype == "float32" else "int", dtype)
    t = Tensor(x, device=device)
    assert_matches(t.maximum(lo), np.maximum(x, lo), dtype=dtype)
    assert_matches(t.minimum(hi), np.minimum(x, hi), dtype=dtype)


def test_where_broadcasts_condition_and_branches(device):
    rng = np.random.default_rng(8)
    cond, a, b = sample(rng, (3, 1), "bool"), sample(rng, (1, 4), "any"), sample(rng, (2, 3, 4), "any")
    out = Tensor.where(Tensor(cond, device=device), Tensor(a, device=device), Tensor(b, device=device))
    assert_matches(out, np.where(cond, a, b), dtype="float32")


def test_where_with_scalar_branches_and_mixed_dtypes(device):
    rng = np.random.default_rng(9)
    x = sample(rng, (4, 5), "any")
    t = Tensor(x, device=device)
    assert_matches(Tensor.where(t > 0, t, 0.0), np.where(x > 0, x, 0.0), dtype="float32")
    assert_matches(Tensor.where(t > 0, -1.5, t), np.where(x > 0, -1.5, x), dtype="float32")
    i = sample(rng, (4, 5), "int", "int32")
    ti = Tensor(i, device=device)
    assert_matches(Tensor.where(ti > 0, ti, -ti), np.abs(i), dtype="int32")
    assert_matches(Tensor.where(t > 0, ti, t), np.where(x > 0, i, x), dtype="float32")


@pytest.mark.parametrize("dtype,lo,hi", [("float32", -0.5, 0.75), ("int32", -2, 3)])
def test_clip(device, dtype, lo, hi):
    x = sample(np.random.default_rng(10), (5, 37), "any" if dtype == "float32" else "int", dtype)
    assert_matches(Tensor(x, device=device).clip(lo, hi), np.clip(x, lo, hi), dtype=dtype)


def test_fused_chain_with_shared_intermediate(device):
    rng = np.random.default_rng(11)
    a, b = sample(rng, (6, 7), "any"), sample(rng, (7,), "any")
    ta, tb = Tensor(a, device=device), Tensor(b, device=device)
    c = ta * tb + 1.0
    out = ((c.exp() / (ta.abs() + 1.0)).sqrt() - tb.sigmoid()) * c + c.relu()
    ca = a.astype(np.float64) * b + 1.0
    ref = (np.sqrt(np.exp(ca) / (np.abs(a) + 1.0)) - sigmoid(b.astype(np.float64))) * ca + np.maximum(ca, 0.0)
    assert_matches(out, ref, dtype="float32", rtol=1e-5, atol=1e-5)


def test_same_tensor_on_both_sides(device):
    x = sample(np.random.default_rng(12), (3, 8), "any")
    t = Tensor(x, device=device)
    assert_matches(t * t - t, x * x - x, dtype="float32")
    assert_matches(t == t, np.ones((3, 8), bool), dtype="bool")


def test_large_broadcast_elementwise(device):
    # big enough for a multi-threaded / vectorised kernel, with odd sizes that leave remainders
    rng = np.random.default_rng(14)
    a, b = sample(rng, (257, 255), "any"), sample(rng, (255,), "pos")
    out = (Tensor(a, device=device) * Tensor(b, device=device).log()).tanh() + 1.0
    assert_matches(out, np.tanh(a.astype(np.float64) * np.log(b.astype(np.float64))) + 1.0, dtype="float32")


def test_long_chain_of_ops(device):
    x = sample(np.random.default_rng(15), (3, 7), "any")
    t, ref = Tensor(x, device=device), x.astype(np.float64)
    for i in range(200):
        t, ref = t * 0.99 + 0.01 * (i % 3), ref * 0.99 + 0.01 * (i % 3)
    assert_matches(t, ref, dtype="float32", rtol=1e-5, atol=1e-5)


def test_many_distinct_inputs_in_one_expression(device):
    xs = [sample(np.random.default_rng(100 + i), (4, 5), "any") for i in range(40)]
    total = Tensor(xs[0], device=device)
    for x in xs[1:]:
        total = total + Tensor(x, device=device)
    assert_matches(total, np.sum([x.astype(np.float64) for x in xs], axis=0), dtype="float32", rtol=1e-5, atol=1e-5)
