"""Many hosts on Ray: an azyx runtime per host, remote tensors as handles, graphs split into one plan per host.

`await Cluster.start()` places one Ray actor (`HostRuntime`) on each node of the Ray cluster (or the first `hosts`
nodes); each owns an azyx runtime on its host's devices. A `RemoteTensor` is a handle to a value inside one of them
(`await host.tensor(array)`), or a lazy op on such handles: Tensor's ops (arithmetic, `@`, reductions, `relu`, ...)
record a graph on the driver; an op runs on the host of its first remote operand, and an operand held elsewhere is
carried there through Ray's object store (`t.to(host)` places one explicitly). `host.call(fn, *args)` runs any
function that builds azyx graphs on that host, with its remote tensors and objects (`await host.create(factory)`:
a model, an optimiser, kept in the actor) as arguments.

`await realize(*tensors)` splits the recorded graph into programs, one per host and stage (a stage ends where a value
crosses to another host), and submits each as one actor call; the calls are chained by their ObjectRefs, so Ray
starts each once the values it imports exist, and every program runs on its host as ONE ExecutionPlan. Results stay
in the actors (a handle keeps its value; dropping it frees it there); `await t.numpy()` fetches one. The driver's
event loop only awaits ObjectRefs (Ray's are awaitable): it never blocks.

A dead actor makes every realize that needs it raise `RemoteError` naming the host; the other hosts work on.
"""

from __future__ import annotations

import asyncio
import itertools
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from azyx.errors import ArgumentError, AzyxError
from azyx.realize import realize as _realize
from azyx.runtime import RT
from azyx.tensor import Tensor

_KEYS = itertools.count(1)


class RemoteError(AzyxError, RuntimeError):
    """A host's actor failed or died: what needed it cannot be computed."""


# ------------------------------------------------------------------------------------------------ the host side
class HostRuntime:
    """The actor on one host (a Ray async actor: its methods run on the actor's event loop, where azyx awaits).
    `values`: what the driver's handles name (realized Tensors, objects)."""

    def __init__(self, config: dict[str, Any] | None):
        if config:
            RT.configure(config)
        self.values: dict[int, Any] = {}

    def describe(self) -> tuple[str, list[str]]:
        """This host's Ray node id and its azyx devices."""
        return ray.get_runtime_context().get_node_id(), RT.device_names()

    async def put(self, key: int, array: np.ndarray, device: str | None) -> tuple[tuple[int, ...], str]:
        """Coroutine: `array` as a realized Tensor on `device` of this host, kept under `key`; returns its shape and
        dtype."""
        t = await Tensor(array, device=device).realize()
        self.values[key] = t
        return t.shape, t.dtype.name

    def create(self, key: int, factory: Callable[..., Any], args: tuple) -> str:
        """Call `factory(*args)` on this host (a model, an optimiser), keep the result under `key`; returns its
        type's name."""
        self.values[key] = factory(*args)
        return type(self.values[key]).__name__

    async def run(self, program: list[tuple], keep: list[int], exports: list[int], *imports: dict[int, np.ndarray]
                  ) -> dict[int, Any]:
        """Evaluate `program` (instructions (key, op, args, kwargs), in order), realize what is kept or exported in
        one plan (with the state of the objects it used), keep `keep` here and return `exports` as numpy arrays
        (with each kept value's shape and dtype, under its negative key)."""
        env: dict[int, Any] = {}
        imported = {k: v for d in imports for k, v in d.items()}
        used: list[Any] = []

        def value(a: Any) -> Any:
            if isinstance(a, _Ref):
                if a.key in env:
                    return env[a.key]
                if a.key in imported:
                    env[a.key] = Tensor(imported[a.key])
                    return env[a.key]
                v = self.values[a.key]
                if not isinstance(v, Tensor):
                    used.append(v)
                return v
            if isinstance(a, tuple):
                return tuple(value(x) for x in a)
            if isinstance(a, list):
                return [value(x) for x in a]
            return a

        for key, op, args, kwargs in program:
            vals = [value(a) for a in args]
            kw = {k: value(v) for k, v in kwargs.items()}
            if op == "call":
                env[key] = vals[0](*vals[1:], **kw)
            elif op == "item":
                env[key] = vals[0][vals[1]]
            elif op == "move":
                env[key] = vals[0]
            else:
                env[key] = getattr(vals[0], op)(*vals[1:], **kw)
        targets = [env[k] for k in [*keep, *exports]]
        state = [t for obj in used if hasattr(obj, "tensors") for t in obj.tensors()]
        await _realize(*targets, *state)
        out: dict[int, Any] = {}
        for k in keep:
            self.values[k] = env[k]
            out[-k] = (env[k].shape, env[k].dtype.name)
        for k in exports:
            out[k] = await env[k].numpy()
        return out

    async def fetch(self, key: int) -> np.ndarray:
        """Coroutine: the value under `key` as a numpy array."""
        return await self.values[key].numpy()

    async def export(self, key: int) -> dict[int, np.ndarray]:
        """A value this host holds, for a program on another host (an import of its `run`)."""
        return {key: await self.values[key].numpy()}

    def free(self, *keys: int) -> None:
        """Drop the values under `keys` (missing ones are ignored)."""
        for k in keys:
            self.values.pop(k, None)


