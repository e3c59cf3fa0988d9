"""Streaming a safetensors file onto a device: realized tensors one by one, with bounded read-ahead.

Each tensor is read on a worker thread (positional reads, off the event loop) into a pooled host buffer: the target
device's own memory when that is host memory (the C backend: no copy after the read), else host:0's pool, from
which a plan copies it to the device. While you work on one tensor, the next ones are already being read, as long
as the bytes read ahead fit in `prefetch` (16 MiB by default); a tensor larger than that is read when you ask for
it. So the memory the stream holds is at most the tensor you are working on plus `prefetch`: drop each tensor when
you are done with it (a loop variable keeps the previous one alive until the next is assigned). A host device's pool
keeps freed blocks for reuse; that memory is the pool's (reused by later tensors of the same size), not the stream's.
"""

from __future__ import annotations

import concurrent.futures
import os
from collections import deque
from typing import Any

import numpy as np

from azyx.backends.disk import DiskFile
from azyx.device import DISK, Buffer
from azyx.dtypes import dtypes
from azyx.errors import AzyxError, AzyxIOError
from azyx.fileformat import TensorEntry
from azyx.graph import Node, Op, StridedView
from azyx.runtime import RT
from azyx.storage import disk_device, header_of, open_safetensors
from azyx.tensor import Tensor
from azyx.workers import in_worker_thread, result_of, start_in_worker_thread

PREFETCH = 16 << 20  # bytes read ahead by default


def stream_safetensors(path: Any, device: str | None = None, *, prefetch: int = PREFETCH,
                       progress: bool = False) -> SafetensorsStream:
    """Realized tensors of a safetensors file, one by one in file order, as `(name, tensor)` on `device` (None:
    AUTO). The next tensors are read while you use the current one (up to `prefetch` bytes ahead); `progress=True`
    shows a tqdm bar (pip install tqdm).

    >>> import asyncio, numpy as np, azyx
    >>> from safetensors.numpy import save_file
    >>> save_file({"a": np.ones(4, np.float32), "b": np.arange(3)}, "/tmp/azyx_doc3.safetensors")
    >>> async def main():
    ...     return {name: await t.sum().item() async for name, t in
    ...             azyx.io.stream_safetensors("/tmp/azyx_doc3.safetensors", device="c:0")}
    >>> asyncio.run(main()) == {"a": 4.0, "b": 3}
    True
    """
    name = RT.check_device(device) if device is not None else None  # (its backend is probed at the first read)
    if name is not None and name in RT.executor.devices and RT.executor.devices[name].storage:
        raise AzyxIOError(f"stream_safetensors needs a compute device, got {device!r}")
    if not isinstance(prefetch, int) or prefetch < 0:
        raise AzyxIOError(f"prefetch must be a number of bytes >= 0, got {prefetch!r}")
    return SafetensorsStream(path, name, prefetch, progress)


