"""Factories (zeros ones full arange eye rand randn uniform zeros_like ones_like, manual_seed), construction from
Python data, attributes (shape dtype device ndim numel len), `.to`, and the async accessors numpy/item/tolist."""

import numpy as np
import pytest
from compare import assert_matches

import azyx
from azyx import Tensor, dtypes

# ---- deterministic factories ------------------------------------------------------------------------------------

# id, factory call given the device, numpy reference, result dtype
FACTORIES = [
    ("zeros", lambda d: Tensor.zeros(2, 3, device=d), np.zeros((2, 3)), "float32"),
    ("zeros_tuple", lambda d: Tensor.zeros((2, 3), device=d), np.zeros((2, 3)), "float32"),
    ("zeros_0d", lambda d: Tensor.zeros(device=d), np.zeros(()), "float32"),
    ("zeros_size0", lambda d: Tensor.zeros(0, 4, device=d), np.zeros((0, 4)), "float32"),
    ("zeros_float64", lambda d: Tensor.zeros(3, dtype=np.float64, device=d), np.zeros(3), "float64"),
    ("ones", lambda d: Tensor.ones(4, 1, 2, device=d), np.ones((4, 1, 2)), "float32"),
    ("ones_int8", lambda d: Tensor.ones(5, dtype="int8", device=d), np.ones(5), "int8"),
    ("ones_bool", lambda d: Tensor.ones(2, 2, dtype=dtypes.bool, device=d), np.ones((2, 2), bool), "bool"),
    ("full_float", lambda d: Tensor.full((2, 3), 2.5, device=d), np.full((2, 3), 2.5), "float32"),
    ("full_int", lambda d: Tensor.full((3,), 7, device=d), np.full(3, 7), "int32"),
    ("full_bool", lambda d: Tensor.full((2,), True, device=d), np.full(2, True), "bool"),
    ("full_f16", lambda d: Tensor.full((2, 2), -3, dtype=dtypes.float16, device=d), np.full((2, 2), -3.0), "float16"),
    (
        "full_np_dtype",
        lambda d: Tensor.full((4,), 1.5, dtype=np.dtype("float64"), device=d),
        np.full(4, 1.5),
        "float64",
    ),
    ("arange_stop", lambda d: Tensor.arange(5, device=d), np.arange(5), "int32"),
    ("arange_step", lambda d: Tensor.arange(2, 10, 3, device=d), np.arange(2, 10, 3), "int32"),
    ("arange_negative_start", lambda d: Tensor.arange(-3, 3, 2, device=d), np.arange(-3, 3, 2), "int32"),
    ("arange_negative_step", lambda d: Tensor.arange(5, 0, -1, device=d), np.arange(5, 0, -1), "int32"),
    ("arange_negative_step_uneven", lambda d: Tensor.arange(7, -4, -3, device=d), np.arange(7, -4, -3), "int32"),
    ("arange_float_step", lambda d: Tensor.arange(0, 1, 0.1, device=d), np.arange(0, 1, 0.1), "float32"),
    ("arange_float_start", lambda d: Tensor.arange(0.5, 3, device=d), np.arange(0.5, 3), "float32"),
    ("arange_float_neg", lambda d: Tensor.arange(1.0, -1.0, -0.25, device=d), np.arange(1.0, -1.0, -0.25), "float32"),
    ("arange_empty", lambda d: Tensor.arange(0, device=d), np.arange(0), "int32"),
    ("arange_empty_range", lambda d: Tensor.arange(3, 3, device=d), np.arange(3, 3), "int32"),
    ("arange_dtype", lambda d: Tensor.arange(4, dtype="float64", device=d), np.arange(4.0), "float64"),
    ("eye", lambda d: Tensor.eye(3, device=d), np.eye(3), "float32"),
    ("eye_1", lambda d: Tensor.eye(1, device=d), np.eye(1), "float32"),
    ("eye_int32", lambda d: Tensor.eye(4, dtype="int32", device=d), np.eye(4, dtype=np.int32), "int32"),
]


@pytest.mark.parametrize("name,make,ref,dtype", FACTORIES, ids=[f[0] for f in FACTORIES])
def test_factory(device, name, make, ref, dtype):
    t = make(device)
    assert t.device == device
    assert_matches(t, ref.astype(dtype), dtype=dtype)


@pytest.mark.parametrize("src_dtype", ["float32", "int32", "bool", "float16"])
def test_zeros_like_and_ones_like(device, src_dtype):
    src = Tensor(np.arange(6).reshape(2, 3).astype(src_dtype), device=device)
    z, o = Tensor.zeros_like(src), Tensor.ones_like(src)
    assert z.device == o.device == device
    assert_matches(z, np.zeros((2, 3), src_dtype), dtype=src_dtype)
    assert_matches(o, np.ones((2, 3), src_dtype), dtype=src_dtype)
    assert_matches(Tensor.ones_like(src, dtype="float64"), np.ones((2, 3)), dtype="float64")
    assert_matches(Tensor.zeros_like(src[:, ::2].T), np.zeros((2, 2), src_dtype), dtype=src_dtype)


