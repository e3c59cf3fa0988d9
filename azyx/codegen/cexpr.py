"""How the C family (C, OpenCL C, CUDA C, GLSL) spells values (codegen.cfamily's renderer writes the statements
around them): literals, the elementwise ops with NaN-propagating max and min and C's remainder made floored, how a
reduce folds a value into its accumulator, and OpenMP's reduction identifiers."""

from __future__ import annotations

import math

from azyx.codegen.dialect import Dialect
from azyx.dtypes import DType, dtypes


def literal(v: object, d: DType, dl: Dialect) -> str:
    """A constant in source, parenthesised when negative: `x - (-0.75)` must not render as `x--0.75f`."""
    s = _literal_text(v, d, dl)
    return f"({s})" if s.startswith("-") else s


def _literal_text(v: object, d: DType, dl: Dialect) -> str:
    if d.is_bool:
        return dl.bools[bool(v)]
    if d.is_int:
        iv = int(v)  # type: ignore[call-overload]
        if d.itemsize == 8:
            sfx = dl.int64_suffix
            return f"{iv}{sfx}" if iv != -(2**63) else f"(-9223372036854775807{sfx}-1)"
        if iv == -(2**31) and d.itemsize == 4:
            return "(-2147483647-1)"
        text = f"{iv}u" if d.kind == "u" else str(iv)
        return dl.cast.format(t=dl.ctype(d), x=text) if dl.glsl and d.itemsize < 4 else text  # (no 8/16-bit literals)
    fv = float(v)  # type: ignore[arg-type]
    single = dl.compute_type(d) == dl.types["float32"]
    if math.isnan(fv):
        return "NAN" if single else dl.cast.format(t=dl.types["float64"], x="NAN")
    if math.isinf(fv):
        s = "-" if fv < 0 else ""
        return f"({s}INFINITY)" if single else f"({s}{dl.cast.format(t=dl.types['float64'], x='INFINITY')})"
    r = repr(fv)
    if "e" not in r and "." not in r:
        r += ".0"
    return f"{r}f" if single else r + dl.double_suffix


def _fn(name: str, d: DType, dl: Dialect) -> str:
    return dl.fns.get(name, name) + (dl.fn_suffix_f32 if dl.compute_type(d) == dl.types["float32"] else "")


_BOOL_AS_INT = {"add", "sub", "mul", "lt", "le", "gt", "ge", "max", "min"}


def alu_expr(op: str, d: DType, a: list[str], dl: Dialect, src_dtype: DType) -> str:
    """Source text of one elementwise op; `d` is the result dtype, `src_dtype` the operands' dtype."""
    if dl.glsl and src_dtype.is_bool and op in _BOOL_AS_INT:  # GLSL has no arithmetic or ordering on bool
        e = alu_expr(op, dtypes.int32, [dl.cast.format(t="int", x=x) for x in a], dl, dtypes.int32)
        return f"({e}!=0)" if d.is_bool and op in ("add", "sub", "mul", "max", "min") else e
    out = _unary(op, a[0], src_dtype, dl)
    return out if out is not None else _binary(op, a[0], a[1] if len(a) > 1 else "", src_dtype, dl)


def _unary(op: str, x: str, sd: DType, dl: Dialect) -> str | None:
    """Op `op` of one operand `x` of dtype `sd` (None: not a one-operand op)."""
    fl = sd.is_float

    def c(e: str) -> str:  # `e` converted to the operands' compute type
        return dl.cast.format(t=dl.compute_type(sd), x=e)

    if op == "neg":
        return f"(-{x})"
    if op == "abs":
        return f"{_fn('fabs', sd, dl)}({x})" if fl else f"({x}<0?-{x}:{x})"
    if op == "not":
        return f"(!{x})" if sd.is_bool else f"(~{x})"
    if op == "square":
        return f"({x}*{x})"
    if op == "sign":
        sign = f"({c(f'{x}>0')}-{c(f'{x}<0')})"
        return sign if not fl else f"({x}!={x}?{x}:{sign})"
    if op == "relu":
        return f"({x}<0?{c('0')}:{x})"  # NaN stays NaN
    if op in ("exp", "log", "exp2", "log2", "sqrt", "sin", "cos", "tan", "tanh", "erf", "floor", "ceil"):
        return f"{_fn(op, sd, dl)}({x})"
    if op == "round":
        return f"{_fn('rint', sd, dl)}({x})"
    if op == "rsqrt":
        return f"({c('1')}/{_fn('sqrt', sd, dl)}({x}))"
    if op == "reciprocal":
        return f"({c('1')}/{x})"
    if op == "sigmoid":
        return f"({c('1')}/({c('1')}+{_fn('exp', sd, dl)}(-{x})))"
    if op == "silu":
        return f"({x}/({c('1')}+{_fn('exp', sd, dl)}(-{x})))"
    if op == "gelu":
        return f"({c('0.5')}*{x}*({c('1')}+{_fn('erf', sd, dl)}({x}*{c('0.7071067811865476')})))"
    if op == "gelu_tanh":  # 0.5*x*(1+tanh(z)) == x*sigmoid(2z): no cancellation in 1+tanh for very negative x
        return (f"({x}/({c('1')}+{_fn('exp', sd, dl)}({c('-1.5957691216057308')}*"
                f"({x}+{c('0.044715')}*{x}*{x}*{x}))))")
    if op == "softplus":
        return f"(({x}>0?{x}:{c('0')})+{_fn('log1p', sd, dl)}({_fn('exp', sd, dl)}(-{_fn('fabs', sd, dl)}({x}))))"
    return None


