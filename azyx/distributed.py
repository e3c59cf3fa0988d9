"""Many hosts on Ray: an azyx runtime per host, remote tensors as handles, graphs split into one plan per host.

`await Cluster.start()` places one Ray actor (`HostRuntime`) on each node of the Ray cluster (or the first `hosts`
nodes); each owns an azyx runtime on its host's devices. A `RemoteTensor` is a handle to a value inside one of them
(`await host.tensor(array)`), or a lazy op on such handles: Tensor's ops (arithmetic, `@`, reductions, `relu`, ...)
record a graph on the driver; an op runs on the host of its first remote operand, and an operand held elsewhere is
carried there through Ray's object store (`t.to(host)` places one explicitly). `host.call(fn, *args)` runs any
function that builds azyx graphs on that host, with its remote tensors and objects (`await host.create(factory)`:
a model, an optimiser, kept in the actor) as arguments.

`await realize(*tensors)` splits the recorded graph into programs, one per host and stage (a stage ends where a value
crosses to another host); every program runs on its host as ONE ExecutionPlan. A plan's first run submits each
program as one actor call, chained by ObjectRefs. The driver keeps the plan (the same ops over the same hosts, values
of the same shapes: a training step's), and its next run compiles it into a Ray compiled graph (`ray.dag`): a node per
program on its host's actor, the arrays that cross hosts carried by the graph's channels (host-staged); later runs
only write the values' keys and read the shapes of what was asked for. Actor calls remain only where a compiled graph
does not apply, decided in one place (a plan's run): its first run (compiling takes seconds and a thread of each
of its hosts' actors, and most plans seen once are not seen again), a plan that cannot be kept (an operand that
cannot be compared, as a numpy index), one dropped while it runs, and `COMPILE` off. Arrays cross hosts host-staged
(numpy through the graph's channels) whatever their devices: Ray's NCCL transport between CUDA devices would need
each actor to hold its GPUs as Ray resources and azyx's CUDA buffers to pass as torch tensors (DLPack), neither of
which exists yet. Compiling and running a compiled graph happen on a thread of the plan's own; the driver's event
loop only awaits. Results stay in the actors (a handle keeps its
value; dropping it frees it there: its key goes with the next run on its host, so that a training step costs no
actor call of its own); `await t.numpy()` fetches one.

A dead actor makes every realize that needs it raise `RemoteError` naming the host (a compiled graph over it is dropped;
the compiled graphs of the other hosts run on); a new `Cluster` (other actors) makes plans of its own.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import threading
import weakref
from collections.abc import Callable, Coroutine, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from azyx.errors import ArgumentError, AzyxError
from azyx.realize import realize as _realize
from azyx.runtime import RT
from azyx.tensor import Tensor

_KEYS = itertools.count(1)
T = TypeVar("T")
COMPILE = True  # plans run again become compiled graphs (False: always actor calls, as bench/scale.py compares)
MAX_PLANS = 16  # plans kept for running again (each compiled one holds a thread of each of its hosts' actors)
_PLANS: dict[Any, _Plan] = {}  # plan key -> the plan (least recently used first)


class RemoteError(AzyxError, RuntimeError):
    """A host's actor failed or died: what needed it cannot be computed."""


