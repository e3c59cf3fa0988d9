"""Random op graphs for the differential fuzzer (tests/test_fuzz.py), built as a user would build them.

A program is a list of statements in azyx's public API (printed as Python source when a check fails) and, beside
each, a numpy reference. Each value carries what is known about it: a bound on its magnitude, and an error bound
against the reference (0 = bit-exact). Inputs and scalars are drawn from a grid of exact binary fractions, so
integer and exact float arithmetic must match numpy exactly; ops that round (division, transcendentals, means of
odd counts, narrowing casts) add ulps and propagate error through their Lipschitz constants. Discontinuous ops
(comparisons, floor/round, int casts, argmax, // and %) only take exact values, so a correct runtime can never
fail a check: every failure is a bug.

Result dtypes follow PyTorch's promotion with azyx's defaults (API.md: int32 and float32), from a table written
here independently of azyx's.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from hypothesis import strategies as st

FLOATS = ("float16", "bfloat16", "float32", "float64")
INTS = ("int8", "int16", "int32", "int64", "uint8")
DTYPES = FLOATS + INTS + ("bool",)
MANTISSA = {"float16": 11, "bfloat16": 8, "float32": 24, "float64": 53}  # significant bits, the implicit one included
FLOAT_LIMIT = {"float16": 2.0e4, "bfloat16": 1e30, "float32": 1e30, "float64": 1e30}  # bounds kept clear of inf
INT_MAX = {"int8": 127, "int16": 32767, "int32": 2**31 - 1, "int64": 2**63 - 1, "uint8": 255}
WRAPS = ("int8", "int16", "uint8")  # narrow ints wrap like numpy and PyTorch (computed wide, stored narrow)
INT_SAFE = {"int32": 2**30, "int64": 2**60}  # wider ints must not overflow (undefined in C)
SIZE = {"bool": 1, "uint8": 1, "int8": 1, "int16": 2, "int32": 4, "int64": 8,
        "float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}
DIMS = (1, 2, 3, 5, 7)
FLOAT_GRID = 3.0  # float inputs are multiples of 1/4 in [-3, 3] (frac = 2 bits), with some -0.0
SCALAR_BOUND = 4.0  # float scalars are multiples of 1/4 in [-4, 4] (-0.0 included)


# ---------------------------------------------------------------------------------------------------- dtype rules
def kind(d: str) -> int:
    return 0 if d == "bool" else 2 if d in FLOATS else 1


def promote(a: str, b: str) -> str:
    """PyTorch's promotion between two tensor dtypes."""
    if a == b:
        return a
    ka, kb = kind(a), kind(b)
    if ka != kb:
        return a if ka > kb else b
    if ka == 2:
        if {a, b} == {"float16", "bfloat16"}:
            return "float32"
        return a if SIZE[a] > SIZE[b] else b
    if "uint8" in (a, b):  # uint8 with a signed int: the signed one if wider, else int16
        s = b if a == "uint8" else a
        return s if SIZE[s] > 1 else "int16"
    return a if SIZE[a] > SIZE[b] else b


def promote_scalar(t: str, scalar_kind: str) -> str:
    """Tensor op Python scalar ("f" or "i"): the scalar decides only when its kind is higher (API.md defaults)."""
    sk = 2 if scalar_kind == "f" else 1
    if sk > kind(t):
        return "float32" if sk == 2 else "int32"
    return t


def least_float(d: str) -> str:
    return d if d in FLOATS else "float32"


def np_dtype(d: str) -> np.dtype:
    """How a dtype's values come back from `Tensor.numpy()` (bfloat16 widened to float32)."""
    return np.dtype("float32" if d == "bfloat16" else d)


def round_to(x: np.ndarray, d: str) -> np.ndarray:
    """Cast a (float64 or int64) reference result to dtype `d` as a device stores it."""
    x = np.asarray(x)
    if d == "bfloat16":
        f = x.astype(np.float32)
        bits = f.view(np.uint32).astype(np.uint64)
        rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).astype(np.uint32).view(np.float32)
        return np.where(np.isnan(f), f, rounded)
    if d == "bool":
        return x.astype(bool)
    if d in INTS and x.dtype.kind == "f":
        return np.trunc(x).astype(np.int64).astype(d)
    return x.astype(d)


def ulp(d: str, bound: float) -> float:
    """One unit in the last place at magnitude `bound` (0 for exact types)."""
    if d not in FLOATS:
        return 0.0
    e = math.frexp(max(bound, 2.0**-14))[1]
    return 2.0 ** (e - MANTISSA[d])


def exact_in(d: str, bound: float, frac: int | None) -> bool:
    """A value with |x| <= bound that is a multiple of 2**-frac is exact in `d`."""
    if d == "bool" or d in INTS:
        return frac == 0
    if frac is None:
        return False
    bits = math.frexp(max(bound, 1.0))[1] + frac
    return bits <= MANTISSA[d]


# ---------------------------------------------------------------------------------------------------- values
@dataclass(frozen=True)
class Val:
    name: str
    shape: tuple[int, ...]
    dtype: str
    bound: float  # |value| <= bound
    err: float  # |azyx - reference| <= err (0: bit-exact)
    frac: int | None  # exact multiple of 2**-frac (None: not known exact)
    device: str
    positive: bool = False  # every element > 0 (a safe divisor, log argument)

    @property
    def exact(self) -> bool:
        return self.err == 0.0 and (self.frac is not None or self.dtype in INTS or self.dtype == "bool")

    @property
    def size(self) -> int:
        return math.prod(self.shape)


def finish(d: str, bound: float, err: float, frac: int | None, ulps: float = 1.0) -> tuple[float, float, int | None]:
    """The (bound, err, frac) of an op's result: exact when representable, else rounding adds `ulps` ulps."""
    if d == "bool":
        return 1.0, 0.0, 0
    if d in INTS:
        return bound, 0.0, 0
    if err == 0.0 and exact_in(d, bound, frac):
        return bound, 0.0, frac
    return bound, err + ulps * ulp(d, bound), None


@dataclass
class Leaf:
    name: str
    shape: tuple[int, ...]
    dtype: str
    domain: str  # "grid", "int", "bool", "index:N" (ints in [-N, N)), "gindex:N" (ints in [0, N))
    device: str


@dataclass
class Program:
    device: str
    leaves: list[Leaf] = field(default_factory=list)
    scalars: dict[str, str] = field(default_factory=dict)  # name -> "f", "i", "fnz", "inz", "pow2", "fpos"
    lines: list[str] = field(default_factory=list)  # azyx statements
    refs: list[Callable[[dict[str, Any]], None]] = field(default_factory=list)  # numpy statements, in step
    vals: list[Val] = field(default_factory=list)
    outputs: list[Val] = field(default_factory=list)
    terminal: set[str] = field(default_factory=set)  # values no op may take (infinities, relative tolerance)
    # values whose zeros may have lost their sign: integer-tensor indexing sums a one-hot product (+0.0 + -0.0 = +0.0;
    # numpy and PyTorch keep -0.0) until it reads at the index (the transformer-speed issue builds real gathers)
    unsigned_zero: set[str] = field(default_factory=set)
    counter: int = 0

    def fresh(self, prefix: str) -> str:
        self.counter += 1
        return f"{prefix}{self.counter}"

    def source(self, data: dict[str, Any], scalars: dict[str, Any]) -> str:
        """The program as a runnable Python script with this data and these scalars."""
        out = ["import asyncio", "import numpy as np", "import azyx", "from azyx import Tensor", "",
               "async def main():"]
        for leaf in self.leaves:
            arr = data[leaf.name]
            lit = f"np.array({arr.tolist()!r}, dtype=np.{np_dtype(leaf.dtype)})"
            out.append(f"    {leaf.name} = Tensor({lit}, dtype={leaf.dtype!r}, device={leaf.device!r})")
        for name in self.scalars:
            out.append(f"    {name} = {scalars[name]!r}")
        out += [f"    {line}" for line in self.lines]
        names = ", ".join(v.name for v in self.outputs)
        out.append(f"    outs = await azyx.realize({names})")
        out.append("    for t in outs:")
        out.append("        print(t.dtype, await t.numpy())")
        out += ["", "asyncio.run(main())"]
        return "\n".join(out)


# ---------------------------------------------------------------------------------------------------- data
def make_data(prog: Program, rng: np.random.Generator) -> dict[str, np.ndarray]:
    data: dict[str, np.ndarray] = {}
    for leaf in prog.leaves:
        shape, d = leaf.shape, leaf.dtype
        if leaf.domain == "bool":
            arr = rng.random(shape) < 0.5
        elif leaf.domain.startswith("index:"):
            n = int(leaf.domain.split(":")[1])
            arr = rng.integers(-n, n, size=shape)
        elif leaf.domain.startswith("gindex:"):
            n = int(leaf.domain.split(":")[1])
            arr = rng.integers(0, n, size=shape)
        elif d in INTS:
            arr = rng.integers(0 if d == "uint8" else -9, 10, size=shape)
        else:
            arr = rng.integers(-12, 13, size=shape) / 4.0
            arr = np.where(rng.random(shape) < 0.1, -0.0, arr)
        data[leaf.name] = np.asarray(arr).astype(np_dtype(d))
    return data


