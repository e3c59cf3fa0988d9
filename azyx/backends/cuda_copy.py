"""The CUDA backend's copies: through pinned (page-locked) staging blocks to and from host memory, in chunks so that
a chunk's DMA overlaps the host copy of the next; device to device on the stream; peer-to-peer between devices.
`StagedCopies` is the part of `CUDADevice` that implements the device protocol's transfer calls (the executor routes
each transfer); the stream, its deferred commands and their completion are cuda.py's."""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable
from functools import partial
from typing import Any, cast

import numpy as np

from azyx import debug
from azyx.backends.cuda_driver import Hot, check, cu, describe_pointer
from azyx.device import Buffer, Device, Lent, after_waits
from azyx.errors import DeviceError
from azyx.memory import RING, RING_BLOCK, Staging
from azyx.queues import QueuedDevice
from azyx.workers import in_background

STAGE = 8 << 20  # bytes per pinned staging chunk of a host <-> device copy
SYNC_STAGE = 1 << 20  # a ready host source up to this size is staged at once; larger ones on a worker thread


class _Pinned:
    """Page-locked host memory. Owned by a device's staging pool, which frees it when the device closes: never
    with its last reference, because a `__del__` here would run when the cyclic GC finalizes a garbage cycle that
    holds a `device.Lent` of it (whose own `__del__` then puts this block back in the pool: resurrected, with its memory
    freed under it; the driver then hands the address out again, and two blocks alias)."""

    __slots__ = ("nbytes", "ptr", "array")

    def __init__(self, nbytes: int):
        self.nbytes = nbytes
        self.ptr = int(check(cu.cuMemHostAlloc(nbytes, cu.CU_MEMHOSTALLOC_PORTABLE), "cuMemHostAlloc"))
        self.array = np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(self.ptr))


