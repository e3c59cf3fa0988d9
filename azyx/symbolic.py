"""Integer index arithmetic with bounds: the algebra that turns movement ops into cheap index expressions.

An index is a `Lin`: a constant plus integer multiples of atoms (`Var` loop counters, `Div` and `Mod` of
indices by positive constants). Construction simplifies with the atoms' bounds, so a reshape that merely
splits or merges dimensions leaves no division behind. Division and modulo follow floor semantics; every
index that reaches memory is non-negative, where floor and C's truncation agree.
"""

from __future__ import annotations

import math
from functools import cached_property
from typing import Any, Union

Index = Union["Lin", int]


class Atom:
    """A term that `Lin` cannot look inside: a loop variable, or a division/modulo of an index."""

    vmin: int
    vmax: int
    __slots__ = ()

    def render(self) -> str:
        raise NotImplementedError


class Var(Atom):
    __slots__ = ("name", "vmin", "vmax")

    def __init__(self, name: str, size: int):
        self.name, self.vmin, self.vmax = name, 0, size - 1

    def __repr__(self) -> str:
        return self.name

    def render(self) -> str:
        return self.name


class Div(Atom):
    __slots__ = ("x", "n", "vmin", "vmax", "_key")

    def __init__(self, x: Lin, n: int):
        self.x, self.n = x, n
        self.vmin, self.vmax = x.vmin // n, x.vmax // n
        self._key = ("d", x.key, n)

    def __eq__(self, o: object) -> bool:
        return isinstance(o, Div) and o._key == self._key

    def __hash__(self) -> int:
        return hash(self._key)

    def render(self) -> str:
        return f"({self.x.render()}/{self.n})"


class Mod(Atom):
    __slots__ = ("x", "n", "vmin", "vmax", "_key")

    def __init__(self, x: Lin, n: int):
        self.x, self.n = x, n
        self.vmin, self.vmax = (x.vmin, x.vmax) if 0 <= x.vmin and x.vmax < n else (0, n - 1)
        self._key = ("m", x.key, n)

    def __eq__(self, o: object) -> bool:
        return isinstance(o, Mod) and o._key == self._key

    def __hash__(self) -> int:
        return hash(self._key)

    def render(self) -> str:
        return f"({self.x.render()}%{self.n})"


class Dyn(Atom):
    """An index read from memory (a gather's row): the kernel value `v` (an ir.V of op "index"), which the kernel
    computes as a local variable `name`, wrapped (-size <= x < 0 counts from the end) and clamped into [0, size), so
    a load at it never leaves its buffer whatever the index buffer holds. `what` names the op that reads it (gather,
    scatter, assign), for the error that a checked kernel raises for an index out of range (ir.Kernel.check)."""

    __slots__ = ("v", "name", "vmin", "vmax", "_key", "what")

    def __init__(self, v: Any, name: str, size: int, what: str = "gather"):
        self.v, self.name, self.vmin, self.vmax, self.what = v, name, 0, size - 1, what
        self._key = ("x", name, size)

    def __eq__(self, o: object) -> bool:
        return isinstance(o, Dyn) and o._key == self._key

    def __hash__(self) -> int:
        return hash(self._key)

    def __repr__(self) -> str:
        return self.name

    def render(self) -> str:
        return self.name


