"""How WGSL spells values (codegen.wgsl's renderer writes the statements around them): each dtype's WGSL type and
adapter feature, literals (infinities and NaNs as bit patterns), casts rounded to narrow dtypes, conditions on index
ranges, and the elementwise ops, with NaN tests on the bits and C's truncated remainder."""

from __future__ import annotations

import math

import numpy as np

from azyx.codegen.dialect import WGSL_TYPES, WType
from azyx.codegen.render import Emitter
from azyx.dtypes import DType, dtypes
from azyx.errors import DTypeError
from azyx.ir import V
from azyx.symbolic import Cond

_FNS_F64 = {"exp": "azyx_exp64", "log": "azyx_log64", "exp2": "azyx_exp264", "log2": "azyx_log264",
            "sin": "azyx_sin64", "cos": "azyx_cos64", "tan": "azyx_tan64", "tanh": "azyx_tanh64",
            "erf": "azyx_erf64", "log1p": "azyx_log1p64", "pow": "azyx_pow64", "fmod": "azyx_fmod64"}
_FNS_F32 = {"erf": "azyx_erf", "log1p": "azyx_log1p", "pow": "azyx_pow", "fmod": "azyx_fmod"}
_BINOPS = {"add": "+", "sub": "-", "mul": "*", "truediv": "/", "lt": "<", "le": "<=", "gt": ">", "ge": ">=",
           "eq": "==", "ne": "!="}
_BOOL_AS_INT = {"add", "sub", "mul", "lt", "le", "gt", "ge", "max", "min"}



def wtype(d: DType, device: str, features: frozenset[str]) -> WType:
    """The WGSL row of dtype `d` on a device with adapter `features`; a DTypeError where the device cannot compute
    it."""
    t = WGSL_TYPES.get(d.name)
    if t is None:
        raise DTypeError(f"{device}: WGSL has no representation of dtype {d.name}")
    if t.feature and t.feature not in features:
        raise DTypeError(f"{device}: dtype {d.name} needs the WebGPU adapter feature {t.feature!r}, which this "
                         f"adapter lacks (use another device for {d.name} tensors, or cast them)")
    return t


def literal(v: object, d: DType) -> str:
    """A constant of dtype `d` in its compute type (WGSL has no literal of infinity or NaN: bit patterns)."""
    t = WGSL_TYPES[d.name].compute
    if t == "bool":
        return "true" if v else "false"
    if t in ("i32", "u32", "i64"):
        iv = int(v)  # type: ignore[call-overload]
        sfx = {"i32": "i", "u32": "u", "i64": "li"}[t]
        lowest = {"i32": -(2**31), "i64": -(2**63)}.get(t)
        if iv == lowest:
            return f"({iv + 1}{sfx} - 1{sfx})"
        return f"({iv}{sfx})" if iv < 0 else f"{iv}{sfx}"
    fv = float(v)  # type: ignore[arg-type]
    if t == "f32":
        fv = float(np.float32(fv))  # (a value past float32's range is its infinity, not an invalid literal)
    if math.isnan(fv) or math.isinf(fv):
        bits = "0x7fc00000u" if math.isnan(fv) else ("0xff800000u" if fv < 0 else "0x7f800000u")
        return f"bitcast<f32>({bits})" if t == "f32" else f"f64(bitcast<f32>({bits}))"
    r = repr(fv)
    if "e" not in r and "." not in r:
        r += ".0"
    s = r + ("f" if t == "f32" else "lf")
    return f"({s})" if s.startswith("-") else s


def combine(op: str, d: DType) -> str:
    """How a reduce of `op` over dtype `d` folds a new value {b} into its accumulator {a} (max and min of floats
    propagate NaN)."""
    if op == "sum":
        return "({a} + {b})"
    if op == "prod":
        return "({a} * {b})"
    if d.is_float:
        cmp = ">" if op == "max" else "<"
        nan = f"isnan{64 if d.itemsize == 8 else 32}"  # NaN by its bits: NVIDIA's compiler turns a select into a max
        return f"select(select({{a}}, {{b}}, {{b}} {cmp} {{a}}), {{a}} + {{b}}, {nan}({{a}}) || {nan}({{b}}))"
    return f"{op}({{a}}, {{b}})"


