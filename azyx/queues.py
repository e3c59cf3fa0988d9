"""A device's queue part (queue + timeline), written once: work items in order, each a value of the device's
TimelineSignal, what an item holds kept until it completed, failures recorded per value; and the two device bases a
backend builds on, each its memory and queue parts composed:

- `WorkQueue`, for a device whose memory is host memory (`HostDevice`: memory.HostBlocks, gathering, batches that run
  inline or queued; `HostMemory`, the "host" device): an in-order worker thread, small work inline on the submitting
  thread, and where the device has one a native queue beside it (a C device's runner).
- `QueuedDevice`, for an API with an in-order queue and completion events (CUDA, OpenCL, Vulkan, wgpu), composing an
  `EventQueue` (its `queue`): each command's event by its timeline value, what the command holds (buffers, host arrays)
  until it completes, one waiter thread per device that waits on the events in queue order (the GIL released while it
  waits) and advances the device's TimelineSignal, handed a command once someone waits for it (until then `poll`
  may see it complete first: `EventQueue.unwatched`), the one translation of a command's waits into native
  events (`native_waits`), and where the API's submissions may block, a submit thread (`enqueue`, `submit`). The waiter
  thread drops a completed command's holdings (outside the lock) before it advances the timeline, so its buffers are
  back in their pools by the time anyone sees the value: a steady plan gets the same blocks each run, and a crowd's
  hundreds of completions are given back one by one as they come, not by the next submitting call (200 requests'
  holdings dropped at once took 0.3-0.6 ms of one realize on the loop of an H200's host). Commands whose completion
  `poll` saw before the waiter thread did are dropped by a submitting thread (`take_done`)."""

from __future__ import annotations

import collections
import ctypes
import functools
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol, Self, TypeGuard

import numpy as np

from azyx import debug
from azyx.device import INLINE, QUEUED, BatchState, Buffer, Device, LaunchItem, Runner, gatherable, host_read
from azyx.dtypes import DType
from azyx.errors import DeviceError
from azyx.graph import Shape, StridedView
from azyx.memory import HostBlocks, memory_bytes
from azyx.plan import ExecutionPlan
from azyx.timeline import TimelineSignal
from azyx.workers import lower_priority

_HANDED = object()  # (_HANDED, v): a WorkQueue's wake-up, reserved item `v` given to its worker (`submit_reserved`)


class NativeQueue(Protocol):
    """A queue beside the worker thread that runs some work items with no Python (a C device's runner): `put` hands
    one over (returning at once, in the queue's order) and signals the timeline with `v` once it has run."""

    def takes(self, fn: Callable[[], None]) -> bool: ...

    def put(self, fn: Callable[[], None], v: int) -> None: ...