def make_scalars(prog: Program, rng: np.random.Generator) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, k in prog.scalars.items():
        if k == "f":
            v: Any = float(rng.integers(-16, 17)) / 4.0
            out[name] = -0.0 if v == 0.0 and rng.random() < 0.5 else v
        elif k == "fnz":
            out[name] = float(rng.choice([-1, 1]) * rng.integers(1, 17)) / 4.0
        elif k == "fpos":
            out[name] = float(rng.integers(1, 13)) / 4.0
        elif k == "pow2":
            out[name] = float(rng.choice([0.25, 0.5, 2.0, 4.0, -0.5, -2.0]))
        elif k == "i":
            out[name] = int(rng.integers(-5, 6))
        elif k == "inz":
            out[name] = int(rng.choice([-1, 1]) * rng.integers(1, 6))
        elif k == "iexp":
            out[name] = int(rng.integers(0, 4))
        else:
            raise AssertionError(k)
    return out


SCALAR_MAX = {"f": SCALAR_BOUND, "fnz": SCALAR_BOUND, "fpos": 3.0, "pow2": 4.0, "i": 5.0, "inz": 5.0, "iexp": 3.0}
SCALAR_FRAC = {"f": 2, "fnz": 2, "fpos": 2, "pow2": 2, "i": 0, "inz": 0, "iexp": 0}


# ---------------------------------------------------------------------------------------------------- reference ops
def f64(x: np.ndarray) -> np.ndarray:
    return np.asarray(x).astype(np.float64)


def wide(x: np.ndarray) -> np.ndarray:
    """Values for exact reference arithmetic: int64 for ints and bools, float64 for floats."""
    x = np.asarray(x)
    return x.astype(np.float64) if x.dtype.kind == "f" else x.astype(np.int64)


BINARY_NP: dict[str, Callable[[Any, Any], Any]] = {
    "+": np.add, "-": np.subtract, "*": np.multiply, "/": np.true_divide, "//": np.floor_divide, "%": np.mod,
    "maximum": np.maximum, "minimum": np.minimum, "<": np.less, "<=": np.less_equal, ">": np.greater,
    ">=": np.greater_equal, "==": np.equal, "!=": np.not_equal, "&": np.bitwise_and, "|": np.bitwise_or,
    "^": np.bitwise_xor, "**": np.power,
}

UNARY_NP: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "exp": np.exp, "exp2": np.exp2, "log": np.log, "log2": np.log2, "sqrt": np.sqrt,
    "rsqrt": lambda x: 1.0 / np.sqrt(x), "reciprocal": lambda x: 1.0 / x, "sin": np.sin, "cos": np.cos,
    "tan": np.tan, "tanh": np.tanh, "sigmoid": lambda x: 1.0 / (1.0 + np.exp(-x)),
    "erf": np.vectorize(math.erf, otypes=[np.float64]),
    "gelu": lambda x: 0.5 * x * (1.0 + np.vectorize(math.erf, otypes=[np.float64])(x / math.sqrt(2.0))),
    "gelu_tanh": lambda x: 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3))),
    "silu": lambda x: x / (1.0 + np.exp(-x)), "softplus": lambda x: np.logaddexp(0.0, x),
}
# (input bound limit, output bound as a function of the input bound, Lipschitz constant on that input range)
UNARY_FACTS: dict[str, tuple[float, Callable[[float], float], Callable[[float], float]]] = {
    "exp": (6.0, lambda b: math.exp(b), lambda b: math.exp(b)),
    "exp2": (8.0, lambda b: 2.0**b, lambda b: 0.7 * 2.0**b),
    "sin": (1e3, lambda b: 1.0, lambda b: 1.0), "cos": (1e3, lambda b: 1.0, lambda b: 1.0),
    "tan": (1.0, lambda b: math.tan(b), lambda b: 1.0 / math.cos(b) ** 2),
    "tanh": (1e3, lambda b: 1.0, lambda b: 1.0), "sigmoid": (1e3, lambda b: 1.0, lambda b: 0.25),
    "erf": (1e3, lambda b: 1.0, lambda b: 1.13), "gelu": (1e3, lambda b: b, lambda b: 1.13),
    "gelu_tanh": (1e3, lambda b: b, lambda b: 1.13), "silu": (1e3, lambda b: b, lambda b: 1.1),
    "softplus": (1e3, lambda b: b + 0.7, lambda b: 1.0),
}


