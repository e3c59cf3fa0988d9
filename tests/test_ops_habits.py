"""The ops a PyTorch user reaches for (issue 36) against numpy on every device, their gradients against PyTorch:
isnan/isinf/isfinite, any/all, masked_fill, tril/triu, norm, cumsum/cumprod, einsum, two index arrays, boolean masks
refused, and `dim=`/`keepdims=` beside `axis=`/`keepdim=` (with `max(dim=)`'s (values, indices) pair)."""

import math

import numpy as np
import pytest
import torch

import azyx
from azyx import GradientTape, Tensor, dtypes

SPECIALS = np.array([[0.0, -1.5, np.nan, np.inf], [-np.inf, 2.0, -0.0, 7.0]], np.float32)


async def test_isnan_isinf_isfinite(device):
    t = Tensor(SPECIALS, device=device)
    for name in ("isnan", "isinf", "isfinite"):
        got = getattr(t, name)()
        assert got.dtype == dtypes.bool and got.device == device
        np.testing.assert_array_equal(await got.numpy(), getattr(np, name)(SPECIALS), err_msg=name)
    ints = Tensor([1, -2], device=device)
    assert (await ints.isnan().numpy()).tolist() == [False, False]
    assert (await ints.isfinite().numpy()).tolist() == [True, True]


@pytest.mark.parametrize("axis", [None, 0, 1, -1, (0, 1)])
async def test_any_all(device, axis):
    x = np.array([[0, 0, 3], [1, 2, 0]], np.int32)
    for name in ("any", "all"):
        for keep in (False, True):
            got = getattr(Tensor(x, device=device), name)(dim=axis, keepdims=keep)
            want = getattr(np, name)(x, axis=axis, keepdims=keep)
            assert got.dtype == dtypes.bool and got.shape == want.shape
            np.testing.assert_array_equal(await got.numpy(), want)
    b = SPECIALS != 0
    np.testing.assert_array_equal(await Tensor(b, device=device).all(axis=axis).numpy(), np.all(b, axis=axis))
    empty = Tensor(np.zeros((2, 0), np.float32), device=device)
    assert (await empty.any(1).numpy()).tolist() == [False, False]
    assert (await empty.all(1).numpy()).tolist() == [True, True]


async def test_masked_fill_and_triangles_with_gradients(device):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 3, 4)).astype(np.float32)
    mask = rng.random((3, 4)) < 0.5
    xt, mt = Tensor(x, device=device), Tensor(mask, device=device)
    np.testing.assert_array_equal(await xt.masked_fill(mt, -9.0).numpy(), np.where(mask, np.float32(-9.0), x))
    for k in (-1, 0, 2):
        np.testing.assert_array_equal(await xt.tril(k).numpy(), np.tril(x, k))
        np.testing.assert_array_equal(await xt.triu(diagonal=k).numpy(), np.triu(x, k))
    ints = np.arange(12, dtype=np.int32).reshape(3, 4)
    np.testing.assert_array_equal(await Tensor(ints, device=device).tril().numpy(), np.tril(ints))
    assert Tensor(ints, device=device).masked_fill(Tensor(ints > 5, device=device), 2.5).dtype == dtypes.int32
    with GradientTape() as tape:
        loss = (xt.masked_fill(mt, 0.0).square().sum() + (xt.tril(1) * 3).sum() + xt.triu().exp().sum())
    got = await tape.gradient(loss, xt).numpy()
    r = torch.from_numpy(x).requires_grad_()
    m = torch.from_numpy(mask)
    (r.masked_fill(m, 0.0).square().sum() + (r.tril(1) * 3).sum() + r.triu().exp().sum()).backward()
    np.testing.assert_allclose(got, r.grad.numpy(), rtol=1e-5, atol=1e-6)
    with pytest.raises(azyx.DTypeError, match="bool mask"):
        xt.masked_fill(Tensor([1, 0, 1, 0], device=device), 0.0)
    with pytest.raises(azyx.ShapeError, match="2 dimensions"):
        Tensor([1.0, 2.0], device=device).tril()


@pytest.mark.parametrize("p", [2, "fro", 1, 3, math.inf, -math.inf, 0])
async def test_norm_matches_torch(device, p):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 5)).astype(np.float32)
    x[0, 0] = 0.0
    xt = Tensor(x, device=device)
    ref = torch.from_numpy(x).requires_grad_()
    for axis in (None, 1, 0):
        got = xt.norm(p, dim=axis) if axis is not None else xt.norm(p)
        want = torch.linalg.vector_norm(ref, ord=2 if p == "fro" else p, dim=axis)
        np.testing.assert_allclose(await got.numpy(), want.detach().numpy(), rtol=1e-5, atol=1e-6)
    assert xt.norm(p, dim=1, keepdim=True).shape == (3, 1)
    if p != 0:  # (the count of nonzeros has no gradient)
        with GradientTape() as tape:
            loss = xt.norm(p, axis=1).sum()
        torch.linalg.vector_norm(ref, ord=2 if p == "fro" else p, dim=1).sum().backward()
        np.testing.assert_allclose(await tape.gradient(loss, xt).numpy(), ref.grad.numpy(), rtol=1e-4, atol=1e-6)
    with pytest.raises(azyx.ArgumentError, match="-2"):
        xt.norm(-2)