class WorkQueue:
    """An in-order queue drained by one worker thread; small work runs inline when the queue is idle. Where the device
    has a native queue, work it takes goes there instead when everything before it is done or there too (and its
    waits are met), so that it starts without this thread, and without the GIL; the rest keeps program order by
    waiting for the item before it."""

    def __init__(self, timeline: TimelineSignal, name: str, record_failure: Callable[[int, BaseException], None]):
        self.timeline, self.name = timeline, name
        self.q: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.submitted = 0
        self.lock = threading.Lock()
        self.thread: threading.Thread | None = None
        self.record_failure = record_failure  # (timeline value, error) of a work item that failed
        self.native: NativeQueue | None = None
        self.native_last = 0  # the value of the last item handed to the native queue
        # values reserved for items handed over later (`reserve`), with the item once given to this queue's worker
        # (None until then; gone once run or handed to the native queue); the worker runs them before later items
        self.reserved: dict[int, Callable[[], None] | None] = {}
        self.handed = threading.Condition(self.lock)  # (notified when a reservation is given or resolved)

    def submit(self, fn: Callable[[], None], waits: list[tuple[TimelineSignal, int]], inline: bool) -> int:
        with self.lock:
            self.submitted += 1
            v = self.submitted
            idle = self.timeline.value == v - 1
            if (idle or self.native_last == v - 1) and all(t.value >= w for t, w in waits):
                if inline and idle:
                    self._execute(fn, v)
                    del fn  # the work's buffers go back to the pool before anyone sees the timeline advance
                    self.timeline.signal(v)
                    return v
                if self.native is not None and self.native.takes(fn):
                    self.native.put(fn, v)
                    self.native_last = v
                    return v
            self._to_worker((fn, waits, v))
        return v

    def _to_worker(self, item: Any) -> None:
        """(Under the lock.) An item for the worker thread, started with the first."""
        if self.thread is None:
            self.thread = threading.Thread(target=self._loop, name=f"azyx-{self.name}", daemon=True)
            self.thread.start()
        self.q.put(item)

    def reserve(self) -> int:
        """The next timeline value, for a work item handed over later (`submit_reserved`); items submitted meanwhile
        come after it (none can run inline or go to the native queue before it: the worker thread takes them, and
        runs the reserved item first once it is given)."""
        with self.lock:
            self.submitted += 1
            self.reserved[self.submitted] = None
            return self.submitted

    def submit_reserved(self, fn: Callable[[], None], v: int, inline: bool) -> None:
        """The work item of value `v` (`reserve`'s): run here and now where `inline` and the queue is idle up to it,
        else handed to the native queue where everything before it is done or there, else to the worker thread, which
        runs it before any later item it took meanwhile (`_reserved_before`)."""
        with self.lock:
            idle = self.timeline.value == v - 1
            if inline and idle:
                del self.reserved[v]
                self._execute(fn, v)
                del fn  # (as `submit`: the buffers back to the pool before the timeline advances)
                self.timeline.signal(v)
            elif (idle or self.native_last == v - 1) and self.native is not None and self.native.takes(fn):
                del self.reserved[v]
                self.native.put(fn, v)
                self.native_last = v
            else:
                self.reserved[v] = fn
                self._to_worker((_HANDED, v))  # (wakes an idle worker; one that took a later item waits on `handed`)
            self.handed.notify_all()

    def _reserved_before(self, u: int) -> None:
        """(The worker thread, before the item of value `u`.) Run the reserved items of lower values, in order, each
        once it is given; one resolved elsewhere (inline, the native queue) is simply gone. Waiting for one is safe:
        the queue's items below `u` were put before `u`'s, so this thread has taken them all."""
        while True:
            with self.lock:
                lower = [r for r in self.reserved if r < u]
                if not lower:
                    return
                r = min(lower)
                fn = self.reserved[r]
                if fn is None:
                    self.handed.wait()
                    continue
                del self.reserved[r]
                box = [fn]
                del fn
            self._run_in_order(box, [], r)

    def run_now(self, fn: Callable[..., None], *args: Any) -> int:
        """Run `fn(*args)` on the calling thread as the queue's next item, where the queue is idle (everything before
        it has run): returns its timeline value; 0 where the queue is busy (the caller queues the work instead)."""
        with self.lock:
            v = self.submitted + 1
            if self.timeline.value != v - 1:
                return 0
            self.submitted = v
            try:
                fn(*args)
            except BaseException as e:  # the run it belongs to raises it (RunRecord)
                self.record_failure(v, e)
            self.timeline.signal(v)
        return v

    def _execute(self, fn: Callable[[], None], v: int) -> None:
        try:
            fn()
        except BaseException as e:  # the run it belongs to raises it (RunRecord); the queue keeps going
            self.record_failure(v, e)

    def _loop(self) -> None:
        # Device work runs at a lower priority than the event loop thread (OpenMP threads started from here
        # inherit it), so the loop wakes on time even while kernels keep every core busy.
        lower_priority()
        while True:
            item = self.q.get()
            if item is None:
                return
            if item[0] is _HANDED:  # (every item below it is taken: those put before it)
                self._reserved_before(item[1] + 1)
                continue
            fn, waits, v = item
            box = [fn]
            del item, fn
            if self.reserved:
                self._reserved_before(v)
            self._run_in_order(box, waits, v)

    def _run_in_order(self, box: list[Callable[[], None]], waits: list[tuple[TimelineSignal, int]], v: int) -> None:
        """(The worker thread.) Run item `v` (the one in `box`, taken out: the item's last reference is this
        frame's) once every value before it and its `waits` are reached, then signal it."""
        fn = box.pop()
        try:
            self.timeline.wait_sync(v - 1)  # an item before it may be in the native queue
            for t, w in waits:
                t.wait_sync(w)
        except BaseException as e:  # a device it waits for has failed (DeviceFailedError): its inputs are lost
            self.record_failure(v, e)
        else:
            self._execute(fn, v)
        del fn  # release the work's buffers before signalling completion
        self.timeline.signal(v)

    def close(self) -> None:
        if self.thread is not None:
            self.q.put(None)
            self.thread.join(timeout=5)
            self.thread = None


# (event, timeline value, what to run on the host once the command completed, before the timeline says so)
Completion = tuple[Any, int, Callable[[], None] | None]
UNWATCHED = 64  # completed commands noticed lazily at most (EventQueue.unwatched); more go to the waiter thread


