"""GradientTape: every gradient rule against central finite differences (float64) and, when torch is importable,
against torch.autograd on the same inputs (float64 and float32); tie rules; non-differentiable ops; higher-order
gradients with nested tapes; tape semantics (persistent, seeds, unreached sources, errors); the graph shrinking back
when a tape is dropped, and freed-and-reused ids never looking recorded."""

from __future__ import annotations

import gc
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

import azyx
from azyx import GradientTape, Tensor
from azyx.graph import GRAPH, Op
from azyx.realize import run_sync

try:
    import torch
    import torch.nn.functional as F
except ImportError:  # the torch columns are skipped, finite differences still run
    torch = None  # type: ignore[assignment]
    F = None  # type: ignore[assignment]

needs_torch = pytest.mark.skipif(torch is None, reason="torch is not importable (pip install torch==2.13.0)")


# ---- inputs -----------------------------------------------------------------------------------------------------
def draw(rng: np.random.Generator, shape: tuple[int, ...], domain: str) -> np.ndarray:
    """float64 inputs away from each op's kinks and poles: "any" (-2, 2), "nonzero" (|x| in [0.3, 2]),
    "pos" (0.3, 2.5), "small" (-1, 1)."""
    if domain == "nonzero":
        return rng.uniform(0.3, 2.0, shape) * rng.choice([-1.0, 1.0], shape)
    lo, hi = {"any": (-2.0, 2.0), "pos": (0.3, 2.5), "small": (-1.0, 1.0)}[domain]
    return rng.uniform(lo, hi, shape)


@dataclass
class Case:
    name: str
    fn: Callable[..., Tensor]  # azyx Tensors -> azyx Tensor
    tfn: Callable[..., Any] | None  # the same function on torch tensors (None: no torch counterpart)
    shapes: list[tuple[int, ...]]
    domains: list[str] = field(default_factory=list)
    fd: bool = True  # central finite differences are meaningful (smooth at the drawn inputs)
    tol: dict[str, float] = field(default_factory=dict)  # overrides the torch comparison's tolerance

    def inputs(self) -> list[np.ndarray]:
        rng = np.random.default_rng(zlib.crc32(self.name.encode()))
        doms = self.domains or ["any"] * len(self.shapes)
        return [draw(rng, s, d) for s, d in zip(self.shapes, doms)]


IDX = np.array([2, 0, 2, 1, -1], np.int32)  # repeated and negative indices: gradients accumulate
GATHER_IDX = np.array([[0, 2, 2, 1], [1, 1, 0, 0], [2, 0, 1, 2]], np.int64)


def _t(x: Any) -> Any:
    return torch.as_tensor(x)


