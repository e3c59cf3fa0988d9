"""Gather for real (issue 18) on every device against numpy: `t[idx]` (one integer index at any position, numpy's
placement of the result's axes), `gather(axis, index)` and `nn.Embedding` read at data-dependent addresses (one load
whose address was loaded, fused with its consumers and with the index's producers), never outside the tensor; host
indices out of range raise at the call; gradients scatter-add (repeated indices accumulate), against PyTorch."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from compare import assert_matches

import azyx
from azyx import GradientTape, Tensor, nn
from azyx.errors import DTypeError, IndexOutOfRange, ShapeError

try:
    import torch
except ImportError:
    torch = None  # type: ignore[assignment]

RNG = np.random.default_rng(18)


def table(shape: tuple[int, ...], dtype: str = "float32") -> np.ndarray:
    return (np.arange(int(np.prod(shape))) + 1).reshape(shape).astype(dtype)  # every row distinct


# (table shape, index, key builder from an index, numpy reference key)
INDEXES: list[tuple[str, tuple[int, ...], Any, Callable[[Any], Any]]] = [
    ("rows", (5, 3), np.array([4, 0, 2]), lambda i: i),
    ("0d", (5, 3), np.array(3), lambda i: i),
    ("0d_negative", (5, 3), np.array(-1), lambda i: i),
    ("size1", (5, 3), np.array([2]), lambda i: i),
    ("negative", (5, 3), np.array([-1, -5, 0, -2]), lambda i: i),
    ("duplicates", (5, 3), np.array([1, 1, 4, 1]), lambda i: i),
    ("2d_index", (6, 2, 2), np.array([[0, 5], [3, -3], [1, 1]]), lambda i: i),
    ("1d_table", (7,), np.array([6, 0, -7, 3]), lambda i: i),
    ("empty_index", (5, 3), np.zeros((0,), np.int64), lambda i: i),
    ("second_axis", (3, 6, 2), np.array([[5, 0], [-1, 2]]), lambda i: (slice(None), i)),
    ("last_axis_ellipsis", (2, 3, 4), np.array([3, -4, 1]), lambda i: (Ellipsis, i)),
    ("after_int", (4, 5, 2), np.array([4, 1]), lambda i: (2, i)),
    ("int_apart", (4, 5, 2), np.array([0, 3, 3]), lambda i: (i, slice(None), 1)),
    ("int_apart_after", (4, 5, 2), np.array([1, 0]), lambda i: (3, slice(None), i)),
    ("with_slice_and_none", (6, 5), np.array([[4], [0]]), lambda i: (slice(1, 4), None, i)),
    ("size1_axes", (1, 4, 1), np.array([0, 0]), lambda i: (i, slice(None), 0)),
]


@pytest.mark.parametrize("name,shape,idx,key", INDEXES, ids=[c[0] for c in INDEXES])
@pytest.mark.parametrize("kind", ["tensor", "int64_tensor", "host"])
def test_integer_indexing_matches_numpy(device: str, name: str, shape: tuple[int, ...], idx: np.ndarray,
                                        key: Callable[[Any], Any], kind: str) -> None:
    x = table(shape)
    if kind == "host":
        i: Any = idx.tolist() if idx.ndim else idx
    else:
        i = Tensor(idx.astype(np.int64 if kind == "int64_tensor" else np.int32), device=device)
    assert_matches(Tensor(x, device=device)[key(i)], x[key(idx)], dtype="float32")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float64", "int8", "int64", "bool", "uint8"])
def test_indexing_keeps_the_table_dtype(device: str, dtype: str) -> None:
    x = (table((6, 3)) % 5).astype(np.float32) if dtype != "bool" else table((6, 3)) % 3 == 0
    t = Tensor(x, dtype=dtype, device=device)
    idx = np.array([5, 0, -2, 5])
    got = t[Tensor(idx.astype(np.int16), device=device)]  # a narrow index tensor too
    want = t.numpy_sync()[idx]
    assert got.dtype == t.dtype
    np.testing.assert_array_equal(got.numpy_sync(), want)


@pytest.mark.parametrize("axis", [0, 1, 2, -1])
def test_gather_matches_numpy(device: str, axis: int) -> None:
    x = RNG.standard_normal((4, 5, 6)).astype(np.float32)
    shape = list(x.shape)
    shape[axis] = 7  # longer than the axis: repeated indices
    idx = RNG.integers(-x.shape[axis], x.shape[axis], shape)
    got = Tensor(x, device=device).gather(axis, Tensor(idx.astype(np.int32), device=device))
    assert_matches(got, np.take_along_axis(x, idx, axis), dtype="float32")


def test_gather_with_a_host_index_and_a_smaller_index(device: str) -> None:
    x = table((4, 5))
    idx = [[4, 0], [-1, 1], [2, 2]]  # 3 of 4 rows, 2 of 5 columns
    got = Tensor(x, device=device).gather(1, idx)
    assert_matches(got, np.take_along_axis(x[:3], np.array(idx), 1), dtype="float32")


def test_out_of_range_host_index_raises_naming_it(device: str) -> None:
    t = Tensor(table((5, 3)), device=device)
    with pytest.raises(IndexOutOfRange, match="index 5 is out of range"):
        t[[0, 5]]
    with pytest.raises(IndexOutOfRange, match="index -6 is out of range"):
        t[np.array([[-6]])]
    with pytest.raises(IndexOutOfRange, match="index 3 is out of range"):
        t.gather(1, [[0, 3]])
    with pytest.raises(IndexOutOfRange, match="index 7 is out of range for axis 1"):
        t[:, [7]]
    with pytest.raises(IndexOutOfRange):
        Tensor.zeros(0, 3, device=device)[Tensor([0], device=device)]
    with pytest.raises(DTypeError):
        t[Tensor([0.0], device=device)]
    with pytest.raises(DTypeError):
        t[Tensor([True, False], device=device)]
    with pytest.raises(ShapeError):
        t.gather(0, [0, 1])
    with pytest.raises(IndexOutOfRange, match="index 3 is out of range for axis 1"):
        t[[0], [3]]  # two index arrays (tests/test_ops_habits.py) check each axis too
    np.testing.assert_array_equal((t[[4, -5]] + 0).numpy_sync(), table((5, 3))[[4, 0]])  # still usable


def test_out_of_range_tensor_index_never_reads_outside(device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """An index only known when the kernel runs raises IndexOutOfRange (naming one of the bad values) when realized;
    with the checks off (AZYX_CHECKS=0) it is wrapped once from the end and clamped into the axis: the values of the
    tensor, never memory beside it."""
    from azyx.runtime import RT

    x = table((5, 3))
    idx = np.array([7, -9, 1000000, -1, -2147483647, 2147483647], np.int64)
    bad = "|".join(str(i) for i in idx if not -5 <= i < 5)
    with pytest.raises(IndexOutOfRange, match=rf"index ({bad}) is out of range for an axis of size 5"):
        Tensor(x, device=device)[Tensor(idx.astype(np.int32), device=device)].numpy_sync()
    with pytest.raises(IndexOutOfRange, match=r"index (3|-4|9) is out of range for an axis of size 3"):
        Tensor(x, device=device).gather(1, Tensor(np.array([[3, -4, 9]] * 5, np.int64), device=device)).numpy_sync()
    monkeypatch.setenv("AZYX_CHECKS", "0")
    RT.plan_cache.clear()  # (plans are made with or without the checks)
    got = Tensor(x, device=device)[Tensor(idx.astype(np.int32), device=device)]
    rows = np.clip(np.where(idx < 0, idx + 5, idx), 0, 4)
    np.testing.assert_array_equal(got.numpy_sync(), x[rows])
    got = Tensor(x, device=device).gather(1, Tensor(np.array([[3, -4, 9]] * 5, np.int64), device=device))
    np.testing.assert_array_equal(got.numpy_sync(), x[:, [2, 0, 2]])
    RT.plan_cache.clear()


def test_gather_fuses_with_consumers_and_the_index_producer(device: str) -> None:
    x = RNG.standard_normal((50, 8)).astype(np.float32)
    idx = RNG.integers(0, 49, (6,))
    t, i = Tensor(x, device=device), Tensor(idx.astype(np.int32), device=device)
    out = ((t * 2)[i + 1] + 1).exp()  # computed table, computed index, consumers: one kernel
    plan = azyx.schedule(out)
    assert len(plan.kernels) == 1, plan.describe()
    assert_matches(out, np.exp((x * 2)[idx + 1] + 1), dtype="float32")
    rows = t[i]
    both = rows.sum(axis=1) + rows.max(axis=1)  # one gathered tensor read by two reduces
    assert_matches(both, x[idx].sum(axis=1) + x[idx].max(axis=1), dtype="float32", rtol=1e-5)


def test_embedding_module_matches_numpy(device: str) -> None:
    emb = nn.Embedding(100, 16, device=device)
    ids = RNG.integers(0, 100, (4, 7))
    w = emb.weight.numpy_sync()
    assert_matches(emb(Tensor(ids.astype(np.int32), device=device)), w[ids], dtype="float32")


def test_a_new_index_value_reuses_the_plan(device: str) -> None:
    from azyx.runtime import RT

    x = table((9, 4))
    t = Tensor(x, device=device)
    for k, idx in enumerate(([1, 2], [1, 2], [8, -1], [0, 0])):
        got = (t[Tensor(np.array(idx, np.int32), device=device)] * 3).numpy_sync()
        np.testing.assert_array_equal(got, x[idx] * 3)
        if k == 1:  # (the first run may upload t's host data to the device: the second plans as all later)
            plans, compiled = len(RT.plan_cache), RT.compiled
    assert (len(RT.plan_cache), RT.compiled) == (plans, compiled)


# ---- gradients: a scatter-add --------------------------------------------------------------------------------------
def _grad(device: str, x: np.ndarray, f: Callable[[Tensor], Tensor]) -> np.ndarray:
    t = Tensor(x, device=device)
    with GradientTape() as tape:
        loss = f(t)
    (g,) = tape.gradient(loss, [t])
    return g.numpy_sync()


def _torch_grad(x: np.ndarray, f: Callable[[Any], Any]) -> np.ndarray:
    tx = torch.tensor(x, requires_grad=True)
    f(tx).backward()
    return tx.grad.numpy()


def _numeric_grad(x: np.ndarray, f: Callable[[np.ndarray], float], eps: float = 1e-3) -> np.ndarray:
    g = np.zeros_like(x, dtype=np.float64)
    for k in range(x.size):
        d = np.zeros(x.size)
        d[k] = eps
        g.flat[k] = (f(x + d.reshape(x.shape)) - f(x - d.reshape(x.shape))) / (2 * eps)
    return g


W = (np.arange(4 * 3 * 2) % 7 - 3).astype(np.float32)


@pytest.mark.parametrize("case", ["rows_with_duplicates", "second_axis", "gather_axis1", "negative", "2d_index"])
def test_gradients_scatter_add(device: str, case: str) -> None:
    x = RNG.standard_normal((5, 4)).astype(np.float32)
    idx = {"rows_with_duplicates": np.array([1, 3, 1, 1, 0]), "second_axis": np.array([3, 3, 0]),
           "gather_axis1": np.array([[0, 3, 3], [1, 1, 1], [2, 0, 1], [3, 3, 3], [0, 0, 2]]),
           "negative": np.array([-1, -1, 2]), "2d_index": np.array([[0, 4], [4, 4]])}[case]
    weight = np.resize(W, {"second_axis": (5, 3), "gather_axis1": (5, 3)}.get(case, idx.shape + (4,)))

    def pick(t: Any, i: Any) -> Any:
        if case == "second_axis":
            return t[:, i]
        if case == "gather_axis1":
            return t.gather(1, i)
        return t[i]

    got = _grad(device, x, lambda t: (pick(t, Tensor(idx.astype(np.int32), device=device)).square()
                                      * Tensor(weight, device=device)).sum())
    if torch is not None:
        ti = torch.tensor(idx % np.array(x.shape[1] if case in ("second_axis", "gather_axis1") else x.shape[0]))
        want = _torch_grad(x, lambda t: (pick(t, ti).square() * torch.tensor(weight)).sum())
    else:
        want = _numeric_grad(x.astype(np.float64), lambda v: float(
            (np.square(np.take_along_axis(v, idx, 1) if case == "gather_axis1" else
                       v[:, idx] if case == "second_axis" else v[idx]) * weight).sum()))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_embedding_gradient_accumulates_repeated_ids(device: str) -> None:
    emb = nn.Embedding(30, 8, device=device)
    ids = np.array([[3, 3, 29], [0, 3, 29]])
    w = emb.weight.numpy_sync()
    with GradientTape() as tape:
        loss = (emb(Tensor(ids.astype(np.int32), device=device)) * 2.0).tanh().sum()
    (g,) = tape.gradient(loss, [emb.weight])
    want = np.zeros_like(w)
    np.add.at(want, ids.reshape(-1), (2 * (1 - np.tanh(2 * w[ids]) ** 2)).reshape(-1, 8))
    np.testing.assert_allclose(g.numpy_sync(), want, rtol=1e-5, atol=1e-5)  # (GLSL's tanh: ~1e-6 off)


def test_second_derivative_through_gather(device: str) -> None:
    x = RNG.standard_normal((4, 3)).astype(np.float32)
    idx = np.array([2, 2, 0])
    t = Tensor(x, device=device)
    with GradientTape() as outer:
        with GradientTape() as inner:
            y = t[Tensor(idx.astype(np.int32), device=device)].square().square().sum()
        (g,) = inner.gradient(y, [t])
        z = (g * g).sum()  # the gradient is a scatter: differentiate through it
    (gg,) = outer.gradient(z, [t])
    # y = sum_j x[idx_j]^4: g = c * 4x^3 (c: how often the row is read); z = sum c^2 16 x^6; dz/dx = c^2 96 x^5
    c = np.bincount(idx, minlength=4)[:, None].astype(np.float64)
    np.testing.assert_allclose(gg.numpy_sync(), c * c * 96 * x.astype(np.float64) ** 5, rtol=1e-4, atol=1e-4)
