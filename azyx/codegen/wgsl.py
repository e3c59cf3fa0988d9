"""The WGSL renderer: one linear pass from a `Kernel` to a WebGPU compute shader (WGSL is not C-family: typed
`let`s, `select` for `?:`, `var<storage>` bindings, no 8/16-bit storage, 64-bit types only behind adapter features).

Shader interface (the contract with `backends/wgpu.py`): the parameters' storage arrays are the bindings of group 0 in
order (outputs read_write, inputs read), one each, or several consecutive ranges of one buffer where a parameter
reaches past the adapter's storage binding size (`bindings`); where the kernel has scalar arguments, the binding after
them is a uniform array of vec4<u32>, scalar j in words 2j and 2j+1 (a 64-bit word each, low first:
`dtypes.SCALAR_CODES`), so a new value compiles nothing. Launch geometry comes from `launch.launch_for` with the facts
of `dialect.WGSL` (one work item per output point, or a work group per point for long reductions; grids past 65535
groups fold into a second dimension), so it is decided once, as for every other GPU dialect.

Dtypes (`dialect.WGSL_TYPES`, one row each): 32-bit types are native; bool, int8, uint8, int16, float16 and bfloat16 are
stored packed in u32 words (byte addressed, as every other backend stores them) and computed in i32 or f32, rounded
or wrapped to their own type after every op: that is exact (it is what C does to a narrow type at each assignment).
Packed outputs are written with two atomics per element (and-clear, or-set), since neighbours share a word. int64 and
float64 need the adapter features `shader-int64` and `shader-f64`; without them a kernel that uses them raises a
DTypeError naming the dtype, the device and the feature.

NaN tests look at the bits (`isnan32`, `isnan64`): naga renders `!=` of floats as an ordered compare (false for NaN),
and a driver that assumes no NaNs (NVIDIA's, without SPIR-V's float controls, which WGSL cannot ask for) may fold
`x == x` to true. Reduce loops are unrolled where a driver bounds a shader's loop iterations (`launch.loop_steps`).
"""

from __future__ import annotations

from dataclasses import replace

from azyx.codegen.dialect import WGSL, WGSL_TYPES
from azyx.codegen.launch import Launch, along_loop, group_size, index_fits, launch_for, loop_steps, vectorized
from azyx.codegen.preludes import WGSL_ISNAN64, WGSL_PRELUDE, WGSL_PRELUDE_F64, WGSL_PRELUDE_I64
from azyx.codegen.render import kernel_name
from azyx.codegen.wgsl_expr import WgslValues, combine, literal, wtype
from azyx.dtypes import dtypes
from azyx.errors import DTypeError, ShapeError
from azyx.ir import Kernel, V, toposort
from azyx.ops import REDUCE

# plain elementwise float32 kernels: four points per work item (Kernel.vector: 2 or 4), each operand along the loop
# bound as vectors
WGSL_VEC = replace(WGSL, vector="vec{n}<f32>", vector_width=4, block=256)

