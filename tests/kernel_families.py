"""The op families the compile-only tests render for a dialect without its device (test_cuda_compile.py for CUDA C,
test_glsl_compile.py for GLSL): every unary op by name, and binary ops as functions of two tensors."""

from __future__ import annotations

from collections.abc import Callable

from azyx import Tensor

UNARY = ["abs", "exp", "log", "exp2", "log2", "sqrt", "rsqrt", "reciprocal", "sin", "cos", "tan", "tanh",
         "erf", "sigmoid", "relu", "gelu", "silu", "softplus", "sign", "floor", "ceil", "round", "square"]
BINARY: list[Callable[[Tensor, Tensor], Tensor]] = [
    lambda a, b: a + b, lambda a, b: a - b, lambda a, b: a * b, lambda a, b: a / b, lambda a, b: a // b,
    lambda a, b: a % b, lambda a, b: a ** b, lambda a, b: a.maximum(b), lambda a, b: a.minimum(b),
    lambda a, b: Tensor.where(a < b, a, b), lambda a, b: (a == b) | (a >= b),
]
