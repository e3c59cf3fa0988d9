"""TimelineSignal: one monotonically increasing value per device.

A device signals `v` when all work it was given up to timeline value `v` is complete, from any thread or a
driver callback. Coroutines `await wait(v)`; the wake-up reaches their event loop through
`call_soon_threadsafe` (asyncio) or the trio token (trio, via anyio), never by polling. Worker threads use
`wait_sync(v)`.

A device that fails (a kernel faulted, the driver lost it) fails its timeline (`fail`): every waiter for a value not
reached, present or future, then raises the failure instead of waiting forever.
"""

from __future__ import annotations

import heapq
import itertools
import threading
from collections.abc import Callable
from typing import Any, NoReturn

import sniffio

from azyx.errors import fresh_copy


class TimelineSignal:
    def __init__(self, name: str = ""):
        self.name = name
        self.value = 0
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)  # (entered as its lock: Condition.__enter__ is Python code)
        self._waiters: list[tuple[int, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self._sync_waiters = 0
        # the device's hook, told when someone starts waiting for a value not reached yet (from any thread, with no
        # lock of this signal held): a device that completes work lazily (CUDA) then makes sure it is watched
        self.demand: Callable[[int], None] | None = None
        self.failure: BaseException | None = None  # set once by `fail`: what every wait for an unreached value raises

    def __repr__(self) -> str:
        return f"TimelineSignal({self.name}, value={self.value})"

    def signal(self, v: int) -> None:
        """Advance to `v` (callable from any thread) and wake everything waiting for a value <= v."""
        ready: list[Callable[[], None]] = []
        with self._lock:
            if v <= self.value:
                return
            self.value = v
            while self._waiters and self._waiters[0][0] <= v:
                ready.append(heapq.heappop(self._waiters)[2])
            if self._sync_waiters:
                self._cond.notify_all()
        if len(ready) == 1:
            ready[0]()
        elif ready:
            _wake_all(ready)

    def fail(self, error: BaseException) -> None:
        """The device behind this timeline has failed: wake every waiter; each wait for a value not reached (now or
        later) raises `error` (a copy of it: several tasks and threads raise it)."""
        with self._cond:
            if self.failure is not None:
                return
            self.failure = error
            ready = [w[2] for w in self._waiters]
            self._waiters = []
            self._cond.notify_all()
        for wake in ready:
            wake()

    def check(self) -> None:
        """Raise the failure of a failed timeline (a copy of it: several tasks and threads raise it)."""
        if self.failure is not None:
            self._raise_failure()

    def _raise_failure(self) -> NoReturn:
        err = self.failure
        assert err is not None
        raise fresh_copy(err)

    def wait_sync(self, v: int) -> None:
        """Block the calling (worker) thread until the value reaches `v` (raises the failure of a failed timeline).
        Never call it on the event loop."""
        if self.demand is not None and self.value < v and self.failure is None:
            self.demand(v)
        with self._cond:
            self._sync_waiters += 1
            try:
                while self.value < v and self.failure is None:
                    self._cond.wait()
            finally:
                self._sync_waiters -= 1
        if self.value < v:
            self._raise_failure()

    def on_reach(self, v: int, callback: Callable[[], None]) -> None:
        """Run `callback` (on the signalling thread) once the value reaches `v`; at once if it has. A failed timeline
        runs it at once too (or when it fails): whoever it wakes checks `failure`."""
        with self._cond:
            pending = self.value < v and self.failure is None
            if pending:
                heapq.heappush(self._waiters, (v, next(self._seq), callback))
        if not pending:
            callback()
        elif self.demand is not None:
            self.demand(v)

    async def wait(self, v: int) -> None:
        """Wait on the event loop (asyncio or trio) until the value reaches `v` (raises the failure of a failed
        timeline)."""
        if self.value >= v:
            return
        if self.failure is None:
            waiter = _LoopWaiter()
            self.on_reach(v, waiter.wake)
            await waiter.wait()
        if self.value < v:
            self._raise_failure()


class _LoopWaiter:
    """The bridge from a device-side wake-up (any thread) to an awaitable on the current event loop."""

    __slots__ = ("_lib", "_fut", "_loop", "_event", "_token")

    def __init__(self) -> None:
        self._lib = sniffio.current_async_library()
        if self._lib == "asyncio":
            import asyncio

            self._loop = asyncio.get_running_loop()
            self._fut: Any = self._loop.create_future()
        else:
            import trio

            self._event = trio.Event()
            self._token = trio.lowlevel.current_trio_token()

    def wake(self) -> None:
        if self._lib == "asyncio":
            if self._fut is None:  # the wait was cancelled (see wait)
                return
            try:
                self._loop.call_soon_threadsafe(_resolve, self._fut)
            except RuntimeError:  # the loop has closed: nobody is waiting any more
                pass
        else:
            try:
                self._token.run_sync_soon(self._event.set)
            except Exception:  # trio.RunFinishedError: nobody is waiting any more
                pass

    def wake_from(self, _source: object) -> None:
        """`wake` as a done-callback (it ignores the future that calls it)."""
        self.wake()

    async def wait(self) -> None:
        if self._lib == "asyncio":
            try:
                await self._fut
            except BaseException:
                # cancelled: let go of the future at once. It keeps the CancelledError, whose traceback holds the
                # waiting frames and their tensors, and the device still holds this waiter (a timeline callback, a
                # worker future's done-callback) until its work ends: those tensors would outlive the cancellation
                self._fut = None
                raise
        else:
            await self._event.wait()

    async def wait_within(self, timeout: float) -> None:
        """`wait`, returning after `timeout` seconds at the latest (the caller looks at what it waited for)."""
        if self._lib == "asyncio":
            handle = self._loop.call_later(timeout, _resolve, self._fut)
            try:
                await self.wait()
            finally:
                handle.cancel()
        else:
            import trio

            with trio.move_on_after(timeout):
                await self._event.wait()


def _resolve(fut: Any) -> None:
    if not fut.done():
        fut.set_result(None)


def _resolve_all(futs: list[Any]) -> None:
    for fut in futs:
        if not fut.done():
            fut.set_result(None)


def _wake_all(ready: list[Callable[[], None]]) -> None:
    """Run the callbacks that one signal made ready, waking the tasks of one asyncio loop that wait on it with one
    `call_soon_threadsafe` (a crowd's realizes whose work completed together): one write to the loop's self-pipe and
    one callback, where one each would hand the GIL back and forth between this thread and the woken loop."""
    loops: dict[Any, list[Any]] = {}
    for wake in ready:
        waiter = getattr(wake, "__self__", None)
        if type(waiter) is _LoopWaiter and waiter._lib == "asyncio" and wake == waiter.wake:
            if waiter._fut is not None:  # (None: the wait was cancelled)
                loops.setdefault(waiter._loop, []).append(waiter._fut)
        else:
            wake()
    for loop, futs in loops.items():
        try:
            loop.call_soon_threadsafe(_resolve_all, futs)
        except RuntimeError:  # the loop has closed: nobody is waiting any more
            pass


class LoopEvent:
    """An event set once, awaited by tasks of one loop (asyncio or trio) through `_LoopWaiter`: what anyio.Event does,
    without importing anyio's backend on the first realize that waits for another's compile (tens of ms on the loop)."""

    __slots__ = ("is_set", "_waiters")

    def __init__(self) -> None:
        self.is_set = False
        self._waiters: list[_LoopWaiter] = []

    def set(self) -> None:
        self.is_set = True
        waiters, self._waiters = self._waiters, []
        for w in waiters:
            w.wake()

    async def wait(self) -> None:
        if not self.is_set:
            waiter = _LoopWaiter()
            self._waiters.append(waiter)
            await waiter.wait()


async def checkpoint() -> None:
    """Let the loop run other tasks once, as trio's checkpoints do (asyncio or trio)."""
    if sniffio.current_async_library() == "asyncio":
        import asyncio

        await asyncio.sleep(0)
    else:
        import trio

        await trio.lowlevel.checkpoint()
