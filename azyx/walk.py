"""The canonical walk: from a realize's targets down to realized nodes, the graph's structure as a cache key.

`canonicalize` produces a structural key (ops, args, shapes, dtypes, devices, and how inputs are shared) plus the input
leaves in a fixed order; the plan cache is keyed by it, so a repeated graph with new data or new scalar values skips
scheduling and compilation. It runs on every realize: it is written for speed.
"""

from __future__ import annotations

from functools import cached_property
from typing import Any

from azyx.dtypes import dtypes
from azyx.graph import SHARED, Graph, Node, Op, prod
from azyx.native import native


class Walk:
    """The structure of the graph below some targets: its cache key, its nodes and its input leaves."""

    def __init__(self, graph: Graph, key: tuple, topo: list[int], leaves: list[int], targets: list[int],
                 scalars: list[Any], scalar_nodes: list[int], donated: frozenset[int] = frozenset()):
        self.graph, self.key, self.topo, self.leaves, self.targets = graph, key, topo, leaves, targets
        self.scalars = scalars  # the values of the graph's scalars, in walk order: a run binds them
        self.scalar_nodes = scalar_nodes  # the node of each (a CONST's value, a PAD's fill, a BINARY's number)
        # ASSIGN nodes whose base is a realized node that nothing else holds: its buffer may be written in place
        self.donated = donated

    @cached_property
    def scalar_of(self) -> dict[int, int]:
        """Node -> its scalar's index (what planning reads; a realize of a cached plan needs only the values)."""
        return {n: k for k, n in enumerate(self.scalar_nodes)}

    @cached_property
    def consumers(self) -> dict[int, int]:
        out: dict[int, int] = {}
        for i in self.topo:
            for s in self.graph[i].src:
                out[s] = out.get(s, 0) + 1
        for t in self.targets:
            out[t] = out.get(t, 0) + 1
        return out

    @cached_property
    def heavy(self) -> set[int]:
        """Unrealized nodes above a reduce that would fuse into their kernel: costly to recompute per consumer,
        unless the reduce (or a heavy node between) has several consumers and so gets its own buffer anyway."""
        heavy: set[int] = set()
        consumers, g = self.consumers, self.graph
        for i in self.topo:
            n = g[i]
            if n.op is Op.REDUCE or any(s in heavy and consumers[s] == 1 and prod(g[s].shape) == prod(n.shape)
                                        for s in n.src):
                heavy.add(i)
        return heavy


def canonicalize(graph: Graph, targets: list[int]) -> Walk:
    """Walk from the targets down to realized nodes; the key captures ops, args, shapes, dtypes, devices, views and
    how nodes are shared (x + x differs from x + y), so equal keys mean one plan serves both graphs. A scalar (a
    CONST's value, a PAD's fill, the number of `x * 0.5`) is data, not structure: the key holds SCALAR in its place
    and the walk keeps the value (Walk.scalars), which each run binds; bool constants stay in the key (a `where` on
    one folds)."""
    if native is not None and type(graph.nodes) is list:
        return _walk_native(graph, targets)
    try:
        return _walk_recursive(graph, targets)
    except RecursionError:  # a very deep chain: the same walk with an explicit stack
        return _walk_iterative(graph, targets)


def leaf_entry(n: Node) -> tuple:
    """How a leaf looks to a plan: what the canonical walk keys it by (azyx.jit checks bound leaves with it too)."""
    v = n.view
    assert v is not None and n.buffer is not None
    return (n.shape, n.dtype, n.device, v.offset, v.strides, n.buffer.device.name)


def _walk_native(graph: Graph, targets: list[int]) -> Walk:
    """The walk in C (azyx/csrc): the same key, order and scalars as `_walk_recursive`'s, in any depth."""
    assert native is not None
    entries, tk, topo, leaves, scalars, scalar_nodes, donated = native.walk(graph.nodes, targets, graph)
    key, kept = _unshared(graph.nodes, (entries, tk), leaves, set(donated), donated) if donated else \
        ((entries, tk), frozenset())
    return Walk(graph, key, topo, leaves, targets, scalars, scalar_nodes, kept)


def _walk_recursive(graph: Graph, targets: list[int]) -> Walk:
    w = _Walker(graph)
    tk = tuple([w.index[t] if t in w.index else w.visit(t) for t in targets])
    key, donated = _unshared(graph.nodes, (tuple(w.entries), tk), w.leaves, w.donated, w.index)
    return Walk(graph, key, w.topo, w.leaves, targets, w.scalars, w.scalar_nodes, donated)


def _unshared(nodes: list[Node | None], key: tuple, leaves: list[int], donated: set[int], index: dict[int, int]
              ) -> tuple[tuple, frozenset[int]]:
    """The donated ASSIGNs whose base's buffer no other leaf of the walk reads (a realized view of it would see the
    write half done); the key names those that lose their donation for that."""
    if not donated:
        return key, frozenset()
    bufs = [id(nodes[i].buffer) for i in leaves]  # type: ignore[union-attr]
    shared = {i for i in donated if bufs.count(id(nodes[nodes[i].src[0]].buffer)) > 1}  # type: ignore[union-attr]
    if not shared:
        return key, frozenset(donated)
    return key + (tuple(sorted(index[i] for i in shared)),), frozenset(donated - shared)


SCALAR = "scalar"  # a scalar's place in the cache key
_CONST, _PAD, _ASSIGN, _BINARY = Op.CONST, Op.PAD, Op.ASSIGN, Op.BINARY  # (an enum member looked up on its class
# costs ~0.25 us)


