"""The event loop never stalls: a 1 ms heartbeat task on the loop stays on time while azyx serves many requests that
each compile, realizes a large never-seen graph, and uploads and reads back a large host array. Nothing that takes
more than about a millisecond (planning a big graph, compiling, loading a module, copying a large buffer, pinning or
allocating a lot of memory) may run on the loop's thread, no thread that holds the GIL runs at a lower priority than
the loop's, and the GIL changes hands every 0.5 ms (workers.SWITCH_INTERVAL). On failure the message says what the
loop's thread and the others were doing during the longest stall (`azyx.debug.LoopStalls`).
tests/test_loop_load.py runs the same scenarios beside two busy processes.

The bound holds for the lateness the process causes: each beat's lateness less the time the loop's thread waited,
runnable, for a CPU during it, the time the hypervisor took a CPU (steal) and, in a stall, the longest time another
Python thread of the process waited for one or the loop's thread lay in its selector with its timer due (Linux's
schedstat, /proc/stat and the thread's syscall; `LoopStalls.worst_own_ms`). Work on the loop's thread and the GIL
held by azyx's other threads while they run count against it; a machine whose cores are all taken by other processes
(CI's neighbours, the load test's busy processes), delaying the loop's wake-up or the GIL holder's, does not. Both
figures are printed."""

from __future__ import annotations

import asyncio
import gc
import os
import time
from collections.abc import Awaitable, Callable

import numpy as np
import pytest
from runtime_state import settle

from azyx import Tensor
from azyx.debug import LoopStalls

pytestmark = pytest.mark.serial  # (timing: run alone, see dev.sh)

# the lateness of its own a run may cause on CI's 2-core shared machine, with a margin (AZYX_TEST_LATENESS_MS sets
# another): the stalls these tests exist for were 100-1,600 ms. The goal of 5 ms on a quiet machine is not held by
# every scenario on a shared machine (at load 1-2: 14 of 16 within 5 ms, worst 17 ms; in 10 runs at load 30-370 by
# other jobs: 12-16 of 16 within 5 ms, worst 31-46 ms of its own, each in a stall the machine made: the loop's thread
# or the GIL's holder without a CPU, beats the sampler could not see); `pytest -m serial -rP` prints each figure
BOUND_MS = float(os.environ.get("AZYX_TEST_LATENESS_MS", 50))
REQUESTS = 200
GRAPH_ELEMENTS = 64 << 20
UPLOAD_BYTES = 256 << 20


async def _worst_lateness_ms(work: Callable[[], Awaitable[None]]) -> tuple[float, str]:
    """Run `work` beside a task that sleeps 1 ms in a loop; the latest wake-up past its 1 ms (ms) while `work` ran,
    and what the loop's thread (and the others) were doing during the longest stall (`LoopStalls.report`; a beat
    2 ms late starts a stall; AZYX_STALL_DEPTH: frames per stack)."""
    gc.collect()
    gc.freeze()  # as a service does after start-up (README): a full collection of the test run's heap takes ~40 ms
    try:
        async with LoopStalls(late_after=3e-3, depth=int(os.environ.get("AZYX_STALL_DEPTH", 10))) as stalls:
            await work()
    finally:
        gc.unfreeze()
    return stalls.worst_own_ms, (f"{len(stalls.lateness)} beats, worst {stalls.worst_ms:.1f} ms late with the waits "
                                 f"for a CPU; {stalls.report()}")


async def on_time(device: str, scenario: Callable[[str, bool], Awaitable[tuple[float, str]]],
                  bound: float | None = None, fresh: bool = False) -> None:
    """`scenario` on `device` keeps the heartbeat within the bound and leaves no node or buffer behind. `fresh`: its
    variant of other shapes and ops (compiled anew after the others ran), a quarter of the size (`_size`)."""
    bound = BOUND_MS if bound is None else bound
    base = await settle()
    worst, what = await scenario(device, fresh)
    print(f"{device} {scenario.__name__.strip('_')}: the heartbeat was {worst:.1f} ms late of its own; {what}")  # -rP
    assert worst <= bound, f"{device}: the heartbeat was {worst:.1f} ms late of its own (bound {bound} ms): {what}"
    assert await settle() == base


def _size(n: int, fresh: bool) -> int:
    """`n` elements, or for a fresh variant a quarter of them and one more (a shape no other test compiled)."""
    return n // 4 + 1 if fresh else n


