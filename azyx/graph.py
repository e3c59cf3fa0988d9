"""The graph: a dense node table indexed by TensorId, with refcounts, free-list reuse and the tape hook.

Every op appends one `Node`. Shapes, dtypes and devices are computed once, when the node is made. A node
lives while tensor handles or consumer nodes reference it; releasing the last reference frees its slot and
releases its sources in turn. A live gradient tape (tape.py) holds the ids it recorded: those nodes keep their
sources when realized, and a freed id leaves every tape at once, so a reused id is never mistaken for a recorded one.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator
from enum import IntEnum
from typing import TYPE_CHECKING, Any, Protocol

from azyx.dtypes import DType
from azyx.native import native

TensorId = int
Shape = tuple[int, ...]


class Storage(Protocol):
    """What the graph knows of the memory a realized node holds (a device's Buffer, azyx.device): its size and the
    device it is on. Layers above read it as the Buffer it is."""

    nbytes: int

    @property
    def device(self) -> StorageDevice: ...


class StorageDevice(Protocol):
    name: str
    listed: bool


# buffers that more than one node holds (ExecutionPlan.aliased: a realized view of a tensor, a collective's replicas
# in memory their devices share): an assignment never writes into one in place (walk.donates), the others would see it
SHARED: weakref.WeakSet[Any] = weakref.WeakSet()

# a TODEVICE's arg (Tensor._readable_on): a kernel on a device that shares memory with the source's reads the source's
# buffer in place, with no copy (azyx.schedule.shares_memory); a copy otherwise, as a plain TODEVICE (arg None)
READ_IN_PLACE = "read in place"


class Op(IntEnum):
    CONST = 0  # arg: the value (a Python scalar); the shape is broadcast
    LEAF = 1  # holds a realized buffer (node.buffer, node.view)
    EXPAND = 2  # arg: new shape
    PERMUTE = 3  # arg: axes order
    RESHAPE = 4  # arg: new shape
    PAD = 5  # arg: ((before, after), ...) per axis, negative is a shrink; value in node.arg2
    FLIP = 6  # arg: axes
    REDUCE = 7  # arg: (op name, axes); output keeps reduced axes as size 1
    CAST = 8  # dtype in node.dtype
    UNARY = 9  # arg: op name
    # arg: op name; src (a, b), or (a,) with node.arg2 the Python number b (x * 0.5: a runtime scalar, as a CONST's
    # value is, held by the op itself: one node fewer to build, walk and free per number)
    BINARY = 10
    WHERE = 11  # cond, a, b
    TODEVICE = 12  # copy to node.device; arg READ_IN_PLACE: read in place where the devices share memory
    # src (x, index), arg: an axis a; the shape is the index's (x's number of axes, each no longer than x's but a):
    # out[p] = x[p with p[a] = index[p]], the index wrapped from the end when negative and clamped into the axis
    GATHER = 13
    # src (g, index), arg: (axis a, x's shape): the gradient of GATHER for x, a tensor of x's shape that is zero but
    # where index points: out[p with p[a] = index[p]] += g[p] (repeated indices accumulate)
    SCATTER = 14
    # src (base, value, *positions), arg: (per base axis ("slice", start, step, region axis) | ("at", k) | ("index",
    # k, region axes), the region's shape): base with the region replaced by value (of the region's shape). An "at"
    # axis is at the 0-d integer positions[k] (a Python int is a runtime scalar: a new step compiles nothing), an
    # "index" axis at positions[k] read at those region axes. Planned in place (azyx.schedule: assign_kernel): the
    # kernel writes only the region, into base's own buffer where nothing else reads base, else into a copy
    ASSIGN = 15
    # src (q, k, v, scale, [mask], [composed]), arg: (causal, mask kind: "" | "bool" | "add"): softmax(q k^T * scale +
    # mask) v over the last two axes, q (..., L, E), k (..., S, E), v (..., S, Ev) and the mask (..., L, S) expanded to
    # the output's batch axes; scale is a 0-d CONST (a runtime scalar). `composed`, where there is one, is the same
    # value built from ordinary ops: what a device without an attention kernel computes instead, and what autograd
    # differentiates (azyx.nn.scaled_dot_product_attention makes it; templates.attention renders the fused kernel)
    ATTENTION = 16


MOVEMENT = frozenset({Op.EXPAND, Op.PERMUTE, Op.RESHAPE, Op.PAD, Op.FLIP})
ELEMENTWISE = frozenset({Op.CAST, Op.UNARY, Op.BINARY, Op.WHERE})


class Node:
    __slots__ = ("op", "src", "arg", "arg2", "shape", "dtype", "device", "pinned", "rc", "buffer", "view")

    def __init__(self, op: Op, src: tuple[TensorId, ...], arg: Any, shape: Shape, dtype: DType, device: str,
                 pinned: bool, arg2: Any = None):
        self.op = op  # (one store per line: a 4-tuple's packing and unpacking cost ~40 ns a node)
        self.src = src
        self.arg = arg
        self.arg2 = arg2
        self.shape = shape
        self.dtype = dtype
        self.device = device
        self.pinned = pinned
        self.rc = 0
        self.buffer: Storage | None = None  # set when realized
        self.view: StridedView | None = None  # how the realized buffer is indexed

    def __repr__(self) -> str:
        return (f"Node({self.op.name}, src={self.src}, arg={self.arg!r}, shape={self.shape}, {self.dtype.name}, "
                f"{self.device})")


if native is not None and not TYPE_CHECKING:
    Node = native.Node  # noqa: F811 (the same fields in C: what the walk and the release read directly)


class StridedView:
    """How a realized node reads its buffer: element offset and per-axis strides (in elements)."""

    __slots__ = ("offset", "strides")

    def __init__(self, offset: int, strides: tuple[int, ...]):
        self.offset, self.strides = offset, strides

    @staticmethod
    def contiguous(shape: Shape) -> StridedView:
        return StridedView(0, contiguous_strides(shape))

    def is_contiguous(self, shape: Shape) -> bool:
        expected = contiguous_strides(shape)
        return self.offset == 0 and all(s == c or n == 1 for s, c, n in zip(self.strides, expected, shape))

    def __repr__(self) -> str:
        return f"StridedView(offset={self.offset}, strides={self.strides})"


def contiguous_strides(shape: Shape) -> tuple[int, ...]:
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= n
    return tuple(reversed(out))


def prod(xs: tuple[int, ...] | list[int]) -> int:
    out = 1
    for x in xs:
        out *= x
    return out


class Graph:
    def __init__(self) -> None:
        self.nodes: list[Node | None] = []
        self.free: list[TensorId] = []
        self.recording: list[set[TensorId]] = []  # tapes inside their `with` block: new nodes are recorded
        self.kept: list[set[TensorId]] = []  # the id sets of live tapes: realized nodes in them keep their sources
        # references (counted in rc too) that keep a node's id alive but never read its data: azyx.jit's recorder
        # holds each rebound handle's first value so; an assignment may still write over that value in place
        self.id_holds: dict[TensorId, int] = {}

    def __len__(self) -> int:
        return len(self.nodes) - len(self.free)

    def add(self, node: Node) -> TensorId:
        nodes, free = self.nodes, self.free
        for s in node.src:
            nodes[s].rc += 1  # type: ignore[union-attr]
        if free:
            i = free.pop()
            nodes[i] = node
        else:
            i = len(nodes)
            nodes.append(node)
        if self.recording:
            for ids in self.recording:
                ids.add(i)
        return i

    def __getitem__(self, i: TensorId) -> Node:
        n = self.nodes[i]
        assert n is not None, f"node {i} was released"
        return n

    def below(self, roots: Iterable[TensorId], realized: bool = True) -> Iterator[tuple[TensorId, Node]]:
        """Each node reachable from `roots`, once (depth first); `realized` False: not through a realized node's
        sources (a node on the tape keeps them)."""
        seen: set[TensorId] = set()
        stack = list(roots)
        while stack:
            i = stack.pop()
            if i in seen:
                continue
            seen.add(i)
            n = self[i]
            yield i, n
            if realized or n.buffer is None:
                stack.extend(n.src)

    def retain(self, i: TensorId) -> None:
        self.nodes[i].rc += 1  # type: ignore[union-attr]

    def hold_id(self, i: TensorId) -> None:
        self.retain(i)
        self.id_holds[i] = self.id_holds.get(i, 0) + 1

    def release_id(self, i: TensorId) -> None:
        left = self.id_holds.pop(i) - 1
        if left:
            self.id_holds[i] = left
        self.release(i)

    def release(self, i: TensorId) -> None:
        """Drop a reference to node `i`; when it was the last, free the node, then release its sources in turn."""
        if _release is not None:
            _release(self.nodes, self.free, self.kept, i)
            return
        nodes = self.nodes
        n = nodes[i]
        assert n is not None and n.rc > 0, f"release of dead node {i}"
        n.rc -= 1
        if n.rc:
            return
        kept = self.kept
        stack = [i]
        pop, push, freed = stack.pop, stack.append, self.free.append  # (a whole graph goes here after each realize)
        while stack:  # the last reference went: free the node, then release its sources in turn
            j = pop()
            n = nodes[j]
            nodes[j] = None
            freed(j)
            if kept:  # the id will be reused: it must not look recorded to any tape
                for ids in kept:
                    ids.discard(j)
            for s in n.src:  # type: ignore[union-attr]
                m = nodes[s]  # (a live source: rc counts this node's reference; None here would raise below)
                m.rc -= 1  # type: ignore[union-attr]
                if not m.rc:  # type: ignore[union-attr]
                    push(s)

    def on_tape(self, i: TensorId) -> bool:
        return any(i in ids for ids in self.kept)

    def become_leaf(self, i: TensorId, buffer: Storage, view: StridedView) -> None:
        """A realized node keeps its buffer; without a tape holding it, it forgets how it was made."""
        if _become_leaf is not None:
            _become_leaf(self.nodes, self.free, self.kept, i, buffer, view)
            return
        n = self.nodes[i]
        assert n is not None, f"node {i} was released"
        n.buffer, n.view = buffer, view
        if not n.pinned and buffer.device.listed:  # AUTO placed: the tensor is where its data ended up
            n.device = buffer.device.name
        if n.src and not (self.kept and self.on_tape(i)):
            self._forget_sources(n)

    def _forget_sources(self, n: Node) -> None:
        src, n.src, n.op, n.arg, n.arg2 = n.src, (), Op.LEAF, None, None
        for s in src:
            self.release(s)

    def add_tape(self, ids: set[TensorId]) -> None:
        self.kept = [*self.kept, ids]

    def drop_tape(self, ids: set[TensorId]) -> None:
        """A tape is gone (or released): stop recording into `ids`, and let the realized nodes it kept forget their
        sources (unless another live tape holds them), so the graph shrinks back."""
        self.kept = [s for s in self.kept if s is not ids]  # by identity: two tapes may hold equal sets
        self.recording = [s for s in self.recording if s is not ids]
        todo = list(ids)
        ids.clear()
        nodes = self.nodes
        for i in todo:
            n = nodes[i]
            if n is not None and n.buffer is not None and n.src and not self.on_tape(i):
                self._forget_sources(n)


_release = native.release if native is not None else None
_become_leaf = native.become_leaf if native is not None else None

GRAPH = Graph()  # the process's one graph: every tensor's node (it outlives runtime restarts)


class ChainWatch:
    """Warns once (LazyChainWarning) about a lazy chain that grows across realizes without being realized: the
    optimiser step whose result is never realized (`opt.step(grads)` while only the loss is), whose parameters become
    an ever-longer chain that every step plans, compiles and computes again. Told of each walk that needs a new plan
    (never of a cached plan's run: no cost there), it counts per unrealized node the walks it was in; a node computed
    by `every` such walks while the walks grew `growth`-fold since its first is such a chain. The warning names the
    user's line of the realize that first computed it without keeping it (`site`, asked once per new plan). A node is
    known by its id, its object's and its sources (ids and objects are reused); the walk must have grown by `least`
    nodes too (small graphs rebuilt in a loop reuse ids, and a few nodes more cost nothing)."""

    def __init__(self, every: int = 8, growth: float = 1.5, least: int = 64):
        self.every, self.growth, self.least = every, growth, least
        # id -> ((id of the Node, its sources), walks, first size, site)
        self.seen: dict[TensorId, tuple[tuple[int, tuple[TensorId, ...]], int, int, int]] = {}
        self.sites: dict[int, tuple[str, int]] = {}  # walk number -> (file, line) of its realize's caller
        self.walks = 0
        self.warned = False

    def note(self, nodes: list[Node | None], topo: list[TensorId], site: Any) -> None:
        """A new plan's walk over `topo` (the unrealized nodes it computes); `site()`: its realize's user frame."""
        if self.warned or not topo:
            return
        self.walks += 1
        size, walk, seen, worst = len(topo), self.walks, self.seen, None
        for i in topo:
            n = nodes[i]
            assert n is not None
            who = (id(n), n.src)
            e = seen.get(i)
            if e is not None and e[0] == who:
                e = seen[i] = (who, e[1] + 1, e[2], e[3])
                if e[1] >= self.every and size >= max(self.growth * e[2], e[2] + self.least) and \
                        (worst is None or e[1] > worst[1]):
                    worst = e
            else:
                seen[i] = (who, 1, size, walk)
        if walk not in self.sites:
            self.sites[walk] = site()
        if worst is not None:
            file, line = self.sites.get(worst[3], ("<unknown>", 0))
            self.warned, self.seen, self.sites = True, {}, {}
            import warnings

            from azyx.errors import LazyChainWarning

            warnings.warn_explicit(
                f"a lazy chain has been computed by {worst[1]} realizes without being realized, and grows ({worst[2]} "
                f"ops to compute at first, {size} now; every one plans and compiles anew): realize what builds on "
                f"itself, e.g. `await azyx.realize(*opt.step(grads))` (or `azyx.realize(loss, *opt.step(grads))`), "
                f"not only the loss. It was first computed without being kept by the realize here.",
                LazyChainWarning, file, line)
            return
        if len(seen) > 4 * size + 65536:  # (freed nodes' entries)
            self.seen = {i: e for i, e in seen.items() if i < len(nodes) and (n := nodes[i]) is not None
                         and e[0] == (id(n), n.src)}
            keep = {e[3] for e in self.seen.values()}
            self.sites = {w: s for w, s in self.sites.items() if w in keep}


def user_site() -> tuple[str, int]:
    """(file, line) of the innermost frame outside azyx and the standard library's asyncio: the user's call."""
    import os
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    f = sys._getframe(1)
    while f is not None:
        name = f.f_code.co_filename
        if not name.startswith(here) and f"{os.sep}asyncio{os.sep}" not in name and not name.startswith("<frozen"):
            return name, f.f_lineno
        f = f.f_back  # type: ignore[assignment]
    return "<unknown>", 0


CHAINS = ChainWatch()


class GraphCopy(Graph):
    """A private copy of some nodes of a graph, for planning on a worker thread: the loop thread goes on mutating the
    graph meanwhile (new nodes, released ones, nodes other realizes turn into leaves), so the planner must read nodes
    as they were when the plan was asked for. Nodes the planner adds (split reductions) live only here, under ids past
    the graph's, and last as long as the copy."""

    def __init__(self, graph: Graph, ids: list[TensorId]):
        super().__init__()
        self.copies: dict[TensorId, Node] = {}
        for i in ids:
            n = graph[i]
            c = self.copies[i] = Node(n.op, n.src, n.arg, n.shape, n.dtype, n.device, n.pinned, n.arg2)
            c.buffer, c.view = n.buffer, n.view
        self.next_id = len(graph.nodes)

    def __len__(self) -> int:
        return len(self.copies)

    def add(self, node: Node) -> TensorId:
        i = self.next_id
        self.next_id += 1
        self.copies[i] = node
        return i

    def __getitem__(self, i: TensorId) -> Node:
        return self.copies[i]

    def retain(self, i: TensorId) -> None:
        pass

    def release(self, i: TensorId) -> None:
        pass


def view_through(n: Node, src_shape: Shape, v: StridedView) -> StridedView | None:
    """The view that movement node `n` makes of its source's view `v`, or None when it is not a strided view (a pad
    that adds elements, a reshape that needs a copy)."""
    if n.op is Op.PAD and any(b > 0 or a > 0 for b, a in n.arg):
        return None
    st, off = list(v.strides), v.offset
    if n.op is Op.EXPAND:
        st = [0 if s != o else x for x, s, o in zip(st, src_shape, n.shape)]
    elif n.op is Op.PERMUTE:
        st = [st[a] for a in n.arg]
    elif n.op is Op.FLIP:
        for a in n.arg:
            off += (src_shape[a] - 1) * st[a]
            st[a] = -st[a]
    elif n.op is Op.PAD:
        for a, (b, _) in enumerate(n.arg):
            off += -b * st[a]
    else:
        new = reshape_strides(src_shape, tuple(st), n.shape)
        if new is None:
            return None
        st = list(new)
    return StridedView(off, tuple(st))


def reshape_strides(old: Shape, strides: tuple[int, ...], new: Shape) -> tuple[int, ...] | None:
    """Strides that read `old` (laid out with `strides`) as shape `new` without a copy, or None when the
    reshape needs one (numpy's no-copy reshape: each run of merged or split dims must be contiguous)."""
    if prod(old) == 0:
        return contiguous_strides(new)
    o = [(s, st) for s, st in zip(old, strides) if s != 1]
    res = [0] * len(new)
    oi = ni = 0
    while oi < len(o) and ni < len(new):
        nsize, osize = new[ni], o[oi][0]
        nj, oj = ni + 1, oi + 1
        while nsize != osize:  # grow the smaller side until both runs hold the same elements
            if nsize < osize:
                nsize *= new[nj]
                nj += 1
            else:
                osize *= o[oj][0]
                oj += 1
        if any(o[k][1] != o[k + 1][0] * o[k + 1][1] for k in range(oi, oj - 1)):
            return None
        acc = o[oj - 1][1]
        for k in range(nj - 1, ni - 1, -1):
            res[k] = acc
            acc *= new[k]
        oi, ni = oj, nj
    return tuple(res)  # trailing new dims are size 1: any stride reads them