# ---------------------------------------------------------------------------------------------------- the builder
class Builder:
    """Draws one program: each `op_*` method appends a statement or returns None when it does not apply."""

    def __init__(self, draw: st.DrawFn, device: str, others: tuple[str, ...], dtypes: tuple[str, ...]):
        self.draw = draw
        self.prog = Program(device)
        self.others = others  # further devices a value may move to
        self.dtypes = dtypes

    # -- drawing helpers
    def choice(self, seq: Any) -> Any:
        return self.draw(st.sampled_from(list(seq)))

    def int_(self, lo: int, hi: int) -> int:
        return self.draw(st.integers(lo, hi))

    def coin(self, p: float = 0.5) -> bool:
        return self.draw(st.integers(0, 99)) < int(p * 100)

    def shape(self, lo: int = 0, hi: int = 4) -> tuple[int, ...]:
        return tuple(self.choice(DIMS) for _ in range(self.int_(lo, hi)))

    def pick(self, pred: Callable[[Val], bool]) -> Val | None:
        vals = [v for v in self.prog.vals if v.name not in self.prog.terminal and pred(v)]
        return self.choice(vals) if vals else None

    def scalar(self, k: str) -> str:
        name = self.prog.fresh("s")
        self.prog.scalars[name] = k
        return name

    # -- values
    def leaf(self, shape: tuple[int, ...], dtype: str, domain: str | None = None, device: str | None = None) -> Val:
        name = self.prog.fresh("x")
        if domain is None:
            domain = "bool" if dtype == "bool" else "int" if dtype in INTS else "grid"
        dev = device or self.prog.device
        self.prog.leaves.append(Leaf(name, shape, dtype, domain, dev))
        if domain == "bool":
            v = Val(name, shape, dtype, 1.0, 0.0, 0, dev)
        elif domain.startswith(("index:", "gindex:")):
            v = Val(name, shape, dtype, float(domain.split(":")[1]), 0.0, 0, dev)
        elif dtype in INTS:
            v = Val(name, shape, dtype, 9.0, 0.0, 0, dev)
        else:
            v = Val(name, shape, dtype, FLOAT_GRID, 0.0, 2, dev)
        self.prog.vals.append(v)
        return v

    def emit(self, src: str, ref: Callable[[dict[str, Any]], Any], shape: tuple[int, ...], dtype: str,
             bound: float, err: float, frac: int | None, device: str | None = None) -> Val:
        """Append `name = src`; the reference result is rounded to `dtype` as a device stores it."""
        if dtype in INTS and bound > INT_MAX[dtype]:
            assert dtype in WRAPS, (dtype, bound)
            bound = float(INT_MAX[dtype] + 1)
        name = self.prog.fresh("v")
        v = Val(name, shape, dtype, bound, err, frac, device or self.prog.device)

        def run(env: dict[str, Any]) -> None:
            out = np.asarray(ref(env))
            env[name] = round_to(out, dtype).reshape(shape)

        self.prog.lines.append(f"{name} = {src}")
        self.prog.refs.append(run)
        if self.prog.unsigned_zero.intersection(re.findall(r"\b[vx]\d+\b", src)):
            self.prog.unsigned_zero.add(name)
        self.prog.vals.append(v)
        return v

    def unsigned(self, v: Val) -> Val:
        """Mark v's zeros as of unspecified sign: IEEE max/min (and ops built on them) may return -0.0 or 0.0
        for a tie of zeros, so no later op may depend on the sign of v's zeros."""
        self.prog.unsigned_zero.add(v.name)
        return v

    def operand(self, a: Val, dtypes: tuple[str, ...] | None = None, same_dtype: bool = False) -> Val:
        """A second tensor for a binary op with `a`: an existing value (a shared subgraph) or a new input, of a shape
        that broadcasts with `a`'s."""
        allowed = dtypes or self.dtypes
        if self.coin(0.4):
            v = self.pick(lambda v: v.device == a.device and _broadcasts(v.shape, a.shape)
                          and (v.dtype == a.dtype if same_dtype else v.dtype in allowed))
            if v is not None:
                return v
        shape = list(a.shape)
        shape = [1 if self.coin(0.25) else s for s in shape]
        if shape and self.coin(0.3):
            shape = shape[self.int_(0, len(shape)):]
        if len(shape) < 4 and self.coin(0.15):
            shape = [self.choice(DIMS)] + shape
        dtype = a.dtype if same_dtype or self.coin(0.6) else self.choice(allowed)
        return self.leaf(tuple(shape), dtype, device=a.device)

    def value(self, pred: Callable[[Val], bool], make: Callable[[], Val | None] | None = None) -> Val | None:
        """An existing value on the program's device satisfying `pred` (favouring the newest), or a new input."""
        vals = [v for v in self.prog.vals if v.device == self.prog.device and v.name not in self.prog.terminal
                and pred(v)]
        if vals and (make is None or self.coin(0.85)):
            return vals[-1] if self.coin(0.5) else self.choice(vals)
        return make() if make else None

    # -- a value converted to a wider or narrower dtype, as promotion does before an op
    def conv(self, v: Val, d: str) -> tuple[float, float, int | None]:
        if v.dtype == d:
            return v.bound, v.err, v.frac
        if d in FLOATS:
            return finish(d, v.bound, v.err, v.frac)
        return v.bound, v.err, 0

    def numeric(self, v: Val) -> bool:
        return v.dtype != "bool"

    def fits(self, d: str, bound: float) -> bool:
        if d in FLOATS:
            return bound <= FLOAT_LIMIT[d]
        if d in INT_SAFE:
            return bound <= INT_SAFE[d]
        return True

    # ------------------------------------------------------------------------------------------------ elementwise
    def op_arith(self) -> Val | None:
        """a + b, a - b, a * b with a tensor or a Python scalar on either side."""
        a = self.value(self.numeric, self.new_input)
        if a is None or not a.dtype != "bool":
            return None
        sym = self.choice(["+", "-", "*"])
        if self.coin(0.45):  # with a scalar
            k = self.choice(["f", "i"]) if a.dtype not in FLOATS else "f"
            s = self.scalar(k)
            d = promote_scalar(a.dtype, k)
            ba, ea, fa = self.conv(a, d)
            bs, fs = SCALAR_MAX[k], SCALAR_FRAC[k]
            rev = self.coin(0.4)
            src = f"{s} {sym} {a.name}" if rev else f"{a.name} {sym} {s}"
            if sym == "*":
                bound, err, frac = ba * bs, ea * bs, _add(fa, fs)
            else:
                bound, err, frac = ba + bs, ea, _max(fa, fs)
            if not self.fits(d, bound):
                return None
            fn = BINARY_NP[sym]
            out_shape = a.shape

            def ref(env: dict[str, Any], a: Val = a, s: str = s, rev: bool = rev) -> Any:
                x, y = _as(env[a.name], d), _scalar_as(env[s], d)
                return fn(y, x) if rev else fn(x, y)

            return self.emit(src, ref, out_shape, d, *finish(d, bound, err, frac))
        b = self.operand(a, tuple(x for x in self.dtypes if x != "bool"))
        d = promote(a.dtype, b.dtype)
        ba, ea, fa = self.conv(a, d)
        bb, eb, fb = self.conv(b, d)
        if sym == "*":
            bound, err, frac = ba * bb, ea * bb + eb * ba + ea * eb, _add(fa, fb)
        else:
            bound, err, frac = ba + bb, ea + eb, _max(fa, fb)
        shape = _bshape(a.shape, b.shape)
        if shape is None or not self.fits(d, bound):
            return None
        fn = BINARY_NP[sym]
        return self.emit(f"{a.name} {sym} {b.name}", lambda env: fn(_as(env[a.name], d), _as(env[b.name], d)),
                         shape, d, *finish(d, bound, err, frac))

    def op_div(self) -> Val | None:
        """True division: by a nonzero scalar, by a tensor kept away from zero, or a scalar by such a tensor."""
        a = self.value(self.numeric, self.new_input)
        if a is None or a.dtype == "bool":
            return None
        form = self.choice(["scalar", "tensor", "rscalar"])
        d = least_float(a.dtype)
        ba, ea, _ = self.conv(a, d)
        if form == "scalar":
            s = self.scalar("fnz")
            bound, err = ba * 4.0, ea * 4.0
            return self.emit(f"{a.name} / {s}", lambda env: _as(env[a.name], "float64") / env[s], a.shape, d,
                             *finish(d, bound, err, None, 2))
        # a positive tensor: |b| + s with s >= 0.25
        b = a if form == "rscalar" else self.operand(a, tuple(x for x in self.dtypes if x != "bool"))
        s = self.scalar("fpos")
        db = promote_scalar(b.dtype, "f")
        bb, eb, _ = self.conv(b, db)
        denom = f"({b.name}.abs() + {s})"
        low, hi = 0.25, bb + 3.0
        if form == "rscalar":
            n = self.scalar("f")
            bound, err = 4.0 / low, 4.0 * eb / low**2
            return self.emit(f"{n} / {denom}",
                             lambda env: env[n] / (_as(_abs(env[b.name], b.dtype), "float64") + env[s]),
                             b.shape, db, *finish(db, bound, err + 2 * ulp(db, hi), None, 2))
        d = least_float(promote(a.dtype, db))
        ba, ea, _ = self.conv(a, d)
        shape = _bshape(a.shape, b.shape)
        if shape is None:
            return None
        bound, err = ba / low, ea / low + ba * (eb + 2 * ulp(db, hi)) / low**2
        return self.emit(f"{a.name} / {denom}",
                         lambda env: _as(env[a.name], "float64")
                         / (_as(_abs(env[b.name], b.dtype), "float64") + env[s]),
                         shape, d, *finish(d, bound, err, None, 2))

    def op_div_zero(self) -> Val | None:
        """A scalar divided by an exact float tensor that holds zeros of both signs: signed infinities (terminal)."""
        a = self.value(lambda v: v.dtype in FLOATS and v.exact and v.name not in self.prog.unsigned_zero)
        if a is None:
            return None
        s = self.scalar("fnz")
        def ref(env: dict[str, Any]) -> Any:
            with np.errstate(divide="ignore"):
                return np.float64(env[s]) / _as(env[a.name], "float64")

        v = self.emit(f"{s} / {a.name}", ref, a.shape, a.dtype, math.inf, math.inf, None)
        self.prog.terminal.add(v.name)
        return v

    def op_minmax(self) -> Val | None:
        a = self.value(self.numeric, self.new_input)
        if a is None or a.dtype == "bool":
            return None
        b = self.operand(a, tuple(x for x in self.dtypes if x != "bool"))
        d = promote(a.dtype, b.dtype)
        shape = _bshape(a.shape, b.shape)
        if shape is None:
            return None
        fn = self.choice(["maximum", "minimum"])
        ba, ea, fa = self.conv(a, d)
        bb, eb, fb = self.conv(b, d)
        f = BINARY_NP[fn]
        return self.unsigned(self.emit(f"{a.name}.{fn}({b.name})", lambda env: f(_as(env[a.name], d),
                                       _as(env[b.name], d)), shape, d, max(ba, bb), max(ea, eb), _max(fa, fb)))

    def op_compare(self) -> Val | None:
        a = self.value(lambda v: v.exact, self.new_input)
        if a is None or not a.exact:
            return None
        sym = self.choice(["<", "<=", ">", ">=", "==", "!="])
        if self.coin(0.4) and a.dtype != "bool":
            k = "f" if a.dtype in FLOATS or a.dtype == "uint8" or self.coin(0.3) else "i"
            s = self.scalar(k)
            f = BINARY_NP[sym]
            return self.emit(f"{a.name} {sym} {s}", lambda env: f(wide(env[a.name]), env[s]), a.shape, "bool",
                             1.0, 0.0, 0)
        b = self.operand(a)
        if not b.exact:
            return None
        shape = _bshape(a.shape, b.shape)
        if shape is None or (a.dtype == "bool") != (b.dtype == "bool") and sym not in ("==", "!="):
            return None
        d = promote(a.dtype, b.dtype)
        f = BINARY_NP[sym]
        return self.emit(f"{a.name} {sym} {b.name}", lambda env: f(_as(env[a.name], d), _as(env[b.name], d)), shape,
                         "bool", 1.0, 0.0, 0)

    def op_bitwise(self) -> Val | None:
        a = self.value(lambda v: v.dtype == "bool" or v.dtype in INTS, lambda: self.new_input(("bool",) + INTS))
        if a is None:
            return None
        if self.coin(0.3):
            return self.emit(f"~{a.name}", lambda env: np.invert(wide(env[a.name]) if a.dtype != "bool"
                                                               else env[a.name]),
                             a.shape, a.dtype, 255.0 if a.dtype == "uint8" else a.bound + 1, 0.0, 0)
        b = self.operand(a, ("bool",) if a.dtype == "bool" else INTS)
        shape = _bshape(a.shape, b.shape)
        if shape is None:
            return None
        d = promote(a.dtype, b.dtype)
        sym = self.choice(["&", "|", "^"])
        f = BINARY_NP[sym]
        bound = 1.0 if d == "bool" else float(2 ** math.ceil(math.log2(max(a.bound, b.bound) + 1)))
        return self.emit(f"{a.name} {sym} {b.name}", lambda env: f(_as(env[a.name], d), _as(env[b.name], d)), shape, d,
                         bound, 0.0, 0)

    def op_floordiv(self) -> Val | None:
        """// and % (floor semantics, the sign of the divisor) on exact values, by a scalar or a positive tensor."""
        a = self.value(lambda v: v.exact and v.dtype != "bool" and v.bound <= 64, self.new_input)
        if a is None or a.dtype == "bool" or not a.exact or a.bound > 64:
            return None
        sym = self.choice(["//", "%"])
        f = BINARY_NP[sym]
        if self.coin(0.5) and a.dtype != "uint8":  # (a negative int scalar has no uint8 value)
            k = "inz" if a.dtype in INTS else "pow2"
            s = self.scalar(k)
            bound = a.bound * 4 + 1 if sym == "//" else SCALAR_MAX[k]
            return self.emit(f"{a.name} {sym} {s}", lambda env: f(wide(env[a.name]), env[s]), a.shape, a.dtype,
                             *finish(a.dtype, bound, 0.0, 0 if sym == "//" else _max(a.frac, 2)))
        # a tensor divisor made positive: |b| + 1
        b = self.operand(a, tuple(x for x in self.dtypes if x != "bool"))
        if not b.exact or b.bound > 64:
            return None
        d = promote(a.dtype, b.dtype)
        shape = _bshape(a.shape, b.shape)
        if shape is None:
            return None
        bound = a.bound + 1 if sym == "//" else b.bound + 1
        return self.emit(f"{a.name} {sym} ({b.name}.abs() + 1)",
                         lambda env: f(_as(env[a.name], d), _as(_abs(env[b.name], b.dtype), d) + 1), shape, d,
                         *finish(d, bound, 0.0, 0 if sym == "//" else _max(a.frac, b.frac)))

    def op_pow(self) -> Val | None:
        a = self.value(self.numeric, self.new_input)
        if a is None or a.dtype == "bool":
            return None
        if a.dtype in INTS and self.coin(0.5):  # an int raised to a small int: exact
            s = self.scalar("iexp")
            if not self.fits(a.dtype, a.bound**3):
                return None
            return self.emit(f"{a.name} ** {s}", lambda env: np.power(wide(env[a.name]), env[s]), a.shape, a.dtype,
                             max(1.0, a.bound**3), 0.0, 0)
        d = least_float(a.dtype)
        ba, ea, _ = self.conv(a, d)
        p = self.scalar("fpos")
        if self.coin(0.3):  # a positive scalar base, a bounded exponent
            if ba > 6:
                return None
            bound = 3.0**ba * 4.0**ba
            if not self.fits(d, bound):
                return None
            return self.emit(f"{p} ** {a.name}", lambda env: np.power(env[p], _as(env[a.name], "float64")), a.shape,
                             d, *finish(d, bound, 2.0 * bound * ea, None, 4))
        s = self.scalar("f")  # (|a| + p) ** s, the base at least 0.25
        if a.dtype in INTS and a.bound > INT_MAX[a.dtype]:
            return None  # |a| may wrap (int8's |-128| is -128): a negative base
        hi = ba + 3.0
        bound = max(hi**4, 0.25**-4)
        lip = 4.0 * max(hi**3, 0.25**-5)
        if not self.fits(d, bound):
            return None
        return self.emit(f"({a.name}.abs() + {p}) ** {s}",
                         lambda env: np.power(_as(_abs(env[a.name], a.dtype), "float64") + env[p], env[s]), a.shape, d,
                         *finish(d, bound, lip * (ea + ulp(d, hi)), None, 4))

    def op_unary_exact(self) -> Val | None:
        """Ops that keep exact values exact: -, abs, relu, square, sign, floor, ceil, round, clip."""
        a = self.value(self.numeric, self.new_input)
        if a is None or a.dtype == "bool":
            return None
        fn = self.choice(["neg", "abs", "relu", "square", "sign", "floor", "ceil", "round", "clip"])
        w = lambda env: wide(env[a.name])  # noqa: E731
        if fn == "neg":
            bound = 255.0 if a.dtype == "uint8" else a.bound  # -x wraps to 256 - x in uint8
            return self.emit(f"-{a.name}", lambda env: -w(env), a.shape, a.dtype, bound, a.err, a.frac)
        if fn in ("abs", "relu"):
            f = np.abs if fn == "abs" else (lambda x: np.maximum(x, 0))
            bound = a.bound + (1 if a.dtype in INTS else 0)  # abs(-128) wraps in int8
            v = self.emit(f"{a.name}.{fn}()", lambda env: f(w(env)), a.shape, a.dtype, bound, a.err, a.frac)
            return self.unsigned(v) if fn == "relu" else v
        if fn == "square":
            bound = a.bound**2
            if not self.fits(a.dtype, bound):
                return None
            return self.emit(f"{a.name}.square()", lambda env: w(env) * w(env), a.shape, a.dtype,
                             *finish(a.dtype, bound, 2 * a.bound * a.err + a.err**2, _add(a.frac, a.frac)))
        if fn == "clip":
            k = "f" if a.dtype in FLOATS else "i"
            lo, hi = self.scalar(k), self.scalar(k)
            form = self.choice(["both", "lo", "hi"])
            los, his = (lo if form != "hi" else "None"), (hi if form != "lo" else "None")

            def ref(env: dict[str, Any]) -> Any:
                x = w(env)  # the bounds wrap into an int dtype first (uint8's -3 is 253), as in PyTorch
                if form != "hi":
                    x = np.maximum(x, _scalar_as(env[lo], a.dtype))
                if form != "lo":
                    x = np.minimum(x, _scalar_as(env[hi], a.dtype))
                return x

            bound = max(a.bound, SCALAR_MAX[k], INT_MAX[a.dtype] if a.dtype.startswith("uint") else 0)
            return self.unsigned(self.emit(f"{a.name}.clip({los}, {his})", ref, a.shape, a.dtype,
                                           bound, a.err, _max(a.frac, SCALAR_FRAC[k])))
        if not a.exact:
            return None
        if fn == "sign":
            return self.emit(f"{a.name}.sign()", lambda env: np.sign(w(env)), a.shape, a.dtype, 1.0, 0.0, 0)
        if a.dtype not in FLOATS:
            return None
        f = {"floor": np.floor, "ceil": np.ceil, "round": np.round}[fn]
        return self.emit(f"{a.name}.{fn}()", lambda env: f(w(env)), a.shape, a.dtype, a.bound + 1, 0.0, 0)

    def op_unary_float(self) -> Val | None:
        """Transcendental ops (float results; ints compute in float32)."""
        fn = self.choice(sorted(UNARY_FACTS) + ["log", "log2", "sqrt", "rsqrt", "reciprocal"])
        a = self.value(self.numeric, self.new_input)
        if a is None or a.dtype == "bool":
            return None
        d = least_float(a.dtype)
        ba, ea, _ = self.conv(a, d)
        if fn not in UNARY_FACTS and a.dtype in INTS and a.bound > INT_MAX[a.dtype]:
            return None  # |a| may wrap (int8's |-128| is -128): no longer >= 0
        if fn in UNARY_FACTS:
            limit, out, lip = UNARY_FACTS[fn]
            if ba > limit:
                return None
            f = UNARY_NP[fn]
            call = "gelu(approximate='tanh')" if fn == "gelu_tanh" else f"{fn}()"
            bound = out(ba)
            return self.emit(f"{a.name}.{call}", lambda env: f(_as(env[a.name], "float64")), a.shape, d,
                             *finish(d, bound, lip(ba) * ea, None, 4))
        if fn == "sqrt":  # of |a|: the error of a root near zero is the root of the error
            return self.emit(f"{a.name}.abs().sqrt()", lambda env: np.sqrt(_as(_abs(env[a.name], a.dtype), "float64")),
                             a.shape, d, *finish(d, math.sqrt(ba), math.sqrt(ea), None, 2))
        s = self.scalar("fpos")  # of |a| + s, s >= 0.25
        hi = ba + 3.0
        f = UNARY_NP[fn]
        bound, lip = {"log": (max(math.log(hi), 1.4), 4.0), "log2": (max(math.log2(hi), 2.0), 6.0),
                      "rsqrt": (2.0, 4.0), "reciprocal": (4.0, 16.0)}[fn]
        return self.emit(f"({a.name}.abs() + {s}).{fn}()",
                         lambda env: f(_as(_abs(env[a.name], a.dtype), "float64") + env[s]), a.shape, d,
                         *finish(d, bound, lip * (ea + ulp(d, hi)), None, 4))

    def op_cast(self) -> Val | None:
        a = self.value(lambda v: True, self.new_input)
        if a is None:
            return None
        d = self.choice(self.dtypes)
        how = self.choice(["cast", "method"])
        method = {"float32": "float", "float16": "half", "int32": "int", "bool": "bool"}.get(d)
        src = f"{a.name}.{method}()" if how == "method" and method else f"{a.name}.cast({d!r})"
        if d == a.dtype:
            return self.emit(src, lambda env: env[a.name], a.shape, d, a.bound, a.err, a.frac)
        if d in FLOATS:
            if a.dtype in FLOATS and a.bound > FLOAT_LIMIT[d]:
                return None
            b, e, f = self.conv(a, d)
            return self.emit(src, lambda env: wide(env[a.name]), a.shape, d, b, e, f)
        if not a.exact:
            return None
        if d == "bool":
            return self.emit(src, lambda env: wide(env[a.name]) != 0, a.shape, d, 1.0, 0.0, 0)
        if a.dtype in FLOATS and a.bound >= INT_MAX[d] // 2:
            return None  # an out-of-range float to int cast is undefined (C, numpy and PyTorch differ)
        bound = 255.0 if d == "uint8" and not a.positive else a.bound  # -2 wraps to 254
        return self.emit(src, lambda env: wide(env[a.name]), a.shape, d, bound, 0.0, 0)

    def op_where(self) -> Val | None:
        c = self.value(lambda v: v.dtype == "bool", lambda: self.new_input(("bool",)))
        if c is None:
            return None
        parts: list[tuple[str, Val | None, str]] = []  # (source, tensor, scalar kind)
        for _ in range(2):
            if self.coin(0.35):
                k = self.choice(["f", "i"])
                parts.append((self.scalar(k), None, k))
            else:
                v = self.operand(c, tuple(x for x in self.dtypes))
                parts.append((v.name, v, ""))
        tensors = [v for _, v, _ in parts if v is not None]
        if tensors:
            d = tensors[0].dtype if len(tensors) == 1 else promote(tensors[0].dtype, tensors[1].dtype)
            for _, v, k in parts:
                if v is None:
                    d = promote_scalar(d, k)
        else:
            d = "float32" if "f" in (parts[0][2], parts[1][2]) else "int32"
        shape: tuple[int, ...] | None = c.shape
        for v in tensors:
            shape = _bshape(shape, v.shape) if shape is not None else None
        if shape is None:
            return None
        stats = [self.conv(v, d) if v is not None else (SCALAR_MAX[k], 0.0, SCALAR_FRAC[k]) for _, v, k in parts]
        (sa, _, _), (sb, _, _) = parts

        def pick(env: dict[str, Any], src: str) -> Any:
            return _as(env[src], d) if isinstance(env[src], np.ndarray) else _scalar_as(env[src], d)

        return self.emit(f"Tensor.where({c.name}, {sa}, {sb})",
                         lambda env: np.where(env[c.name], pick(env, sa), pick(env, sb)), shape, d,
                         max(stats[0][0], stats[1][0]), max(stats[0][1], stats[1][1]),
                         _max(stats[0][2], stats[1][2]))

    # ------------------------------------------------------------------------------------------------ reductions
    def axes(self, v: Val, single: bool = False) -> tuple[str, tuple[int, ...]]:
        """A reduction's axis argument as source, and the axes it names (normalised)."""
        nd = len(v.shape)
        if nd == 0 or self.coin(0.2):
            return "None", tuple(range(nd))
        if single or self.coin(0.6):
            ax = self.int_(-nd, nd - 1)
            return str(ax), (ax % nd,)
        chosen = sorted(set(self.draw(st.lists(st.integers(0, nd - 1), min_size=1, max_size=nd))))
        src = [a - nd if self.coin(0.3) else a for a in chosen]
        return repr(tuple(src)), tuple(chosen)

    def op_reduce(self) -> Val | None:
        fn = self.choice(["sum", "max", "min", "mean", "prod", "var", "std", "argmax", "argmin", "logsumexp",
                          "softmax", "log_softmax"])
        a = self.value(lambda v: True, self.new_input)
        if a is None:
            return None
        single = fn in ("argmax", "argmin", "softmax", "log_softmax")
        if fn in ("softmax", "log_softmax") and not a.shape:
            return None
        axis_src, axes = self.axes(a, single)
        keep = self.coin(0.4) and not (fn in ("argmax", "argmin") and axis_src == "None")
        n = math.prod(a.shape[i] for i in axes)
        if n == 0 and fn not in ("sum", "prod"):
            return None  # max/min/arg*: an error as in numpy and PyTorch; mean/var/std/logsumexp: nan or -inf
        shape = tuple(1 if i in axes else s for i, s in enumerate(a.shape)) if keep else \
            tuple(s for i, s in enumerate(a.shape) if i not in axes)
        npax = tuple(axes) if axes else None
        kw = ", keepdim=True" if keep else ""
        src = f"{a.name}.{fn}({'' if axis_src == 'None' and not kw else axis_src}{kw})"
        w = lambda env: wide(env[a.name])  # noqa: E731
        if fn in ("sum", "max", "min", "prod"):
            if fn == "sum":
                d = "int32" if a.dtype == "bool" else a.dtype
                bound, err, frac, ulps = a.bound * n, a.err * n, a.frac, float(n)
                f = np.sum
            elif fn == "prod":
                d = "int32" if a.dtype == "bool" else a.dtype
                if n > 4 or a.bound > 3:
                    return None
                bound = max(a.bound, 1.0) ** n
                err, frac, ulps = n * max(a.bound, 1.0) ** (n - 1) * a.err, _mul(a.frac, n), float(n)
                f = np.prod
            else:
                d, bound, err, frac, ulps = a.dtype, a.bound, a.err, a.frac, 0.0
                f = np.max if fn == "max" else np.min
            if not self.fits(d, bound):
                return None
            v = self.emit(src, lambda env: f(w(env), axis=npax, keepdims=keep), shape, d,
                          *finish(d, bound, err, frac, ulps))
            return self.unsigned(v) if fn in ("max", "min") else v
        if fn in ("argmax", "argmin"):
            if not a.exact or a.dtype == "bool":
                return None
            f = np.argmax if fn == "argmax" else np.argmin
            ax = axes[0] if axis_src != "None" else None
            return self.emit(src, lambda env: f(w(env), axis=ax, keepdims=keep) if ax is not None else
                             f(w(env)), shape, "int32", float(max(n, 1)), 0.0, 0)
        if a.dtype not in FLOATS:
            return None
        d = a.dtype
        x64 = lambda env: _as(env[a.name], "float64")  # noqa: E731
        if fn == "mean":
            frac = _add(a.frac, int(math.log2(n))) if n & (n - 1) == 0 and a.frac is not None else None
            return self.emit(src, lambda env: np.mean(x64(env), axis=npax, keepdims=keep), shape, d,
                             *finish(d, a.bound, a.err, frac if a.err == 0 else None, 2.0 + n * 2.0**-20))
        if fn in ("var", "std"):
            corr = self.choice([1, 0]) if n > 1 else 0
            if n - corr <= 0:
                return None
            csrc = "" if corr == 1 else f", correction={corr}"
            src = f"{a.name}.{fn}({axis_src}{kw}{csrc})"
            e1 = a.err + 4 * n * ulp("float32", a.bound)
            bvar = a.bound**2 * n / (n - corr)
            evar = n / (n - corr) * (4 * a.bound * e1 + e1**2) + 4 * n * ulp("float32", bvar)
            f = (lambda x: np.var(x, axis=npax, keepdims=keep, ddof=corr)) if fn == "var" else \
                (lambda x: np.std(x, axis=npax, keepdims=keep, ddof=corr))
            bound, err = (bvar, evar) if fn == "var" else (math.sqrt(bvar), math.sqrt(evar))
            return self.emit(src, lambda env: f(x64(env)), shape, d, *finish(d, bound, err, None, 4))
        if a.bound > 30:
            return None
        lse = lambda x, keepdims: np.log(np.sum(np.exp(x - np.max(x, axis=npax, keepdims=True)), axis=npax,  # noqa: E731
                                                keepdims=keepdims)) + np.max(x, axis=npax, keepdims=keepdims)
        e = 2 * a.err + 8 * n * ulp("float32", a.bound + math.log(max(n, 1)) + 1)
        if fn == "logsumexp":
            return self.emit(src, lambda env: lse(x64(env), keep), shape, d,
                             *finish(d, a.bound + math.log(max(n, 1)), e, None, 4))
        if axis_src == "None":
            return None
        src = f"{a.name}.{fn}({axis_src})"
        if fn == "softmax":
            return self.emit(src, lambda env: np.exp(x64(env) - lse(x64(env), True)), a.shape, d,
                             *finish(d, 1.0, e, None, 4))
        return self.emit(src, lambda env: x64(env) - lse(x64(env), True), a.shape, d,
                         *finish(d, 2 * a.bound + math.log(max(n, 1)), e, None, 4))

    # ------------------------------------------------------------------------------------------------ movement
    def op_movement(self) -> Val | None:
        fn = self.choice(["reshape", "permute", "transpose", "T", "expand", "pad", "squeeze", "unsqueeze", "flatten",
                          "flip", "repeat", "index", "cat", "stack", "split", "chunk", "to"])
        a = self.value(lambda v: True, self.new_input)
        if a is None:
            return None
        nd, shape = len(a.shape), a.shape
        keep = (a.dtype, a.bound, a.err, a.frac)
        if fn == "reshape":
            new = _factor(a.size, self.int_(0, 4), self.draw)
            if new is None:
                return None
            shown = list(new)
            if shown and a.size and self.coin(0.3):  # (-1 with no elements is ambiguous: an error)
                shown[self.int_(0, len(shown) - 1)] = -1
            args = ", ".join(map(str, shown)) if self.coin(0.6) else repr(tuple(shown))
            return self.emit(f"{a.name}.reshape({args})", lambda env: env[a.name].reshape(new), new, *keep)
        if fn == "permute":
            order = tuple(self.draw(st.permutations(range(nd))))
            return self.emit(f"{a.name}.permute{order if nd != 1 else (order[0],)}".replace(",)", ")"),
                             lambda env: np.transpose(env[a.name], order), tuple(shape[i] for i in order), *keep)
        if fn == "transpose":
            if nd < 2:
                return None
            d0, d1 = self.int_(-nd, nd - 1), self.int_(-nd, nd - 1)
            out = list(shape)
            out[d0], out[d1] = out[d1], out[d0]
            return self.emit(f"{a.name}.transpose({d0}, {d1})", lambda env: np.swapaxes(env[a.name], d0, d1),
                             tuple(out), *keep)
        if fn == "T":
            return self.emit(f"{a.name}.T", lambda env: np.transpose(env[a.name]), shape[::-1], *keep)
        if fn == "expand":
            lead = tuple(self.choice(DIMS) for _ in range(self.int_(0, 4 - nd)))
            new = lead + tuple(self.choice((2, 3)) if s == 1 and self.coin() else s for s in shape)
            shown = lead + tuple(-1 if s == t and self.coin(0.3) else t for s, t in zip(shape, new[len(lead):]))
            return self.emit(f"{a.name}.expand{shown}".replace(",)", ")"),
                             lambda env: np.broadcast_to(env[a.name], new), new, *keep)
        if fn == "pad":
            pads = tuple((self.int_(-min(1, s - 1), 2), self.int_(-min(1, s - 1), 2)) for s in shape)
            if a.dtype == "bool":
                return None
            k = "f" if a.dtype in FLOATS else "i"
            s = self.scalar(k) if self.coin(0.6) else None
            value = f", value={s}" if s else ""
            new = tuple(n + b + e for n, (b, e) in zip(shape, pads))
            bound = max(a.bound, SCALAR_MAX[k] if s else 0.0)
            return self.emit(f"{a.name}.pad({pads}{value})", lambda env: _np_pad(env[a.name], pads,
                             env[s] if s else 0), new, a.dtype, bound, a.err, _max(a.frac, SCALAR_FRAC[k]))
        if fn == "squeeze":
            ones = [i for i, s in enumerate(shape) if s == 1]
            if not ones or self.coin(0.3):
                return self.emit(f"{a.name}.squeeze()", lambda env: np.reshape(env[a.name], tuple(
                    s for s in shape if s != 1)), tuple(s for s in shape if s != 1), *keep)
            ax = self.choice(ones)
            return self.emit(f"{a.name}.squeeze({ax - nd if self.coin() else ax})",
                             lambda env: np.squeeze(env[a.name], ax), shape[:ax] + shape[ax + 1:], *keep)
        if fn == "unsqueeze":
            if nd >= 4:
                return None
            ax = self.int_(-nd - 1, nd)
            return self.emit(f"{a.name}.unsqueeze({ax})", lambda env: np.expand_dims(env[a.name], ax),
                             np.expand_dims(np.empty(shape), ax).shape, *keep)
        if fn == "flatten":
            if nd == 0:
                return self.emit(f"{a.name}.flatten()", lambda env: env[a.name].reshape(1), (1,), *keep)
            s0 = self.int_(0, nd - 1)
            e0 = self.int_(s0, nd - 1)
            new = shape[:s0] + (math.prod(shape[s0:e0 + 1]),) + shape[e0 + 1:]
            return self.emit(f"{a.name}.flatten({s0}, {e0 - nd if self.coin() else e0})",
                             lambda env: env[a.name].reshape(new), new, *keep)
        if fn == "flip":
            if nd == 0:
                return None
            axes = sorted(set(self.draw(st.lists(st.integers(0, nd - 1), min_size=1, max_size=nd))))
            arg = axes[0] if len(axes) == 1 else tuple(axes)
            return self.emit(f"{a.name}.flip({arg})", lambda env: np.flip(env[a.name], arg), shape, *keep)
        if fn == "repeat":
            reps = tuple(self.choice((1, 2, 3)) for _ in range(self.int_(max(nd, 1), max(nd, 4))))
            new = tuple(np.tile(np.empty(shape), reps).shape)
            return self.emit(f"{a.name}.repeat{reps}".replace(",)", ")"), lambda env: np.tile(env[a.name], reps),
                             new, *keep)
        if fn == "index":
            if nd == 0:
                return None
            key = self.index_key(shape)
            new = np.empty(shape)[key].shape
            return self.emit(f"{a.name}[{_key_src(key)}]", lambda env: env[a.name][key], new, *keep)
        if fn in ("cat", "stack"):
            if nd == 0 and fn == "cat":
                return None
            ax = self.int_(-nd, nd - 1) if fn == "cat" else self.int_(-nd - 1, nd)
            others = []
            for _ in range(self.int_(1, 2)):
                oshape = list(shape)
                if fn == "cat":
                    oshape[ax] = self.choice(DIMS)
                other = self.pick(lambda v: v.shape == tuple(oshape) and v.dtype == a.dtype and v.device == a.device)
                others.append(other if other is not None and self.coin() else
                              self.leaf(tuple(oshape), a.dtype, device=a.device))
            names = [a.name] + [o.name for o in others]
            f = np.concatenate if fn == "cat" else np.stack
            new = f([np.empty(shape)] + [np.empty(o.shape) for o in others], axis=ax).shape
            return self.emit(f"Tensor.{fn}([{', '.join(names)}], axis={ax})",
                             lambda env: f([env[n] for n in names], axis=ax), new, a.dtype,
                             max(o.bound for o in [a, *others]), max(o.err for o in [a, *others]),
                             _max(a.frac, *[o.frac for o in others]))
        if fn in ("split", "chunk"):
            if nd == 0:
                return None
            ax = self.int_(-nd, nd - 1)
            n = shape[ax]
            if n == 0:
                return None
            size = self.int_(1, n) if fn == "split" else -(-n // self.int_(1, n))
            arg = size if fn == "split" else self.chunk_arg(n, size)
            starts = list(range(0, n, size))
            i = self.int_(0, len(starts) - 1)
            lo, hi = starts[i], min(n, starts[i] + size)
            new = tuple(hi - lo if j == ax % nd else s for j, s in enumerate(shape))
            return self.emit(f"{a.name}.{fn}({arg}, axis={ax})[{i}]",
                             lambda env: np.take(env[a.name], range(lo, hi), axis=ax), new, *keep)
        if fn == "to":
            if not self.others:
                return None
            dev = self.choice(self.others + (self.prog.device,))
            return self.emit(f"{a.name}.to({dev!r})", lambda env: env[a.name], shape, *keep, device=dev)
        raise AssertionError(fn)

    def chunk_arg(self, n: int, size: int) -> int:
        """A chunk count whose chunks have `size` rows (PyTorch: chunks of ceil(n / count))."""
        for count in range(1, n + 1):
            if -(-n // count) == size:
                return count
        raise AssertionError((n, size))

    def index_key(self, shape: tuple[int, ...]) -> tuple[Any, ...]:
        """A basic index: ints (negative too), slices with steps (negative too), None, and at most one Ellipsis
        (the keys after it address the last axes)."""
        nd = len(shape)
        used = self.int_(1, nd)
        split = self.int_(0, used) if self.coin(0.25) else used
        dims = list(range(split)) + list(range(nd - (used - split), nd))
        key: list[Any] = []
        for i, dim in enumerate(dims):
            if i == split:
                key.append(Ellipsis)
            n = shape[dim]
            if self.coin(0.15):
                key.append(None)
            if self.coin(0.35):
                key.append(self.int_(-n, n - 1))
            else:
                step = self.choice([1, 1, 2, 3, -1, -2])
                start = self.choice([None, self.int_(-n, n - 1)])
                stop = self.choice([None, self.int_(-n - 1, n)])
                key.append(slice(start, stop, step if step != 1 or self.coin(0.3) else None))
        if split == len(dims) and split < used:
            key.append(Ellipsis)
        return tuple(key)

    def op_take(self) -> Val | None:
        """Integer-tensor indexing along one axis (the first, or another after full slices) and gather (indices are
        new int inputs in range, negative ones too where the op allows them)."""
        a = self.value(lambda v: len(v.shape) >= 1, lambda: self.new_input(rank=(1, 3)))
        if a is None or not a.shape or 0 in a.shape:
            return None
        idt = self.choice(["int32", "int64", "int16", "uint8"])
        if self.coin(0.5):
            ax = 0 if self.coin(0.5) else self.int_(0, len(a.shape) - 1)
            n = a.shape[ax]
            ishape = self.shape(0, 2)
            idx = self.leaf(ishape, idt, f"index:{n}" if idt != "uint8" else f"gindex:{n}", device=a.device)
            lead = ":, " * ax
            v = self.emit(f"{a.name}[{lead}{idx.name}]",
                          lambda env: env[a.name][(slice(None),) * ax + (wide(env[idx.name]),)],
                          a.shape[:ax] + ishape + a.shape[ax + 1 :], a.dtype, a.bound, a.err, a.frac)
            self.prog.unsigned_zero.add(v.name)
            return v
        nd = len(a.shape)
        ax = self.int_(-nd, nd - 1)
        ishape = tuple(self.choice(DIMS) if i == ax % nd else self.int_(1, s) for i, s in enumerate(a.shape))
        idx = self.leaf(ishape, idt, f"gindex:{a.shape[ax]}", device=a.device)
        region = tuple(slice(None) if i == ax % nd else slice(0, s) for i, s in enumerate(ishape))
        v = self.emit(f"{a.name}.gather({ax}, {idx.name})",
                      lambda env: np.take_along_axis(env[a.name][region], wide(env[idx.name]), axis=ax), ishape,
                      a.dtype, a.bound, a.err, a.frac)
        self.prog.unsigned_zero.add(v.name)
        return v

    def op_setitem(self) -> Val | None:
        """An in-place update of a view (`v[key] = b`) on a new handle to a value (which keeps its old contents: the
        update writes into a copy, or in place where nothing else holds the old value)."""
        a = self.value(lambda v: len(v.shape) >= 1, lambda: self.new_input(rank=(1, 3)))
        if a is None or not a.shape or 0 in a.shape:
            return None
        key = self.index_key(a.shape)
        region = np.empty(a.shape)[key].shape
        b = self.leaf(region[self.int_(0, len(region)):], a.dtype, device=a.device)  # (broadcasts to the view)
        frac = None if a.frac is None or b.frac is None else max(a.frac, b.frac)
        v = self.emit(f"Tensor({a.name})", lambda env: env[a.name].copy(), a.shape, a.dtype, max(a.bound, b.bound),
                      max(a.err, b.err), frac)

        def run(env: dict[str, Any]) -> None:
            env[v.name][key] = env[b.name]

        self.prog.lines.append(f"{v.name}[{_key_src(key)}] = {b.name}")
        self.prog.refs.append(run)
        if b.name in self.prog.unsigned_zero:
            self.prog.unsigned_zero.add(v.name)
        return v

    # ------------------------------------------------------------------------------------------- linear algebra, nn
    def op_matmul(self) -> Val | None:
        a = self.value(lambda v: len(v.shape) >= 1 and v.dtype != "bool", lambda: self.new_input(rank=(1, 3)))
        if a is None or not a.shape or a.dtype == "bool":
            return None
        k = a.shape[-1]
        if len(a.shape) == 1 or self.coin(0.2):
            bshape: tuple[int, ...] = (k,)
        else:  # a matrix, with some of a's batch dims (or 1s that broadcast against them)
            batch = a.shape[:-2]
            batch = batch[len(batch) - self.int_(0, len(batch)):]
            bshape = tuple(s if self.coin(0.7) else 1 for s in batch) + (k, self.choice(DIMS))
        b = self.pick(lambda v: v.shape == bshape and v.dtype == a.dtype and v.device == a.device and v.exact)
        b = b if b is not None and self.coin() else self.leaf(bshape, a.dtype, device=a.device)
        try:
            out = np.matmul(np.zeros(a.shape), np.zeros(b.shape)).shape
        except ValueError:
            return None
        d = a.dtype
        bound = k * a.bound * b.bound
        if not self.fits(d, bound):
            return None
        err = k * (a.err * b.bound + b.err * a.bound + a.err * b.err)
        vector = len(a.shape) == len(b.shape) == 1
        sym = self.choice(["@", ".matmul", ".dot"] if vector else ["@", ".matmul"])
        src = f"{a.name} @ {b.name}" if sym == "@" else f"{a.name}{sym}({b.name})"
        return self.emit(src, lambda env: np.matmul(wide(env[a.name]), wide(env[b.name])), out, d,
                         *finish(d, bound, err, _add(a.frac, b.frac), 2.0 * k))

    def op_nn(self) -> Val | None:
        fn = self.choice(["conv2d", "max_pool2d", "avg_pool2d", "layernorm", "one_hot"])
        if fn == "one_hot":
            n = self.int_(1, 5)
            idx = self.leaf(self.shape(0, 2), self.choice(["int32", "int64"]), f"gindex:{n}")
            return self.emit(f"{idx.name}.one_hot({n})", lambda env: np.eye(n, dtype=np.int64)[env[idx.name]],
                             idx.shape + (n,), "int32", 1.0, 0.0, 0)
        if fn in ("max_pool2d", "avg_pool2d"):
            a = self.value(lambda v: len(v.shape) >= 2 and v.dtype in FLOATS and min(v.shape[-2:]) >= 2,
                           lambda: self.new_input(FLOATS, rank=(2, 4)))
            if a is None or len(a.shape) < 2 or a.dtype not in FLOATS:
                return None
            k = self.int_(1, max(1, min(a.shape[-2:])))
            *pre, h, w = a.shape
            oh, ow = h // k, w // k
            new = (*pre, oh, ow)

            def pool(env: dict[str, Any]) -> Any:
                x = _as(env[a.name], "float64")[..., :oh * k, :ow * k].reshape(*pre, oh, k, ow, k)
                return x.max(axis=(-3, -1)) if fn == "max_pool2d" else x.mean(axis=(-3, -1))

            if fn == "max_pool2d":
                return self.unsigned(self.emit(f"{a.name}.max_pool2d({k})", pool, new, a.dtype, a.bound, a.err, a.frac))
            return self.emit(f"{a.name}.avg_pool2d({k})", pool, new, a.dtype,
                             *finish(a.dtype, a.bound, a.err, None, 2.0 + k * k * 2.0**-20))
        if fn == "layernorm":
            a = self.value(lambda v: len(v.shape) >= 1 and v.dtype in FLOATS, lambda: self.new_input(FLOATS, (1, 3)))
            if a is None or not a.shape or a.dtype not in FLOATS:
                return None
            eps = self.choice([0.1, 1.0, 1e-5])
            axis_src, axes = self.axes(a)
            n = math.prod(a.shape[i] for i in axes)
            e1 = a.err + 4 * n * ulp("float32", a.bound)
            evar = 4 * a.bound * e1 + e1**2 + 4 * n * ulp("float32", a.bound**2)
            bound = min(2 * a.bound / math.sqrt(eps), math.sqrt(n))
            err = 2 * e1 / math.sqrt(eps) + math.sqrt(n) * evar / eps
            npax = tuple(axes)

            def ln(env: dict[str, Any]) -> Any:
                x = _as(env[a.name], "float64")
                y = x - x.mean(axis=npax, keepdims=True)
                return y / np.sqrt((y * y).mean(axis=npax, keepdims=True) + eps)

            return self.emit(f"{a.name}.layernorm({axis_src}, eps={eps})", ln, a.shape, a.dtype,
                             *finish(a.dtype, bound, err, None, 4))
        # conv2d on an (N, C, H, W) input
        a = self.value(lambda v: len(v.shape) == 4 and v.dtype in FLOATS, lambda: self.new_input(FLOATS, (4, 4)))
        if a is None or len(a.shape) != 4 or a.dtype not in FLOATS:
            return None
        nb, c, h, w = a.shape
        if 0 in a.shape:
            return None
        stride, pad = self.int_(1, 2), self.int_(0, 1)
        kh, kw = self.int_(1, min(3, h + 2 * pad)), self.int_(1, min(3, w + 2 * pad))
        o = self.choice((1, 2, 3))
        wt = self.leaf((o, c, kh, kw), a.dtype, device=a.device)
        bias = self.leaf((o,), a.dtype, device=a.device) if self.coin() else None
        oh, ow = (h + 2 * pad - kh) // stride + 1, (w + 2 * pad - kw) // stride + 1
        taps = c * kh * kw
        bound = taps * a.bound * wt.bound + (bias.bound if bias else 0.0)
        err = taps * a.err * wt.bound

        def conv(env: dict[str, Any]) -> Any:
            x = np.pad(_as(env[a.name], "float64"), ((0, 0), (0, 0), (pad, pad), (pad, pad)))
            k = _as(env[wt.name], "float64")
            out = np.zeros((nb, o, oh, ow))
            for i in range(kh):
                for j in range(kw):
                    patch = x[:, :, i:i + stride * (oh - 1) + 1:stride, j:j + stride * (ow - 1) + 1:stride]
                    out += np.einsum("nchw,oc->nohw", patch, k[:, :, i, j])
            if bias is not None:
                out += _as(env[bias.name], "float64").reshape(1, o, 1, 1)
            return out

        bsrc = f", {bias.name}" if bias else ""
        return self.emit(f"{a.name}.conv2d({wt.name}{bsrc}, stride={stride}, padding={pad})", conv, (nb, o, oh, ow),
                         a.dtype, *finish(a.dtype, bound, err, _add(a.frac, wt.frac), 2.0 * taps + 2))

    def op_factory(self) -> Val | None:
        fn = self.choice(["full", "ones", "zeros", "arange", "eye", "zeros_like"])
        d = self.choice(self.dtypes)
        dev = self.prog.device
        if fn == "full":
            shape = self.shape(0, 3)
            k = "f" if d in FLOATS else "i"
            if d == "bool":
                return None
            s = self.scalar(k)
            return self.emit(f"Tensor.full({shape}, {s}, dtype={d!r}, device={dev!r})",
                             lambda env: np.full(shape, env[s]), shape, d,
                             255.0 if d == "uint8" else SCALAR_MAX[k], 0.0, SCALAR_FRAC[k])  # -3 wraps to 253
        if fn in ("ones", "zeros"):
            shape = self.shape(0, 3)
            args = ", ".join(map(str, shape))
            return self.emit(f"Tensor.{fn}({args}{', ' if args else ''}dtype={d!r}, device={dev!r})",
                             lambda env: (np.ones if fn == "ones" else np.zeros)(shape), shape, d, 1.0, 0.0, 0)
        if fn == "arange":
            if d == "bool":
                return None
            start, stop, step = self.int_(-3, 3), self.int_(-3, 9), self.choice([1, 2, 3, -1])
            n = len(range(start, stop, step))
            if n == 0:
                return None
            return self.emit(f"Tensor.arange({start}, {stop}, {step}, dtype={d!r}, device={dev!r})",
                             lambda env: np.arange(start, stop, step), (n,), d, 255.0 if d == "uint8" else 9.0,
                             0.0, 0)
        if fn == "eye":
            n = self.int_(1, 4)
            return self.emit(f"Tensor.eye({n}, dtype={d!r}, device={dev!r})", lambda env: np.eye(n), (n, n), d,
                             1.0, 0.0, 0)
        a = self.value(lambda v: True)
        if a is None:
            return None
        return self.emit(f"Tensor.zeros_like({a.name})", lambda env: np.zeros(a.shape), a.shape, a.dtype, 0.0,
                         0.0, 0, device=a.device)

    def new_input(self, dtypes: tuple[str, ...] | None = None, rank: tuple[int, int] = (0, 4)) -> Val:
        allowed = [d for d in (dtypes or self.dtypes) if d in self.dtypes]
        return self.leaf(self.shape(*rank), self.choice(allowed or self.dtypes))

    def realize_early(self) -> None:
        v = self.value(lambda v: v.name.startswith("v"))
        if v is not None:
            self.prog.lines.append(f"await {v.name}.realize()")
            self.prog.refs.append(lambda env: None)

    OPS = ("arith", "unary_exact", "reduce", "movement", "compare", "where", "cast", "unary_float", "div", "minmax",
           "matmul", "take", "bitwise", "floordiv", "pow", "nn", "factory", "div_zero", "setitem")


# ---------------------------------------------------------------------------------------------------- helpers
def _add(a: int | None, b: int | None) -> int | None:
    return None if a is None or b is None else a + b


def _max(*fs: int | None) -> int | None:
    return None if any(f is None for f in fs) else max(f for f in fs if f is not None)


def _mul(f: int | None, n: int) -> int | None:
    return None if f is None else f * n


def _as(x: np.ndarray, d: str) -> np.ndarray:
    """A stored value converted to `d` (rounded as the device rounds), widened for exact reference arithmetic."""
    if d == "bool":
        return np.asarray(x).astype(bool)
    if d in FLOATS:
        return round_to(np.asarray(x).astype(np.float64), d).astype(np.float64)
    return np.asarray(x).astype(np.int64)


def _abs(x: np.ndarray, d: str) -> np.ndarray:
    """|x| as a `d` tensor computes it: an int's wraps (int8's |-128| is -128), as in numpy and PyTorch."""
    return np.abs(wide(x)).astype(np_dtype(d)) if d in INTS else np.abs(x)


def _scalar_as(v: Any, d: str) -> Any:
    """A Python scalar as an op on a `d` tensor takes it: an int wraps into an int dtype first (as in PyTorch)."""
    if d in FLOATS:
        return float(v)
    return bool(v) if d == "bool" else int(np.array(int(v)).astype(np_dtype(d)))


def _bshape(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...] | None:
    try:
        out = np.broadcast_shapes(a, b)
    except ValueError:
        return None
    return out if len(out) <= 4 and math.prod(out) <= 4096 else None


def _broadcasts(a: tuple[int, ...], b: tuple[int, ...]) -> bool:
    return _bshape(a, b) is not None


def _factor(size: int, rank: int, draw: st.DrawFn) -> tuple[int, ...] | None:
    """A random shape of `rank` dims with `size` elements (size-1 dims allowed)."""
    if rank == 0:
        return () if size == 1 else None
    if size == 0:  # a 0 somewhere, other dims of any size
        zero = draw(st.integers(0, rank - 1))
        return tuple(0 if i == zero else draw(st.integers(1, 3)) for i in range(rank))
    primes, n, p = [], size, 2
    while n > 1:
        while n % p == 0:
            primes.append(p)
            n //= p
        p += 1
    dims = [1] * rank
    for q in primes:
        dims[draw(st.integers(0, rank - 1))] *= q
    return tuple(dims)


def _np_pad(x: np.ndarray, pads: tuple[tuple[int, int], ...], value: Any) -> np.ndarray:
    crop = tuple(slice(max(0, -b), x.shape[i] - max(0, -a)) for i, (b, a) in enumerate(pads))
    x = x[crop]
    widths = tuple((max(0, b), max(0, a)) for b, a in pads)
    return np.pad(x, widths, constant_values=value) if x.ndim else x


def _key_src(key: tuple[Any, ...]) -> str:
    parts = []
    for k in key:
        if k is None:
            parts.append("None")
        elif k is Ellipsis:
            parts.append("...")
        elif isinstance(k, slice):
            text = ("" if k.start is None else str(k.start)) + ":" + ("" if k.stop is None else str(k.stop))
            parts.append(text + ("" if k.step is None else f":{k.step}"))
        else:
            parts.append(str(k))
    return ", ".join(parts) + ("," if len(parts) == 1 and not isinstance(key[0], slice | int) else "")


# ---------------------------------------------------------------------------------------------------- programs
@st.composite
def programs(draw: st.DrawFn, device: str, others: tuple[str, ...] = (), dtypes: tuple[str, ...] = DTYPES,
             max_ops: int = 14) -> Program:
    b = Builder(draw, device, others, dtypes)
    for _ in range(draw(st.integers(2, max_ops))):
        op = draw(st.sampled_from(Builder.OPS))
        v = getattr(b, "op_" + op)()
        if v is not None and op in ("reduce", "matmul", "nn"):
            b.unsigned(v)  # the sign of a zero sum is the order's: 0.0 + -0.0 or -0.0 alone (a GPU's tree sum)
        if draw(st.integers(0, 9)) == 0:
            b.realize_early()
    computed = [v for v in b.prog.vals if v.name.startswith("v")]
    while not computed:
        v = b.op_arith()
        computed = [v] if v is not None else []
    rest = [v for v in computed[:-1] if draw(st.integers(0, 3)) == 0]
    b.prog.outputs = rest + [computed[-1]]
    return b.prog


def expected(prog: Program, data: dict[str, np.ndarray], scalars: dict[str, Any]) -> dict[str, np.ndarray]:
    env: dict[str, Any] = {**data, **scalars}
    for ref in prog.refs:
        ref(env)
    return env


async def execute(prog: Program, data: dict[str, np.ndarray], scalars: dict[str, Any]) -> list[tuple[str, np.ndarray]]:
    """Build the program's graph with azyx and realize its outputs: (dtype name, values) per output."""
    import azyx
    from azyx import Tensor

    env: dict[str, Any] = {"Tensor": Tensor, "azyx": azyx, "np": np, **scalars}
    for leaf in prog.leaves:
        env[leaf.name] = Tensor(data[leaf.name], dtype=leaf.dtype, device=leaf.device)
    body = "\n".join(f"    {line}" for line in prog.lines) or "    pass"
    names = ", ".join(v.name for v in prog.outputs)
    exec(f"async def _program():\n{body}\n    return [{names}]", env)
    outs = await azyx.realize(*await env["_program"]())
    return [(t.dtype.name, await t.numpy()) for t in outs]


def compare(prog: Program, results: list[tuple[str, np.ndarray]], env: dict[str, Any]) -> None:
    """Every output has the reference's dtype, shape and values (bit-exact where the value is exact, else within
    its error bound)."""
    for v, (dtype, out) in zip(prog.outputs, results):
        ref = np.asarray(env[v.name])
        assert dtype == v.dtype, f"{v.name}: dtype {dtype}, expected {v.dtype}"
        assert out.dtype == np_dtype(v.dtype), f"{v.name}: numpy dtype {out.dtype}, expected {np_dtype(v.dtype)}"
        assert out.shape == v.shape == ref.shape, f"{v.name}: shape {out.shape}, expected {v.shape}"
        if v.name in prog.terminal:
            rtol = 2.0 ** (2 - MANTISSA[v.dtype])
            np.testing.assert_allclose(out, ref, rtol=rtol, atol=0, equal_nan=True, err_msg=v.name)
        elif v.err == 0.0:
            np.testing.assert_array_equal(out, ref, err_msg=f"{v.name} (exact)")
        else:
            o, r = out.astype(np.float64), ref.astype(np.float64)
            assert not np.isnan(o).any() and not np.isnan(r).any(), f"{v.name}: NaN\n{out}\n{ref}"
            worst = float(np.max(np.abs(o - r), initial=0.0))
            assert worst <= 2 * v.err + 1e-300, f"{v.name}: off by {worst:g} > 2 x bound {v.err:g}\n{out}\n{ref}"