class EventQueue:
    """The queue part of a device whose commands complete through events of its API (`QueuedDevice.queue`): each
    command's event by its timeline value (`events`), what the command holds until it completes (`holding`), the
    waiter thread that waits on the events in value order and advances the device's timeline, and where the API's
    submissions may block, the submit thread (`enqueue`, `start`). What differs per API is the device's: how a command
    is submitted (`QueuedDevice.submit`), how its event is waited on (`wait_event`) and recycled (`retire`), what
    its queue can wait on natively (`native_wait`)."""

    def __init__(self, dev: QueuedDevice):
        self.dev = dev
        self.submitted = 0
        self.events: dict[int, Any] = {}  # timeline value -> the event completing it (dropped once the waiter is past)
        self.holding: dict[int, Any] = {}  # what queued commands use, by value, held until they complete
        self.waited = 0  # the last value whose completion the waiter thread handled
        self.posts: collections.deque[int] = collections.deque()  # values whose host-side `post` has not run yet
        # enqueues come from the loop and from other devices' threads; re-entrant: CUDA holds it through a batch
        # (begin_batch .. end_batch), whose submissions take it again
        self.lock = threading.RLock()
        self.completions: queue.SimpleQueue[Completion | None] = queue.SimpleQueue()
        self.waiter = threading.Thread(target=self._wait_loop, name=f"azyx-{dev.name}-events", daemon=True)
        # the submit thread's commands (`enqueue`), in value order, as (what to run, its waits, its value, its `post`,
        # the first value it completes); None stops it (`stop_submit_thread`)
        self.to_submit: queue.SimpleQueue[tuple[Any, list[tuple[Device, int]], int, Callable[[], None] | None, int]
                                          | None] = queue.SimpleQueue()
        self.submit_thread = threading.Thread(target=self._submit_each, name=f"azyx-{dev.name}-submit", daemon=True)
        self.through = 0  # the last value the submit thread is through with
        self.handed = 0  # commands handed to the submit thread (the others their caller submitted: `enqueue`)
        # the first value of each command handed to the submit thread and not submitted yet (`submitted_to`; CUDA's
        # native queue reads its length: its lanes submit only behind none)
        self.pending: collections.deque[int] = collections.deque()
        self.moved = threading.Condition(self.lock)  # (notified as the submit thread submits a command)
        self.closed = False
        # Completed work is noticed lazily: a command's event waits in `unwatched` until someone waits for it (the
        # timeline's `demand`), a `post` needs the waiter thread, or too many pile up; only then the waiter thread is
        # handed it (`watched`: the last value it was). A realize that `poll` finds complete never wakes that thread:
        # its wake-up, and its taking the GIL from the loop's thread while the next plan is submitted, cost more than
        # the work (CUDA on an H200's VM)
        self.qlock = threading.Lock()  # guards `unwatched` and `watched`; taken under `lock`, never the reverse
        self.unwatched: collections.deque[tuple[Any, int]] = collections.deque()
        self.watched = self.demanded = 0  # (`demanded`: the highest value someone waited for)
        dev.timeline.demand = self.demand

    def start(self) -> None:
        """Start the waiter thread and the submit thread (once the device's API state exists: the threads may use its
        context)."""
        self.waiter.start()
        self.submit_thread.start()

    def native_waits(self, waits: list[tuple[Device, int]]) -> tuple[list[Any], list[tuple[Device, int]]]:
        """The one translation of a command's waits: of those not reached yet, the native ones (the device's
        `native_wait`) and the rest, which the host sees reached (a host-opened gate, a user event, or the command
        deferred)."""
        native, host = [], []
        native_wait = self.dev.native_wait
        for dev, v in waits:
            if dev.timeline.value < v:
                if (ev := native_wait(dev, v)) is not None:
                    native.append(ev)
                else:
                    host.append((dev, v))
        return native, host

    def host_waited(self, waits: list[tuple[Device, int]], v: int) -> tuple[list[Any], bool]:
        """(The submit thread, where the API cannot wait on an event of the host's.) The command's native waits
        (`native_waits`) once the host has seen the others reached, blocking here; False where one of those failed (a
        device it waits for failed: its input is lost), the failure recorded for `v`: the command is then left out."""
        native, host = self.native_waits(waits)
        try:
            for dev, u in host:
                dev.timeline.wait_sync(u)
        except BaseException as e:
            self.dev.record_failure(v, e)
            return native, False
        return native, True

    def record(self, ev: Any, v: int, post: Callable[[], None] | None, first: int = 0) -> None:
        """Once the command of value `v` (and the values from `first` on, that a batch reserved) is submitted with
        event `ev`: its completion left for `poll` to notice, or handed to the waiter thread (see `unwatched`)."""
        with self.qlock:
            if post is None and self.demanded < (first or v) and len(self.unwatched) < UNWATCHED:
                self.unwatched.append((ev, v))
            else:
                self.watch(ev, v, post)
        self.through = v

    def watch(self, ev: Any, v: int, post: Callable[[], None] | None = None) -> None:
        """Under `qlock`: the waiter thread takes the command of value `v` (event `ev`), after every unwatched one."""
        self.hand_over()
        self.completions.put((ev, v, post))
        self.watched = v

    def hand_over(self) -> None:
        """Under `qlock`: the waiter thread takes every unwatched command, in order."""
        while self.unwatched:
            ev, v = self.unwatched.popleft()
            self.completions.put((ev, v, None))
            self.watched = v

    def demand(self, v: int) -> None:
        """The timeline's hook: someone waits for a value not reached yet, so the waiter thread must watch it: now, or
        when it is recorded (a command not submitted yet)."""
        with self.qlock:
            self.demanded = max(self.demanded, v)
            self.hand_over()

    def polled(self, v: int) -> list[Any]:
        """Under the lock: `poll` saw the command of value `v` complete, so the unwatched ones up to it are (the queue
        is in order): where the waiter thread has nothing older left, their completion is handled here. Returns what
        they held, for the caller to drop outside the lock."""
        done = []
        with self.qlock:
            if self.waited >= self.watched:
                while self.unwatched and self.unwatched[0][1] <= v:
                    done.append(self.completed(self.unwatched.popleft()[1], None))
        return done

    def completed(self, v: int, post: Callable[[], None] | None) -> Any:
        """Under the lock, on the waiter thread: the command of value `v` completed (and its `post` ran). Returns what
        it held, for the waiter thread to drop outside the lock."""
        # (`enqueue` appends `v` to `posts` as it takes a command with a `post`, `reserve` each reserved value with a
        # host-side end: all of them ran with the command's `post`)
        posts = self.posts
        while posts and posts[0] <= v:
            posts.popleft()
        self.waited = v
        self.dev.completed(v)
        return self.holding.pop(v, None)

    def _wait_loop(self) -> None:
        dev = self.dev
        dev.on_waiter_thread()
        while (item := self.completions.get()) is not None:
            ev, v, post = item
            try:
                ok = dev.wait_event(ev, v)
            except BaseException as e:  # (the API's error: the command failed)
                dev.record_failure(v, e)
                ok = False
            if ok and post is not None:
                try:
                    post()
                except BaseException as e:
                    dev.record_failure(v, e)
            with self.lock:
                held = self.completed(v, post)
            del ev, item, post, held  # (its buffers back to their pools, outside the lock, before anyone sees `v`)
            dev.timeline.signal(v)

    def reserve(self, keep: Any, post: bool = False) -> int:
        """Under the lock: number a command that an open batch or gather takes (the batch's one command, submitted
        with `first`, completes it), keeping what it holds; `post`: it has a host-side end that runs with the
        command's `post` (until then `poll` does not see its value complete)."""
        self.submitted += 1
        v = self.submitted
        self.holding[v] = keep
        if post:
            self.posts.append(v)
        return v

    def enqueue(self, run: Any, waits: list[tuple[Device, int]], keep: Any,
                post: Callable[[], None] | None = None, inline: bool = False, first: int = 0) -> int:
        """Number a command, keep what it holds, and hand it to the submit thread (`_submit_each`); `post` runs on the
        waiter thread once the command completed, before the timeline reaches its value. `inline`: the device says
        its API cannot block on this command; where the submit thread is through with every earlier one, it is
        submitted here and now (a thread's hand-over and wake-up less: OpenCL's small realize 200-280 -> ~100 us).
        `first`: the command completes the values reserved from `first` on (CUDA's batch, holding what they use)."""
        self.dev.check_alive()
        with self.lock:
            if self.closed:
                raise DeviceError(f"{self.dev.name} is closed")
            if not first:
                self.submitted += 1
                self.holding[self.submitted] = keep
            v = self.submitted
            if post is not None:
                self.posts.append(v)
            if inline and not self.pending:
                self._submit(run, waits, v, post, first)
            else:
                self.handed += 1
                self.pending.append(first or v)
                self.to_submit.put((run, waits, v, post, first))
            done = self.take_done()
        del done  # buffers of completed commands go back to their pools here, on the submitting thread
        return v

    def _submit(self, run: Any, waits: list[tuple[Device, int]], v: int, post: Callable[[], None] | None,
                first: int = 0) -> None:
        """Submit command `v` (the device's `submit`) and hand it to the waiter thread; a command that cannot be
        submitted fails its value. `through` moves last: at `v` the submit thread is idle."""
        ev = None
        try:
            ev = self.dev.submit(run, waits, v)
        except BaseException as e:
            self.dev.record_failure(v, e, first)
        self.record(ev, v, post, first)

    def _submit_each(self) -> None:
        """The submit thread: each command submitted in value order (`_submit`)."""
        while (item := self.to_submit.get()) is not None:
            self._submit(*item)
            del item
            with self.lock:
                self.pending.popleft()
                self.moved.notify_all()

    def submitted_to(self, v: int) -> None:
        """Block (another device's submit thread) until the command of value `v` is submitted: its event exists."""
        with self.lock:
            while self.pending and self.pending[0] <= v:
                self.moved.wait()

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

    def take_done(self) -> list[Any]:
        """Under the lock: what completed commands held that the waiter thread has not dropped (the queue is in
        order: all up to the timeline's value is complete, even where `poll` saw it first), for the caller to drop
        outside the lock; the events the waiter thread is past are retired. Both tables are in the order of their
        values."""
        reached = self.dev.timeline.value
        done = []
        holding, events = self.holding, self.events
        while holding and (k := next(iter(holding))) <= reached:
            done.append(holding.pop(k))
        while events and (k := next(iter(events))) <= self.waited:
            self.dev.retire(k, events.pop(k))
        return done

    def collect(self) -> None:
        with self.lock:
            done = self.take_done()
        del done

    def stop_waiter(self) -> None:
        """Stop the waiter thread once it has handled the completions queued (every unwatched one handed to it first),
        and drop what completed work held."""
        with self.qlock:
            self.hand_over()
        self.completions.put(None)
        if self.waiter.is_alive():
            self.waiter.join(timeout=10)
        self.collect()