CASES = [
    # unary
    Case("neg", lambda a: -a, lambda a: -a, [(3, 4)]),
    Case("abs", lambda a: a.abs(), lambda a: a.abs(), [(3, 4)], ["nonzero"]),
    Case("square", lambda a: a.square(), lambda a: a.square(), [(3, 4)]),
    Case("relu", lambda a: a.relu(), lambda a: a.relu(), [(3, 4)], ["nonzero"]),
    Case("exp", lambda a: a.exp(), lambda a: a.exp(), [(3, 4)]),
    Case("log", lambda a: a.log(), lambda a: a.log(), [(3, 4)], ["pos"]),
    Case("exp2", lambda a: a.exp2(), lambda a: a.exp2(), [(3, 4)]),
    Case("log2", lambda a: a.log2(), lambda a: a.log2(), [(3, 4)], ["pos"]),
    Case("sqrt", lambda a: a.sqrt(), lambda a: a.sqrt(), [(3, 4)], ["pos"]),
    Case("rsqrt", lambda a: a.rsqrt(), lambda a: a.rsqrt(), [(3, 4)], ["pos"]),
    Case("reciprocal", lambda a: a.reciprocal(), lambda a: a.reciprocal(), [(3, 4)], ["nonzero"]),
    Case("sin", lambda a: a.sin(), lambda a: a.sin(), [(3, 4)]),
    Case("cos", lambda a: a.cos(), lambda a: a.cos(), [(3, 4)]),
    Case("tan", lambda a: a.tan(), lambda a: a.tan(), [(3, 4)], ["small"]),
    Case("tanh", lambda a: a.tanh(), lambda a: a.tanh(), [(3, 4)]),
    Case("erf", lambda a: a.erf(), lambda a: a.erf(), [(3, 4)]),
    Case("sigmoid", lambda a: a.sigmoid(), lambda a: a.sigmoid(), [(3, 4)]),
    Case("gelu", lambda a: a.gelu(), lambda a: F.gelu(a), [(3, 4)]),
    Case("gelu_tanh", lambda a: a.gelu(approximate="tanh"), lambda a: F.gelu(a, approximate="tanh"), [(3, 4)]),
    Case("silu", lambda a: a.silu(), lambda a: F.silu(a), [(3, 4)]),
    Case("softplus", lambda a: a.softplus(), lambda a: F.softplus(a), [(3, 4)]),
    Case("pow_scalar", lambda a: a**3, lambda a: a**3, [(3, 4)]),
    Case("pow_fraction", lambda a: a**1.7, lambda a: a**1.7, [(3, 4)], ["pos"]),
    Case("sqrt_via_pow", lambda a: a**0.5, lambda a: a**0.5, [(3, 4)], ["pos"]),
    Case("clip", lambda a: a.clip(-0.5, 0.7), lambda a: a.clip(-0.5, 0.7), [(4, 5)]),
    # binary, with broadcasting and scalars on either side
    Case("add_broadcast", lambda a, b: a + b, lambda a, b: a + b, [(3, 1, 4), (2, 4)]),
    Case("sub_broadcast", lambda a, b: a - b, lambda a, b: a - b, [(2, 4), (3, 1, 4)]),
    Case("mul_broadcast", lambda a, b: a * b, lambda a, b: a * b, [(3, 4), (3, 1)]),
    Case("div_broadcast", lambda a, b: a / b, lambda a, b: a / b, [(3, 4), (4,)], ["any", "nonzero"]),
    Case("scalar_left", lambda a: 2.0 - a * 3.0 + 1.5 / a, lambda a: 2.0 - a * 3.0 + 1.5 / a, [(5,)], ["nonzero"]),
    Case("rpow", lambda a: 2.0**a, lambda a: 2.0**a, [(5,)]),
    Case("pow_tensors", lambda a, b: a**b, lambda a, b: a**b, [(3, 4), (3, 4)], ["pos", "any"]),
    Case("mod", lambda a, b: a % b, lambda a, b: torch.remainder(a, b), [(3, 4), (3, 4)], ["any", "pos"]),
    Case("maximum", lambda a, b: a.maximum(b), lambda a, b: torch.maximum(a, b), [(3, 4), (4,)]),
    Case("minimum", lambda a, b: a.minimum(b), lambda a, b: torch.minimum(a, b), [(3, 4), (3, 1)]),
    Case("where", lambda c, a, b: Tensor.where(c > 0, a * 2, b.exp()),
         lambda c, a, b: torch.where(c > 0, a * 2, b.exp()), [(3, 4), (3, 4), (4,)]),
    Case("shared_operand", lambda a: a * a + a.exp() * a, lambda a: a * a + a.exp() * a, [(2, 3)]),
    # reductions
    Case("sum_all", lambda a: a.sum(), lambda a: a.sum(), [(3, 4)]),
    Case("sum_axis", lambda a: a.sum(axis=1), lambda a: a.sum(dim=1), [(2, 3, 4)]),
    Case("sum_axes_keepdim", lambda a: a.sum(axis=(0, 2), keepdim=True), lambda a: a.sum(dim=(0, 2), keepdim=True),
         [(2, 3, 4)]),
    Case("mean_axis", lambda a: a.mean(axis=-1), lambda a: a.mean(dim=-1), [(3, 5)]),
    Case("max_axis", lambda a: a.max(axis=1), lambda a: a.amax(dim=1), [(3, 5)]),
    Case("min_axes_keepdim", lambda a: a.min(axis=(0, 1), keepdim=True), lambda a: a.amin(dim=(0, 1), keepdim=True),
         [(3, 4, 2)]),
    Case("min_all", lambda a: a.min(), lambda a: a.amin(), [(3, 4)]),
    Case("mean_all", lambda a: a.mean() * a, lambda a: a.mean() * a, [(2, 3)]),
    Case("max_all", lambda a: a.max(), lambda a: a.amax(), [(3, 4)]),
    Case("prod_axis", lambda a: a.prod(axis=1), lambda a: a.prod(dim=1), [(3, 4)], ["nonzero"]),
    Case("var", lambda a: a.var(axis=1), lambda a: a.var(dim=1), [(3, 5)]),
    Case("std_keepdim", lambda a: a.std(axis=0, keepdim=True, correction=0),
         lambda a: a.std(dim=0, keepdim=True, correction=0), [(4, 3)]),
    Case("logsumexp", lambda a: a.logsumexp(axis=1), lambda a: torch.logsumexp(a, dim=1), [(3, 5)]),
    Case("softmax", lambda a: a.softmax(axis=-1), lambda a: a.softmax(dim=-1), [(3, 5)]),
    Case("softmax_axis0", lambda a: a.softmax(axis=0), lambda a: a.softmax(dim=0), [(3, 5)]),
    Case("log_softmax", lambda a: a.log_softmax(axis=-1), lambda a: a.log_softmax(dim=-1), [(3, 5)]),
    # movement
    Case("reshape", lambda a: a.reshape(4, 3) * _c((4, 3)), lambda a: a.reshape(4, 3) * _ct((4, 3)), [(2, 6)]),
    Case("permute", lambda a: a.permute(2, 0, 1), lambda a: a.permute(2, 0, 1), [(2, 3, 4)]),
    Case("transpose", lambda a: a.transpose(0, 2) * _c((4, 3, 2)), lambda a: a.transpose(0, 2) * _ct((4, 3, 2)),
         [(2, 3, 4)]),
    Case("transpose_T", lambda a: a.T @ a, lambda a: a.T @ a, [(3, 2)]),
    Case("expand", lambda a: a.expand(3, 4, 2), lambda a: a.expand(3, 4, 2), [(4, 1)]),
    Case("pad", lambda a: a.pad(((1, 2), (0, 1)), value=0.5), lambda a: F.pad(a, (0, 1, 1, 2), value=0.5), [(2, 3)]),
    Case("pad_and_shrink", lambda a: a.pad(((-1, 2), (1, -2))), lambda a: F.pad(a, (1, -2, -1, 2)), [(3, 4)]),
    Case("flip", lambda a: a.flip((0, 2)) * _c((2, 3, 4)), lambda a: a.flip((0, 2)) * _ct((2, 3, 4)), [(2, 3, 4)]),
    Case("squeeze_unsqueeze", lambda a: a.squeeze(1).unsqueeze(0), lambda a: a.squeeze(1).unsqueeze(0), [(3, 1, 2)]),
    Case("flatten", lambda a: a.flatten(1), lambda a: a.flatten(1), [(2, 3, 2)]),
    Case("repeat", lambda a: a.repeat(2, 3), lambda a: a.repeat(2, 3), [(2, 3)]),
    Case("cat", lambda a, b: Tensor.cat([a, b, a], axis=1), lambda a, b: torch.cat([a, b, a], dim=1),
         [(2, 3), (2, 1)]),
    Case("stack", lambda a, b: Tensor.stack([a, b], axis=1), lambda a, b: torch.stack([a, b], dim=1),
         [(2, 3), (2, 3)]),
    Case("split_chunk", lambda a: a.split(2, axis=1)[1] * 2 + a.chunk(2)[0].sum(),
         lambda a: a.split(2, dim=1)[1] * 2 + a.chunk(2)[0].sum(), [(4, 5)]),
    Case("basic_index", lambda a: a[1:, None, ::2, -1], lambda a: a[1:, None, ::2, -1], [(3, 5, 2)]),
    Case("index_ellipsis", lambda a: a[..., 1] * a[0], lambda a: a[..., 1] * a[0], [(2, 2)]),
    Case("negative_step", lambda a: a[::-2, 1:] * _c((2, 3)), None, [(4, 4)]),
    Case("int_tensor_index", lambda a: a[Tensor(IDX, device=a.device)], lambda a: a[_t(IDX).long()], [(3, 4)]),
    Case("gather", lambda a: a.gather(1, Tensor(GATHER_IDX.astype(np.int32), device=a.device)),
         lambda a: torch.gather(a, 1, _t(GATHER_IDX)), [(3, 4)]),
    # linear algebra and nn
    Case("matmul", lambda a, b: a @ b, lambda a, b: a @ b, [(3, 4), (4, 2)]),
    Case("matmul_batched", lambda a, b: a @ b, lambda a, b: a @ b, [(2, 1, 3, 4), (3, 4, 2)]),
    Case("matmul_vector", lambda a, b: a @ b, lambda a, b: a @ b, [(4,), (2, 4, 3)]),
    Case("dot", lambda a, b: a.dot(b), lambda a, b: a.dot(b), [(5,), (5,)]),
    Case("conv2d", lambda x, w, b: x.conv2d(w, b), lambda x, w, b: F.conv2d(x, w, b),
         [(1, 2, 5, 5), (3, 2, 3, 3), (3,)]),
    Case("conv2d_stride_padding", lambda x, w: x.conv2d(w, stride=2, padding=1),
         lambda x, w: F.conv2d(x, w, stride=2, padding=1), [(2, 2, 5, 6), (2, 2, 3, 2)]),
    Case("conv2d_asymmetric", lambda x, w: x.conv2d(w, stride=(2, 1), padding=(1, 0)),
         lambda x, w: F.conv2d(x, w, stride=(2, 1), padding=(1, 0)), [(1, 1, 6, 5), (2, 1, 3, 3)]),
    Case("max_pool2d", lambda a: a.max_pool2d(2), lambda a: F.max_pool2d(a, 2), [(1, 2, 4, 5)]),
    Case("avg_pool2d", lambda a: a.avg_pool2d(3), lambda a: F.avg_pool2d(a, 3), [(2, 1, 7, 6)]),
    Case("layernorm", lambda a: a.layernorm(), lambda a: F.layer_norm(a, a.shape[-1:]), [(3, 6)]),
    Case("layernorm_2axes", lambda a: a.layernorm(axis=(-2, -1), eps=0.1),
         lambda a: F.layer_norm(a, a.shape[-2:], eps=0.1), [(2, 3, 4)]),
    Case("cast_half", lambda a: (a.half() * 3).float().cast("float64") * a, lambda a: (a.half() * 3).double() * a,
         [(3, 4)], fd=False, tol={"rtol": 2e-3, "atol": 1e-3}),  # float16 rounding of values and gradients
    Case("cast_roundtrip", lambda a: (a.float() * 3).cast("float64") + a, lambda a: (a.float() * 3).double() + a,
         [(3, 4)], fd=False),
    Case("one_hot_mix", lambda a: (a * Tensor(IDX[:3], device=a.device).one_hot(4)).sum(axis=1),
         lambda a: (a * F.one_hot(_t(IDX[:3]).long(), 4)).sum(dim=1), [(3, 4)]),
]


