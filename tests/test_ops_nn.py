"""Linear algebra and nn ops against numpy: matmul/@ (batched, broadcast, 1-D operands), dot, conv2d, max/avg pools,
layernorm, one_hot, softmax/log_softmax, dropout; and indexing: basic, integer-tensor, gather."""

import numpy as np
import pytest
from compare import assert_matches, sample

import azyx
from azyx import Tensor

# ---- matmul -----------------------------------------------------------------------------------------------------

MATMUL_SHAPES = [
    ((37, 53), (53, 29)),
    ((4, 4), (4, 4)),
    ((1, 7), (7, 1)),
    ((7, 1), (1, 5)),
    ((2, 3, 5), (5, 4)),
    ((2, 3, 5), (2, 5, 4)),
    ((2, 1, 3, 5), (4, 5, 6)),
    ((5,), (5, 3)),
    ((3, 5), (5,)),
    ((5,), (5,)),
    ((2, 3, 5), (5,)),
    ((5,), (2, 5, 3)),
    ((3, 0), (0, 4)),
    ((0, 3), (3, 4)),
    ((256, 256), (256, 256)),
]


@pytest.mark.parametrize("shapes", MATMUL_SHAPES, ids=str)
def test_matmul_float32(device, shapes):
    rng = np.random.default_rng(0)
    a, b = sample(rng, shapes[0], "small"), sample(rng, shapes[1], "small")
    out = Tensor(a, device=device) @ Tensor(b, device=device)
    assert_matches(out, a.astype(np.float64) @ b.astype(np.float64), dtype="float32", rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", ["float64", "int32", "float16"])
def test_matmul_other_dtypes(device, dtype):
    rng = np.random.default_rng(1)
    if dtype == "int32":
        a, b = sample(rng, (9, 13), "int", dtype), sample(rng, (13, 6), "int", dtype)
    else:
        a, b = sample(rng, (9, 13), "small", dtype), sample(rng, (13, 6), "small", dtype)
    tol = {"float16": {"rtol": 1e-2, "atol": 1e-2}}.get(dtype, {})
    ref = a.astype(np.int64 if dtype == "int32" else np.float64) @ b
    assert_matches(Tensor(a, device=device).matmul(Tensor(b, device=device)), ref, dtype=dtype, **tol)


def test_matmul_of_transposed_and_sliced_operands(device):
    rng = np.random.default_rng(2)
    at, bt = sample(rng, (53, 37), "small"), sample(rng, (29, 53), "small")
    ta, tb = Tensor(at, device=device), Tensor(bt, device=device)
    ref = at.T.astype(np.float64) @ bt.T
    tol = {"rtol": 1e-4, "atol": 1e-4}
    assert_matches(ta.T @ tb.T, ref, dtype="float32", **tol)
    assert_matches(ta[::2].T @ tb[::-1, ::2].T, at[::2].T.astype(np.float64) @ bt[::-1, ::2].T, **tol)
    assert_matches((ta.T @ tb.T).T, ref.T, **tol)  # a view of the product
    assert_matches((ta.T @ tb.T).sum(axis=0) + 1.0, ref.sum(axis=0) + 1.0, **tol)  # consumed by later ops


def test_matmul_chain(device):
    rng = np.random.default_rng(3)
    a, b, c = sample(rng, (6, 11), "small"), sample(rng, (11, 7), "small"), sample(rng, (7, 3), "small")
    ta, tb, tc = (Tensor(x, device=device) for x in (a, b, c))
    ref = np.maximum(a.astype(np.float64) @ b, 0.0) @ c
    assert_matches((ta @ tb).relu() @ tc, ref, rtol=1e-4, atol=1e-5)


def test_dot(device):
    rng = np.random.default_rng(4)
    a, b = sample(rng, (53,), "small"), sample(rng, (53,), "small")
    out = Tensor(a, device=device).dot(Tensor(b, device=device))
    assert_matches(out, np.dot(a.astype(np.float64), b), dtype="float32", rtol=1e-4, atol=1e-5)


# ---- conv2d and pools -------------------------------------------------------------------------------------------


def pair(v):
    return v if isinstance(v, tuple) else (v, v)


def conv2d_ref(x, w, bias, stride, padding):
    (sh, sw), (ph, pw) = pair(stride), pair(padding)
    xp = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (ph, ph), (pw, pw)))
    kh, kw = w.shape[2:]
    oh, ow = (xp.shape[2] - kh) // sh + 1, (xp.shape[3] - kw) // sw + 1
    out = np.zeros((x.shape[0], w.shape[0], oh, ow))
    for i in range(kh):
        for j in range(kw):
            window = xp[:, :, i : i + sh * (oh - 1) + 1 : sh, j : j + sw * (ow - 1) + 1 : sw]
            out += np.einsum("nchw,oc->nohw", window, w[:, :, i, j])
    return out if bias is None else out + bias[None, :, None, None]


