"""The one Runtime: configuration, devices, executor, plan cache, program compilation, random state.

Devices start lazily, on first use, so `azyx.configure()` can run first. The graph outlives restarts.
"""

from __future__ import annotations

import atexit
import dataclasses
import itertools
import threading
from typing import Any

import numpy as np
import sniffio

from azyx import config as _config
from azyx import debug, optimize, search, workers
from azyx.backends import BACKENDS, load_backend
from azyx.backends.disk import DiskDevice
from azyx.backends.host import HostMemory
from azyx.device import Buffer, Device
from azyx.errors import AllocationError, DeviceError, RuntimeStateError, fresh_copy
from azyx.executor import UnifiedExecutor
from azyx.graph import Graph, StridedView
from azyx.plan import ExecutionPlan, KernelStep
from azyx.timeline import LoopEvent
from azyx.workers import in_worker_thread

GRAPH = Graph()


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

    # ------------------------------------------------------------------ lifecycle
    @property
    def executor(self) -> UnifiedExecutor:
        if self._executor is None:
            self.start()
        assert self._executor is not None
        return self._executor

    def start(self) -> None:
        with self.lock:
            if self._executor is not None:
                return
            self.cfg = _config.load(self.overrides)
            self.plan_cache.capacity = _config.plan_cache_size(self.cfg)
            _config.search_settings(self.cfg)  # a bad search level or budget fails here, naming the value
            ex = UnifiedExecutor()
            ex.add_device(HostMemory(0, {}))
            for kind in BACKENDS:
                section = self.cfg.get(kind, {})
                if not section.get("enabled", kind != "dummy"):
                    continue
                try:
                    device_class = load_backend(kind)
                    for i in range(device_class.count(section)):
                        ex.add_device(device_class(i, section))
                except Exception as e:  # a missing package or driver disables that backend only
                    debug.log(debug.DEVICES, f"backend {kind} skipped: {type(e).__name__}: {e}")
            if not any(d.listed for d in ex.devices.values()):
                debug.log(debug.DEVICES, "no compute device available")
            ex.add_device(DiskDevice())  # file-backed tensors (azyx.io): not a compute device, never listed
            workers.start()
            self._executor = ex

    def configure(self, overrides: dict[str, Any]) -> None:
        merged = _config.merge(_config.DEFAULTS, overrides)  # validates the dict's shape and values
        _config.plan_cache_size(merged)
        _config.search_settings(merged)
        if self._executor is not None:
            if len(GRAPH):
                raise RuntimeStateError(f"configure() after tensors exist ({len(GRAPH)} live nodes); call it first")
            self.shutdown()
        self.overrides = overrides
        self.plan_cache.clear()

    def shutdown(self) -> None:
        with self.lock:
            if self._executor is not None:
                self._executor.close()
                self._executor = None

    # ------------------------------------------------------------------ devices
    def device(self, name: str) -> Device:
        return self.executor.context(name)

    def started_devices(self) -> dict[str, Device]:
        """Every device, once the runtime has started (this starts nothing: none before)."""
        return self._executor.devices if self._executor is not None else {}

    def device_names(self) -> list[str]:
        return [n for n in self.auto_order() if self.executor.devices[n].listed]

    def auto_order(self) -> list[str]:
        """Devices that can compute, most free compute first (the dummy device plans but holds no data); a device that
        has failed is left out."""
        devs = [d for d in self.executor.devices.values() if (d.listed or d.kind == "dummy") and d.failed is None]
        devs.sort(key=lambda d: (-d.compute / (1 + d.pending()), d.name))
        return [d.name for d in devs]

    def check_device(self, device: str) -> str:
        if not isinstance(device, str):
            raise DeviceError(f"device must be a string like 'c:0', got {device!r}")
        name = device if ":" in device or device in self.executor.devices else f"{device}:0"  # "c" is c:0; "disk"
        if name not in self.executor.devices:
            raise DeviceError(f"unknown device {device!r}; available: {', '.join(self.executor.devices) or 'none'}")
        return name

    def resolve_device(self, device: str | None, nbytes: int) -> tuple[str, bool]:
        """AUTO (None): the device with the most free compute that has room; else the named device, pinned. What is
        made "on" a storage device (disk: a constant beside a disk tensor) is made on AUTO: storage computes nothing."""
        if device is not None:
            name = self.check_device(device)
            if not self.executor.devices[name].storage:
                return name, True
        order = self.auto_order()
        for name in order:
            if self.executor.devices[name].free_memory() >= nbytes:
                return name, False
        if not order:
            raise DeviceError("no device is available (check the configuration and AZYX_DEBUG=1)")
        raise AllocationError(f"{nbytes} bytes fit on no device: " + ", ".join(
            f"{n} has {self.executor.devices[n].free_memory()} free" for n in order))

    def buffer_from_numpy(self, arr: np.ndarray, device: str) -> tuple[Buffer, StridedView]:
        """Host data for a tensor on `device`: in place on host-memory devices, else held in host memory until a
        plan copies it over (building never touches a device)."""
        dev = self.device(device)
        if not dev.host_memory:
            dev = self.device("host:0")
        return dev.buffer_from_numpy(arr), StridedView.contiguous(arr.shape)

    # ------------------------------------------------------------------ search
    def search_settings(self) -> tuple[str, float]:
        """(level, per-kernel budget in seconds) of the kernel search (config `search`, $AZYX_SEARCH)."""
        if self.cfg is None:
            self.start()
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


def loop_identity() -> int:
    lib = sniffio.current_async_library()
    if lib == "asyncio":
        import asyncio

        return id(asyncio.get_running_loop())
    import trio

    return id(trio.lowlevel.current_trio_token())


RT = Runtime()
atexit.register(RT.shutdown)  # finish device queues before the interpreter goes (drivers call back into Python)