class StagedCopies(QueuedDevice):
    """A CUDA device's transfers (see the module docstring); what it needs of the device is declared here."""

    stream: Any
    stream_h: int  # the stream's handle, for the ctypes calls of `hot`
    hot: Hot
    ctx: Any
    cu_device: Any
    staging: Staging  # pinned blocks (`_pinned`), kept for reuse (freeing page-locked memory synchronises the device)
    peers: dict[int, bool]  # per device index peer access was asked for with: whether it is on

    def use(self) -> None:
        raise NotImplementedError

    def _submit(self, enqueue: Callable[[], None], waits: list[tuple[Device, int]], keep: Any,
                post: Callable[[], None] | None = None, host_wait: Callable[[], None] | None = None) -> int:
        raise NotImplementedError

    def _pinned(self, size: int) -> _Pinned:
        """A new pinned block for the staging pool."""
        self.use()  # pinned memory is allocated in a context, on whichever thread needs staging
        return _Pinned(size)

    def pin_ring(self) -> None:
        """Pin a load's ring of staging blocks (RING of RING_BLOCK bytes: memory.Ring) into the staging
        pool now, at the device's start (a worker thread): the ring takes them from the pool's cache (`host_staging`)
        on the loop's thread, and no load pins memory beside the loop's driver calls (cuMemHostAlloc holds the
        driver's lock for milliseconds)."""
        blocks = [self.staging.lend(RING_BLOCK) for _ in range(RING)]
        del blocks  # (back to the pool, which keeps them cached)

    def copy(self, src: Buffer, dst: Buffer, n: int, waits: list[tuple[Device, int]]) -> int:
        return self._submit(lambda: check(cu.cuMemcpyDtoDAsync(dst.ptr, src.ptr, n, self.stream), "copy"), waits,
                            (src, dst))

    def copy_peer(self, src: Buffer, dst: Buffer, n: int, waits: list[tuple[Device, int]]) -> int:
        sdev = cast(StagedCopies, src.device)
        self._enable_peer(sdev)
        return self._submit(lambda: check(cu.cuMemcpyPeerAsync(dst.ptr, self.ctx, src.ptr, sdev.ctx, n, self.stream),
                                          "cuMemcpyPeerAsync"), waits, (src, dst))

    def host_staging(self, nbytes: int) -> tuple[np.ndarray, Any]:
        """A pinned block the staging pool has cached, to be read into and then copied from with one DMA. Else plain
        host memory: this runs on the loop, and pinning fresh memory takes milliseconds, so `copy_from_host` stages
        that through pinned chunks on a worker thread instead (whose blocks the pool then keeps for the next time)."""
        if (staged := self.staging.cached(nbytes)) is None:
            return super().host_staging(nbytes)
        return staged.block.array[:nbytes], staged

    def staging_block(self, nbytes: int) -> tuple[np.ndarray, Any]:
        """A pinned block from the staging pool, pinned now when it has none cached (worker threads only)."""
        return self.staging.host(nbytes)

    def copy_from_host(self, host: np.ndarray, dst: Buffer, waits: list[tuple[Device, int]], keep: Any,
                       offset: int = 0) -> int:
        """From this device's pinned staging (`host_staging`, `staging_block`: `keep` is its block, `host` that block
        or a part of it): one DMA. From other host memory: through pinned chunks, overlapped (`_upload`)."""
        n = host.nbytes
        if isinstance(keep, Lent) and keep.pool is self.staging.pool:
            src = host.ctypes.data if n else keep.block.ptr

            def dma() -> None:
                if n and (err := self.hot.here().htod(dst.ptr + offset, src, n, self.stream_h)):
                    self.hot.fail(err, "H2D")

            return self._submit(dma, waits, (keep, dst))
        flat = host.reshape(-1).view(np.uint8)
        return self._upload(n, lambda o, out: out.__setitem__(slice(None), flat[o:o + out.nbytes]), dst, offset,
                            waits, (keep, dst), at_once=n <= SYNC_STAGE)

    def _upload(self, n: int, fill: Callable[[int, np.ndarray], None], dst: Buffer, offset: int,
                waits: list[tuple[Device, int]], keep: Any, at_once: bool = False) -> int:
        """Host bytes -> this device (into `dst` from byte `offset`) through pinned chunks: `fill(o, chunk)` writes
        each (`o`: its offset in the bytes). A ready source that may be staged `at_once` (small) is staged here;
        otherwise a worker thread fills the chunks once the source is ready, and each chunk's DMA is a deferred
        command that goes on the stream once its chunk is filled (the DMA of one chunk overlaps the filling of the
        next)."""
        chunks = [(o, min(STAGE, n - o)) for o in range(0, n, STAGE)] or [(0, 0)]
        # each chunk's pinned block, in a cell of its own that its DMA command keeps (back to the pool once that DMA
        # is done); taken from the pool by whoever fills the chunk: pinning fresh memory takes milliseconds per chunk
        stages: list[list[Lent]] = [[] for _ in chunks]

        def dma(i: int) -> None:
            o, size = chunks[i]
            if size:
                pinned, at = stages[i][0].block, dst.ptr + offset + o
                if err := self.hot.here().htod(at, pinned.ptr, size, self.stream_h):  # (often the submitter's)
                    self.hot.fail(err, f"H2D of {size} bytes to {at:#x} (of {dst.nbytes}) from {pinned.ptr:#x}")

        def dma_all() -> None:
            for i in range(len(chunks)):
                dma(i)

        def fill_chunk(i: int, staged: Lent | None = None) -> None:
            o, size = chunks[i]
            stages[i].append(staged or self.staging.lend(max(size, 1)))
            fill(o, stages[i][0].block.array[:size])

        if at_once and all(d.timeline.value >= v for d, v in waits):
            # staged here from blocks the pool has cached; else (pinning fresh memory takes milliseconds, and this
            # may be the loop's thread) as a large source is, on a worker thread (those taken go back with `cached`)
            cached = [self.staging.cached(max(size, 1)) for _, size in chunks]
            if all(c is not None for c in cached):
                for i, c in enumerate(cached):
                    fill_chunk(i, c)
                return self._submit(dma_all, [], (keep, stages))
            del cached
        staged = [threading.Event() for _ in chunks]  # set as the worker fills each chunk

        def stage() -> None:
            try:
                for i in range(len(chunks)):
                    fill_chunk(i)
                    staged[i].set()
            except BaseException as e:
                self.record_failure(v, e)  # (v: the last chunk's value, set before this runs)
            finally:
                for ev in staged:  # never leave the submitter waiting
                    ev.set()

        v = 0
        for i in range(len(chunks)):
            v = self._submit(partial(dma, i), [], (keep, stages[i]), host_wait=partial(_wait_set, staged[i]))
        after_waits(waits, lambda: in_background(stage))
        return v

    def _enable_peer(self, other: StagedCopies) -> bool:
        """Peer access between the two contexts, both ways (a copy may run on either one's stream, a kernel of either
        may read the other's memory); whether it is on."""
        if other.index in self.peers:
            return self.peers[other.index]
        can = all(check(cu.cuDeviceCanAccessPeer(a.cu_device, b.cu_device), "cuDeviceCanAccessPeer")
                  for a, b in ((self, other), (other, self)))
        if can:
            for a, b in ((self, other), (other, self)):
                a.use()
                err = cu.cuCtxEnablePeerAccess(b.ctx, 0)[0]
                if err not in (cu.CUresult.CUDA_SUCCESS, cu.CUresult.CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED):
                    check((err,), "cuCtxEnablePeerAccess")
            self.use()
        self.peers[other.index] = other.peers[self.index] = can
        debug.log(debug.DEVICES, f"{self.name} <-> {other.name}: peer access {'on' if can else 'unavailable'}")
        return can

    def copy_to_host(self, buf: Buffer, out: np.ndarray, waits: list[tuple[Device, int]], offset: int = 0) -> int:
        """A read in stream order into the host array `out`, overlapped: each chunk's DMA lands in pinned memory and
        the waiter thread copies it out while the next chunk's DMA runs. Returns the last chunk's value."""
        n = out.nbytes
        flat = out.reshape(-1).view(np.uint8)
        v = 0
        for o in range(0, max(n, 1), STAGE):
            size = min(STAGE, n - o)
            cell: list[Lent] = []  # its pinned block: taken here when small, else on the submitter thread

            def take(size: int = size, cell: list[Lent] = cell) -> None:
                cell.append(self.staging.lend(max(size, 1)))

            def enqueue(o: int = o, size: int = size, cell: list[Lent] = cell) -> None:
                if size:
                    staged = cell[0]
                    at = buf.ptr + offset + o
                    if err := self.hot.here().dtoh(staged.block.ptr, at, size, self.stream_h):
                        raise DeviceError(f"D2H of {size} bytes ({err}): from {describe_pointer(at)} (of "
                                          f"{buf.nbytes}, {buf.device.name}) to {describe_pointer(staged.block.ptr)} "
                                          f"in {cu.cuCtxGetCurrent()}, device ctx {self.ctx}")

            def post(o: int = o, size: int = size, cell: list[Lent] = cell) -> None:
                flat[o:o + size] = cell[0].block.array[:size]  # on the waiter thread

            # a small read takes a block the pool has cached; pinning fresh memory takes milliseconds (1.2 ms for a
            # few bytes on an H200's host): never on the caller's (the loop's) thread, but the submitter's
            staged = self.staging.cached(max(size, 1)) if n <= SYNC_STAGE else None
            if staged is not None:
                cell.append(staged)
                v = self._submit(enqueue, waits if o == 0 else [], (buf, cell, out), post)
            else:
                v = self._submit(enqueue, waits if o == 0 else [], (buf, cell, out), post, host_wait=take)
        return v

    def write(self, buf: Buffer, host: np.ndarray) -> None:
        """Blocking write of raw bytes (worker threads)."""
        data = host.reshape(-1).view(np.uint8)[:buf.nbytes]
        v = self._upload(data.nbytes, lambda o, out: out.__setitem__(slice(None), data[o:o + out.nbytes]), buf, 0, [],
                         (buf, host), at_once=True)
        self.timeline.wait_sync(v)


def _wait_set(ev: threading.Event) -> None:
    ev.wait()

