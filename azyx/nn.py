"""Neural-network layers and losses built from Tensor ops: a `Module` base that finds its parameters, the usual
layers with PyTorch's default initialisation, state dicts, and the common losses.

Parameters are plain Tensors held as attributes (directly, in sub-Modules, or in lists/tuples/dicts of them); an
optimiser (optim.py) rebinds those handles to their updated values with `Tensor.assign`, so a model always reads
its current weights.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from azyx.codegen.templates import attention
from azyx.device import DISK, buffer_of
from azyx.dtypes import DType, dtypes, to_dtype
from azyx.errors import ArgumentError, DTypeError, ShapeError, StateDictError
from azyx.graph import GRAPH, Node, Op
from azyx.runtime import RT
from azyx.tensor import Tensor, _as_dtype, broadcast_shapes


class Module:
    """Base class of layers and models: `forward` computes, `__call__` calls it; every Tensor attribute (also inside
    sub-Modules and lists, tuples or dicts of them) is a parameter, named by its attribute path; attributes whose
    name starts with "_" are not looked into (keep non-trainable tensors there).

    `training` is None by default: the module follows the global mode (`with azyx.train():`); `train()`/`eval()`
    set it explicitly for the module and its children.

    `copy.deepcopy(module)` is a model of its own (the "keep the best model" and EMA habits): its parameters are new
    handles to the same values, and training either model (which rebinds its handles) leaves the other as it was.

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
        """The layer's computation: subclasses define it (`module(x)` calls it). Builds lazy tensors; not a
        coroutine."""
        raise NotImplementedError(f"{type(self).__name__} must define forward()")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """`forward(*args, **kwargs)`: build this module's output graph (lazy; realize the result to compute it)."""
        return self.forward(*args, **kwargs)

    # ---------------------------------------------------------------- parameters
    def named_parameters(self) -> list[tuple[str, Tensor]]:
        """(name, Tensor) for every parameter, in attribute order; a tensor shared by two attributes appears once."""
        out: list[tuple[str, Tensor]] = []
        seen: set[int] = set()
        _collect(self, "", out, seen, set())
        return out

    def parameters(self) -> list[Tensor]:
        """Every parameter Tensor (those of `named_parameters()`, in the same order), for an optimiser."""
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
        """Set evaluation mode (dropout off) on this module and its children: `train(False)`; returns self."""
        return self.train(False)

    def is_training(self) -> bool:
        """Whether this module runs in training mode: its own `train()`/`eval()` setting, else `azyx.train()`'s."""
        return Tensor.training if self.training is None else self.training

    # ---------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Tensor]:
        """name -> the parameter's current value: a new handle to the same node (no copy; a later optimiser step
        rebinds the model's handles, not these)."""
        return {name: Tensor(t) for name, t in self.named_parameters()}

    def load_state_dict(self, state: Mapping[str, Any], strict: bool = True) -> None:
        """Replace parameters by name. Values are Tensors or numpy arrays, cast to the parameter's dtype and moved to
        its device. A file-backed (disk) tensor, such as `azyx.io.load_safetensors(path)` gives, is read now, once,
        into a realized tensor on the parameter's device (a blocking file read of only its bytes): forward passes
        never read the file again. Other tensors stay lazy (computed when next realized). With `strict`, missing or
        unexpected keys raise `StateDictError`; a shape mismatch always raises `ShapeError`; both name the key."""
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
            n = value._node
            if n.device == DISK and n.buffer is not None and n.view is not None:  # read once, onto p's device
                buf = buffer_of(n)
                value = Tensor(buf.device.read(buf, n.view, n.shape, n.dtype), dtype=n.dtype, device=p.device)
            p.assign(value.cast(p.dtype).to(p.device))

    def to(self, device: Any = None, dtype: Any = None) -> Module:
        """Move every parameter to `device` and/or cast its float parameters to `dtype` (`model.to("c:0")`,
        `model.to(dtypes.float16)`, `model.to("c:0", "float16")`, as PyTorch's `Module.to`): each parameter handle is
        rebound to its lazy copy, made when next realized. Tensors under "_" attributes are not parameters and stay.
        Returns self (not a coroutine).

        >>> from azyx import nn
        >>> nn.Linear(2, 3).to("c:0").weight.device
        'c:0'
        """
        if device is not None and _as_dtype(device) is not None:
            device, dtype = None, device
        for p in self.parameters():
            cast = dtype if dtype is not None and p.dtype.is_float else None
            if device is not None or cast is not None:
                p._rebind(p.to(device, cast))
        return self

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