def test_factories_feed_ops(device):
    out = (Tensor.arange(6, device=device).reshape(2, 3) + Tensor.eye(3, device=device)[:2]) * Tensor.full(
        (3,), 2, device=device
    )
    assert_matches(out, (np.arange(6).reshape(2, 3) + np.eye(3)[:2]) * 2, dtype="float32")


# ---- random factories -------------------------------------------------------------------------------------------
# Bounds below sit many standard deviations from the expected value: they fail on a broken generator, not by chance.


def test_rand_is_uniform_in_unit_interval(device):
    azyx.manual_seed(0)
    t = Tensor.rand(100, 1000, device=device)
    assert t.dtype == dtypes.float32 and t.shape == (100, 1000) and t.device == device
    r = t.numpy_sync()
    assert r.min() >= 0.0 and r.max() < 1.0
    assert abs(r.mean() - 0.5) < 0.01  # standard error 0.0009
    counts, _ = np.histogram(r, bins=10, range=(0.0, 1.0))
    assert np.all(np.abs(counts - 10_000) < 600), counts  # each bin: standard deviation 95


def test_randn_is_standard_normal(device):
    azyx.manual_seed(1)
    r = Tensor.randn(100_000, device=device).numpy_sync()
    assert r.dtype == np.float32 and np.isfinite(r).all()
    assert abs(r.mean()) < 0.03  # standard error 0.003
    assert abs(r.std() - 1.0) < 0.03
    assert abs(np.mean(np.abs(r) > 2.0) - 0.0455) < 0.006  # the tails of a normal: standard deviation 0.0007


def test_uniform_respects_bounds(device):
    azyx.manual_seed(2)
    r = Tensor.uniform(50_000, low=-2.0, high=3.0, device=device).numpy_sync()
    assert r.min() >= -2.0 and r.max() < 3.0
    assert abs(r.mean() - 0.5) < 0.07  # standard error 0.0065
    assert r.min() < -1.9 and r.max() > 2.9


@pytest.mark.parametrize("dtype", ["float16", "float64"])
def test_rand_other_dtypes_stay_in_unit_interval(device, dtype):
    azyx.manual_seed(3)
    t = Tensor.rand(20_000, dtype=dtype, device=device)
    r = t.numpy_sync()
    assert t.dtype == getattr(dtypes, dtype) and r.dtype == np.dtype(dtype)
    assert r.min() >= 0.0 and r.max() < 1.0  # float16 must not round values near 1 up to 1.0
    assert abs(r.astype(np.float64).mean() - 0.5) < 0.02


@pytest.mark.parametrize("factory", ["rand", "randn", "uniform"])
def test_manual_seed_reproduces_and_distinguishes(device, factory):
    make = getattr(Tensor, factory)

    def draw(seed):
        azyx.manual_seed(seed)
        return make(3, 337, device=device).numpy_sync()

    first, again, other = draw(7), draw(7), draw(8)
    np.testing.assert_array_equal(first, again)
    assert np.mean(first != other) > 0.99


def test_consecutive_random_tensors_differ(device):
    azyx.manual_seed(4)
    a, b = Tensor.rand(1000, device=device), Tensor.rand(1000, device=device)
    c = Tensor.randn(4, 250, device=device).reshape(1000)
    ra, rb, rc = a.numpy_sync(), b.numpy_sync(), c.numpy_sync()
    assert np.mean(ra != rb) > 0.99 and np.mean(ra != rc) > 0.99
    assert np.mean(ra[1:] != ra[:-1]) > 0.99  # no repeated neighbours within one tensor


async def test_random_tensors_realized_together_differ(device):
    azyx.manual_seed(5)
    a, b = Tensor.rand(500, device=device), Tensor.rand(500, device=device)
    await azyx.realize(a, b)
    ra, rb = await a.numpy(), await b.numpy()
    assert np.mean(ra != rb) > 0.99


def test_random_in_an_expression_is_drawn_once(device):
    # one random tensor used twice in a graph holds the same values in both uses
    azyx.manual_seed(6)
    r = Tensor.rand(64, device=device)
    both = Tensor.stack([r, r * 1.0]).numpy_sync()
    np.testing.assert_array_equal(both[0], both[1])
    assert_matches(r, both[0])


# ---- construction and attributes --------------------------------------------------------------------------------

