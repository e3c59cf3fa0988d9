"""Scheduling: graph -> fused kernels -> an `ExecutionPlan`, computed once per graph structure (azyx.walk's key).

Fusion: a kernel is a root node and everything it can compute by index arithmetic: elementwise ops and
movement ops fuse, a reduce fuses into a consumer of the same size, constants are literals or scalar arguments. A node
is realized into its own buffer when it is a target, a reduce consumed by a kernel of another size or by more than one
consumer, a node a kernel would read under two different index maps, or a device transfer. On a GPU-style device an
elementwise kernel that reads statistics of its own rows (a layernorm's mean and variance) computes them itself, a work
group per row (a row kernel: KernelBuild.row_statistic). Placement: a kernel goes
where its inputs are unless another device is clearly faster (AUTO), and a plan that does not fit moves to a device
with room. Lowering: each kernel's value DAG (azyx.ir), rendered by its device; then merging (azyx.merge).

Data-dependent addresses: a gather fuses as a load whose address holds the index's value (an IR `index`); its
gradient, a scatter-add, is a kernel of its own (scatter_kernel), and so is an assignment into a view
(assign_kernel), which writes only the view, into its base's buffer where nothing else reads the base.

The scheduler sees devices only through `Devices`, a narrow read-only view (facts, free memory, a renderer): it
never runs anything.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any, Protocol

from azyx import debug
from azyx.codegen import search_actions
from azyx.codegen.dialect import ITEM_TILES, WARP_TILES, Dialect
from azyx.codegen.kernel import templated
from azyx.codegen.launch import Launch
from azyx.codegen.templates import attention, gemm_host
from azyx.codegen.templates.gemm import product_dtypes, split_k
from azyx.codegen.templates.gemv import GEMV_ROWS
from azyx.dtypes import DType, dtypes
from azyx.errors import AllocationError
from azyx.graph import (
    ELEMENTWISE,
    MOVEMENT,
    READ_IN_PLACE,
    Graph,
    Node,
    Op,
    Shape,
    StridedView,
    contiguous_strides,
    prod,
    view_through,
)
from azyx.ir import CHECK_WORDS, Attention, Kernel, V, ValueBuilder, format_kernel, index_sites, scalar_args, toposort
from azyx.merge import merge_kernels
from azyx.ops import REDUCE
from azyx.plan import ExecutionPlan, KernelStep, Slot, Step, TransferStep
from azyx.symbolic import Cond, Lin, Var, count_divmod, lin_vars, var
from azyx.walk import Walk

EXPAND_REALIZE = 16  # a computed value broadcast this many times over is realized first instead of recomputed
SPLIT_MAX_OUTPUTS, SPLIT_MIN_REDUCE, SPLIT_PARTS = 256, 1 << 15, 1024  # two-stage reductions (split_reduce)
# a reduce read along its outputs (a column sum) of COLUMN_REDUCE elements or more in two stages where the dialect asks
# (Dialect.split_columns): enough partial rows for COLUMN_ITEMS work items, at most COLUMN_PARTS of them, each summing
# at least COLUMN_RUN elements; COLUMN_SCAN: nodes of its operand looked at to tell how it reads memory
COLUMN_REDUCE, COLUMN_ITEMS, COLUMN_PARTS, COLUMN_RUN, COLUMN_SCAN = 256, 1 << 18, 64, 16, 64
TRANSFER_BYTES_PER_S = 5e9  # what moving an input to another device costs, for AUTO placement
TILE = (8, 32)  # register tile of a matmul-like reduce: rows x columns (columns vectorise)
# prologue fusion (KernelBuild.prologue): an operand broadcast into a product that no template takes (a matrix-vector
# product on a GPU: layernorm before it) is computed in the product's kernel where it costs at most PROLOGUE_OPS
# operations per element (its statistics' counted too) instead of a buffer written and read back and a kernel of its
# own; a statistic (a reduce whose result is the same along the enclosing reduce: a row's mean) fuses where it reduces
# at most STAT_RATIO times as many elements per kernel point as the enclosing reduce (each point computes it once)
PROLOGUE_OPS, STAT_RATIO = 24, 2
# row kernels (KernelBuild.row): rows and statistics of at most ROW_MAX elements; ROW_SCAN: nodes looked at to tell
# whether a kernel may be one
ROW_MAX, ROW_SCAN = 8192, 256

class DeviceFacts(Protocol):
    """What the scheduler may know of a device: read-only facts, its load, and its renderer."""

    @property
    def dialect(self) -> Dialect | None: ...
    @property
    def tiles(self) -> bool: ...
    @property
    def threads(self) -> int: ...
    @property
    def compute(self) -> float: ...
    @property
    def max_buffers(self) -> int: ...  # storage buffers one kernel may bind (0: no limit)
    @property
    def multiprocessors(self) -> int: ...  # a GPU's multiprocessors (0: not known)
    @property
    def kind(self) -> str: ...
    @property
    def host_memory(self) -> bool: ...  # its buffers are this process's host memory
    def free_memory(self) -> int: ...
    def pending(self) -> int: ...
    def render(self, k: Kernel) -> tuple[str, str, Launch]: ...
    def split_choice(self, site: search_actions.SplitSite) -> int | None: ...
    def reads_peer(self, other: Any) -> bool: ...  # its kernels read `other`'s buffers where they lie


class Devices(Protocol):
    """The devices as the scheduler sees them (the runtime is one)."""

    def device(self, name: str) -> DeviceFacts: ...
    def auto_order(self) -> list[str]: ...
    def placement(self, home: str) -> list[str]: ...


@dataclass
class Attempt:
    """One way of building a kernel (its loops grouped and tiled so): the kernel, the slots it reads in parameter
    order, and what choosing among attempts needs."""

    kernel: Kernel
    params: list[int]
    device: str
    cost: int  # index arithmetic (divisions and modulos) it computes per point
    load_paths: dict[int, tuple[int, ...]]  # per load (id of its value): the nodes it was read through, outermost first
    root: int
    misfit: bool = False  # built as a row kernel (KernelBuild.row), which it cannot be


def shares_memory(a: DeviceFacts, b: DeviceFacts) -> bool:
    """Whether a kernel on `b` reads `a`'s buffers where they are, with no transfer: both devices' memory is this
    process's host memory and they are of one kind (c:1 for c:0; not the host memory that numpy data waits in, whose
    uploads their tensors adopt)."""
    return a.host_memory and b.host_memory and a.kind == b.kind


def reads_in_place(a: DeviceFacts, b: DeviceFacts) -> bool:
    """Whether a kernel on `b` reads a buffer of `a` where it lies: memory both share (`shares_memory`), or a peer's
    memory that `b`'s kernels address (CUDA devices with peer access: `Device.reads_peer`). A replica realized on `b`
    is a copy in the second case: only kernels read across."""
    return shares_memory(a, b) or b.reads_peer(a)


# ------------------------------------------------------------------------------------------------ planner
class Planner:
    def __init__(self, rt: Devices, graph: Graph, walk: Walk, targets: list[int], override: dict[str, str],
                 splits: dict[str, int] | None = None):
        self.rt, self.graph, self.walk, self.targets = rt, graph, walk, set(targets)
        self.override = override
        self.forced_splits = splits or {}  # split key -> parts, for the split search's timing plans (azyx.tune)
        self.split_sites: dict[tuple[str, str], tuple[str, search_actions.SplitSite]] = {}  # (device, key) -> the site
        self.slots: list[Slot] = []
        self.steps: list[Step] = []
        self.done: dict[int, tuple[int, StridedView]] = {}
        self.transfers: dict[tuple[int, str], int] = {}
        self.adopt: list[tuple[int, int]] = []  # (input slot, slot holding it on the tensor's own device)
        self.check = os.environ.get("AZYX_CHECKS", "1") != "0"  # kernels check the indices they read (see `emit`)
        self.checks: dict[str, int] = {}  # per device: the slot of its check words
        self.temp_nodes: list[int] = []  # graph nodes the planner made (split reductions); released when done
        self.split_products: dict[tuple[int, str], int | None] = {}  # (product, device) -> its split form's node
        self.product_sums: set[int] = set()  # the stage-2 sums of split products (fused into their consumers)
        self.donated_chain: set[int] = set()  # ASSIGNs that wrote in place into a donated input's buffer
        self.leaf_device: dict[int, str] = {}
        for leaf in walk.leaves:
            n = graph[leaf]
            assert n.buffer is not None and n.view is not None
            self.done[leaf] = (self._slot(n.buffer.device.name, n.dtype, n.buffer.nbytes, "input"), n.view)
            self.leaf_device[self.done[leaf][0]] = n.device

    def _slot(self, device: str, dtype: DType, nbytes: int, kind: str) -> int:
        self.slots.append(Slot(device, dtype, nbytes, kind))
        return len(self.slots) - 1

    def device_of(self, n: Node) -> str:
        return n.device if n.pinned else self.override.get(n.device, n.device)

    def on_device(self, slot: int, device: str) -> int:
        """The slot's contents on `device`, inserting a transfer the first time."""
        s = self.slots[slot]
        if s.device == device or s.kind == "input" and self.leaf_device.get(slot) == device and \
                shares_memory(self.rt.device(s.device), self.rt.device(device)):
            return slot  # (a tensor of `device` whose buffer lies in memory it shares: a replica, `realize`)
        key = (slot, device)
        if key not in self.transfers:
            dst = self._slot(device, s.dtype, s.nbytes, "temp")
            self.steps.append(TransferStep(slot, dst, s.device, device))
            self.transfers[key] = dst
            if s.kind == "input" and s.device == "host:0" and self.leaf_device[slot] == device:
                self.adopt.append((slot, dst))  # host data uploaded to its tensor's device: the tensor keeps it
        return self.transfers[key]

    def read_from(self, nid: int, device: str) -> tuple[int, StridedView]:
        """The slot and view through which a kernel on `device` reads node `nid`: a TODEVICE marked READ_IN_PLACE
        (and no target) from its source's buffer where that lies on `device` or on a device whose buffers its kernels
        read (`reads_in_place`; the executor makes the kernel wait for the buffer's writer); else `nid` realized and
        moved to `device`."""
        n = self.graph[nid]
        if n.op is Op.TODEVICE and n.arg == READ_IN_PLACE and nid not in self.done and nid not in self.targets:
            slot, view = self.realize(n.src[0])
            held = self.slots[slot].device
            if held == device or reads_in_place(self.rt.device(held), self.rt.device(device)):
                return slot, view
        slot, view = self.realize(nid)
        return self.on_device(slot, device), view

    def realize(self, nid: int, copy: bool = False) -> tuple[int, StridedView]:
        """The slot holding `nid` and how to index it; `copy`: in a contiguous buffer of its own, not as a view."""
        if nid in self.done:
            return self.done[nid]
        n = self.graph[nid]
        if n.op is Op.TODEVICE:
            slot, view = self.realize(n.src[0])
            held, device = self.slots[slot].device, self.device_of(n)
            if n.arg == READ_IN_PLACE and shares_memory(self.rt.device(held), self.rt.device(device)):
                out = (slot, view)  # a replica (a collective's) in memory both share: the source's buffer, no copy
            else:
                out = (self.on_device(slot, device), view)
        elif not copy and (sv := self.viewed(nid)) is not None:
            out = sv  # a view of a buffer: no kernel
        else:
            out = self.kernel(nid)
        self.done[nid] = out
        return out

    def strided(self, nid: int) -> tuple[int, StridedView] | None:
        """Movement ops over a realized buffer that a strided view expresses (no copy needed)."""
        n = self.graph[nid]
        if nid in self.done:
            return self.done[nid]
        if n.op is Op.REDUCE and self.split_parts(nid, self.place(nid)) is not None:
            return self.realize(nid)  # a split reduce is its own kernels anyway: views of it need no copy
        if n.op not in MOVEMENT:
            return None
        inner = self.strided(n.src[0])
        if inner is None or self.slots[inner[0]].device != self.device_of(n):
            return None
        view = view_through(n, self.graph[n.src[0]].shape, inner[1])
        return None if view is None else (inner[0], view)

    def movement_chain(self, nid: int) -> tuple[list[Node], int]:
        """The movement ops from node `nid` down (outermost first) and the node they start from: the first that is
        not one, or that has a buffer already."""
        g, chain, base = self.graph, [], nid
        while g[base].op in MOVEMENT and base not in self.done:
            chain.append(g[base])
            base = g[base].src[0]
        return chain, base

    def through(self, chain: list[Node], view: StridedView | None) -> StridedView | None:
        """The view that `chain` (Planner.movement_chain) makes of its base's `view`; None where it is no strided
        view."""
        for m in reversed(chain):
            view = view_through(m, self.graph[m.src[0]].shape, view) if view is not None else None
        return view

    def view_of(self, nid: int) -> StridedView | None:
        """The strided view through which node `nid` reads the node its movement ops start from (that node's buffer
        where it has one, else its contiguous result), or None where they make no strided view of it."""
        chain, base = self.movement_chain(nid)
        return self.through(chain, self.done[base][1] if base in self.done else
                            StridedView.contiguous(self.graph[base].shape))

    def viewed(self, nid: int) -> tuple[int, StridedView] | None:
        """A movement node realized whole (a target, a broadcast operand, a shared view of a reduce) is a view of the
        node its movement ops start from, instead of a copy, when they are a strided view of it and that node has a
        buffer: it is realized, or it gets one anyway (read by other kernels too, a reduce in two stages, or not a
        target: read whole, the moved copy would cost a kernel as well)."""
        chain, base = self.movement_chain(nid)
        if not chain:
            return None
        if base not in self.done:  # realize it only if the ops above will be a view of its contiguous result
            shared = self.walk.consumers.get(base, 0) > 1 or self.split_parts(base, self.place(base)) is not None
            if nid in self.targets and not shared:
                return None  # computed straight into the target's own layout instead
            if self.through(chain, StridedView.contiguous(self.graph[base].shape)) is None:
                return None
            self.realize(base)
        return self.strided(nid)

    def place(self, root: int) -> str:
        """The device of a kernel. Pinned: its own. AUTO: the cheapest of moving its inputs to a device and
        computing there (so it stays where its inputs already are unless another device is clearly faster)."""
        n = self.graph[root]
        home = self.device_of(n)
        if n.pinned or home in self.override.values():
            return home
        held: dict[str, int] = {}
        seen: set[int] = set()
        flops = 0
        stack = [root]
        while stack:  # the realized buffers this kernel would read, and the work above them (a node per element)
            i = stack.pop()
            if i in seen:
                continue
            seen.add(i)
            if i in self.done:
                slot = self.slots[self.done[i][0]]
                held[slot.device] = held.get(slot.device, 0) + slot.nbytes
            else:
                m = self.graph[i]
                flops += prod(m.shape)
                stack.extend(m.src)

        def cost(name: str) -> float:
            dev = self.rt.device(name)
            moved = sum(b for d, b in held.items() if d != name)
            return moved / TRANSFER_BYTES_PER_S + flops / (dev.compute * 1e9)  # (never the load: deterministic)

        candidates = [d for d in self.rt.placement(home) if d == home or self.rt.device(d).free_memory() > 0]
        return min(candidates, key=lambda d: (cost(d), d != home)) if candidates else home

    def computes(self, nid: int) -> bool:
        """Whether reading `nid` means computing something (an op below it), not just loading through views."""
        while True:
            if nid in self.done:
                return False
            n = self.graph[nid]
            if n.op in MOVEMENT:
                nid = n.src[0]
                continue
            return n.op not in (Op.CONST, Op.LEAF) and n.buffer is None

    def split_parts(self, nid: int, device: str) -> int | None:
        """How many partial results a reduce should be split into on `device` (see split_reduce), or None: the parts
        the search found for its structure on the device (Device.split_choice, azyx.tune), else the heuristic's."""
        n = self.graph[nid]
        dev = self.rt.device(device)
        dialect = dev.dialect
        # GPU-style devices run one work item per output; host devices with several threads share loops of outputs
        # (a reduction into one would need an OpenMP region of its own: that team makes OpenMP in the rest of the
        # process, PyTorch's, sleep between its regions)
        if n.op is not Op.REDUCE or dialect is None or not (dialect.global_ids or dialect.pragmas and dev.threads > 1):
            return None
        src = self.graph[n.src[0]]
        r = prod([src.shape[a] for a in n.arg[1]])
        outputs = prod(n.shape)
        if outputs >= SPLIT_MAX_OUTPUTS:
            if not dialect.split_columns or r < COLUMN_REDUCE or nid in self.temp_nodes \
                    or not self.reads_along_outputs(nid):  # (a split's own stages are never split again)
                return None
            kind, parts = search_actions.COLUMNS, self.column_parts(nid, r)
        else:
            if r < SPLIT_MIN_REDUCE:
                return None
            per_part = 4 * dialect.group_size if dialect.group_size else 64  # a grouped part: 4 elements per item
            kind, parts = search_actions.ROWS, next((d for d in range(min(SPLIT_PARTS, r // per_part), 15, -1)
                                               if r % d == 0), None)
        if nid in self.temp_nodes:  # a split's own stage: the heuristic's (never searched)
            return parts
        site = search_actions.SplitSite(kind, n.arg[0], n.dtype.name, outputs, r, parts or 0)
        self.split_sites[(device, site.key)] = (device, site)
        chosen = self.forced_splits.get(site.key)
        if chosen is None:
            chosen = dev.split_choice(site)
        return (chosen or None) if chosen is not None else parts

    def column_parts(self, nid: int, r: int) -> int | None:
        """Parts of a column split of reduce `nid` (`r` elements into each of its many outputs, read along them; see
        split_reduce), or None: one work item per output (each walks its column, neighbours reading neighbouring
        addresses) leaves a GPU mostly idle where the outputs are a few thousand."""
        want = -(-COLUMN_ITEMS // prod(self.graph[nid].shape))
        top = min(want, COLUMN_PARTS, r // COLUMN_RUN)
        return next((d for d in range(top, 1, -1) if r % d == 0), None) if top >= 2 else None

    def reads_along_outputs(self, nid: int) -> bool:
        """Whether reduce `nid` reads memory along its outputs, not along what it reduces (a column sum of a row-major
        matrix): each operand that varies along the reduced axes is contiguous along the innermost kept axis and
        along no reduced one. Elementwise ops over views of buffers only (else False: not known)."""
        n = self.graph[nid]
        shape, axes = self.graph[n.src[0]].shape, n.arg[1]
        kept = [a for a in range(len(shape)) if a not in axes and shape[a] > 1]
        if not kept:
            return False
        found, seen, stack = False, set(), [n.src[0]]
        while stack:
            i = stack.pop()
            if i in seen:
                continue
            seen.add(i)
            m, computed = self.graph[i], i not in self.done
            if len(seen) > COLUMN_SCAN or computed and m.op not in ELEMENTWISE | MOVEMENT | {Op.CONST, Op.LEAF}:
                return False
            if computed and m.op in ELEMENTWISE:  # fused into the reduce's kernel: what it reads counts
                stack.extend(m.src)
                continue
            chain, base = self.movement_chain(i)
            if self.graph[base].op is Op.CONST:
                continue
            if base not in self.done:  # a computed value under movement ops: how it reads is not known here
                return False
            view = self.through(chain, self.done[base][1])
            if view is None or len(view.strides) != len(shape):
                return False
            if all(view.strides[a] == 0 for a in axes):  # the same for every reduced element: not read along them
                continue
            if view.strides[kept[-1]] != 1 or any(abs(view.strides[a]) == 1 for a in axes):
                return False
            found = True
        return found

    def small_product(self, nid: int, dl: Dialect) -> bool:
        """Whether reduce `nid` is a product of at most GEMV_ROWS rows against one weight for every row, which a
        dialect that takes them (`small_products`) runs as the small-M kernel (templates.gemv)."""
        n = self.graph[nid]
        src = self.graph[n.src[0]]
        if not dl.small_products or n.arg[0] != "sum" or len(n.arg[1]) != 1 or src.op is not Op.BINARY or \
                src.arg != "mul" or len(src.src) != 2 or len(src.shape) < 3:
            return False
        axis = n.arg[1][0]
        col = max(d for d in range(len(src.shape)) if d != axis)
        rows = prod(src.shape) // (src.shape[axis] * max(src.shape[col], 1))
        return rows <= GEMV_ROWS and any(  # (one weight for every row)
            v is not None and all(v.strides[d] == 0 or src.shape[d] == 1 for d in range(len(src.shape))
                                  if d not in (axis, col))
            for v in map(self.view_of, src.src))

    def tiled_product(self, nid: int, device: str, least_k: int = 64) -> bool:
        """Whether reduce `nid` is a matrix product of 16 rows or more, K 64 or more, of a dtype that the device's
        product template takes (gemm: float32, float16/bfloat16 on tensor cores; gemm_host: all three): it
        gets that kernel, a kernel of its own, rather than being fused into its consumer (a bias, an activation) as a
        generic reduce, which on an H100 ran a 128 x 768 x 3072 product 60x slower (a half product is then rounded to
        its dtype, as PyTorch's)."""
        dl = self.rt.device(device).dialect
        n = self.graph[nid]
        if dl is None or not dl.gemm or n.arg[0] != "sum" or len(n.arg[1]) != 1:
            return False
        if n.dtype not in product_dtypes(dl.products, dl.tensor_cores):
            return False
        src = self.graph[n.src[0]]
        axis = n.arg[1][0]
        if (src.op is not Op.BINARY or src.arg != "mul" or len(src.src) != 2 or src.shape[axis] < least_k
                or len(src.shape) < 3):
            return False
        col = max(d for d in range(len(src.shape)) if d != axis)  # (x @ y: (..., m, n, k) summed over k)
        rows = prod(src.shape) // (src.shape[axis] * max(src.shape[col], 1))
        if dl.global_ids or rows >= gemm_host.MIN_ROWS:
            if self.small_product(nid, dl):  # (the small-M kernel, fused with its prologue and epilogue)
                return False
            return rows >= 16
        # fewer rows: on the host still where the right operand is stored transposed (`x @ W.T`, gemm_host.takes)
        row = max((d for d in range(len(src.shape)) if d not in (axis, col)), default=-1)
        views = [self.view_of(s) for s in src.src] if row >= 0 else []
        transposed = any(v is not None and v.strides[row] == 0 and v.strides[axis] == 1 and v.strides[col] != 1
                         for v in views)
        return gemm_host.takes(rows, transposed)

    def split_reduce(self, root: int, device: str) -> int | None:
        """On GPU-style devices (one work item per output point) a reduce of many elements into few outputs would
        leave the device idle: reduce in two stages, P partial results per output computed in parallel, then P
        into one. A column split (column_parts: many outputs, read along them) puts the P parts first, so that each
        part's work items still read neighbouring addresses. Built from temporary view and reduce nodes (index
        arithmetic, no copies); None if not worth it."""
        p = self.split_parts(root, device)
        if p is None:
            return None
        n = self.graph[root]
        op, axes = n.arg
        src = self.graph[n.src[0]]
        r = prod([src.shape[a] for a in axes])
        keep = [a for a in range(len(src.shape)) if a not in axes]
        outer = tuple(src.shape[a] for a in keep)

        def node(op: Op, srcs: tuple[int, ...], arg: Any, shape: Shape) -> int:
            return self.temp_node(n, op, srcs, arg, shape)

        x = n.src[0]
        if prod(n.shape) >= SPLIT_MAX_OUTPUTS:  # a column split (column_parts): P partial rows, each part's work items
            order = list(axes) + keep  # reading neighbouring addresses, then a work item per output over the P rows
            if order != list(range(len(src.shape))):
                x = node(Op.PERMUTE, (x,), tuple(order), tuple(src.shape[a] for a in order))
            x = node(Op.RESHAPE, (x,), (p, r // p) + outer, (p, r // p) + outer)
            x = node(Op.REDUCE, (x,), (op, (1,)), (p, 1) + outer)
            return node(Op.REDUCE, (x,), (op, (0,)), (1, 1) + outer)
        if keep + list(axes) != list(range(len(src.shape))):
            x = node(Op.PERMUTE, (x,), tuple(keep + list(axes)), outer + tuple(src.shape[a] for a in axes))
        x = node(Op.RESHAPE, (x,), outer + (p, r // p), outer + (p, r // p))
        k = len(outer)
        x = node(Op.REDUCE, (x,), (op, (k + 1,)), outer + (p, 1))  # stage 1: P partials per output
        return node(Op.REDUCE, (x,), (op, (k,)), outer + (1, 1))  # stage 2: as many elements as `root`

    def temp_node(self, like: Node, op: Op, srcs: tuple[int, ...], arg: Any, shape: Shape,
                  dtype: DType | None = None) -> int:
        """A graph node the planner makes (a stage of a split), on `like`'s device, of its dtype unless `dtype`."""
        i = self.graph.add(Node(op, srcs, arg, shape, dtype or like.dtype, like.device, like.pinned))
        self.graph.retain(i)
        self.temp_nodes.append(i)
        return i

    def split_product(self, nid: int, device: str) -> int | None:
        """The node that computes product `nid` from parts of its K (gemm.split_k decides how many, from the shape
        and the device's multiprocessors), else None: a product of rows against one weight (a linear layer at
        decode) whose tiles alone would leave most of a CUDA device idle. Stage 1 is the product of P parts, a batch
        element each, in float32 (float16/bfloat16 operands widened: the tensor-core kernel then stores its float32
        accumulators, gemm.Gemm.out); stage 2 sums the P partials and rounds once to the product's dtype. Stage 2 is
        a reduce that fuses into the product's consumer (its epilogue: bias, GELU, a residual) where that consumer
        could have read the product (Builder.value), else it is a kernel of its own. Made once per product."""
        if self.graph[nid].op is not Op.REDUCE:
            return None
        if (nid, device) in self.split_products:
            return self.split_products[(nid, device)]
        self.split_products[(nid, device)] = None
        dev = self.rt.device(device)
        dl = dev.dialect
        if dl is None or dl.products != WARP_TILES or not dev.multiprocessors or nid in self.temp_nodes \
                or not self.tiled_product(nid, device):
            return None
        n = self.graph[nid]
        src = self.graph[n.src[0]]
        *lead, m, cols, k = src.shape
        if n.arg[1] != (len(src.shape) - 1,) or not any(  # (one weight for every row)
                v is not None and all(v.strides[d] == 0 or src.shape[d] == 1 for d in range(len(lead) + 1))
                for v in map(self.view_of, src.src)):
            return None
        rows = prod(lead) * m
        parts = split_k(rows, cols, k, n.dtype.name, dev.multiprocessors)
        if parts < 2:
            return None
        kp, wide = k // parts, dtypes.float32
        operands = []
        for x in src.src:  # (P, rows, cols, K / P): the parts a batch
            x = self.temp_node(n, Op.RESHAPE, (x,), (rows, cols, parts, kp), (rows, cols, parts, kp))
            x = self.temp_node(n, Op.PERMUTE, (x,), (2, 0, 1, 3), (parts, rows, cols, kp))
            if n.dtype is not wide:
                x = self.temp_node(n, Op.CAST, (x,), None, (parts, rows, cols, kp), wide)
            operands.append(x)
        x = self.temp_node(n, Op.BINARY, tuple(operands), "mul", (parts, rows, cols, kp), wide)
        x = self.temp_node(n, Op.REDUCE, (x,), ("sum", (3,)), (parts, rows, cols, 1), wide)  # stage 1
        x = self.temp_node(n, Op.REDUCE, (x,), ("sum", (0,)), (1, rows, cols, 1), wide)  # stage 2
        self.product_sums.add(x)
        if n.dtype is not wide:
            x = self.temp_node(n, Op.CAST, (x,), None, (1, rows, cols, 1))
        x = self.temp_node(n, Op.RESHAPE, (x,), n.shape, n.shape)
        debug.log(debug.PLANS, lambda: f"product {nid} {n.shape} split over K in {parts}")
        self.split_products[(nid, device)] = x
        return x

    def kernel(self, root: int) -> tuple[int, StridedView]:
        n = self.graph[root]
        device = self.place(root)
        split = self.split_reduce(root, device)
        if split is not None:  # same elements, contiguous: only the shape differs
            return self.realize(split)[0], StridedView.contiguous(n.shape)
        split = self.split_product(root, device)
        if split is not None:  # (a product read by no epilogue that could sum its parts: the sum is a kernel)
            return self.realize(split)
        if n.op is Op.ASSIGN:
            return self.assign_kernel(root, device)
        if n.op is Op.ATTENTION:
            return self.attention_kernel(root, device)
        shape = n.shape
        kind = "output" if root in self.targets else "temp"
        out = self._slot(device, n.dtype, prod(shape) * n.dtype.itemsize, kind)
        if prod(shape) == 0:
            return out, StridedView.contiguous(shape)
        if n.op is Op.SCATTER:
            return self.scatter_kernel(root, device, out)
        dims = [i for i, s in enumerate(shape) if s != 1]
        groups = [[d] for d in dims]
        best = self.attempt(root, device, groups, None, rows=self.row_candidate(root, device))
        if best.misfit:  # (no row kernel after all: built as any other)
            best = self.attempt(root, device, groups, None)
        rows = best.kernel.rows
        i = 0
        while i < len(groups) - 1 - rows:  # (a row kernel's last loop stays the row's)
            cand = groups[:i] + [groups[i] + groups[i + 1]] + groups[i + 2 :]
            trial = self.attempt(root, device, cand, None, rows)
            if trial.cost <= best.cost and not trial.misfit:
                groups, best = cand, trial
            else:
                i += 1
        best = self.within_binding_limit(root, device, groups, best)
        tile = None if rows else self.tile_for(best, groups, shape)
        if tile == "retry":  # an operand was made contiguous: build again, reading it
            best = self.attempt(root, device, groups, None)
            tile = self.tile_for(best, groups, shape)
            tile = None if tile == "retry" else tile
        k = best.kernel
        if tile is not None and k.stores[0][1].has_reduce:  # the heuristic's tile, as actions on the IR
            if search_actions.searchable(k):
                k = search_actions.apply(k, search_actions.heuristic(tile, len(k.gvars)))
            else:  # (a gather's address in it: the actions do not rewrite those; built tiled instead, never searched)
                tiled = self.attempt(root, device, groups, tile)
                if tiled.kernel.stores[0][1].has_reduce:
                    best, k = tiled, tiled.kernel
        self.emit(device, k, (out, *best.params))
        return out, StridedView.contiguous(shape)

    def scatter_kernel(self, root: int, device: str, out: int) -> tuple[int, StridedView]:
        """SCATTER: loops over the output's points off the scattered axis (outer: the axes before it, inner: those
        after it), each zeroing its elements along that axis and then adding its gradient values at the rows its
        index reads (Kernel.scatter)."""
        n = self.graph[root]
        axis, shape = n.arg
        g, index = n.src
        rows, m = shape[axis], self.graph[g].shape[axis]
        outer, inner = Var("g0", prod(shape[:axis])), Var("g1", prod(shape[axis + 1 :]))
        j, r = Var("j", m), Var("r", rows)
        idx = [*_unflatten(var(outer), shape[:axis]), var(j), *_unflatten(var(inner), shape[axis + 1 :])]
        kb = KernelBuild(self, root, device, prod(shape))
        value = kb.value(g, tuple(idx), Cond(), False)
        dyn = kb.vb.index(kb.value(index, tuple(idx), Cond(), False), rows, "scatter")
        stride = prod(shape[axis + 1 :])
        at = var(outer) * (rows * stride) + var(inner)
        k = Kernel([n.dtype, *(self.slots[s].dtype for s in kb.params)], [outer, inner], [],
                   [(at + Lin({dyn: stride}), value)], (outer.vmax + 1) * (inner.vmax + 1) * (rows + m),
                   (j, r, at + var(r) * stride))
        self.emit(device, k, (out, *kb.params))
        return out, StridedView.contiguous(shape)

    def attention_kernel(self, root: int, device: str) -> tuple[int, StridedView]:
        """ATTENTION: one kernel (templates.attention) reading q, k, v (and the mask) where they lie, where the device's
        dialect has it and the lengths fit; else its composed form (the node's last source where nn made one: see
        nn._fused_attention), planned as any graph, or the kernel on the node's own device."""
        n = self.graph[root]
        q, k, v, scale, *rest = n.src
        causal, mask_kind = n.arg
        mask = rest[0] if mask_kind else None
        composed = rest[-1] if len(rest) > (mask is not None) else None
        *batch, lq, e = self.graph[q].shape
        lk, ev = self.graph[v].shape[-2:]

        def takes(device: str) -> bool:
            dl = self.rt.device(device).dialect
            return dl is not None and attention.fits(dl, lq, lk, e, ev, self.graph[q].dtype)

        if not takes(device):
            if composed is not None:
                return self.realize(composed)
            device = n.device  # (made without its composed form only where its own device has the kernel)
            assert takes(device), f"attention without its composed form on {device}, which has no kernel for it"
        dl = self.rt.device(device).dialect
        assert dl is not None
        rows = prod(batch) * lq
        splits = attention.decode_splits(dl, rows, lk) if attention.decode_takes(dl, lq, e, ev, n.dtype) else 0
        wide = attention.copies_unaligned(dl, e, ev, n.dtype, splits)
        cache = self.gathered_cache(k, v, device, wide) if splits and batch else None
        tables = {} if cache is None else {k: cache[0], v: cache[1]}
        params, views = [], []
        for s in (q, k, v) if mask is None else (q, k, v, mask):
            if s in tables and s != q and s != mask:  # the table the rows are gathered from, read in place
                slot, view = tables[s]
            else:
                slot, view = self.read_in_place(s, device)
            if wide and s != mask and not attention.rows_aligned((view.offset, *view.strides)):
                slot, view = self.kernel(s)  # a contiguous copy, whose rows the kernel reads 16 bytes at a time
                slot = self.on_device(slot, device)
            params.append(slot)
            views.append((view.offset, *view.strides))
        if cache is not None:
            params.append(cache[2])
        spec = Attention(tuple(batch), lq, lk, e, ev, views[0], views[1], views[2],
                         views[3] if mask is not None else None, mask_kind == "bool", causal, splits, int(splits > 0),
                         0 if cache is None else cache[3])
        vb = ValueBuilder()
        sn, si = self.graph[scale], self.walk.scalar_of.get(scale)
        sv = vb.arg(si, sn.dtype) if si is not None else vb.const(sn.arg, sn.dtype)
        kind = "output" if root in self.targets else "temp"
        out = self._slot(device, n.dtype, prod(n.shape) * n.dtype.itemsize, kind)
        stages = [(spec, out, n.dtype, params)]
        if splits > 1:  # the decode form's chunks: partials (m, l, o) per row and chunk, then combined into `out`
            part = self._slot(device, dtypes.float32, 4 * rows * splits * (ev + 2), "temp")
            stages = [(spec, part, dtypes.float32, params),
                      (replace(spec, stage=2), out, n.dtype, [part])]
        for sp, dst, dtype, srcs in stages:
            kern = Kernel([dtype, *(self.slots[s].dtype for s in srcs)], [], [],
                          [(Lin({}, 0), vb.attention(sp, dtype, sv))], attention.work(sp))
            self.emit(device, kern, (dst, *srcs), checked=sp.stage == 1 and sp.gather > 0)
        return out, StridedView.contiguous(n.shape)

    def gathered_cache(self, k: int, v: int, device: str, aligned: bool
                       ) -> tuple[tuple[int, StridedView], tuple[int, StridedView], int, int] | None:
        """k and v as a decode step reads a KV cache: each the rows of a table taken along its first axis by one
        int32 index of a row per batch point (`cache[:, :, :window][slots]`): the tables' slots and views (read in
        place, rows on 16 bytes where `aligned`), the index's slot, the tables' rows; else None (the gathers run)."""
        found = []
        for nid in (k, v):
            n = self.graph[nid]
            while n.op is Op.RESHAPE and n.shape == self.graph[n.src[0]].shape:  # (an identity reshape)
                n = self.graph[n.src[0]]
            if n.op is not Op.GATHER or n.arg != 0:
                return None
            table, ix = n.src
            if self.graph[ix].op is Op.EXPAND and self.graph[self.graph[ix].src[0]].shape == (n.shape[0],) + (1,) * (
                    len(n.shape) - 1):
                ix = self.graph[ix].src[0]
            if self.graph[ix].op is Op.RESHAPE and self.graph[self.graph[ix].src[0]].shape == (n.shape[0],):
                ix = self.graph[ix].src[0]
            if self.graph[ix].shape != (n.shape[0],) or self.graph[ix].dtype is not dtypes.int32 or \
                    self.graph[table].shape[1:] != n.shape[1:]:
                return None
            found.append((table, ix))
        (tk, ik), (tv, iv) = found
        rows = self.graph[tk].shape[0]
        if ik != iv or self.graph[tv].shape[0] != rows:
            return None
        tables = [self.read_in_place(t, device) for t in (tk, tv)]
        if aligned and not all(attention.rows_aligned((w.offset, *w.strides)) for _, w in tables):
            return None
        slot, view = self.read_in_place(ik, device)
        if view.offset or not view.is_contiguous(self.graph[ik].shape):
            slot = self.on_device(self.kernel(ik)[0], device)  # (contiguous: the kernel reads index[c])
        return tables[0], tables[1], slot, rows

    def read_in_place(self, nid: int, device: str) -> tuple[int, StridedView]:
        """The slot on `device` and the view through which a kernel of its own reads node `nid`: movement ops over a
        buffer (realized, or computed for it) as a strided view of that buffer, moved to `device` whole where it lies
        elsewhere (a mask broadcast over heads is not copied per head); else `nid` realized."""
        chain, base = self.movement_chain(nid)
        slot, view = self.realize(base)
        seen = self.through(chain, view)
        if seen is None:
            slot, seen = self.realize(nid)
        return self.on_device(slot, device), seen

    def writable(self, root: int, device: str) -> tuple[int, StridedView] | None:
        """The slot and view of ASSIGN `root`'s base if the kernel may write into it: the base's own buffer (not a
        view of another node's), on the kernel's device, read by nothing else: a realized base that only `root` holds
        (walk.donated), or one this plan computes for `root` alone (also an ASSIGN that wrote into a donated input:
        a chain of assignments to one tensor writes its buffer in place, assignment after assignment)."""
        base = self.graph[root].src[0]
        b = self.graph[base]
        if b.op in MOVEMENT or base in self.targets or self.walk.consumers.get(base, 0) != 1:
            return None
        if base in self.walk.leaves and root not in self.walk.donated:
            return None
        slot, view = self.realize(base)
        s = self.slots[slot]
        if s.device != device or slot in self.transfers.values() or not view.is_contiguous(b.shape) or \
                (s.kind == "input") != (base in self.walk.leaves or base in self.donated_chain):
            return None
        return slot, view

    def assign_kernel(self, root: int, device: str) -> tuple[int, StridedView]:
        """ASSIGN: a kernel over the region alone, writing value into the base's buffer (`writable`), else into a
        copy of the base made first (the base's holders keep the old value)."""
        n = self.graph[root]
        base, value, *positions = n.src
        axes, region = n.arg
        target = self.writable(root, device)
        if target is not None and self.slots[target[0]].kind == "input":
            self.donated_chain.add(root)
        if target is None:  # a contiguous copy of the base, which the kernel then updates
            copy = self.graph.add(Node(Op.RESHAPE, (base,), n.shape, n.shape, n.dtype, n.device, n.pinned))
            self.graph.retain(copy)
            self.temp_nodes.append(copy)
            slot, view = self.kernel(copy)
            target = self.on_device(slot, device), view
        out, view = target
        if prod(region) == 0:
            return out, view
        gvars = [Var(f"g{i}", s) for i, s in enumerate(region)]
        ridx = tuple(var(g) if s != 1 else Lin({}, 0) for g, s in zip(gvars, region))
        kb = KernelBuild(self, root, device, prod(region))
        at = Lin({}, view.offset)
        for ax, size, stride in zip(axes, n.shape, view.strides):
            if ax[0] == "slice":
                coord = ridx[ax[3]] * ax[2] + ax[1]
            else:
                where = () if ax[0] == "at" else tuple(ridx[r] for r in ax[2])
                coord = Lin({kb.vb.index(kb.value(positions[ax[1]], where, Cond(), False), size, "assign"): 1})
            at = at + coord * stride
        v = kb.value(value, ridx, Cond(), False)
        k = Kernel([n.dtype, *(self.slots[s].dtype for s in kb.params)], [g for g in gvars if g.vmax > 0], [],
                   [(at, v)], prod(region), inplace=True)
        self.emit(device, k, (out, *kb.params))
        return out, view

    def emit(self, device: str, k: Kernel, args: tuple[int, ...], checked: bool = False) -> None:
        """Render kernel `k` for `device` and append its step, reading and writing slots `args`. A kernel that reads
        indices from memory checks them (unless AZYX_CHECKS=0): its last parameter is the run's check words (a
        slot of kind "check", one per device per plan, which the executor binds; see ir.Kernel.check)."""
        if self.check and k.check < 0 and (checked or index_sites(k)):  # (checked: a template's own index reads)
            if device not in self.checks:
                self.checks[device] = self._slot(device, dtypes.int32, 4 * CHECK_WORDS, "check")
            k.check = len(k.params)
            k.params.append(dtypes.int32)
            args = (*args, self.checks[device])
        debug.log(debug.IR, lambda: format_kernel(k))
        name, src, launch = self.rt.device(device).render(k)
        self.steps.append(KernelStep(device, name, src, args, k.work, k, launch=launch))

    def within_binding_limit(self, root: int, device: str, groups: list[list[int]], best: Attempt) -> Attempt:
        """A kernel that would bind more buffers than its device allows (Vulkan: maxPerStageDescriptorStorageBuffers)
        computes the source of its root that reads the most buffers as a kernel of its own first (which splits the
        same way if it must), then reads that one buffer instead."""
        limit = self.rt.device(device).max_buffers
        check = self.check and bool(index_sites(best.kernel))  # (the check words: one buffer more)
        while limit and 1 + len(best.params) + bool(scalar_args(best.kernel)) + check > limit:
            wide = max(((s, self.inputs_below(s)) for s in self.graph[root].src if self.computes(s)),
                       key=lambda si: si[1], default=(None, 0))
            if wide[0] is None or wide[1] < 2:
                break  # nothing to split: the device refuses the kernel when it compiles it
            self.realize(wide[0], copy=True)
            best = self.attempt(root, device, groups, None, best.kernel.rows)
        return best

    def inputs_below(self, nid: int) -> int:
        """How many realized buffers computing `nid` (fused, as far as it is not realized) reads."""
        seen: set[int] = set()
        inputs: set[int] = set()
        stack = [nid]
        while stack:
            i = stack.pop()
            if i in seen:
                continue
            seen.add(i)
            if i in self.done or self.graph[i].buffer is not None:
                inputs.add(i)
            else:
                stack.extend(self.graph[i].src)
        return len(inputs)

    def tile_for(self, att: Attempt, groups: list[list[int]], shape: Shape) -> tuple[int, int] | None:
        k = att.kernel
        dev = self.rt.device(att.device)
        if not k.stores[0][1].has_reduce or not dev.tiles:
            return None
        if dev.dialect is not None and templated(k, dev.dialect, dev.threads):
            return None  # the device's product template takes it (operands read where they lie)
        bound = dev.dialect.max_trips if dev.dialect is not None else 0
        if bound and any(prod([x.vmax + 1 for x in v.arg[1]]) > bound for v in toposort(*k.values) if v.op == "reduce"):
            return None  # (a driver that ends long loops, llvmpipe: the grouped reduce takes several steps a turn)
        if len(groups) < 2:
            return self.column_tile(k) if len(k.gvars) == 1 else None
        a = prod([shape[d] for d in groups[-2]])
        b = prod([shape[d] for d in groups[-1]])
        ta = next((t for t in (TILE[0], 4, 2) if a % t == 0), None)
        tb = next((t for t in (TILE[1], 16, 8) if b % t == 0), None)
        # (OpenCL on a CPU: its product template takes any sizes once the right operand is contiguous)
        template = dev.dialect is not None and dev.dialect.gemm and dev.dialect.products == ITEM_TILES
        if (ta is None or tb is None) and not template:
            return None
        gi, gj = k.gvars[-2], k.gvars[-1]
        loads = [v for v in toposort(*k.values) if v.op == "load"]
        col = [v for v in loads if gi not in v.vars and gj in v.vars]  # the right operand: varies along columns
        if not (col and any(gj not in v.vars and gi in v.vars for v in loads)):
            return None
        strided = [v for v in col if v.arg[1].terms.get(gj, 0) != 1]
        if strided:  # columns not contiguous (x @ W.T with W as stored): copy the transposed operand once
            paths = [att.load_paths.get(id(v), ()) for v in strided]
            # the permute below the reduce that made the columns strided; never the kernel's own root (a transposed
            # product, (a @ b).T, reads its left operand along the output's columns: copying the root would plan it
            # again, forever)
            root = att.root
            perms = [next((i for i in reversed(path) if i != root and self.graph[i].op is Op.PERMUTE), None)
                     for path in paths]
            if all(i is not None and i not in self.done for i in perms):
                for i in perms:
                    self.realize(i, copy=True)  # type: ignore[arg-type]
                return "retry"  # type: ignore[return-value]
            return None  # a dot product per output instead, vectorised along the reduce
        return None if ta is None or tb is None else (ta, tb)

    @staticmethod
    def column_tile(k: Kernel) -> tuple[int, int] | None:
        """A reduce over the rows of a row-major operand (a column sum, a vector-matrix product `x @ W`): one output
        per work item would read each row's element `n` apart; a register tile of outputs reads every row's run of
        them contiguously instead (the reduce loop outside, the tile inside: vectorised)."""
        g = k.gvars[0]
        n = g.vmax + 1
        tb = next((t for t in (TILE[1], 16, 8) if n % t == 0 and n >= 2 * t), None)
        along = [v for v in toposort(*k.values) if v.op == "load" and g in v.vars]
        if tb is None or not along or any(v.arg[1].terms.get(g, 0) != 1 for v in along):
            return None
        if not any(len(v.vars) > 1 for v in along):  # (no row of a reduce read along the outputs: nothing to gain)
            return None
        return 1, tb

    def loads(self, nid: int) -> bool:
        """Whether a kernel that reads node `nid` loads it from memory rather than computing it: a realized node, a
        target, a transfer, or a node of several consumers over a fused reduce, which gets a buffer of its own."""
        n = self.graph[nid]
        return nid in self.done or n.buffer is not None or n.op is Op.TODEVICE or nid in self.targets or \
            self.walk.consumers.get(nid, 0) > 1 and nid in self.walk.heavy

    def row_candidate(self, root: int, device: str) -> bool:
        """Whether `root`'s kernel is built as a row kernel first (KernelBuild.row_statistic): its device's dialect
        runs them (Dialect.rows, with grouped reductions), `root` is elementwise or a view of one, and among what its
        kernel would compute (unrealized nodes, ROW_SCAN of them at most) lies a reduce of fewer outputs than `root`
        has (one of as many would be the kernel's own reduce: a product and its epilogue)."""
        dl = self.rt.device(device).dialect
        n = self.graph[root]
        if dl is None or not dl.rows or not dl.global_ids or not dl.group_size or n.op not in ELEMENTWISE | MOVEMENT:
            return False
        seen: set[int] = set()
        stack, numel = list(n.src), prod(n.shape)
        while stack and len(seen) < ROW_SCAN:
            i = stack.pop()
            if i in seen:
                continue
            seen.add(i)
            m = self.graph[i]
            if self.loads(i):
                continue
            if m.op is Op.REDUCE and prod(m.shape) < numel:
                return True
            if m.op in ELEMENTWISE | MOVEMENT:
                stack.extend(m.src)
        return False

    def attempt(self, root: int, device: str, groups: list[list[int]], tile: tuple[int, int] | None,
                rows: bool = False) -> Attempt:
        """The kernel of `root` over global loops `groups` (axes of its output, each group one loop), register tile
        `tile` of the last two; `rows`: built as a row kernel (KernelBuild.row), its `misfit` where it is none (then the
        caller builds it again as any other kernel)."""
        n = self.graph[root]
        shape = n.shape
        idx: list[Lin] = [Lin({}, 0)] * len(shape)
        gvars: list[Var] = []
        uvars: list[Var] = []
        for gi, group in enumerate(groups):
            size = prod([shape[d] for d in group])
            t = tile[gi - len(groups) + 2] if tile is not None and gi >= len(groups) - 2 else 1
            if t > 1:
                g = Var(f"g{gi}", size // t)
                u = Var(f"u{gi}", t)
                gvars.append(g)
                uvars.append(u)
                gidx = var(g) * t + var(u)
            else:
                g = Var(f"g{gi}", size)
                gvars.append(g)
                gidx = var(g)
            inner = 1
            for d in reversed(group):
                idx[d] = (gidx // inner) % shape[d] if d != group[0] else gidx // inner
                inner *= shape[d]
        if tile is not None and len(gvars) > 1:  # column tiles outermost: a tile of the right operand stays in cache
            gvars[-2], gvars[-1] = gvars[-1], gvars[-2]  # over all rows
        kb = KernelBuild(self, root, device, prod(shape), gvars[-1] if rows and gvars and tile is None else None)
        value = kb.value(root, tuple(idx), Cond(), False, top=True)
        strides = contiguous_strides(shape)
        out_idx = Lin({}, 0)
        for i, s in zip(idx, strides):
            out_idx = out_idx + i * s
        k = Kernel([n.dtype, *(self.slots[s].dtype for s in kb.params)], gvars, uvars, [(out_idx, value)])
        k.work = prod(shape) * (1 + kb.reduce_work)
        if kb.row is not None:
            reduces = [v for v in toposort(value) if v.op == "reduce"]
            k.rows = bool(kb.stats) and not any(kb.row in v.vars for v in reduces)
            k.work = prod(shape) + k.points * kb.reduce_work
        return Attempt(k, kb.params, device, kb.cost, kb.load_paths, root, kb.row is not None and not k.rows)

    def check_memory(self) -> dict[str, int]:
        need: dict[str, int] = {}
        for s in self.slots:
            if s.kind != "input" and s.kind != "check":
                need[s.device] = need.get(s.device, 0) + s.nbytes
        return need

    def finish(self, target_ids: list[int]) -> ExecutionPlan:
        self.steps = merge_kernels(self.steps, lambda device, k: self.rt.device(device).render(k),
                                   lambda device: self.rt.device(device).max_buffers)
        outputs = tuple(self.done[t] for t in target_ids)
        last: dict[int, int] = {}
        for i, st in enumerate(self.steps):
            for s in (st.args if isinstance(st, KernelStep) else (st.src, st.dst)):
                last[s] = i
        out_slots = {s for s, _ in outputs} | {dst for _, dst in self.adopt}
        frees: list[list[int]] = [[] for _ in self.steps]
        for s, i in last.items():
            if self.slots[s].kind == "temp" and s not in out_slots:
                frees[i].append(s)
        slots = tuple(Slot(s.device, s.dtype, s.nbytes, "output") if i in out_slots and s.kind == "temp" else s
                      for i, s in enumerate(self.slots))
        devices = tuple(sorted({s.device for s in slots}))
        n_in = len(self.walk.leaves)
        overwrites = tuple(sorted({st.args[0] for st in self.steps
                                   if isinstance(st, KernelStep) and st.kernel.inplace and st.args[0] < n_in}))
        return ExecutionPlan(tuple(self.steps), slots, n_in, outputs, tuple(tuple(f) for f in frees), devices,
                             tuple(self.adopt), len(self.walk.scalars), overwrites, tuple(self.split_sites.values()),
                             tuple(self.checks.values()),
                             _aliased([s for s, _ in outputs], n_in, overwrites))


def _aliased(slots: list[int], n_inputs: int, overwrites: tuple[int, ...]) -> tuple[int, ...]:
    """The positions of the targets whose slot is an input's (not one an assignment writes in place: its old value's
    node goes) or another target's (ExecutionPlan.aliased)."""
    return tuple(i for i, s in enumerate(slots) if s < n_inputs and s not in overwrites or slots.count(s) > 1)


class KernelBuild:
    """Builds one kernel's value DAG by pushing index maps through movement ops down to loads."""

    def __init__(self, planner: Planner, root: int, device: str, out_numel: int, row: Var | None = None):
        self.p, self.root, self.device, self.out_numel = planner, root, device, out_numel
        self.row = row  # built as a row kernel (see row_statistic): its last global loop, which its work groups walk
        self.stats: dict[tuple, V] = {}  # a row kernel's statistics, by node and index (read inside reduces and out)
        self.vb = ValueBuilder()
        self.params: list[int] = []  # slots read, in parameter order (parameter 0 is the output)
        self.memo: dict[tuple, V] = {}
        self.contexts: dict[int, set] = {}
        self.cost = 0
        self.reduce_work = 0
        self.rcount = 0
        self.path: list[int] = []  # nodes being built, outermost first
        self.reducing: list[tuple[int, frozenset[Var], int]] = []  # reduces being built: (node, vars, size)
        self.load_paths: dict[int, tuple[int, ...]] = {}

    def load(self, nid: int, idx: tuple[Lin, ...], cond: Cond) -> V:
        n = self.p.graph[nid]
        slot, view = self.p.read_from(nid, self.device)
        if slot not in self.params:
            self.params.append(slot)
        if cond.never:
            return self.vb.const(0, n.dtype)
        off = Lin({}, view.offset)
        for i, s in zip(idx, view.strides):
            off = off + i * s
        self.cost += count_divmod(off) + sum(count_divmod(x) for x, _, _ in cond.facts)
        v = self.vb.load(self.params.index(slot) + 1, n.dtype, off, cond)
        self.load_paths.setdefault(id(v), tuple(self.path))  # the nodes it was read through, outermost first
        return v

    def value(self, nid: int, idx: tuple[Lin, ...], cond: Cond, in_reduce: bool, top: bool = False) -> V:
        key = (nid, tuple(i.key for i in idx), cond.key, in_reduce)
        got = self.memo.get(key)
        if got is not None:
            return got
        self.path.append(nid)
        try:
            v = self._value(nid, idx, cond, in_reduce, top)
        finally:
            self.path.pop()
        self.memo[key] = v
        return v

    def _value(self, nid: int, idx: tuple[Lin, ...], cond: Cond, in_reduce: bool, top: bool) -> V:
        p = self.p
        n = p.graph[nid]
        vb = self.vb
        if not top and (nid in p.done or n.buffer is not None or n.op is Op.TODEVICE or nid in p.targets):
            return self.load(nid, idx, cond)
        op = n.op
        if op is Op.CONST:
            k = p.walk.scalar_of.get(nid)
            return vb.const(n.arg, n.dtype) if k is None else vb.arg(k, n.dtype)
        multi = not top and p.walk.consumers.get(nid, 0) > 1
        if multi and nid in p.walk.heavy:  # a fused reduce below it (through any ops): compute once, not per consumer
            return self.load(nid, idx, cond)
        if op in ELEMENTWISE:
            if multi and self.second_map(nid, idx, cond) and not self.recomputable(nid):
                return self.load(nid, idx, cond)  # read under a second index map: compute it once instead
            srcs = [self.value(s, idx, cond, in_reduce) for s in n.src]
            if n.arg2 is not None and op is Op.BINARY:  # x op number: the number is a scalar argument
                k = p.walk.scalar_of.get(nid)
                dt = p.graph[n.src[0]].dtype
                srcs.append(vb.const(n.arg2, dt) if k is None else vb.arg(k, dt))
            if op is Op.CAST:
                return vb.cast(srcs[0], n.dtype)
            if op is Op.WHERE:
                return vb.where(*srcs)
            return vb.alu(n.arg, n.dtype, *srcs)
        if op is Op.GATHER:  # the index's value at this point, then x at it: one load whose address was loaded
            if multi and self.second_map(nid, idx, cond) or self.in_small_product():
                return self.load(nid, idx, cond)
            table, index = n.src
            rows = Lin({vb.index(self.value(index, idx, cond, in_reduce), p.graph[table].shape[n.arg]): 1})
            self.cost += 1
            return self.value(table, tuple(rows if a == n.arg else i for a, i in enumerate(idx)), cond, in_reduce)
        if op is Op.SCATTER or op is Op.ASSIGN or op is Op.ATTENTION:  # a kernel of its own (scatter_kernel, ...)
            return self.load(nid, idx, cond)
        src = p.graph[n.src[0]]
        if op is Op.REDUCE:
            alone = not in_reduce and p.walk.consumers.get(nid, 0) == 1 and prod(n.shape) == self.out_numel
            summed = p.split_product(nid, self.device) if alone and not top else None
            if summed is not None:  # its consumer adds up the product's parts over K (Planner.split_product)
                return self.value(summed, idx, cond, in_reduce)
            fuse = top or (alone and p.split_parts(nid, self.device) is None and not self.epilogue_of_product(nid)) \
                or (not in_reduce and nid in p.product_sums)
            if fuse:
                return self.reduce(n, idx, cond)
            if not self.row_statistic(nid, idx) and not self.statistic(nid, idx):
                return self.load(nid, idx, cond)
            if self.row is None:
                return self.reduce(n, idx, cond)
            key = (nid, tuple(i.key for i in idx), cond.key)  # (once, whether read in a reduce or out of one)
            if key not in self.stats:
                self.stats[key] = self.reduce(n, idx, cond)
            return self.stats[key]
        if op is Op.EXPAND:
            src_idx = tuple(Lin({}, 0) if s == 1 else i for i, s in zip(idx, src.shape))
            # computed once, not once per broadcast copy (matmul inputs); a single element is computed once per kernel
            # anyway (it depends on no loop), so it fuses instead of costing a kernel of its own
            if prod(n.shape) >= EXPAND_REALIZE * prod(src.shape) > EXPAND_REALIZE and p.computes(n.src[0]) \
                    and not self.prologue(n.src[0], src_idx) and not self.row_operand(n.src[0], src_idx):
                return self.load(n.src[0], src_idx, cond)
            return self.value(n.src[0], src_idx, cond, in_reduce)
        if op is Op.PERMUTE:
            new: list[Lin] = [Lin({}, 0)] * len(idx)
            for k, a in enumerate(n.arg):
                new[a] = idx[k]
            return self.value(n.src[0], tuple(new), cond, in_reduce)
        if op is Op.FLIP:
            return self.value(n.src[0], tuple(Lin({}, s - 1) - i if a in n.arg else i
                                              for a, (i, s) in enumerate(zip(idx, src.shape))), cond, in_reduce)
        if op is Op.RESHAPE:
            linear = Lin({}, 0)
            for i, s in zip(idx, contiguous_strides(n.shape)):
                linear = linear + i * s
            out = []
            for d, (size, st) in enumerate(zip(src.shape, contiguous_strides(src.shape))):
                out.append(Lin({}, 0) if size == 1 else (linear // st if d == 0 else (linear // st) % size))
            return self.value(n.src[0], tuple(out), cond, in_reduce)
        if op is Op.PAD:
            return self._pad(nid, n, src, idx, cond, in_reduce)
        raise AssertionError(f"cannot fuse {n}")

    def _pad(self, nid: int, n: Node, src: Node, idx: tuple[Lin, ...], cond: Cond, in_reduce: bool) -> V:
        """A PAD's value at `idx`: its source's where the index falls inside it (the bounds added to the condition
        its loads are guarded by), else the fill (a scalar argument where the walk made it one)."""
        p, vb = self.p, self.vb
        local = Cond()
        new = []
        for i, (b, a), size in zip(idx, n.arg, src.shape):
            x = i - b
            new.append(x)
            if b > 0 or a > 0:
                local = local.add(x, 0, size)
        k = p.walk.scalar_of.get(nid)
        fill = vb.const(n.arg2, n.dtype) if k is None else vb.arg(k, n.dtype)
        if local.never:
            return fill
        inner_cond = cond
        for x, lo, hi in local.facts:
            inner_cond = inner_cond.add(x, lo, hi)
        inner = self.value(n.src[0], tuple(new), inner_cond, in_reduce)
        if local.always:
            return inner
        self.cost += sum(count_divmod(x) for x, _, _ in local.facts)
        return vb.where(vb.cond(local, dtypes.bool), inner, fill)

    def epilogue_of_product(self, nid: int) -> bool:
        """Whether reduce `nid` is read by computation (not views alone) and is a product that the device runs best in a
        kernel of its own (Planner.tiled_product)."""
        g = self.p.graph
        return (any(g[x].op not in MOVEMENT for x in self.path[:-1]) and self.p.tiled_product(nid, self.device))

    def prologue(self, nid: int, idx: tuple[Lin, ...]) -> bool:
        """Whether operand `nid`, broadcast into the reduce being built and read at `idx`, is computed in this kernel
        (a prologue) rather than realized first: the device runs a work item (or group) per output point, as a GPU
        does, where a matrix-vector product is bound by reading its weight and the recomputation hides behind it (on
        a host device it did not: c:0, (1, 768) @ (768, 3072) 0.62 -> 1.26 ms with a layernorm prologue, x @ W.T
        0.46 -> 4.3 ms, more than the three kernels it saved); the reduce is no product that a template takes (those
        read their operands from memory: Planner.tiled_product); the operand costs at most PROLOGUE_OPS operations
        per element (prologue_ops)."""
        p = self.p
        dl = p.rt.device(self.device).dialect
        if not self.reducing or dl is None or not dl.global_ids or \
                any(p.tiled_product(r, self.device, 1 if self.alone(r) else 64) for r, _, _ in self.reducing):
            return False
        moving = frozenset().union(*(rv for _, rv, _ in self.reducing))
        return self.prologue_ops(nid, any(v in moving for i in idx for v in lin_vars(i))) <= PROLOGUE_OPS

    def in_small_product(self) -> bool:
        """Whether the kernel being built is a small-M product (its outermost reduce: Planner.small_product), whose
        loads are affine: what it would gather (a decode step's embedding under the first layernorm) is realized first,
        and the product keeps that kernel."""
        dl = self.p.rt.device(self.device).dialect
        return bool(self.reducing) and dl is not None and self.p.small_product(self.reducing[0][0], dl)

    def alone(self, nid: int) -> bool:
        """Whether node `nid`, being built, is all the kernel computes (only movement ops above it): a product alone
        takes its device's template at any K."""
        return all(self.p.graph[i].op in MOVEMENT for i in self.path[:self.path.index(nid)])

    def prologue_ops(self, nid: int, along: bool = True) -> int:
        """Operations per element of computing `nid` in a kernel: elementwise ops and reduces down to what the kernel
        loads (realized nodes, and shared nodes over a fused reduce, which get a buffer); PROLOGUE_OPS + 1 for an
        op that is a kernel of its own (attention, scatter, assignment) or, where `nid` is read `along` the enclosing
        reduce, a reduce of as many elements as `nid` (a product below a bias and an activation: those are its
        kernel's epilogue, computed once per element there rather than once per use here; a statistic read across
        the reduce is computed once per kernel point anyway)."""
        numel = prod(self.p.graph[nid].shape) if along else 0
        ops = 0
        for _, m in self.computed(nid):
            if m.op in (Op.SCATTER, Op.ASSIGN, Op.ATTENTION) or m.op is Op.REDUCE and along and prod(m.shape) >= numel:
                return PROLOGUE_OPS + 1
            ops += m.op not in MOVEMENT
            if ops > PROLOGUE_OPS:
                break
        return ops

    def computed(self, nid: int) -> Iterator[tuple[int, Node]]:
        """The nodes this kernel computes to compute `nid`, each once, depth first (a node's sources are visited after
        it is yielded): down to what it loads (realized nodes, targets, constants, transfers, and shared nodes over a
        fused reduce, which get a buffer)."""
        p, seen, stack = self.p, set(), [nid]
        while stack:
            i = stack.pop()
            if i in seen:
                continue
            seen.add(i)
            m = p.graph[i]
            if m.op is Op.CONST or p.loads(i):
                continue
            yield i, m
            stack.extend(m.src)

    def statistic(self, nid: int, idx: tuple[Lin, ...]) -> bool:
        """Whether reduce `nid`, read inside another reduce, is computed in this kernel: a statistic of a prologue
        (a row's mean or variance), read at an index that does not move with the enclosing reduce (so each kernel
        point computes it once, before that loop), of one consumer, reducing at most STAT_RATIO times as many
        elements as the enclosing reduce does per point (see prologue)."""
        if not self.reducing or self.p.walk.consumers.get(nid, 0) != 1:
            return False
        n = self.p.graph[nid]
        if self.p.split_parts(nid, self.device) is not None:
            return False
        moving = frozenset().union(*(rv for _, rv, _ in self.reducing))
        if any(v in moving for i in idx for v in lin_vars(i)):
            return False
        src_shape = self.p.graph[n.src[0]].shape
        return prod([src_shape[a] for a in n.arg[1]]) <= STAT_RATIO * self.reducing[0][2]

    def row_statistic(self, nid: int, idx: tuple[Lin, ...]) -> bool:
        """Whether reduce `nid`, read outside any reduce at `idx`, is computed in this kernel as a statistic of its row:
        the kernel is built as a row kernel (`row`: Planner.row_candidate), whose work group per point of the global
        loops but the last computes each statistic once (the existing grouped reduce, in dependence order: the
        variance after the mean it reads), then its items walk the row's points (codegen.cfamily, codegen.wgsl), so a
        layernorm, a softmax, an RMSNorm is one kernel instead of a kernel per statistic and one for the
        normalization, whose statistics make a round trip through memory. Where: `idx` does not move with the last
        loop (the statistic is the same along the row) and the reduce fits (row_reduce). The kernel is a row kernel
        only if no reduce in it moves with that loop (a product fused as the kernel's own reduce: built again as any
        other kernel, Planner.attempt); register tiles are never applied to one; a value shared by the statistics and
        the outputs (`x - mean`) is recomputed (recomputable). A statistic read inside a reduce (the mean in the
        variance) is one of the reduce's `statistic`s, as in a product's prologue."""
        if self.row is None or self.reducing or any(self.row in lin_vars(i) for i in idx):
            return False
        return self.row_reduce(nid)

    def row_reduce(self, nid: int) -> bool:
        """Whether reduce `nid` may be a statistic of the row kernel being built (row_statistic): of one consumer, not
        split in stages (split_parts), the row and the reduce at most ROW_MAX elements long (a work group's items
        take a few elements each) and the reduce at most STAT_RATIO times the row (each group computes it once)."""
        p, n, row = self.p, self.p.graph[nid], self.row
        if row is None or p.walk.consumers.get(nid, 0) != 1 or p.split_parts(nid, self.device) is not None:
            return False
        src_shape = p.graph[n.src[0]].shape
        size = prod([src_shape[a] for a in n.arg[1]])
        return row.vmax + 1 <= ROW_MAX and size <= min(ROW_MAX, STAT_RATIO * (row.vmax + 1))

    def row_operand(self, nid: int, idx: tuple[Lin, ...]) -> bool:
        """Whether operand `nid`, broadcast along the row of the row kernel being built and read at `idx` outside any
        reduce, is computed in it rather than realized first: its statistics of the row (row_statistic) and at most
        PROLOGUE_OPS operations between them and what the kernel loads (scanned as prologue_ops does)."""
        if self.row is None or self.reducing or any(self.row in lin_vars(i) for i in idx):
            return False
        ops = stats = 0
        for i, m in self.computed(nid):
            if m.op in (Op.SCATTER, Op.ASSIGN, Op.ATTENTION) or m.op is Op.REDUCE and not self.row_reduce(i):
                return False
            stats += m.op is Op.REDUCE
            ops += m.op not in MOVEMENT
            if ops > PROLOGUE_OPS:
                return False
        return stats > 0

    def recomputable(self, nid: int) -> bool:
        """Whether elementwise node `nid`, shared and read here under a second index map, is computed again rather
        than realized: inside a reduce (a prologue: `x - mean` is read by the variance and by the product) or a row
        kernel (`x - mean` read by the variance and by the output), cheap (prologue_ops)."""
        return (bool(self.reducing) or self.row is not None) and self.prologue_ops(nid) <= PROLOGUE_OPS

    def second_map(self, nid: int, idx: tuple[Lin, ...], cond: Cond) -> bool:
        """Whether node `nid`, shared by several consumers, is now read under a second index map."""
        ctx = self.contexts.setdefault(nid, set())
        ctx.add((tuple(i.key for i in idx), cond.key))
        return len(ctx) > 1

    def reduce(self, n: Node, idx: tuple[Lin, ...], cond: Cond) -> V:
        op, axes = n.arg
        src_shape = self.p.graph[n.src[0]].shape
        if any(src_shape[a] == 0 for a in axes):
            return self.vb.const(REDUCE[op][0](n.dtype), n.dtype)
        groups: list[list[int]] = []
        for a in axes:
            if groups and groups[-1][-1] == a - 1:
                groups[-1].append(a)
            else:
                groups.append([a])
        new = list(idx)
        rvars = []
        for group in groups:
            size = prod([src_shape[a] for a in group])
            rv = Var(f"r{self.rcount}", size)
            self.rcount += 1
            rvars.append(rv)
            inner = 1
            for a in reversed(group):
                new[a] = (var(rv) // inner) % src_shape[a] if a != group[0] else var(rv) // inner
                inner *= src_shape[a]
        size = prod([src_shape[a] for a in axes])
        self.reduce_work += size
        self.reducing.append((self.path[-1], frozenset(rvars), size))
        try:
            body = self.value(n.src[0], tuple(new), cond, True)
        finally:
            self.reducing.pop()
        return self.vb.reduce(op, n.dtype, body, tuple(rvars))


def _unflatten(flat: Lin, shape: Shape) -> list[Lin]:
    """The coordinates of the row-major flat index `flat` in `shape`."""
    out, inner = [], 1
    for d in reversed(range(len(shape))):
        out.append(flat // inner if d == 0 else (flat // inner) % shape[d])
        inner *= shape[d]
    return out[::-1]


# ------------------------------------------------------------------------------------------------ entry point
def make_plan(rt: Devices, graph: Graph, walk: Walk, targets: list[int], splits: dict[str, int] | None = None
              ) -> ExecutionPlan:
    """The plan of `targets`; `splits`: parts (0: none) to split the reductions of these keys into
    (search_actions.SplitSite.key), whatever the heuristics or the winner cache say (the split search's timings)."""
    with _deep_recursion(8 * len(walk.topo) + 1000):  # kernel building recurses along the graph's depth
        return _make_plan(rt, graph, walk, targets, splits)


_limits: list[int] = []  # the recursion limits asked for by planners running now (the loop's, workers'), the first
_limits_lock = threading.Lock()  # being the limit before any of them


@contextlib.contextmanager
def _deep_recursion(depth: int) -> Iterator[None]:
    """Allow `depth` frames while planning. The limit is the interpreter's, shared by threads: while planners overlap
    it is the largest any asks for, and it goes back to what it was once the last one is done."""
    with _limits_lock:
        if not _limits:
            _limits.append(sys.getrecursionlimit())
        _limits.append(depth)
        sys.setrecursionlimit(max(_limits))
    try:
        yield
    finally:
        with _limits_lock:
            _limits.remove(depth)
            sys.setrecursionlimit(max(_limits))
            if len(_limits) == 1:
                _limits.clear()


def _plan_targets(planner: Planner, targets: list[int]) -> None:
    try:
        for t in targets:
            planner.realize(t)
    finally:
        for i in planner.temp_nodes:
            planner.graph.release(i)


def _make_plan(rt: Devices, graph: Graph, walk: Walk, targets: list[int], splits: dict[str, int] | None
               ) -> ExecutionPlan:
    planner = Planner(rt, graph, walk, targets, {}, splits)
    _plan_targets(planner, targets)
    need = planner.check_memory()
    short = {d: b for d, b in need.items() if b > rt.device(d).free_memory()}
    if short:
        movable = any(not graph[i].pinned for i in walk.topo)
        for alt in rt.auto_order() if movable else []:
            if alt in short:
                continue
            override = {d: alt for d in short}
            cand = Planner(rt, graph, walk, targets, override, splits)
            _plan_targets(cand, targets)
            if all(b <= rt.device(d).free_memory() for d, b in cand.check_memory().items()):
                planner = cand
                break
        else:
            d, b = next(iter(short.items()))
            raise AllocationError(f"the plan needs {b} bytes on {d}, which has {rt.device(d).free_memory()} free; "
                                  f"no other device has room for it")
    plan = planner.finish(targets)
    debug.log(debug.PLANS, plan.describe)
    return plan