# set while a loader builds a model whose parameters its checkpoint replaces: they start as zeros (lazy constants)
# instead of random draws (all-MiniLM-L6-v2's 30522 x 384 table: ~0.3 s of the loop's thread)
_ZEROS = contextvars.ContextVar("azyx_nn_zeros", default=False)


@contextlib.contextmanager
def _zeros_until_loaded() -> Iterator[None]:
    """Layers made inside start with zero parameters (a checkpoint's load assigns every one)."""
    token = _ZEROS.set(True)
    try:
        yield
    finally:
        _ZEROS.reset(token)


def _uniform(shape: tuple[int, ...], bound: float, dtype: Any, device: str | None) -> Tensor:
    if _ZEROS.get():
        return Tensor.zeros(*shape, dtype=dtype, device=device)
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
        """`x @ weight.T + bias` over the last axis of `x` (..., in_features) -> (..., out_features), x's dtype and
        device."""
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
        """The convolution of `x` (N, C_in, H, W) -> (N, C_out, H', W') with the layer's stride and padding."""
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
        """`x` normalised over its last axes (`normalized_shape`, else `ShapeError`), scaled by `weight`, shifted by
        `bias`."""
        if x.shape[x.ndim - len(self.shape):] != self.shape:
            raise ShapeError(f"LayerNorm over {self.shape} got an input of shape {x.shape}")
        y = x.layernorm(axis=tuple(range(-len(self.shape), 0)), eps=self.eps)
        if self.weight is not None and self.bias is not None:
            y = y * self.weight + self.bias
        return y


class Embedding(Module):
    """Rows of a (num_embeddings, dim) table picked by integer indices; initialised N(0, 1) like PyTorch."""

    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: Any = None, device: str | None = None):
        draw = Tensor.zeros if _ZEROS.get() else Tensor.randn
        self.weight = draw(num_embeddings, embedding_dim, dtype=dtype, device=device)

    def forward(self, idx: Tensor) -> Tensor:
        """The rows of `weight` at integer indices `idx` (any shape): shape `idx.shape + (embedding_dim,)`, weight's
        dtype."""
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
        """`x` with each element zeroed with probability `p` and the rest scaled by 1/(1-p) in training mode; `x`
        otherwise."""
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
        """`x` through every layer in order."""
        for layer in self.layers:
            x = layer(x)
        return x


class ReLU(Module):
    """`max(x, 0)` elementwise, as a layer (`Tensor.relu`)."""
    def forward(self, x: Tensor) -> Tensor:
        """`x.relu()`: max(x, 0) elementwise, x's dtype."""
        return x.relu()


class GELU(Module):
    """`x * Phi(x)`; `approximate="tanh"` for the tanh form (PyTorch's names)."""

    def __init__(self, approximate: str = "none"):
        if approximate not in ("none", "tanh"):
            raise ArgumentError(f"GELU approximate must be 'none' or 'tanh', got {approximate!r}")
        self.approximate = approximate

    def forward(self, x: Tensor) -> Tensor:
        """`x.gelu(approximate=...)`: x's dtype."""
        return x.gelu(approximate=self.approximate)


class SiLU(Module):
    """`x * sigmoid(x)` elementwise, as a layer (`Tensor.silu`)."""
    def forward(self, x: Tensor) -> Tensor:
        """`x.silu()`: x * sigmoid(x), x's dtype."""
        return x.silu()


class RMSNorm(Module):
    """`x / sqrt(mean(x^2) + eps) * weight` over the last len(normalized_shape) axes (PyTorch's RMSNorm: eps None
    is the machine epsilon of the input's dtype); the mean is taken in float32 at least."""

    def __init__(self, normalized_shape: int | tuple[int, ...], eps: float | None = None,
                 elementwise_affine: bool = True, dtype: Any = None, device: str | None = None):
        shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
        self.shape, self.eps = shape, eps
        dt = to_dtype(dtype) if dtype is not None else dtypes.default_float
        self.weight = Tensor(np.ones(shape, dt.numpy), dtype=dt, device=device) if elementwise_affine else None

    def forward(self, x: Tensor) -> Tensor:
        """`x` divided by its root mean square over the last axes (`normalized_shape`, else `ShapeError`), times
        `weight`."""
        if x.shape[x.ndim - len(self.shape):] != self.shape:
            raise ShapeError(f"RMSNorm over {self.shape} got an input of shape {x.shape}")
        eps = self.eps if self.eps is not None else float(np.finfo(x.dtype.numpy).eps)
        w = x.cast(dtypes.float32) if x.dtype.itemsize < 4 else x
        axes = tuple(range(-len(self.shape), 0))
        y = (w * ((w * w).mean(axis=axes, keepdim=True) + eps).rsqrt()).cast(x.dtype)
        return y * self.weight if self.weight is not None else y