def _c(shape: tuple[int, ...]) -> np.ndarray:
    """A fixed non-uniform weight, so a movement op's gradient is not the same at every position."""
    return np.arange(1, int(np.prod(shape)) + 1, dtype=np.float64).reshape(shape) / 7.0


def _ct(shape: tuple[int, ...]) -> Any:
    return torch.as_tensor(_c(shape))


def _projection(out_shape: tuple[int, ...], name: str) -> np.ndarray:
    return np.random.default_rng(zlib.crc32(name.encode()) + 1).uniform(-1, 1, out_shape)


def azyx_value_and_grads(case: Case, xs: list[np.ndarray], device: str, dtype: str) -> tuple[float, list[np.ndarray]]:
    ts = [Tensor(x.astype(dtype), device=device) for x in xs]
    with GradientTape() as tape:
        out = case.fn(*ts)
        r = Tensor(_projection(out.shape, case.name).astype(dtype), device=device)
        loss = (out.cast(dtype) * r).sum()
    grads = tape.gradient(loss, ts)
    for g, t in zip(grads, ts):
        assert g.shape == t.shape and g.dtype == t.dtype and g.device == t.device
    run_sync(azyx.realize(loss, *grads))  # forward and backward in one plan
    return float(loss.numpy_sync()), [g.numpy_sync() for g in grads]


