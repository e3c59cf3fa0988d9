"""The op table: every elementwise and reduce op, once. Renderers map these names to source text,
const folding uses the numpy function, dtype rules are read from here, and autograd (autograd.py) reads each
elementwise op's gradient rule from its entry."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

_erf = np.vectorize(math.erf, otypes=[np.float64])


def _floordiv(a: Any, b: Any) -> Any:
    with np.errstate(all="ignore"):
        if np.asarray(a).dtype.kind in "iub" and np.all(np.asarray(b) == 0):
            return np.zeros_like(np.asarray(a) // 1)
        return np.floor_divide(a, b)


def _mod(a: Any, b: Any) -> Any:
    with np.errstate(all="ignore"):
        if np.asarray(a).dtype.kind in "iub" and np.all(np.asarray(b) == 0):
            return np.zeros_like(np.asarray(a) // 1)
        return np.mod(a, b)


def _gelu_tanh(x: Any) -> Any:
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


def _where(cond: Any, a: Any, b: Any) -> Any:
    return type(cond).where(cond, a, b)  # (cond: a lazy bool Tensor; Tensor.where is a static method)


def _tie_share(mine: Any, other: Any, g: Any, wins: Callable[[Any, Any], Any]) -> Any:
    """maximum/minimum: the operand that wins gets g, a tie splits g equally (PyTorch's rule)."""
    return _where(wins(mine, other), g, _where(mine == other, g * 0.5, 0.0))


_SQRT_2, _SQRT_2PI, _LN2 = math.sqrt(2.0), math.sqrt(2.0 * math.pi), math.log(2.0)
_GELU_C = math.sqrt(2 / math.pi)


def _gelu_grad(x: Any, g: Any) -> Any:
    cdf = ((x * (1 / _SQRT_2)).erf() + 1) * 0.5
    pdf = (x.square() * -0.5).exp() * (1 / _SQRT_2PI)
    return g * (cdf + x * pdf)


def _gelu_tanh_grad(x: Any, out: Any, g: Any) -> Any:
    t = ((x + x * x.square() * 0.044715) * _GELU_C).tanh()
    return g * ((t + 1) * 0.5 + x * (1 - t.square()) * (x.square() * (3 * 0.044715) + 1) * (0.5 * _GELU_C))


# Gradient rules beside each forward reference. A unary rule maps (x, out, g) to the input's gradient, a binary rule
# pair maps (a, b, out, g) to each operand's; x, a, b, out and g are lazy Tensors of the node's float dtype, so the
# gradient is built from the same ops (and is itself differentiable). None: not differentiable (no gradient flows;
# piecewise-constant ops like sign/floor/ceil/round, comparisons, bitwise ops, floordiv).
UnaryGrad = Callable[[Any, Any, Any], Any]
BinaryGrad = Callable[[Any, Any, Any, Any], Any]

# Unary ops: name -> (float result: the input is cast to a float dtype first, numpy reference, gradient rule)
UNARY: dict[str, tuple[bool, Callable[[Any], Any], UnaryGrad | None]] = {
    "neg": (False, np.negative, lambda x, out, g: -g),
    "abs": (False, np.abs, lambda x, out, g: g * x.sign()),  # 0 at x == 0, like PyTorch
    "not": (False, lambda x: np.logical_not(x) if np.asarray(x).dtype == np.bool_ else np.invert(x), None),
    "square": (False, np.square, lambda x, out, g: g * x * 2),
    "sign": (False, np.sign, None),
    "relu": (False, lambda x: np.maximum(x, 0), lambda x, out, g: _where(x > 0, g, 0.0)),  # 0 at x == 0
    "exp": (True, np.exp, lambda x, out, g: g * out),
    "log": (True, np.log, lambda x, out, g: g / x),
    "exp2": (True, np.exp2, lambda x, out, g: g * out * _LN2),
    "log2": (True, np.log2, lambda x, out, g: g / (x * _LN2)),
    "sqrt": (True, np.sqrt, lambda x, out, g: g * 0.5 / out),
    "rsqrt": (True, lambda x: 1 / np.sqrt(x), lambda x, out, g: g * out * out.square() * -0.5),
    "reciprocal": (True, lambda x: 1 / x, lambda x, out, g: -(g * out.square())),
    "sin": (True, np.sin, lambda x, out, g: g * x.cos()),
    "cos": (True, np.cos, lambda x, out, g: -(g * x.sin())),
    "tan": (True, np.tan, lambda x, out, g: g * (out.square() + 1)),
    "tanh": (True, np.tanh, lambda x, out, g: g * (1 - out.square())),
    "erf": (True, _erf, lambda x, out, g: g * (x.square() * -1).exp() * (2 / math.sqrt(math.pi))),
    "sigmoid": (True, lambda x: 1 / (1 + np.exp(-x)), lambda x, out, g: g * out * (1 - out)),
    "gelu": (True, lambda x: 0.5 * x * (1 + _erf(x / math.sqrt(2))), lambda x, out, g: _gelu_grad(x, g)),
    "gelu_tanh": (True, _gelu_tanh, _gelu_tanh_grad),
    "silu": (True, lambda x: x / (1 + np.exp(-x)),
             lambda x, out, g: g * (x.sigmoid() * (x * (1 - x.sigmoid()) + 1))),
    "softplus": (True, lambda x: np.logaddexp(0, x), lambda x, out, g: g * x.sigmoid()),
    "floor": (False, np.floor, None),
    "ceil": (False, np.ceil, None),
    "round": (False, np.round, None),
}

# Binary ops: name -> (result kind: "same" keeps the promoted dtype, "bool" compares, "float" divides; numpy ref;
# gradient rule for the first operand; for the second)
BINARY: dict[str, tuple[str, Callable[[Any, Any], Any], BinaryGrad | None, BinaryGrad | None]] = {
    "add": ("same", np.add, lambda a, b, out, g: g, lambda a, b, out, g: g),
    "sub": ("same", np.subtract, lambda a, b, out, g: g, lambda a, b, out, g: -g),
    "mul": ("same", np.multiply, lambda a, b, out, g: g * b, lambda a, b, out, g: g * a),
    "truediv": ("float", np.true_divide, lambda a, b, out, g: g / b, lambda a, b, out, g: -(g * a) / b.square()),
    "floordiv": ("same", _floordiv, None, None),
    "mod": ("same", _mod, lambda a, b, out, g: g, lambda a, b, out, g: -(g * (a // b))),  # a - floor(a / b) * b
    # d/da: b * a**(b-1) (0 where b == 0); d/db: out * log(a) (0 where a == 0 and b >= 0), both like PyTorch
    "pow": ("same", np.power, lambda a, b, out, g: _where(b == 0, 0.0, g * (b * a ** (b - 1))),
            lambda a, b, out, g: _where((a == 0) & (b >= 0), 0.0, g * (out * a.log()))),
    "max": ("same", np.maximum, lambda a, b, out, g: _tie_share(a, b, g, lambda m, o: m > o),
            lambda a, b, out, g: _tie_share(b, a, g, lambda m, o: m > o)),
    "min": ("same", np.minimum, lambda a, b, out, g: _tie_share(a, b, g, lambda m, o: m < o),
            lambda a, b, out, g: _tie_share(b, a, g, lambda m, o: m < o)),
    "lt": ("bool", np.less, None, None),
    "le": ("bool", np.less_equal, None, None),
    "gt": ("bool", np.greater, None, None),
    "ge": ("bool", np.greater_equal, None, None),
    "eq": ("bool", np.equal, None, None),
    "ne": ("bool", np.not_equal, None, None),
    "and": ("same", lambda a, b: np.logical_and(a, b) if np.asarray(a).dtype == np.bool_ else np.bitwise_and(a, b),
            None, None),
    "or": ("same", lambda a, b: np.logical_or(a, b) if np.asarray(a).dtype == np.bool_ else np.bitwise_or(a, b),
           None, None),
    "xor": ("same", lambda a, b: np.logical_xor(a, b) if np.asarray(a).dtype == np.bool_ else np.bitwise_xor(a, b),
            None, None),
}
BITWISE = frozenset({"and", "or", "xor", "not"})

# Reduce ops: name -> (identity for a dtype, numpy reference)
REDUCE: dict[str, tuple[Callable[[Any], Any], Callable[..., Any]]] = {
    "sum": (lambda d: 0, np.sum),
    "prod": (lambda d: 1, np.prod),
    "max": (lambda d: -math.inf if d.is_float else (False if d.is_bool else int(np.iinfo(d.np).min)), np.max),
    "min": (lambda d: math.inf if d.is_float else (True if d.is_bool else int(np.iinfo(d.np).max)), np.min),
}