class SafetensorsStream:
    """The async iterator of `stream_safetensors` (also an async context manager that closes it)."""

    def __init__(self, path: Any, device: str | None, prefetch: int, progress: bool):
        self.path, self.device, self.prefetch = path, device, prefetch
        self.pinned = device is not None
        self.dev = self.staging = RT.device("host:0")  # (the device and staging memory are chosen in `_open`)
        self.widen_bf16 = False
        self.want_progress = progress
        self.bar: Any = None
        self.file: DiskFile | None = None
        self.entries: list[TensorEntry] = []
        self.next = 0  # index of the next entry to start reading
        # read (or being read) ahead: the entry, its read (a future of None: the buffer is held here, not by the
        # future, so an abandoned read frees it when it ends, not when the pool's thread lets go of its work item)
        self.ahead: deque[tuple[TensorEntry, concurrent.futures.Future[None], Buffer | None]] = deque()
        self.ahead_bytes = 0  # read (or being read) but not yet handed out
        self.closed = False
        if progress:
            try:
                import tqdm  # noqa: F401
            except ImportError:
                raise AzyxError("progress=True needs tqdm (pip install tqdm)") from None

    def __aiter__(self) -> SafetensorsStream:
        return self

    async def __aenter__(self) -> SafetensorsStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def __anext__(self) -> tuple[str, Tensor]:
        if self.closed:
            raise StopAsyncIteration
        if self.file is None:
            await self._open()
        if not self.ahead:
            if self.next >= len(self.entries):
                await self.aclose()
                raise StopAsyncIteration
            self._start_next()  # asked for: read it now, whatever its size
        entry, job, staged = self.ahead[0]
        try:
            await result_of(job)  # cancelled here: the entry stays first, the next call waits again
            assert staged is not None
            t = await self._to_device(entry, staged)
        except AzyxError:
            await self.aclose()
            raise
        self.ahead.popleft()
        self.ahead_bytes -= entry.nbytes
        self._top_up()
        if self.bar is not None:
            self.bar.update(entry.nbytes)
        return entry.name, t

    async def aclose(self) -> None:
        """Stop: the reads already started (at most `prefetch` bytes) finish on their threads, then free their
        buffers (`azyx.synchronize()` waits for them)."""
        self.closed = True
        self.ahead.clear()
        self.ahead_bytes = 0
        self.file = None
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    async def _open(self) -> None:
        # the device's backend probed off the loop (AUTO's backends for None), then the device chosen
        await RT.startup(RT.auto_kinds() if self.device is None else [self.device.partition(":")[0]])
        name = self.device if self.device is not None else RT.resolve_device(None, 0)[0]
        self.dev = dev = RT.device(name)
        if dev.storage:
            raise AzyxIOError(f"stream_safetensors needs a compute device, got {self.device!r}")
        # pooled host buffers the reads land in: the device's own memory, or host:0's until a plan copies them over
        self.staging = dev if dev.host_memory else RT.device("host:0")
        self.widen_bf16 = dev.dialect is None or "bfloat16" not in dev.dialect.types
        self.file = await in_worker_thread(open_safetensors, self.path)
        self.entries = list(header_of(self.file).tensors.values())
        if self.want_progress:
            from tqdm import tqdm

            total = sum(e.nbytes for e in self.entries)
            self.bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024,
                            desc=os.path.basename(self.file.path))
        self._top_up()

    def _top_up(self) -> None:
        while self.next < len(self.entries) and self.ahead_bytes + self.entries[self.next].nbytes <= self.prefetch:
            self._start_next()

    def _start_next(self) -> None:
        assert self.file is not None
        entry = self.entries[self.next]
        self.next += 1
        src = disk_device().buffer(self.file, header_of(self.file).data_start + entry.begin, entry.nbytes,
                                   f"tensor {entry.name!r}")
        widen = self.widen_bf16 and entry.dtype is dtypes.bfloat16
        job: concurrent.futures.Future[None]
        dst: Buffer | None = None
        try:
            dst = self.staging.alloc(max(entry.nbytes * (2 if widen else 1), 1))
        except AzyxError as e:  # raised when this tensor is asked for, not while another is being used
            job = concurrent.futures.Future()
            job.set_exception(e)
        else:
            job = start_in_worker_thread(_read, src, dst, entry.nbytes, widen)
        self.ahead.append((entry, job, dst))
        self.ahead_bytes += entry.nbytes

    async def _to_device(self, entry: TensorEntry, staged: Buffer) -> Tensor:
        dtype = dtypes.float32 if self.widen_bf16 and entry.dtype is dtypes.bfloat16 else entry.dtype
        on_device = self.dev.host_memory
        node = Node(Op.LEAF, (), None, entry.shape, dtype, self.dev.name if on_device else self.staging.name,
                    self.pinned if on_device else False)
        node.buffer, node.view = staged, StridedView.contiguous(entry.shape)
        t = Tensor._from_node(node)
        if not on_device:
            t = await t.to(self.dev.name).realize()
        return t


def _read(src: Buffer, dst: Buffer, n: int, widen_bf16: bool) -> None:
    """On a worker thread: the file range into the pooled host buffer (bfloat16 widened for devices without it)."""
    assert src.device.name == DISK
    mem: np.ndarray = dst.mem
    src.device.read_into(src, mem[:n])
    if widen_bf16:  # bfloat16 is the upper half of a float32
        mem[: 2 * n].view(np.uint32)[:] = mem[:n].view(np.uint16).astype(np.uint32) << 16
