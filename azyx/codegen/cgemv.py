"""templates.gemv's small-M product in a C-family dialect that takes it (Dialect.small_products: CUDA C, and GLSL on a
Vulkan GPU; OpenCL C renders too, off on PoCL's CPU device): a block of `Gemv.threads` items owns a slab of C's columns
for all M rows.

1. Row phase: each value the prologue needs per row alone (a layernorm's mean and reciprocal deviation, the statistics
   reduced by the whole block as the generic grouped reduce does) is computed once per row into shared memory.
2. For each chunk of KC elements of K, the block computes A(i, r) (the prologue) for every row into shared memory,
   each element once, then streams the weight: `x @ W.T` (W contiguous along K): each warp owns `cols_per_warp`
   columns and its lanes read consecutive 16-byte vectors along K; `x @ W` (W contiguous along N): `lanes_along_n`
   items read a row's ROW_BYTES of the slab's columns in 16-byte vectors, the others step down K. Every weight
   element is multiplied by the M rows' staged values in float32 (a float16 / bfloat16 product is not rounded before
   it is summed, as cuBLAS does).
3. The items' partial sums combine by warp shuffles (and shared memory across warps), and each output point runs the
   epilogue (bias, activation, residual: any expression of the sum and loads at the point) and stores.
"""

from __future__ import annotations

from azyx.codegen.cfamily import CRenderer
from azyx.codegen.dialect import Dialect
from azyx.codegen.launch import index_fits, work_group
from azyx.codegen.templates.gemv import WARP, Gemv, above
from azyx.ir import Kernel, V, toposort

REGISTERS = 160  # float registers an item's streaming loop may hold (accumulators, weight and staged elements)


