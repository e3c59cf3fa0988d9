"""Neural-network layers and losses built from Tensor ops: a `Module` base that finds its parameters, the usual
layers with PyTorch's default initialisation, state dicts, and the common losses.

Parameters are plain Tensors held as attributes (directly, in sub-Modules, or in lists/tuples/dicts of them); an
optimiser (optim.py) rebinds those handles to their updated values with `Tensor.assign`, so a model always reads
its current weights.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from azyx.dtypes import dtypes, to_dtype
from azyx.errors import ArgumentError, DTypeError, ShapeError, StateDictError
from azyx.tensor import Tensor


class Module:
    """Base class of layers and models: `forward` computes, `__call__` calls it; every Tensor attribute (also inside
    sub-Modules and lists, tuples or dicts of them) is a parameter, named by its attribute path; attributes whose
    name starts with "_" are not looked into (keep non-trainable tensors there).

    `training` is None by default: the module follows the global mode (`with azyx.train():`); `train()`/`eval()`
    set it explicitly for the module and its children.

    >>> from azyx import nn, Tensor
    >>> class MLP(nn.Module):
    ...     def __init__(self):
    ...         self.layers = [nn.Linear(4, 8), nn.Linear(8, 2)]
    ...     def forward(self, x):
    ...         return self.layers[1](self.layers[0](x).relu())
    >>> [name for name, _ in MLP().named_parameters()]
    ['layers.0.weight', 'layers.0.bias', 'layers.1.weight', 'layers.1.bias']
    """

    training: bool | None = None

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__} must define forward()")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)

    # ---------------------------------------------------------------- parameters
    def named_parameters(self) -> list[tuple[str, Tensor]]:
        """(name, Tensor) for every parameter, in attribute order; a tensor shared by two attributes appears once."""
        out: list[tuple[str, Tensor]] = []
        seen: set[int] = set()
        _collect(self, "", out, seen, set())
        return out

    def parameters(self) -> list[Tensor]:
        return [t for _, t in self.named_parameters()]

    def modules(self) -> Iterator[Module]:
        """This module and every sub-Module, depth first."""
        yield self
        for v in vars(self).values():
            for m in _submodules(v):
                yield from m.modules()

    # ---------------------------------------------------------------- modes
    def train(self, mode: bool = True) -> Module:
        """Set training mode (dropout active) on this module and its children; returns self."""
        for m in self.modules():
            m.training = mode
        return self

    def eval(self) -> Module:
        return self.train(False)

    def is_training(self) -> bool:
        return Tensor.training if self.training is None else self.training

    # ---------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Tensor]:
        """name -> the parameter's current value: a new handle to the same node (no copy; a later optimiser step
        rebinds the model's handles, not these)."""
        return {name: Tensor(t) for name, t in self.named_parameters()}

    def load_state_dict(self, state: Mapping[str, Any], strict: bool = True) -> None:
        """Replace parameters by name (lazily: the values are read when next realized). Values are Tensors or numpy
        arrays, cast to the parameter's dtype and moved to its device. With `strict`, missing or unexpected keys raise
        `StateDictError`; a shape mismatch always raises `ShapeError`; both name the key."""
        params = dict(self.named_parameters())
        if strict:
            missing = [k for k in params if k not in state]
            unexpected = [k for k in state if k not in params]
            if missing or unexpected:
                raise StateDictError(f"load_state_dict: missing keys {missing}, unexpected keys {unexpected}")
        for name, p in params.items():
            if name not in state:
                continue
            value = state[name]
            if not isinstance(value, Tensor):
                value = Tensor(np.asarray(value), dtype=p.dtype, device=p.device)
            if value.shape != p.shape:
                raise ShapeError(f"load_state_dict: {name!r} has shape {value.shape}, the parameter {p.shape}")
            p.assign(value.cast(p.dtype).to(p.device))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={tuple(t.shape)}' for k, t in self.named_parameters())})"


def _submodules(v: Any) -> list[Module]:
    if isinstance(v, Module):
        return [v]
    if isinstance(v, list | tuple):
        return [m for x in v for m in _submodules(x)]
    if isinstance(v, dict):
        return [m for x in v.values() for m in _submodules(x)]
    return []


