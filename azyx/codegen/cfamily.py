"""The C-family renderer: one linear pass from a `Kernel` to C99 (OpenCL C, CUDA C and GLSL are dialects).

Placement: a value is computed in the outermost loop where all of its variables are defined; values that
depend on a reduce's variables live in that reduce's loop; values that depend on upcast (register-tile)
variables are computed inside small constant-bound loops that the compiler unrolls and vectorises.

GPU-style dialects (`global_ids`) run one work item per output point. Where a reduce is long and its loads
are contiguous along it (a row sum), or there are too few outputs to fill the device, a work group of
`group_size` items reduces each output instead ("grouped"): each item accumulates a strided share, then a tree
in shared memory combines them, so neighbouring items read neighbouring addresses (see `group_size`). A row kernel
(`Kernel.rows`: a layernorm, a softmax) runs a work group per point of its global loops but the last: the group computes
its reduces so (in dependence order: the variance after the mean it reads), then its items walk the last loop's points,
each storing its own.

Facts that search actions set (codegen.search_actions) are read here as they are: `Kernel.unroll` steps of a reduce's
innermost loop per iteration (each step in braces of its own, in the loop's order: the accumulation order stays the
plain loop's), `Kernel.vector` elements per vector load and store (`vector_width`; where `vector_fits`).
"""
from __future__ import annotations

from collections.abc import Callable

from azyx.codegen.cexpr import alu_expr, combine, literal, omp_reduction
from azyx.codegen.dialect import Dialect
from azyx.codegen.launch import (
    OWN_REGION,
    along_loop,
    group_size,
    index_fits,
    parallel_kind,
    parallel_loop,
    reduce_vector_operands,
    streams,
    vector_width,
    vectorized,
    work_group,
)
from azyx.codegen.render import Emitter
from azyx.dtypes import dtypes
from azyx.ir import Kernel, V, toposort
from azyx.ops import REDUCE
from azyx.symbolic import Cond, Var