class QueuedDevice(Device):
    """A device whose commands complete through events of its API, its queue part an `EventQueue` (`queue`, of the
    class `event_queue`). A subclass submits its commands (`queue.enqueue`, and `submit` on the submit thread, or on
    its own), says how to wait on an event (`wait_event`) and starts the queue's threads (`queue.start`)."""

    event_queue: type[EventQueue] = EventQueue
    # each such API makes blocks on any thread (clCreateBuffer, vkAllocateMemory, wgpu-native's create_buffer,
    # cuMemAlloc once the context is made current there), and the pools are locked (the native pool's one C call per
    # step, or PoolAllocator's lock; wgpu's `OwnedPool.blocks` changes by one dict store under the GIL)
    alloc_anywhere = True
    # a large block made on the loop's thread held it: wgpu's create_buffer 50-120 ms beside a stream's reader threads
    # and the queue's (lavapipe, a loaded machine); cuMemAlloc past a slab's pieces waits on the driver's lock, held for
    # hundreds of ms while other threads pin staging memory (a first 2 GB lazy load: the loop's thread slept 494 ms).
    # A load's or a plan's blocks of this size and up are made first on a worker thread (`Device.reserve`) and taken
    # from the pool's cache on the loop's
    reserve_min = 1 << 20
    ctx: Any = None  # the API's context, where one serves several devices (`peer`)

    def __init__(self, index: int, options: dict[str, Any]):
        super().__init__(index, options)
        self.spin = float(options.get("spin_us", 0)) * 1e-6  # (its config section's, where `poll` may spin)
        self.queue = self.event_queue(self)

    # the API's part
    def on_waiter_thread(self) -> None:
        """Called on the waiter thread before its first wait."""

    def wait_event(self, ev: Any, v: int) -> bool:
        """Block, with the GIL released, until `ev` (the event of the command of value `v`) completes; False when the
        command failed, its failure recorded (`record_failure`; an error raised here is recorded by the waiter
        thread)."""
        raise NotImplementedError

    def submit(self, run: Any, waits: list[tuple[Device, int]], v: int) -> Any:
        """On the submit thread: queue the command of value `v` (`run`, as `queue.enqueue` was given it) after its
        waits. Returns what the waiter thread waits on (`wait_event`); an exception fails the value."""
        raise NotImplementedError

    def retire(self, v: int, ev: Any) -> None:
        """Under the queue's lock: the waiter thread is past `ev`, the event of value `v` (CUDA recycles it)."""

    def completed(self, v: int) -> None:
        """Under the queue's lock, on the waiter thread: the command of value `v` completed (Vulkan recycles its
        command buffer)."""

    def peer(self, dev: Device) -> TypeGuard[Self]:
        """Whether `dev` shares this device's API context (of its kind, on the same driver context: `ctx`, where the
        API's context serves several devices): its buffers are copied on this queue (`copy_peer`) and its completions
        waited for natively (`native_wait`)."""
        return self.ctx is not None and isinstance(dev, type(self)) and dev.ctx is self.ctx

    def query(self, v: int) -> Callable[[], bool] | None:
        """How `poll` asks the API whether the command of value `v` has completed (once the submit thread submitted it,
        and no read's host copy before it is left to run: `poll`); None: it cannot tell now."""
        return None

    def native_wait(self, dev: Device, v: int) -> Any:
        """What this device's queue can wait on natively for value `v` of `dev`, or None: the host must see it reached
        (`EventQueue.native_waits`). By default a `peer`'s event of that value, where its queue has one yet (OpenCL's;
        Vulkan waits on a peer's semaphore, CUDA on any CUDA device's event)."""
        return dev.queue.events.get(v) if self.peer(dev) else None

    # shared
    def poll(self, v: int, spin: float = 0.0) -> bool:
        """On the loop, before it would sleep: the command of value `v` seen complete now or within `spin` seconds (at
        most `spin_cap`; the backend's `query`) advances the timeline here (the queue is in order: all before it is
        complete too), and the completion of the unwatched commands up to it is handled here (`EventQueue.polled`);
        a command the waiter thread was handed, it still takes in turn."""
        if self.timeline.value >= v:
            return True
        queue = self.queue  # (asked only of a command submitted, with no host-side `post` before it left to run)
        done = None if queue.through < v or (queue.posts and queue.posts[0] <= v) or queue.closed else self.query(v)
        if done is None or not self.spun(done, spin):
            return self.timeline.value >= v
        with queue.lock:
            held = queue.polled(v)
        del held  # the commands' buffers go back to their pools, outside the lock
        self.timeline.signal(v)
        return True

    def copy_peer(self, src: Buffer, dst: Buffer, n: int, waits: list[tuple[Device, int]]) -> int | None:
        """A `peer`'s buffers are this queue's: a copy here. Between contexts there is no peer path."""
        return self.copy(src, dst, n, waits) if self.peer(src.device) else None

    def alloc(self, nbytes: int) -> Buffer:
        # completed commands' buffers go back to the pool first (this request may reuse one): those of commands the
        # timeline is past, which `poll` may have seen complete before the waiter thread did
        if holding := self.queue.holding:  # (read without the lock, which the waiter thread holds as it drops
            try:  # entries: a changed table is a completion, so collect then too)
                first = next(iter(holding))
            except (RuntimeError, StopIteration):
                first = 0
            if first <= self.timeline.value:
                self.queue.collect()
        return self.mem.alloc(nbytes)  # (the memory part: a frame less than Device.alloc)

    def read_into(self, buf: Buffer, out: np.ndarray) -> None:
        """Blocking read on a worker thread (the buffer is ready): queued in order (`copy_to_host`), then waited
        for."""
        if out.nbytes:
            self.timeline.wait_sync(self.copy_to_host(buf, out, []))

    def write(self, buf: Buffer, host: np.ndarray) -> None:
        """Blocking write of raw bytes on a worker thread: queued in order (`copy_from_host`), then waited for."""
        data = host.reshape(-1).view(np.uint8)[:buf.nbytes]
        self.timeline.wait_sync(self.copy_from_host(data, buf, [], host))

    def read(self, buf: Buffer, view: StridedView, shape: Shape, dtype: DType) -> np.ndarray:
        host = np.empty(buf.nbytes, np.uint8)
        self.read_into(buf, host)
        return host_read(host, view, shape, dtype)

    def collect(self) -> None:
        self.queue.collect()

    def queued(self) -> int:
        return self.queue.submitted

    def close(self) -> None:
        """Let the submit thread submit what was queued and stop it, let the API finish its queue (`drain`), stop the
        waiter thread (what completed work held is dropped), let the API's objects go (`let_go`), then close the memory
        part: its cached blocks are destroyed now, those still out as they come back."""
        if not self.queue.stop_submit_thread():
            return
        self.drain()
        self.queue.stop_waiter()
        self.let_go()
        self.mem.close()

    def drain(self) -> None:
        """(`close`) Wait, within reason, for the API's queue to complete what was submitted."""

    def let_go(self) -> None:
        """(`close`, the waiter thread stopped) Destroy what the API made for this device, its memory's blocks aside."""