# math functions by name, per compute type where they differ (float64 has its own routines)
class _Renderer(WgslValues):
    """One kernel's WGSL: the entry point's body (`lines`), then the interface before it (`interface`), which knows
    the dtypes, helpers and workgroup memory the body used."""

    spaced = True

    def __init__(self, k: Kernel, name: str, device: str, features: frozenset[str], max_binding: int,
                 max_trips: int):
        assert not k.uvars, "WGSL kernels have no register tiles (the device says tiles = False)"
        super().__init__(k, name)
        self.device, self.features = device, features
        self.types = [wtype(d, device, features) for d in k.params]
        self.chunks = bindings(k, max_binding)
        self.group = group_size(k, WGSL)
        # (a parameter split into ranges past the binding size keeps scalar accessors; so does an output also read)
        reread = any(v.op == "load" and v.arg[0] < len(k.stores) for v in toposort(*k.values))
        self.dl = WGSL_VEC if vectorized(k, WGSL_VEC) and all(n == 1 for n, _ in self.chunks) and not reread \
            else WGSL
        self.vec_params = along_loop(k, toposort(*k.values)) | set(range(len(k.stores))) \
            if self.dl is WGSL_VEC else set()
        self.vw = vectorized(k, WGSL_VEC) if self.dl is WGSL_VEC else 0
        # steps per reduce loop iteration: what the driver's bound needs, or more where the kernel asks (Kernel.unroll)
        self.unroll = max(loop_steps(k, self.group, max_trips), k.unroll)
        if not index_fits(k, self.group):
            raise ShapeError(f"{device}: a kernel of {k.global_size} points indexes past 2**31 elements (WGSL indices "
                             "are i32)")
        self.used = set()  # dtypes the kernel computes in

    def literal(self, v: V) -> str:
        self.ct(v.dtype)
        return literal(v.arg, v.dtype)

    def declare(self, name: str, v: V) -> str:
        return f"let {name}: {self.ct(v.dtype)} = {self.expr(v)};"

    def index_decl(self, name: str, value: str) -> str:
        return f"let {name} = {value};"

    # ------------------------------------------------------------------ values
    def load(self, param: int, idx: str) -> str:
        if self.types[param].pack == 1 and self.chunks[param][0] == 1:
            return f"d{param}[{idx}]"
        return f"ld{param}({idx})"

    def expr(self, v: V) -> str:
        if v.op == "load":
            param, idx, cond = v.arg
            i = idx.render() if cond.always else f"select(0, {idx.render()}, {self.cond(cond)})"
            self.ct(v.dtype)
            return self.load(param, i)
        if v.op == "cond":
            return f"({self.cond(v.arg)})"
        if v.op == "cast":
            return self.cast(v.src[0], v.dtype)
        if v.op == "where":
            c, a, b = (self.ref(s) for s in v.src)
            return f"select({b}, {a}, {c})"
        if v.op == "alu":
            return self.rounded(v.dtype, self.alu(v.arg, v.dtype, [self.ref(s) for s in v.src], v.src[0].dtype))
        raise AssertionError(v.op)

    # ------------------------------------------------------------------ statements
    def index_stmt(self, v: V) -> None:
        x, top, t = self.ref(v.src[0]), v.arg.vmax, self.ct(v.src[0].dtype)
        if v.src[0].dtype.kind == "u":
            e = f"min({x}, {t}({top}))"
        else:
            e = f"clamp(select({x}, {x} + {t}({top + 1}), {x} < {t}(0)), {t}(0), {t}({top}))"
        self.emit(f"let {v.arg.name}: i32 = i32({e});")
        self.names[id(v)] = v.arg.name
        if self.k.check >= 0:  # (an index out of range writes the check words: see cfamily's check_index)
            n, c = top + 1, f"d{self.k.check}"
            bad = f"{x} > {t}({top})" if v.src[0].dtype.kind == "u" else f"{x} < {t}(-{n}) || {x} > {t}({top})"
            lo = f"bitcast<i32>(u32({x} & 4294967295li))" if t == "i64" else f"i32({x})"
            hi = f"i32({x} >> 32u)" if t == "i64" else "0" if t == "u32" else f"select(0, -1, {x} < {t}(0))"
            self.emit(f"if ({bad}) {{ {c}[1] = {lo}; {c}[2] = {hi}; {c}[3] = {n}; "
                      f"{c}[0] = {int(v.arg.name[2:]) + 1}; }}")

    def body_of(self, r: V, place: dict[int, object], order: list[V]) -> list[V]:
        """The values computed inside reduce `r`'s loop, in topological order."""
        return [v for v in order if place.get(id(v)) is r and v.op != "reduce"]

    def reduce(self, r: V, place: dict[int, object], order: list[V]) -> None:
        op, rvars = r.arg
        acc_d = dtypes.int32 if r.dtype.is_bool else r.dtype
        acc_t = self.ct(acc_d)
        init = literal(REDUCE[op][0](r.dtype), acc_d)
        name = f"acc{self.count}"
        self.count += 1
        comb = combine(op, acc_d)
        self.emit(f"var {name}: {acc_t} = {init};")
        total = 1
        for rv in rvars:
            total *= rv.vmax + 1
        step, u = self.group or 1, self.unroll
        start = "i32(lid)" if self.group else "0"
        if u == 1:
            self.open(f"for (var rl = {start}; rl < {total}; rl += {step})")
        else:  # `u` steps per iteration (a driver that bounds a shader's loop iterations: see `loop_steps`)
            self.open(f"for (var rb = {start}; rb < {total}; rb += {step * u})")
        for i in range(u):
            saved = dict(self.names)
            if u > 1:
                self.open("" if i == 0 else f"if (rb + {i * step} < {total})")
                self.emit(f"let rl = rb + {i * step};")
            self.unflatten("rl", rvars)  # the flat index back into the reduce's own variables
            for v in self.body_of(r, place, order):
                self.stmt(v)
            val = self.store_value(r.src[0])
            if r.dtype.is_bool:
                val = f"select(0i, 1i, {val})"
            self.emit(f"{name} = {comb.format(a=name, b=val)};")
            if u > 1:
                self.close()
            self.names = saved
        self.close()
        if self.group:  # a tree in workgroup memory; every item ends with the result
            sh = f"{name}_s"
            self.globals.append(f"var<workgroup> {sh}: array<{acc_t}, {self.group}>;")
            self.emit(f"{sh}[lid] = {name};")
            self.emit("workgroupBarrier();")
            self.open(f"for (var s = {self.group // 2}u; s > 0u; s >>= 1u)")
            self.emit(f"if (lid < s) {{ {sh}[lid] = {comb.format(a=f'{sh}[lid]', b=f'{sh}[lid + s]')}; }}")
            self.emit("workgroupBarrier();")
            self.close()
            self.emit(f"{name} = {sh}[0];")
            self.emit("workgroupBarrier();")  # every item has read before a later reduce of this kernel writes
        self.names[id(r)] = f"({name} != 0i)" if r.dtype.is_bool else name

    def render(self) -> str:
        k = self.k
        order = toposort(*k.values)
        reduces = [v for v in order if v.op == "reduce"]
        owner = {rv: r for r in reduces for rv in r.arg[1]}
        place: dict[int, object] = {}  # id -> the reduce whose loop computes it (absent: the top level)
        for v in order:
            own = next((owner[x] for x in v.vars if x in owner), None)
            if v.op != "reduce" and own is not None:
                place[id(v)] = own
        self.scalar_values()
        if k.scatter is not None:
            self.scatter_body(order)
            return self.entry()
        if self.vec_params:
            self.vector_body(order, self.vec_params, self.vw)
            return self.entry()
        n = max(k.points, 1)
        if self.group:  # a work group per output point; no early return before the barriers but whole groups'
            self.emit("let gid = i32(wg.x + wg.y * nwg.x);")
            self.emit(f"if (gid >= {n}) {{ return; }}")
        else:
            self.point_index(n)
        gvars = k.gvars[:-1] if k.rows else k.gvars  # (a row kernel: a group per row, whose items walk the last)
        stride = 1
        strides = []
        for g in reversed(gvars):
            strides.append(stride)
            stride *= g.vmax + 1
        for lvl, (g, s) in enumerate(zip(gvars, reversed(strides))):
            self.emit(self.index_decl(g.name, self.unflat("gid", s, g.vmax + 1, lvl == 0)))
        last = k.gvars[-1] if k.rows else None
        for v in order:  # (a row kernel's statistics first, then the row's points)
            if id(v) in place or last is not None and last in v.vars:
                continue
            if v.op == "reduce":
                self.reduce(v, place, order)
            else:
                self.stmt(v)
        if last is not None:
            self.open(f"for (var {last.name} = i32(lid); {last.name} < {last.vmax + 1}; {last.name} += {self.group})")
            for v in order:
                if id(v) not in place and last in v.vars:
                    self.stmt(v)
        only = "if (lid == 0u) " if self.group and last is None else ""
        for i, (idx, v) in enumerate(k.stores):
            val = self.store_value(v)
            if self.types[i].pack == 1 and self.chunks[i][0] == 1:
                self.emit(f"{only}{{ d{i}[{idx.render()}] = {val}; }}")
            else:
                self.emit(f"{only}{{ st{i}({idx.render()}, {val}); }}")
        if last is not None:
            self.close()
        return self.entry()

    def point_index(self, n: int) -> None:
        self.emit(f"let gid = i32(gi.x + gi.y * nwg.x * {self.work_group()}u);")
        self.emit(f"if (gid >= {n}) {{ return; }}")

    def vector_let(self, p: int) -> str:
        return f"let l{p} = d{p}[gid];"

    def vector_var(self, i: int) -> str:
        return f"var s{i}: vec{self.vw}<f32>;"

    def vector_store(self, i: int) -> str:
        return f"d{i}[gid] = s{i};"

    def scatter_body(self, order: list[V]) -> None:
        """A scatter-add (Kernel.scatter), as cfamily's: each point of the global loops (outer, inner: the axes before
        and after the scattered one) owns the output's elements along the scattered axis at its coordinates, zeroes
        them, then adds its values in order at the rows its index reads (no two points write one element)."""
        k = self.k
        j, r, zero_idx = k.scatter  # type: ignore[misc]
        outer, inner = k.gvars
        (idx, value), = k.stores
        if self.types[0].pack != 1 or self.chunks[0][0] != 1:
            raise DTypeError(f"{self.device}: a scatter-add into {k.params[0].name} (a packed or split binding) is not "
                             "supported by the WGSL renderer")
        self.point_index(max(k.global_size, 1))
        self.emit(f"let {outer.name} = gid / {inner.vmax + 1}; let {inner.name} = gid % {inner.vmax + 1};")
        self.open(f"for (var {r.name} = 0; {r.name} < {r.vmax + 1}; {r.name}++)")
        self.emit(f"d0[{zero_idx.render()}] = {literal(0, k.params[0])};")
        self.close()
        self.open(f"for (var {j.name} = 0; {j.name} < {j.vmax + 1}; {j.name}++)")
        for v in order:
            self.stmt(v)
        self.emit(f"d0[{idx.render()}] = d0[{idx.render()}] + {self.store_value(value)};")
        self.close()

    def entry(self) -> str:
        return self.interface() + f"@compute @workgroup_size({self.work_group()})\n" \
            f"fn {self.name}(@builtin(global_invocation_id) gi: vec3<u32>, @builtin(workgroup_id) wg: vec3<u32>, " \
            f"@builtin(local_invocation_index) lid: u32, @builtin(num_workgroups) nwg: vec3<u32>) {{\n" + \
            "\n".join(self.lines) + "\n}\n"

    def work_group(self) -> int:
        return launch_for(self.k, self.dl).group

    def scalar_values(self) -> None:
        """Each scalar argument from its 64-bit word of the uniform words (two u32s, low first)."""
        for j, v in enumerate(self.scalars):
            t = self.ct(v.dtype)
            lo, hi = f"sw[{j // 2}][{(j % 2) * 2}]", f"sw[{j // 2}][{(j % 2) * 2 + 1}]"
            word = f"(u64({lo}) | (u64({hi}) << 32u))"  # (naga types bitcast<f64>(vec2<u32>) as vec2<f32>)
            if t in ("f64", "i64") and "shader-int64" not in self.features:
                raise DTypeError(f"{self.device}: a {v.dtype.name} scalar argument needs the WebGPU adapter feature "
                                 "'shader-int64', which this adapter lacks")
            if t == "f64":
                x = f"bitcast<f64>({word})"
            elif t == "f32":
                x = f"bitcast<f32>({lo})"  # (float16 and bfloat16 scalars come as float32: SCALAR_CODES)
            elif t == "i64":
                x = f"bitcast<i64>({word})"
            elif t == "u32":
                x = lo
            elif t == "bool":
                x = f"({lo} != 0u)"
            else:
                x = self.rounded(v.dtype, f"bitcast<i32>({lo})")
            self.emit(f"let sc{j}: {t} = {x};")

    def interface(self) -> str:
        """The part before the entry point: its name, the helpers, the bindings (and packed parameters' accessors),
        the words, workgroup memory."""
        k = self.k
        out = [f"// {self.name}"]
        out.append(WGSL_PRELUDE)  # (wgpu enables f64 and i64 by device feature: no `enable` directive)
        if "int64" in self.used:
            out.append(WGSL_PRELUDE_I64)
        if "float64" in self.used:
            out.append(WGSL_ISNAN64["shader-int64" in self.features] + WGSL_PRELUDE_F64)
        binding = 0
        for i, (t, (n, per)) in enumerate(zip(self.types, self.chunks)):
            write = k.writes(i)
            elem = f"atomic<{t.storage}>" if write and t.pack > 1 else t.storage
            if i in self.vec_params:
                elem = f"vec{self.vw}<f32>"
            for c in range(n):
                out.append(f"@group(0) @binding({binding}) var<storage, {'read_write' if write else 'read'}> "
                           f"{_array(i, c, n)}: array<{elem}>;")
                binding += 1
            per //= t.element_size
            if t.pack == 1:
                if n > 1 and write:
                    out.append(f"fn st{i}(i: i32, v: {t.compute}) {{ {_chunked(i, n, per, 'i', '{a}[{j}] = v;')} }}")
                elif n > 1:
                    out.append(f"fn ld{i}(i: i32) -> {t.compute} {{ {_chunked(i, n, per, 'i', 'return {a}[{j}];')} }}")
                continue
            bits = 32 // t.pack
            shift = f"(u32(i) & {t.pack - 1}u) * {bits}u"
            word = f"u32(i) >> {t.pack.bit_length() - 1}u"
            mask = f"0x{(1 << bits) - 1:x}u"
            if write:
                body = _chunked(i, n, per, "w", "atomicAnd(&{a}[{j}], keep); atomicOr(&{a}[{j}], bits);")
                out.append(f"fn st{i}(i: i32, v: {t.compute}) {{ let w = {word}; let s = {shift}; let keep = ~({mask} "
                           f"<< s); let bits = ({t.packs.format(x='v')} & {mask}) << s; {body} }}")
            else:
                out.append(f"fn rd{i}(w: u32) -> u32 {{ {_chunked(i, n, per, 'w', 'return {a}[{j}];')} }}")
                raw = f"((rd{i}({word}) >> ({shift})) & {mask})"
                out.append(f"fn ld{i}(i: i32) -> {t.compute} {{ return {t.unpack.format(x=raw)}; }}")
        if self.scalars:
            out.append(f"@group(0) @binding({binding}) var<uniform> sw: array<vec4<u32>, "
                       f"{-(-len(self.scalars) // 2)}>;")
        out += self.globals
        return "\n".join(line for line in out if line) + "\n"


