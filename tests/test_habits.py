"""The habits numpy and PyTorch users bring (issue 36): `await t`, `np.asarray(t)`, `repr(t)` with values,
`float/int/bool(t)`, `azyx.realize([a, b])`, `azyx.replicate(ndarray)`, `.to(dtype)` and the dtype shorthands,
`clone`/`detach`/`no_grad`, `Tensor.empty`, `Module.to(device)`, `dim=`/`keepdims=` and `max(dim=)`'s pair, and
`plot_graph`'s warning when it cannot render."""

import operator
import warnings

import numpy as np
import pytest

import azyx
from azyx import GradientTape, RuntimeStateError, Tensor, dtypes, nn
from azyx.runtime import RT


async def test_await_realizes_and_returns_the_tensor(device):
    t = Tensor([1.0, 2.0, 3.0], device=device) * 2 + 1
    got = await t
    assert got is t
    np.testing.assert_array_equal(np.asarray(t), [3.0, 5.0, 7.0])  # realized: readable without awaiting


async def test_asarray_of_realized_and_lazy(device):
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    t = Tensor(x, device=device).exp()
    with pytest.raises(RuntimeStateError, match=r"await t\.numpy\(\)"):
        np.asarray(t)
    await t.realize()
    np.testing.assert_allclose(np.asarray(t), np.exp(x), rtol=1e-6)
    assert np.asarray(t, dtype=np.float64).dtype == np.float64
    # numpy's operators defer to the tensor's (a lazy Tensor, not an array read with __array__)
    out = np.ones(4, np.float32) + (Tensor([1.0, 2.0, 3.0, 4.0], device=device) * 1)
    assert isinstance(out, Tensor)
    np.testing.assert_array_equal(await out.numpy(), [2.0, 3.0, 4.0, 5.0])


async def test_repr_shows_values_when_realized(device, monkeypatch):
    x = np.linspace(-1, 1, 6, dtype=np.float32).reshape(2, 3)
    t = Tensor(x, device=device) * 3
    assert "lazy" in repr(t) and "shape=(2, 3)" in repr(t)
    await t
    want = np.array2string(x * 3, separator=", ", prefix="Tensor(")
    assert repr(t) == f"Tensor({want}, dtype=float32, device={device!r})"
    big = await (Tensor.arange(5000, device=device) * 2)  # numpy's summarised format for a large one
    assert repr(big).startswith("Tensor([   0,    2,    4, ..., 9994, 9996, 9998], dtype=int32")
    monkeypatch.setattr(azyx.tensor, "REPR_MAX_ELEMENTS", 4096)  # larger than this: not read for a repr
    assert repr(big) == f"<Tensor realized shape=(5000,) dtype=int32 device={device}>"


async def test_repr_of_a_host_memory_tensor_reads_it_in_place(device, monkeypatch):
    """A realized tensor in host memory is shown from its memory, not from a copy of all of it (Python 3.11's
    asyncio.run formats its main task's result after each run: the tensors a realize returned)."""
    x = np.arange(24, dtype=np.float32).reshape(4, 6)
    t = await (Tensor(x, device=device) * 2)
    tt = await Tensor(x, device=device).T  # (a strided view)
    big = await (Tensor.arange(1 << 20, device=device) + 0)
    dev = RT.device(device)
    if dev.host_memory:
        def refuse(*_: object) -> None:
            raise AssertionError("a repr copied the tensor")
        monkeypatch.setattr(dev, "read", refuse)
    assert repr(t) == f"Tensor({np.array2string(x * 2, separator=', ', prefix='Tensor(')}, dtype=float32, " \
                      f"device={device!r})"
    assert repr(tt) == f"Tensor({np.array2string(x.T, separator=', ', prefix='Tensor(')}, dtype=float32, " \
                       f"device={device!r})"
    assert repr(big).startswith("Tensor([      0,       1,       2, ..., 1048573, 1048574, 1048575], dtype=int32")


async def test_python_scalars_of_realized_tensors(device):
    f = Tensor([[2.75]], device=device) * 2
    with pytest.raises(RuntimeStateError, match=r"await t\.item\(\)"):
        float(f)
    with pytest.raises(RuntimeStateError, match=r"await t\.item\(\)"):
        bool(f > 1)
    await f
    assert float(f) == 5.5 and int(f) == 5
    i = await (Tensor([-7], device=device) + 3)
    assert int(i) == -4 and operator.index(i) == -4 and list(range(10))[i] == 6
    with pytest.raises(azyx.DTypeError):
        operator.index(f)
    b = await (Tensor([3.0], device=device) > 1)
    assert bool(b) is True and (not await (Tensor([0], device=device) != 0))
    with pytest.raises(azyx.ShapeError, match=r"shape \(2,\)"):
        float(await (Tensor([1.0, 2.0], device=device) + 0))


async def test_realize_takes_lists_and_tuples(device):
    a = Tensor([1.0, 2.0], device=device) + 1
    b = Tensor([3], device=device) * 2
    c = Tensor([4.0], device=device).sqrt()
    got = await azyx.realize([a, (b,)], c)
    assert got == (a, b, c)
    assert np.asarray(a).tolist() == [2.0, 3.0] and np.asarray(b).tolist() == [6] and np.asarray(c).tolist() == [2.0]
    with pytest.raises(azyx.DTypeError, match="ndarray"):
        await azyx.realize([a, np.ones(2)])


