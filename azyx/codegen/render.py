"""What every renderer of the IR shares: the text it builds (`Emitter`: indented lines, statement names, the per-lane
loop of a vectorised kernel, a flat index split back into loop variables) and a kernel's name and program source.
The C family (codegen.cfamily) and WGSL (codegen.wgsl) are subclasses spelling what their languages write
differently."""

from __future__ import annotations

import hashlib

from azyx.codegen.dialect import Dialect
from azyx.ir import Kernel, V, scalar_args
from azyx.symbolic import Var


class Emitter:
    """One kernel's body as lines (`lines`, at `depth`), the names its values have (`names`: id -> text, scalars
    first), declarations a language keeps outside the entry point (`globals`). Subclasses give `literal`, `expr`,
    `declare` (a value's statement) and `index_decl` (an integer variable's)."""

    spaced = False  # binary operators of index math with spaces around them (WGSL's style)

    def __init__(self, k: Kernel, name: str):
        self.k, self.name = k, name
        self.scalars = scalar_args(k)  # by-value parameters after the buffers, bound on every run
        self.names: dict[int, str] = {id(v): f"sc{i}" for i, v in enumerate(self.scalars)}
        self.lines: list[str] = []
        self.globals: list[str] = []  # declarations outside the entry point (GLSL, WGSL: shared memory)
        self.depth = 1
        self.count = 0

    # ------------------------------------------------------------------ text
    def emit(self, line: str) -> None:
        self.lines.append("  " * self.depth + line)

    def open(self, line: str) -> None:
        self.emit(line + " {")
        self.depth += 1

    def close(self) -> None:
        self.depth -= 1
        self.emit("}")

    def fresh(self, prefix: str) -> str:
        """A new statement name (`v3`, `acc4`): one counter for all of them."""
        name = f"{prefix}{self.count}"
        self.count += 1
        return name

    # ------------------------------------------------------------------ values
    def literal(self, v: V) -> str:
        raise NotImplementedError

    def expr(self, v: V) -> str:
        raise NotImplementedError

    def declare(self, name: str, v: V) -> str:
        raise NotImplementedError

    def index_decl(self, name: str, value: str) -> str:
        raise NotImplementedError

    def index_stmt(self, v: V) -> None:
        raise NotImplementedError

    def point_index(self, n: int) -> None:
        """Declare `gid`, the work item's point of `n`, and return from items past the last."""
        raise NotImplementedError

    def vector_let(self, p: int) -> str:
        """The statement reading parameter `p`'s vector at `gid` into `l{p}`."""
        raise NotImplementedError

    def vector_var(self, i: int) -> str:
        """The declaration of output `i`'s vector `s{i}`."""
        raise NotImplementedError

    def vector_store(self, i: int) -> str:
        """The statement storing `s{i}` as output `i`'s vector at `gid`."""
        raise NotImplementedError

    def ref(self, v: V) -> str:
        if v.op == "const":
            return self.literal(v)
        return self.names[id(v)]

    def store_value(self, v: V) -> str:
        """A value where it is used once more (a store, a reduce's step): its name, or its expression inline."""
        return self.ref(v) if (v.op == "const" or id(v) in self.names) else self.expr(v)

    def stmt(self, v: V) -> None:
        """The statement that computes `v` (once: later uses read its name)."""
        if v.op in ("const", "reduce") or id(v) in self.names:
            return
        if v.op == "index":  # an address read from memory: wrapped from the end, then clamped into its buffer
            self.index_stmt(v)
            return
        name = self.fresh("v")
        self.emit(self.declare(name, v))
        self.names[id(v)] = name

    def unflat(self, flat: str, stride: int, size: int, outermost: bool) -> str:
        """A loop variable of `size` values from a flat index whose later variables take `stride` values together."""
        sp = " " if self.spaced else ""
        at = flat if stride == 1 else f"({flat}{sp}/{sp}{stride})"
        return at if outermost else f"{at}{sp}%{sp}{size}"

    def unflatten(self, flat: str, rvars: tuple[Var, ...]) -> None:
        """Declare each of `rvars` (outer first) from the flat index `flat` over all of them."""
        inner = 1
        for rv in reversed(rvars):
            n = rv.vmax + 1
            self.emit(self.index_decl(rv.name, self.unflat(flat, inner, n, rv is rvars[0])))
            inner *= n

    def vector_body(self, order: list[V], along: set[int], w: int) -> None:
        """A plain elementwise float32 kernel over one loop (launch.vectorized), `w` points per work item: each
        parameter `along` the loop read as one vector, each output stored as one, the body computed per lane (other
        loads, broadcast ones, stay per lane)."""
        k = self.k
        self.point_index(k.global_size // w)
        for p in sorted(along - set(range(len(k.stores)))):
            self.emit(self.vector_let(p))
        for i in range(len(k.stores)):
            self.emit(self.vector_var(i))
        self.lanes(order, along, k.gvars[0], w)
        for i in range(len(k.stores)):
            self.emit(self.vector_store(i))

    def lanes(self, order: list[V], along: set[int], g: Var, w: int) -> None:
        """The body of a vectorised elementwise kernel once per lane of its `w`-wide vectors: the lane's point of loop
        `g`, the loads of parameters `along` the loop read from vectors `l{p}`, each output into its vector `s{i}`."""
        for lane, c in enumerate("xyzw"[:w]):
            self.open("")
            self.emit(self.index_decl(g.name, f"gid * {w} + {lane}"))
            saved = dict(self.names)
            for v in order:
                if v.op == "load" and v.arg[0] in along:
                    self.names[id(v)] = f"l{v.arg[0]}.{c}"
            for v in order:
                self.stmt(v)
            for i, (_, v) in enumerate(self.k.stores):
                self.emit(f"s{i}.{c} = {self.store_value(v)};")
            self.names = saved
            self.close()


def kernel_source(kernels: list[str], dl: Dialect) -> str:
    """A program's source: the dialect's prelude, then its kernels."""
    return dl.prelude + "\n" + "\n".join(kernels)


def kernel_name(src: str, prefix: str = "k") -> str:
    """A kernel's name: a hash of its source, so equal kernels share one compiled program."""
    return f"{prefix}_{hashlib.sha256(src.encode()).hexdigest()[:16]}"