class WgslValues(Emitter):
    """The value half of a WGSL renderer: what it records (`used`: the dtypes computed in, whose helpers the shader
    then needs) for a device of adapter `features`."""

    device: str
    features: frozenset[str]
    used: set[str]

    def ct(self, d: DType) -> str:
        self.used.add(d.name)
        return wtype(d, self.device, self.features).compute

    def fn(self, name: str, d: DType) -> str:
        t = self.ct(d)
        return (_FNS_F64 if t == "f64" else _FNS_F32).get(name, name)

    def isnan(self, x: str, d: DType) -> str:
        return f"isnan{64 if self.ct(d) == 'f64' else 32}({x})"

    def cond(self, c: Cond) -> str:
        if c.never:
            return "false"
        parts = []
        for x, lo, hi in c.facts:
            if x.vmin >= lo:
                parts.append(f"({x.render()} < {hi})")
            elif x.vmax < hi:
                parts.append(f"({x.render()} >= {lo})")
            else:
                parts.append(f"(u32({(x - lo).render()}) < {hi - lo}u)")
        return " && ".join(parts) if parts else "true"

    def rounded(self, d: DType, e: str) -> str:
        r = WGSL_TYPES[d.name].rounds
        return r.format(x=e) if r else e

    def cast(self, s: V, d: DType) -> str:
        x, st, t = self.ref(s), self.ct(s.dtype), self.ct(d)
        if d.is_bool:
            return x if s.dtype.is_bool else f"({x} != {literal(0, s.dtype)})"
        if s.dtype.is_bool:
            return self.rounded(d, f"select({literal(0, d)}, {literal(1, d)}, {x})")
        return self.rounded(d, x if st == t else f"{t}({x})")

    def alu(self, op: str, d: DType, a: list[str], sd: DType) -> str:
        """One elementwise op; `d` is the result dtype, `sd` the operands'."""
        if sd.is_bool and op in _BOOL_AS_INT:  # no arithmetic or ordering on bool
            e = self.alu(op, dtypes.int32, [f"select(0i, 1i, {x})" for x in a], dtypes.int32)
            return f"({e} != 0i)" if d.is_bool and op in ("add", "sub", "mul", "max", "min") else e
        self.ct(sd)  # (the operands' dtype is one the kernel computes in)
        x = a[0]
        out = self.unary(op, x, sd)
        return out if out is not None else self.binary(op, x, a[1] if len(a) > 1 else "", sd)

    def unary(self, op: str, x: str, sd: DType) -> str | None:
        """Op `op` of one operand `x` of dtype `sd` (None: not a one-operand op)."""
        fl = sd.is_float

        def c(v: float | int) -> str:
            return literal(v, sd)

        if op == "neg":
            return f"(-{x})"
        if op == "abs":
            return f"abs({x})"
        if op == "not":
            return f"(!{x})" if sd.is_bool else f"(~{x})"
        if op == "square":
            return f"({x} * {x})"
        if op == "sign":
            s = f"(select({c(0)}, {c(1)}, {x} > {c(0)}) - select({c(0)}, {c(1)}, {x} < {c(0)}))"
            return f"select({s}, {x}, {self.isnan(x, sd)})" if fl else s
        if op == "relu":  # NaN stays NaN, by its bits (NVIDIA's compiler turns the select into a max that drops it)
            r = f"select({x}, {c(0)}, {x} < {c(0)})"
            return f"select({r}, {x}, {self.isnan(x, sd)})" if fl else r
        if op in ("exp", "log", "exp2", "log2", "sqrt", "sin", "cos", "tan", "tanh", "erf", "floor", "ceil", "round"):
            return f"{self.fn(op, sd)}({x})"  # (WGSL's round rounds half to even, as numpy's)
        if op == "rsqrt":
            return f"({c(1)} / sqrt({x}))"
        if op == "reciprocal":
            return f"({c(1)} / {x})"
        ex = self.fn("exp", sd)
        if op == "sigmoid":
            return f"({c(1)} / ({c(1)} + {ex}(-{x})))"
        if op == "silu":
            return f"({x} / ({c(1)} + {ex}(-{x})))"
        if op == "gelu":
            return f"({c(0.5)} * {x} * ({c(1)} + {self.fn('erf', sd)}({x} * {c(0.7071067811865476)})))"
        if op == "gelu_tanh":  # x*sigmoid(2z): no cancellation in 1+tanh for very negative x
            return f"({x} / ({c(1)} + {ex}({c(-1.5957691216057308)} * ({x} + {c(0.044715)} * {x} * {x} * {x}))))"
        if op == "softplus":
            return f"(max({x}, {c(0)}) + {self.fn('log1p', sd)}({ex}(-abs({x}))))"
        return None

    def binary(self, op: str, x: str, y: str, sd: DType) -> str:
        """Op `op` of operands `x` and `y` of dtype `sd`."""
        t, fl = self.ct(sd), sd.is_float

        def c(v: float | int) -> str:
            return literal(v, sd)

        if op in ("eq", "ne") and fl and x == y:  # a NaN test (argmax's `x != x`), by the bits
            return f"({'!' if op == 'eq' else ''}{self.isnan(x, sd)})"
        if op == "ne" and fl:  # unordered: true where either is NaN (naga's float != is ordered)
            return f"(!({x} == {y}))"
        if op in _BINOPS:
            return f"({x} {_BINOPS[op]} {y})"
        if op in ("and", "or", "xor"):
            if sd.is_bool:
                return {"and": f"({x} && {y})", "or": f"({x} || {y})", "xor": f"({x} != {y})"}[op]
            return f"({x} {({'and': '&', 'or': '|', 'xor': '^'})[op]} {y})"
        if op in ("max", "min"):
            return combine(op, sd).format(a=y, b=x)
        rem = f"({x} - {x} / {y} * {y})"  # truncated, as C's % (naga's % gave wrong remainders on NVIDIA)
        if op == "floordiv":
            if fl:
                return f"floor({x} / {y})"
            adjust = f"select({c(0)}, {c(1)}, ({rem} != {c(0)}) && (({x} < {c(0)}) != ({y} < {c(0)})))"
            return f"select({x} / {y} - {adjust}, {c(0)}, {y} == {c(0)})"
        if op == "mod":
            if fl:  # a zero remainder takes the divisor's sign (numpy, Python)
                r = f"{self.fn('fmod', sd)}({x}, {y})"
                m = f"select({r}, {r} + {y}, ({r} < {c(0)}) != ({y} < {c(0)}))"
                u = {"f32": "u32", "f64": "u64"}[self.ct(sd)]
                if u == "u64" and "shader-int64" not in self.features:
                    return f"select(select({c(0.0)}, {c(-0.0)}, {y} < {c(0)}), {m}, {r} != {c(0)})"
                # the zero's sign set in its bits: a driver that ignores signed zeros (NVIDIA's) folds float selects
                top = "0x80000000u" if u == "u32" else "0x8000000000000000lu"
                sign = f"(bitcast<{u}>({y}) & {top})"  # (on NVIDIA, select(0u, 0x80000000u, y < 0) gave it for y = 1)
                return f"bitcast<{self.ct(sd)}>(select(bitcast<{u}>({m}), {sign}, (bitcast<{u}>({r}) << 1u) == {u}(0)))"
            return f"select(select({rem}, {rem} + {y}, {rem} != {c(0)} && (({rem} < {c(0)}) != ({y} < {c(0)}))), " \
                   f"{c(0)}, {y} == {c(0)})"
        if op == "pow":
            if fl:
                return f"{self.fn('pow', sd)}({x}, {y})"
            if t == "i64":
                return f"ipow64({x}, {y})"
            return f"ipow({x}, {y})"
        raise AssertionError(f"no WGSL rendering for op {op}")