class MultiheadAttention(Module):
    """PyTorch's `nn.MultiheadAttention` (its parameter names, so its state dict loads as it is): the inputs
    projected by `in_proj_weight` (3E x E) and `in_proj_bias`, split into `num_heads` heads, attended with
    `scaled_dot_product_attention`, and projected back by `out_proj`. Inputs are (L, N, E), or (N, L, E) with
    `batch_first`; `forward` returns (output, the attention weights averaged over heads, or None where
    `need_weights=False`)."""

    def __init__(self, embed_dim: int, num_heads: int, bias: bool = True, batch_first: bool = False,
                 dtype: Any = None, device: str | None = None):
        if num_heads <= 0 or embed_dim % num_heads:
            raise ArgumentError(f"embed_dim {embed_dim} is not divisible into num_heads={num_heads} heads")
        self.embed_dim, self.num_heads, self.batch_first = embed_dim, num_heads, batch_first
        bound = math.sqrt(6.0 / (embed_dim + 3 * embed_dim))  # xavier-uniform over the stacked projections
        self.in_proj_weight = _uniform((3 * embed_dim, embed_dim), bound, dtype, device)
        dt = to_dtype(dtype) if dtype is not None else dtypes.default_float
        self.in_proj_bias = Tensor(np.zeros(3 * embed_dim, dt.numpy), dtype=dt, device=device) if bias else None
        self.out_proj = Linear(embed_dim, embed_dim, bias=bias, dtype=dtype, device=device)
        if self.out_proj.bias is not None:
            self.out_proj.bias = Tensor(np.zeros(embed_dim, dt.numpy), dtype=dt, device=device)

    def forward(self, query: Tensor, key: Tensor, value: Tensor, key_padding_mask: Tensor | None = None,
                need_weights: bool = True, attn_mask: Tensor | None = None, average_attn_weights: bool = True,
                is_causal: bool = False) -> tuple[Tensor, Tensor | None]:
        """(output, weights): `query` attending to `key`/`value` ((L, N, E), or (N, L, E) with `batch_first`).

        `key_padding_mask` (N, S) and `attn_mask` (L, S) or (N * heads, L, S) follow PyTorch: a bool True masks a key
        out, a float is added to the scores. `need_weights=False` returns None for the weights and runs the fused
        attention; `average_attn_weights` averages them over heads; `is_causal` masks later keys where no mask is given.
        """
        if query.ndim != 3 or key.ndim != 3 or value.ndim != 3:
            raise ShapeError(f"MultiheadAttention takes batched 3-D inputs, got {query.shape}, {key.shape}, "
                             f"{value.shape}")
        if not self.batch_first:  # (L, N, E) -> (N, L, E)
            query, key, value = (t.transpose(0, 1) for t in (query, key, value))
        e, h = self.embed_dim, self.num_heads
        w, b = self.in_proj_weight, self.in_proj_bias
        q, k, v = ((x @ w[i * e:(i + 1) * e].T + (b[i * e:(i + 1) * e] if b is not None else 0.0))
                   for i, x in enumerate((query, key, value)))
        n, lq, lk = query.shape[0], query.shape[1], key.shape[1]
        q, k, v = (t.reshape(n, ln, h, e // h).transpose(1, 2) for t, ln in ((q, lq), (k, lk), (v, lk)))
        mask = _attention_mask(attn_mask, key_padding_mask, n, h, lq, lk)
        if need_weights:
            weights = _attention_weights(q, k, mask, is_causal and mask is None, None)
            out = weights @ v
        else:
            out = scaled_dot_product_attention(q, k, v, mask=mask, causal=is_causal and mask is None)
        out = self.out_proj(out.transpose(1, 2).reshape(n, lq, e))
        if not self.batch_first:
            out = out.transpose(0, 1)
        if not need_weights:
            return out, None
        return out, (weights.mean(axis=1) if average_attn_weights else weights)


def _attention_mask(attn_mask: Tensor | None, key_padding_mask: Tensor | None, n: int, h: int, lq: int,
                    lk: int) -> Tensor | None:
    """MultiheadAttention's masks (PyTorch's convention there: a bool True masks a key out, a float is added) as
    one mask for `scaled_dot_product_attention` (bool True: may attend), broadcast to (n, h, lq, lk)."""
    parts = []
    for m, shape in ((attn_mask, None), (key_padding_mask, (n, 1, 1, lk))):
        if m is None:
            continue
        if m.ndim == 3:  # (n * h, lq, lk)
            m = m.reshape(n, h, lq, lk)
        elif shape is not None:
            m = m.reshape(*shape)
        parts.append(Tensor.where(m, float("-inf"), 0.0) if m.dtype is dtypes.bool else m)
    if not parts:
        return None
    return parts[0] if len(parts) == 1 else parts[0] + parts[1]


def _attention_weights(q: Tensor, k: Tensor, mask: Tensor | None, causal: bool, scale: float | None) -> Tensor:
    return _scores(q, k, mask, causal, scale).softmax(-1)


def _scores(q: Tensor, k: Tensor, mask: Tensor | None, causal: bool, scale: float | None) -> Tensor:
    """q @ k^T * scale, masked (-inf where a key is dropped, a float mask added)."""
    lq, e, lk = q.shape[-2], q.shape[-1], k.shape[-2]
    s = (q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(e) if scale is None else scale)
    if causal:  # query i attends to keys 0..i (the top-left triangle, as PyTorch's is_causal)
        keep = Tensor.arange(lq, device=q.device).reshape(lq, 1) >= Tensor.arange(lk, device=q.device).reshape(1, lk)
        s = Tensor.where(keep, s, float("-inf"))
    elif mask is not None:
        s = Tensor.where(mask, s, float("-inf")) if mask.dtype is dtypes.bool else s + mask
    return s


def _split_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool, scale: float | None,
                     splits: int) -> Tensor:
    """The attention of `scaled_dot_product_attention` as flash-decoding does it, in ops (any device): the S keys in
    `splits` chunks (S a multiple of it), each chunk's maximum m, sum l of exp(s - m) and weighted values o, then
    out = sum exp(m - M) o / sum exp(m - M) l with M the largest m (a chunk all masked adds nothing; a row all masked
    is NaN, as the whole form). Float16 and bfloat16 are computed in float32 and rounded once."""
    f32 = dtypes.float32
    s = _scores(q, k, mask, causal, scale).cast(f32)
    *lead, lq, lk = s.shape
    ev, c = v.shape[-1], lk // splits
    s = s.reshape(*lead, lq, splits, c)
    m = s.max(-1, keepdim=True)  # (..., L, P, 1)
    p = (s - Tensor.where(m == float("-inf"), 0.0, m)).exp()
    chunks = v.cast(f32).reshape(*v.shape[:-2], splits, c, ev)  # (..., P, C, Ev)
    o = (p.transpose(-3, -2) @ chunks).transpose(-3, -2)  # (..., L, P, Ev)
    top = m.max(-2, keepdim=True)
    w = (m - Tensor.where(top == float("-inf"), 0.0, top)).exp()  # (..., L, P, 1)
    return ((o * w).sum(-2) / (p.sum(-1, keepdim=True) * w).sum(-2)).cast(q.dtype)


def _composed(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool, scale: float | None) -> Tensor:
    """The attention in ops where no kernel takes it: split over the keys as flash-decoding (`_split_attention`) for a
    few query rows against many keys (attention.DECODE_ROWS; chunks of at least attention.DECODE_CHUNK keys, S a
    multiple of their count), else the scores' softmax times v."""
    lq, lk = q.shape[-2], k.shape[-2]
    most = min(attention.DECODE_MAX_SPLITS, lk // attention.DECODE_CHUNK) if lq <= attention.DECODE_ROWS else 1
    splits = next((n for n in range(most, 1, -1) if lk % n == 0), 1)
    if splits > 1:
        return _split_attention(q, k, v, mask, causal, scale, splits)
    return _attention_weights(q, k, mask, causal, scale) @ v


def scaled_dot_product_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None, causal: bool = False,
                                 scale: float | None = None) -> Tensor:
    """`softmax(q @ k^T * scale + mask) @ v` over the last two axes: PyTorch's `F.scaled_dot_product_attention`
    (its `attn_mask`, `is_causal` and `scale`). q (..., L, E), k (..., S, E), v (..., S, Ev) -> (..., L, Ev), the
    leading axes broadcast. A bool mask says which keys each query may attend to (True: may), a float mask is added
    to the scores; `causal`: query i attends to keys 0..i. `scale` defaults to 1/sqrt(E) and is a runtime value (a
    new scale compiles nothing). A query row with every key masked out gives NaN, as PyTorch's math kernel.

    One kernel where the device has one (codegen.templates: C, CUDA), which never holds the (L, S) scores whole; float16
    and bfloat16 are computed in float32 there and rounded once. Elsewhere the composed ops run."""
    if q.ndim < 2 or k.ndim < 2 or v.ndim < 2:
        raise ShapeError(f"attention needs at least 2-D q, k, v, got {q.shape}, {k.shape}, {v.shape}")
    if k.shape[-1] != q.shape[-1]:
        raise ShapeError(f"attention: q's last axis {q.shape[-1]} differs from k's {k.shape[-1]} ({q.shape}, "
                         f"{k.shape})")
    if v.shape[-2] != k.shape[-2]:
        raise ShapeError(f"attention: v has {v.shape[-2]} keys, k has {k.shape[-2]} ({v.shape}, {k.shape})")
    if mask is not None and causal:
        raise ArgumentError("attention takes a mask or causal=True, not both (as PyTorch)")
    return _fused_attention(q, k, v, mask, causal, scale)


_ATTENTION_DTYPES = (dtypes.float32, dtypes.float16, dtypes.bfloat16)


def _fused_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool, scale: float | None
                     ) -> Tensor:
    """One ATTENTION node over q, k, v (and the mask) expanded to the output's batch axes, where one kernel can
    compute it (float32/float16/bfloat16 of one dtype, on one device; a bool or float mask of no other dtype): the
    scheduler renders it as a kernel where the device's dialect has one (templates.attention), else plans its composed
    form, its last source. The composed form (the ops of `_attention_weights` and a product) is built only where it
    may be needed: a tape records (autograd differentiates it), or the tensors' device has no kernel for these lengths
    (building it costs ~0.2 ms, more than the kernel of a short sequence). Anything else is the composed form alone."""
    ops = [q, k, v] + ([mask] if mask is not None else [])
    if (any(type(t) is not Tensor for t in ops) or q.dtype not in _ATTENTION_DTYPES or k.dtype is not q.dtype
            or v.dtype is not q.dtype or len({t.device for t in ops}) != 1
            or (mask is not None and mask.dtype is not dtypes.bool and mask.dtype is not q.dtype)):
        return _attention_weights(q, k, mask, causal, scale) @ v
    lq, e, lk, ev = q.shape[-2], q.shape[-1], k.shape[-2], v.shape[-1]
    batch = broadcast_shapes(*(t.shape[:-2] for t in ops))
    composed = None
    if not _has_attention_kernel(q.device, lq, lk, e, ev, q.dtype):
        composed = _composed(q, k, v, mask, causal, scale)
    elif GRAPH.recording:  # (what autograd differentiates)
        composed = _attention_weights(q, k, mask, causal, scale) @ v
        if composed.shape != (*batch, lq, ev) or composed.dtype is not q.dtype:
            return composed
    shapes = [(lq, e), (lk, e), (lk, ev)] + ([(lq, lk)] if mask is not None else [])
    srcs = [t._broadcast_to((*batch, *sh)) for t, sh in zip(ops, shapes)]
    s = q._const_like(1.0 / math.sqrt(e) if scale is None else scale, shape=(), dtype=dtypes.float32)  # (runtime)
    ids = (*(t.id for t in srcs[:3]), s.id, *(t.id for t in srcs[3:]), *([] if composed is None else [composed.id]))
    kind = "" if mask is None else "bool" if mask.dtype is dtypes.bool else "add"
    pinned = any(t._node.pinned for t in ops)
    return Tensor._from_node(Node(Op.ATTENTION, ids, (causal, kind), (*batch, lq, ev), q.dtype, q.device, pinned))


def _has_attention_kernel(device: str, lq: int, lk: int, e: int, ev: int, dtype: DType) -> bool:
    dev = RT.executor.devices.get(device)  # (None for the disk, say: compute goes elsewhere)
    dl = dev.dialect if dev is not None else None
    return dl is not None and attention.fits(dl, lq, lk, e, ev, dtype)


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
    log_softmax (numerically stable for large logits). A class outside [-C, C) raises IndexOutOfRange when realized
    (a negative one counts from the end, as an index does).

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
    picked = Tensor.where(classes._checked_classes(target).unsqueeze(-1) == classes, logp, 0.0)
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