class _Ref:
    """An instruction's operand that names a value (of the program, imported, or held by the actor)."""

    __slots__ = ("key",)

    def __init__(self, key: int):
        self.key = key


# ------------------------------------------------------------------------------------------------ the driver side
class Cluster:
    """The hosts of a Ray cluster, each with its azyx runtime (`hosts`)."""

    def __init__(self, hosts: list[Host]):
        self.hosts = hosts

    @classmethod
    async def start(cls, hosts: int | None = None, address: str | None = None,
                    config: dict[str, Any] | None = None) -> Cluster:
        """An actor on each alive node with CPUs (the first `hosts` of them); connects to the Ray cluster at
        `address` first where Ray is not initialised (None: Ray's own default, a local cluster)."""
        if not ray.is_initialized():
            ray.init(address=address, log_to_driver=False)
        nodes = sorted((n for n in ray.nodes() if n["Alive"] and n["Resources"].get("CPU", 0) > 0),
                       key=lambda n: n["NodeID"])
        if hosts is not None:
            if hosts > len(nodes):
                raise ArgumentError(f"{hosts} hosts asked, the Ray cluster has {len(nodes)} nodes with CPUs")
            nodes = nodes[:hosts]
        actor = ray.remote(num_cpus=0, max_restarts=0)(HostRuntime)
        handles: list[Any] = [actor.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False))
                   .remote(config) for n in nodes]
        described = await asyncio.gather(*(h.describe.remote() for h in handles))
        return cls([Host(h, i, node, devs) for i, (h, (node, devs)) in enumerate(zip(handles, described))])

    def shutdown(self) -> None:
        """Stop every host's actor (its runtime and what it holds)."""
        for h in self.hosts:
            ray.kill(h.actor)


_HOSTS: weakref.WeakValueDictionary[str, Host] = weakref.WeakValueDictionary()  # actor id (hex) -> its host


class Host:
    """One host's runtime: make remote tensors and objects there, run functions there."""

    def __init__(self, actor: Any, index: int, node: str, devices: list[str]):
        self.actor, self.index, self.node, self.devices = actor, index, node, devices
        self.name = f"host {index} (node {node[:8]})"
        _HOSTS[actor._actor_id.hex()] = self

    def __repr__(self) -> str:
        return f"Host({self.index}, node {self.node[:8]}, devices {self.devices})"

    async def tensor(self, data: Any, device: str | None = None) -> RemoteTensor:
        """`data` (a numpy array or nested lists) as a tensor on this host (on `device`, else its default)."""
        key = next(_KEYS)
        shape, dtype = await _remote(self, self.actor.put.remote(key, np.asarray(data), device))
        return RemoteTensor(self, "leaf", (), {}, key=key, shape=shape, dtype=dtype)

    async def create(self, factory: Callable[..., Any], *args: Any) -> RemoteObject:
        """`factory(*args)` made and kept on this host (a model, an optimiser, ...): an argument of `call`. An object
        with a `tensors()` method has those realized with every program that uses it (an optimiser's state)."""
        key = next(_KEYS)
        await _remote(self, self.actor.create.remote(key, factory, args))
        return RemoteObject(self, key)

    def call(self, fn: Callable[..., Any], *args: Any, outputs: int = 1, **kwargs: Any
             ) -> RemoteTensor | tuple[RemoteTensor, ...]:
        """`fn(*args, **kwargs)` run on this host (lazily, with the next realize): remote tensors and objects among
        the arguments are its values there. `outputs`: how many tensors `fn` returns (a tuple where more than one)."""
        r = RemoteTensor(self, "call", (fn, *args), kwargs)
        if outputs == 1:
            return r
        return tuple(RemoteTensor(self, "item", (r, i), {}) for i in range(outputs))


class RemoteObject:
    """An object kept on a host (`Host.create`)."""

    def __init__(self, host: Host, key: int):
        self.host, self.key = host, key
        _on_drop(self, host.actor, key)


