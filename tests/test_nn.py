"""azyx.nn: parameter discovery, layers against PyTorch (forward and gradients, same weights), PyTorch-like init,
training/eval modes and dropout, state dicts (strict checks, the safetensors round trip), losses and their
gradients against PyTorch (or closed forms without it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import azyx
from azyx import GradientTape, Tensor, nn
from azyx.realize import run_sync

try:
    import torch
    import torch.nn.functional as F
except ImportError:
    torch = None  # type: ignore[assignment]
    F = None  # type: ignore[assignment]

needs_torch = pytest.mark.skipif(torch is None, reason="torch is not importable (pip install torch==2.13.0)")


class Block(nn.Module):
    def __init__(self, device: str) -> None:
        self.norm = nn.LayerNorm(6, device=device)
        self.layers = [nn.Linear(6, 5, device=device), nn.Linear(5, 3, bias=False, device=device)]
        self.heads = {"a": nn.Linear(3, 2, device=device)}
        self.scale = Tensor(np.ones(3, np.float32), device=device)
        self.shared = self.scale  # the same tensor twice: one parameter
        self.drop = nn.Dropout(0.5)
        self.note = "not a parameter"

    def forward(self, x: Tensor) -> Tensor:
        h = self.layers[0](self.norm(x)).relu()
        return self.heads["a"](self.drop(self.layers[1](h)) * self.scale)


def test_parameters_are_found_by_attribute_path(device: str) -> None:
    m = Block(device)
    names = [n for n, _ in m.named_parameters()]
    assert names == ["norm.weight", "norm.bias", "layers.0.weight", "layers.0.bias", "layers.1.weight",
                     "heads.a.weight", "heads.a.bias", "scale"]
    assert [p.shape for p in m.parameters()] == [(6,), (6,), (5, 6), (5,), (3, 5), (2, 3), (2,), (3,)]
    assert len(list(m.modules())) == 6  # Block itself, LayerNorm, two Linear, the head Linear, Dropout
    assert "layers.0.weight=(5, 6)" in repr(m)
    out = m(Tensor(np.ones((4, 6), np.float32), device=device))
    assert out.shape == (4, 2) and np.isfinite(out.numpy_sync()).all()


def test_sequential_and_relu(device: str) -> None:
    azyx.manual_seed(3)
    seq = nn.Sequential(nn.Linear(4, 8, device=device), nn.ReLU(), nn.Linear(8, 2, device=device))
    assert [n for n, _ in seq.named_parameters()] == ["layers.0.weight", "layers.0.bias", "layers.2.weight",
                                                      "layers.2.bias"]
    x = np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32)
    w0, b0, w2, b2 = (p.numpy_sync() for p in seq.parameters())
    ref = np.maximum(x @ w0.T + b0, 0) @ w2.T + b2
    np.testing.assert_allclose(seq(Tensor(x, device=device)).numpy_sync(), ref, rtol=1e-5, atol=1e-6)


def test_init_is_pytorch_like_and_seeded(device: str) -> None:
    azyx.manual_seed(7)
    a = nn.Linear(400, 300, device=device)
    azyx.manual_seed(7)
    b = nn.Linear(400, 300, device=device)
    wa, wb = a.weight.numpy_sync(), b.weight.numpy_sync()
    np.testing.assert_array_equal(wa, wb)  # manual_seed makes init reproducible
    bound = 1 / np.sqrt(400)  # kaiming_uniform(a=sqrt(5)) == U(-1/sqrt(fan_in), 1/sqrt(fan_in))
    assert np.abs(wa).max() <= bound and np.abs(a.bias.numpy_sync()).max() <= bound
    assert abs(wa.std() - bound / np.sqrt(3)) < 0.02 * bound and abs(wa.mean()) < 0.02 * bound
    conv = nn.Conv2d(3, 8, 5, device=device)
    w = conv.weight.numpy_sync()
    assert w.shape == (8, 3, 5, 5) and np.abs(w).max() <= 1 / np.sqrt(75) and w.std() > 0.5 / np.sqrt(3 * 75)
    emb = nn.Embedding(50, 40, device=device).weight.numpy_sync()
    assert abs(emb.std() - 1.0) < 0.1  # N(0, 1) like PyTorch
    ln = nn.LayerNorm((2, 3), device=device)
    np.testing.assert_array_equal(ln.weight.numpy_sync(), np.ones((2, 3)))
    np.testing.assert_array_equal(ln.bias.numpy_sync(), np.zeros((2, 3)))


# ---- layers against PyTorch, forward and backward ------------------------------------------------------------------
def _layer_case(device: str, name: str) -> tuple[nn.Module, Any, list[np.ndarray], Any]:
    """(azyx module, torch module with the same weights, inputs, how to call)."""
    rng = np.random.default_rng(11)
    if name == "linear":
        m, tm = nn.Linear(7, 4, device=device), torch.nn.Linear(7, 4)
        xs = [rng.standard_normal((5, 7)).astype(np.float32)]
    elif name == "conv2d":
        m, tm = nn.Conv2d(3, 4, 3, stride=2, padding=1, device=device), torch.nn.Conv2d(3, 4, 3, stride=2, padding=1)
        xs = [rng.standard_normal((2, 3, 7, 6)).astype(np.float32)]
    elif name == "layernorm":
        m, tm = nn.LayerNorm((3, 4), eps=1e-3, device=device), torch.nn.LayerNorm((3, 4), eps=1e-3)
        xs = [rng.standard_normal((2, 3, 4)).astype(np.float32) * 3]
        m.weight.assign(Tensor(rng.uniform(0.5, 1.5, (3, 4)).astype(np.float32), device=device))
        m.bias.assign(Tensor(rng.uniform(-1, 1, (3, 4)).astype(np.float32), device=device))
    else:
        m, tm = nn.Embedding(6, 3, device=device), torch.nn.Embedding(6, 3)
        xs = [np.array([[1, 5, 1], [0, 1, 4]], np.int32)]
    with torch.no_grad():
        for (_, p), (_, tp) in zip(m.named_parameters(), tm.named_parameters()):
            tp.copy_(torch.from_numpy(p.numpy_sync()))
    return m, tm, xs, None


@needs_torch
@pytest.mark.parametrize("name", ["linear", "conv2d", "layernorm", "embedding"])
def test_layers_match_pytorch_forward_and_gradients(device: str, name: str) -> None:
    m, tm, xs, _ = _layer_case(device, name)
    ts = [Tensor(x, device=device) for x in xs]
    params = m.parameters()
    proj = np.random.default_rng(1)
    with GradientTape() as tape:
        out = m(*ts)
        r = proj.standard_normal(out.shape).astype(np.float32)
        loss = (out * Tensor(r, device=device)).sum()
    float_inputs = [t for t in ts if t.dtype.is_float]
    grads = tape.gradient(loss, [*params, *float_inputs])
    run_sync(azyx.realize(out, *grads))
    txs = [torch.from_numpy(x.astype(np.int64) if x.dtype.kind == "i" else x).requires_grad_(x.dtype.kind == "f")
           for x in xs]
    tout = tm(*txs)
    (tout * torch.from_numpy(r)).sum().backward()
    np.testing.assert_allclose(out.numpy_sync(), tout.detach().numpy(), rtol=1e-4, atol=1e-5)
    refs = [tp.grad.numpy() for _, tp in tm.named_parameters()] + [t.grad.numpy() for t in txs if t.requires_grad]
    for g, ref in zip(grads, refs):
        np.testing.assert_allclose(g.numpy_sync(), ref, rtol=1e-4, atol=1e-5)


def test_layer_input_errors(device: str) -> None:
    with pytest.raises(azyx.ShapeError, match=r"\(3, 4\)"):
        nn.LayerNorm(5, device=device)(Tensor(np.ones((3, 4), np.float32), device=device))
    with pytest.raises(azyx.DTypeError, match="float32"):
        nn.Embedding(4, 2, device=device)(Tensor(np.ones(3, np.float32), device=device))
    with pytest.raises(azyx.ArgumentError, match="1.5"):
        nn.Dropout(1.5)
    with pytest.raises(azyx.ShapeError, match="inner dimensions"):
        nn.Linear(3, 2, device=device)(Tensor(np.ones((4, 5), np.float32), device=device))


# ---- modes and dropout --------------------------------------------------------------------------------------------
def test_dropout_follows_the_global_mode_unless_set(device: str) -> None:
    x = Tensor(np.ones((64, 64), np.float32), device=device)
    drop = nn.Dropout(0.5)
    assert drop.training is None and not drop.is_training()
    np.testing.assert_array_equal(drop(x).numpy_sync(), np.ones((64, 64)))  # global mode is off by default
    with azyx.train():
        assert drop.is_training()
        kept = drop(x).numpy_sync()
        assert 0.35 < (kept != 0).mean() < 0.65 and set(np.unique(kept)) <= {0.0, 2.0}
        drop.eval()  # explicit beats global
        np.testing.assert_array_equal(drop(x).numpy_sync(), np.ones((64, 64)))
    drop.train()
    assert drop.is_training() and not Tensor.training
    assert (drop(x).numpy_sync() == 0).any()


def test_train_and_eval_reach_every_submodule(device: str) -> None:
    m = Block(device)
    m.train()
    assert all(sub.training is True for sub in m.modules())
    assert m.eval() is m and all(sub.training is False for sub in m.modules())
    x = Tensor(np.ones((2, 6), np.float32), device=device)
    np.testing.assert_array_equal(m(x).numpy_sync(), m(x).numpy_sync())  # eval: deterministic


# ---- state dicts --------------------------------------------------------------------------------------------------
def test_state_dict_round_trip_between_models(device: str) -> None:
    azyx.manual_seed(1)
    a = Block(device)
    azyx.manual_seed(2)
    b = Block(device)
    sd = a.state_dict()
    assert list(sd) == [n for n, _ in a.named_parameters()]
    b.load_state_dict(sd)
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert na == nb
        np.testing.assert_array_equal(pa.numpy_sync(), pb.numpy_sync())
    a.layers[0].weight.assign(a.layers[0].weight * 0)  # a later update rebinds a's handle, not the state dict's
    assert np.abs(sd["layers.0.weight"].numpy_sync()).sum() > 0
    b.load_state_dict({k: v.numpy_sync().astype(np.float64) for k, v in sd.items()})  # numpy, other dtype: cast
    assert b.layers[0].weight.dtype == azyx.dtypes.float32


def test_load_state_dict_strict_checks_name_the_key(device: str) -> None:
    m = Block(device)
    sd = m.state_dict()
    missing = {k: v for k, v in sd.items() if k != "layers.1.weight"}
    with pytest.raises(azyx.StateDictError, match=r"missing keys \['layers.1.weight'\]"):
        m.load_state_dict(missing)
    with pytest.raises(azyx.StateDictError, match="unexpected keys \\['extra'\\]"):
        m.load_state_dict({**sd, "extra": Tensor(np.ones(2, np.float32))})
    m.load_state_dict(missing, strict=False)  # partial loads are allowed when not strict
    with pytest.raises(azyx.ShapeError, match="'norm.bias'.*\\(7,\\)"):
        m.load_state_dict({**sd, "norm.bias": Tensor(np.ones(7, np.float32), device=device)})
    assert isinstance(azyx.StateDictError("x"), KeyError)


async def test_state_dict_safetensors_round_trip(device: str, tmp_path: Path) -> None:
    io = pytest.importorskip("azyx.io")
    if not hasattr(io, "save_safetensors") or not hasattr(io, "load_safetensors"):
        pytest.skip("azyx.io has no save_safetensors/load_safetensors yet")
    azyx.manual_seed(5)
    a = Block(device)
    path = tmp_path / "block.safetensors"
    await io.save_safetensors(path, a.state_dict())
    azyx.manual_seed(6)
    b = Block(device)
    b.load_state_dict(io.load_safetensors(path))
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert pb.device == pa.device, name
        np.testing.assert_array_equal(await pa.numpy(), await pb.numpy(), err_msg=name)
    x = Tensor(np.random.default_rng(0).standard_normal((3, 6)).astype(np.float32), device=device)
    np.testing.assert_allclose(await a.eval()(x).numpy(), await b.eval()(x).numpy(), rtol=1e-6)
    try:
        from safetensors.numpy import load_file
    except ImportError:
        return
    assert sorted(load_file(str(path))) == sorted(n for n, _ in a.named_parameters())


# ---- losses -------------------------------------------------------------------------------------------------------
def _loss_inputs(name: str) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(4)
    if name == "cross_entropy":
        return rng.standard_normal((6, 5)) * 3, rng.integers(0, 5, 6).astype(np.int32)
    if name == "binary_cross_entropy":
        return rng.uniform(0.05, 0.95, (4, 3)), (rng.random((4, 3)) < 0.5).astype(np.float64)
    if name == "binary_cross_entropy_with_logits":
        return rng.standard_normal((4, 3)) * 4, rng.uniform(0, 1, (4, 3))
    return rng.standard_normal((4, 3)), rng.standard_normal((4, 3))


LOSSES = ["mse_loss", "cross_entropy", "binary_cross_entropy", "binary_cross_entropy_with_logits"]


@needs_torch
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("name", LOSSES)
def test_losses_and_their_gradients_match_pytorch(device: str, name: str, reduction: str) -> None:
    pred, target = _loss_inputs(name)
    p, t = Tensor(pred, device=device), Tensor(target, device=device)
    with GradientTape() as tape:
        loss = getattr(nn, name)(p, t, reduction=reduction)
        weights = np.linspace(0.5, 1.5, loss.numel()).reshape(loss.shape)  # distinct per element for "none"
        total = (loss * Tensor(weights, device=device)).sum()
    g = tape.gradient(total, p)
    tp = torch.tensor(pred, requires_grad=True)
    tt = torch.tensor(target.astype(np.int64) if name == "cross_entropy" else target)
    tloss = getattr(F, name)(tp, tt, reduction=reduction)
    (tloss * torch.from_numpy(weights)).sum().backward()
    np.testing.assert_allclose(loss.numpy_sync(), tloss.detach().numpy(), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(g.numpy_sync(), tp.grad.numpy(), rtol=1e-9, atol=1e-12)


def test_losses_closed_forms(device: str) -> None:
    logits = Tensor(np.array([[0.0, 0.0], [1000.0, -1000.0]], np.float32), device=device)
    ce = nn.cross_entropy(logits, Tensor(np.array([1, 1], np.int32), device=device), reduction="none")
    np.testing.assert_allclose(ce.numpy_sync(), [np.log(2), 2000.0], rtol=1e-6)  # stable for huge logits
    x = Tensor(np.array([0.0, 50.0, -50.0]), device=device)
    y = Tensor(np.array([1.0, 1.0, 1.0]), device=device)
    with GradientTape() as tape:
        bce = nn.binary_cross_entropy_with_logits(x, y, reduction="sum")
    np.testing.assert_allclose(bce.numpy_sync(), np.log(2) + 0 + 50.0, rtol=1e-12, atol=1e-12)
    sig = 1 / (1 + np.exp(-np.array([0.0, 50.0, -50.0])))
    np.testing.assert_allclose(tape.gradient(bce, x).numpy_sync(), sig - 1, rtol=1e-12, atol=1e-20)  # sigmoid(x) - y
    p = Tensor(np.array([0.0, 1.0]), device=device)  # log(0) is clamped at -100 like PyTorch
    np.testing.assert_allclose(nn.binary_cross_entropy(p, Tensor(np.array([1.0, 0.0]))).numpy_sync(), 100.0)
    np.testing.assert_allclose(nn.mse_loss(Tensor([1.0, 2.0]), Tensor([1.0, 4.0])).numpy_sync(), 2.0)


def test_loss_input_errors(device: str) -> None:
    logits = Tensor(np.zeros((3, 4), np.float32), device=device)
    with pytest.raises(azyx.DTypeError, match="float32"):
        nn.cross_entropy(logits, Tensor(np.zeros(3, np.float32), device=device))
    with pytest.raises(azyx.ShapeError, match=r"\(3, 4\) and \(2,\)"):
        nn.cross_entropy(logits, Tensor(np.zeros(2, np.int32), device=device))
    with pytest.raises(azyx.ShapeError, match=r"\(3, 4\).*\(4,\)"):
        nn.mse_loss(logits, Tensor(np.zeros(4, np.float32), device=device))
    with pytest.raises(azyx.ArgumentError, match="'avg'"):
        nn.mse_loss(logits, logits, reduction="avg")