def azyx_loss(case: Case, xs: list[np.ndarray], device: str) -> float:
    ts = [Tensor(x, device=device) for x in xs]
    out = case.fn(*ts)
    return float((out * Tensor(_projection(out.shape, case.name), device=device)).sum().numpy_sync())


def finite_differences(case: Case, xs: list[np.ndarray], device: str, eps: float = 1e-6) -> list[np.ndarray]:
    grads = []
    for k, x in enumerate(xs):
        g = np.zeros_like(x)
        for i in range(x.size):
            plus, minus = [a.copy() for a in xs], [a.copy() for a in xs]
            plus[k].flat[i] += eps
            minus[k].flat[i] -= eps
            g.flat[i] = (azyx_loss(case, plus, device) - azyx_loss(case, minus, device)) / (2 * eps)
        grads.append(g)
    return grads


def torch_grads(case: Case, xs: list[np.ndarray], dtype: Any) -> list[np.ndarray]:
    ts = [torch.tensor(x, dtype=dtype, requires_grad=True) for x in xs]
    out = case.tfn(*ts)  # type: ignore[misc]
    loss = (out * torch.as_tensor(_projection(tuple(out.shape), case.name), dtype=out.dtype)).sum()
    loss.backward()
    return [t.grad.numpy() if t.grad is not None else np.zeros(t.shape) for t in ts]


FD_CASES = [c for c in CASES if c.fd]  # the others round through float32/float16: checked against torch only


@pytest.mark.parametrize("case", FD_CASES, ids=[c.name for c in FD_CASES])
def test_gradient_against_finite_differences(device: str, case: Case) -> None:
    xs = case.inputs()
    _, grads = azyx_value_and_grads(case, xs, device, "float64")
    for k, (g, ref) in enumerate(zip(grads, finite_differences(case, xs, device))):
        np.testing.assert_allclose(g, ref, rtol=1e-5, atol=1e-6, err_msg=f"input {k} of {case.name}")


@needs_torch
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("case", [c for c in CASES if c.tfn is not None], ids=[c.name for c in CASES if c.tfn])
def test_gradient_against_torch(device: str, case: Case, dtype: str) -> None:
    xs = case.inputs()
    _, grads = azyx_value_and_grads(case, xs, device, dtype)
    refs = torch_grads(case, [x.astype(dtype) for x in xs], getattr(torch, dtype))
    tol = case.tol or ({"rtol": 1e-9, "atol": 1e-10} if dtype == "float64" else {"rtol": 2e-4, "atol": 2e-5})
    for k, (g, ref) in enumerate(zip(grads, refs)):
        assert g.dtype == np.dtype(dtype)
        np.testing.assert_allclose(g, ref, **tol, err_msg=f"input {k} of {case.name}")


# ---- rules that finite differences cannot check: ties, kinks, non-differentiable ops --------------------------------
def grads_of(fn: Callable[..., Tensor], *arrays: np.ndarray, device: str = "c:0") -> list[np.ndarray]:
    ts = [Tensor(a, device=device) for a in arrays]
    with GradientTape() as tape:
        loss = fn(*ts)
    return [g.numpy_sync() for g in tape.gradient(loss, ts)]