class _GemvRenderer(CRenderer):
    def __init__(self, k: Kernel, name: str, dl: Dialect, g: Gemv):
        super().__init__(k, name, dl, 1)
        assert dl.small_products
        self.shuffles = bool(dl.shuffle)  # (of 32 lanes where there are any: Dialect.small_products)
        self.g = g
        self.items = g.threads
        self.shared_decls: list[str] = []
        self.let = "" if dl.glsl else "const "  # (a GLSL const is a compile-time constant)
        self.vec = dl.vector.format(n=4)
        self.group = g.threads  # the row statistics: reduced by the whole block (grouped_reduce)
        self.it = dl.narrow_index if dl.narrow_index and index_fits(k, g.threads) else dl.index_type

    def render(self) -> str:
        k, dl, g, it = self.k, self.dl, self.g, self.it
        order = toposort(*k.values)
        place = self.placement(order)
        guarded = any(v.op == "cond" or (v.op == "load" and not v.arg[2].always) for v in order)
        # (the compiler keeps each item's registers within what a block of `items` may hold)
        header = self.signature(None, guarded).replace(dl.kernel_prefix, dl.kernel_prefix + dl.bounds.format(
            n=self.items), 1)
        self.emit(f"{self.let}{it} blk = {self.cast(it, dl.group_ids[0])}, lid = {self.cast(it, dl.group_ids[1])};")
        if dl.max_groups and g.grid()[0] > dl.max_groups:  # (a folded grid: its groups past the last, whole, first)
            self.emit(f"if (blk >= {g.grid()[0]}) return;")
        if g.groups > 1:  # (a group of rows per block of a slab: its first row i0, its rows mr)
            self.emit(f"{self.let}{it} slab = blk % {g.slabs}, i0 = (blk / {g.slabs}) * {g.mb};")
            if g.ragged:
                self.emit(f"{self.let}{it} mr = min({self.cast(it, str(g.mb))}, {self.cast(it, str(g.m))} - i0);")
        self.emit(f"{self.let}{it} lane = lid % {WARP}, warp = lid / {WARP}, "
                  f"j0 = {'slab' if g.groups > 1 else 'blk'} * {g.block_cols};")
        wj = f"warp * {g.cols_per_warp}" if g.along_k else f"(lid % {g.lanes_along_n}) * {g.vec}"
        self.emit(f"{self.let}{it} wj = j0 + {wj};  /* the item's first column */")
        prefetched = self.prefetch_steps()
        if prefetched:
            self.prefetch(prefetched)
        frontier = self.frontier()
        self.row_phase(frontier, order, place)
        cols = g.cols_per_warp if g.along_k else g.vec
        kc = g.chunk
        self.declare_shared(f"{dl.align.format(n=16)}{dl.shared} float xs[{g.mb}][{kc}];")
        self.emit(f"float pacc[{g.mb}][{cols}];")
        self.each("pacc[m][c] = 0.0f;", cols)
        self.open(f"for ({it} k0 = 0; k0 < {g.k}; k0 += {kc})")
        # (one chunk: a constant bound, so the compiler unrolls the streaming loop and keeps its loads in flight)
        bound = f"{g.k};" if kc >= g.k else f"min({self.cast(it, str(kc))}, {self.cast(it, str(g.k))} - k0);"
        self.emit(f"{self.let}{it} kn = {bound}")
        self.emit(dl.barrier)  # (the previous chunk read by every item before it is overwritten)
        self.stage(frontier, kc)
        self.emit(dl.barrier)
        self.stream(prefetched)
        self.close()
        self.combine()
        self.epilogue()
        # (GLSL: the interface is written last, once the shared arrays and vector views are known)
        interface = self.glsl_interface().replace(f"local_size_x = {work_group(k, dl)})",
                                                  f"local_size_x = {self.items})")
        return f"{interface}{header} {{\n" + "\n".join(self.shared_decls + self.lines) + "\n}\n"

    def declare_shared(self, line: str) -> None:
        """Shared memory at the kernel's outermost scope (OpenCL requires it; the statistics' are declared in the rows'
        loop)."""
        if self.dl.glsl:
            self.globals.append(line)
        else:
            self.shared_decls.append("  " + line)

    def unroll(self, steps: int = 0) -> None:
        """A pragma unrolling the next loop (`steps` times; 0: whole), where the dialect has one."""
        if self.dl.unroll:
            self.emit(f"#pragma unroll {steps}" if steps else "#pragma unroll")

    def each(self, stmt: str, cols: int) -> None:
        """`stmt` for every row m and accumulator column c, in loops the compiler unrolls (the accumulators stay in
        registers)."""
        for line in (f"for (int m = 0; m < {self.g.mb}; m++)", f"  for (int c = 0; c < {cols}; c++) {stmt}"):
            self.unroll()
            self.emit(line)

    def steps(self, acc: int, per_step: int) -> int:
        """Iterations of the streaming loop unrolled (their weight loads in flight together: a product of a few MB is
        bound by round trips to memory, not by bandwidth), within REGISTERS for the accumulators and each
        iteration's weight and staged elements (NVRTC sm_90, M = 16, x @ W.T in half: 255 registers at 4 steps)."""
        budget = min(REGISTERS, (1 << 16) // self.items - 24)  # (24: addresses, indices, the loop)
        return max(1, min(16, (budget - acc) // per_step))

    # ------------------------------------------------------------------ prologue
    def frontier(self) -> list[V]:
        """The values of A that do not move with r (per row, or per kernel) but are computed (a row's statistics and
        what is derived from them, a load of the row alone): the row phase computes each once per row."""
        g, out, seen = self.g, [], set()
        for v in toposort(self.g.a):
            if g.rv not in v.vars:
                continue
            for s in v.src:
                if g.rv not in s.vars and s.op not in ("const", "arg") and (s.vars or s.has_reduce) \
                        and id(s) not in seen:
                    seen.add(id(s))
                    out.append(s)
        return out

    @property
    def mr(self) -> str:
        """The block's rows (`Gemv.mb`; fewer in the last group of rows)."""
        return "mr" if self.g.ragged else str(self.g.mb)

    def rows(self, local: str) -> None:
        """Declare the row loops' variables from the block's row `local` (the block's first row i0 added)."""
        if self.g.rows:
            self.unflatten(f"(i0 + {local})" if self.g.groups > 1 else local, self.g.rows)

    def row_phase(self, frontier: list[V], order: list[V], place: dict[int, object]) -> None:
        """Each frontier value for each row into shared memory (rw0, rw1, ...): where the dialect shuffles, a warp per
        row (the rows' statistics at once: a row at a time, each reduce's round trips to memory and barriers add up,
        16 rows' layernorm 64 of them), else the whole block row by row (its barriers uniform)."""
        if not frontier:
            return
        dl, g, it = self.dl, self.g, self.it
        for n, _ in enumerate(frontier):
            self.declare_shared(f"{dl.shared} float rw{n}[{g.mb}];")
        saved, group = dict(self.names), self.group
        by_warp = self.shuffles
        if by_warp:
            self.open(f"for ({it} m = warp; m < {self.mr}; m += {self.items // WARP})")
            self.emit(f"{self.let}{it} lid = lane;  /* the warp's item: the statistics are reduced by the warp */")
            self.group = WARP
        else:
            self.open(f"for ({it} m = 0; m < {self.mr}; m++)")
        first = "lane" if by_warp else "lid"
        self.rows("m")
        for v in toposort(*frontier):
            if isinstance(place.get(id(v)), V):  # inside a statistic's body: its reduce emits it
                continue
            if v.op == "reduce":
                self.reduce_block(v, order, place, "")
            else:
                self.stmt(v)
        for n, f in enumerate(frontier):
            self.emit(f"if ({first} == 0) rw{n}[m] = {self.store_value(f)};")
        self.close()
        self.names, self.group = saved, group
        self.emit(dl.barrier)

    def stage(self, frontier: list[V], kc: int) -> None:
        """A(i, r) for every row and the chunk's r (zero past K) into xs."""
        g, it = self.g, self.it
        saved = dict(self.names)
        self.open(f"for ({it} e = lid; e < {g.mb * kc}; e += {self.items})")
        self.emit(f"{self.let}{it} m = e / {kc}, rr = e % {kc};")
        self.emit("float av = 0.0f;")
        self.open("if (rr < kn && m < mr)" if g.ragged else "if (rr < kn)")
        self.emit(f"{self.let}{it} {g.rv.name} = k0 + rr;")
        self.rows("m")
        for n, f in enumerate(frontier):
            self.names[id(f)] = f"rw{n}[m]"
        for v in toposort(g.a):
            if id(v) in self.names:
                continue
            if g.rv in v.vars or not (v.vars or v.has_reduce):
                self.stmt(v)
        self.emit(f"av = {self.store_value(g.a)};")
        self.close()
        self.emit("xs[m][rr] = av;")
        self.close()
        self.names = saved

    # ------------------------------------------------------------------ the weight
    def vec4(self, buf: str, idx: str, param: int = -1) -> str:
        """Four floats at element `idx` of `buf` (parameter `param`'s, or shared memory), 16-byte aligned where the
        dialect reads through a cast pointer."""
        dl = self.dl
        if dl.glsl:  # (no pointers: a parameter through its vector view, shared memory element by element)
            if param >= 0:
                return self.vec_load(param, idx, element=True)
            return f"vec4({', '.join(f'{buf}[{idx} + {e}]' for e in range(4))})"
        ptr = f"{buf} + {idx}" if param >= 0 else f"&{buf}[{idx}]"
        if dl.vector_load:
            return dl.vector_load.format(n=4, ptr=ptr)
        return f"*(const float4*)({ptr})"

    def weight_load(self, dst: str, idx: str, guard: str) -> list[str]:
        """Statements reading `vec` weight elements at element `idx` into float array `dst` (zeros where `guard`
        fails)."""
        g, dl = self.g, self.dl
        v, p = g.vec, g.w.arg[0]
        conv = dl.loads.get(g.dtype.name, "{buf}[{idx}]")
        if v == 1:
            return [f"{dst}[0] = ({guard}) ? {conv.format(buf=f'd{p}', idx=idx)} : 0.0f;"]
        zero = " ".join(f"{dst}[{e}] = 0.0f;" for e in range(v))
        if g.dtype.itemsize == 4:
            get = f"{self.let}{self.vec} q = {self.vec4(f'd{p}', idx, p)}; " + " ".join(
                f"{dst}[{e}] = q.{c};" for e, c in enumerate("xyzw"))
        elif dl.vector_load or dl.glsl:  # (no cast pointers: element by element)
            get = " ".join(f"{dst}[{e}] = {conv.format(buf=f'd{p}', idx=f'{idx} + {e}')};" for e in range(v))
        else:  # 16 or 8 bytes of 16-bit elements
            t, u = dl.ctype(g.dtype), "uint4" if v == 8 else "uint2"
            get = f"const {u} q = *(const {u}*)&d{p}[{idx}]; const {t}* h = (const {t}*)&q; " + " ".join(
                f"{dst}[{e}] = {conv.format(buf='h', idx=e)};" for e in range(v))
        return [f"if ({guard}) {{ {get} }} else {{ {zero} }}"]

    def walk(self) -> tuple[str, str, int, int]:
        """How an item steps along K: (its position's name, its first position in a chunk, the step, the steps it
        takes over all of K): `x @ W.T`, a lane per `vec` elements of K (its warp's columns); `x @ W`, a row of the
        chunk per `lanes_along_n` items."""
        g = self.g
        if g.along_k:
            return "kk", f"lane * {g.vec}", WARP * g.vec, -(-g.k // (WARP * g.vec))
        per = self.items // g.lanes_along_n
        return "rr", f"lid / {g.lanes_along_n}", per, -(-g.k // per)

    def loads(self, tag: str, k0: str, bounded: bool = False) -> tuple[list[str], list[str]]:
        """(declarations, loads) of the weight elements an item uses at one position: `w{c}{tag}` per column it owns
        (`vec` elements along K), or one `w{tag}` of `vec` columns; `k0` the chunk's start; `bounded`: the position may
        pass K (zeros there)."""
        g, v = self.g, self.g.vec
        pos = self.walk()[0]
        past = f" && {pos} < {g.k}" if bounded else ""
        if not g.along_k:
            idx = f"{g.w_off} + ({k0} + rr) * {g.w_sk} + wj"
            return [f"float w{tag}[{v}];"], self.weight_load(f"w{tag}", idx, f"wj < {g.n}{past}")
        decls, out = [], []
        for c in range(g.cols_per_warp):
            idx = f"{g.w_off} + (wj + {c}) * {g.w_sj} + ({k0} + kk)"
            decls.append(f"float w{c}{tag}[{v}];")
            out += self.weight_load(f"w{c}{tag}", idx, f"wj + {c} < {g.n}{past}")
        return decls, out

    def multiply(self, tag: str) -> None:
        """The M rows' staged elements at the item's position times its weight elements (`tag`'s), into pacc."""
        g, v = self.g, self.g.vec
        self.unroll()
        self.open(f"for (int m = 0; m < {g.mb}; m++)")
        if not g.along_k:
            self.emit("float a = xs[m][rr];")
            for e in range(v):
                self.emit(f"pacc[m][{e}] += a * w{tag}[{e}];")
        else:
            if v % 4 == 0:
                self.emit(f"float a[{v}];")
                for q in range(v // 4):
                    self.emit(f"{{ {self.let}{self.vec} t = {self.vec4('xs[m]', f'kk + {4 * q}')}; a[{4 * q}] = t.x; "
                              f"a[{4 * q + 1}] = t.y; a[{4 * q + 2}] = t.z; a[{4 * q + 3}] = t.w; }}")
            else:
                self.emit("float a[1]; a[0] = xs[m][kk];")
            for c in range(g.cols_per_warp):
                self.emit(f"pacc[m][{c}] += " + " + ".join(f"a[{e}] * w{c}{tag}[{e}]" for e in range(v)) + ";")
        self.close()

    def unrolled(self) -> int:
        """Steps of the streaming loop unrolled (see steps): the accumulators and each step's weight and staged
        elements in the item's registers."""
        g = self.g
        if g.along_k:
            cols = g.cols_per_warp
            return self.steps(cols * g.mb, (cols + g.mb) * g.vec)
        return self.steps(g.mb * g.vec, g.vec + g.mb)

    def prefetch_steps(self) -> int:
        """Steps whose weight elements are loaded before anything else (0: none): all of them, where K is one chunk
        and they fit the item's registers, so that the loads are in flight while the block computes the prologue
        (a decode step's products are bound by such round trips, not by bandwidth)."""
        steps = self.walk()[3]
        return steps if self.g.chunk >= self.g.k and steps <= self.unrolled() else 0

    def prefetch(self, steps: int) -> None:
        """Each step's weight elements into registers (w*_0, w*_1, ...) at the kernel's start."""
        pos, start, stride, _ = self.walk()
        for i in range(steps):
            for line in self.loads(f"_{i}", "0")[0]:
                self.emit(line)
        for i in range(steps):
            self.open("")
            self.emit(f"{self.let}{self.it} {pos} = {start} + {i * stride};")
            for line in self.loads(f"_{i}", "0", bounded=True)[1]:
                self.emit(line)
            self.close()

    def stream(self, prefetched: int) -> None:
        """The chunk's weight elements times the staged rows: the prefetched steps' (their registers), or a loop
        that loads each step's."""
        it = self.it
        pos, start, stride, _ = self.walk()
        if prefetched:
            for i in range(prefetched):
                self.open("")
                self.emit(f"{self.let}{it} {pos} = {start} + {i * stride};")
                self.open(f"if ({pos} < kn)")
                self.multiply(f"_{i}")
                self.close()
                self.close()
            return
        self.unroll(self.unrolled())
        self.open(f"for ({it} {pos} = {start}; {pos} < kn; {pos} += {stride})")
        decls, loads = self.loads("", "k0")
        for line in decls + loads:
            self.emit(line)
        self.multiply("")
        self.close()

    # ------------------------------------------------------------------ combine, epilogue
    def combine(self) -> None:
        """The items' partial sums of each output point, combined into shared memory: `x @ W.T`, the warp's lanes
        by shuffles into res[m][column]; `x @ W`, the lanes of a warp that share columns by shuffles, then one
        partial per warp into red[warp][m][column] (the epilogue adds the warps')."""
        g, dl = self.g, self.dl
        cols = g.cols_per_warp if g.along_k else g.vec
        first = 1 if g.along_k else g.lanes_along_n  # lanes xor this and up share columns
        if first < WARP and self.shuffles:
            self.unroll()
            self.open(f"for (int o = {WARP // 2}; o >= {first}; o >>= 1)")
            self.unroll()
            self.open(f"for (int m = 0; m < {g.mb}; m++)")
            for c in range(cols):
                self.emit(f"pacc[m][{c}] += {dl.shuffle.format(x=f'pacc[m][{c}]', o='o')};")
            self.close()
            self.close()
        elif first < WARP:  # no shuffles: a tree in shared memory per accumulator (lanes below `first` end with it)
            self.declare_shared(f"{dl.shared} float tree[{self.items}];")
            for m in range(g.mb):
                for c in range(cols):
                    self.emit(f"tree[lid] = pacc[{m}][{c}];")
                    self.emit(dl.barrier)
                    self.open(f"for (int o = {WARP // 2}; o >= {first}; o >>= 1)")
                    self.emit("if (lane < o) tree[lid] += tree[lid + o];")
                    self.emit(dl.barrier)
                    self.close()
                    self.emit(f"pacc[{m}][{c}] = tree[lid];")
                    self.emit(dl.barrier)
        if g.along_k:
            self.declare_shared(f"{dl.shared} float res[{g.mb}][{g.block_cols}];")
            self.open("if (lane == 0)")
            self.each(f"res[m][warp * {cols} + c] = pacc[m][c];", cols)
        else:
            self.declare_shared(f"{dl.shared} float red[{self.items // WARP}][{g.mb}][{g.block_cols}];")
            self.open(f"if (lane < {first})")
            self.each(f"red[warp][m][lane * {cols} + c] = pacc[m][c];", cols)
        self.close()
        self.emit(dl.barrier)

    def epilogue(self) -> None:
        """Each output point (the items share them out): its sum, then the epilogue's values, then its store."""
        k, g, it = self.k, self.g, self.it
        bc = g.block_cols
        out_idx, value = k.stores[0]
        self.open(f"for ({it} oi = lid; oi < {g.mb * bc}; oi += {self.items})")
        self.emit(f"{self.let}{it} m = oi / {bc}, jj = oi % {bc}, {g.col.name} = j0 + jj;")
        self.open(f"if ({g.col.name} < {g.n} && m < mr)" if g.ragged else f"if ({g.col.name} < {g.n})")
        self.rows("m")
        if g.along_k:
            self.emit("float pv = res[m][jj];")
        else:
            self.emit("float pv = red[0][m][jj];")
            self.emit(f"for (int w = 1; w < {self.items // WARP}; w++) pv += red[w][m][jj];")
        self.names[id(g.product)] = "pv"
        for v in above(value, g.product):
            if v is not g.product:
                self.stmt(v)
        store = self.dl.stores.get(k.params[0].name, "{buf}[{idx}] = {val};")
        self.emit(store.format(buf="d0", idx=out_idx.render(), val=self.store_value(value)))
        self.close()
        self.close()


def render(k: Kernel, g: Gemv, name: str, dl: Dialect) -> str:
    """Kernel `k` (the small-M product `g`) in dialect `dl` as one function named `name`."""
    return _GemvRenderer(k, name, dl, g).render()
