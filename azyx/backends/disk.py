"""The disk as a device: its buffers are byte ranges of open files, its memory pool the files it holds open.

A tensor of a safetensors file is a Leaf on device "disk" whose Buffer is (file, offset, length). Nothing is read until
a plan copies it to a compute device or `numpy()` reads it. Reads run on reader threads, never on the event loop: a
plan's transfer out of a file (`send`) and a stream (azyx.io.stream) take the one load pipeline, the disk's `loads`
part (azyx.loads.Loads), whose reads the disk's timeline numbers (it reaches a read's value once it and every earlier
read are done; the destination's queue waits for that, as for any other source device).
The disk runs no kernels and is not listed by `azyx.devices()`; an op on disk tensors computes on the AUTO device
(see `azyx.storage.on_build`). Every byte read is counted (`bytes_read`), so tests see what a realize read.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from azyx import workers
from azyx.allocator import MemoryUsage
from azyx.device import DISK, Buffer, Device, host_read, widened
from azyx.dtypes import DType
from azyx.errors import DeviceError
from azyx.files import DiskFile, FileRange, covering
from azyx.graph import Shape, StridedView, contiguous_strides, prod
from azyx.loads import Loads
from azyx.timeline import TimelineSignal


class DiskDevice(Device):
    """Device "disk": buffers over file ranges, positional reads, no kernels, no allocation."""

    kind = DISK
    listed = False
    storage = True

    def __init__(self, index: int = 0, options: dict[str, Any] | None = None):
        super().__init__(index, options or {})
        self.name = DISK
        self.timeline = TimelineSignal(DISK)  # its buffers are ready at 0; its values are transfers' reads
        self.compute = 0.0
        # re-entrant: release() runs from Buffer.__del__, which the cyclic GC may call while this thread holds it
        self.lock = threading.RLock()
        self.in_use = 0  # bytes of file ranges that live buffers describe
        self.buffers = 0  # how many such buffers live
        self.bytes_read = 0  # bytes read from files so far (tests: lazy loading and partial reads)
        self.reads = 0
        self.reads_on_loop = 0  # reads made on an event loop's thread, which they would block: should stay 0
        self.loads = Loads(self, self.count_read)  # (its reads numbered on this timeline, counted here)

    # memory: file ranges, accounted like a pool
    def buffer(self, file: DiskFile, offset: int, nbytes: int, what: str = "",
               runs: tuple[int, int] | None = None) -> Buffer:
        """A buffer describing bytes [offset, offset + nbytes) of `file` (`what`: the data's name, for errors); with
        `runs` (run, step), `nbytes` bytes in runs of `run` bytes every `step` bytes from `offset` (`FileRange`)."""
        end = offset + nbytes if runs is None else offset + (-(-nbytes // runs[0]) - 1) * runs[1] + runs[0]
        assert 0 <= offset and (not nbytes or end <= file.size), f"range {offset}+{nbytes} outside {file}"
        with self.lock:
            self.in_use += nbytes
            self.buffers += 1
        return Buffer(self, nbytes, FileRange(file, offset, what, runs), 0, False)

    def memory(self) -> MemoryUsage:
        return MemoryUsage(self.in_use, 0)

    def free_memory(self) -> int:
        return 0

    def alloc(self, nbytes: int) -> Buffer:
        raise DeviceError("the disk device holds file-backed tensors only: nothing is allocated or computed there")

    def release(self, buf: Buffer) -> None:
        with self.lock:
            self.in_use -= buf.nbytes
            self.buffers -= 1

    def buffer_from_numpy(self, arr: np.ndarray) -> Buffer:
        raise DeviceError("the disk device holds file-backed tensors only; write files with azyx.io.save_safetensors")

    # reads: the load pipeline's (`loads`: on reader threads, never the loop), counted here
    def count_read(self, n: int) -> None:
        """Account one read of `n` bytes (`bytes_read`, `reads`, `reads_on_loop`)."""
        on_loop = workers.on_event_loop()
        with self.lock:
            self.bytes_read += n
            self.reads += 1
            self.reads_on_loop += on_loop

    def send(self, src: Buffer, dst: Buffer, n: int) -> int:
        """A plan's transfer of `n` bytes of a file range into `dst` (any other device): `Loads.send`."""
        return self.loads.send(src, dst, n)

    def queued(self) -> int:
        return self.loads.submitted

    def read(self, buf: Buffer, view: StridedView, shape: Shape, dtype: DType) -> np.ndarray:
        """A new C-contiguous array of the view (bfloat16 widened to float32, like every device's `read`); only the
        bytes the view covers are read."""
        lo, hi = covering(view, shape)
        if lo == hi:
            return np.empty(shape, dtype.numpy)
        item = dtype.itemsize
        assert 0 <= lo and hi * item <= buf.nbytes, f"read of elements [{lo}, {hi}) outside {buf}"
        if view.strides == contiguous_strides(shape) or prod(shape) == 1:  # (read in place, in parallel)
            out = np.empty(shape, dtype.np)
            self.loads.read_split(buf.mem, lo * item, out.reshape(-1).view(np.uint8).data)
            return widened(out, dtype)
        raw = np.empty((hi - lo) * item, np.uint8)
        self.loads.read_range(buf.mem, lo * item, [raw.data])
        return host_read(raw, StridedView(view.offset - lo, view.strides), shape, dtype)

