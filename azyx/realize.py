"""The asynchronous path of one realize: canonical walk -> cached plan (or schedule + compile) -> submit ->
the targets become leaves -> wait for their timeline values on the event loop."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from azyx.errors import AzyxIOError, RuntimeStateError
from azyx.plan import canonicalize, make_plan
from azyx.runtime import GRAPH, RT

if TYPE_CHECKING:
    from azyx.device import Device
    from azyx.tensor import Tensor

T = TypeVar("T")


async def realize(*tensors: Tensor) -> None:
    """Compute all `tensors` in one plan; returns when their buffers are ready."""
    rt = RT
    ex = rt.executor
    while True:
        targets = list(dict.fromkeys(t.id for t in tensors if GRAPH[t.id].buffer is None))
        if not targets:
            break
        walk = canonicalize(GRAPH, targets)
        plan = rt.plan_cache.get(walk.key)
        if plan is None:
            plan = make_plan(rt, GRAPH, walk, targets)
            await rt.compile(plan)  # the graph may change meanwhile (other tasks): walk it again
            rt.plan_cache[walk.key] = plan
            continue
        bindings = [GRAPH[i].buffer for i in walk.leaves]
        outs = ex.run(plan, bindings)
        for (slot, _), buf in zip(plan.adopt, ex.adopted):  # uploaded host data stays on its device
            GRAPH[walk.leaves[slot]].buffer = buf
        ex.adopted = []
        for tid, (buf, view) in zip(targets, outs):
            GRAPH.become_leaf(tid, buf, view)
        break
    last: dict[Device, int] = {}  # a device's queue is in order: its latest value covers every earlier one
    for t in tensors:
        buf = GRAPH[t.id].buffer
        assert buf is not None
        if buf.ready > last.get(buf.device, -1):
            last[buf.device] = buf.ready
    for dev, ready in last.items():  # one wake-up per device, not one per tensor
        if dev.timeline.value < ready:
            dev.poll(ready)  # a small plan may be done already: then no wake-up from the device's thread
        if dev.timeline.value < ready:
            await dev.timeline.wait(ready)
        _raise_failure(dev)


def _raise_failure(dev: Any) -> None:
    """Raise the first failure of `dev`'s queued work, if any (the runtime stays usable)."""
    if dev.errors:
        err = dev.errors.pop(0)
        if isinstance(err, AzyxIOError):  # a file read failed (e.g. truncated after opening): it names the file
            raise err
        raise RuntimeStateError(f"{dev.name}: a work item failed: {err!r}") from err


async def to_numpy(t: Tensor) -> np.ndarray:
    await realize(t)
    n = GRAPH[t.id]
    assert n.buffer is not None and n.view is not None
    buf, view, shape, dtype = n.buffer, n.view, n.shape, n.dtype
    dev = buf.device
    if not dev.host_memory and not dev.storage:  # a device with a queue: read in its order, await the timeline
        host = np.empty(buf.nbytes, np.uint8)
        v = dev.copy_to_host(buf, host, [])
        if v is not None:
            await dev.timeline.wait(v)
            _raise_failure(dev)
            from azyx.backends.host import host_read

            return host_read(host, view, shape, dtype)
    if buf.nbytes >= (8 << 20) or dev.storage:  # large copies and file reads leave the loop free
        from azyx.workers import in_worker_thread

        return await in_worker_thread(buf.device.read, buf, view, shape, dtype)
    return buf.device.read(buf, view, shape, dtype)


_local = threading.local()


def run_sync(coro: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine to completion for scripts; refuses inside a running event loop."""
    try:
        asyncio.get_running_loop()
        running = True
    except RuntimeError:
        running = False
    if not running:
        try:
            import sniffio

            sniffio.current_async_library()
            running = True
        except Exception:
            running = False
    if running:
        coro.close()
        raise RuntimeStateError("realize_sync()/numpy_sync() called inside a running event loop; "
                                "use `await t.realize()` / `await t.numpy()` there")
    loop = getattr(_local, "loop", None)
    if loop is None or loop.is_closed():
        loop = _local.loop = asyncio.new_event_loop()
    return loop.run_until_complete(coro)