# ------------------------------------------------------------------------------------------------ the host side
class HostRuntime:
    """The actor on one host (a threaded Ray actor: Ray's calls, and each compiled graph's loop, run on threads of
    their own; every azyx await runs on the actor's one event loop, `loop`, which the calling thread runs, one call at
    a time: `_on_loop`). `values`: what the driver's handles name (realized Tensors, objects)."""

    def __init__(self, config: dict[str, Any] | None):
        # Ray sets OMP_NUM_THREADS to the actor's CPUs (1 where it reserves none): the host's C devices would run
        # their OpenMP kernels on one thread beside a pool of all the cores; they set it to their own threads instead
        os.environ.pop("OMP_NUM_THREADS", None)
        if config:
            RT.configure(config)
        self.values: dict[int, Any] = {}
        self.loop = asyncio.new_event_loop()
        self.turn = threading.Lock()  # held by the thread that runs `loop`

    def _on_loop(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run `coro` on the actor's event loop, which this (Ray's) thread runs until it is done (the loop's turn
        taken: one call at a time). The loop has no thread of its own: handing each call to one and waiting for it
        cost two thread wake-ups a call, 0.3-0.4 ms of every program on a shared 2-core machine."""
        with self.turn:
            return self.loop.run_until_complete(coro)

    def describe(self) -> tuple[str, list[str]]:
        """This host's Ray node id and its azyx devices."""
        return ray.get_runtime_context().get_node_id(), RT.device_names()

    def put(self, key: int, array: np.ndarray, device: str | None) -> tuple[tuple[int, ...], str]:
        """`array` as a realized Tensor on `device` of this host, kept under `key`; returns its shape and dtype."""
        async def make() -> Tensor:  # (azyx's graph is the loop thread's: a Tensor is made and dropped there)
            return await Tensor(array, device=device).realize()

        t = self._on_loop(make())
        self.values[key] = t
        return t.shape, t.dtype.name

    def create(self, key: int, factory: Callable[..., Any], args: tuple) -> str:
        """Call `factory(*args)` on this host (a model, an optimiser), keep the result under `key`; returns its
        type's name."""

        async def make() -> Any:
            return factory(*args)

        self.values[key] = self._on_loop(make())
        return type(self.values[key]).__name__

    def run(self, program: _Program, inputs: _Inputs, *imports: _Output) -> _Output:
        """Run one program of a plan (`inputs`: each of the plan's slots' key, and per host the keys of values whose
        handles the driver dropped since, dropped here too): with the arrays that `imports` (the outputs of the
        programs it waits for) carry, one ExecutionPlan on this host. A failure is a RemoteError naming this host."""
        try:
            return self._on_loop(_run(self, program, inputs, imports))
        except Exception as e:
            raise RemoteError(f"{program.host} failed: {e!r}") from None

    def fetch(self, key: int) -> np.ndarray:
        """The value under `key` as a numpy array."""
        return self._on_loop(self.values[key].numpy())

    def free(self, *keys: int) -> None:
        """Drop the values under `keys` (missing ones are ignored), on the actor's event loop."""
        self._on_loop(_dropping(self.values, keys))


async def _run(host: HostRuntime, program: _Program, inputs: _Inputs, imports: tuple[_Output, ...]) -> _Output:
    """HostRuntime.run's work, on the actor's event loop (a function: one async method would make the actor an async
    actor, whose threads are event loops that a compiled graph's loop blocks)."""
    binding, freed = inputs
    _drop(host.values, freed.get(program.index, ()))  # (dropped handles: no key among them is the binding's)
    # (imports copied at once: an array read from a compiled graph's channel holds the channel until it is dropped)
    env: dict[int, Any] = {s: Tensor(v) for _, data in imports for s, v in data.items()}
    used: list[Any] = []
    try:
        for slot, op, args, kwargs in program.ops:
            vals = [_value(a, env, host.values, binding, used) for a in args]
            kw = {k: _value(v, env, host.values, binding, used) for k, v in kwargs.items()}
            if op == "call":
                env[slot] = vals[0](*vals[1:], **kw)
            elif op == "item":
                env[slot] = vals[0][vals[1]]
            elif op == "move":
                env[slot] = vals[0]
            else:
                env[slot] = getattr(vals[0], op)(*vals[1:], **kw)
        targets = [env[s] for s in (*program.keep, *program.exports) if s in env]
        state = [t for obj in used if hasattr(obj, "tensors") for t in obj.tensors()]
        await _realize(*targets, *state)
    finally:
        _drop(host.values, [binding[s] for s in program.drops])
    meta = {s: m for upstream, _ in imports for s, m in upstream.items()}
    for s in program.keep:
        host.values[binding[s]] = env[s]
        if s in program.wanted:
            meta[s] = (env[s].shape, env[s].dtype.name)
    return meta, {s: await _value(_Ref(s), env, host.values, binding, used).numpy() for s in program.exports}


async def _dropping(values: dict[int, Any], keys: Sequence[int]) -> None:
    _drop(values, keys)


