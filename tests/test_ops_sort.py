"""sort, argsort and topk (a bitonic sorting network in the graph) against numpy and PyTorch on every device: values,
stable indices on ties, NaN placement, padding to a power of two, other axes, gradients against PyTorch."""

import numpy as np
import pytest
import torch

import azyx
from azyx import GradientTape, Tensor, dtypes


def ties_and_nans(rng, shape, dtype=np.float32):
    x = rng.integers(-3, 4, size=shape).astype(dtype)  # few distinct values: many ties
    if np.dtype(dtype).kind == "f":
        x[rng.random(shape) < 0.15] = np.nan
    return x


@pytest.mark.parametrize("n", [1, 2, 5, 8, 13])
async def test_sort_matches_stable_numpy(device, n):
    rng = np.random.default_rng(n)
    x = ties_and_nans(rng, (3, n))
    values, indices = Tensor(x, device=device).sort()
    want = np.argsort(x, axis=-1, kind="stable")  # numpy also sorts NaN last
    assert indices.dtype == dtypes.int32 and indices.device == device and values.dtype == dtypes.float32
    np.testing.assert_array_equal(await indices.numpy(), want)
    np.testing.assert_array_equal(await values.numpy(), np.take_along_axis(x, want, -1))


async def test_sort_descending_matches_torch_stable(device):
    rng = np.random.default_rng(1)
    x = ties_and_nans(rng, (4, 11))
    values, indices = Tensor(x, device=device).sort(dim=1, descending=True, stable=True)
    ref = torch.sort(torch.from_numpy(x), dim=1, descending=True, stable=True)  # NaN first, ties in input order
    np.testing.assert_array_equal(await indices.numpy(), ref.indices.numpy())
    np.testing.assert_array_equal(await values.numpy(), ref.values.numpy())


@pytest.mark.parametrize("dtype", ["int32", "bool", "float16"])
async def test_argsort_dtypes_and_axes(device, dtype):
    rng = np.random.default_rng(2)
    x = (rng.integers(-5, 6, size=(3, 6, 4)) if dtype != "bool" else rng.random((3, 6, 4)) < 0.5).astype(dtype)
    for axis in (0, 1, -1):
        got = await Tensor(x, device=device).argsort(axis=axis).numpy()
        np.testing.assert_array_equal(got, np.argsort(x, axis=axis, kind="stable"))
    got = await Tensor(x, device=device).argsort(dim=1, descending=True).numpy()
    want = torch.sort(torch.from_numpy(x.astype(np.float32)), dim=1, descending=True, stable=True).indices
    np.testing.assert_array_equal(got, want.numpy())


async def test_topk_matches_torch(device):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((5, 9)).astype(np.float32)
    for k, largest in ((1, True), (3, True), (4, False), (9, True)):
        values, indices = Tensor(x, device=device).topk(k, dim=-1, largest=largest)
        ref = torch.topk(torch.from_numpy(x), k, dim=-1, largest=largest)
        np.testing.assert_array_equal(await indices.numpy(), ref.indices.numpy())
        np.testing.assert_array_equal(await values.numpy(), ref.values.numpy())
    values, indices = Tensor(x, device=device).topk(2, axis=0)
    np.testing.assert_array_equal(await indices.numpy(), torch.topk(torch.from_numpy(x), 2, dim=0).indices.numpy())
    with pytest.raises(azyx.ArgumentError, match="k=10"):
        Tensor(x, device=device).topk(10)


async def test_sort_and_topk_gradients_match_torch(device):
    rng = np.random.default_rng(4)
    x = rng.standard_normal((3, 7)).astype(np.float32)
    w = rng.standard_normal((3, 7)).astype(np.float32)
    xt = Tensor(x, device=device)
    with GradientTape() as tape:
        values, _ = xt.sort(dim=1, descending=True)
        top, _ = xt.topk(3)
        loss = (values * Tensor(w, device=device)).sum() + top.square().sum()
    got = await tape.gradient(loss, xt).numpy()
    ref = torch.from_numpy(x).requires_grad_()
    ordered = torch.sort(ref, dim=1, descending=True).values
    ((ordered * torch.from_numpy(w)).sum() + torch.topk(ref, 3).values.square().sum()).backward()
    np.testing.assert_allclose(got, ref.grad.numpy(), rtol=1e-5, atol=1e-6)


async def test_sort_of_a_long_axis(device):
    x = np.random.default_rng(5).standard_normal((2, 300)).astype(np.float32)  # padded to 512: 45 stages
    values, indices = Tensor(x, device=device).sort(dim=-1)
    np.testing.assert_array_equal(await indices.numpy(), np.argsort(x, axis=-1, kind="stable"))
    np.testing.assert_array_equal(await values.numpy(), np.sort(x, axis=-1))


async def test_sort_and_triangles_of_a_tensor_on_disk(tmp_path):
    from safetensors.numpy import save_file

    x = np.random.default_rng(6).standard_normal((3, 5)).astype(np.float32)
    save_file({"w": x}, str(tmp_path / "w.safetensors"))
    w = Tensor.from_safetensors(tmp_path / "w.safetensors", "w")  # helpers go where the computation does (AUTO)
    np.testing.assert_array_equal(await w.argsort(dim=1).numpy(), np.argsort(x, axis=1, kind="stable"))
    np.testing.assert_array_equal(await w.tril().numpy(), np.tril(x))
    np.testing.assert_allclose(await w.cumsum(1).numpy(), np.cumsum(x, 1), rtol=1e-6)