def _collect(v: Any, prefix: str, out: list[tuple[str, Tensor]], seen: set[int], visiting: set[int]) -> None:
    if isinstance(v, Tensor):
        if id(v) not in seen:
            seen.add(id(v))
            out.append((prefix, v))
        return
    if isinstance(v, Module):
        if id(v) in visiting:
            return
        visiting.add(id(v))
        items = list(vars(v).items())
    elif isinstance(v, list | tuple):
        items = [(str(i), x) for i, x in enumerate(v)]
    elif isinstance(v, dict):
        items = [(str(k), x) for k, x in v.items()]
    else:
        return
    for k, x in items:
        if k.startswith("_") or k == "training":
            continue
        _collect(x, f"{prefix}.{k}" if prefix else k, out, seen, visiting)


def _uniform(shape: tuple[int, ...], bound: float, dtype: Any, device: str | None) -> Tensor:
    return Tensor.uniform(*shape, low=-bound, high=bound, dtype=dtype, device=device)


# ------------------------------------------------------------------------------------------------ layers
class Linear(Module):
    """y = x @ weight.T + bias, weight of shape (out, in) like PyTorch, initialised like PyTorch (kaiming-uniform:
    U(-1/sqrt(in), 1/sqrt(in)) for weight and bias), reproducible with `azyx.manual_seed`.

    >>> from azyx import nn, Tensor
    >>> nn.Linear(3, 2)(Tensor.ones(5, 3)).shape
    (5, 2)
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, dtype: Any = None,
                 device: str | None = None):
        bound = 1 / math.sqrt(in_features) if in_features else 0.0
        self.weight = _uniform((out_features, in_features), bound, dtype, device)
        self.bias = _uniform((out_features,), bound, dtype, device) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        y = x @ self.weight.T
        return y + self.bias if self.bias is not None else y


class Conv2d(Module):
    """2-D convolution over (N, C, H, W), weight (out, in, kh, kw), PyTorch's default initialisation."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int | tuple[int, int],
                 stride: int | tuple[int, int] = 1, padding: int | tuple[int, int] = 0, bias: bool = True,
                 dtype: Any = None, device: str | None = None):
        kh, kw = (kernel_size, kernel_size) if isinstance(kernel_size, int) else kernel_size
        self.stride, self.padding = stride, padding
        bound = 1 / math.sqrt(in_channels * kh * kw)
        self.weight = _uniform((out_channels, in_channels, kh, kw), bound, dtype, device)
        self.bias = _uniform((out_channels,), bound, dtype, device) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        return x.conv2d(self.weight, self.bias, stride=self.stride, padding=self.padding)


class LayerNorm(Module):
    """Normalise over the last len(normalized_shape) axes, then scale and shift (weight ones, bias zeros)."""

    def __init__(self, normalized_shape: int | tuple[int, ...], eps: float = 1e-5, elementwise_affine: bool = True,
                 dtype: Any = None, device: str | None = None):
        shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
        self.shape, self.eps = shape, eps
        dt = to_dtype(dtype) if dtype is not None else dtypes.default_float
        self.weight = Tensor(np.ones(shape, dt.numpy), dtype=dt, device=device) if elementwise_affine else None
        self.bias = Tensor(np.zeros(shape, dt.numpy), dtype=dt, device=device) if elementwise_affine else None

    def forward(self, x: Tensor) -> Tensor:
        if x.shape[x.ndim - len(self.shape):] != self.shape:
            raise ShapeError(f"LayerNorm over {self.shape} got an input of shape {x.shape}")
        y = x.layernorm(axis=tuple(range(-len(self.shape), 0)), eps=self.eps)
        if self.weight is not None and self.bias is not None:
            y = y * self.weight + self.bias
        return y


class Embedding(Module):
    """Rows of a (num_embeddings, dim) table picked by integer indices; initialised N(0, 1) like PyTorch."""

    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: Any = None, device: str | None = None):
        self.weight = Tensor.randn(num_embeddings, embedding_dim, dtype=dtype, device=device)

    def forward(self, idx: Tensor) -> Tensor:
        if idx.dtype.is_float:
            raise DTypeError(f"Embedding indices must be integer, got {idx.dtype.name}")
        return self.weight[idx]


