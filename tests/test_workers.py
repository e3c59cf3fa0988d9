"""Thread priorities and the GIL's hand-over, which keep the event loop's thread on time on a busy machine: threads
that run Python (workers, device queues, wgpu-py's poller) at the loop's priority, a driver's own threads and the
compilers below it (tests/test_loop_load.py measures the effect)."""

from __future__ import annotations

import os
import re
import sys
import threading

import pytest

from azyx import workers
from azyx.native import native
from azyx.runtime import RT


def _nice(native_id: int) -> int:
    return os.getpriority(os.PRIO_PROCESS, native_id)


def _driver_threads() -> dict[str, list[int]]:
    """The nice value of each thread of this process that is not a Python thread, by its name (Linux)."""
    python = {t.native_id for t in threading.enumerate()}
    out: dict[str, list[int]] = {}
    for tid in os.listdir("/proc/self/task"):
        if int(tid) in python:
            continue
        with open(f"/proc/self/task/{tid}/stat") as f:
            stat = f.read()
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        out.setdefault(name, []).append(int(stat[stat.rindex(")") + 2:].split()[16]))
    return out


HOST_QUEUE = re.compile(r"azyx-[a-z]+:\d+$")  # a host device's own thread (its kernels: C, the GIL released)


def _check_azyx_threads(threads: dict[str, int], mine: int, native_reads: bool) -> None:
    """`threads` (azyx's, name -> nice) at the priorities they should have beside a loop of nice `mine`: every one that
    holds the GIL at times (workers, device queues' submitters and waiters) at `mine`, and the disk readers
    WORKER_NICE below it where the native core reads (the GIL released from a read's start to its end). A host
    device's own thread is left to the caller."""
    readers = {name: n for name, n in threads.items() if name.startswith("azyx-disk") and native_reads}
    python = {name: n for name, n in threads.items() if name not in readers and not HOST_QUEUE.match(name)}
    assert python and all(n == mine for n in python.values()), python
    assert all(n == min(mine + workers.WORKER_NICE, 19) for n in readers.values()), readers


def test_at_lower_priority_returns_raises_and_lowers_only_its_own_thread() -> None:
    mine = _nice(threading.get_native_id())
    seen: list[int] = []

    def job(x: int) -> int:
        seen.append(_nice(threading.get_native_id()))
        return x * 2

    assert workers.at_lower_priority(job, 21) == 42
    assert seen == [min(mine + workers.WORKER_NICE, 19)]
    assert _nice(threading.get_native_id()) == mine
    with pytest.raises(ZeroDivisionError):
        workers.at_lower_priority(lambda: 1 // 0)


@pytest.mark.skipif(not hasattr(os, "getpriority") or sys.platform != "linux", reason="Linux thread priorities")
def test_a_python_thread_started_at_lower_priority_is_set_back() -> None:
    """wgpu-py starts its poller thread inside the device's creation: a Python thread, set back to the caller's
    priority (where the process may raise one)."""
    mine = _nice(threading.get_native_id())
    stop = threading.Event()
    started: list[threading.Thread] = []

    def start_one() -> None:
        t = threading.Thread(target=stop.wait, daemon=True)
        t.start()
        started.append(t)

    try:
        workers.at_lower_priority(start_one)
        assert started[0].native_id is not None
        got = _nice(started[0].native_id)
        may_raise = os.geteuid() == 0
        assert got == mine if may_raise else got in (mine, min(mine + workers.WORKER_NICE, 19))
    finally:
        stop.set()
        started[0].join()


@pytest.mark.skipif(sys.platform != "linux", reason="/proc")
def test_python_threads_run_at_the_loops_priority_and_driver_threads_below() -> None:
    """Once the devices have started: every azyx thread that holds the GIL at times (workers, device queues and
    waiters) runs at the main thread's priority, and a CPU driver's threads that run kernels (llvmpipe's, for
    lavapipe) below it. (A host device's own thread lowers itself: its kernels are C, run with the GIL released; so do
    the disk readers where the native core reads files, with the GIL released from a read's start to its end.)"""
    assert RT.executor.devices
    mine = _nice(threading.get_native_id())
    below = min(mine + workers.WORKER_NICE, 19)  # (AZYX_WORKER_NICE: 10 unless set)
    _check_azyx_threads({t.name: _nice(t.native_id) for t in threading.enumerate()
                         if t.native_id is not None and t.name.startswith("azyx-")}, mine, native is not None)
    drivers = _driver_threads()
    for name, nices in drivers.items():
        if name.startswith("llvmpipe"):
            assert all(n == below for n in nices), drivers


def test_the_gil_changes_hands_quickly_once_the_runtime_runs() -> None:
    assert RT.executor.devices
    assert sys.getswitchinterval() <= workers.SWITCH_INTERVAL


@pytest.mark.skipif(sys.platform != "linux", reason="/proc")
def test_a_runtime_started_by_a_first_realize_on_a_loop_gives_its_threads_the_same_priorities() -> None:
    """The first realize on an event loop starts the runtime on a probe thread of its own (off the loop): the threads
    it starts inherit that thread's priority, and a thread cannot raise its own again, so the probe runs at the loop's
    priority; the workers then run at it as when the runtime starts on the caller's thread, and the readers (native
    reads) below it. (A fresh process: this one's runtime has started. Its small realize runs inline on c:0: no queue
    thread of c:0's starts.)"""
    import json
    import subprocess

    script = """if True:
        import asyncio, json, os, threading
        import numpy as np
        import azyx
        from azyx.native import native

        async def main():
            await (azyx.Tensor(np.arange(4, dtype=np.float32), device="c:0") + 1).realize()
            return {t.name: os.getpriority(os.PRIO_PROCESS, t.native_id) for t in threading.enumerate()
                    if t.name.startswith("azyx-") and t.native_id is not None}

        print(json.dumps({"threads": asyncio.run(main()), "native": native is not None,
                          "mine": os.getpriority(os.PRIO_PROCESS, threading.get_native_id())}))
    """
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    mine, threads = got["mine"], got["threads"]
    assert [n for n in threads if n.startswith("azyx-worker")], threads
    _check_azyx_threads(threads, mine, got["native"])
