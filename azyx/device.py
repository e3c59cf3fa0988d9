"""The small protocol every backend implements, and the Buffer that carries its readiness."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from azyx.allocator import MemoryUsage
from azyx.cstyle import Dialect, render
from azyx.ir import Kernel
from azyx.timeline import TimelineSignal

if TYPE_CHECKING:
    from azyx.dtypes import DType
    from azyx.graph import Shape, StridedView
    from azyx.plan import KernelStep


class Buffer:
    """Device memory plus the timeline value (on its own device) at which its contents are ready."""

    __slots__ = ("device", "nbytes", "mem", "ptr", "ready", "pooled", "__weakref__")

    def __init__(self, device: Device, nbytes: int, mem: Any, ptr: int, pooled: bool):
        self.device, self.nbytes, self.mem, self.ptr, self.pooled = device, nbytes, mem, ptr, pooled
        self.ready = 0

    def __repr__(self) -> str:
        return f"Buffer({self.device.name}, {self.nbytes} bytes, ready@{self.ready})"

    def __del__(self) -> None:
        try:
            self.device.release(self)
        except Exception:  # interpreter shutdown
            pass



Launch = tuple["KernelStep", list["Buffer"], tuple[int, ...]]  # a kernel, its buffers, its scalar arguments' words

class Device:
    """One logical device: allocator, queue, timeline signal, compiler and launcher."""

    kind: str = "abstract"
    dialect: Dialect | None = None
    tiles = False  # whether register tiling pays off on this device
    host_memory = False  # buffers are host memory (Buffer.mem is a numpy array, Buffer.ptr its address)
    listed = True  # a compute device that azyx.devices() lists
    storage = False  # buffers are file ranges (disk): reading them waits on storage, so never on the event loop
    spin = 0.0  # seconds `poll` may query for completion when the loop would sleep otherwise (see realize.wait_for)

    def __init__(self, index: int, options: dict[str, Any]):
        self.index = index
        self.name = f"{self.kind}:{index}"
        self.options = options
        self.timeline = TimelineSignal(self.name)
        self.capacity = 0
        self.compute = 1.0
        self.threads = 1
        self.errors: list[BaseException] = []  # failures of queued work, raised by the next realize that waits

    def __repr__(self) -> str:
        return f"<Device {self.name}>"

    # memory
    def free_memory(self) -> int:
        raise NotImplementedError

    def memory(self) -> MemoryUsage:
        """Bytes this device's buffers hold and bytes its pool caches for reuse (what `azyx.stats()` reports)."""
        raise NotImplementedError

    def alloc(self, nbytes: int) -> Buffer:
        raise NotImplementedError

    def release(self, buf: Buffer) -> None:
        raise NotImplementedError

    def buffer_from_numpy(self, arr: np.ndarray) -> Buffer:
        raise NotImplementedError

    def read(self, buf: Buffer, view: StridedView, shape: Shape, dtype: DType) -> np.ndarray:
        raise NotImplementedError

    # work: the executor's two entry points; `waits` are (device, timeline value) pairs to wait for first,
    # on the device side (its queue's wait primitive or its worker thread), never on the event loop
    def pending(self) -> int:
        return 0

    def launch(self, step: KernelStep, bufs: list[Buffer], waits: list[tuple[Device, int]],
               words: tuple[int, ...] = ()) -> int:
        """Queue a kernel with its buffers and the 64-bit words of its scalar arguments (KernelStep.words); returns the
        timeline value at which it will have completed."""
        raise NotImplementedError

    def launch_many(self, items: list[Launch], waits: list[tuple[Device, int]],
                    memo: dict[str, Any] | None = None) -> int:
        """Queue kernels that run back to back (a device may submit them as one piece of work); returns the timeline
        value at which all have completed. The queue is in order: the first kernel's waits hold for the rest. `memo`
        (when given) belongs to these steps of one plan: a device may keep there what it derives from the steps alone,
        for the plan's next run."""
        v = 0
        for i, (step, bufs, words) in enumerate(items):
            v = self.launch(step, bufs, waits if i == 0 else [], words)
        return v

    def copy_in(self, src: Buffer, dst: Buffer, waits: list[tuple[Device, int]]) -> int:
        """Queue a copy of `src` (on this or any other device) into `dst` (on this device)."""
        raise NotImplementedError

    def begin_batch(self) -> None:
        """The launches until `end_batch` are one plan's, on this device alone: a device may submit them together
        (CUDA replays them as a graph once steady)."""

    def end_batch(self) -> None:
        pass

    def render(self, k: Kernel) -> tuple[str, str]:
        from azyx.plan import kernel_name

        assert self.dialect is not None
        body = render(k, "KERNEL", self.dialect, self.threads)
        name = kernel_name(body)
        return name, body.replace("KERNEL", name, 1)

    def has_program(self, name: str) -> bool:
        """Whether kernel `name` is compiled and loaded for this device."""
        return False

    async def compile(self, steps: list[KernelStep]) -> None:
        raise NotImplementedError

    def write(self, buf: Buffer, host: np.ndarray) -> None:
        """Blocking write of raw bytes into `buf` (called on worker threads)."""
        raise NotImplementedError

    def copy_to_host(self, buf: Buffer, out: np.ndarray, waits: list[tuple[Device, int]]) -> int | None:
        """Queue a read of `buf` into the host array `out`, in program order on this device's own queue; returns
        the timeline value at which it is done, or None where the device has no queue (then `read_into` runs on
        the reader's worker thread). Reading in program order is what keeps cross-device waits free of cycles."""
        return None

    def read_into(self, buf: Buffer, out: np.ndarray) -> None:
        """Blocking read of the first `out.nbytes` raw bytes of `buf` into the uint8 array `out` (worker threads)."""
        from azyx.dtypes import dtypes
        from azyx.graph import StridedView

        out[...] = self.read(buf, StridedView(0, (1,)), (out.nbytes,), dtypes.uint8)

    def collect(self) -> None:
        """Drop what completed work still holds (called by `synchronize` once the device is idle)."""

    def poll(self, v: int, spin: float = 0.0) -> bool:
        """Advance the timeline to `v` if the device can tell that its work up to `v` has completed, without a wake-up
        from another thread: at once, or by querying for up to `spin` seconds (the caller's loop has nothing else to
        do). Returns whether `v` is reached. Optional: a device without a cheap query says no."""
        return self.timeline.value >= v

    def close(self) -> None:
        pass