def _free(actor: Any, key: int) -> None:
    if not ray.is_initialized():  # (Ray shut down: the actors are gone; a call would start a new local Ray)
        return
    try:
        actor.free.remote(key)
    except Exception:  # (the actor died: nothing to free)
        pass


def _on_drop(handle: object, actor: Any, key: int) -> None:
    """Free `key` on its host once `handle` is dropped (not at interpreter exit: Ray goes first)."""
    weakref.finalize(handle, _free, actor, key).atexit = False


class RemoteTensor:
    """A value on one host, or a lazy op (Tensor's ops) whose operands are remote tensors, objects and numbers."""

    def __init__(self, host: Host, op: str, args: tuple, kwargs: dict[str, Any], key: int | None = None,
                 shape: tuple[int, ...] | None = None, dtype: str | None = None):
        self.host, self.op, self.args, self.kwargs = host, op, args, kwargs
        self.key = key if key is not None else next(_KEYS)
        self.realized = op == "leaf"
        self.shape, self.dtype = shape, dtype
        if self.realized:
            _on_drop(self, host.actor, self.key)

    def __repr__(self) -> str:
        state = f"shape {self.shape}, {self.dtype}" if self.realized else f"lazy {self.op}"
        return f"RemoteTensor({state} on {self.host.name})"

    def _op(self, op: str, *args: Any, **kwargs: Any) -> RemoteTensor:
        return RemoteTensor(self.host, op, (self, *args), kwargs)

    def to(self, host: Host) -> RemoteTensor:
        """This value on `host` (carried through Ray's object store when realized)."""
        return self if host is self.host else RemoteTensor(host, "move", (self,), {})

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or not callable(getattr(Tensor, name, None)):
            raise AttributeError(f"'RemoteTensor' has no attribute {name!r}")
        return lambda *a, **k: self._op(name, *a, **k)

    def __add__(self, o: Any) -> RemoteTensor:
        return self._op("__add__", o)

    def __radd__(self, o: Any) -> RemoteTensor:
        return self._op("__radd__", o)

    def __sub__(self, o: Any) -> RemoteTensor:
        return self._op("__sub__", o)

    def __rsub__(self, o: Any) -> RemoteTensor:
        return self._op("__rsub__", o)

    def __mul__(self, o: Any) -> RemoteTensor:
        return self._op("__mul__", o)

    def __rmul__(self, o: Any) -> RemoteTensor:
        return self._op("__rmul__", o)

    def __truediv__(self, o: Any) -> RemoteTensor:
        return self._op("__truediv__", o)

    def __matmul__(self, o: Any) -> RemoteTensor:
        return self._op("__matmul__", o)

    def __neg__(self) -> RemoteTensor:
        return self._op("__neg__")

    def __getitem__(self, k: Any) -> RemoteTensor:
        """`t[k]` on the host, lazily (Tensor's indexing)."""
        return self._op("__getitem__", k)

    async def realize(self) -> RemoteTensor:
        """Coroutine: compute this tensor on its host (`realize(self)`); returns self."""
        await realize(self)
        return self

    def __await__(self) -> Any:
        """`await t`: the same as `await t.realize()`."""
        return self.realize().__await__()

    async def numpy(self) -> np.ndarray:
        """Coroutine: realize and fetch the value to the driver as a numpy array."""
        await realize(self)
        return await _remote(self.host, self.host.actor.fetch.remote(self.key))


async def _remote(host: Host, ref: Any) -> Any:
    """`await ref`, a call to `host`'s actor; a failure as a RemoteError naming the host that failed (a program
    that imports from a dead host fails with that host's error)."""
    try:
        return await ref
    except ray.exceptions.RayTaskError as e:
        cause = e.cause
        if not isinstance(cause, ray.exceptions.RayActorError):
            raise RemoteError(f"{host.name} failed: {cause!r}") from None
        err = cause
    except ray.exceptions.RayActorError as e:
        err = e
    dead = _HOSTS.get(getattr(err, "actor_id", None) or "", host)
    raise RemoteError(f"{dead.name} is gone (its actor died: {type(err).__name__}); what needs it cannot be "
                      "computed") from None