# input shape, weight shape, bias, stride, padding
CONV_CASES = [
    ((2, 3, 9, 8), (4, 3, 3, 3), True, 1, 0),
    ((2, 3, 9, 8), (4, 3, 3, 3), False, 1, 1),
    ((2, 3, 9, 8), (4, 3, 3, 3), True, 2, 1),
    ((1, 2, 7, 7), (3, 2, 3, 3), True, 2, 0),
    ((2, 5, 6, 6), (7, 5, 1, 1), True, 1, 0),
    ((1, 3, 8, 7), (2, 3, 3, 2), True, 1, 1),
    ((1, 3, 9, 8), (2, 3, 3, 3), True, (2, 1), (1, 0)),
]


@pytest.mark.parametrize("xs,ws,bias,stride,padding", CONV_CASES, ids=str)
def test_conv2d(device, xs, ws, bias, stride, padding):
    rng = np.random.default_rng(5)
    x, w = sample(rng, xs, "small"), sample(rng, ws, "small")
    b = sample(rng, (ws[0],)) if bias else None
    out = Tensor(x, device=device).conv2d(
        Tensor(w, device=device), bias=None if b is None else Tensor(b, device=device), stride=stride, padding=padding
    )
    assert_matches(out, conv2d_ref(x, w, b, stride, padding), dtype="float32", rtol=1e-4, atol=1e-5)


def pool_ref(x, k, reduce):
    n, c, h, w = x.shape
    oh, ow = h // k, w // k  # PyTorch's defaults: stride k, no padding, the remainder dropped
    windows = x[:, :, : oh * k, : ow * k].reshape(n, c, oh, k, ow, k)
    return reduce(windows, axis=(3, 5))


@pytest.mark.parametrize(
    "shape,k", [((2, 3, 8, 6), 2), ((1, 2, 7, 5), 2), ((1, 1, 9, 9), 3), ((1, 2, 4, 4), 1)], ids=str
)
@pytest.mark.parametrize("name,reduce", [("max_pool2d", np.max), ("avg_pool2d", np.mean)])
def test_pool2d(device, name, reduce, shape, k):
    x = sample(np.random.default_rng(6), shape, "any") - 5.0  # all negative: a max that starts at 0 shows
    out = getattr(Tensor(x, device=device), name)(k)
    assert_matches(out, pool_ref(x.astype(np.float64), k, reduce), dtype="float32")


# ---- normalisation and softmax ----------------------------------------------------------------------------------


def layernorm_ref(x, axis, eps):
    mean = x.mean(axis=axis, keepdims=True)
    return (x - mean) / np.sqrt(x.var(axis=axis, keepdims=True) + eps)


@pytest.mark.parametrize("axis,eps", [(-1, 1e-5), (1, 1e-5), ((1, 2), 1e-5), (-1, 0.5)], ids=str)
def test_layernorm(device, axis, eps):
    x = sample(np.random.default_rng(7), (4, 7, 9), "any") * 3.0 + 1.0
    out = Tensor(x, device=device).layernorm(axis=axis, eps=eps)
    assert_matches(out, layernorm_ref(x.astype(np.float64), axis, eps), dtype="float32", rtol=1e-4, atol=1e-5)


def test_layernorm_defaults(device):
    x = sample(np.random.default_rng(8), (5, 6), "any")
    assert_matches(Tensor(x, device=device).layernorm(), layernorm_ref(x.astype(np.float64), -1, 1e-5), rtol=1e-4)


def softmax_ref(x, axis):
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def log_softmax_ref(x, axis):
    shifted = x - x.max(axis=axis, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=axis, keepdims=True))


@pytest.mark.parametrize("scale", [1.0, 50.0], ids=["normal", "large_logits"])
@pytest.mark.parametrize("axis", [-1, 0, 1])
@pytest.mark.parametrize("name,ref", [("softmax", softmax_ref), ("log_softmax", log_softmax_ref)])
def test_softmax(device, name, ref, axis, scale):
    x = sample(np.random.default_rng(9), (4, 7, 9), "any") * scale  # x 50: exp overflows without the max shift
    out = getattr(Tensor(x, device=device), name)(axis=axis)
    assert_matches(out, ref(x.astype(np.float64), axis), dtype="float32", rtol=1e-5, atol=1e-5)


def test_softmax_default_axis_and_float64(device):
    x = sample(np.random.default_rng(10), (3, 5), "any", "float64")
    assert_matches(Tensor(x, device=device).softmax(), softmax_ref(x, -1), dtype="float64")
    assert_matches(Tensor(x, device=device).log_softmax(), log_softmax_ref(x, -1), dtype="float64")