def _drop(values: dict[int, Any], keys: Sequence[int]) -> None:
    for k in keys:
        values.pop(k, None)


def _value(a: Any, env: dict[int, Any], values: dict[int, Any], binding: tuple[int, ...], used: list[Any]) -> Any:
    """An operand's value in a program: a slot's from `env` (computed or imported), else kept on the host under
    the slot's key (an object among them noted in `used`)."""
    if isinstance(a, _Ref):
        if a.slot in env:
            return env[a.slot]
        v = values[binding[a.slot]]
        if not isinstance(v, Tensor):
            used.append(v)
        return v
    if isinstance(a, tuple):
        return tuple(_value(x, env, values, binding, used) for x in a)
    if isinstance(a, list):
        return [_value(x, env, values, binding, used) for x in a]
    return a


class _Ref:
    """An instruction's operand that names a value of the plan by its slot (a value the program computes, imports,
    or finds kept on its host under the slot's key)."""

    __slots__ = ("slot",)

    def __init__(self, slot: int):
        self.slot = slot

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Ref) and other.slot == self.slot

    def __hash__(self) -> int:
        return hash(("ref", self.slot))


@dataclass(frozen=True)
class _Program:
    """What one host runs of a plan, in one ExecutionPlan: `ops` (slot, op, args, kwargs) in order; kept on the host
    (under the slots' keys): `keep`, of which `wanted` are what the realize asked for (their shapes and dtypes go back
    to the driver); `exports`: slots sent on to programs of other hosts, as arrays; `drops`: kept slots of earlier
    programs it reads last. `host`: its host's name, for errors; `index`: its host's index."""

    host: str
    index: int
    ops: tuple[tuple[int, str, tuple, dict[str, Any]], ...]
    keep: tuple[int, ...]
    wanted: frozenset[int]
    exports: tuple[int, ...]
    drops: tuple[int, ...]


_Output = tuple[dict[int, tuple[tuple[int, ...], str]], dict[int, np.ndarray]]  # a program's: (meta, arrays)
_Inputs = tuple[tuple[int, ...], dict[int, list[int]]]  # a run's: the slots' keys, per host index the keys to drop


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
        actor = ray.remote(**_ACTOR)(HostRuntime)
        handles: list[Any] = [actor.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False))
                              .remote(config) for n in nodes]
        described = await asyncio.gather(*(h.describe.remote() for h in handles))
        return cls([Host(h, i, node, devs) for i, (h, (node, devs)) in enumerate(zip(handles, described))])

    def shutdown(self) -> None:
        """Stop every host's actor (its runtime and what it holds), the compiled graphs over them torn down first."""
        ids = {h.actor_id for h in self.hosts}
        for k, plan in list(_PLANS.items()):
            if any(h.actor_id in ids for h in plan.hosts.values()):
                del _PLANS[k]
                done = plan.close()
                if done is not None:
                    done.result()
        for h in self.hosts:
            h.freed.clear()
            ray.kill(h.actor)


# a host's actor: threads, one per call in flight and one per compiled graph's loop (Ray's "_ray_system" group)
_ACTOR: dict[str, Any] = {"num_cpus": 0, "max_restarts": 0, "max_concurrency": 32,
                          "concurrency_groups": {"_ray_system": MAX_PLANS}}
_HOSTS: weakref.WeakValueDictionary[str, Host] = weakref.WeakValueDictionary()  # actor id (hex) -> its host


class Host:
    """One host's runtime: make remote tensors and objects there, run functions there."""

    def __init__(self, actor: Any, index: int, node: str, devices: list[str]):
        self.actor, self.index, self.node, self.devices = actor, index, node, devices
        self.name = f"host {index} (node {node[:8]})"
        self.actor_id = actor._actor_id.hex()
        self.freed: list[int] = []  # keys of values whose handles were dropped, to free on the host (`_free`)
        _HOSTS[self.actor_id] = self

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
        _on_drop(self, host, key)


FREE_BATCH = 64  # dropped handles' keys a host gathers before an actor call of its own frees them


