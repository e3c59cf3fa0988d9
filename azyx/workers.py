"""Blocking host work (compilers, large copies) on worker threads, awaited from asyncio or trio.

Completion comes back through the same loop bridge as device completion. A cancelled waiter abandons the
work, which still runs to its end; `drain()` waits for everything started so far.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import concurrent.futures.thread  # (imported now, not by the first worker job, on the loop)
import contextlib
import os
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import sniffio

from azyx.timeline import _LoopWaiter

T = TypeVar("T")
WORKER_NICE = int(os.environ.get("AZYX_WORKER_NICE", "10"))  # how far below the loop's thread workers run
# how long the loop's thread waits for the GIL while another thread runs Python (planning, a driver's Python
# wrapper) before that thread must let go: the loop takes the GIL back after each call that released it (its select,
# each driver call), so at Python's 5 ms a realize that made several such calls beside a worker planning a graph
# waited that many times 5 ms (200 requests on c:0 at load 6-7: 19.7-28.9 ms late at 5 ms, 7.0-13.1 at 0.5 ms)
SWITCH_INTERVAL = 0.5e-3

_pool: concurrent.futures.ThreadPoolExecutor | None = None
_pending: set[concurrent.futures.Future[Any]] = set()
_lock = threading.Lock()


def _executor() -> concurrent.futures.ThreadPoolExecutor:
    global _pool
    with _lock:
        if _pool is None:
            # (at the loop's own priority: they run Python, and a thread of lower priority that holds the GIL when
            # a busy machine preempts it holds the loop's thread off the GIL until it gets a core again: 100-160 ms
            # beside two busy processes at nice 10; the compilers they start run at a lower priority, `run_compiler`)
            _pool = started_pool(max(2, os.cpu_count() or 2), "azyx-worker")
        return _pool


def started_pool(n: int, name: str, initializer: Callable[[], None] | None = None
                 ) -> concurrent.futures.ThreadPoolExecutor:
    """A pool of `n` threads named `name`-i, each started now (made at the runtime's start-up, off the loop): a pool
    that grows later starts a thread inside a submit, which waits for it to run, and a busy machine made that wait
    tens of ms on the loop (the disk's readers: 1-4 ms for a process's first two transfers on a 2-core machine)."""
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=n, thread_name_prefix=name, initializer=initializer)
    meet = threading.Barrier(n)
    for _ in range(n):
        pool.submit(meet.wait, 5.0)
    return pool


def start() -> None:
    """Start the worker threads (at the runtime's start-up, not at the first job), and shorten the interpreter's
    switch interval to SWITCH_INTERVAL (a process that set a shorter one keeps it)."""
    _executor()
    if sys.getswitchinterval() > SWITCH_INTERVAL:
        sys.setswitchinterval(SWITCH_INTERVAL)


def on_event_loop() -> bool:
    """Whether the calling thread is running an asyncio event loop, or one that sniffio is told of (trio's). Without
    raising: the disk's reader threads ask it of every read (`sniffio.current_async_library` raised twice on a thread
    that runs no loop, the most Python a read made besides its own bookkeeping)."""
    return asyncio._get_running_loop() is not None or sniffio.thread_local.name is not None or \
        sniffio.current_async_library_cvar.get() is not None


def lower_priority(pid: int | None = None) -> None:
    """Run the calling thread and the processes it starts (or the process `pid`, a compiler, and those it starts) at
    a lower priority than the event loop's: on a machine whose cores are all busy, the loop then still wakes on time.
    (Only for a thread that spends its time in C with the GIL released: see `_executor`.) WORKER_NICE below the
    calling thread's priority, never above it."""
    try:
        mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id() if pid is None else pid,
                       min(mine + WORKER_NICE, 19))
    except (OSError, AttributeError):
        pass


def at_lower_priority(fn: Callable[..., T], *args: Any) -> T:
    """Call `fn(*args)` on a fresh thread of lower priority and wait for it. For a driver's start (an instance, a
    device): the threads it starts meanwhile inherit that thread's priority (llvmpipe's, which run lavapipe's
    kernels, and PoCL's), and as device work they run below the event loop's thread (at its priority, two of them
    beside two busy processes left the loop unscheduled for 40-60 ms)."""
    out: list[tuple[bool, Any]] = []

    def run() -> None:
        lower_priority()
        try:
            out.append((True, fn(*args)))
        except BaseException as e:
            out.append((False, e))

    before = set(threading.enumerate())
    thread = threading.Thread(target=run, name="azyx-driver-start", daemon=True)
    thread.start()
    thread.join()
    # Python threads it started (wgpu-py's poller) run Python, holding the GIL: back at the caller's priority where
    # the process may raise one (else they stay lower: their completions come later)
    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    for t in set(threading.enumerate()) - before:
        if t.native_id is not None:
            try:
                os.setpriority(os.PRIO_PROCESS, t.native_id, mine)
            except OSError:
                pass
    ok, value = out[0]
    if not ok:
        raise value
    return value


def _call(job: list[Any]) -> Any:
    """Run a job and let go of its function and arguments before its future completes: the pool's work item
    outlives the call by a moment, and must not keep buffers alive past the wake-up it triggers."""
    fn, args = job.pop()
    return fn(*args)


async def in_worker_thread(fn: Callable[..., T], *args: Any) -> T:
    """Run `fn(*args)` on a worker thread; the event loop stays free while it runs."""
    fut = _executor().submit(_call, [(fn, args)])
    with _lock:
        _pending.add(fut)
    fut.add_done_callback(_forget)
    if not fut.done():
        waiter = _LoopWaiter()
        fut.add_done_callback(waiter.wake_from)
        await waiter.wait()
    return fut.result()


# held by the worker running Python-heavy work (`in_python_thread`): the GIL runs one thread's Python at a time anyway,
# and each more thread that wants it makes the loop's thread wait longer for its turn (two workers planning graphs at
# once beside a busy machine: the loop slept 10-43 ms on the GIL). Re-entrant: a job in it may take it again
_python_lane = threading.RLock()


def _in_lane(fn: Callable[..., T], *args: Any) -> T:
    with _python_lane:
        return fn(*args)


async def in_python_thread(fn: Callable[..., T], *args: Any) -> T:
    """`in_worker_thread` for work that is mostly Python (planning a graph): such jobs run one at a time."""
    return await in_worker_thread(_in_lane, fn, *args)


@contextlib.contextmanager
def python_lane() -> Iterator[None]:
    """On a worker thread: a stretch of mostly Python work inside a job that is not (a driver wrapper's Python after
    a compile), in turn with `in_python_thread`'s jobs."""
    with _python_lane:
        yield


def in_background(fn: Callable[[], Any]) -> None:
    """Run `fn()` on a worker thread without waiting for it (`drain()` still does)."""
    fut = _executor().submit(fn)
    with _lock:
        _pending.add(fut)
    fut.add_done_callback(_forget)


def start_in_worker_thread(fn: Callable[..., T], *args: Any) -> concurrent.futures.Future[T]:
    """Start `fn(*args)` on a worker thread now and return its future; `await result_of(fut)` later (read-ahead)."""
    fut = _executor().submit(_call, [(fn, args)])
    with _lock:
        _pending.add(fut)
    fut.add_done_callback(_forget)
    return fut


async def result_of(fut: concurrent.futures.Future[T], timeout: float | None = None) -> T:
    """Wait on the event loop for a future of `start_in_worker_thread`; a cancelled waiter leaves the work running.
    After `timeout` seconds raise TimeoutError (the work runs on, abandoned)."""
    if not fut.done():
        waiter = _LoopWaiter()
        fut.add_done_callback(waiter.wake_from)
        if timeout is None:
            await waiter.wait()
        else:
            await waiter.wait_within(timeout)
            if not fut.done():
                raise TimeoutError(f"worker-thread work took longer than {timeout} s")
    return fut.result()


async def in_worker_thread_within(timeout: float, fn: Callable[..., T], *args: Any) -> T:
    """`in_worker_thread`, giving up after `timeout` seconds (TimeoutError); the work runs on to its end, abandoned."""
    return await result_of(start_in_worker_thread(fn, *args), timeout)


def _forget(fut: concurrent.futures.Future[Any]) -> None:
    with _lock:
        _pending.discard(fut)


async def drain() -> None:
    """Wait until all worker-thread work started so far (including abandoned work, and work that it started, such
    as the clean-up of a cancelled save) has finished."""
    while True:
        with _lock:
            pending = [f for f in _pending if not f.done()]
        if not pending:
            return
        for fut in pending:
            if not fut.done():
                waiter = _LoopWaiter()
                fut.add_done_callback(waiter.wake_from)
                await waiter.wait()