async def realize(*tensors: RemoteTensor) -> None:
    """Compute the remote tensors: their graph split into one program per host and stage, each submitted as one
    actor call (one ExecutionPlan on its host), chained by ObjectRefs; each tensor's value then stays on its host."""
    order: list[RemoteTensor] = []
    seen: set[int] = set()

    def visit(t: RemoteTensor) -> None:
        if t.key in seen or t.realized:
            return
        seen.add(t.key)
        for a in _operands(t):
            visit(a)
        order.append(t)

    for t in tensors:
        visit(t)
    if not order:
        return
    # a lazy value read on another host ends its stage there: stage by stage, the programs' imports exist before
    stage: dict[int, int] = {}
    for t in order:
        stage[t.key] = max((stage[a.key] + (a.host is not t.host) for a in _operands(t) if not a.realized), default=0)
    programs: dict[tuple[int, int], list[RemoteTensor]] = {}
    for t in order:
        programs.setdefault((stage[t.key], t.host.index), []).append(t)
    at = {t.key: (stage[t.key], t.host.index) for t in order}
    wanted = {t.key for t in tensors}
    keep: dict[tuple[int, int], set[int]] = {p: {t.key for t in ts if t.key in wanted} for p, ts in programs.items()}
    exports: dict[tuple[int, int], set[int]] = {p: set() for p in programs}
    after: dict[tuple[int, int], set[tuple[int, int]]] = {p: set() for p in programs}  # programs it waits for
    held: dict[tuple[int, int], dict[int, RemoteTensor]] = {p: {} for p in programs}  # realized values it imports
    scratch: list[tuple[Host, int]] = []  # values kept only for a later program on the same host
    for p, ts in programs.items():
        for t in ts:
            for a in _operands(t):
                if a.realized:
                    if a.host is not t.host:
                        held[p][a.key] = a
                    continue
                q = at[a.key]
                if q == p:
                    continue
                after[p].add(q)
                if a.host is t.host:  # a later stage on the same host reads it where it is kept
                    if a.key not in keep[q]:
                        keep[q].add(a.key)
                        scratch.append((a.host, a.key))
                else:
                    exports[q].add(a.key)
    refs: dict[tuple[int, int], Any] = {}
    for p in sorted(programs):
        ts = programs[p]
        host = ts[0].host
        instructions = [(t.key, t.op, tuple(_encode(a, host) for a in t.args),
                         {k: _encode(v, host) for k, v in t.kwargs.items()}) for t in ts]
        imports = [refs[q] for q in sorted(after[p])] + [a.host.actor.export.remote(k) for k, a in held[p].items()]
        refs[p] = host.actor.run.remote(instructions, sorted(keep[p]), sorted(exports[p]), *imports)
    try:
        results = await asyncio.gather(*(_remote(programs[p][0].host, r) for p, r in refs.items()))
    finally:
        for host, key in scratch:
            _free(host.actor, key)
    for res in results:
        for t in tensors:
            if -t.key in res:
                t.shape, t.dtype = res[-t.key]
                t.op, t.args, t.kwargs, t.realized = "leaf", (), {}, True
                _on_drop(t, t.host.actor, t.key)


def _operands(t: RemoteTensor) -> list[RemoteTensor]:
    out: list[RemoteTensor] = []
    for a in (*t.args, *t.kwargs.values()):
        if isinstance(a, RemoteTensor):
            out.append(a)
        elif isinstance(a, tuple | list):
            out.extend(x for x in a if isinstance(x, RemoteTensor))
    return out


def _encode(a: Any, host: Host) -> Any:
    """An operand as a program sees it: a remote value by its key (objects must be on the program's host)."""
    if isinstance(a, RemoteTensor):
        return _Ref(a.key)
    if isinstance(a, RemoteObject):
        if a.host is not host:
            raise ArgumentError(f"an object kept on {a.host.name} cannot be used on {host.name}")
        return _Ref(a.key)
    if isinstance(a, tuple):
        return tuple(_encode(x, host) for x in a)
    if isinstance(a, list):
        return [_encode(x, host) for x in a]
    return a


def all_reduce(values: Sequence[RemoteTensor], op: str = "sum") -> list[RemoteTensor]:
    """Partial values, one per host (each host's gradients), combined by `op` ("sum", "max", "min") on the first
    value's host and carried back: the result on each value's host (lazy: realize with what reads them)."""
    combine = {"sum": "__add__", "max": "maximum", "min": "minimum"}.get(op)
    if combine is None:
        raise ArgumentError(f"all-reduce op must be sum, max or min, got {op!r}")
    if not values:
        raise ArgumentError("all-reduce of no values")
    home = values[0].host
    total = values[0]
    for v in values[1:]:
        total = total._op(combine, v.to(home))
    return [total.to(v.host) for v in values]


async def scatter(hosts: Sequence[Host], data: Any) -> list[RemoteTensor]:
    """`data` split along axis 0 over `hosts` (numpy's array_split sizes): a remote tensor on each."""
    return list(await asyncio.gather(*(h.tensor(part) for h, part in zip(hosts, np.array_split(np.asarray(data),
                                                                                              len(hosts))))))