def _free(host: Host, key: int) -> None:
    """`key`'s handle was dropped: its value goes with the next run of a program on `host`, or with the next
    realize (`_flush`), or once FREE_BATCH keys are waiting (never an actor call per dropped handle: a training
    step drops a few, and each would be a Ray task of its own on the driver's and the host's cores)."""
    host.freed.append(key)
    if len(host.freed) >= FREE_BATCH:
        _flush(host)


def _take_freed(host: Host) -> list[int]:
    """The keys waiting on `host`, taken (a key a finalizer appends meanwhile stays for the next)."""
    keys = host.freed[:]
    del host.freed[:len(keys)]
    return keys


def _flush(host: Host) -> None:
    """Free the keys waiting on `host` by one actor call."""
    keys = _take_freed(host)
    if not keys or not ray.is_initialized():  # (Ray shut down: the actors are gone; a call would start a new Ray)
        return
    try:
        host.actor.free.remote(*keys)
    except Exception:  # (the actor died: nothing to free)
        pass


def _on_drop(handle: object, host: Host, key: int) -> None:
    """Free `key` on `host` once `handle` is dropped (not at interpreter exit: Ray goes first)."""
    weakref.finalize(handle, _free, host, key).atexit = False


class RemoteTensor:
    """A value on one host, or a lazy op (Tensor's ops) whose operands are remote tensors, objects and numbers."""

    def __init__(self, host: Host, op: str, args: tuple, kwargs: dict[str, Any], key: int | None = None,
                 shape: tuple[int, ...] | None = None, dtype: str | None = None):
        self.host, self.op, self.args, self.kwargs = host, op, args, kwargs
        self.key = key if key is not None else next(_KEYS)
        self.realized = op == "leaf"
        self.shape, self.dtype = shape, dtype
        if self.realized:
            _on_drop(self, host, self.key)

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
        if isinstance(cause, RemoteError):  # (a program's own failure, named by its host)
            raise cause from None
        if not isinstance(cause, ray.exceptions.RayActorError):
            raise RemoteError(f"{host.name} failed: {cause!r}") from None
        err = cause
    except ray.exceptions.RayActorError as e:
        err = e
    dead = _HOSTS.get(getattr(err, "actor_id", None) or "", host)
    raise RemoteError(f"{dead.name} is gone (its actor died: {type(err).__name__}); what needs it cannot be "
                      "computed") from None


async def realize(*tensors: RemoteTensor) -> None:
    """Compute the remote tensors: their graph split into one program per host and stage (`_Plan`), each tensor's
    value then kept on its host. A plan's first run submits each program as one actor call, chained by ObjectRefs;
    when the same plan runs again (the same ops over the same hosts, values of the same shapes) it becomes a
    compiled Ray graph, whose runs only write the values' keys and read what the driver needs."""
    order: list[RemoteTensor] = []
    seen: set[int] = set()
    for t in tensors:
        _visit(t, order, seen)
    if not order:
        return
    slots = {t.key: i for i, t in enumerate(order)}
    leaves: list[RemoteTensor | RemoteObject] = []
    ops = tuple((t.host, t.op, _encode(t.args, t.host, slots, leaves),
                 {k: _encode(v, t.host, slots, leaves) for k, v in t.kwargs.items()}) for t in order)
    wanted = frozenset(slots[t.key] for t in tensors if not t.realized)
    binding = tuple(t.key for t in order) + tuple(a.key for a in leaves)
    key = _plan_key(ops, leaves, wanted)
    plan = _PLANS.pop(key, None) if key is not None else None
    if plan is None:
        plan = _Plan(ops, [a.host for a in leaves], wanted)
    if key is not None:
        _PLANS[key] = plan  # (the most recently used last)
        while len(_PLANS) > MAX_PLANS:
            _PLANS.pop(next(iter(_PLANS))).close()
    meta = await plan.run(binding, key is not None)
    for t in tensors:
        s = slots.get(t.key)
        if s in meta:
            t.shape, t.dtype = meta[s]
            t.op, t.args, t.kwargs, t.realized = "leaf", (), {}, True
            _on_drop(t, t.host, t.key)