def _binary(op: str, x: str, y: str, sd: DType, dl: Dialect) -> str:
    """Op `op` of operands `x` and `y` of dtype `sd`."""
    fl = sd.is_float

    def c(e: str) -> str:  # `e` converted to the operands' compute type
        return dl.cast.format(t=dl.compute_type(sd), x=e)

    binops = {"add": "+", "sub": "-", "mul": "*", "truediv": "/", "lt": "<", "le": "<=", "gt": ">", "ge": ">=",
              "eq": "==", "ne": "!="}
    if op in binops:
        return f"({x}{binops[op]}{y})"
    if op in ("and", "or", "xor"):
        if sd.is_bool:
            return {"and": f"({x}&&{y})", "or": f"({x}||{y})", "xor": f"({x}!={y})"}[op]
        return f"({x}{ {'and': '&', 'or': '|', 'xor': '^'}[op] }{y})"
    if op in ("max", "min") and not fl:
        return combine(op, sd, dl).format(a=y, b=x)
    if op == "max":
        return f"(({x}>{y}||{x}!={x})?{x}:{y})"
    if op == "min":
        return f"(({x}<{y}||{x}!={x})?{x}:{y})"
    # C's truncated remainder (GLSL's % is undefined for negative operands: glslang emits OpSMod, floored on NVIDIA's
    # driver and truncated on lavapipe's; its / truncates, as SPIR-V's OpSDiv does)
    rem = f"({x}-({x}/{y})*{y})" if dl.glsl else f"({x}%{y})"
    if op == "floordiv":
        if fl:
            return f"{_fn('floor', sd, dl)}({x}/{y})"
        return f"({y}==0?{c('0')}:{c(f'{x}/{y}-' + c(f'({rem}!=0)&&(({x}<0)!=({y}<0))'))})"
    if op == "mod":
        if fl:
            r = f"{_fn('fmod', sd, dl)}({x},{y})"  # a zero remainder takes the divisor's sign (numpy, Python)
            return f"(({r}!=0)?((({r}<0)!=({y}<0))?{r}+{y}:{r}):{_fn('copysign', sd, dl)}({c('0')},{y}))"
        r = rem
        return f"({y}==0?{c('0')}:(({r}!=0&&(({r}<0)!=({y}<0)))?{c(f'{r}+{y}')}:{r}))"
    if op == "pow":
        return f"{_fn('pow', sd, dl)}({x},{y})" if fl else c(f"ipow({x},{y})")
    raise AssertionError(f"no rendering for op {op}")


_COMBINE = {"sum": "{a}+{b}", "prod": "{a}*{b}", "max": "(({b}>{a}||{b}!={b})?{b}:{a})",
            "min": "(({b}<{a}||{b}!={b})?{b}:{a})"}
_COMBINE_INT = {"max": "({b}>{a}?{b}:{a})", "min": "({b}<{a}?{b}:{a})"}
_OMP_RED = {"sum": "+", "prod": "*", "max": "max", "min": "min"}


def combine(op: str, d: DType, dl: Dialect) -> str:
    """How a reduce of `op` over dtype `d` folds a new value {b} into its accumulator {a}."""
    if d.is_float or op not in _COMBINE_INT:
        return _COMBINE[op]
    return f"azyx_{op}({{a}},{{b}})" if dl.int_minmax and not d.is_bool else _COMBINE_INT[op]


def omp_reduction(op: str, d: DType) -> str:
    """The OpenMP reduction identifier: floats' max/min use NaN-propagating declared reductions (see prelude)."""
    if op in ("max", "min") and d.is_float:
        return f"n{op}{'d' if d is dtypes.float64 else 'f'}"
    return _OMP_RED[op]