def test_maximum_minimum_split_ties_equally(device: str) -> None:
    a = np.array([1.0, 2.0, 3.0, -1.0])
    b = np.array([1.0, 5.0, 0.0, -1.0])
    ga, gb = grads_of(lambda x, y: x.maximum(y).sum(), a, b, device=device)
    np.testing.assert_array_equal(ga, [0.5, 0.0, 1.0, 0.5])
    np.testing.assert_array_equal(gb, [0.5, 1.0, 0.0, 0.5])
    ga, gb = grads_of(lambda x, y: (x.minimum(y) * 2).sum(), a, b, device=device)
    np.testing.assert_array_equal(ga, [1.0, 2.0, 0.0, 1.0])
    np.testing.assert_array_equal(gb, [1.0, 0.0, 2.0, 1.0])
    (gx,) = grads_of(lambda x: x.clip(0.0, 2.0).sum(), np.array([-1.0, 0.0, 1.0, 2.0, 3.0]), device=device)
    np.testing.assert_array_equal(gx, [0.0, 0.5, 1.0, 0.5, 0.0])
    if torch is not None:  # PyTorch's rule is the same
        ta, tb = torch.tensor(a, requires_grad=True), torch.tensor(b, requires_grad=True)
        torch.maximum(ta, tb).sum().backward()
        np.testing.assert_array_equal(ta.grad.numpy(), [0.5, 0.0, 1.0, 0.5])


def test_max_min_reductions_split_ties_equally(device: str) -> None:
    x = np.array([[3.0, 1.0, 3.0, 3.0], [0.0, 2.0, -1.0, 2.0]])
    (g,) = grads_of(lambda t: t.max(axis=1).sum(), x, device=device)
    np.testing.assert_allclose(g, [[1 / 3, 0, 1 / 3, 1 / 3], [0, 0.5, 0, 0.5]])
    (g,) = grads_of(lambda t: t.min(), x, device=device)
    np.testing.assert_array_equal(g, [[0, 0, 0, 0], [0, 0, 1, 0]])
    (g,) = grads_of(lambda t: t.max(), x, device=device)
    np.testing.assert_allclose(g, [[1 / 3, 0, 1 / 3, 1 / 3], [0, 0, 0, 0]])
    (g,) = grads_of(lambda t: t.max_pool2d(2).sum(), np.ones((1, 1, 2, 2)), device=device)
    np.testing.assert_array_equal(g, np.full((1, 1, 2, 2), 0.25))  # a pooling window of ties shares too
    if torch is not None:  # amax (a reduction without indices) splits ties like this in PyTorch
        t = torch.tensor(x, requires_grad=True)
        t.amax(dim=1).sum().backward()
        np.testing.assert_allclose(t.grad.numpy(), [[1 / 3, 0, 1 / 3, 1 / 3], [0, 0.5, 0, 0.5]])


def test_prod_with_zeros(device: str) -> None:
    x = np.array([[2.0, 0.0, 3.0], [0.0, 0.0, 5.0], [1.0, 4.0, -2.0]])
    (g,) = grads_of(lambda t: t.prod(axis=1).sum(), x, device=device)
    np.testing.assert_array_equal(g, [[0.0, 6.0, 0.0], [0.0, 0.0, 0.0], [-8.0, -2.0, 4.0]])
    if torch is not None:
        t = torch.tensor(x, requires_grad=True)
        t.prod(dim=1).sum().backward()
        np.testing.assert_array_equal(g, t.grad.numpy())


def test_kinks_follow_pytorch(device: str) -> None:
    x = np.array([-1.0, 0.0, 2.0])
    (g,) = grads_of(lambda t: t.relu().sum() + t.abs().sum(), x, device=device)
    np.testing.assert_array_equal(g, [-1.0, 0.0, 2.0])  # relu'(0) = 0, |x|'(0) = 0