class Dropout(Module):
    """Zero each element with probability p and scale the rest by 1/(1-p), in training mode only."""

    def __init__(self, p: float = 0.5):
        if not 0.0 <= p <= 1.0:
            raise ArgumentError(f"dropout probability must be in [0, 1], got {p}")
        self.p = p

    def forward(self, x: Tensor) -> Tensor:
        mode = self.is_training()
        if Tensor.tracer is not None:  # azyx.jit: a replay holds only while this module's mode is the same
            Tensor.tracer.guard(self.is_training, mode)
        prev, Tensor.training = Tensor.training, mode
        try:
            return x.dropout(self.p)
        finally:
            Tensor.training = prev


class Sequential(Module):
    """Apply layers in order: `Sequential(Linear(4, 8), ReLU(), Linear(8, 2))`."""

    def __init__(self, *layers: Any):
        self.layers = list(layers)

    def forward(self, x: Tensor) -> Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class ReLU(Module):
    def forward(self, x: Tensor) -> Tensor:
        return x.relu()


# ------------------------------------------------------------------------------------------------ losses
def _reduce(loss: Tensor, reduction: str) -> Tensor:
    if reduction == "mean":
        return loss.mean()
    if reduction == "sum":
        return loss.sum()
    if reduction == "none":
        return loss
    raise ArgumentError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")


def _same_shape(name: str, a: Tensor, b: Tensor) -> None:
    if a.shape != b.shape:
        raise ShapeError(f"{name}: input of shape {a.shape} and target of shape {b.shape} differ")


def mse_loss(pred: Tensor, target: Tensor, reduction: str = "mean") -> Tensor:
    """Mean squared error.

    >>> from azyx import nn, Tensor
    >>> nn.mse_loss(Tensor([1.0, 2.0]), Tensor([1.0, 4.0])).numpy_sync().item()
    2.0
    """
    _same_shape("mse_loss", pred, target)
    return _reduce((pred - target).square(), reduction)


def cross_entropy(logits: Tensor, target: Tensor, reduction: str = "mean") -> Tensor:
    """Cross entropy of (N, C) logits against (N,) integer classes (or (C,) against a 0-d class), computed with
    log_softmax (numerically stable for large logits).

    >>> from azyx import nn, Tensor
    >>> round(nn.cross_entropy(Tensor([[0.0, 0.0]]), Tensor([1])).numpy_sync().item(), 4)
    0.6931
    """
    if target.dtype.is_float:
        raise DTypeError(f"cross_entropy targets must be integer class indices, got {target.dtype.name}")
    if logits.ndim not in (1, 2) or target.shape != logits.shape[:-1]:
        raise ShapeError(f"cross_entropy needs (N, C) logits and (N,) targets, got {logits.shape} and {target.shape}")
    logp = logits.log_softmax(axis=-1)
    classes = logits._placed_like(Tensor.arange(logits.shape[-1], device=logits.device))
    picked = Tensor.where(target.unsqueeze(-1) == classes, logp, 0.0)
    return _reduce(-picked.sum(axis=-1), reduction)


def binary_cross_entropy(prob: Tensor, target: Tensor, reduction: str = "mean") -> Tensor:
    """-(y log p + (1 - y) log(1 - p)) on probabilities, with each log clamped at -100 like PyTorch."""
    _same_shape("binary_cross_entropy", prob, target)
    loss = -(target * prob.log().maximum(-100.0) + (1 - target) * (1 - prob).log().maximum(-100.0))
    return _reduce(loss, reduction)


def binary_cross_entropy_with_logits(logits: Tensor, target: Tensor, reduction: str = "mean") -> Tensor:
    """binary_cross_entropy(sigmoid(logits), target), stable for any logit: (1 - y) x + softplus(-x)."""
    _same_shape("binary_cross_entropy_with_logits", logits, target)
    return _reduce((1 - target) * logits + (-logits).softplus(), reduction)