async def test_norm_of_a_zero_vector_has_gradient_zero(device):
    x = np.array([[0.0, 0.0, 0.0], [3.0, 0.0, -4.0]], np.float32)
    xt = Tensor(x, device=device)
    for p in (2, 3):
        with GradientTape() as tape:
            loss = xt.norm(p, dim=1).sum()
        ref = torch.from_numpy(x).requires_grad_()
        torch.linalg.vector_norm(ref, ord=p, dim=1).sum().backward()
        np.testing.assert_allclose(await tape.gradient(loss, xt).numpy(), ref.grad.numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("n", [1, 2, 7, 64, 100])
async def test_cumsum_cumprod(device, n):
    rng = np.random.default_rng(n)
    x = rng.uniform(0.5, 1.5, size=(3, n)).astype(np.float32)
    xt = Tensor(x, device=device)
    np.testing.assert_allclose(await xt.cumsum(dim=1).numpy(), np.cumsum(x, axis=1), rtol=1e-5)
    np.testing.assert_allclose(await xt.cumprod(1).numpy(), np.cumprod(x, axis=1), rtol=1e-5)
    np.testing.assert_allclose(await xt.cumsum(axis=0).numpy(), np.cumsum(x, axis=0), rtol=1e-5)
    np.testing.assert_allclose(await xt.cumsum().numpy(), np.cumsum(x), rtol=1e-5)  # None: flattened, as numpy
    ints = rng.integers(-5, 6, size=(2, n)).astype(np.int32)
    got = Tensor(ints, device=device).cumsum(-1)
    assert got.dtype == dtypes.int32
    np.testing.assert_array_equal(await got.numpy(), np.cumsum(ints, axis=-1))
    np.testing.assert_array_equal(await Tensor(ints > 0, device=device).cumsum(1).numpy(), np.cumsum(ints > 0, 1))


async def test_cumsum_cumprod_gradients_match_torch(device):
    rng = np.random.default_rng(2)
    x = rng.standard_normal((2, 9)).astype(np.float32)
    x[1, 3] = 0.0  # cumprod's gradient through a zero
    w = rng.standard_normal((2, 9)).astype(np.float32)
    xt = Tensor(x, device=device)
    with GradientTape() as tape:
        loss = (xt.cumsum(1) * Tensor(w, device=device)).sum() + (xt.cumprod(dim=1) * Tensor(w, device=device)).sum()
    r = torch.from_numpy(x).requires_grad_()
    ((r.cumsum(1) * torch.from_numpy(w)).sum() + (r.cumprod(1) * torch.from_numpy(w)).sum()).backward()
    np.testing.assert_allclose(await tape.gradient(loss, xt).numpy(), r.grad.numpy(), rtol=1e-5, atol=1e-5)


EINSUMS = [
    ("ij,jk->ik", [(3, 4), (4, 5)]),
    ("bij,bjk->bik", [(2, 3, 4), (2, 4, 2)]),
    ("ij->ji", [(3, 4)]),
    ("ij->", [(3, 4)]),
    ("ii->i", [(4, 4)]),
    ("ii", [(4, 4)]),
    ("i,j->ij", [(3,), (5,)]),
    ("ij,ij->i", [(3, 4), (3, 4)]),
    ("ij,jk", [(2, 3), (3, 4)]),
    ("bhqd,bhkd->bhqk", [(1, 2, 3, 4), (1, 2, 5, 4)]),
    ("ij,jk,kl->il", [(2, 3), (3, 4), (4, 2)]),
]


@pytest.mark.parametrize("eq,shapes", EINSUMS)
async def test_einsum_matches_numpy_and_torch_gradients(device, eq, shapes):
    rng = np.random.default_rng(len(eq))
    xs = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    ts = [Tensor(x, device=device) for x in xs]
    with GradientTape() as tape:
        out = azyx.einsum(eq, *ts)
        loss = (out * out).sum()
    np.testing.assert_allclose(await out.numpy(), np.einsum(eq, *xs), rtol=1e-5, atol=1e-5)
    refs = [torch.from_numpy(x).requires_grad_() for x in xs]
    (torch.einsum(eq, *refs) ** 2).sum().backward()
    for g, r in zip(tape.gradient(loss, ts), refs):
        np.testing.assert_allclose(await g.numpy(), r.grad.numpy(), rtol=1e-4, atol=1e-4)


def test_einsum_errors():
    a = Tensor.ones(2, 3)
    with pytest.raises(azyx.ShapeError, match="'j'"):
        azyx.einsum("ij,jk->ik", a, a)
    with pytest.raises(azyx.ArgumentError, match="2 operands"):
        azyx.einsum("ij,jk->ik", a)
    with pytest.raises(azyx.ShapeError, match="names 3 axes"):
        azyx.einsum("ijk->i", a)
    with pytest.raises(azyx.ArgumentError, match=r"'\.\.\.'"):
        azyx.einsum("...i->i", a)
    np.testing.assert_array_equal(azyx.einsum("ij,jk", [a, a.T]).numpy_sync(), np.full((2, 2), 3.0))


KEYS = [
    ([0, 1], [1, 2]),
    ([0, 2], [1, 3], [4, 0]),
    (slice(None), [0, 3], [1, 2]),
    ([[0], [2]], [1, 3]),
    ([0, 1], slice(1, 3), [2, 4]),
    (Ellipsis, [0, -1], [2, 3]),
    (1, [0, 1], [2, 3]),
    ([0, -1], 2, [1, 1]),
    (None, [0, 1], [1, 2]),
]


@pytest.mark.parametrize("key", KEYS, ids=str)
async def test_two_index_arrays(device, key):
    x = np.arange(60, dtype=np.float32).reshape(3, 4, 5)
    np.testing.assert_array_equal(await Tensor(x, device=device)[key].numpy(), x[key])


async def test_two_index_tensors_and_their_gradient(device):
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    xt = Tensor(x, device=device)
    rows, cols = Tensor([0, 2, 2], device=device), Tensor([3, 1, 1], device=device)
    with GradientTape() as tape:
        picked = xt[rows, cols]
        loss = (picked * Tensor([1.0, 2.0, 3.0], device=device)).sum()
    np.testing.assert_array_equal(await picked.numpy(), x[[0, 2, 2], [3, 1, 1]])
    want = np.zeros_like(x)
    np.add.at(want, ([0, 2, 2], [3, 1, 1]), [1.0, 2.0, 3.0])  # a repeated point accumulates
    np.testing.assert_array_equal(await tape.gradient(loss, xt).numpy(), want)
    with pytest.raises(azyx.IndexOutOfRange, match="4"):
        xt[[0, 1], [1, 4]]


async def test_boolean_mask_index_names_where_and_masked_fill(device):
    x = Tensor([1.0, 5.0, 2.0], device=device)
    for mask in (x > 3, np.array([True, False, True]), [True, False, True]):
        with pytest.raises(azyx.DTypeError, match=r"Tensor\.where.*masked_fill"):
            x[mask]


async def test_dim_and_keepdims_everywhere(device):
    x = np.random.default_rng(3).standard_normal((2, 3, 4)).astype(np.float32)
    t = Tensor(x, device=device)
    for name in ("sum", "mean", "prod", "max", "min", "var", "std", "logsumexp", "argmax", "argmin"):
        a = getattr(t, name)(axis=1, keepdim=True)
        b = getattr(t, name)(dim=1, keepdims=True)
        if name in ("max", "min"):
            b = b.values
        assert a.shape == b.shape == (2, 1, 4), name
        np.testing.assert_array_equal(await a.numpy(), await b.numpy(), err_msg=name)
    np.testing.assert_allclose(await t.softmax(dim=1).numpy(), await t.softmax(axis=1).numpy())
    np.testing.assert_allclose(await t.log_softmax(dim=0).numpy(), await t.log_softmax(0).numpy())
    assert Tensor.cat([t, t], dim=2).shape == (2, 3, 8) and Tensor.stack([t, t], dim=1).shape == (2, 2, 3, 4)
    assert [p.shape for p in t.split(2, dim=2)] == [(2, 3, 2), (2, 3, 2)] and len(t.chunk(3, dim=1)) == 3
    assert t.unsqueeze(dim=0).shape == (1, 2, 3, 4) and t[:, :1].squeeze(dim=1).shape == (2, 4)
    np.testing.assert_array_equal(await t.flip(dim=0).numpy(), x[::-1])
    with pytest.raises(azyx.ArgumentError, match="axis= and dim="):
        t.sum(axis=0, dim=1)


async def test_max_with_dim_is_torchs_pair(device):
    x = np.array([[1.0, 5.0, 5.0], [7.0, 2.0, 0.0]], np.float32)
    t = Tensor(x, device=device)
    values, indices = t.max(dim=1)
    ref = torch.from_numpy(x).max(dim=1)
    np.testing.assert_array_equal(await values.numpy(), ref.values.numpy())
    np.testing.assert_array_equal(await indices.numpy(), [1, 0])  # the first index of the maximum
    low = t.min(dim=0, keepdim=True)
    assert low.values.shape == low.indices.shape == (1, 3)
    np.testing.assert_array_equal(await low.indices.numpy(), [[0, 1, 1]])
    np.testing.assert_array_equal(await t.max(axis=1).numpy(), [5.0, 7.0])  # numpy's name: the values
    with pytest.raises(azyx.ArgumentError, match=r"dim=axis"):
        values, indices = t.max(-1)  # torch's habit by position: refused, never two rows' maxima
    assert float(await t.max()) == 7.0
    other = Tensor([[2.0, 2.0, 9.0], [1.0, 3.0, -1.0]], device=device)  # PyTorch's x.max(y): elementwise
    np.testing.assert_array_equal(await t.max(other).numpy(), np.maximum(x, await other.numpy()))
    np.testing.assert_array_equal(await t.min(other).numpy(), np.minimum(x, await other.numpy()))