# (module functions, not closures in realize: a recursive closure is a reference cycle, which would keep the
# realize's handles, and so their values on the hosts, until the garbage collector next runs)
def _visit(t: RemoteTensor, order: list[RemoteTensor], seen: set[int]) -> None:
    """Append `t`'s unrealized graph to `order`, operands first."""
    if t.key in seen or t.realized:
        return
    seen.add(t.key)
    for a in _operands(t):
        _visit(a, order, seen)
    order.append(t)


def _encode(a: Any, host: Host, slots: dict[int, int], leaves: list[RemoteTensor | RemoteObject]) -> Any:
    """An op's operand with remote tensors and objects as `_Ref`s to their slots; a held one read for the first time
    becomes a leaf (its slot after the graph's and the earlier leaves')."""
    if isinstance(a, RemoteObject) and a.host is not host:
        raise ArgumentError(f"an object kept on {a.host.name} cannot be used on {host.name}")
    if isinstance(a, RemoteTensor | RemoteObject):
        if a.key not in slots:
            slots[a.key] = len(slots)
            leaves.append(a)
        return _Ref(slots[a.key])
    if isinstance(a, tuple):
        return tuple(_encode(x, host, slots, leaves) for x in a)
    if isinstance(a, list):
        return [_encode(x, host, slots, leaves) for x in a]
    return a


def _plan_key(ops: tuple, leaves: list[RemoteTensor | RemoteObject], wanted: frozenset[int]) -> Any:
    """What makes two realizes the same plan: the ops (by host and operands' slots), the leaves' hosts, shapes and
    dtypes, what is wanted. None where an operand cannot be compared (a numpy array as an index): never cached."""
    key = (tuple((h.actor_id, op, _frozen(args), _frozen(kw)) for h, op, args, kw in ops),
           tuple((a.host.actor_id, getattr(a, "shape", None), getattr(a, "dtype", None)) for a in leaves), wanted)
    try:
        hash(key)
    except TypeError:
        return None
    return key


def _frozen(a: Any) -> Any:
    """An encoded operand as a hashable value of its own kind (lists, dicts and slices as tuples)."""
    if isinstance(a, list):
        return ("list", tuple(_frozen(x) for x in a))
    if isinstance(a, tuple):
        return tuple(_frozen(x) for x in a)
    if isinstance(a, dict):
        return ("dict", tuple((k, _frozen(v)) for k, v in a.items()))
    if isinstance(a, slice):
        return ("slice", a.start, a.stop, a.step)
    return a if isinstance(a, _Ref) else (type(a), a)  # (1, 1.0 and True hash alike, but promote apart)


