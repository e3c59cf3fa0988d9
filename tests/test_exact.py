"""No silent wrong answers (issue 36): Python numbers become tensors exactly, copies of tensors and modules are
independent, integer-tensor indices out of range raise, lazy chains that outgrow their realizes warn."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

import azyx
from azyx import Tensor
from azyx.errors import DTypeError


# ---------------------------------------------------------------- Python numbers and lists, exactly
@pytest.mark.parametrize("data", [[2**40], [3_000_000_000], [[1, 2], [3, -(2**33)]], [2**63 - 1], [-(2**63)]])
def test_list_of_big_ints_is_int64_like_numpy_and_torch(data: list) -> None:
    t = Tensor(data)
    want = np.asarray(data)
    assert t.dtype is azyx.dtypes.int64 and torch.tensor(data).dtype == torch.int64
    np.testing.assert_array_equal(t.numpy_sync(), want)
    assert t.numpy_sync().dtype == np.int64


def test_small_ints_keep_the_default_int32() -> None:
    t = Tensor([1, -2, 2**31 - 1, -(2**31)])
    assert t.dtype is azyx.dtypes.int32
    np.testing.assert_array_equal(t.numpy_sync(), [1, -2, 2**31 - 1, -(2**31)])


@pytest.mark.parametrize("data", [[2**63], [2**64], [1, 2**70]])
def test_ints_beyond_int64_raise_naming_the_value(data: list) -> None:
    with pytest.raises(DTypeError, match=str(data[-1])):
        Tensor(data)


@pytest.mark.parametrize(("data", "dtype"), [([2**40], "int64"), ([0.1, 1 / 3], "float64"), ([2**53 + 1], "int64"),
                                             ([0.1], "float16"), ([3_000_000_000], "int64"), ([300], "int16")])
def test_an_explicit_dtype_is_applied_to_the_python_values(data: list, dtype: str) -> None:
    got = Tensor(data, dtype=dtype).numpy_sync()
    want = np.asarray(data, dtype=dtype)
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got, torch.tensor(data, dtype=getattr(torch, dtype)).numpy())


def test_an_explicit_bfloat16_rounds_the_python_value_once() -> None:
    got = Tensor([0.1, 1 / 3], dtype="bfloat16").numpy_sync()
    want = torch.tensor([0.1, 1 / 3], dtype=torch.bfloat16).float().numpy()
    np.testing.assert_array_equal(got, want)


def test_an_int_outside_the_explicit_dtype_raises_naming_it() -> None:
    with pytest.raises(DTypeError, match="1099511627776"):
        Tensor([1, 2**40], dtype="int32")
    with pytest.raises(DTypeError, match="300"):
        Tensor.full((2,), 300, dtype="int8")


def test_full_of_a_big_int_is_int64() -> None:
    t = Tensor.full((2,), 2**40)
    assert t.dtype is azyx.dtypes.int64
    np.testing.assert_array_equal(t.numpy_sync(), np.full((2,), 2**40))
    np.testing.assert_array_equal(t.numpy_sync(), torch.full((2,), 2**40).numpy())


def test_a_number_that_does_not_fit_the_tensor_raises() -> None:
    """numpy 2 (NEP 50) raises OverflowError (PyTorch wraps: 1 + 2**40 in int32 gives 1): azyx raises naming the
    value. (Run with AZYX_NATIVE=0 too: the native core's operators send such a number to Python's check.)"""
    with pytest.raises(OverflowError):
        np.array([1, 2], np.int32) + 2**40
    for f in (lambda: Tensor([1, 2]) + 2**40, lambda: Tensor([1, 2]) * 2**40, lambda: 2**40 - Tensor([1, 2]),
              lambda: Tensor([1, 2]).cast("int8") + 200, lambda: Tensor([1, 2]) + 2**31):
        with pytest.raises(DTypeError, match="does not fit"):
            f()
    # a number the dtype holds keeps working, and an unsigned dtype's negatives wrap as in PyTorch
    np.testing.assert_array_equal((Tensor([1, 2]) + 1000).numpy_sync(), [1001, 1002])
    np.testing.assert_array_equal((Tensor([1, 2]).cast("int8") + 100).numpy_sync(), [101, 102])
    np.testing.assert_array_equal((Tensor([1, 2]).cast("uint8") - 3).numpy_sync(),
                                  (torch.tensor([1, 2], dtype=torch.uint8) - 3).numpy())
    big = (Tensor([1, 2]).cast("int64") + 2**40).numpy_sync()
    np.testing.assert_array_equal(big, np.array([1, 2], np.int64) + 2**40)
    np.testing.assert_array_equal((Tensor([1.0, 2.0]) + 2**40).numpy_sync(), np.float32([1, 2]) + np.float32(2**40))


# ---------------------------------------------------------------- copies of tensors and modules
@pytest.mark.parametrize("how", ["copy", "deepcopy", "pickle"])
def test_a_copy_is_independent_of_its_tensor(how: str) -> None:
    import copy
    import gc
    import pickle

    x = Tensor([1.0, 2.0, 3.0]) * 2
    x.realize_sync()
    make = {"copy": copy.copy, "deepcopy": copy.deepcopy, "pickle": lambda t: pickle.loads(pickle.dumps(t))}[how]
    y = make(x)
    assert y.shape == x.shape and y.dtype is x.dtype
    np.testing.assert_array_equal(y.numpy_sync(), [2.0, 4.0, 6.0])
    del y
    gc.collect()
    others = [Tensor([7.0, 8.0, 9.0]) + 1 for _ in range(3)]  # (they would take a freed id)
    np.testing.assert_array_equal(x.numpy_sync(), [2.0, 4.0, 6.0])
    z = make(x)
    x.assign(x + 1)  # rebinding one handle leaves the other
    x[0] = 100.0
    np.testing.assert_array_equal(z.numpy_sync(), [2.0, 4.0, 6.0])
    np.testing.assert_array_equal(x.numpy_sync(), [100.0, 5.0, 7.0])
    del others


def test_pickle_of_a_lazy_tensor_realizes_it_and_keeps_its_dtype() -> None:
    import pickle

    x = (Tensor([1, 2, 3]).cast("int64") + 2**40).cast("int64")
    y = pickle.loads(pickle.dumps(x))
    assert y.dtype is azyx.dtypes.int64
    np.testing.assert_array_equal(y.numpy_sync(), np.array([1, 2, 3], np.int64) + 2**40)
    h = pickle.loads(pickle.dumps(Tensor([0.1, 0.3], dtype="bfloat16")))
    assert h.dtype is azyx.dtypes.bfloat16
    np.testing.assert_array_equal(h.numpy_sync(), torch.tensor([0.1, 0.3], dtype=torch.bfloat16).float().numpy())


def test_deepcopy_of_a_module_keeps_the_best_model_and_the_original() -> None:
    """The "keep the best model" and EMA habits: a deep copy of a module is a model of its own; training the
    original (assigning its parameters) and dropping copies never touch the other."""
    import copy
    import gc

    from azyx import nn

    class Net(nn.Module):
        def __init__(self) -> None:
            self.emb = nn.Embedding(10, 4)
            self.layers = [nn.Linear(4, 8), nn.Linear(8, 2)]
            self.tied = self.layers[0].weight  # one tensor twice: copied once

        def forward(self, ids: Tensor) -> Tensor:
            return self.layers[1](self.layers[0](self.emb(ids)).relu())

    model = Net()
    ids = Tensor([1, 2, 3])
    want = model(ids).numpy_sync()
    want_bias = model.layers[1].bias.numpy_sync()
    best = copy.deepcopy(model)
    assert best.tied is best.layers[0].weight and best.tied is not model.tied
    np.testing.assert_array_equal(best(ids).numpy_sync(), want)
    for p in model.parameters():  # a training step on the original
        p.assign(p * 0.5)
    np.testing.assert_array_equal(best(ids).numpy_sync(), want)
    ema = copy.deepcopy(best)
    for e, p in zip(ema.parameters(), model.parameters()):
        e.assign(e * 0.9 + p * 0.1)
    del best
    gc.collect()
    for m in (model, ema):
        weights = {k: v.numpy_sync() for k, v in m.state_dict().items()}
        np.testing.assert_allclose(m(ids).numpy_sync(), _numpy_net(weights, ids.numpy_sync()), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(ema.layers[1].bias.numpy_sync(), want_bias * 0.9 + want_bias * 0.5 * 0.1, rtol=1e-6)


def _numpy_net(w: dict[str, np.ndarray], ids: np.ndarray) -> np.ndarray:
    h = w["emb.weight"][ids]
    h = np.maximum(h @ w["layers.0.weight"].T + w["layers.0.bias"], 0)
    return h @ w["layers.1.weight"].T + w["layers.1.bias"]


def test_pickle_inside_a_running_loop_names_the_way_out() -> None:
    import asyncio
    import pickle

    async def main() -> None:
        with pytest.raises(azyx.RuntimeStateError, match="await"):
            pickle.dumps(Tensor([1.0]) + 1)

    asyncio.run(main())


# ---------------------------------------------------------------- weights from files
def test_load_state_dict_from_a_file_moves_the_weights_to_the_device_once(tmp_path: Any, device: str) -> None:
    from safetensors.numpy import save_file

    from azyx import nn
    from azyx.storage import disk_device

    rng = np.random.default_rng(0)
    weights = {"weight": rng.standard_normal((8, 16)).astype(np.float32),
               "bias": rng.standard_normal(8).astype(np.float32)}
    path = tmp_path / "linear.safetensors"
    save_file(weights, str(path))
    layer = nn.Linear(16, 8, device=device)
    disk = disk_device()
    before = disk.bytes_read
    layer.load_state_dict(azyx.io.load_safetensors(path))
    assert disk.bytes_read - before == 8 * 16 * 4 + 8 * 4  # read now, once
    for p in layer.parameters():
        assert p.device == device and p._node.buffer is not None  # realized on the module's device
    x = rng.standard_normal((2, 16)).astype(np.float32)
    want = torch.nn.functional.linear(torch.from_numpy(x), torch.from_numpy(weights["weight"]),
                                      torch.from_numpy(weights["bias"])).numpy()
    read = disk.bytes_read
    for _ in range(2):
        np.testing.assert_allclose(layer(Tensor(x, device=device)).numpy_sync(), want, rtol=1e-5, atol=1e-5)
    assert disk.bytes_read == read  # forward passes never read the file again


def test_a_gather_by_host_index_from_a_disk_tensor_reads_only_its_rows(tmp_path: Any) -> None:
    from safetensors.numpy import save_file

    from azyx.storage import disk_device

    table = np.random.default_rng(1).standard_normal((1000, 320)).astype(np.float32)
    path = tmp_path / "emb.safetensors"
    save_file({"emb": table}, str(path))
    emb = azyx.io.load_safetensors(path)["emb"]
    disk, row = disk_device(), 320 * 4
    for index in ([1, 2, 3], [700, 2, 2, -1], np.array([[5], [999]]), [4]):
        before = disk.bytes_read
        got = emb[index].numpy_sync()
        np.testing.assert_array_equal(got, table[np.asarray(index)])
        assert disk.bytes_read - before == len(np.unique(np.asarray(index) % 1000)) * row
    with pytest.raises(azyx.IndexOutOfRange, match="1000"):
        emb[[1, 1000]]


# ---------------------------------------------------------------- a lazy chain that outgrows its realizes
def _train(steps: int, keep_params: bool) -> list[float]:
    """SGD on a least-squares fit, realizing the loss each step (and the parameters, with `keep_params`)."""
    from azyx import GradientTape, nn, optim

    rng = np.random.default_rng(0)
    x = Tensor(rng.standard_normal((16, 4)).astype(np.float32))
    y = Tensor(rng.standard_normal((16, 1)).astype(np.float32))
    layer = nn.Linear(4, 1)
    opt = optim.SGD(layer.parameters(), lr=0.05)
    losses = []
    for _ in range(steps):
        with GradientTape() as tape:
            loss = ((layer(x) - y) ** 2).mean()
        new = opt.step(tape.gradient(loss, layer.parameters()))
        if keep_params:
            losses.append(float(loss.numpy_sync()))
            for p in new:
                p.realize_sync()
        else:
            losses.append(float(loss.numpy_sync()))  # the habit: only the loss is realized
    return losses


def test_a_chain_that_grows_across_realizes_warns_once_naming_the_realize() -> None:
    import warnings

    from azyx.errors import LazyChainWarning
    from azyx.graph import CHAINS

    CHAINS.warned = False
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        losses = _train(30, keep_params=False)
    chain = [w for w in caught if issubclass(w.category, LazyChainWarning)]
    assert len(chain) == 1, [str(w.message) for w in caught]
    assert chain[0].filename == __file__ and "opt.step" in str(chain[0].message)
    assert losses[-1] < losses[0]  # (the values are right: only the cost grows)


def test_no_warning_when_the_parameters_are_realized_or_a_graph_is_only_reused() -> None:
    import warnings

    from azyx.errors import LazyChainWarning
    from azyx.graph import CHAINS

    CHAINS.warned = False
    with warnings.catch_warnings():
        warnings.simplefilter("error", LazyChainWarning)
        _train(30, keep_params=True)
        y = Tensor(np.arange(64, dtype=np.float32).reshape(16, 4)).exp()  # one lazy tensor read by many realizes
        for i in range(16):
            np.testing.assert_allclose(y[i].numpy_sync(), np.exp(np.arange(64, dtype=np.float32).reshape(16, 4)[i]),
                                       rtol=1e-6)


def test_a_jitted_function_given_an_int_that_does_not_fit_raises() -> None:
    """azyx.jit traces Python numbers as kernel arguments (values are data): a replay with an int the tensor's dtype
    cannot hold is not wrapped into the old plan; it raises as the eager op does."""
    import asyncio

    async def main() -> None:
        f = azyx.jit(lambda x, k: x * k)
        t = Tensor([1, 2])
        np.testing.assert_array_equal(await (await f(t, 5)).numpy(), [5, 10])
        np.testing.assert_array_equal(await (await f(t, 7)).numpy(), [7, 14])  # (a replay: the number is data)
        with pytest.raises(DTypeError, match=r"the Python int 1099511627776 does not fit int32"):
            await f(t, 2**40)

    asyncio.run(main())