def donates(graph: Graph, n: Node) -> bool:
    """Whether ASSIGN node `n` may write into its base's buffer: the base is realized and held by nothing but `n`
    (no handle, no other node, no tape reads the old value; Graph.id_holds read none; no other node holds its
    buffer: graph.SHARED), so no one can see it change.
    Structure: in the key."""
    b = n.src[0]
    base = graph.nodes[b]
    assert base is not None
    return base.buffer is not None and base.rc - graph.id_holds.get(b, 0) == 1 and base.buffer not in SHARED


def _entry(n: Node, i: int, srck: tuple[int, ...], scalars: list[Any], scalar_nodes: list[int]) -> tuple:
    """A node's entry in the key; its scalar, if it has one, goes to `scalars` instead."""
    op, arg, arg2 = n.op, n.arg, n.arg2
    if op is _CONST and n.dtype.kind != "b":
        scalar_nodes.append(i)
        scalars.append(arg)
        arg = SCALAR
    elif (op is _PAD and n.dtype.kind != "b") or (op is _BINARY and arg2 is not None):
        scalar_nodes.append(i)
        scalars.append(arg2)
        arg2 = SCALAR
    return (op, arg, arg2, n.shape, n.dtype, n.device, n.pinned, srck)


class _Walker:
    """The recursive walk's state (a method, not a closure that calls itself: that would be a reference cycle, and
    every realize would leave its walk for the cyclic garbage collector)."""

    def __init__(self, graph: Graph):
        self.graph, self.nodes = graph, graph.nodes
        self.index: dict[int, int] = {}
        self.entries: list[tuple] = []
        self.leaves: list[int] = []
        self.topo: list[int] = []
        self.scalars: list[Any] = []
        self.scalar_nodes: list[int] = []
        self.donated: set[int] = set()

    def visit(self, i: int) -> int:
        n = self.nodes[i]
        assert n is not None
        index, entries = self.index, self.entries
        if n.buffer is not None:
            k = index[i] = len(entries)
            entries.append(leaf_entry(n))
            self.leaves.append(i)
            return k
        # (the common arities written out: no comprehension's frame, one dict lookup per source)
        src = n.src
        if not src:
            srck: tuple[int, ...] = ()
        elif len(src) == 1:
            k0 = index.get(src[0])
            srck = (self.visit(src[0]) if k0 is None else k0,)
        elif len(src) == 2:
            s0, s1 = src
            k0 = index.get(s0)
            if k0 is None:
                k0 = self.visit(s0)
            k1 = index.get(s1)
            srck = (k0, self.visit(s1) if k1 is None else k1)
        else:
            srck = tuple([index[s] if s in index else self.visit(s) for s in src])
        k = index[i] = len(entries)
        op = n.op
        if op is _BINARY and n.arg2 is not None:  # x op number (_entry's common cases, without the call)
            self.scalar_nodes.append(i)
            self.scalars.append(n.arg2)
            entries.append((op, n.arg, SCALAR, n.shape, n.dtype, n.device, n.pinned, srck))
        elif op is _CONST and n.dtype.kind != "b":
            self.scalar_nodes.append(i)
            self.scalars.append(n.arg)
            entries.append((op, SCALAR, n.arg2, n.shape, n.dtype, n.device, n.pinned, srck))
        elif op is _CONST or op is _PAD:
            entries.append(_entry(n, i, srck, self.scalars, self.scalar_nodes))
        elif op is _ASSIGN:
            donated = donates(self.graph, n)
            if donated:
                self.donated.add(i)
            entries.append((op, n.arg, donated, n.shape, n.dtype, n.device, n.pinned, srck))
        else:
            entries.append((op, n.arg, n.arg2, n.shape, n.dtype, n.device, n.pinned, srck))
        self.topo.append(i)
        return k


def _walk_iterative(graph: Graph, targets: list[int]) -> Walk:
    nodes = graph.nodes
    index: dict[int, int] = {}
    entries: list[tuple] = []
    leaves: list[int] = []
    topo: list[int] = []
    scalars: list[Any] = []
    scalar_nodes: list[int] = []
    donated: set[int] = set()
    for t in targets:
        stack: list[tuple[int, bool]] = [(t, False)]
        while stack:
            i, done = stack.pop()
            n = nodes[i]
            assert n is not None
            if done:
                index[i] = len(entries)
                entry = _entry(n, i, tuple([index[s] for s in n.src]), scalars, scalar_nodes)
                if n.op is _ASSIGN:  # (its arg2 place holds whether it writes in place)
                    flag = donates(graph, n)
                    if flag:
                        donated.add(i)
                    entry = (n.op, n.arg, flag) + entry[3:]
                entries.append(entry)
                topo.append(i)
                continue
            if i in index:
                continue
            if n.buffer is not None:
                index[i] = len(entries)
                entries.append(leaf_entry(n))
                leaves.append(i)
                continue
            stack.append((i, True))
            for s in reversed(n.src):
                if s not in index:
                    stack.append((s, False))
    key, kept = _unshared(nodes, (tuple(entries), tuple(index[t] for t in targets)), leaves, donated, index)
    return Walk(graph, key, topo, leaves, targets, scalars, scalar_nodes, kept)


if native is not None:
    assert [d for d in dtypes.all() if d.kind == "b"] == [dtypes.bool]  # (the native walk tests for this one)
    native.setup(Op.CONST, Op.PAD, Op.ASSIGN, Op.BINARY, Op.LEAF, Op.UNARY, Op.REDUCE, Op.RESHAPE, SCALAR, dtypes.bool,
                 donates)