async def test_replicate_a_numpy_array():
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    r = azyx.replicate(x, ["c:0", "c:1"])
    assert r.devices == ["c:0", "c:1"]
    for piece in r.shards:
        np.testing.assert_array_equal(await piece.numpy(), x)


async def test_to_dtype_and_shorthands(device):
    x = np.array([1.5, -2.25, 3.0], np.float32)
    t = Tensor(x, device=device)
    assert t.to(dtypes.float16).dtype == dtypes.float16
    assert t.to("int32").device == device
    np.testing.assert_array_equal(await t.to(np.int32).numpy(), x.astype(np.int32))
    assert t.to(device, "float16").dtype == dtypes.float16 and t.to(dtype="int8").dtype == dtypes.int8
    shorthands = {"float": "float32", "half": "float16", "int": "int32", "bool": "bool", "long": "int64",
                  "double": "float64", "bfloat16": "bfloat16", "short": "int16", "char": "int8", "byte": "uint8"}
    for method, name in shorthands.items():
        assert getattr(t, method)().dtype == getattr(dtypes, name), method
    np.testing.assert_array_equal(await t.int().numpy(), x.astype(np.int32))
    with pytest.raises(azyx.DeviceError, match="nope:0"):
        t.to("nope:0")


async def test_clone_is_independent_and_differentiable(device):
    a = Tensor([1.0, 2.0, 3.0], device=device)
    b = a.clone()
    b[1] = 10.0
    assert (await a.numpy()).tolist() == [1.0, 2.0, 3.0]
    assert (await b.numpy()).tolist() == [1.0, 10.0, 3.0]
    with GradientTape() as tape:
        y = (a.clone() * a).sum()
    np.testing.assert_allclose(await tape.gradient(y, a).numpy(), [2.0, 4.0, 6.0])


async def test_detach_and_no_grad_stop_gradients(device):
    x = Tensor([1.0, -2.0, 3.0], device=device)
    with GradientTape() as tape:
        y = (x * x.detach()).sum()  # d/dx of x * c with c = x held constant: c
    np.testing.assert_allclose(await tape.gradient(y, x).numpy(), [1.0, -2.0, 3.0])
    with GradientTape() as tape:
        with azyx.no_grad():
            s = x.square()
        y = (x * s).sum()
    np.testing.assert_allclose(await tape.gradient(y, x).numpy(), [1.0, 4.0, 9.0])  # s held constant: x^2
    with GradientTape() as tape:
        z = (x * x.square()).sum()
    gz = tape.gradient(z, x)
    np.testing.assert_allclose(await gz.numpy(), [3.0, 12.0, 27.0])  # outside no_grad: 3x^2
    d = x.detach()
    assert d.shape == x.shape and d.dtype == x.dtype and d.device == x.device
    np.testing.assert_array_equal(await d.numpy(), [1.0, -2.0, 3.0])


async def test_empty(device):
    t = Tensor.empty(2, 3, device=device)
    assert t.shape == (2, 3) and t.dtype == dtypes.float32 and t.device == device
    t[:, 1] = 4.0  # the habit: make it, then fill it
    np.testing.assert_array_equal(await t.numpy(), [[0, 4, 0], [0, 4, 0]])
    assert Tensor.empty((4,), dtype="int32").dtype == dtypes.int32


async def test_module_to_device_and_dtype(device):
    azyx.manual_seed(0)
    model = nn.Linear(3, 2)
    x = np.array([[1.0, 2.0, 3.0]], np.float32)
    want = await model(Tensor(x)).numpy()
    assert model.to(device) is model
    assert all(p.device == device for p in model.parameters())
    got = await model(Tensor(x, device=device)).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-6)
    model.to(dtypes.float16)
    assert all(p.dtype == dtypes.float16 and p.device == device for p in model.parameters())
    half = await model(Tensor(x, device=device).half()).numpy()
    np.testing.assert_allclose(half, want, rtol=1e-2, atol=1e-2)


def test_plot_graph_warns_when_it_cannot_render(tmp_path, monkeypatch):
    t = Tensor([1.0, 2.0]) * 2
    monkeypatch.setenv("PATH", str(tmp_path))  # no Graphviz `dot` on this PATH
    with pytest.warns(RuntimeWarning, match=r"g\.svg was not rendered.*g\.dot"):
        written = azyx.plot_graph(t, tmp_path / "g.svg")
    assert written == tmp_path / "g.dot" and "digraph" in written.read_text()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert azyx.plot_graph(t, tmp_path / "h.dot") == tmp_path / "h.dot"  # asked for .dot: nothing to warn of


async def test_sharded_tensors_take_dim_and_keepdims():
    x = np.arange(12, dtype=np.float32).reshape(4, 3)
    s = Tensor(x).shard(["c:0", "c:1"], dim=0)
    np.testing.assert_array_equal(await s.sum(dim=1).gather().numpy(), x.sum(axis=1))
    np.testing.assert_array_equal(await s.max(dim=0, keepdims=True).gather().numpy(), x.max(axis=0, keepdims=True))
    np.testing.assert_allclose(await s.mean(dim=(0, 1)).gather().numpy(), x.mean())
