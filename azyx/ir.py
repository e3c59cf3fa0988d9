"""The kernel IR: one loop nest with a value DAG, which every renderer turns into source in one pass.

A `Kernel` writes, for every point of its global loops (`gvars`, outer first), each of its `stores`: a value at an
index of an output parameter (outputs are the first parameters; a kernel with several is a multi-output kernel).
Upcast vars (`uvars`) are small register-tile loops, innermost. A `V` of op "reduce" is an accumulation loop over its
own vars, placed inside the innermost global loop. Values are interned, so equal expressions are one object (common
subexpressions are computed once).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from azyx.dtypes import DType
from azyx.symbolic import Cond, Dyn, Lin, Var, lin_dyns, lin_vars


class V:
    """A value: op is one of const, arg, load, cond, alu, cast, where, reduce, index. An `arg` is a scalar the plan
    binds at run time (a Python number of the graph: values are data, not source); its arg is the plan's scalar index.
    An `index` is an integer value used as an address (a gather's row): its arg is the `Dyn` atom that indices
    (`Lin`) hold for it, its source the integer read; a load or cond whose index holds one has it among its sources."""

    __slots__ = ("op", "dtype", "src", "arg", "vars", "has_reduce")

    def __init__(self, op: str, dtype: DType, src: tuple[V, ...], arg: Any, vars: frozenset[Var], has_reduce: bool):
        self.op, self.dtype, self.src, self.arg, self.vars, self.has_reduce = op, dtype, src, arg, vars, has_reduce

    def __repr__(self) -> str:
        return f"V({self.op}, {self.dtype.name}, {self.arg!r})"


class ValueBuilder:
    """Interns values so that equal expressions are the same object."""

    def __init__(self) -> None:
        self.cache: dict[tuple, V] = {}
        self.n_index = 0

    def _v(self, key: tuple, op: str, dtype: DType, src: tuple[V, ...], arg: Any, vars: frozenset[Var],
           has_reduce: bool = False) -> V:
        v = self.cache.get(key)
        if v is None:
            v = self.cache[key] = V(op, dtype, src, arg, vars, has_reduce or any(s.has_reduce for s in src))
        return v

    def const(self, value: Any, dtype: DType) -> V:
        return self._v(("const", value, type(value), dtype), "const", dtype, (), value, frozenset())

    def arg(self, index: int, dtype: DType) -> V:
        """The plan's scalar `index` (a kernel parameter, bound on every run)."""
        return self._v(("arg", index, dtype), "arg", dtype, (), index, frozenset())

    def load(self, param: int, dtype: DType, idx: Lin, cond: Cond) -> V:
        vs = frozenset(lin_vars(idx) | cond.vars())
        return self._v(("load", param, idx.key, cond.key), "load", dtype, _dyn_src(idx, cond), (param, idx, cond), vs)

    def cond(self, c: Cond, dtype: DType) -> V:
        return self._v(("cond", c.key), "cond", dtype, _dyn_src(Lin({}), c), c, frozenset(c.vars()))

    def index(self, x: V, size: int, what: str = "gather") -> Dyn:
        """The address atom of integer value `x` along an axis of `size` elements (wrapped and clamped, see Dyn), read
        by op `what`."""
        key = ("index", id(x), size)
        v = self.cache.get(key)
        if v is None:
            dyn = Dyn(None, f"ix{self.n_index}", size, what)
            self.n_index += 1
            v = self._v(key, "index", x.dtype, (x,), dyn, x.vars)
            dyn.v = v
        return v.arg

    def alu(self, op: str, dtype: DType, *src: V) -> V:
        vs = frozenset().union(*(s.vars for s in src))
        return self._v(("alu", op, dtype, *map(id, src)), "alu", dtype, src, op, vs)

    def cast(self, x: V, dtype: DType) -> V:
        if x.dtype is dtype:
            return x
        if x.op == "const":
            return self.const(_cast_scalar(x.arg, dtype), dtype)
        return self._v(("cast", id(x), dtype), "cast", dtype, (x,), None, x.vars)

    def where(self, c: V, a: V, b: V) -> V:
        if c.op == "const":
            return a if c.arg else b
        if a is b:
            return a
        return self._v(("where", id(c), id(a), id(b)), "where", a.dtype, (c, a, b), None, c.vars | a.vars | b.vars)

    def reduce(self, op: str, dtype: DType, body: V, rvars: tuple[Var, ...]) -> V:
        vs = body.vars - frozenset(rvars)
        return self._v(("reduce", op, dtype, id(body), rvars), "reduce", dtype, (body,), (op, rvars), vs, True)

    def attention(self, spec: Attention, dtype: DType, scale: V) -> V:
        """The whole output of an attention kernel (see `Attention`): its one source is the scale."""
        return self._v(("attention", spec, dtype, id(scale)), "attention", dtype, (scale,), spec, frozenset(), True)


@dataclass(frozen=True)
class Attention:
    """An attention kernel's shape, which codegen.templates.attention renders whole: for each point of the batch axes,
    out (L, Ev) = softmax(q (L, E) @ k (S, E)^T * scale + mask (L, S)) @ v (S, Ev), the output contiguous. Each operand
    is read where it lies: its element offset, then its strides along the batch axes (0 where broadcast), then along
    its two axes. Parameters: the output, q, k, v, then the mask where there is one."""

    batch: tuple[int, ...]
    L: int
    S: int
    E: int
    Ev: int
    q: tuple[int, ...]
    k: tuple[int, ...]
    v: tuple[int, ...]
    mask: tuple[int, ...] | None  # (a bool mask: True keeps a key; else added to the scores)
    mask_bool: bool
    causal: bool  # query i attends to keys 0..i
    # the decode form (templates.attention_decode, a few query rows against a long cache): the keys of each query row
    # cut into `splits` chunks; stage 1 computes each chunk's maximum, sum and weighted values (the output itself where
    # there is one chunk), stage 2 combines the chunks. 0: the whole kernel (templates.attention)
    splits: int = 0
    stage: int = 0
    # k and v's first batch axis read through an int32 index into a table of this many rows (a KV cache's slots, each
    # batch point's row gathered in the kernel): the parameter after the mask, then the check words where checked.
    # 0: none
    gather: int = 0

    @property
    def batch_size(self) -> int:
        out = 1
        for b in self.batch:
            out *= b
        return out


def attention_of(k: Kernel) -> Attention | None:
    """The attention that `k` computes whole (one store of an "attention" value), else None."""
    v = k.stores[0][1] if len(k.stores) == 1 else None
    return v.arg if v is not None and v.op == "attention" else None


def _dyn_src(idx: Lin, cond: Cond) -> tuple[V, ...]:
    """The `index` values an address depends on: a load or cond at it comes after them."""
    dyns = lin_dyns(idx)
    for x, _, _ in cond.facts:
        dyns += [d for d in lin_dyns(x) if d not in dyns]
    return tuple(d.v for d in dyns)


def has_index(k: Kernel) -> bool:
    """Whether `k` reads or writes at an address loaded from memory (a gather, a scatter), or writes only part of its
    output (an assignment)."""
    return k.scatter is not None or k.inplace or any(v.op == "index" for v in toposort(*k.values))


def index_sites(k: Kernel) -> list[V]:
    """The integer values `k` reads as addresses (its `index` values), in the order of their sites (ix0, ix1, ...)."""
    return sorted((v for v in toposort(*k.values) if v.op == "index"), key=lambda v: int(v.arg.name[2:]))


CHECK_WORDS = 4  # int32 check words of a run on a device: site + 1 (0: no error), the value's low and high words, size


def _cast_scalar(v: Any, dtype: DType) -> Any:
    if dtype.is_bool:
        return bool(v)
    if dtype.is_int:
        return int(v)
    return float(v)


@dataclass
class Kernel:
    params: list[DType]  # parameters 0 .. len(stores)-1 are the outputs, the rest are read
    gvars: list[Var]
    uvars: list[Var]
    stores: list[tuple[Lin, V]]  # per output parameter, in order: the index written and the value written there
    work: int = 0  # iterations of the innermost loops, for launch decisions
    # a scatter-add (its one store adds into the output at an index read from memory): (j, r, zero index). Each
    # point of the global loops zeroes the output at the zero index for every r, then, for j in order, adds its
    # value at the store's index; the points own disjoint elements (see codegen.cfamily's scatter_body)
    scatter: tuple[Var, Var, Lin] | None = None
    inplace: bool = False  # it writes part of its output, whose other elements it leaves as they are (an ASSIGN)
    # schedule choices that optimisation actions set (codegen.search_actions.apply); renderers read them as facts
    local: int = 0  # GPU-style, one work item per point: work items per group (0: the dialect's `block`)
    group: int = -1  # work items that reduce each output point together (0: one item per point, -1: the dialect's)
    variant: int = 0  # a template's variant: a matrix product's block sizes (gemm_host.HOST_BLOCKS; GPU: gemm tiles)
    unroll: int = 0  # steps of each reduce's innermost loop per iteration (0, 1: as the dialect does)
    vector: int = -1  # float32 elements per vector load and store (1: none; -1: the dialect's default width)
    # the parameter (the last, int32) of the run's check words, where the kernel checks the indices it reads from
    # memory (-1: it does not): an index out of range still reads clamped, and writes CHECK_WORDS words there
    # (site + 1, the value's low and high 32 bits, the axis size), which the run's record reads when its work is done
    check: int = -1
    # a row kernel (schedule.KernelBuild.rows): a work group per point of the global loops but the last, which computes
    # the reduces (none moves with the last loop: statistics of the row, a layernorm's mean and variance) once, then its
    # work items walk the last loop's points (GPU-style dialects with `Dialect.rows`)
    rows: bool = False
    base: Kernel | None = field(default=None, repr=False, compare=False)  # the kernel before the actions
    opts: tuple = ()  # the actions (search_actions.Opt) that made it from `base`

    def writes(self, i: int) -> bool:
        """Whether the kernel writes parameter `i` (an output, or its check words)."""
        return i < len(self.stores) or i == self.check

    @property
    def global_size(self) -> int:
        out = 1
        for v in self.gvars:
            out *= v.vmax + 1
        return out

    @property
    def points(self) -> int:
        """The points that a work item (a work group, of a row kernel: Kernel.rows) each computes the kernel at."""
        return self.global_size // (self.gvars[-1].vmax + 1) if self.rows else self.global_size

    @property
    def values(self) -> list[V]:
        """The values stored, then the addresses loaded from memory that the stores' indices hold."""
        out = [v for _, v in self.stores]
        for idx, _ in self.stores:
            out += [d.v for d in lin_dyns(idx) if d.v not in out]
        return out


def scalar_args(k: Kernel) -> list[V]:
    """The kernel's scalar parameters (its `arg` values) in parameter order: first use in topological order, so the
    source names them by position and kernels that differ only in which plan scalars they read are one program."""
    return [v for v in toposort(*k.values) if v.op == "arg"]


def toposort(*roots: V) -> list[V]:
    """Every value the roots depend on, each after its sources."""
    order: list[V] = []
    seen: set[int] = set()
    stack: list[tuple[V, bool]] = [(r, False) for r in reversed(roots)]
    while stack:
        v, done = stack.pop()
        if done:
            order.append(v)
            continue
        if id(v) in seen:
            continue
        seen.add(id(v))
        stack.append((v, True))
        for s in reversed(v.src):
            if id(s) not in seen:
                stack.append((s, False))
    return order


def format_kernel(k: Kernel) -> str:
    """A readable dump of a kernel's loops and value DAG (AZYX_DEBUG=8)."""
    loops = " ".join(f"{v.name}<{v.vmax + 1}" for v in k.gvars)
    ups = " ".join(f"{v.name}<{v.vmax + 1}" for v in k.uvars)
    lines = [f"kernel params={[d.name for d in k.params]} loops=[{loops}]" + (f" upcast=[{ups}]" if ups else "") +
             (" (a group per row)" if k.rows else "")]
    names: dict[int, str] = {}
    for i, v in enumerate(toposort(*k.values)):
        names[id(v)] = f"%{i}"
        src = ", ".join(names[id(s)] for s in v.src)
        if v.op == "load":
            param, idx, cond = v.arg
            arg = f"d{param}[{idx.render()}]" + ("" if cond.always else f" if {cond.render()}")
        elif v.op == "reduce":
            arg = f"{v.arg[0]} over {' '.join(f'{r.name}<{r.vmax + 1}' for r in v.arg[1])}"
        elif v.op == "cond":
            arg = v.arg.render()
        elif v.op == "arg":
            arg = f"scalar {v.arg}"
        elif v.op == "index":
            arg = f"{v.arg.name} < {v.arg.vmax + 1}"
        else:
            arg = "" if v.arg is None else repr(v.arg)
        parts = [f"  %{i} = {v.op} {v.dtype.name}", arg, f"({src})" if src else ""]
        lines.append(" ".join(p for p in parts if p))
    lines += [f"  store d{i}[{idx.render()}] = {names[id(v)]}" for i, (idx, v) in enumerate(k.stores)]
    return "\n".join(lines)
