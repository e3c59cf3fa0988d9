"""The dummy device: fake memory and compute capacity. It plans, allocates and 'runs' without computing,
so the scheduler, placement and allocation errors can be tested without real hardware."""

from __future__ import annotations

from typing import Any

import numpy as np

from azyx.codegen.dialect import C
from azyx.device import Buffer, Device
from azyx.dtypes import DType
from azyx.errors import DeviceError
from azyx.graph import Shape, StridedView
from azyx.plan import KernelStep

CONFIG = {"enabled": False, "devices": 1, "memory": 1 << 30, "compute": 0.0}
AUTO = True

NO_DATA = "{} is a dummy device: it plans and accounts memory but holds no data"


class DummyDevice(Device):
    kind = "dummy"
    dialect = C
    listed = False
    unlisted_compute = True
    search_actions: frozenset[str] = frozenset()  # (it runs nothing: nothing to time)

    def __init__(self, index: int, options: dict[str, Any]):
        super().__init__(index, options)
        self.mem.open_pool(options, 1 << 30, _no_data, 0)  # (accounting only)
        self.compute = float(options.get("compute", 0.0))
        self.launched: list[str] = []  # kernel names, in launch order (for tests)
        self.scalars_bound = 0  # scalar arguments passed to kernels (for tests)

    def buffer_from_numpy(self, arr: np.ndarray) -> Buffer:
        return self.alloc(arr.nbytes)

    def read(self, buf: Buffer, view: StridedView, shape: Shape, dtype: DType) -> np.ndarray:
        raise DeviceError(NO_DATA.format(self.name))

    def _done(self) -> int:
        """Work submitted and done at once: the timeline's next value."""
        self.timeline.signal(v := self.timeline.value + 1)
        return v

    def launch(self, step: KernelStep, bufs: list[Buffer], waits: list[tuple[Device, int]],
               words: tuple[int, ...] = ()) -> int:
        self.launched.append(step.name)
        self.scalars_bound += len(words)
        return self._done()

    def copy(self, src: Buffer, dst: Buffer, n: int, waits: list[tuple[Device, int]]) -> int:
        return self._done()

    copy_peer = copy

    def copy_from_host(self, host: np.ndarray, dst: Buffer, waits: list[tuple[Device, int]], keep: Any,
                       offset: int = 0) -> int:
        return self._done()

    def copy_to_host(self, buf: Buffer, out: np.ndarray, waits: list[tuple[Device, int]], offset: int = 0) -> int:
        """The read fails (there is no data): its run raises the error, as a read of a buffer here does."""
        self.record_failure(self.timeline.value + 1, DeviceError(NO_DATA.format(self.name)))
        return self._done()

    def has_program(self, name: str) -> bool:
        return True

    async def compile(self, steps: list[KernelStep]) -> None:
        return None


def _no_data(size: int) -> None:
    """A dummy block: nothing."""
