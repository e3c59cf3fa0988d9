"""What every device whose memory is host memory shares: a pooled allocator and an in-order worker queue."""

from __future__ import annotations

import ctypes
import os
import queue
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from azyx import debug
from azyx.device import Buffer, Device
from azyx.dtypes import DType, dtypes
from azyx.errors import AllocationError
from azyx.graph import Shape, StridedView
from azyx.timeline import TimelineSignal

ALIGN = 64
WORKER_NICE = 10


def bucket(nbytes: int) -> int:
    """Round a request up so that freed blocks are reused by requests of nearly the same size."""
    if nbytes <= 4096:
        return max(64, 1 << (nbytes - 1).bit_length())
    gran = 4096 if nbytes <= (1 << 20) else 1 << 16
    return -(-nbytes // gran) * gran


class HostAllocator:
    """Size-bucketed free lists of 64-byte aligned host blocks, with in-use accounting for device choice."""

    def __init__(self, capacity: int, cache_limit: int):
        self.capacity, self.cache_limit = capacity, cache_limit
        self.lock = threading.Lock()
        self.free_lists: dict[int, list[np.ndarray]] = {}
        self.in_use = 0
        self.cached = 0

    def alloc(self, nbytes: int) -> tuple[np.ndarray, int, int]:
        size = bucket(nbytes)
        with self.lock:
            lst = self.free_lists.get(size)
            mem = lst.pop() if lst else None
            if mem is not None:
                self.cached -= size
            elif self.in_use + size > self.capacity:
                raise AllocationError(f"allocating {nbytes} bytes exceeds the device's capacity of {self.capacity} "
                                      f"bytes ({self.in_use} in use)")
            self.in_use += size
        if mem is None:
            try:
                raw = np.empty(size + ALIGN, np.uint8)
            except MemoryError:
                with self.lock:
                    self.in_use -= size
                raise AllocationError(f"host allocation of {size} bytes failed") from None
            off = (-raw.ctypes.data) % ALIGN
            mem = raw[off : off + size]
        return mem, mem.ctypes.data, size

    def free(self, mem: np.ndarray, size: int) -> None:
        with self.lock:
            self.in_use -= size
            if self.cached + size <= self.cache_limit:
                self.free_lists.setdefault(size, []).append(mem)
                self.cached += size

    def trim(self) -> None:
        with self.lock:
            self.free_lists.clear()
            self.cached = 0


class WorkQueue:
    """An in-order queue drained by one worker thread; small work runs inline when the queue is idle."""

    def __init__(self, timeline: TimelineSignal, name: str, errors: list[BaseException]):
        self.timeline, self.name = timeline, name
        self.q: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.submitted = 0
        self.lock = threading.Lock()
        self.thread: threading.Thread | None = None
        self.errors = errors

    def submit(self, fn: Callable[[], None], waits: list[tuple[TimelineSignal, int]], inline: bool) -> int:
        with self.lock:
            self.submitted += 1
            v = self.submitted
            if inline and self.timeline.value == v - 1 and all(t.value >= w for t, w in waits):
                self._execute(fn, v)
                del fn  # the work's buffers go back to the pool before anyone sees the timeline advance
                self.timeline.signal(v)
                return v
            if self.thread is None:
                self.thread = threading.Thread(target=self._loop, name=f"azyx-{self.name}", daemon=True)
                self.thread.start()
            self.q.put((fn, waits, v))
        return v

    def _execute(self, fn: Callable[[], None], v: int) -> None:
        try:
            fn()
        except BaseException as e:  # the loop sees it through realize's check; the queue keeps going
            self.errors.append(e)
            debug.log(debug.DEVICES, f"{self.name}: work item {v} failed: {e!r}")

    def _loop(self) -> None:
        # Device work runs at a lower priority than the event loop thread (OpenMP threads started from here
        # inherit it), so the loop wakes on time even while kernels keep every core busy.
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WORKER_NICE)
        except (OSError, AttributeError):
            pass
        while True:
            item = self.q.get()
            if item is None:
                return
            fn, waits, v = item
            del item
            for t, w in waits:
                t.wait_sync(w)
            self._execute(fn, v)
            del fn  # release the work's buffers before signalling completion
            self.timeline.signal(v)

    def close(self) -> None:
        if self.thread is not None:
            self.q.put(None)
            self.thread.join(timeout=5)
            self.thread = None


def memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 8 << 30


class HostDevice(Device):
    """A device whose buffers are host memory: allocation, copies and reads are plain memory operations."""

    def __init__(self, index: int, options: dict[str, Any]):
        super().__init__(index, options)
        self.capacity = int(options.get("memory") or memory_bytes() * 3 // 4)
        self.allocator = HostAllocator(self.capacity, cache_limit=self.capacity // 4)
        self.queue = WorkQueue(self.timeline, self.name, self.errors)
        self.inline_work = int(options.get("inline_work", 1 << 16))

    def free_memory(self) -> int:
        return self.capacity - self.allocator.in_use

    def alloc(self, nbytes: int) -> Buffer:
        mem, ptr, size = self.allocator.alloc(nbytes)
        return Buffer(self, size, mem, ptr, True)

    def release(self, buf: Buffer) -> None:
        if buf.pooled:
            self.allocator.free(buf.mem, buf.nbytes)
        else:
            with self.allocator.lock:
                self.allocator.in_use -= buf.nbytes

    def buffer_from_numpy(self, arr: np.ndarray) -> Buffer:
        assert arr.flags.c_contiguous
        with self.allocator.lock:
            self.allocator.in_use += arr.nbytes
        return Buffer(self, arr.nbytes, arr, arr.ctypes.data if arr.nbytes else 0, False)

    def read(self, buf: Buffer, view: StridedView, shape: Shape, dtype: DType) -> np.ndarray:
        return host_read(buf.mem, view, shape, dtype)

    def pending(self) -> int:
        return self.queue.submitted - self.timeline.value

    def submit(self, fn: Callable[[], None], waits: list[tuple[TimelineSignal, int]], work: int) -> int:
        return self.queue.submit(fn, waits, work <= self.inline_work)

    def write(self, buf: Buffer, host: np.ndarray) -> None:
        ctypes.memmove(buf.ptr, host.ctypes.data, min(buf.nbytes, host.nbytes))

    def copy_fn(self, src: Buffer, dst: Buffer) -> Callable[[], None]:
        n = min(src.nbytes, dst.nbytes)

        def copy() -> None:
            ctypes.memmove(dst.ptr, src.ptr, n)

        return copy

    def close(self) -> None:
        self.queue.close()


def host_read(mem: np.ndarray, view: StridedView, shape: Shape, dtype: DType) -> np.ndarray:
    """Copy a strided view of host memory into a new C-contiguous array (bfloat16 widened to float32)."""
    item = dtype.itemsize
    raw = mem.reshape(-1).view(np.uint8)
    flat = raw[: len(raw) // item * item].view(dtype.np)
    if not shape or 0 not in shape:
        arr = np.lib.stride_tricks.as_strided(flat[view.offset :], shape, tuple(s * item for s in view.strides))
    else:
        arr = np.empty(shape, dtype.np)
    out = np.array(arr, copy=True, order="C")
    if dtype is dtypes.bfloat16:
        out = (out.astype(np.uint32) << 16).view(np.float32)
    return out