async def _requests(device: str, fresh: bool = False) -> tuple[float, str]:
    xs = np.linspace(-2, 2, _size(4096, fresh), dtype=np.float32)
    x = await Tensor(xs, device=device).realize()
    salt = os.getpid() % 9973 / 9973  # scalars this process has not seen
    got: dict[int, float] = {}

    async def request(i: int) -> None:
        a, b = 1.0 + salt + i / 512, i / 1024 - 0.25
        got[i] = await ((x * a + b).relu() * 0.5).sum().item()

    async def work() -> None:
        await asyncio.gather(*(request(i) for i in range(REQUESTS)))

    late = await _worst_lateness_ms(work)
    for i in range(REQUESTS):
        a, b = np.float32(1.0 + salt + i / 512), np.float32(i / 1024 - 0.25)
        np.testing.assert_allclose(got[i], (np.maximum(xs * a + b, 0) * 0.5).sum(dtype=np.float64), rtol=1e-4)
    return late


async def test_many_requests_with_distinct_scalars_leave_the_loop_free(device: str) -> None:
    """(a) Concurrent requests, each with its own scalars (until scalars are kernel arguments, each compiles)."""
    await on_time(device, _requests)


async def _large_graph(device: str, fresh: bool = False) -> tuple[float, str]:
    xs = np.random.default_rng(1).random(_size(GRAPH_ELEMENTS, fresh), dtype=np.float32)
    x = await Tensor(xs, device=device).realize()
    salt = 1.0 + os.getpid() % 9973 / 9973 + time.time() % 1  # a kernel no earlier run compiled
    y = ((x * salt + 0.5).sqrt() * x - 1.0).relu()
    if fresh:  # (a large elementwise kernel takes its size as an argument: other ops make it new)
        y = (y + 1.0).relu()
    late = await _worst_lateness_ms(y.realize)
    probe = np.arange(0, len(xs), 4099)
    ref = np.maximum(np.sqrt(xs[probe] * np.float32(salt) + np.float32(0.5)) * xs[probe] - 1, 0) + fresh
    np.testing.assert_allclose((await y.numpy())[probe], ref, rtol=1e-5, atol=1e-6)
    return late


async def test_first_realize_of_a_large_new_graph_leaves_the_loop_free(device: str) -> None:
    """(b) Planning, compiling, allocating and first touching a graph of 64M elements never seen before."""
    await on_time(device, _large_graph)


async def _upload(device: str, fresh: bool = False) -> tuple[float, str]:
    data = np.random.default_rng(2).integers(0, 1 << 30, _size(UPLOAD_BYTES // 4, fresh), dtype=np.int32)
    x = Tensor(data, device=device)
    back: list[np.ndarray] = []

    async def work() -> None:
        await x.realize()
        back.append(await x.numpy())

    late = await _worst_lateness_ms(work)
    np.testing.assert_array_equal(back[0], data)
    return late


async def test_uploading_and_reading_back_a_large_array_leaves_the_loop_free(device: str) -> None:
    """(c) 256 MiB of host data realized onto the device and read back with numpy() (building the tensor, a
    synchronous copy of the caller's array, is outside the measure)."""
    await on_time(device, _upload)


async def _long_chain(device: str, fresh: bool = False) -> tuple[float, str]:
    xs = np.linspace(0.5, 1.5, _size(4096, fresh), dtype=np.float32)
    x = await Tensor(xs, device=device).realize()
    salt = os.getpid() % 9973 / 1e6
    steps = [x]
    ref = [xs.astype(np.float64)]
    for i in range(120):  # ~300 nodes: planned on a worker thread (tens of ms on the loop otherwise)
        k = 1 + salt + i / 1e4
        steps.append((steps[-1] * k).sqrt() + 0.25 if i % 2 else steps[-1] * k - 0.125)
        ref.append(np.sqrt(ref[-1] * k) + 0.25 if i % 2 else ref[-1] * k - 0.125)
    y = steps[-1].sum()

    async def work() -> None:
        task = asyncio.create_task(y.realize())
        await asyncio.sleep(0)  # y's plan is being made from a copy of its nodes: change the graph under it
        mids = [steps[j] for j in range(30, 120, 30)]
        await asyncio.gather(*(m.realize() for m in mids))  # these become leaves, and forget how they were made
        for j, m in zip(range(30, 120, 30), mids):
            np.testing.assert_allclose(await m.numpy(), ref[j], rtol=1e-4)
        await task

    late = await _worst_lateness_ms(work)
    np.testing.assert_allclose(await y.item(), ref[-1].sum(), rtol=1e-4)
    return late


async def test_a_long_graph_is_planned_off_the_loop_while_its_nodes_change(device: str) -> None:
    """Planning and rendering a graph of hundreds of nodes runs on a worker, from a copy of the nodes: other tasks
    realize nodes of the same graph meanwhile, and both get numpy's values."""
    await on_time(device, _long_chain)


SCENARIOS = {"requests": _requests, "large_graph": _large_graph, "upload": _upload, "long_chain": _long_chain}