# ---- one_hot and dropout ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("idx,n", [([0, 2, 1, 3, 3], 4), ([[1, 0, 4], [4, 4, 2]], 5), ([0], 1)], ids=str)
def test_one_hot(device, idx, n):
    idx = np.array(idx, np.int32)
    assert_matches(Tensor(idx, device=device).one_hot(n), np.eye(n, dtype=np.int32)[idx])


def test_dropout_is_identity_outside_training(device):
    x = sample(np.random.default_rng(11), (8, 9), "any")
    assert_matches(Tensor(x, device=device).dropout(0.5), x, dtype="float32")


def training_mode():
    """API.md says dropout is active only in training mode but names no switch: use the implementation's
    `azyx.train()` (or tinygrad's `Tensor.train()`) context manager when there is one, else skip."""
    for switch in (getattr(azyx, "train", None), getattr(Tensor, "train", None)):
        if callable(switch):
            return switch()
    pytest.skip("API.md names no training-mode switch")


def test_dropout_in_training_zeroes_about_p_and_rescales_the_rest(device):
    with training_mode():
        out = Tensor.ones(200, 500, device=device).dropout(0.25).numpy_sync()
    kept = out != 0
    # 100k Bernoulli(0.75) draws: the kept fraction's standard deviation is 0.0014, so 0.01 is > 7 sigma
    assert abs(kept.mean() - 0.75) < 0.01
    np.testing.assert_allclose(out[kept], 1.0 / 0.75, rtol=1e-6)


# ---- indexing ---------------------------------------------------------------------------------------------------

BASIC_INDEXES = [
    1,
    -1,
    slice(1, 3),
    slice(None, None, 2),
    slice(None, None, -1),
    slice(None, None, -2),
    slice(4, 0, -2),
    slice(2, 100),
    slice(-100, 2),
    slice(3, 1),
    slice(None, None, 5),  # steps that leave one element
    slice(1, None, -2),
    (slice(None), slice(2, None, 6)),
    None,
    Ellipsis,
    (slice(1, -1, 2), slice(None, None, -1)),
    (Ellipsis, 0),
    (slice(None), None, 1),
    (1, Ellipsis, None),
    (0, 0, 0),
    (-2, slice(None), slice(None, None, -3)),
    (None, slice(1, None), None, slice(None, None, 3)),
    (slice(None, None, -1), 2, slice(5, 1, -1)),
]


@pytest.mark.parametrize("index", BASIC_INDEXES, ids=repr)
def test_basic_indexing(device, index):
    x = np.arange(5 * 6 * 7, dtype=np.float32).reshape(5, 6, 7)
    assert_matches(Tensor(x, device=device)[index], x[index], dtype="float32")


def test_indexing_to_0d_and_indexing_an_indexed_view(device):
    x = np.arange(12, dtype=np.int32).reshape(3, 4)
    t = Tensor(x, device=device)
    assert_matches(t[2, -1], x[2, -1], dtype="int32")
    assert_matches(t[1:, ::-1][0], x[1:, ::-1][0], dtype="int32")


@pytest.mark.parametrize("idx", [[2, 0, 5, 2], [[0, 1], [5, 4]], [3], [-1, 0, -6]], ids=str)
def test_integer_tensor_indexing_along_first_axis(device, idx):
    x = sample(np.random.default_rng(12), (6, 4))
    idx = np.array(idx, np.int32)
    assert_matches(Tensor(x, device=device)[Tensor(idx, device=device)], x[idx], dtype="float32")


def test_integer_tensor_index_computed_lazily(device):
    x = sample(np.random.default_rng(13), (6, 3))
    idx = Tensor(np.array([3, 1, 1], np.int32), device=device) * 2 - 1  # [5, 1, 1]
    assert_matches(Tensor(x, device=device)[idx], x[[5, 1, 1]], dtype="float32")


@pytest.mark.parametrize("axis", [0, 1, 2, -1])
def test_gather(device, axis):
    rng = np.random.default_rng(14)
    x = sample(rng, (4, 5, 6))
    idx_shape = list(x.shape)
    idx_shape[axis] = 3
    idx = rng.integers(0, x.shape[axis], size=idx_shape).astype(np.int32)
    out = Tensor(x, device=device).gather(axis, Tensor(idx, device=device))
    assert_matches(out, np.take_along_axis(x, idx, axis=axis), dtype="float32")


def test_gather_index_smaller_than_input_in_other_dims(device):
    # PyTorch: index may be smaller than the input outside `axis`; out[i, j, k] = x[i, idx[i, j, k], k]
    rng = np.random.default_rng(15)
    x = sample(rng, (4, 5, 6))
    idx = rng.integers(0, 5, size=(2, 7, 3)).astype(np.int32)
    out = Tensor(x, device=device).gather(1, Tensor(idx, device=device))
    assert_matches(out, np.take_along_axis(x[:2, :, :3], idx, axis=1), dtype="float32")