class CRenderer(Emitter):
    """One kernel in a C-family dialect (see the module docstring); codegen.cgemv renders its small-M products
    through it."""

    def __init__(self, k: Kernel, name: str, dl: Dialect, threads: int):
        super().__init__(k, name)
        self.dl, self.threads = dl, threads
        self.vec_params: set[int] = set()  # GLSL: parameters also read or written as vectors (vec_load, vec_store)
        self.vw = vector_width(k, dl)  # elements per vector access where the kernel has them
        self.uset = set(k.uvars)
        # the innermost register-tile loop is the one to vectorise (gcc may otherwise pick an outer one)
        self.simd = "#pragma omp simd"
        self.group = group_size(k, dl)
        self.it = dl.narrow_index if dl.narrow_index and index_fits(k, self.group) else dl.index_type

    def cond(self, c: Cond) -> str:
        if not self.dl.glsl:
            return c.render()
        below = "uint({x})<{n}u" if self.it == "int" else "uint64_t({x})<{n}ul"
        return c.render(below, *self.dl.bools)

    def cast(self, t: str, x: str) -> str:
        return self.dl.cast.format(t=t, x=x)

    def loop(self, v: Var, pragma: str = "", opaque: bool = False, shared: bool = False, step: int = 1) -> None:
        """A loop over `v`; `shared`: only over the caller's range of it, [lo, hi) (see parallel_loop); `step` > 1:
        over `v`_u, every `step`-th value (an unrolled loop: its body sets `v` for each of the steps)."""
        if pragma and self.dl.pragmas:
            self.emit(pragma)
        it = self.it
        bound = str(v.vmax + 1)
        if opaque and self.dl.opaque:
            bound = f"{v.name}_n"
            self.emit(f"{it} {bound} = {v.vmax + 1}; {self.dl.opaque.format(x=bound)}")
        if shared:
            self.open(f"for ({it} {v.name} = lo; {v.name} < hi; {v.name}++)")
            return
        if step > 1:
            self.open(f"for ({it} {v.name}_u = 0; {v.name}_u < {bound}; {v.name}_u += {step})")
            return
        self.open(f"for ({it} {v.name} = 0; {v.name} < {bound}; {v.name}++)")

    def literal(self, v: V) -> str:
        return literal(v.arg, v.dtype, self.dl)

    def declare(self, name: str, v: V) -> str:
        return f"{self.dl.compute_type(v.dtype)} {name} = {self.expr(v)};"

    def index_decl(self, name: str, value: str) -> str:
        return f"{self.it} {name} = {value};"

    def expr(self, v: V) -> str:
        dl = self.dl
        if v.op == "load":
            param, idx, cond = v.arg
            # A masked load (under a pad) reads a clamped, always valid index; the pad's select above it picks
            # the fill value. No conditional memory access: gcc 12 -O3 -march=native vectorises `c ? p[i] : 0`
            # wrongly when `c` depends on an outer loop.
            i = idx.render() if cond.always else f"({self.cond(cond)})?{idx.render()}:0"
            return dl.loads.get(v.dtype.name, "{buf}[{idx}]").format(buf=f"d{param}", idx=i)
        if v.op == "cond":
            return f"({self.cond(v.arg)})"
        if v.op == "cast":
            s, t = v.src[0], dl.compute_type(v.dtype)
            if v.dtype.is_bool:
                return f"({self.ref(s)}!=0)"
            if v.dtype.name in dl.rounds:  # computed in float, but rounded like the storage type
                return dl.rounds[v.dtype.name].format(x=self.ref(s))
            if s.dtype.is_float and v.dtype.is_int and v.dtype.itemsize < 8:
                # float -> narrow int through int64, then wrap: C leaves an out-of-range conversion undefined (x86
                # wraps, a GPU saturates: -2.5 -> uint8 is 254 on one, 0 on the other); numpy and PyTorch wrap
                return dl.cast.format(t=t, x=dl.cast.format(t=dl.compute_type(dtypes.int64), x=self.ref(s)))
            return dl.cast.format(t=t, x=self.ref(s))
        if v.op == "where":
            c, a, b = (self.ref(s) for s in v.src)
            return f"({c}?{a}:{b})"
        if v.op == "alu":
            e = alu_expr(v.arg, v.dtype, [self.ref(s) for s in v.src], dl, v.src[0].dtype)
            # a float16/bfloat16 result is computed in float32 but rounded like its dtype at every op, as PyTorch and
            # numpy do: else a fused value and the same value read back from a buffer differ (h == h.max() false)
            rnd = dl.rounds.get(v.dtype.name)
            return rnd.format(x=e) if rnd else e
        raise AssertionError(v.op)

    def index_stmt(self, v: V) -> None:
        x, top, it = self.ref(v.src[0]), v.arg.vmax, self.it
        if v.src[0].dtype.kind == "u":
            e = f"({x}>{top}?{top}:{x})"
        else:
            e = f"({x}<0?{x}+{top + 1}:{x})"
            e = f"({e}<0?0:({e}>{top}?{top}:{e}))"
        self.emit(f"{it} {v.arg.name} = {self.cast(it, e)};")
        self.names[id(v)] = v.arg.name
        if self.k.check >= 0:
            self.check_index(v)

    def check_index(self, v: V) -> None:
        """An index out of range (outside [-size, size)) writes the check words (ir.Kernel.check): site + 1, the
        value's low and high 32 bits, the size. Plain stores: where several are out of range, one of them is kept."""
        x, n, src, dl = self.ref(v.src[0]), v.arg.vmax + 1, v.src[0].dtype, self.dl
        i32 = dl.compute_type(dtypes.int32)
        bad = f"{x}>{n - 1}" if src.kind == "u" else f"{x}<-{n}||{x}>{n - 1}"
        lo = dl.cast.format(t=i32, x=x)
        hi = dl.cast.format(t=i32, x=f"({x}>>32)") if src.itemsize == 8 else "0" if src.kind == "u" else \
            f"({x}<0?-1:0)"
        c = f"d{self.k.check}"
        self.emit(f"if ({bad}) {{ {c}[1] = {lo}; {c}[2] = {hi}; {c}[3] = {n}; {c}[0] = {int(v.arg.name[2:]) + 1}; }}")

    def block(self, nodes: list[V], inner: Callable[[], list[str]], uvars: list[Var] | None = None) -> None:
        """Emit `nodes` (topological order) nested in upcast loops by how many upcast vars each needs, then the
        statements `inner` makes, innermost (`uvars`: those loops alone, for a reduce that needs only some)."""
        uvars = self.k.uvars if uvars is None else uvars
        depth = {id(v): max((uvars.index(u) + 1 for u in v.vars if u in self.uset), default=0) for v in nodes}
        saved = dict(self.names)
        for d in range(len(uvars) + 1):
            if d > 0:
                self.loop(uvars[d - 1], self.simd if d == len(uvars) else "")
            for v in nodes:
                if depth[id(v)] == d:
                    self.stmt(v)
        for line in inner():
            self.emit(line)
        for _ in uvars:
            self.close()
        self.names = saved  # names declared inside the block's braces go out of scope

    def placement(self, order: list[V]) -> dict[int, object]:
        """Where each value is computed (see the module docstring): id -> the global loop level (int; a reduce and
        what depends on one: the innermost), a reduce (its loop's body) or "U" (inside each block of upcast loops)."""
        k = self.k
        gindex = {v: i for i, v in enumerate(k.gvars)}
        n = len(k.gvars)
        owner: dict[Var, V] = {rv: r for r in order if r.op == "reduce" for rv in r.arg[1]}
        place: dict[int, object] = {}
        dep_red: dict[int, bool] = {}
        for v in order:
            dr = v.op == "reduce" or any(dep_red[id(s)] for s in v.src)
            dep_red[id(v)] = dr
            own = next((owner[x] for x in v.vars if x in owner), None)
            low = n - 1 if k.rows else n  # (a row kernel's reduces: before its last loop, which its items walk)
            if v.op == "reduce":
                place[id(v)] = low
            elif own is not None:
                place[id(v)] = own
            elif v.vars & self.uset:
                place[id(v)] = "U"
            else:
                place[id(v)] = max([low if dr else 0, *(gindex[x] + 1 for x in v.vars if x in gindex)])
        return place

    def render(self) -> str:
        k, dl = self.k, self.dl
        order = toposort(*k.values)
        n = len(k.gvars)
        reduces = [v for v in order if v.op == "reduce"]
        place = self.placement(order)
        shared = parallel_loop(k, dl, self.threads)
        guarded = any(v.op == "cond" or (v.op == "load" and not v.arg[2].always) for v in order)
        header = self.signature(shared, guarded)
        if k.scatter is not None:
            return self.scatter_body(order, shared, header)

        par = self._parallel_plan(reduces, place, order)
        # the innermost loop of a plain elementwise kernel vectorises along itself: left to choose, gcc vectorises the
        # loop around it instead where the inner one reads with a stride (a transposing copy: 15x slower); not where
        # loads are guarded (see C.guarded_prefix)
        simd = "#pragma omp simd" if not k.uvars and not reduces and not guarded else ""
        if simd and streams(k, dl):
            self.stream_body(order, place, shared == 0)
            return f"{dl.stream}{header} {{\n" + "\n".join(self.lines) + "\n}\n"
        it = self.it
        if self.group and self.group == dl.warp:  # a warp per output point, the group's size / warp points a group
            per = dl.group_size // dl.warp
            self.emit(f"{it} gid = {self.cast(it, dl.group_ids[0])} * {per} + ({self.cast(it, dl.group_ids[1])} / "
                      f"{dl.warp}), lid = {self.cast(it, dl.group_ids[1])} % {dl.warp};")
            self.emit(f"if (gid >= {k.points}) return;  /* whole warps return: their shuffles stay uniform */")
        elif self.group:  # one work group per point of the global loops; no early return (all reach the barriers)
            self.emit(f"{it} gid = {self.cast(it, dl.group_ids[0])}, lid = {self.cast(it, dl.group_ids[1])};")
            if dl.max_groups:  # a folded grid's groups past the last point (whole groups: before any barrier)
                self.emit(f"if (gid >= {k.points}) return;")
        elif vectorized(k, dl):  # `vw` points per work item, vector loads and stores
            self.vector_body(order, along_loop(k, order), self.vw)
            return f"{self.glsl_interface()}{header} {{\n" + "\n".join(self.lines) + "\n}\n"
        elif dl.global_ids and n:  # one work item per point of the global loops
            self.point_index(k.global_size)
        for lvl in range(n + 1):
            items = [v for v in order if place[id(v)] == lvl]
            if lvl < n:
                for v in items:
                    if v.op == "reduce":  # (a row kernel's statistics, in dependence order)
                        self.reduce_block(v, order, place, "")
                    else:
                        self.stmt(v)
                if dl.global_ids:
                    g = k.gvars[lvl]
                    if k.rows and lvl == n - 1:  # the group's items walk the row
                        self.open(f"for ({it} {g.name} = lid; {g.name} < {g.vmax + 1}; {g.name} += {self.group})")
                        continue
                    stride = 1
                    for later in k.gvars[lvl + 1 : n - 1 if k.rows else n]:
                        stride *= later.vmax + 1
                    self.emit(self.index_decl(g.name, self.unflat("gid", stride, g.vmax + 1, lvl == 0)))
                else:
                    self.loop(k.gvars[lvl], par.get(lvl, "") or (simd if lvl == n - 1 else ""), shared=lvl == shared)
                continue
            for v in items:
                if v.op == "reduce":
                    self.reduce_block(v, order, place, par.get("reduce", ""))
                else:
                    self.stmt(v)
        # epilogue: everything that depends on upcast vars, then the stores
        epi = self.collect(k.values, place, None)
        only = "if (lid == 0) " if self.group and not k.rows else ""  # the group's result is in every item: one stores
        self.block(epi, lambda: [only + self.dl.stores.get(k.params[i].name, "{buf}[{idx}] = {val};").format(
            buf=f"d{i}", idx=idx.render(), val=self.store_value(v)) for i, (idx, v) in enumerate(k.stores)])
        if k.rows:
            self.close()
        if not dl.global_ids:
            for _ in k.gvars:
                self.close()
        body = "\n".join(self.lines)
        return f"{self.glsl_interface()}{header} {{\n{body}\n}}\n"

    def stream_body(self, order: list[V], place: dict[int, object], shared: bool) -> None:
        """A `streams` kernel's loop (over [lo, hi) where `shared`) in three parts: plain stores up to the output's
        first element aligned to a streaming store (Dialect.stream), then AZYX_NT elements a step computed into an
        aligned block and stored streaming, then the tail plainly; a fence after them, so that the stores are
        ordered before the kernel (each thread's part) returns."""
        k, it, g = self.k, self.it, self.k.gvars[0].name
        first, end = ("lo", "hi") if shared else ("0", str(k.global_size))
        for v in order:
            if place[id(v)] == 0:
                self.stmt(v)
        self.emit(f"{it} nt_a = {first}, nt_e = {end};")
        self.emit("while (nt_a < nt_e && ((unsigned long)(d0 + nt_a) & (4 * AZYX_NT - 1))) nt_a++;")
        self.emit(f"{it} nt_b = nt_a + (nt_e - nt_a) / AZYX_NT * AZYX_NT;")
        (idx, value), = k.stores

        def part(lo: str, hi: str, target: str) -> None:  # one loop over [lo, hi), its output to `target`[idx]
            saved = dict(self.names)
            self.emit(self.simd)
            self.open(f"for ({it} {g} = {lo}; {g} < {hi}; {g}++)")
            for v in order:
                if place[id(v)] == 1:
                    self.stmt(v)
            self.block(self.collect(k.values, place, None), lambda: [f"{target} = {self.store_value(value)};"])
            self.close()
            self.names = saved

        part(first, "nt_a", f"d0[{idx.render()}]")
        self.open(f"for ({it} nt_s = nt_a; nt_s < nt_b; nt_s += AZYX_NT)")
        self.emit("float nt_t[AZYX_NT] __attribute__((aligned(32)));")
        part("nt_s", "nt_s + AZYX_NT", f"nt_t[{g} - nt_s]")
        self.emit("AZYX_NT_STORE(d0 + nt_s, nt_t);")
        self.close()
        part("nt_b", "nt_e", f"d0[{idx.render()}]")
        self.emit("AZYX_NT_FENCE();")

    def signature(self, shared: int | None, guarded: bool) -> str:
        """The kernel's header (GLSL: main, after which the parameters' addresses and the scalars are read)."""
        k, dl = self.k, self.dl
        if dl.glsl:
            self.emit_scalar_words()
            return "void main()"
        params = [] if shared is None else [f"{dl.index_type} lo", f"{dl.index_type} hi"]
        for i, d in enumerate(k.params):
            const = "" if k.writes(i) else "const "
            params.append(f"{dl.buffer_qual}{const}{dl.ctype(d)}* {dl.restrict} d{i}")
        params += [f"{dl.compute_type(v.dtype)} sc{i}" for i, v in enumerate(self.scalars)]
        return f"{dl.guarded_prefix if guarded else ''}{dl.kernel_prefix} {self.name}({', '.join(params)})"

    def scatter_body(self, order: list[V], shared: int | None, header: str) -> str:
        """A scatter-add (Kernel.scatter): each point of the global loops (outer: the axes before the scattered one,
        inner: those after it) owns the output's elements along the scattered axis at its coordinates, so it zeroes
        them, then adds its values in order at the rows its index reads (repeated rows accumulate): no two points
        write one element, no atomics. Host loops keep the inner axes innermost (contiguous, vectorised), inside
        the rows: a thread that shares out a loop owns its part of it for every row."""
        k, dl, it = self.k, self.dl, self.it
        j, r, zero_idx = k.scatter  # type: ignore[misc]
        outer, inner = k.gvars
        (idx, value), = k.stores
        store = dl.stores.get(k.params[0].name, "{buf}[{idx}] = {val};")
        if dl.global_ids:
            self.point_index(k.global_size)
            self.emit(f"{it} {outer.name} = gid/{inner.vmax + 1}, {inner.name} = gid%{inner.vmax + 1};")
        else:
            self.loop(outer, shared=shared == 0)
        self.loop(r)
        if not dl.global_ids:
            self.loop(inner, "#pragma omp simd" if shared != 1 else "", shared=shared == 1)
        self.emit(store.format(buf="d0", idx=zero_idx.render(), val=literal(0, k.params[0], dl)))
        self.close()
        if not dl.global_ids:
            self.close()
        self.loop(j)
        for v in order:  # what one row of the index needs, then (host) the inner loop for the rest
            if dl.global_ids or inner not in v.vars:
                self.stmt(v)
        if not dl.global_ids:
            self.loop(inner, "#pragma omp simd" if shared != 1 else "", shared=shared == 1)
            for v in order:
                if inner in v.vars:
                    self.stmt(v)
        old = dl.loads.get(k.params[0].name, "{buf}[{idx}]").format(buf="d0", idx=idx.render())
        self.emit(store.format(buf="d0", idx=idx.render(), val=f"({old}+{self.ref(value)})"))
        self.close()
        if not dl.global_ids:
            self.close()
            self.close()
        return f"{self.glsl_interface()}{header} {{\n" + "\n".join(self.lines) + "\n}\n"

    def glsl_interface(self) -> str:
        """A GLSL shader's part before main: its name (a comment, so the source names its kernel), the prelude, the
        work group size, a buffer reference type per parameter (outputs first, inputs read-only: buffers are device
        addresses, so neither a binding count nor a binding's range limits a kernel), the words buffer (binding 0:
        the parameters' addresses, then the scalars; each a 64-bit word of two uints), and shared memory."""
        if not self.dl.glsl:
            return ""
        k, dl = self.k, self.dl
        out = [dl.prelude, f"// {self.name}", f"layout(local_size_x = {work_group(k, dl)}) in;",
               "layout(std430, set = 0, binding = 0) restrict readonly buffer W { uint sw[]; };"]
        for i, d in enumerate(k.params):
            access = "restrict" if k.writes(i) else "restrict readonly"
            out.append(f"layout(buffer_reference, std430, buffer_reference_align = {d.itemsize}) {access} buffer "
                       f"B{i} {{ {dl.ctype(d)} v[]; }};")
            out.append(f"#define d{i} p{i}.v")
            if i in self.vec_params:  # the same address read a vector at a time (vector_body)
                out.append(f"layout(buffer_reference, std430, buffer_reference_align = {4 * self.vw}) {access} buffer "
                           f"Q{i} {{ {dl.vector.format(n=self.vw)} v[]; }};")
        out += self.globals
        return "\n".join(out) + "\n"

    def emit_scalar_words(self) -> None:
        """GLSL: each parameter's address, then each scalar argument, from two 32-bit words of the words buffer
        (SCALAR_CODES: a scalar's bytes, zero padded)."""
        n = len(self.k.params)
        for i in range(n):
            self.emit(f"B{i} p{i} = B{i}({self.address(i)});")
        for j, v in enumerate(self.scalars):
            t, lo, hi = self.dl.compute_type(v.dtype), f"sw[{2 * (n + j)}]", f"sw[{2 * (n + j) + 1}]"
            if v.dtype.is_float:
                x = f"packDouble2x32(uvec2({lo}, {hi}))" if v.dtype.itemsize == 8 else f"uintBitsToFloat({lo})"
            elif v.dtype.itemsize == 8:
                x = f"{t}(packUint2x32(uvec2({lo}, {hi})))"
            else:
                x = f"{t}({lo})" if v.dtype.kind != "i" or v.dtype.itemsize == 4 else f"{t}(int({lo}))"
            self.emit(f"{t} sc{j} = {x};")

    @staticmethod
    def address(i: int) -> str:
        return f"packUint2x32(uvec2(sw[{2 * i}], sw[{2 * i + 1}]))"

    def vec_ptr(self, p: int, idx: str, element: bool) -> str:
        """Where parameter `p`'s vector at `idx` lies (in vectors; in elements, a multiple of the width, where
        `element`), as an element address."""
        return f"d{p} + ({idx})" if element else f"d{p} + ({idx}) * {self.vw}"

    def vec_load(self, p: int, idx: str, element: bool = False) -> str:
        """Parameter `p` read as a vector of `vw` floats at `idx` (see vec_ptr). GLSL reads the same address through a
        buffer reference of vectors."""
        dl, vec = self.dl, self.dl.vector.format(n=self.vw)
        if dl.glsl:
            self.vec_params.add(p)
            return f"Q{p}({self.address(p)}).v[{f'({idx}) >> {self.vw.bit_length() - 1}' if element else idx}]"
        if dl.vector_load:
            return dl.vector_load.format(n=self.vw, ptr=self.vec_ptr(p, idx, element))
        const = "const " if p >= len(self.k.stores) else ""
        return f"*({dl.buffer_qual}{const}{vec}*)(d{p} + {idx})" if element else \
            f"(({dl.buffer_qual}{const}{vec}*)d{p})[{idx}]"

    def vec_store(self, p: int, idx: str, val: str) -> str:
        """A statement storing vector `val` at vector `idx` of output `p`."""
        dl = self.dl
        if dl.glsl:
            self.vec_params.add(p)
            return f"Q{p}({self.address(p)}).v[{idx}] = {val};"
        if dl.vector_store:
            return dl.vector_store.format(n=self.vw, ptr=self.vec_ptr(p, idx, False), val=val)
        return f"(({dl.buffer_qual}{dl.vector.format(n=self.vw)}*)d{p})[{idx}] = {val};"

    def point_index(self, n: int) -> None:
        it = self.it
        self.emit(f"{it} gid = {self.cast(it, self.dl.global_ids)};")
        self.emit(f"if (gid >= {n}) return;")

    def vector_let(self, p: int) -> str:
        return f"{self.dl.vector.format(n=self.vw)} l{p} = {self.vec_load(p, 'gid')};"

    def vector_var(self, i: int) -> str:
        return f"{self.dl.vector.format(n=self.vw)} s{i};"

    def vector_store(self, i: int) -> str:
        return self.vec_store(i, "gid", f"s{i}")

    def collect(self, roots: list[V], place: dict[int, object], body_of: V | None) -> list[V]:
        """Nodes of one block: those placed in it, plus per-block ("U") nodes it needs, in topological order."""
        out: list[V] = []
        seen: set[int] = set()
        for r in roots:
            self._collect(r, place, body_of, seen, out)
        return [v for v in out if v.op != "reduce"]

    def _collect(self, v: V, place: dict[int, object], body_of: V | None, seen: set[int], out: list[V]) -> None:
        # a method, not a recursive closure: that would be a reference cycle left to the cyclic GC per kernel
        if id(v) in seen:
            return
        seen.add(id(v))
        p = place.get(id(v))
        if v.op == "reduce" and v is not body_of:
            return
        if not (p == "U" or (body_of is not None and p is body_of) or (body_of is None and p is None)):
            return
        for s in v.src:
            self._collect(s, place, body_of, seen, out)
        out.append(v)

    def grouped_reduce(self, r: V, place: dict[int, object], acc_t: str, init: str, name: str) -> None:
        """The work group's items accumulate strided shares of the reduce (neighbours read neighbouring elements),
        then combine them in a tree in shared memory; every item ends with the result."""
        op, rvars = r.arg
        dl, it, size = self.dl, self.it, self.group
        comb = combine(op, r.dtype, dl)
        total = 1
        for rv in rvars:
            total *= rv.vmax + 1
        self.emit(f"{acc_t} {name} = {init};")
        if dl.unroll:
            self.emit(dl.unroll)
        body = self.collect([r.src[0]], place, r)
        vector = reduce_vector_operands(self.k, r, self.vw, body) if self.vw else None
        trip = total // self.vw if vector is not None else total  # steps of the reduce, `size` items at a time
        copies = dl.copies if trip >= dl.copies * size else 1
        if self.k.unroll > 1:  # an optimisation action chose the steps per iteration (search_actions.UNROLL)
            copies = self.k.unroll
        if dl.max_trips:  # enough steps per iteration to stay within the driver's bound
            copies = max(copies, -(-trip // (size * dl.max_trips)))
        if copies > 1:  # `copies` steps per iteration, so that their loads are in flight together
            self.open("")  # (a scope of its own: a kernel may hold several grouped reduces, a prologue's statistics)
            self.emit(f"{it} rl0 = lid;")
            self.open(f"for (; rl0 + {(copies - 1) * size} < {trip}; rl0 += {copies * size})")
            for u in range(copies):
                self.open("")
                self.emit(f"{it} rl = rl0 + {u * size};")
                self.reduce_step(r, body, vector, name, comb)
                self.close()
            self.close()
            self.open(f"for (; rl0 < {trip}; rl0 += {size})")
            self.emit(f"{it} rl = rl0;")
        else:
            self.open(f"for ({it} rl = lid; rl < {trip}; rl += {size})")
        self.reduce_step(r, body, vector, name, comb)
        self.close()
        if copies > 1:
            self.close()
        self.combine_group(r, name, comb, acc_t)

    def reduce_step(self, r: V, body: list[V], vector: set[int] | None, name: str, comb: str) -> None:
        """One step `rl` of a work item's share of a grouped reduce: an element (`vw`, in vectors), into `name`."""
        dl, it, rvars = self.dl, self.it, r.arg[1]
        along = vector or set()
        saved_step = dict(self.names)
        if vector is not None:  # `vw` elements per step, each operand read along the reduce in one vector load
            (rv,) = rvars
            w = self.vw
            self.emit(f"{it} {rv.name} = rl * {w};")
            loads = {p: v for v in body if v.op == "load" and (p := v.arg[0]) in along}
            for p, v in sorted(loads.items()):
                self.emit(f"{dl.vector.format(n=w)} l{p} = {self.vec_load(p, v.arg[1].render(), element=True)};")
            lanes: list[tuple[str, int]] = [(c, i) for i, c in enumerate("xyzw"[:w])]
        else:
            self.unflatten("rl", rvars)  # the flat index back into the reduce's own variables
            lanes = [("", 0)]
        for c, lane in lanes:
            saved = dict(self.names)
            if c:  # one lane of the vectors: its own copy of the reduce variable and of the values computed from it
                self.open("")
                self.emit(f"{it} {rvars[0].name} = rl * {self.vw} + {lane};")
                for v in body:
                    if v.op == "load" and v.arg[0] in along:
                        self.names[id(v)] = f"l{v.arg[0]}.{c}"
            for v in body:
                self.stmt(v)
            body_v = r.src[0]
            val = self.ref(body_v) if (body_v.op == "const" or id(body_v) in self.names) else self.expr(body_v)
            val = self.cast("int", val) if r.dtype.is_bool else val
            self.emit(f"{name} = {comb.format(a=name, b=val)};")
            if c:
                self.close()
            self.names = saved
        self.names = saved_step

    def combine_group(self, r: V, name: str, comb: str, acc_t: str) -> None:
        """The group's items' shares of a reduce, in `name`, combined: every item ends with the result."""
        dl, size = self.dl, self.group
        sh = f"{name}_s"
        if size == dl.warp:  # a warp per output: the butterfly leaves the result in every lane
            self._warp_tree(name, comb, acc_t)
            self.names[id(r)] = f"({name}!=0)" if r.dtype.is_bool else name
            return
        if dl.shuffle:  # within each warp by shuffles, then the warps' results in one warp
            warps = size // dl.warp
            self.declare_shared(f"{dl.shared} {acc_t} {sh}[{warps}];")
            self._warp_tree(name, comb, acc_t)
            self.emit(f"if (lid % {dl.warp} == 0) {sh}[lid / {dl.warp}] = {name};")
            self.emit(dl.barrier)
            self.emit(f"{name} = {sh}[lid % {warps}];")
            self._warp_tree(name, comb, acc_t, warps)
            self.emit(dl.barrier)  # every item has read before a later reduce of this kernel writes shared memory
        else:  # a tree in shared memory
            self.declare_shared(f"{dl.shared} {acc_t} {sh}[{size}];")
            self.emit(f"{sh}[lid] = {name};")
            self.emit(dl.barrier)
            self.open(f"for (int s = {size // 2}; s > 0; s >>= 1)")
            self.emit(f"if (lid < s) {sh}[lid] = {comb.format(a=f'{sh}[lid]', b=f'{sh}[lid+s]')};")
            self.emit(dl.barrier)
            self.close()
            self.emit(f"{name} = {sh}[0];")
        self.names[id(r)] = f"({name}!=0)" if r.dtype.is_bool else name

    def declare_shared(self, line: str) -> None:
        """Shared memory: declared where it is used, but at global scope in GLSL."""
        if self.dl.glsl:
            self.globals.append(line)
        else:
            self.emit(line)

    def _warp_tree(self, name: str, comb: str, acc_t: str, lanes: int = 0) -> None:
        """Combine `lanes` values of a warp (each lane holding one, repeating every `lanes` lanes) into every lane:
        a butterfly, each lane shuffling exactly once per step (no divergence)."""
        self.emit("#pragma unroll")
        self.open(f"for (int o = {(lanes or self.dl.warp) // 2}; o > 0; o >>= 1)")
        self.emit(f"{acc_t} other = {self.dl.shuffle.format(x=name, o='o')};")
        self.emit(f"{name} = {comb.format(a=name, b='other')};")
        self.close()

    def reduce_block(self, r: V, order: list[V], place: dict[int, object], pragma: str) -> None:
        op, rvars = r.arg
        acc_t = self.dl.compute_type(r.dtype) if not r.dtype.is_bool else "int"
        init = literal(REDUCE[op][0](r.dtype), r.dtype if not r.dtype.is_bool else dtypes.int32, self.dl)
        name = f"acc{self.count}"
        self.count += 1
        if self.group:
            self.grouped_reduce(r, place, acc_t, init, name)
            return
        # accumulators along the upcast vars the reduce depends on (a row's statistic in a product's prologue: its
        # row's alone, or one)
        uvars = [u for u in self.k.uvars if u in r.vars]
        dims = "".join(f"[{u.vmax + 1}]" for u in uvars)
        if dims:
            self.emit(f"{acc_t} {name}{dims};")
            self.block([], lambda: [f"{name}{''.join(f'[{u.name}]' for u in uvars)} = {init};"], uvars)
        else:
            self.emit(f"{acc_t} {name} = {init};")
        use_red = not dims and self.dl.pragmas
        last = rvars[-1]
        # the innermost loop unrolled `unroll` times (an optimisation action, Kernel.unroll; a divisor of its length):
        # each step in braces of its own, in the loop's order, so the accumulation order is the plain loop's
        unroll = self.k.unroll if self.k.unroll > 1 and (last.vmax + 1) % self.k.unroll == 0 else 1
        for i, rv in enumerate(rvars):
            p = ""
            if i == 0 and pragma:
                p = pragma.replace("ACC", name)
            elif i == len(rvars) - 1 and use_red:
                p = f"#pragma omp simd reduction({omp_reduction(op, r.dtype)}:{name})"
            self.loop(rv, p, opaque=bool(dims), step=unroll if rv is last else 1)
        body = self.collect([r.src[0]], place, r)
        body_v = r.src[0]
        ref = f"{name}{''.join(f'[{u.name}]' for u in uvars)}"
        comb = combine(op, r.dtype, self.dl)

        def step() -> list[str]:  # (the body value is referenced after emission inside the block)
            val = self.store_value(body_v)
            return [f"{ref} = {comb.format(a=ref, b=self.cast('int', val) if r.dtype.is_bool else val)};"]

        for j in range(unroll):
            if unroll > 1:
                self.open("")
                self.emit(f"{self.it} {last.name} = {last.name}_u + {j};")
            self.block(body, step, uvars)
            if unroll > 1:
                self.close()
        for _ in rvars:
            self.close()
        self.names[id(r)] = f"({ref}!=0)" if r.dtype.is_bool else ref

    def _parallel_plan(self, reduces: list[V], place: dict[int, object], order: list[V]) -> dict[object, str]:
        if parallel_kind(self.k, self.dl, self.threads) == OWN_REGION:
            op = reduces[0].arg[0]
            return {"reduce": f"#pragma omp parallel for simd reduction({omp_reduction(op, reduces[0].dtype)}:ACC)"}
        return {}


def render(k: Kernel, name: str, dl: Dialect, threads: int = 1) -> str:
    """Kernel `k` in dialect `dl` as one C-family function (GLSL: one shader) named `name`."""
    return CRenderer(k, name, dl, threads).render()