# data, expected shape, expected dtype
FROM_DATA = [
    (1.5, (), "float32"),
    (3, (), "int32"),
    (True, (), "bool"),
    ([1.0, 2.0, 3.5], (3,), "float32"),
    ([[1, 2], [3, 4], [5, 6]], (3, 2), "int32"),
    ([1, 2.5], (2,), "float32"),
    ([[True, False]], (1, 2), "bool"),
    ([], (0,), "float32"),
]


@pytest.mark.parametrize("data,shape,dtype", FROM_DATA, ids=str)
def test_tensor_from_python_data(device, data, shape, dtype):
    t = Tensor(data, device=device)
    assert t.shape == shape and isinstance(t.shape, tuple) and all(type(n) is int for n in t.shape)
    assert t.ndim == len(shape)
    assert t.numel() == int(np.prod(shape))
    assert t.device == device
    assert_matches(t, np.array(data, dtype=dtype).reshape(shape), dtype=dtype)


def test_tensor_copies_its_numpy_input(device):
    x = np.arange(6, dtype=np.float32)
    t = Tensor(x, device=device)
    lazy = t * 2.0
    x[:] = -1.0  # the caller reuses its array before anything is realized
    assert_matches(t, np.arange(6), dtype="float32")
    assert_matches(lazy, np.arange(6) * 2.0, dtype="float32")
    out = t.numpy_sync()
    out[:] = 5.0  # and the array numpy_sync returns is the caller's own
    assert_matches(t, np.arange(6), dtype="float32")


@pytest.mark.parametrize(
    "view",
    [
        lambda x: x.T,
        lambda x: x[::2, ::-1],
        lambda x: x[:, 1:4],
        lambda x: np.asfortranarray(x),
        lambda x: np.broadcast_to(x[:1], (3, 5)),  # read-only, zero strides
    ],
    ids=["transposed", "negative_step", "column_slice", "fortran", "broadcast"],
)
def test_tensor_from_strided_numpy_views(device, view):
    x = np.arange(15, dtype=np.float32).reshape(3, 5)
    v = view(x)
    assert_matches(Tensor(v, device=device), v.copy(), dtype="float32")
    assert_matches(Tensor(v, device=device) + 1.0, v + 1.0, dtype="float32")


def test_attributes(device):
    t = Tensor(np.zeros((4, 2, 3), np.float32), device=device)
    assert t.shape == (4, 2, 3)
    assert t.dtype == dtypes.float32
    assert t.device == device
    assert t.ndim == 3
    assert t.numel() == 24
    assert len(t) == 4
    view = t.permute(2, 0, 1)[1:]
    assert (view.shape, view.ndim, view.numel(), len(view)) == ((2, 4, 2), 3, 16, 2)
    assert view.device == device and view.dtype == dtypes.float32
    r = t.sum(axis=(0, 2))
    assert (r.shape, r.ndim, r.numel(), len(r)) == ((2,), 1, 2, 2)
    s = t.sum()
    assert (s.shape, s.ndim, s.numel()) == ((), 0, 1)


def test_devices_lists_the_device_and_to_moves_lazily(device):
    assert device in azyx.devices()
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    for src in azyx.devices():
        moved = (Tensor(x, device=src) * 2.0).to(device)
        assert moved.device == device
        assert_matches(moved + Tensor.ones(3, device=device), x * 2.0 + 1.0, dtype="float32")


# ---- async accessors --------------------------------------------------------------------------------------------


async def test_realize_returns_the_tensor_and_numpy_returns_an_owned_copy(device):
    x = np.arange(6, dtype=np.float32)
    t = Tensor(x, device=device) + 1.0
    assert await t.realize() is t
    first = await t.numpy()
    first[:] = -7.0
    np.testing.assert_array_equal(await t.numpy(), x + 1.0)
    np.testing.assert_array_equal(await (t * 2.0).numpy(), (x + 1.0) * 2.0)


async def test_item_returns_python_scalars(device):
    f = await (Tensor([1.5, 2.0], device=device).sum()).item()
    i = await Tensor(np.array([3, 4], np.int32), device=device).max().item()
    b = await (Tensor(2.0, device=device) > 1.0).item()
    assert (f, type(f)) == (3.5, float)
    assert (i, type(i)) == (4, int)
    assert (b, type(b)) == (True, bool)


async def test_tolist_returns_nested_python_lists(device):
    x = np.arange(6, dtype=np.int32).reshape(2, 3)
    got = await Tensor(x, device=device).tolist()
    assert got == [[0, 1, 2], [3, 4, 5]] and type(got[0][0]) is int
    got = await (Tensor(x, device=device) / 2).tolist()
    assert got == [[0.0, 0.5, 1.0], [1.5, 2.0, 2.5]] and type(got[1][2]) is float
    assert await Tensor(2.5, device=device).tolist() == 2.5