class _Plan:
    """A realize's graph as programs, one per host and stage (a stage ends where a value crosses to another host),
    over slots (the graph's values in order, then the values it reads that hosts hold: a run's `binding` gives each
    slot's key). A held value read on another host comes from a program on its own host that only exports it (stage
    -1). `run` submits the programs as actor calls chained by ObjectRefs, or runs them as a compiled Ray graph: a node
    per program on its host's actor, the arrays that cross hosts carried by the graph's channels."""

    def __init__(self, ops: tuple, leaf_hosts: list[Host], wanted: frozenset[int]):
        n = len(ops)
        host_of = [h for h, *_ in ops] + leaf_hosts
        stage: list[int] = []
        readers: dict[int, list[int]] = {}  # slot -> the slots whose op reads it
        for i, (h, _, args, kwargs) in enumerate(ops):
            refs = _slots((args, kwargs))
            for r in refs:
                readers.setdefault(r, []).append(i)
            stage.append(max((stage[r] + (host_of[r] is not h) for r in refs if r < n), default=0))
        at = [(stage[i], host_of[i].index) for i in range(n)] + [(-1, h.index) for h in leaf_hosts]
        progs: dict[tuple[int, int], list[int]] = {}
        for i in range(n):
            progs.setdefault(at[i], []).append(i)
        for r, rs in readers.items():
            if r >= n and any(host_of[i] is not host_of[r] for i in rs):
                progs.setdefault(at[r], [])  # its host's exporting program
        keep = {p: {i for i in slots if i in wanted} for p, slots in progs.items()}
        exports: dict[tuple[int, int], set[int]] = {p: set() for p in progs}
        after: dict[tuple[int, int], set[tuple[int, int]]] = {p: set() for p in progs}
        drops: dict[tuple[int, int], set[int]] = {p: set() for p in progs}
        self.scratch: list[tuple[Host, int]] = []  # (host, slot): kept only for later programs on that host
        for r, rs in readers.items():
            q = at[r]
            later = sorted({at[i] for i in rs if at[i] != q and host_of[i] is host_of[r]}) if r < n else []
            if later:  # read by later programs on its host: kept there, its readers in turn, the last dropping it
                if r not in keep[q]:
                    keep[q].add(r)
                    drops[later[-1]].add(r)
                    self.scratch.append((host_of[r], r))
                for x, y in zip([q, *later], later):
                    after[y].add(x)
            for i in rs:
                if host_of[i] is not host_of[r]:
                    exports[q].add(r)
                    after[at[i]].add(q)
        hosts = {h.index: h for h in host_of}
        self.hosts = {p: hosts[p[1]] for p in sorted(progs)}
        self.programs = {p: _Program(self.hosts[p].name, p[1], tuple((i, *ops[i][1:]) for i in progs[p]),
                                     tuple(sorted(keep[p])), wanted, tuple(sorted(exports[p])), tuple(sorted(drops[p])))
                         for p in self.hosts}
        self.after = {p: sorted(after[p]) for p in self.programs}
        read = {q for qs in self.after.values() for q in qs}
        self.sinks = [p for p in self.programs if p not in read]
        self.runs = 0
        self.closed = False
        self.dag: Any = None
        self.compiling: asyncio.Future | None = None
        self.thread: ThreadPoolExecutor | None = None  # where the compiled graph is made, run and torn down

    async def run(self, binding: tuple[int, ...], cached: bool) -> dict[int, tuple[tuple[int, ...], str]]:
        """Run the programs with `binding`; returns the wanted slots' shapes and dtypes. A plan the driver keeps
        (`cached`) runs as a compiled graph from its second run on."""
        self.runs += 1
        mine = {h.actor_id: h for h in self.hosts.values()}
        for h in list(_HOSTS.values()):  # (the keys freed on the plan's hosts go with its programs)
            if h.freed and h.actor_id not in mine:
                _flush(h)
        freed = {h.index: keys for h in mine.values() if (keys := _take_freed(h))}
        try:
            # the one decision between a compiled graph and actor calls (the module's docstring says why)
            compiled = cached and COMPILE and self.runs > 1 and not self.closed  # (closed: dropped meanwhile)
            outs = await (self._execute((binding, freed)) if compiled else self._submit((binding, freed)))
        except BaseException:
            for h in mine.values():  # (perhaps not dropped: again with a later run)
                h.freed.extend(freed.get(h.index, ()))
            for host, s in self.scratch:
                _free(host, binding[s])
            raise
        return {s: m for meta, _ in outs for s, m in meta.items()}

    async def _submit(self, inputs: _Inputs) -> list[_Output]:
        refs: dict[tuple[int, int], Any] = {}
        for p, program in self.programs.items():
            refs[p] = self.hosts[p].actor.run.remote(program, inputs, *(refs[q] for q in self.after[p]))
        return list(await asyncio.gather(*(_remote(self.hosts[p], refs[p]) for p in self.sinks)))

    def _compile(self) -> None:
        from ray.dag import InputNode, MultiOutputNode

        with InputNode() as inputs:
            nodes: dict[tuple[int, int], Any] = {}
            for p, program in self.programs.items():
                nodes[p] = self.hosts[p].actor.run.bind(program, inputs, *(nodes[q] for q in self.after[p]))
            graph = MultiOutputNode([nodes[p] for p in self.sinks])
        dag = graph.experimental_compile()
        if self.closed:  # (dropped while it compiled)
            dag.teardown()
        else:
            self.dag = dag

    @staticmethod
    def _execute_now(dag: Any, inputs: _Inputs) -> list[_Output]:
        return [ref.get(timeout=-1) for ref in dag.execute(inputs)]  # (-1: as long as the programs take)

    async def _execute(self, inputs: _Inputs) -> list[_Output]:
        loop = asyncio.get_running_loop()
        if self.dag is None:
            if self.compiling is None:
                self.thread = ThreadPoolExecutor(1, thread_name_prefix="azyx ray graph")
                self.compiling = loop.run_in_executor(self.thread, self._compile)
            try:
                await asyncio.shield(self.compiling)
            except Exception as e:
                raise await self._broken(e) from None
        if self.thread is None or self.dag is None:  # (closed while it compiled)
            return await self._submit(inputs)
        try:
            return await loop.run_in_executor(self.thread, self._execute_now, self.dag, inputs)
        except ray.exceptions.RayTaskError as e:
            if isinstance(e.cause, RemoteError):
                raise e.cause from None
            raise RemoteError(f"{self.hosts[self.sinks[0]].name} failed: {e.cause!r}") from None
        except Exception as e:  # the graph itself broke (a host died): Ray tears it down
            raise await self._broken(e) from None

    async def _broken(self, e: Exception) -> RemoteError:
        """The error for a compiled graph that failed to compile or run: the plan dropped (its next realize starts
        over), its hosts probed for the dead ones."""
        for k, plan in list(_PLANS.items()):
            if plan is self:
                del _PLANS[k]
        self.close()
        hosts = {h.index: h for h in self.hosts.values()}.values()
        dead = []
        for h in hosts:
            try:
                await h.actor.describe.remote()
            except ray.exceptions.RayActorError:
                dead.append(h.name)
        if not dead:
            return RemoteError(f"the compiled graph over {', '.join(h.name for h in hosts)} failed: {e!r}")
        return RemoteError(f"{', '.join(dead)} is gone (its actor died); what needs it cannot be computed")

    def close(self) -> Future | None:
        """Tear the compiled graph down (after the runs in flight), off the loop; returns that teardown."""
        self.closed = True
        if self.thread is None:
            return None
        dag, self.dag = self.dag, None
        done = self.thread.submit(dag.teardown) if dag is not None else None
        self.thread.shutdown(wait=False)
        self.thread = None
        return done


