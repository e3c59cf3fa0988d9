"""The op table: every elementwise and reduce op, once. Renderers map these names to source text,
const folding uses the numpy function, and dtype rules are read from here."""

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


# Unary ops: name -> (float result: the input is cast to a float dtype first, numpy reference)
UNARY: dict[str, tuple[bool, Callable[[Any], Any]]] = {
    "neg": (False, np.negative),
    "abs": (False, np.abs),
    "not": (False, lambda x: np.logical_not(x) if np.asarray(x).dtype == np.bool_ else np.invert(x)),
    "square": (False, np.square),
    "sign": (False, np.sign),
    "relu": (False, lambda x: np.maximum(x, 0)),
    "exp": (True, np.exp),
    "log": (True, np.log),
    "exp2": (True, np.exp2),
    "log2": (True, np.log2),
    "sqrt": (True, np.sqrt),
    "rsqrt": (True, lambda x: 1 / np.sqrt(x)),
    "reciprocal": (True, lambda x: 1 / x),
    "sin": (True, np.sin),
    "cos": (True, np.cos),
    "tan": (True, np.tan),
    "tanh": (True, np.tanh),
    "erf": (True, _erf),
    "sigmoid": (True, lambda x: 1 / (1 + np.exp(-x))),
    "gelu": (True, lambda x: 0.5 * x * (1 + _erf(x / math.sqrt(2)))),
    "gelu_tanh": (True, _gelu_tanh),
    "silu": (True, lambda x: x / (1 + np.exp(-x))),
    "softplus": (True, lambda x: np.logaddexp(0, x)),
    "floor": (False, np.floor),
    "ceil": (False, np.ceil),
    "round": (False, np.round),
}

# Binary ops: name -> (result kind: "same" keeps the promoted dtype, "bool" compares, "float" divides; numpy ref)
BINARY: dict[str, tuple[str, Callable[[Any, Any], Any]]] = {
    "add": ("same", np.add),
    "sub": ("same", np.subtract),
    "mul": ("same", np.multiply),
    "truediv": ("float", np.true_divide),
    "floordiv": ("same", _floordiv),
    "mod": ("same", _mod),
    "pow": ("same", np.power),
    "max": ("same", np.maximum),
    "min": ("same", np.minimum),
    "lt": ("bool", np.less),
    "le": ("bool", np.less_equal),
    "gt": ("bool", np.greater),
    "ge": ("bool", np.greater_equal),
    "eq": ("bool", np.equal),
    "ne": ("bool", np.not_equal),
    "and": ("same", lambda a, b: np.logical_and(a, b) if np.asarray(a).dtype == np.bool_ else np.bitwise_and(a, b)),
    "or": ("same", lambda a, b: np.logical_or(a, b) if np.asarray(a).dtype == np.bool_ else np.bitwise_or(a, b)),
    "xor": ("same", lambda a, b: np.logical_xor(a, b) if np.asarray(a).dtype == np.bool_ else np.bitwise_xor(a, b)),
}
BITWISE = frozenset({"and", "or", "xor", "not"})

# Reduce ops: name -> (identity for a dtype, numpy reference)
REDUCE: dict[str, tuple[Callable[[Any], Any], Callable[..., Any]]] = {
    "sum": (lambda d: 0, np.sum),
    "prod": (lambda d: 1, np.prod),
    "max": (lambda d: -math.inf if d.is_float else (False if d.is_bool else int(np.iinfo(d.np).min)), np.max),
    "min": (lambda d: math.inf if d.is_float else (True if d.is_bool else int(np.iinfo(d.np).max)), np.min),
}
REDUCE_COMBINE = {"sum": "add", "prod": "mul", "max": "max", "min": "min"}
