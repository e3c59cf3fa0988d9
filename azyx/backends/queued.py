"""What the devices of an API with an in-order queue and completion events (CUDA, OpenCL) share: each command's event
by its timeline value, what the command holds (buffers, host arrays) until it completes, and one waiter thread per
device that waits on the events in queue order (the GIL released while it waits) and advances the device's
TimelineSignal; nothing polls. The waiter thread drops a completed command's holdings (outside the lock) before it
advances the timeline, so its buffers are back in their pools by the time anyone sees the value: a steady plan gets
the same blocks each run, and a crowd's hundreds of completions are given back one by one as they come, not by the
next submitting call (200 requests' holdings dropped at once took 0.3-0.6 ms of one realize on the loop of an H200's
host). Commands whose completion `poll` saw before the waiter thread did are dropped by a submitting thread
(`_take_done`).
"""

from __future__ import annotations

import collections
import queue
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from azyx.device import Buffer, Device, host_read
from azyx.dtypes import DType
from azyx.errors import DeviceError
from azyx.graph import Shape, StridedView

# (event, timeline value, what to run on the host once the command completed, before the timeline says so)
Completion = tuple[Any, int, Callable[[], None] | None]


class QueuedDevice(Device):
    """A device whose commands complete through events of its API. A subclass puts each command's event on
    `completions` (in value order), says how to wait on one (`wait_event`) and starts the waiter (`start_waiter`)."""

    def __init__(self, index: int, options: dict[str, Any]):
        super().__init__(index, options)
        self.submitted = 0
        self.spin = float(options.get("spin_us", 0)) * 1e-6  # (its config section's, where `poll` may spin)
        self.events: dict[int, Any] = {}  # timeline value -> the event completing it (dropped once the waiter is past)
        self.holding: dict[int, Any] = {}  # what queued commands use, by value, held until they complete
        self.waited = 0  # the last value whose completion the waiter thread handled
        self.posts: collections.deque[int] = collections.deque()  # values whose host-side `post` has not run yet
        # enqueues come from the loop and from other devices' threads; re-entrant: CUDA holds it through a batch
        # (begin_batch .. end_batch), whose submissions take it again
        self.lock = threading.RLock()
        self.completions: queue.SimpleQueue[Completion | None] = queue.SimpleQueue()
        self.waiter = threading.Thread(target=self._wait_loop, name=f"azyx-{self.name}-events", daemon=True)
        # a subclass that submits from a thread of its own (OpenCL, wgpu): its commands by `_enqueue`, in value order,
        # as (what to run, its waits, its value); None stops it (`stop_submit_thread`)
        self.to_submit: queue.SimpleQueue[tuple[Any, list[tuple[Device, int]], int] | None] = queue.SimpleQueue()
        self.submit_thread = threading.Thread(target=self._submit_each, name=f"azyx-{self.name}-submit", daemon=True)
        self.through = 0  # the last value the submit thread is through with
        self.closed = False

    # the API's part
    def start_waiter(self) -> None:
        """Start the waiter thread (once the subclass's API state exists: the waiter may use its context)."""
        self.waiter.start()

    def on_waiter_thread(self) -> None:
        """Called on the waiter thread before its first wait."""

    def wait_event(self, ev: Any, v: int) -> bool:
        """Block, with the GIL released, until `ev` (the event of the command of value `v`) completes; False when the
        command failed, its failure recorded (`record_failure`)."""
        raise NotImplementedError

    def submit(self, run: Any, waits: list[tuple[Device, int]], v: int) -> Any:
        """On the submit thread: queue the command of value `v` (`run`, as `_enqueue` was given it) after its waits.
        Returns what the waiter thread waits on (`wait_event`); an exception fails the value."""
        raise NotImplementedError

    def retire(self, v: int, ev: Any) -> None:
        """Under the lock: the waiter thread is past `ev`, the event of value `v` (CUDA recycles it)."""

    def native_wait(self, dev: Device, v: int) -> Any:
        """What this device's queue can wait on natively for value `v` of `dev` (an event, a semaphore and its value),
        or None: the host must see it reached (`native_waits`)."""
        return None

    def native_waits(self, waits: list[tuple[Device, int]]) -> tuple[list[Any], list[tuple[Device, int]]]:
        """The one translation of a command's waits: of those not reached yet, the native ones (`native_wait`) and
        the rest, which the host sees reached (a host-opened gate, a user event, or the command deferred)."""
        native, host = [], []
        for dev, v in waits:
            if dev.timeline.value < v:
                if (ev := self.native_wait(dev, v)) is not None:
                    native.append(ev)
                else:
                    host.append((dev, v))
        return native, host

    def completed(self, v: int, post: Callable[[], None] | None) -> Any:
        """Under the lock, on the waiter thread: the command of value `v` completed (and its `post` ran). Returns what
        it held, for the waiter thread to drop outside the lock."""
        if post is not None:  # (a subclass appends `v` to `posts` as it submits a command with a `post`)
            self.posts.popleft()
        self.waited = v
        return self.holding.pop(v, None)

    # shared
    def alloc(self, nbytes: int) -> Buffer:
        # completed commands' buffers go back to the pool first (this request may reuse one): those of commands the
        # timeline is past, which `poll` may have seen complete before the waiter thread did
        if self.holding:  # (read without the lock, which the waiter thread holds as it drops entries: a changed
            try:  # table is a completion, so collect then too)
                first = next(iter(self.holding))
            except (RuntimeError, StopIteration):
                first = 0
            if first <= self.timeline.value:
                self.collect()
        return super().alloc(nbytes)

    def read_into(self, buf: Buffer, out: np.ndarray) -> None:
        """Blocking read on a worker thread (the buffer is ready): queued in order (`copy_to_host`), then waited
        for."""
        self.timeline.wait_sync(self.copy_to_host(buf, out, []))

    def write(self, buf: Buffer, host: np.ndarray) -> None:
        """Blocking write of raw bytes on a worker thread: queued in order (`copy_from_host`), then waited for."""
        data = host.reshape(-1).view(np.uint8)[:buf.nbytes]
        self.timeline.wait_sync(self.copy_from_host(data, buf, [], host))

    def read(self, buf: Buffer, view: StridedView, shape: Shape, dtype: DType) -> np.ndarray:
        host = np.empty(buf.nbytes, np.uint8)
        self.read_into(buf, host)
        return host_read(host, view, shape, dtype)

    def _wait_loop(self) -> None:
        self.on_waiter_thread()
        while (item := self.completions.get()) is not None:
            ev, v, post = item
            if self.wait_event(ev, v) and post is not None:
                try:
                    post()
                except BaseException as e:
                    self.record_failure(v, e)
            with self.lock:
                held = self.completed(v, post)
            del ev, item, post, held  # (its buffers back to their pools, outside the lock, before anyone sees `v`)
            self.timeline.signal(v)

    def _enqueue(self, run: Any, waits: list[tuple[Device, int]], keep: Any) -> int:
        """Number a command, keep what it holds, and hand it to the submit thread (`_submit_each`)."""
        with self.lock:
            if self.closed:
                raise DeviceError(f"{self.name} is closed")
            self.submitted += 1
            v = self.submitted
            self.holding[v] = keep
            self.to_submit.put((run, waits, v))
            done = self._take_done()
        del done  # buffers of completed commands go back to their pools here, on the submitting thread
        return v

    def _submit_each(self) -> None:
        """The submit thread: each command submitted in value order (`submit`), then to the waiter thread; a command
        that cannot be submitted fails its value."""
        while (item := self.to_submit.get()) is not None:
            run, waits, v = item
            ev = None
            try:
                ev = self.submit(run, waits, v)
            except BaseException as e:
                self.record_failure(v, e)
            self.through = v
            self.completions.put((ev, v, None))
            del item, run, ev

    def stop_submit_thread(self) -> bool:
        """Let the submit thread submit what was queued, then stop it; False: it was stopped already."""
        with self.lock:
            if self.closed:
                return False
            self.closed = True
            self.to_submit.put(None)
        if self.submit_thread.is_alive():
            self.submit_thread.join(timeout=30)
        return True

    def _take_done(self) -> list[Any]:
        """Under the lock: what completed commands held that the waiter thread has not dropped (the queue is in
        order: all up to the timeline's value is complete, even where `poll` saw it first), for the caller to drop
        outside the lock; the events the waiter thread is past are retired. Both tables are in the order of their
        values."""
        reached = self.timeline.value
        done = []
        holding, events = self.holding, self.events
        while holding and (k := next(iter(holding))) <= reached:
            done.append(holding.pop(k))
        while events and (k := next(iter(events))) <= self.waited:
            self.retire(k, events.pop(k))
        return done

    def collect(self) -> None:
        with self.lock:
            done = self._take_done()
        del done

    def pending(self) -> int:
        return self.submitted - self.timeline.value

    def queued(self) -> int:
        return self.submitted

    def stop_waiter(self) -> None:
        """Stop the waiter thread once it has handled the completions queued, and drop what completed work held."""
        self.completions.put(None)
        if self.waiter.is_alive():
            self.waiter.join(timeout=10)
        self.collect()