class Lin:
    """const + sum(coeff * atom), immutable, normalised on construction."""

    __slots__ = ("terms", "const", "__dict__")

    def __init__(self, terms: dict[Atom, int], const: int = 0):
        self.terms = {a: c for a, c in terms.items() if c != 0}
        self.const = const

    @staticmethod
    def of(x: Index | Atom) -> Lin:
        if isinstance(x, Lin):
            return x
        if isinstance(x, int):
            return Lin({}, x)
        return Lin({x: 1})

    @cached_property
    def key(self) -> tuple:
        return (self.const, frozenset((id(a) if isinstance(a, Var) else a, c) for a, c in self.terms.items()))

    @cached_property
    def vmin(self) -> int:
        return self.const + sum(c * (a.vmin if c > 0 else a.vmax) for a, c in self.terms.items())

    @cached_property
    def vmax(self) -> int:
        return self.const + sum(c * (a.vmax if c > 0 else a.vmin) for a, c in self.terms.items())

    @property
    def is_const(self) -> bool:
        return not self.terms

    def __repr__(self) -> str:
        return self.render()

    def __add__(self, o: Index) -> Lin:
        o = Lin.of(o)
        terms = dict(self.terms)
        for a, c in o.terms.items():
            terms[a] = terms.get(a, 0) + c
        return _recombine(Lin(terms, self.const + o.const))

    __radd__ = __add__

    def __sub__(self, o: Index) -> Lin:
        return self + Lin.of(o) * -1

    def __mul__(self, k: int) -> Lin:
        assert isinstance(k, int)
        if k == 0:
            return Lin({}, 0)
        return Lin({a: c * k for a, c in self.terms.items()}, self.const * k)

    __rmul__ = __mul__

    def __floordiv__(self, n: int) -> Lin:
        assert isinstance(n, int) and n > 0
        if n == 1:
            return self
        if 0 <= self.vmin and self.vmax < n:
            return Lin({}, 0)
        # floor((n*q + r) / n) == q + floor(r / n) for integers: split every coefficient into n*q + r
        q = {a: c // n for a, c in self.terms.items() if c // n != 0}
        rest = Lin({a: c % n for a, c in self.terms.items() if c % n != 0}, self.const % n)
        out = Lin(q, self.const // n)
        if rest.is_const or (0 <= rest.vmin and rest.vmax < n):
            return out
        g = math.gcd(n, *rest.terms.values(), rest.const)
        if g > 1:
            return out + Lin({a: c // g for a, c in rest.terms.items()}, rest.const // g) // (n // g)
        if len(rest.terms) == 1 and rest.const == 0:
            (a, c), = rest.terms.items()
            if c == 1 and isinstance(a, Div):  # (x // m) // n == x // (m*n)
                return out + a.x // (a.n * n)
        return out + Lin({Div(rest, n): 1})

    def __mod__(self, n: int) -> Lin:
        assert isinstance(n, int) and n > 0
        if n == 1:
            return Lin({}, 0)
        rest = Lin({a: c % n for a, c in self.terms.items() if c % n != 0}, self.const % n)
        if rest.is_const:
            return rest
        if 0 <= rest.vmin and rest.vmax < n:
            return rest
        if len(rest.terms) == 1 and rest.const == 0:
            (a, c), = rest.terms.items()
            if c == 1 and isinstance(a, Mod) and a.n % n == 0:  # (x % (k*n)) % n == x % n
                return a.x % n
        return Lin({Mod(rest, n): 1})

    def render(self) -> str:
        parts = [a.render() if c == 1 else f"{a.render()}*{c}" for a, c in self.terms.items()]
        if self.const or not parts:
            parts.append(str(self.const))
        return parts[0] if len(parts) == 1 else "(" + "+".join(parts).replace("+-", "-") + ")"


def _recombine(x: Lin) -> Lin:
    """Fold (y // n) * n*c + (y % n) * c back into y * c, which merged loops produce."""
    mods = [(a, c) for a, c in x.terms.items() if isinstance(a, Mod)]
    for m, c in mods:
        d = m.x // m.n
        if len(d.terms) == 1 and d.const == 0:
            (da, dc), = d.terms.items()
            if x.terms.get(da, 0) * dc == c * m.n and dc > 0 and x.terms.get(da, 0) != 0:
                terms = dict(x.terms)
                del terms[m], terms[da]
                return Lin(terms, x.const) + m.x * c
    return x


def const(v: int) -> Lin:
    return Lin({}, v)


def var(v: Var) -> Lin:
    return Lin({v: 1})


class Cond:
    """A conjunction of `lo <= index < hi` facts (a mask from pads); simplified with bounds."""

    __slots__ = ("facts", "never")

    def __init__(self, facts: tuple[tuple[Lin, int, int], ...] = (), never: bool = False):
        self.facts, self.never = facts, never

    def add(self, x: Lin, lo: int, hi: int) -> Cond:
        if self.never:
            return self
        if x.vmax < lo or x.vmin >= hi:
            return Cond((), True)
        if x.vmin >= lo and x.vmax < hi:
            return self
        return Cond(self.facts + ((x, lo, hi),))

    @property
    def always(self) -> bool:
        return not self.never and not self.facts

    @property
    def key(self) -> tuple:
        return (self.never, tuple((x.key, lo, hi) for x, lo, hi in self.facts))

    def render(self, below: str = "(unsigned long)({x})<{n}ul", false: str = "0", true: str = "1") -> str:
        """C-family text; a two-sided fact is one unsigned compare, `below` (x - lo as unsigned, below hi - lo)."""
        if self.never:
            return false
        parts: list[str] = []
        for x, lo, hi in self.facts:
            if x.vmin >= lo:
                parts.append(f"{x.render()}<{hi}")
            elif x.vmax < hi:
                parts.append(f"{x.render()}>={lo}")
            else:
                parts.append(below.format(x=(x - lo).render(), n=hi - lo))
        return "&&".join(parts) if parts else true

    def vars(self) -> set[Var]:
        return {v for x, _, _ in self.facts for v in lin_vars(x)}


def lin_vars(x: Lin) -> set[Var]:
    out: set[Var] = set()
    for a in x.terms:
        if isinstance(a, Var):
            out.add(a)
        elif isinstance(a, Dyn):
            out |= a.v.vars
        else:
            out |= lin_vars(a.x)  # type: ignore[attr-defined]
    return out


def lin_dyns(x: Lin) -> list[Dyn]:
    """The indices read from memory that `x` depends on, each once (the values a load at `x` must follow)."""
    out: list[Dyn] = []
    for a in x.terms:
        if isinstance(a, Dyn):
            out.append(a)
        elif isinstance(a, Div | Mod):
            out += [d for d in lin_dyns(a.x) if d not in out]
    return out


def count_divmod(x: Lin) -> int:
    return sum((1 + count_divmod(a.x)) if isinstance(a, Div | Mod) else 0 for a in x.terms)