def bindings(k: Kernel, max_binding: int) -> list[tuple[int, int]]:
    """Per parameter of `k`: how many storage bindings it takes and the bytes of each (but the last, which binds the
    rest of the buffer). A parameter whose elements reach past `max_binding` bytes (the adapter's storage binding
    size: 128 MiB on lavapipe) is bound as consecutive ranges of one buffer, which the shader's accessors pick by
    index; the ranges start at multiples of 256 bytes (WebGPU's largest offset alignment)."""
    reach = [0] * len(k.params)
    for i, (idx, _) in enumerate(k.stores):
        reach[i] = max(reach[i], idx.vmax + 1)
    for v in toposort(*k.values):
        if v.op == "load":
            reach[v.arg[0]] = max(reach[v.arg[0]], v.arg[1].vmax + 1)
    chunk = max_binding // 256 * 256
    out = []
    for d, n in zip(k.params, reach):
        t = WGSL_TYPES[d.name]
        nbytes = -(-n // t.pack) * t.element_size
        out.append((1, max_binding) if nbytes <= max_binding else (-(-nbytes // chunk), chunk))
    return out


def _array(param: int, chunk: int, chunks: int) -> str:
    return f"d{param}" if chunks == 1 else f"d{param}_{chunk}"


def _chunked(param: int, n: int, per: int, index: str, body: str) -> str:
    """Statements doing `body` ({a}: the array, {j}: the index in it) on element `index` of a parameter bound as `n`
    ranges of `per` elements each."""
    if n == 1:
        return body.format(a=f"d{param}", j=index)
    parts = [f"let c = {index} / {per}; let j = {index} - c * {per};"]
    for c in range(n - 1):
        parts.append(f"if (c == {c}) {{ {body.format(a=_array(param, c, n), j='j')} return; }}"
                     if "return" not in body else f"if (c == {c}) {{ {body.format(a=_array(param, c, n), j='j')} }}")
    parts.append(body.format(a=_array(param, n - 1, n), j="j"))
    return " ".join(parts)


def render_wgsl(k: Kernel, device: str, features: frozenset[str], max_binding: int = 1 << 62, max_trips: int = 0
                ) -> tuple[str, str, Launch]:
    """(name, source, launch) of a kernel as a WGSL compute shader for a device with adapter `features`, storage
    bindings of up to `max_binding` bytes and at most `max_trips` loop iterations per work item (0: no bound); the
    entry point is the kernel's name, which hashes the source."""
    r = _Renderer(k, "KERNEL", device, features, max_binding, max_trips)
    body = r.render()
    name = kernel_name(body, "w")
    return name, body.replace("KERNEL", name), launch_for(k, r.dl)
