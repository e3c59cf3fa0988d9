"""Reverse-mode autograd on the one graph: the backward walk and the gradient rule of every non-elementwise node kind.

Elementwise rules (UNARY, BINARY) live beside their forward references in ops.py; the rules here are for movement,
reduce, cast, where, gather/scatter and device copies. Every rule builds its gradient from ordinary Tensor ops, so
gradients are lazy, fuse with the forward pass into one plan, and can themselves be differentiated by an outer tape.

Conventions (documented once, here):
- Only float nodes carry gradients. Integer and bool results (comparisons, argmax, casts to int, bitwise ops) and the
  piecewise-constant ops (sign, floor, ceil, round, floordiv) pass no gradient: their rule is None.
- Ties: max/min reductions and maximum/minimum split the gradient equally among the tied elements (PyTorch's rule
  for amax/amin and maximum/minimum; PyTorch's max_pool2d instead gives a tied window's gradient to one element).
  relu'(0) = 0 and |x|'(0) = 0, like PyTorch.
- prod: the gradient is the product of the other elements, exact with zeros in the input.
- A source not reached from the target through recorded nodes gets zeros.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from azyx.errors import DTypeError, ShapeError
from azyx.graph import GRAPH, Node, Op
from azyx.ops import BINARY, UNARY
from azyx.tensor import Tensor

Grads = tuple[Tensor | None, ...]


def _expand_grad(n: Node, out: Tensor, src: list[Tensor], g: Tensor, need: tuple[bool, ...]) -> Grads:
    shape = src[0].shape  # an expand keeps the number of axes: its gradient sums g over the broadcast ones
    axes = tuple([a for a, (s, o) in enumerate(zip(shape, n.shape)) if s != o])
    return (g._new(Op.REDUCE, (g.id,), ("sum", axes), shape, g.dtype),)


def _permute_grad(n: Node, out: Tensor, src: list[Tensor], g: Tensor, need: tuple[bool, ...]) -> Grads:
    inverse = [0] * len(n.arg)
    for k, a in enumerate(n.arg):
        inverse[a] = k
    return (g.permute(*inverse),)


def _reduce_grad(n: Node, out: Tensor, src: list[Tensor], g: Tensor, need: tuple[bool, ...]) -> Grads:
    op, axes = n.arg  # the node keeps reduced axes as size 1, so g broadcasts back over them
    x = src[0]
    if op == "sum":
        return (g._broadcast_to(x.shape),)
    if op in ("max", "min"):  # ties share the gradient equally
        hit = x == out
        count = hit.cast(g.dtype).sum(axes, keepdim=True)
        return (Tensor.where(hit, g / count, 0.0),)
    assert op == "prod", op
    zero = x == 0
    safe = Tensor.where(zero, 1.0, x)
    others = safe.prod(axes, keepdim=True)  # the product of the nonzero elements
    zeros = zero.sum(axes, keepdim=True)
    local = Tensor.where(zeros == 0, others / safe, Tensor.where((zeros == 1) & zero, others, 0.0))
    return (g * local,)


def _binary_grad(n: Node, out: Tensor, src: list[Tensor], g: Tensor, need: tuple[bool, ...]) -> Grads:
    _, _, ga, gb = BINARY[n.arg]
    if len(src) == 1:  # x op number (the node's arg2): no gradient for the number
        a = src[0]
        return (ga(a, a._const_like(n.arg2), out, g) if need[0] and ga else None,)
    a, b = src
    return (ga(a, b, out, g) if need[0] and ga else None, gb(a, b, out, g) if need[1] and gb else None)


def _unary_grad(n: Node, out: Tensor, src: list[Tensor], g: Tensor, need: tuple[bool, ...]) -> Grads:
    rule = UNARY[n.arg][2]
    return (rule(src[0], out, g) if rule else None,)


def _assign_grad(n: Node, out: Tensor, src: list[Tensor], g: Tensor, need: tuple[bool, ...]) -> Grads:
    """The base gets g but where the region was overwritten, the value gets g read at the region."""
    positions = src[2:]
    gb = g._assign_node(g._const_like(0.0, shape=n.arg[1]), positions, n.arg) if need[0] else None
    return (gb, g._region(n.arg, positions) if need[1] else None, *(None for _ in positions))


Rule = Callable[[Node, Tensor, list[Tensor], Tensor, tuple[bool, ...]], Grads]

# node kind -> rule(node, out, sources, g, which sources need a gradient) -> one gradient (or None) per source.
# CONST and LEAF have no sources.
RULES: dict[Op, Rule] = {
    Op.EXPAND: _expand_grad,  # sum over the broadcast axes
    Op.PERMUTE: _permute_grad,  # the inverse permutation
    Op.RESHAPE: lambda n, out, src, g, need: (g._reshaped(src[0].shape),),
    Op.PAD: lambda n, out, src, g, need: (g.pad(tuple((-b, -a) for b, a in n.arg)),),  # pad <-> shrink
    Op.FLIP: lambda n, out, src, g, need: (g.flip(n.arg),),
    Op.REDUCE: _reduce_grad,
    Op.CAST: lambda n, out, src, g, need: (g.cast(src[0].dtype),),  # float -> float only (others carry none)
    Op.UNARY: _unary_grad,
    Op.BINARY: _binary_grad,
    Op.WHERE: lambda n, out, src, g, need: (None, Tensor.where(src[0], g, 0.0) if need[1] else None,
                                            Tensor.where(src[0], 0.0, g) if need[2] else None),
    Op.TODEVICE: lambda n, out, src, g, need: (g.to(src[0].device),),
    # a gather's gradient adds g up at the rows it read (repeated rows accumulate); the index carries none
    Op.GATHER: lambda n, out, src, g, need: (g._scattered(n.arg, src[1], src[0].shape), None),
    Op.SCATTER: lambda n, out, src, g, need: (g._gathered(n.arg[0], src[1]), None),
    Op.ASSIGN: _assign_grad,
    # attention: g flows into its composed form (its last source, made whenever a tape records), and on from there
    Op.ATTENTION: lambda n, out, src, g, need: (*(None for _ in src[:-1]), g),
}


def _seed(target: Tensor, seed: Any) -> Tensor:
    if seed is None:
        if target.shape:
            raise ShapeError(f"gradient of a non-scalar target of shape {target.shape} needs an explicit seed "
                             f"(the upstream gradient, of shape {target.shape})")
        return target._const_like(1.0)
    s = seed if isinstance(seed, Tensor) else Tensor(seed, dtype=target.dtype, device=target.device)
    if s.shape != target.shape:
        raise ShapeError(f"gradient seed of shape {s.shape} does not match the target's shape {target.shape}")
    return s.cast(target.dtype)


def _order(recorded: set[int], target: int, source_ids: set[int]) -> tuple[list[int], set[int]]:
    """Recorded nodes below the target in topological order (sources first), and those that lead to a source."""
    nodes = GRAPH.nodes
    post: list[int] = []
    seen: set[int] = {target}
    stack = [(target, iter(nodes[target].src if target in recorded else ()))]  # type: ignore[union-attr]
    while stack:  # depth first, each node's sources iterated in place (no per-edge stack entries)
        i, it = stack[-1]
        for s in it:
            if s not in seen:
                seen.add(s)
                stack.append((s, iter(nodes[s].src if s in recorded else ())))  # type: ignore[union-attr]
                break
        else:
            stack.pop()
            post.append(i)
    needs: set[int] = set()
    for i in post:
        n = nodes[i]
        assert n is not None
        if n.dtype.kind == "f" and (i in source_ids or (i in recorded and not needs.isdisjoint(n.src))):
            needs.add(i)
    return post, needs


def _handle(handles: dict[int, Tensor], i: int) -> Tensor:
    t = handles.get(i)
    if t is None:
        t = handles[i] = Tensor._wrap(i)
    return t


def gradient(recorded: set[int], target: Tensor, sources: list[Tensor], seed: Any = None) -> list[Tensor]:
    """The backward walk: reverse topological order from `target` over `recorded` nodes, accumulating each node's
    gradient and pushing it to its sources through RULES. Returns one lazy gradient per source."""
    for t in sources:
        if not isinstance(t, Tensor):
            raise DTypeError(f"gradient sources must be Tensors, got {type(t).__name__}")
    if not isinstance(target, Tensor):
        raise DTypeError(f"gradient target must be a Tensor, got {type(target).__name__}")
    if not target.dtype.is_float:
        raise DTypeError(f"gradient target must be a float tensor, got {target.dtype.name}")
    g0 = _seed(target, seed)
    source_ids = {t.id for t in sources}
    post, needs = _order(recorded, target.id, source_ids)
    grads: dict[int, Tensor] = {target.id: g0} if target.id in needs else {}
    nodes = GRAPH.nodes
    handles: dict[int, Tensor] = {}  # one handle per node for the walk (a node is one op's output, others' input)
    for i in reversed(post):
        g = grads.get(i)
        if g is None or i not in recorded:
            continue
        n = nodes[i]
        assert n is not None
        rule = RULES.get(n.op)
        if rule is None or not n.src:
            continue
        need = tuple([s in needs for s in n.src])
        if True not in need:
            continue
        out = _handle(handles, i)
        inputs = [_handle(handles, s) for s in n.src]
        for s, gs in zip(n.src, rule(n, out, inputs, g, need)):
            if gs is None or s not in needs:
                continue
            prev = grads.get(s)
            grads[s] = gs if prev is None else prev + gs
        if i not in source_ids:
            del grads[i]  # no longer needed: let its nodes go as soon as nothing else holds them
    return [grads[t.id] if t.id in grads else t._const_like(0.0 if t.dtype.is_float else 0) for t in sources]


class no_grad(contextlib.ContextDecorator):
    """`with azyx.no_grad():` (or `@azyx.no_grad()` on a plain function): the ops built inside are recorded by no
    GradientTape, so no gradient flows through them and the tapes keep nothing for them (PyTorch's `torch.no_grad`;
    an evaluation pass inside a training tape). Tapes entered inside the block record as usual.

    >>> import azyx
    >>> from azyx import GradientTape, Tensor
    >>> x = Tensor([2.0])
    >>> with GradientTape() as tape:
    ...     with azyx.no_grad():
    ...         scale = x * 10
    ...     y = (x * scale).sum()
    >>> tape.gradient(y, x).numpy_sync().tolist()
    [20.0]
    """

    def __enter__(self) -> no_grad:
        self._saved, GRAPH.recording = GRAPH.recording, []
        return self

    def __exit__(self, *exc: object) -> None:
        GRAPH.recording = self._saved
