"""`azyx.jit`: a function's graph is built and planned once; later calls run its plan again with new inputs.

    @azyx.jit
    def train_step(x, y):
        with GradientTape() as tape:
            loss = nn.cross_entropy(model(x), y)
        opt.step(tape.gradient(loss, opt.params))
        return loss

    loss = await train_step(x, y)  # realized

The first call with a new signature (the shapes, dtypes, devices and layouts of the tensor arguments, the values of
the others, and the training mode) runs the function, which builds a lazy graph, and realizes what it returns
together with every tensor it rebound (`Tensor.assign`: an optimiser's parameters and state), in one plan: the
trace. A later call with that signature does not run the function. It binds the trace's plan to this call's
tensors and submits it, makes the results leaves and rebinds the same handles to them, like the function would
have. What it skips is the Python work: building the graph, the canonical walk that finds the cached plan, and
turning the targets into leaves.

What the function reads, on a replay:
- its tensor arguments: this call's;
- tensors it rebinds: their current value (so an optimiser's parameters and state move on from call to call);
- random tensors it draws (`Tensor.rand`, `randn`, `uniform`, `dropout`): new numbers from azyx's generator, drawn
  in the same order as the function draws them, so a replay gives what a call of the function would;
- any other tensor (a closure's tensor, a constant made inside): its value at the trace, like a constant of
  `jax.jit`. A tensor that changes between calls must be an argument, or be rebound by the function.
Python numbers: a float or int argument is traced (azyx.traced): it reaches the graph as a scalar, a kernel argument,
so a new value replays the same plan; arithmetic on it inside the function is traced too (`lr * 0.5`), and a decision
Python makes from it (a comparison, an `int()`, a shape) is guarded: a replay whose numbers decide differently traces
again. Arguments named in `static_argnames` (as in `jax.jit`), bools and other values are part of the signature.
A number read from an object that outlives the call is a constant of the trace, except where the reader marks it
`traced.bound(obj, name)`: an optimiser's hyper-parameters are, so a replay binds the `opt.lr` a schedule just set.
Python control flow runs once, at the trace: a branch on an argument's value is a guard, or make the argument static.
Python state the graph depends on is guarded: the training mode of each `nn.Dropout` the function ran (set by
`Module.train()`/`eval()`) is checked on a replay, which traces again when it differs.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Sequence
from operator import is_
from typing import Any

from azyx import debug
from azyx.device import Buffer, Device, buffer_of
from azyx.errors import ArgumentError
from azyx.graph import GRAPH, Node
from azyx.plan import ExecutionPlan
from azyx.realize import done, realize, run_plan, submit, wait_for
from azyx.tensor import Tensor
from azyx.traced import TracedFloat, TracedInt, evaluate, evaluate_recipe, recording, structure
from azyx.walk import Walk, leaf_entry

MAX_TRACES = 32  # signatures kept per function (the oldest is dropped)

ARG, STATE, DRAWN, CONST = range(4)  # where a trace's leaf comes from on a replay
KEPT = -2  # (a replay's result that is a handle keeping its node: `Trace.steps`)

_JITTED: weakref.WeakSet[jit] = weakref.WeakSet()  # every live jitted function (azyx.stats counts their traces)


def trace_count() -> int:
    """Traces held by all live jitted functions."""
    return sum(len(f.traces) for f in list(_JITTED))


class Recorder:
    """What a function does while it is traced, besides building nodes: the handles it rebinds (with the node each
    held first, kept until the trace is made so that its id is not reused meanwhile) and the random tensors it draws
    (by the buffer they were drawn into: their nodes may be gone by the time the trace is made, and an upload gives
    a node another buffer), with how to draw them again. Set as `Tensor.tracer`."""

    def __init__(self) -> None:
        self.rebound: dict[Tensor, int] = {}  # handle -> the node it held when the function first rebound it
        self.drawn: list[tuple[Buffer, Callable[[], Tensor]]] = []
        self.guards: list[tuple[Callable[[], Any], Any]] = []  # Python state the graph depended on, and its value

    def guard(self, read: Callable[[], Any], value: Any) -> None:
        """The graph built depends on `read()` being `value` (a module's training mode): a replay checks it."""
        self.guards.append((read, value))

    def rebinding(self, handle: Tensor) -> None:
        """Note that `handle` is rebound by the traced function (`Tensor.assign`), keeping the node it held first."""
        if handle not in self.rebound:
            self.rebound[handle] = handle.id
            GRAPH.hold_id(handle.id)  # (its id, not its data: an in-place assignment may overwrite it)

    def draw(self, t: Tensor, again: Callable[[], Tensor]) -> None:
        """Note a random tensor `t` drawn by the traced function, with `again`, which draws its next value for a
        replay."""
        self.drawn.append((buffer_of(t._node), again))

    def close(self) -> None:
        """Let go of what the trace kept (the rebound handles' first nodes, the draws, the guards)."""
        for i in self.rebound.values():
            GRAPH.release_id(i)
        self.rebound.clear()
        self.drawn.clear()
        self.guards.clear()


async def _place_constants(roots: list[Tensor], tensors: list[Tensor], rec: Recorder) -> None:
    """Host data that the traced function made for a device (`Tensor.arange`, a table from numpy: a leaf held in host
    memory until a plan uploads it) goes to its device now, once: the trace's plan then binds the device's copy, and
    a replay uploads none of it (an argmax's index ramp over GPT-2's vocabulary was 201 KB a decode step). Not the
    call's arguments, its handles' values, or random draws (each replay has its own)."""
    skip = {t.id for t in tensors} | set(rec.rebound.values())
    drawn = {id(b) for b, _ in rec.drawn}
    found = [i for i, n in GRAPH.below([t.id for t in roots], realized=False)
             if (b := n.buffer) is not None and b.device.name != n.device and isinstance(b.device, Device)
             and b.device.host_memory and b.nbytes and i not in skip and id(b) not in drawn]
    if found:  # (a one-element view of each: realizing it uploads the leaf, which keeps the upload)
        await realize(*[Tensor._wrap(i).reshape(-1)[:1] for i in found])


class Trace:
    """One signature's plan, and where each of its leaves and results comes from on a replay."""

    def __init__(self, plan: ExecutionPlan | None, sources: list[tuple[int, Any]], checks: list[tuple[int, tuple]],
                 results: list[tuple[int, Any]], targets: list[tuple[Any, ...]], handles: list[Tensor],
                 handle_results: list[int], output: Callable[[list[Tensor]], Any],
                 drawn: list[Callable[[], Tensor]], guards: list[tuple[Callable[[], Any], Any]],
                 token: object = None, scalars: list[Any] | None = None,
                 scalar_guards: list[tuple[tuple, Any]] | None = None, views: list[Any] | None = None):
        self.plan = plan
        self.token = token  # the traced numbers' trace
        self.scalars = scalars or []  # the plan's scalars at the trace: constants, or traced numbers computed anew
        # the traced numbers among them, each once (many kernels take the same one: an optimiser's rate), and per
        # scalar that is one, (its index, its number's index): a replay computes each number once
        self.numbers: list[Any] = []
        self.traced: list[tuple[int, int]] = []
        first: dict[Any, int] = {}
        for i, s in enumerate(self.scalars):
            if isinstance(s, TracedFloat | TracedInt):
                k = first.setdefault(structure(s), len(self.numbers))
                if k == len(self.numbers):
                    self.numbers.append(s)
                self.traced.append((i, k))
        self.scalar_guards = scalar_guards or []  # (recipe, value): decisions made from traced numbers
        self.guards = guards  # (read, value): the replay fits only while each read() gives its value
        self.sources = sources  # per leaf of the plan: (ARG, argument index) | (STATE, handle index) | (DRAWN, draw
        #                         index) | (CONST, the buffer bound at the trace)
        # a replay's bindings start as the constants' buffers (None where a leaf is looked up each call: `live`, by
        # position), so a trace of many constants (a model's weights) costs a replay one list copy for them
        self.constants: list[Any] = [x if kind == CONST else None for kind, x in sources]
        self.live = [(i, kind, x) for i, (kind, x) in enumerate(sources) if kind != CONST]
        # the same split once for the replay: the leaves bound to arguments, by (leaf, argument index), and the rest
        self.live_args = [(i, x) for i, kind, x in self.live if kind == ARG]
        self.live_other = [(i, kind, x) for i, kind, x in self.live if kind != ARG]
        self.no_nodes: list[Any] = [None] * len(sources)  # (a replay's nodes per leaf start as a copy of it)
        self.checks = checks  # per STATE leaf: (handle index, how its value must look for the plan to fit it)
        self.checked: list[Any] = []  # the nodes a replay found to fit (`checks`), in their order
        self.results = results  # per result: (-1, target index) or a leaf source
        self.targets = targets  # per target of the plan: (shape, dtype, device, pinned) of its leaf
        self.handles = handles  # the handles the function rebinds ...
        self.handle_results = handle_results  # ... and the result each one is rebound to
        self.output = output  # the function's results (tensors) -> what it returned (their structure)
        self.drawn = drawn
        # the handles whose new value the plan writes in place into the buffer they hold (a KV cache's tensors): per
        # such target, its handle's index. A replay leaves those handles on the node they hold (the same buffer,
        # seen the same way: nothing to rebind), and a result that is one of them is its handle's node
        self.kept: dict[int, int] = {}
        if plan is not None:
            n_out = len(results) - len(handles)
            for k, (kind, x) in enumerate(results[n_out:]):
                slot = plan.outputs[x][0] if kind == -1 else -1
                if 0 <= slot < plan.n_inputs and slot in plan.overwrites and sources[slot] == (STATE, k) and \
                        x not in self.kept and views is not None and _same_view(plan.outputs[x][1], views[slot]):
                    self.kept[x] = k
        self.rebind = [(h, r) for k, (h, r) in enumerate(zip(handles, handle_results)) if k not in self.kept.values()]
        # the common case, decided once: the results are the plan's targets, each once and in order, and no handle is
        # rebound (a replay's results are then the new leaves it made, as they are)
        self.plain = plan is not None and not handles and results == [(-1, k) for k in range(len(targets))]
        # `results` as a replay reads them: a handle's result that keeps its node (`kept`) marked KEPT
        n_out = len(results) - len(handles)
        self.steps = [(KEPT, x) if j >= n_out and kind == -1 and x in self.kept else (kind, x)
                      for j, (kind, x) in enumerate(results)]


class jit:  # noqa: N801  (a decorator, named like a function: azyx.jit)
    """Trace `fn` on its first call with each signature, replay the trace on later calls (module docstring).
    `@azyx.jit` or `@azyx.jit(static_argnames=("n",))`."""

    def __new__(cls, fn: Callable[..., Any] | None = None, *, static_argnames: Sequence[str] | str = ()) -> Any:
        if fn is None:
            return functools.partial(jit, static_argnames=static_argnames)
        return super().__new__(cls)

    def __init__(self, fn: Callable[..., Any] | None = None, *, static_argnames: Sequence[str] | str = ()):
        import inspect

        assert fn is not None
        if inspect.iscoroutinefunction(fn):
            raise ArgumentError(f"azyx.jit needs a function that builds a lazy graph, not a coroutine function "
                                f"({fn.__qualname__}): it realizes what the function returns itself")
        static = {static_argnames} if isinstance(static_argnames, str) else set(static_argnames)
        try:
            names = list(inspect.signature(fn).parameters)
        except (TypeError, ValueError):
            names = []
        unknown = static - set(names) if names else set()
        if unknown:
            raise ArgumentError(f"static_argnames {sorted(unknown)} are not parameters of {fn.__qualname__}")
        # positions and names of static arguments (a positional argument is known by its index)
        self.static = static | {i for i, name in enumerate(names) if name in static}
        self.fn = fn
        self.traces: dict[tuple, Trace] = {}
        self.replays = 0  # calls answered by a replay (for tests and debugging)
        self.layouts: dict[tuple, jit] = {}  # flattened arguments' layout -> the jit over their tensors
        functools.update_wrapper(self, fn)
        _JITTED.add(self)

    def __get__(self, obj: Any, cls: Any = None) -> Any:
        """On a class: a method, whose instance is a static argument."""
        return self if obj is None else functools.partial(self.__call__, obj)

    async def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Coroutine: run the function (traced on a new signature, else its trace replayed) and return its results
        realized."""
        return await self._call(args, kwargs, True)

    async def submit(self, *args: Any, **kwargs: Any) -> Any:
        """Coroutine: as calling it, but a replay returns its results once their work is queued, not done: reading
        one (`numpy()`, `item()`) then waits for the work and the read together, on a GPU one round trip instead of
        two, and the work's failure is raised there. A call that traces waits as `__call__` does."""
        return await self._call(args, kwargs, False)

    async def _call(self, args: tuple, kwargs: dict[str, Any], wait: bool) -> Any:
        for a in args:
            if type(a) is not Tensor and hasattr(type(a), "jit_flatten"):  # (a missing attribute costs ~0.25 us)
                return await self._call_flattened(args, kwargs, wait)
        nodes = GRAPH.nodes
        named = (*enumerate(args), *sorted(kwargs.items())) if kwargs else tuple(enumerate(args))
        tensors: list[Tensor] = []
        lazy: list[Tensor] = []
        for _, a in named:  # (a loop: a comprehension is a call of its own on Python 3.11)
            if isinstance(a, Tensor):
                tensors.append(a)
                if nodes[a.id].buffer is None:  # type: ignore[union-attr]
                    lazy.append(a)
        if lazy:  # arguments are leaves of the trace: realize them first
            await submit(lazy)
        key, numbers = self._signature(named)
        trace = self.traces.get(key)
        if trace is not None:
            if trace.handles and (handles := [h for h in trace.handles if nodes[h.id].buffer is None]):  # type: ignore[union-attr]
                await submit(handles)  # (rebound outside the function since: their new values first)
            replay = self._replay(trace, tensors, numbers)
            if replay is not None:
                self.replays += 1
                results, plan = replay
                bufs = []
                for t in results:
                    bufs.append(nodes[t.id].buffer)  # type: ignore[union-attr]
                if wait and not done(bufs):  # type: ignore[arg-type]  # (a small plan that ran inline is done by now)
                    await wait_for(bufs, plan)  # type: ignore[arg-type]
                return trace.output(results)
        return await self._trace(key, args, kwargs, tensors, numbers)

    async def _call_flattened(self, args: tuple, kwargs: dict[str, Any], wait: bool = True) -> Any:
        """A call with arguments made of tensors (a ShardedTensor: its `jit_flatten()` gives its tensors, a hashable
        layout and how to rebuild it from tensors): they pass as their tensors to a jit of its own per layout, and
        the function sees them rebuilt (replays bind the tensors like any argument)."""
        flat: list[Any] = []
        spec: list[tuple[int, Any]] = []  # per argument: (how many tensors it flattened to (0: itself), layout)
        rebuilds: list[Callable[[list[Any]], Any] | None] = []
        static_at: set[int] = set()
        for i, a in enumerate(args):
            if hasattr(type(a), "jit_flatten"):
                parts, layout, rebuild = a.jit_flatten()
                spec.append((len(parts), layout))
                rebuilds.append(rebuild)
                flat.extend(parts)
            else:
                if i in self.static:
                    static_at.add(len(flat))
                spec.append((0, None))
                rebuilds.append(None)
                flat.append(a)
        key = tuple(spec)
        inner = self.layouts.get(key)
        if inner is None:
            fn = self.fn

            def rebuilt(*xs: Any, **kw: Any) -> Any:
                out, j = [], 0
                for (n, _), rebuild in zip(spec, rebuilds):
                    if rebuild is None:
                        out.append(xs[j])
                        j += 1
                    else:
                        out.append(rebuild(list(xs[j:j + n])))
                        j += n
                return fn(*out, **kw)

            functools.update_wrapper(rebuilt, fn)
            inner = self.layouts[key] = jit(rebuilt)
            inner.static = static_at | {k for k in self.static if isinstance(k, str)}
        before = inner.replays
        try:
            return await inner._call(tuple(flat), kwargs, wait)
        finally:
            self.replays += inner.replays - before

    def _signature(self, named: tuple[tuple[Any, Any], ...]) -> tuple[tuple, dict[Any, Any]]:
        """The call's signature, and its traced numbers (argument name -> value)."""
        nodes = GRAPH.nodes
        numbers: dict[Any, Any] = {}
        out: list[Any] = [Tensor.training]
        first: dict[int, Any] = {}  # which arguments are the same node (the trace's plan binds it once)
        for name, a in named:
            if isinstance(a, Tensor):
                out.append((name, first.setdefault(a.id, name), leaf_entry(nodes[a.id])))  # type: ignore[arg-type]
                continue
            if (type(a) is float or type(a) is int) and name not in self.static:
                numbers[name] = a
                out.append((name, type(a)))  # traced: its value is data
                continue
            try:
                hash(a)
            except TypeError:
                raise ArgumentError(f"argument {name!r} of {self.fn.__qualname__} is a {type(a).__name__}: azyx.jit "
                                    f"takes tensors and hashable values (a value is part of the signature)") from None
            out.append((name, type(a), a))
        return tuple(out), numbers

    async def _trace(self, key: tuple, args: tuple, kwargs: dict[str, Any], tensors: list[Tensor],
                     numbers: dict[Any, Any]) -> Any:
        token = object()
        if numbers:  # the function sees traced numbers (azyx.traced)
            args = tuple(_traced(a, ("arg", token, i)) if i in numbers else a for i, a in enumerate(args))
            kwargs = {k: _traced(a, ("arg", token, k)) if k in numbers else a for k, a in kwargs.items()}
        rec = Tensor.tracer = Recorder()
        try:
            try:
                with recording() as scalar_guards:
                    returned = self.fn(*args, **kwargs)
            finally:
                Tensor.tracer = None
            outputs, output = _flatten(returned, self.fn.__qualname__)
            handles = list(rec.rebound)
            await _place_constants([*outputs, *handles], tensors, rec)
            plan, walk, bindings = await submit([*outputs, *handles])
            trace = self._make(rec, tensors, outputs, output, handles, plan, walk, bindings)
            if trace is not None:
                trace.token, trace.scalar_guards = token, scalar_guards
        finally:
            rec.close()
        if trace is not None:
            if len(self.traces) >= MAX_TRACES:
                self.traces.pop(next(iter(self.traces)))
            self.traces[key] = trace
        await wait_for([GRAPH[t.id].buffer for t in outputs], plan)  # type: ignore[misc]
        return output(outputs)

    def _make(self, rec: Recorder, tensors: list[Tensor], outputs: list[Tensor],
              output: Callable[[list[Tensor]], Any], handles: list[Tensor], plan: ExecutionPlan | None,
              walk: Walk | None, bindings: list[Buffer]) -> Trace | None:
        """The trace of a call that just ran; None when it cannot be replayed (a rebound handle held a lazy value
        when the function took it: the next call traces again, from the realized values)."""
        if any(GRAPH[i].buffer is None for i in rec.rebound.values()):
            return None
        # where each leaf comes from on a replay (an argument first: it may also be a handle's first value)
        arg_of = {t.id: k for k, t in reversed(list(enumerate(tensors)))}
        state_of = {i: k for k, i in enumerate(rec.rebound.values())}
        drawn_of = {id(b): k for k, (b, _) in enumerate(rec.drawn)}

        def source(i: int, bound: Buffer) -> tuple[int, Any]:
            if i in arg_of:
                return ARG, arg_of[i]
            if i in state_of:
                return STATE, state_of[i]
            if id(bound) in drawn_of:
                return DRAWN, drawn_of[id(bound)]
            return CONST, bound

        leaves = walk.leaves if walk is not None else []
        sources = [source(i, b) for i, b in zip(leaves, bindings)]
        # a handle's value must fit the plan as its first one did (an argument's fits: it is in the signature)
        checks = [(x, (*leaf_entry(GRAPH[i])[:-1], b.device.name))
                  for i, b, (kind, x) in zip(leaves, bindings, sources) if kind == STATE]
        target_ids = walk.targets if walk is not None else []
        target_of = {i: k for k, i in enumerate(target_ids)}
        results: list[tuple[int, Any]] = []
        for t in [*outputs, *handles]:
            if t.id in target_of:
                results.append((-1, target_of[t.id]))
            else:  # realized before: an argument, a handle's first value, a drawn or a captured tensor
                kind, x = source(t.id, GRAPH[t.id].buffer)  # type: ignore[arg-type]
                results.append((kind, Tensor._wrap(t.id) if kind == CONST else x))
        targets = [(n.shape, n.dtype, n.device, n.pinned) for n in (GRAPH[i] for i in target_ids)]
        debug.log(debug.PLANS, lambda: f"jit {self.fn.__qualname__}: traced {len(leaves)} leaves, {len(target_ids)} "
                                       f"targets, {len(handles)} rebound handles, {len(rec.drawn)} random tensors")
        return Trace(plan, sources, checks, results, targets, handles,
                     list(range(len(outputs), len(results))), output, [again for _, again in rec.drawn],
                     list(rec.guards), scalars=list(walk.scalars) if walk is not None else [],
                     views=[GRAPH[i].view if kind == STATE else None for i, (kind, _) in zip(leaves, sources)])

    @staticmethod
    def _replay(trace: Trace, tensors: list[Tensor], numbers: dict[Any, Any]
                ) -> tuple[list[Tensor], ExecutionPlan | None] | None:
        """Bind and submit the trace's plan; None when a guard or a leaf does not fit it (then the caller traces
        again)."""
        handles, gn = trace.handles, GRAPH.nodes
        for read, value in trace.guards:
            if read() != value:
                return None
        scalars = trace.scalars
        if trace.scalar_guards or trace.traced:
            token = trace.token
            memo: dict[int, Any] = {}  # this replay's value of each traced number computed so far
            for recipe, value in trace.scalar_guards:
                if evaluate_recipe(recipe, token, numbers, memo) != value:
                    return None
            if trace.traced:  # this call's values of the traced numbers
                scalars = list(scalars)
                values = [evaluate(x, token, numbers, memo) for x in trace.numbers]
                for i, k in trace.traced:
                    scalars[i] = values[k]
        if trace.checks:  # (the nodes the last replay checked, or left the handles on, fit still: not again)
            now = [gn[handles[x].id] for x, _ in trace.checks]
            if not all(map(is_, now, trace.checked)):
                for n, (_, entry) in zip(now, trace.checks):
                    if leaf_entry(n) != entry:  # type: ignore[arg-type]
                        return None
                trace.checked = now
        bindings: list[Buffer] = trace.constants.copy()
        nodes: list[Node | None] = trace.no_nodes.copy()
        for i, x in trace.live_args:
            n = gn[tensors[x].id]
            nodes[i] = n
            bindings[i] = n.buffer
        if trace.live_other or trace.drawn or not trace.plain:
            drawn = [again() for again in trace.drawn] if trace.drawn else []  # in the function's order: one stream
            of = {ARG: tensors, STATE: handles, DRAWN: drawn}  # where a source's tensor is, this call
            for i, kind, x in trace.live_other:
                n = gn[of[kind][x].id]
                nodes[i] = n
                bindings[i] = n.buffer
        plan = trace.plan
        if plan is not None and plan.overwrites:
            for s in plan.overwrites:
                n = nodes[s]
                if n is None or n.rc != 1:
                    return None  # the plan writes into an input that something else holds now: trace again (copies)
        made: list[Tensor | int] = []  # per target, its handle (or its id, once a result has that handle)
        if plan is not None:
            outs = run_plan(plan, bindings, nodes.__getitem__, scalars)  # a constant's host copy is bound again
            realized, kept = Tensor._realized, trace.kept
            if trace.plain:  # (the results are the new leaves, in order)
                for (shape, dtype, device, pinned), (buf, view) in zip(trace.targets, outs):
                    made.append(realized(shape, dtype, device, pinned, buf, view))
                return made, plan  # type: ignore[return-value]
            # (a target written in place into the buffer its handle holds: the handle's node)
            made = [realized(shape, dtype, device, pinned, buf, view) if i not in kept else handles[kept[i]].id
                    for i, ((shape, dtype, device, pinned), (buf, view)) in enumerate(zip(trace.targets, outs))]
        results: list[Tensor | None] = []
        for kind, x in trace.steps:
            if kind == KEPT:  # (a handle that keeps its node)
                results.append(None)
            elif kind == -1:
                t = made[x]
                if type(t) is int:  # (a target returned twice: a second handle of it)
                    t = Tensor._wrap(t)
                else:
                    made[x] = t.id
                results.append(t)
            elif kind == CONST:
                results.append(Tensor._wrap(x.id))
            else:
                results.append(Tensor._wrap(of[kind][x].id))
        for h, r in trace.rebind:
            h.assign(results[r])
        return results[:len(trace.results) - len(handles)], plan  # type: ignore[return-value]


def _same_view(a: Any, b: Any) -> bool:
    """Whether two strided views read a buffer the same way."""
    return a is not None and b is not None and (a.offset, tuple(a.strides)) == (b.offset, tuple(b.strides))


def _traced(value: Any, recipe: tuple) -> Any:
    return TracedFloat(value, recipe) if type(value) is float else TracedInt(value, recipe)


def _flatten(returned: Any, name: str) -> tuple[list[Tensor], Callable[[list[Tensor]], Any]]:
    """The tensors a traced function returned, and how to give the same structure back."""
    if returned is None:
        return [], lambda ts: None
    if isinstance(returned, Tensor):
        return [returned], lambda ts: ts[0]
    if isinstance(returned, Sequence) and not isinstance(returned, str) and all(
            isinstance(t, Tensor) for t in returned):
        kind = type(returned)
        return list(returned), (lambda ts: list(ts)) if kind is list else (lambda ts: tuple(ts))
    raise ArgumentError(f"{name} returned a {type(returned).__name__}: a function under azyx.jit returns a Tensor, "
                        f"a tuple or list of Tensors, or None")