class CommandGathers(QueuedDevice):
    """A queued device whose gather (Runner.gathers: a crowd's runs in one loop iteration, their uploads of host data
    and their reads) is one command of the commands it took, in order, with one event: while it is open the loop's
    thread holds the queue's lock, a command that waits for nothing joins it (`gathered`; its value reserved, which
    the gather's one command completes), and one that waits comes after the commands gathered so far
    (`_flush_gathered`); other threads' commands wait on the lock until it is closed (the next iteration). A subclass
    says what a gathered command is and submits them (`_flush_gathered`)."""

    gathers_copies = True
    gathered: list[Any] | None = None  # the open gather's commands (None: none open)

    def prepare(self, plan: ExecutionPlan, batches: list[BatchState]) -> Runner:
        runner = super().prepare(plan, batches)
        runner.gathers = self.gather_runs and gatherable(plan, uploads=True)
        return runner

    def open_gather(self) -> None:
        self.queue.lock.acquire()
        self.gathered = []

    def gather_launch(self, items: list[LaunchItem], batch: BatchState) -> int:
        return self.launch_many(items, [], batch)

    def close_gather(self) -> None:
        try:
            self._flush_gathered()
        finally:
            self.gathered = None
            self.queue.lock.release()

    def _flush_gathered(self) -> None:
        """Under the lock: the commands gathered so far as one command (their reserved values first..last)."""
        raise NotImplementedError