def _slots(a: Any) -> list[int]:
    """The slots an instruction's operands name."""
    if isinstance(a, _Ref):
        return [a.slot]
    if isinstance(a, tuple | list):
        return [s for x in a for s in _slots(x)]
    if isinstance(a, dict):
        return [s for x in a.values() for s in _slots(x)]
    return []


def _operands(t: RemoteTensor) -> list[RemoteTensor]:
    out: list[RemoteTensor] = []
    for a in (*t.args, *t.kwargs.values()):
        if isinstance(a, RemoteTensor):
            out.append(a)
        elif isinstance(a, tuple | list):
            out.extend(x for x in a if isinstance(x, RemoteTensor))
    return out


def all_reduce(values: Sequence[RemoteTensor], op: str = "sum") -> list[RemoteTensor]:
    """Partial values, one per host (each host's gradients), combined by `op` ("sum", "max", "min"): the result on
    each value's host (lazy: realize with what reads them). Every value is carried to every other host, and each
    host combines them all in the same order (equal results): one exchange between the hosts, where reducing on one
    host and carrying the result back takes two in turn (on a training step's path, a stage and a transfer fewer)."""
    combine = {"sum": "__add__", "max": "maximum", "min": "minimum"}.get(op)
    if combine is None:
        raise ArgumentError(f"all-reduce op must be sum, max or min, got {op!r}")
    if not values:
        raise ArgumentError("all-reduce of no values")
    out = []
    for v in values:
        total = values[0].to(v.host)
        for w in values[1:]:
            total = total._op(combine, w.to(v.host))
        out.append(total)
    return out


async def scatter(hosts: Sequence[Host], data: Any) -> list[RemoteTensor]:
    """`data` split along axis 0 over `hosts` (numpy's array_split sizes): a remote tensor on each."""
    return list(await asyncio.gather(*(h.tensor(part) for h, part in zip(hosts, np.array_split(np.asarray(data),
                                                                                              len(hosts))))))
