"""The small protocol every backend implements, and the Buffer that carries its readiness."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

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


class Device:
    """One logical device: allocator, queue, timeline signal, compiler and launcher."""

    kind: str = "abstract"
    dialect: Dialect | None = None
    tiles = False  # whether register tiling pays off on this device

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

    def alloc(self, nbytes: int) -> Buffer:
        raise NotImplementedError

    def release(self, buf: Buffer) -> None:
        raise NotImplementedError

    def buffer_from_numpy(self, arr: np.ndarray) -> Buffer:
        raise NotImplementedError

    def read(self, buf: Buffer, view: StridedView, shape: Shape, dtype: DType) -> np.ndarray:
        raise NotImplementedError

    # work
    def pending(self) -> int:
        return 0

    def submit(self, fn: Callable[[], None], waits: list[tuple[TimelineSignal, int]], work: int) -> int:
        raise NotImplementedError

    def render(self, k: Kernel) -> tuple[str, str]:
        from azyx.plan import kernel_name

        assert self.dialect is not None
        body = render(k, "KERNEL", self.dialect, self.threads)
        name = kernel_name(body)
        return name, body.replace("KERNEL", name, 1)

    async def compile(self, steps: list[KernelStep]) -> None:
        raise NotImplementedError

    def launch_fn(self, step: KernelStep, bufs: list[Buffer]) -> Callable[[], None]:
        raise NotImplementedError

    def copy_fn(self, src: Buffer, dst: Buffer) -> Callable[[], None]:
        """A copy between two buffers of this device's API (same device or peer)."""
        raise NotImplementedError

    def write(self, buf: Buffer, host: np.ndarray) -> None:
        raise NotImplementedError

    def staged_copy_fn(self, src: Buffer, dst: Buffer) -> Callable[[], None]:
        """A copy from another API's device into `dst`, staged through host memory."""
        from azyx.dtypes import dtypes
        from azyx.graph import StridedView

        def copy() -> None:
            n = min(src.nbytes, dst.nbytes)
            self.write(dst, src.device.read(src, StridedView(0, (1,)), (n,), dtypes.uint8))

        return copy

    def close(self) -> None:
        pass