WIDE_KEPT = 64  # (HostDevice) gathers' batches kept per device (a crowd's gathers come in a few sizes)


class HostDevice(Device):
    """A device whose buffers are host memory: allocation, copies and reads are plain memory operations."""

    host_memory = True
    alloc_anywhere = True  # (a locked pool of numpy blocks)

    def __init__(self, index: int, options: dict[str, Any]):
        super().__init__(index, options)
        capacity = int(options.get("memory") or memory_bytes() * 3 // 4)
        self.mem = HostBlocks(self, Buffer, capacity, capacity // 4)
        # the memory part's own calls, a frame less on a small run's path (each buffer taken and given back)
        self.alloc, self.alloc_many, self.release = (  # type: ignore[method-assign]
            self.mem.alloc, self.mem.alloc_many, self.mem.release)
        self.queue = WorkQueue(self.timeline, self.name, self.record_failure)
        self.inline_work = int(options.get("inline_work", 1 << 16))
        # the open gather (`open_gather`): its reserved timeline value (0: none open), the runs' kernels and batches
        self.gather_v = 0
        self.gathered: list[LaunchItem] = []
        self.gathered_batches: list[BatchState] = []
        # a gather's batch by the batches it gathered (their ids: the batches are kept with it, so no id is reused)
        self.wide: dict[tuple[int, ...], tuple[list[BatchState], BatchState]] = {}

    def buffer_from_numpy(self, arr: np.ndarray) -> Buffer:
        assert arr.flags.c_contiguous
        self.allocator.account(arr.nbytes)
        return Buffer(self, arr.nbytes, arr, arr.ctypes.data if arr.nbytes else 0, False)

    def read(self, buf: Buffer, view: StridedView, shape: Shape, dtype: DType) -> np.ndarray:
        return host_read(buf.mem, view, shape, dtype)

    def queued(self) -> int:
        return self.queue.submitted

    def runs_inline(self, work: int) -> bool:
        """Whether work of this size runs on the submitting thread when the queue is idle (`inline_work`): handing it
        to the worker thread would cost more than the work."""
        return work <= self.inline_work

    def submit(self, fn: Callable[[], None], waits: list[tuple[Device, int]], work: int) -> int:
        return self.queue.submit(fn, [(d.timeline, v) for d, v in waits], self.runs_inline(work))

    def prepare_batch(self, batch: BatchState) -> None:
        """INLINE where the batch's work is small (`runs_inline`), else QUEUED (always under AZYX_DEBUG's launch
        timings, which time each kernel of a work item: `timed`). A backend then leaves in an INLINE batch's
        `prepared` what runs it now on the calling thread: `prepared.inline(items)`."""
        batch.how = INLINE if self.runs_inline(batch.work) and not debug.enabled(debug.LAUNCHES) else QUEUED

    def timed(self, calls: list[Callable[[], None]], items: list[LaunchItem]) -> Callable[[], None]:
        """The work item of AZYX_DEBUG's launch timings: `calls` (one per kernel of `items`) in turn, each timed."""

        def run() -> None:
            for call, (step, _, _) in zip(calls, items):
                t0 = time.perf_counter()
                call()
                debug.log(debug.LAUNCHES, f"{self.name}: {step.name} work={step.work} "
                                          f"{(time.perf_counter() - t0) * 1e6:.1f} us")
        return run

    def prepare(self, plan: ExecutionPlan, batches: list[BatchState]) -> Runner:
        """The base's runner (each batch INLINE or QUEUED), gathering where the plan is `gatherable` and its work is
        handed to the queue (QUEUED): a crowd's runs are then one hand-off, not one each. An INLINE plan's runs are
        not gathered: each runs where it is submitted, and its realize returns without waiting, where a gathered run
        is waited for (a wake-up of its task, ~10 us on a 2-core host, more than the run's own submission)."""
        runner = super().prepare(plan, batches)
        runner.gathers = self.gather_runs and gatherable(plan) and any(b.how is QUEUED for b in batches)
        return runner

    def open_gather(self) -> None:
        assert not self.gather_v
        self.gather_v = self.queue.reserve()

    def gather_launch(self, items: list[LaunchItem], batch: BatchState) -> int:
        assert self.gather_v
        self.gathered += items
        self.gathered_batches.append(batch)
        return self.gather_v

    def close_gather(self) -> None:
        """The gathered kernels as one batch (prepared once per combination of the runs' batches, by the device's own
        rule: INLINE only where the whole is small work), one work item of the reserved value: on a C device one call
        into C, which runs on the device's runner, not on the loop's thread, unless it is small."""
        v, items, batches = self.gather_v, self.gathered, self.gathered_batches
        self.gather_v, self.gathered, self.gathered_batches = 0, [], []
        try:
            key = tuple(map(id, batches))
            found = self.wide.get(key)
            if found is None:
                if len(self.wide) >= WIDE_KEPT:
                    self.wide.pop(next(iter(self.wide)))
                wide = BatchState([step for b in batches for step in b.steps])
                self.prepare_batch(wide)
                found = self.wide[key] = (batches, wide)
            wide = found[1]
            if wide.how is INLINE:
                self.queue.submit_reserved(functools.partial(wide.prepared.inline, items), v, True)
            else:
                self.queue.submit_reserved(self.batch_fn(items, wide), v, False)
        except BaseException as e:  # (the runs' records raise it; their value still comes, or they would wait on)
            self.record_failure(v, e)
            self.queue.submit_reserved(_keep_alive(items), v, False)

    def batch_fn(self, items: list[LaunchItem], batch: BatchState) -> Callable[[], None]:
        """The work item that runs these kernels in order (it holds their buffers until it has run)."""
        raise NotImplementedError

    def launch_many(self, items: list[LaunchItem], waits: list[tuple[Device, int]],
                    batch: BatchState | None = None) -> int:
        """Kernels back to back. An INLINE batch whose waits are met runs here and now where the queue is idle (a
        steady small request: no work item, no hand-off); any other is one work item, so one hand-off to the worker
        thread (or the native queue) for all of them."""
        if batch is None:
            batch = self.batch_of(items)
        return self.run_batch(batch.how, waits, batch.prepared.inline, (items,),
                              functools.partial(self.batch_fn, items, batch))

    def run_batch(self, how: str, waits: list[tuple[Device, int]], inline: Callable[..., None], args: tuple[Any, ...],
                  queued: Callable[[], Callable[[], None]]) -> int:
        """Where a batch's run goes, decided here alone (for launch items and frozen batches alike): an INLINE batch
        (`prepare_batch`) whose waits are met runs here and now, `inline(*args)`, where the queue is idle; any other
        run is one work item (`queued()`), so one hand-off to the worker thread (or the native queue)."""
        if how is INLINE and (not waits or all(d.timeline.value >= w for d, w in waits)) and (
                v := self.queue.run_now(inline, *args)):
            return v
        return self.queue.submit(queued(), [(d.timeline, w) for d, w in waits], False)

    def copy(self, src: Buffer, dst: Buffer, n: int, waits: list[tuple[Device, int]]) -> int:
        """A memmove on this device's queue (also from another host-memory device of this kind: c:0 -> c:1)."""

        def copy() -> None:
            ctypes.memmove(dst.ptr, src.ptr, n)

        return self.submit(copy, waits, n // 64)

    copy_peer = copy

    def copy_from_host(self, host: np.ndarray, dst: Buffer, waits: list[tuple[Device, int]], keep: Any,
                       offset: int = 0) -> int:

        def copy() -> None:
            assert keep is not None
            ctypes.memmove(dst.ptr + offset, host.ctypes.data, host.nbytes)

        return self.submit(copy, waits, host.nbytes // 64)

    def hold(self, waits: list[tuple[Device, int]], keep: Any) -> int:
        return self.submit(_keep_alive(keep), waits, 0)

    def write(self, buf: Buffer, host: np.ndarray) -> None:
        ctypes.memmove(buf.ptr, host.ctypes.data, min(buf.nbytes, host.nbytes))

    def close(self) -> None:
        self.queue.close()


def run_each(calls: list[Callable[[], None]]) -> None:
    """(The waiter thread) the `post`s of the commands a batch or gather took, in order: its one command's `post`."""
    for call in calls:
        call()


def _keep_alive(*objs: object) -> Callable[[], None]:
    """A no-op work item that holds `objs` (buffers) until the queue has run it."""

    def hold() -> None:
        assert objs

    return hold


class HostMemory(HostDevice):
    """Plain host memory ("host"): where tensors made from numpy data wait for a device whose memory is not
    host memory; the plan copies them over when it first needs them. Not a compute device."""

    kind = "host"
    listed = False