def test_non_differentiable_ops_pass_no_gradient(device: str) -> None:
    x = np.array([-1.5, 0.25, 2.5])

    def fn(t: Tensor) -> Tensor:
        steps = t.sign() + t.floor() + t.ceil() + t.round() + (t // 2.0)
        compares = (t > 0).float().cast("float64") + (t == 0.25).cast("float64")
        argmax = t.argmax().cast("float64")
        return (steps + compares + argmax + t.cast("int32").cast("float64")).sum() + t.sum() * 0

    (g,) = grads_of(fn, x, device=device)
    np.testing.assert_array_equal(g, np.zeros(3))


def test_cast_to_float32_and_back_keeps_dtypes(device: str) -> None:
    x = Tensor(np.array([1.0, 2.0]), device=device)
    with GradientTape() as tape:
        y = (x.float().square() * 0.5).sum()
    (g,) = tape.gradient(y, [x])
    assert y.dtype == azyx.dtypes.float32 and g.dtype == azyx.dtypes.float64
    np.testing.assert_allclose(g.numpy_sync(), [1.0, 2.0])


def test_todevice_gradient_comes_back_to_the_source_device() -> None:
    if "c:1" not in azyx.devices():
        pytest.skip("needs two C devices (tests/conftest.py configures them)")
    x = Tensor(np.array([1.0, 2.0, 3.0]), device="c:0")
    with GradientTape() as tape:
        y = x.to("c:1").square() * 3
        loss = (y.to("c:0") + x.exp()).sum()
    (g,) = tape.gradient(loss, [x])
    assert g.device == "c:0" and y.device == "c:1"
    np.testing.assert_allclose(g.numpy_sync(), 6 * np.array([1.0, 2.0, 3.0]) + np.exp([1.0, 2.0, 3.0]))
    with GradientTape() as tape:  # the other direction, the loss on c:1
        loss = (x.to("c:1") * 2).sum()
    g1 = tape.gradient(loss, x)
    assert g1.device == "c:0"
    np.testing.assert_array_equal(g1.numpy_sync(), [2.0, 2.0, 2.0])


def test_dropout_gradient_is_the_kept_mask_scaled(device: str) -> None:
    x = Tensor(np.ones((40, 50)), device=device)
    with azyx.train(), GradientTape() as tape:
        y = x.dropout(0.25)
        loss = y.sum()
    g = tape.gradient(loss, x)
    run_sync(azyx.realize(y, g))
    yv, gv = y.numpy_sync(), g.numpy_sync()
    np.testing.assert_array_equal(gv, yv)  # x is all ones: the gradient is the mask times 1/(1-p), like y
    assert 0.6 < (gv != 0).mean() < 0.9 and set(np.unique(gv)) <= {0.0, 1 / 0.75}


# ---- higher order -------------------------------------------------------------------------------------------------
def test_second_and_third_derivatives_with_nested_tapes(device: str) -> None:
    xv = np.array([-1.5, 0.5, 2.0])
    x = Tensor(xv, device=device)
    ones = Tensor(np.ones(3), device=device)
    with GradientTape() as t3:
        with GradientTape() as t2:
            with GradientTape() as t1:
                y = x**4
            d1 = t1.gradient(y, x, seed=ones)
        d2 = t2.gradient(d1, x, seed=ones)
    d3 = t3.gradient(d2, x, seed=ones)
    run_sync(azyx.realize(d1, d2, d3))
    np.testing.assert_allclose(d1.numpy_sync(), 4 * xv**3)
    np.testing.assert_allclose(d2.numpy_sync(), 12 * xv**2)
    np.testing.assert_allclose(d3.numpy_sync(), 24 * xv)


@pytest.mark.parametrize("name,fn,d2", [
    ("cube", lambda x: x**3, lambda x: 6 * x),
    ("sin", lambda x: x.sin(), lambda x: -np.sin(x)),
    ("tanh", lambda x: x.tanh(), lambda x: -2 * np.tanh(x) * (1 - np.tanh(x) ** 2)),
    ("x_exp_x", lambda x: x * x.exp(), lambda x: (x + 2) * np.exp(x)),
    ("sigmoid", lambda x: x.sigmoid(), lambda x: (s := 1 / (1 + np.exp(-x))) * (1 - s) * (1 - 2 * s)),
    ("log", lambda x: x.log(), lambda x: -1 / x**2),
])
def test_second_derivative(device: str, name: str, fn: Callable[[Tensor], Tensor], d2: Callable[..., Any]) -> None:
    xv = np.array([0.3, 0.9, 1.7])
    x = Tensor(xv, device=device)
    with GradientTape() as outer:
        with GradientTape() as inner:
            y = fn(x).sum()
        dx = inner.gradient(y, x).sum()  # inside the outer block: recorded by it
    np.testing.assert_allclose(outer.gradient(dx, x).numpy_sync(), d2(xv), rtol=1e-10)


def test_mixed_partials_and_hessian_vector_product_against_torch(device: str) -> None:
    rng = np.random.default_rng(3)
    xv, wv, v = rng.standard_normal((4, 3)), rng.standard_normal((3, 5)), rng.standard_normal((4, 3))
    x, w = Tensor(xv, device=device), Tensor(wv, device=device)
    with GradientTape() as outer:
        with GradientTape() as inner:
            loss = (x @ w).tanh().log_softmax(axis=-1).square().sum()
        gx = inner.gradient(loss, x)
        hvp_target = (gx * Tensor(v, device=device)).sum()
    hx, hw = outer.gradient(hvp_target, [x, w])
    if torch is None:
        assert np.isfinite(hx.numpy_sync()).all() and np.isfinite(hw.numpy_sync()).all()
        return
    tx, tw = torch.tensor(xv, requires_grad=True), torch.tensor(wv, requires_grad=True)
    tl = (tx @ tw).tanh().log_softmax(dim=-1).square().sum()
    (tgx,) = torch.autograd.grad(tl, tx, create_graph=True)
    thx, thw = torch.autograd.grad((tgx * torch.as_tensor(v)).sum(), [tx, tw])
    np.testing.assert_allclose(gx.numpy_sync(), tgx.detach().numpy(), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(hx.numpy_sync(), thx.numpy(), rtol=1e-9, atol=1e-11)
    np.testing.assert_allclose(hw.numpy_sync(), thw.numpy(), rtol=1e-9, atol=1e-11)


# ---- tape semantics -----------------------------------------------------------------------------------------------
def test_gradients_are_lazy_and_realize_with_the_forward_in_one_plan(device: str) -> None:
    xv, wv = np.arange(6.0).reshape(2, 3), np.array([[1.0], [-2.0], [0.5]])
    x, w, b = Tensor(xv, device=device), Tensor(wv, device=device), Tensor(np.array([0.25]), device=device)
    y = Tensor(np.array([[1.0], [2.0]]), device=device)
    with GradientTape() as tape:
        loss = ((x @ w + b) - y).square().mean()
    gw, gb = tape.gradient(loss, [w, b])
    assert GRAPH[gw.id].buffer is None and GRAPH[gb.id].buffer is None  # nothing ran yet
    plan = azyx.schedule(loss, gw, gb)
    assert len(plan.kernels) >= 1
    run_sync(azyx.realize(loss, gw, gb))
    r = xv @ wv + 0.25 - [[1.0], [2.0]]
    np.testing.assert_allclose(loss.numpy_sync(), (r**2).mean())
    np.testing.assert_allclose(gw.numpy_sync(), xv.T @ r)
    np.testing.assert_allclose(gb.numpy_sync(), [r.sum()])


async def test_one_realize_runs_forward_and_backward(device: str) -> None:
    x = Tensor(np.array([1.0, 2.0]), device=device)
    with GradientTape() as tape:
        loss = (x.exp() * x).sum()
    g = tape.gradient(loss, x)
    await azyx.realize(loss, g)
    np.testing.assert_allclose(await g.numpy(), (np.array([1.0, 2.0]) + 1) * np.exp([1.0, 2.0]))


def test_persistent_tape_answers_several_calls_and_plain_tape_one(device: str) -> None:
    x = Tensor(np.array([1.0, 2.0]), device=device)
    with GradientTape(persistent=True) as tape:
        y = (x**2).sum()
        z = (x**3).sum()
    np.testing.assert_allclose(tape.gradient(y, x).numpy_sync(), [2.0, 4.0])
    np.testing.assert_allclose(tape.gradient(z, x).numpy_sync(), [3.0, 12.0])
    np.testing.assert_allclose(tape.gradient(y, x).numpy_sync(), [2.0, 4.0])
    with GradientTape() as once:
        y = (x**2).sum()
    once.gradient(y, x)
    with pytest.raises(azyx.RuntimeStateError, match="persistent"):
        once.gradient(y, x)
    assert not once.ids  # it let go of what it recorded


def test_seed_rules(device: str) -> None:
    x = Tensor(np.array([1.0, 2.0, 3.0]), device=device)
    with GradientTape(persistent=True) as tape:
        y = x * x
    with pytest.raises(azyx.ShapeError, match=r"\(3,\)"):
        tape.gradient(y, x)
    with pytest.raises(azyx.ShapeError, match=r"\(2,\)"):
        tape.gradient(y, x, seed=np.ones(2))
    np.testing.assert_allclose(tape.gradient(y, x, seed=np.array([1.0, 0.0, -1.0])).numpy_sync(), [2.0, 0.0, -6.0])
    np.testing.assert_allclose(tape.gradient(y, x, seed=Tensor([1.0, 1.0, 1.0])).numpy_sync(), [2.0, 4.0, 6.0])
    with pytest.raises(azyx.DTypeError, match="int32"):
        tape.gradient((x > 1).cast("int32").sum(), x)


def test_unreached_and_integer_sources_get_zeros(device: str) -> None:
    x = Tensor(np.array([1.0, 2.0]), device=device)
    unused = Tensor(np.ones((2, 2), np.float32), device=device)
    idx = Tensor(np.array([1, 0], np.int32), device=device)
    outside = x * 5  # built before the tape: a constant to it
    with GradientTape() as tape:
        loss = (outside * x).sum() + idx.cast("float64").sum()
    gx, gu, gi, go = tape.gradient(loss, [x, unused, idx, outside])
    np.testing.assert_allclose(gx.numpy_sync(), [5.0, 10.0])  # only the recorded multiply: d/dx of c * x
    np.testing.assert_array_equal(gu.numpy_sync(), np.zeros((2, 2), np.float32))
    assert gu.dtype == azyx.dtypes.float32 and gi.dtype == azyx.dtypes.int32
    np.testing.assert_array_equal(gi.numpy_sync(), [0, 0])
    np.testing.assert_allclose(go.numpy_sync(), [1.0, 2.0])  # a source built outside is still a source


def test_target_as_source_and_intermediate_sources(device: str) -> None:
    x = Tensor(np.array([1.0, 2.0]), device=device)
    with GradientTape() as tape:
        h = x * 3
        loss = (h * h).sum()
    gl, gh, gx = tape.gradient(loss, [loss, h, x])
    np.testing.assert_allclose(gl.numpy_sync(), 1.0)
    np.testing.assert_allclose(gh.numpy_sync(), [6.0, 12.0])
    np.testing.assert_allclose(gx.numpy_sync(), [18.0, 36.0])  # the total derivative through h


def test_bad_arguments_raise_azyx_errors(device: str) -> None:
    x = Tensor(np.array([1.0, 2.0]), device=device)
    with GradientTape(persistent=True) as tape:
        y = x.sum()
    with pytest.raises(azyx.DTypeError, match="list"):
        tape.gradient(y, [[x]])  # type: ignore[list-item]
    with pytest.raises(azyx.DTypeError, match="ndarray"):
        tape.gradient(np.ones(2), x)  # type: ignore[arg-type]


def test_gradient_of_a_target_realized_while_the_tape_is_alive(device: str) -> None:
    x = Tensor(np.array([0.5, -1.0]), device=device)
    with GradientTape() as tape:
        y = (x * 2).tanh()
        loss = y.sum()
    loss.realize_sync()  # the tape keeps how loss was made although it is realized
    n = GRAPH[loss.id]
    assert n.buffer is not None and n.op is not Op.LEAF and n.src
    g = tape.gradient(loss, x)
    np.testing.assert_allclose(g.numpy_sync(), 2 * (1 - np.tanh([1.0, -2.0]) ** 2))
    assert GRAPH[loss.id].op is Op.LEAF  # released after the one call: it forgot its sources


def _settle() -> None:
    gc.collect()


def test_dropping_the_tape_returns_the_graph_to_its_baseline(device: str) -> None:
    x = Tensor(np.arange(6.0).reshape(2, 3), device=device)
    _settle()
    base = len(GRAPH)
    with GradientTape(persistent=True) as tape:
        y = (x.exp() * x).sum(axis=1).softmax()
        loss = y.square().sum()
    loss.realize_sync()
    y.realize_sync()
    g = tape.gradient(loss, x)
    g.realize_sync()
    grown = len(GRAPH)
    assert grown > base + 5 and GRAPH[loss.id].src  # a live persistent tape keeps realized nodes' sources
    del g
    del tape
    _settle()
    assert len(GRAPH) == base + 2  # y and loss, now leaves
    assert GRAPH[loss.id].op is Op.LEAF and GRAPH[y.id].op is Op.LEAF
    del y, loss
    assert len(GRAPH) == base


def test_non_persistent_tape_with_everything_dropped_returns_to_baseline(device: str) -> None:
    x = Tensor(np.arange(4.0), device=device)
    _settle()
    base = len(GRAPH)
    for _ in range(3):
        with GradientTape() as tape:
            loss = (x.sin() * x).sum()
        g = tape.gradient(loss, x)
        run_sync(azyx.realize(loss, g))
        assert len(GRAPH) == base + 2  # only the two realized leaves remain
        del tape, loss, g
        assert len(GRAPH) == base


def test_a_freed_and_reused_id_is_not_mistaken_for_a_recorded_one(device: str) -> None:
    x = Tensor(np.array([1.0, 2.0]), device=device)
    with GradientTape(persistent=True) as tape:
        a = x * 2
    old = a.id
    assert tape.watched(a)
    del a  # freed: its id goes back to the free list
    z = x * 3  # outside the tape, likely in the same slot
    assert z.id == old, "the graph's free list is LIFO: the slot is reused"
    assert not tape.watched(z) and old not in tape.ids
    with tape:
        loss = (z * x).sum()
    # d/dx of (3x) * x with 3x built outside the tape: only the recorded multiply counts -> 3x, not 6x
    np.testing.assert_allclose(tape.gradient(loss, x).numpy_sync(), [3.0, 6.0])


def test_nested_tapes_with_equal_id_sets_keep_recording(device: str) -> None:
    x = Tensor(np.array([1.0, 2.0]), device=device)
    with GradientTape() as outer:
        with GradientTape() as inner:
            y = x * x
        assert inner.watched(y) and outer.watched(y) and inner.ids == outer.ids  # equal sets, distinct tapes
        z = (y * 3).sum()  # after the inner block ends, only the outer records
    assert outer.watched(z) and not inner.watched(z)
    np.testing.assert_allclose(outer.gradient(z, x).numpy_sync(), [6.0, 12.0])


def test_tape_release_and_reuse_errors(device: str) -> None:
    x = Tensor(np.array([1.0]), device=device)
    tape = GradientTape()
    with tape:
        y = x * 2
    tape.release()
    assert not tape.ids
    with pytest.raises(azyx.RuntimeStateError):
        tape.gradient(y.sum(), x)
    with pytest.raises(azyx.RuntimeStateError), tape:
        pass
