"""Traced scalars: the Python numbers `azyx.jit` passes to a function it traces.

A traced float or int is a real `float`/`int` (every op that takes a Python scalar takes it) that remembers how it
was computed from the call's arguments: arithmetic on it (`lr * 0.5`, `1 - beta ** t`) gives another traced number,
and the graph keeps it where it keeps any scalar (a kernel argument bound per run). A replay computes each one again
from the new call's numbers, so the same plan runs with new values. Where Python itself decides something from the
value (a comparison, `bool()`, `int()`, an index, a hash), the decision is recorded as a guard: a replay whose
numbers decide differently traces again. Functions that read the value without asking it (`math.sqrt(x)`,
`numpy.float32(x)`) see a plain number: their result is a constant of the trace; pass such a number as an argument,
or mark the argument static. A number the function reads from an object that outlives the call (an optimiser's
`lr`, changed by a schedule between calls) is traced with `bound(obj, name)`: a replay reads the attribute again.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

Recipe = tuple  # ("arg", token, name) | ("call", fn, args)

_guards: list[list[tuple[Any, Any]]] = []  # the guard lists of the traces being recorded (innermost last)


class Traced:
    """The part a traced float and a traced int share: the recipe, arithmetic that keeps one, and guards."""

    recipe: Recipe

    def __add__(self, o: Any) -> Any: return lift(operator.add, self, o)  # noqa: E704
    def __radd__(self, o: Any) -> Any: return lift(operator.add, o, self)  # noqa: E704
    def __sub__(self, o: Any) -> Any: return lift(operator.sub, self, o)  # noqa: E704
    def __rsub__(self, o: Any) -> Any: return lift(operator.sub, o, self)  # noqa: E704
    def __mul__(self, o: Any) -> Any: return lift(operator.mul, self, o)  # noqa: E704
    def __rmul__(self, o: Any) -> Any: return lift(operator.mul, o, self)  # noqa: E704
    def __truediv__(self, o: Any) -> Any: return lift(operator.truediv, self, o)  # noqa: E704
    def __rtruediv__(self, o: Any) -> Any: return lift(operator.truediv, o, self)  # noqa: E704
    def __floordiv__(self, o: Any) -> Any: return lift(operator.floordiv, self, o)  # noqa: E704
    def __rfloordiv__(self, o: Any) -> Any: return lift(operator.floordiv, o, self)  # noqa: E704
    def __mod__(self, o: Any) -> Any: return lift(operator.mod, self, o)  # noqa: E704
    def __rmod__(self, o: Any) -> Any: return lift(operator.mod, o, self)  # noqa: E704
    def __pow__(self, o: Any) -> Any: return lift(operator.pow, self, o)  # noqa: E704
    def __rpow__(self, o: Any) -> Any: return lift(operator.pow, o, self)  # noqa: E704
    def __neg__(self) -> Any: return lift(operator.neg, self)  # noqa: E704
    def __pos__(self) -> Any: return self  # noqa: E704
    def __abs__(self) -> Any: return lift(operator.abs, self)  # noqa: E704

    # Python decides from the value: a replay must decide the same
    def __eq__(self, o: Any) -> bool: return guarded(operator.eq, self, o)  # noqa: E704
    def __ne__(self, o: Any) -> bool: return guarded(operator.ne, self, o)  # noqa: E704
    def __lt__(self, o: Any) -> bool: return guarded(operator.lt, self, o)  # noqa: E704
    def __le__(self, o: Any) -> bool: return guarded(operator.le, self, o)  # noqa: E704
    def __gt__(self, o: Any) -> bool: return guarded(operator.gt, self, o)  # noqa: E704
    def __ge__(self, o: Any) -> bool: return guarded(operator.ge, self, o)  # noqa: E704
    def __bool__(self) -> bool: return guarded(bool, self)  # noqa: E704
    def __hash__(self) -> int: return guarded(hash, self)  # noqa: E704
    def __round__(self, n: Any = None) -> Any: return guarded(round, self) if n is None else guarded(round, self, n)  # noqa: E704,E501


class TracedFloat(Traced, float):  # type: ignore[misc]  # pow: any number here
    def __new__(cls, value: float, recipe: Recipe) -> TracedFloat:
        self = float.__new__(cls, value)
        self.recipe = recipe
        return self

    def __int__(self) -> int: return guarded(int, self)  # noqa: E704
    def __float__(self) -> float: return plain(self)  # noqa: E704
    def __repr__(self) -> str: return f"traced({float.__repr__(self)})"  # noqa: E704


class TracedInt(Traced, int):  # type: ignore[misc]  # pow: any number here
    def __new__(cls, value: int, recipe: Recipe) -> TracedInt:
        self = int.__new__(cls, value)
        self.recipe = recipe
        return self

    def __index__(self) -> int: return guarded(int, self)  # noqa: E704  (a shape, an index, a range)
    def __int__(self) -> int: return guarded(int, self)  # noqa: E704
    def __float__(self) -> float: return float(int.__int__(self))  # noqa: E704
    def __repr__(self) -> str: return f"traced({int.__repr__(self)})"  # noqa: E704


def plain(x: Any) -> Any:
    """The number itself, not traced."""
    if isinstance(x, TracedFloat):
        return float.__float__(x)
    if isinstance(x, TracedInt):
        return int.__int__(x)
    return x


def make(value: Any, recipe: Recipe) -> Any:
    """`value` traced by `recipe` (a bool result, which no type can extend, is guarded instead)."""
    if hasattr(value, "item") and not isinstance(value, Traced):  # a numpy scalar
        value = value.item()
    if type(value) is float:
        return TracedFloat(value, recipe)
    if type(value) is int:
        return TracedInt(value, recipe)
    _guard(("call", lambda *a: a[0], (make_raw(recipe),)), value)
    return value


def bound(obj: Any, name: str) -> Any:
    """`obj.name`, a number that a trace reads again on each replay: a setting changed between calls, such as an
    optimiser's learning rate that a schedule decays, is a kernel argument of the trace, not a constant of it (nor a
    reason to trace again). Outside a trace, and for a value that is not a number or is traced already (set from an
    argument inside the function), the value itself."""
    value = getattr(obj, name)
    if not _guards or isinstance(value, Traced | bool) or not isinstance(value, int | float):
        return value
    return make(value, ("call", getattr, (obj, name)))


def make_raw(recipe: Recipe) -> Any:
    """An object standing for `recipe` in another recipe (for a value that is not a number)."""
    return _Raw(recipe)


class _Raw:
    def __init__(self, recipe: Recipe):
        self.recipe = recipe


def lift(fn: Callable[..., Any], *args: Any) -> Any:
    """fn(*args); traced (its recipe: this call) when any argument is."""
    value = fn(*(plain(a) for a in args))
    if not any(isinstance(a, Traced | _Raw) for a in args):
        return value
    return make(value, ("call", fn, args))


def guarded(fn: Callable[..., Any], *args: Any) -> Any:
    """fn(*args), a decision from traced values: recorded so that a replay checks it decides the same."""
    value = fn(*(plain(a) for a in args))
    _guard(("call", fn, args), value)
    return value


def _guard(recipe: Recipe, value: Any) -> None:
    if _guards:
        _guards[-1].append((recipe, value))


def evaluate(x: Any, token: object, values: dict[Any, Any], memo: dict[int, Any] | None = None) -> Any:
    """What traced `x` is for the call whose numbers are `values` (argument name -> number) in the trace `token`;
    a traced number of another trace is the constant it was. `memo` (id -> value, for one call: the traced numbers
    are alive meanwhile) computes a number that several others derive from once (an optimiser's `1 - beta`)."""
    if not isinstance(x, Traced | _Raw):
        return x
    cache = memo if isinstance(x, Traced) else None  # (not a _Raw made for one guard: its id is reused)
    if cache is not None and id(x) in cache:
        return cache[id(x)]
    recipe = x.recipe
    if recipe[0] == "arg":
        value = values[recipe[2]] if recipe[1] is token else plain(x)
    else:
        _, fn, args = recipe
        value = fn(*[evaluate(a, token, values, memo) for a in args])
    if cache is not None:
        cache[id(x)] = value
    return value


def structure(x: Any) -> Any:
    """A key equal for traced numbers computed the same way from the same sources (every kernel that takes an
    optimiser's rate casts it anew: one number, computed once per replay)."""
    if isinstance(x, Traced | _Raw):
        recipe = x.recipe
        if recipe[0] == "arg":
            return ("arg", id(recipe[1]), recipe[2])
        return (recipe[1], *[structure(a) for a in recipe[2]])
    try:
        hash(x)
    except TypeError:
        return ("object", id(x))
    return (type(x), x)


def evaluate_recipe(recipe: Recipe, token: object, values: dict[Any, Any], memo: dict[int, Any] | None = None) -> Any:
    return evaluate(_Raw(recipe), token, values, memo)


class recording:
    """The guards of one trace: Python decisions made from its traced numbers while it runs."""

    def __init__(self) -> None:
        self.guards: list[tuple[Recipe, Any]] = []

    def __enter__(self) -> list[tuple[Recipe, Any]]:
        _guards.append(self.guards)
        return self.guards

    def __exit__(self, *exc: Any) -> None:
        _guards.remove(self.guards)
