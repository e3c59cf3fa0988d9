"""The one Runtime: configuration, devices, executor, plan cache, program compilation, random state.

Devices start lazily, so `azyx.configure()` can run first: each backend is probed when first needed (a device of it
named, AUTO's backends for an AUTO tensor, every backend for `azyx.devices()`), and a device named on an event loop's
thread has its backend probed on a worker thread while the first realize waits (`await azyx.start()` probes them all
before a service serves). The graph outlives restarts.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import dataclasses
import itertools
import threading
from collections.abc import Iterable
from typing import Any

import numpy as np
import sniffio

from azyx import config as _config
from azyx import debug, search, workers
from azyx.backends.disk import DiskDevice
from azyx.codegen import search_actions as optimize
from azyx.device import Buffer, Device
from azyx.errors import AllocationError, DeviceError, RuntimeStateError, fresh_copy
from azyx.executor import UnifiedExecutor
from azyx.graph import GRAPH, StridedView
from azyx.loads import start_readers
from azyx.plan import ExecutionPlan, KernelStep
from azyx.queues import HostMemory
from azyx.registry import BACKENDS, Probe, probe
from azyx.timeline import LoopEvent
from azyx.workers import in_worker_thread


class PlanCache(dict[tuple, ExecutionPlan]):
    """ExecutionPlans by structural key (azyx.walk), at most `capacity` of them: a new plan past the capacity drops the
    least recently used one (it is planned again if its structure comes back). A realize that reuses a plan stamps it
    (`touch`, by the plan's identity: hashing its key again would cost a microsecond); the lookup itself is a plain
    dict's, as it is on every realize."""

    def __init__(self, capacity: int) -> None:
        super().__init__()
        self.capacity = capacity
        self.uses = itertools.count(1)
        self.stamps: dict[int, int] = {}  # id of a cached plan -> when it was last used

    def touch(self, plan: ExecutionPlan) -> None:
        self.stamps[id(plan)] = next(self.uses)

    def least_recent(self) -> tuple:
        """The key of the least recently used plan (a scan: only when a new plan is made, milliseconds anyway)."""
        return min(self, key=lambda k: self.stamps[id(dict.__getitem__(self, k))])

    def __setitem__(self, key: tuple, plan: ExecutionPlan) -> None:
        if key in self:
            del self[key]
        while len(self) >= self.capacity:
            del self[self.least_recent()]
        super().__setitem__(key, plan)
        self.touch(plan)

    def __delitem__(self, key: tuple) -> None:
        del self.stamps[id(dict.__getitem__(self, key))]
        super().__delitem__(key)

    def clear(self) -> None:
        self.stamps.clear()
        super().clear()


class Runtime:
    def __init__(self) -> None:
        self.cfg: dict[str, dict[str, Any]] | None = None
        self.overrides: dict[str, Any] = {}
        self._executor: UnifiedExecutor | None = None
        self.plan_cache = PlanCache(_config.DEFAULTS["runtime"]["plan_cache_size"])
        self.rng = np.random.default_rng()
        self.lock = threading.Lock()
        self.inflight: dict[str, InFlight] = {}  # kernel name -> the compile under way
        self.planning: dict[tuple, InFlight] = {}  # a walk's key -> the realize planning and compiling it
        self.compiled = 0  # kernels handed to a device's compiler (a new scalar value must add none)
        self.planned = 0  # plans made (a crowd of realizes of one new graph makes one)
        self.probes: dict[str, Probe] = {}  # backend kind -> what probing it found (each backend is probed once)
        self.probe_lock = threading.RLock()
        self.probing: list[concurrent.futures.Future[None]] = []  # probes under way on worker threads
        self.probing_kinds: set[str] = set()
        self.workers_started = False

    # ------------------------------------------------------------------ lifecycle
    @property
    def executor(self) -> UnifiedExecutor:
        """The executor, with host memory and the disk; a backend's devices join it when the backend is probed."""
        return self._executor or self._base()

    def _base(self) -> UnifiedExecutor:
        """The runtime's start: configuration read and checked, the executor with host memory and the disk. No backend
        is probed here, and no worker thread started (`ensure` does both)."""
        with self.lock:
            if self._executor is not None:
                return self._executor
            self.cfg = _config.load(self.overrides)
            self.plan_cache.capacity = _config.plan_cache_size(self.cfg)
            _config.search_settings(self.cfg)  # a bad search level or budget fails here, naming the value
            ex = UnifiedExecutor()
            ex.add_device(HostMemory(0, {}))
            ex.add_device(DiskDevice())  # file-backed tensors (azyx.io): not a compute device, never listed
            _config.auto_backends(self.cfg)
            self._executor = ex
            return ex

    def start(self, kinds: Iterable[str] | None = None) -> None:
        """Start the runtime and probe the backends of `kinds` (every backend: None) here and now (see `startup`
        for the same off the event loop)."""
        self.ensure(BACKENDS if kinds is None else kinds)

    async def startup(self, kinds: Iterable[str] | None = None) -> None:
        """`start` on a worker thread: the event loop stays free while drivers are probed and contexts created."""
        self.probe_in_background(list(BACKENDS if kinds is None else kinds))
        await self.probed()

    def ensure(self, kinds: Iterable[str]) -> None:
        """Probe the backends of `kinds` that are not probed yet, on this thread (each backend once, ever: its
        devices join the executor, or the probe says why it has none)."""
        ex = self.executor
        todo = [k for k in kinds if k not in self.probes]
        if not todo:
            return
        if not self.workers_started:  # (starting them waits for each thread to run: tens of ms on a busy machine)
            self.workers_started = True
            if workers.on_event_loop():
                threading.Thread(target=_start_threads, name="azyx-start", daemon=True).start()
            else:
                _start_threads()
        assert self.cfg is not None
        with self.probe_lock:
            for kind in todo:
                if kind in self.probes or kind not in BACKENDS:
                    continue
                record = probe(kind, self.cfg.get(kind, {}))
                if record.skipped:
                    debug.log(debug.DEVICES, f"backend {kind} skipped: {record.skipped}")
                if record.stderr:
                    debug.log(debug.DEVICES, f"backend {kind} wrote to stderr while probed:\n{record.stderr.rstrip()}")
                if self._executor is not ex:  # (the runtime was shut down meanwhile: configure())
                    for d in record.devices:
                        d.close()
                    return
                # a new dict, not an insert: the loop's thread may be iterating the devices meanwhile
                ex.devices = {**ex.devices, **{d.name: d for d in record.devices}}
                for d in record.devices:
                    debug.log(debug.DEVICES, f"device {d.name}: {d.capacity >> 20} MiB, ~{d.compute:.0f} GFLOP/s")
                self.probes[kind] = record

    def probe_in_background(self, kinds: list[str]) -> None:
        """Probe the backends of `kinds` on a thread of its own, starting now (`probed` waits for it); it starts the
        worker threads too, which the loop's thread would wait for."""
        with self.lock:
            todo = [k for k in kinds if k in BACKENDS and k not in self.probes and k not in self.probing_kinds]
            if not todo:
                return
            self.probing_kinds.update(todo)
            fut: concurrent.futures.Future[None] = concurrent.futures.Future()
            self.probing.append(fut)
        threading.Thread(target=self._probe, args=(todo, fut), name="azyx-probe", daemon=True).start()

    def _probe(self, kinds: list[str], fut: concurrent.futures.Future[None]) -> None:
        # (at the loop's priority, as the caller's thread would probe: the threads it starts inherit it, and a thread
        # cannot raise its priority again. The worker threads run Python beside the loop's; the drivers' and readers'
        # threads, the device queues' and the compilers lower their own: `workers.lower_priority`, `at_lower_priority`)
        try:
            self.ensure(kinds)
        except BaseException as e:  # (a bug: the realize that waits raises it)
            fut.set_exception(e)
        else:
            fut.set_result(None)

    async def probed(self) -> None:
        """Wait, without blocking the event loop, for the probes `probe_in_background` started (a realize waits here
        before it plans: its tensors may name a device whose backend was still being probed)."""
        while self.probing:
            fut = self.probing[0]
            try:
                await workers.result_of(fut)
            finally:
                with self.lock:
                    if fut.done() and fut in self.probing:
                        self.probing.remove(fut)
                        if not self.probing:
                            self.probing_kinds.clear()

    def configure(self, overrides: dict[str, Any]) -> None:
        merged = _config.merge(_config.DEFAULTS, overrides)  # validates the dict's shape and values
        _config.plan_cache_size(merged)
        _config.search_settings(merged)
        _config.auto_backends(merged)
        if self._executor is not None:
            if len(GRAPH):
                raise RuntimeStateError(f"configure() after tensors exist ({len(GRAPH)} live nodes); call it first")
            self.shutdown()
        self.overrides = overrides
        self.plan_cache.clear()

    def shutdown(self) -> None:
        concurrent.futures.wait(list(self.probing))  # (a probe under way finishes first: its devices are closed below)
        with self.lock:
            self.probing.clear()
            self.probing_kinds.clear()
            if self._executor is not None:
                self._executor.close()
                self._executor = None
            self.probes.clear()

    # ------------------------------------------------------------------ devices
    def device(self, name: str) -> Device:
        dev = self.executor.devices.get(name)
        if dev is None:
            kind = name.partition(":")[0]
            if kind in BACKENDS and kind not in self.probes:
                self.ensure([kind])
            dev = self.executor.devices.get(name)
            if dev is None:
                raise self.unknown(name)
        return dev

    def unknown(self, device: str) -> DeviceError:
        """The error for a device that does not exist: the devices that do, and why its backend has none."""
        kind = device.partition(":")[0]
        record = self.probes.get(kind)
        why = f" (backend {kind} skipped: {record.skipped})" if record is not None and record.skipped else ""
        names = [n for n, d in self.executor.devices.items() if d.listed]
        later = [k for k in BACKENDS if k not in self.probes]
        more = f" (backends not probed yet: {', '.join(later)})" if later else ""
        return DeviceError(f"unknown device {device!r}{why}; available: {', '.join(names) or 'none'}{more}")

    def started_devices(self) -> dict[str, Device]:
        """Every device started so far (this starts nothing: none before the runtime starts)."""
        return self._executor.devices if self._executor is not None else {}

    def device_names(self, kinds: Iterable[str] | None = None) -> list[str]:
        """Every compute device of the backends of `kinds` (None: every backend), probing those not probed yet on this
        thread: AUTO's candidates first, in AUTO's order, then the others by the same rule."""
        kinds = list(BACKENDS if kinds is None else kinds)
        self.ensure(kinds)
        auto = self.auto_kinds()
        devs = [d for d in self.executor.devices.values() if d.listed and d.failed is None and d.kind in kinds]
        devs.sort(key=lambda d: (d.kind not in auto, -d.compute, d.name))
        return [d.name for d in devs]

    def auto_kinds(self) -> list[str]:
        """The backends AUTO chooses among (config `runtime.auto`)."""
        if self.cfg is None:
            self._base()
        assert self.cfg is not None
        return _config.auto_backends(self.cfg)

    def auto_order(self) -> list[str]:
        """AUTO's candidates, best first: the compute devices of the backends in `runtime.auto` (by default CUDA, then
        C; the dummy device where enabled), by their speed estimate (`Device.compute`, from the device's facts: never
        timed, never its load, so that the same machine and configuration place the same way), ties by name; where
        those backends have no device, every backend's devices by the same rule. A device that has failed is left
        out. Probes the backends it needs on this thread (`await azyx.start()` does it off the event loop first)."""
        kinds = self.auto_kinds()
        self.ensure(kinds)
        devs = self._computing(kinds)
        if not devs:
            self.ensure(BACKENDS)
            devs = self._computing(BACKENDS)
        devs.sort(key=lambda d: (-d.compute, d.name))
        return [d.name for d in devs]

    def _computing(self, kinds: Iterable[str]) -> list[Device]:
        """The devices of `kinds` that can compute (listed or not: the dummy device plans but holds no data) and have
        not failed."""
        kinds = set(kinds)
        return [d for d in self.executor.devices.values()
                if d.kind in kinds and (d.listed or d.unlisted_compute) and d.failed is None]

    def check_device(self, device: str) -> str:
        """The device's full name ("c" is c:0; "disk"). A device of a backend not probed yet, named on an event loop's
        thread, is taken by its name (its backend is probed on a worker thread meanwhile, and the realize waits for
        that: an index past the backend's devices raises there); elsewhere the backend is probed here."""
        if not isinstance(device, str):
            raise DeviceError(f"device must be a string like 'c:0', got {device!r}")
        ex = self.executor
        name = device if ":" in device or device in ex.devices else f"{device}:0"
        if name in ex.devices:
            return name
        kind, _, index = name.partition(":")
        if kind in BACKENDS and kind not in self.probes:
            if index.isdigit() and workers.on_event_loop() and self.cfg is not None \
                    and self.cfg.get(kind, {}).get("enabled", BACKENDS[kind].config.get("enabled", True)):
                self.probe_in_background([kind])
                return name
            self.ensure([kind])
            if name in ex.devices:
                return name
        raise self.unknown(device)

    def resolve_device(self, device: str | None, nbytes: int) -> tuple[str, bool]:
        """AUTO (None): the first device of `auto_order` that has room; else the named device, pinned. What is made
        "on" a storage device (disk: a constant beside a disk tensor) is made on AUTO: storage computes nothing."""
        if device is not None:
            name = self.check_device(device)
            dev = self.executor.devices.get(name)
            if dev is None or not dev.storage:  # (None: its backend is being probed)
                return name, True
        order = self.auto_order()
        devices = self.executor.devices
        for name in order:
            if devices[name].free_memory() >= nbytes:
                return name, False
        if not order:
            raise DeviceError("no device is available (check the configuration, and `python -m azyx` for why)")
        raise AllocationError(f"{nbytes} bytes fit on no device: " + ", ".join(
            f"{n} has {devices[n].free_memory()} free" for n in order))

    def placement(self, home: str) -> list[str]:
        """Where the scheduler may put an AUTO kernel whose inputs are on `home`: AUTO's candidates that are listed
        compute devices (not the dummy one), and `home`."""
        devices = self.executor.devices
        order = [d for d in self.auto_order() if devices[d].listed]
        return order if home in order or home not in devices else [*order, home]

    def buffer_from_numpy(self, arr: np.ndarray, device: str) -> tuple[Buffer, StridedView]:
        """Host data for a tensor on `device`: in place on host-memory devices, else held in host memory until a
        plan copies it over (building never touches a device)."""
        dev = self.executor.devices.get(device)  # (None: its backend is being probed)
        if dev is None or not dev.host_memory:
            dev = self.device("host:0")
        return dev.buffer_from_numpy(arr), StridedView.contiguous(arr.shape)

    # ------------------------------------------------------------------ search
    def search_settings(self) -> tuple[str, float]:
        """(level, per-kernel budget in seconds) of the kernel search (config `search`, $AZYX_SEARCH)."""
        if self.cfg is None:
            self._base()
        assert self.cfg is not None
        return _config.search_settings(self.cfg)

    async def search(self, plan: ExecutionPlan, level: str, budget_s: float) -> tuple[ExecutionPlan,
                                                                                   list[search.SearchResult]]:
        """Search the plan's kernels that have no winner in their device's disk cache (on worker threads, one kernel
        at a time), and the plan with each kernel made as its winner says."""
        steps = list(plan.steps)
        results: list[search.SearchResult] = []
        for i, st in enumerate(steps):
            if not isinstance(st, KernelStep):
                continue
            dev = self.device(st.device)
            if not dev.search_actions:
                continue
            r = await in_worker_thread(search.search_step, dev, st, search.kernel_step_nbytes(plan, st), level,
                                       budget_s)
            if r is None:
                continue
            results.append(r)
            if r.winner != st.kernel.opts:
                steps[i] = search.retuned(dev, st, optimize.apply(st.kernel.base or st.kernel, r.winner))
        if any(a is not b for a, b in zip(steps, plan.steps)):
            plan = dataclasses.replace(plan, steps=tuple(steps))
        return plan, results

    # ------------------------------------------------------------------ compilation
    async def compile(self, plan: ExecutionPlan) -> ExecutionPlan:
        """Compile the plan's kernels not yet loaded, one batch per device; concurrent realizes of the same
        kernels wait for the compile already running instead of starting another, and get its error when it fails
        (a CompileError: the compiler failed or ran past `compile_timeout_s`). A failed compile leaves nothing
        compiled: the next realize compiles again. With the kernel search on, kernels without a cached winner are
        searched first; returns the plan to run (its kernels the winners)."""
        level, budget_s = self.search_settings()
        if level != "off":
            plan, _ = await self.search(plan, level, budget_s)
        by_dev: dict[str, list[KernelStep]] = {}
        for k in plan.kernels:
            by_dev.setdefault(k.device, []).append(k)
        loop_id = loop_identity()
        for name, steps in by_dev.items():
            dev = self.device(name)
            while True:
                waiting = [self.inflight[s.name] for s in steps if s.name in self.inflight]
                mine = [w for w in waiting if w.loop == loop_id]
                if not mine:
                    break
                await mine[0].event.wait()
                if mine[0].error is not None:  # the compile we waited for failed: so does this realize
                    raise fresh_copy(mine[0].error)
            todo = [s for s in steps if not dev.has_program(s.name)]
            if not todo:
                continue
            job = InFlight(loop_id)
            for s in todo:
                self.inflight[s.name] = job
            self.compiled += len(todo)
            try:
                await dev.compile(todo)
            except Exception as e:  # (a cancelled compile is no failure: whoever waited compiles anew)
                job.error = e
                raise
            finally:
                for s in todo:
                    if self.inflight.get(s.name) is job:
                        del self.inflight[s.name]
                job.event.set()
        return plan


class InFlight:
    """A compile (or a plan) under way, for the realizes (of the same loop) that need the same kernels (the same
    plan): they wait for `event`, then raise its `error` if it failed."""

    __slots__ = ("loop", "event", "error")

    def __init__(self, loop: int):
        self.loop, self.event = loop, LoopEvent()
        self.error: BaseException | None = None


def _start_threads() -> None:
    """The runtime's threads: the workers' and the disk's readers, each started at once rather than at a first use
    that may be on the event loop (starting a thread waits for it to run)."""
    workers.start()
    start_readers()


def loop_identity() -> int:
    lib = sniffio.current_async_library()
    if lib == "asyncio":
        import asyncio

        return id(asyncio.get_running_loop())
    import trio

    return id(trio.lowlevel.current_trio_token())


RT = Runtime()
atexit.register(RT.shutdown)  # finish device queues before the interpreter goes (drivers call back into Python)
