"""Streaming a safetensors file onto a device: realized tensors one by one, with bounded read-ahead.

The file is read by the one load pipeline (azyx.loads: the disk's `loads`, which a plan's transfer out of a file
takes too): reader threads (never the event loop) read extents of up to `EXTENT` bytes in parallel, consecutive small
tensors sharing one `preadv`, a large tensor several extents. On a device whose memory is host memory (the C backend)
each extent lands straight in its tensors' pooled device buffers (no copy after the read). On another device (CUDA,
OpenCL, Vulkan, wgpu) each extent lands in a block of the device's ring of `RING` staging blocks (memory the device
writes from fastest: pinned on CUDA, pinned once at its start), and the device's queue copies it to the tensors'
buffers once it is read; the block is read into again once that copy is done. The loop's thread only books the reads
and copies (queued at once, each after its read); a tensor is handed out as soon as its bytes have landed (read, its
copies queued: its buffer ready at their value, as a plan's results are), in file order.

While you work on one tensor, the next ones are already being read, as long as the bytes read ahead fit in `prefetch`
(64 MiB by default); a tensor larger than that is read when you ask for it. So the memory the stream holds is at most
the tensor you are working on plus `prefetch`: drop each tensor when you are done with it (a loop variable keeps the
previous one alive until the next is assigned). A host device's pool keeps freed blocks for reuse by later tensors of
the same size; before it grows for the stream, the blocks it keeps of sizes no tensor left in the file has (the first,
largest tensor's, often) are given back, so the pool, too, stays within that bound.

`shard={pattern: (devices, axis)}` hands out the tensors whose names match a pattern (`fnmatch`) as
`azyx.shard.ShardedTensor`s: each device's slice read from the file (only its bytes) straight into its memory.
"""

from __future__ import annotations

import fnmatch
import os
import traceback
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

from azyx.allocator import bucket
from azyx.dtypes import dtypes
from azyx.errors import AzyxError, AzyxIOError, fresh_copy
from azyx.fileformat import TensorEntry
from azyx.files import DiskFile, FileRange
from azyx.graph import Node, Op, StridedView
from azyx.loads import Extent, Target
from azyx.memory import EXTENT, RING
from azyx.runtime import RT
from azyx.storage import disk_device, disk_node, header_of, open_safetensors
from azyx.tensor import Tensor
from azyx.workers import in_worker_thread

# the read pipeline's facts are azyx.memory's (EXTENT, RING: sized for a GPU host of about 16 cores; bench/io.py
# measures them); the read-ahead is the stream's. Two extents per reader thread (256 MiB on 16 cores, all 16 readers
# busy) read the H200 host's 2 GiB file 10-15% faster, but the loop's heartbeat went 4-7 -> 11-16 ms (16 readers'
# Python beside the loop's thread): kept at 64 MiB
PREFETCH = 64 << 20  # bytes of tensors read ahead of the one handed out, by default
__all__ = ["EXTENT", "PREFETCH", "RING", "SafetensorsStream", "stream_safetensors"]


def stream_safetensors(path: Any, device: str | None = None, *, prefetch: int = PREFETCH, progress: bool = False,
                       shard: Mapping[str, tuple[Sequence[str], int]] | None = None,
                       direct_io: bool = False) -> SafetensorsStream:
    """Realized tensors of a safetensors file, one by one in file order, as `(name, tensor)` on `device` (None:
    AUTO). The next tensors are read while you use the current one (up to `prefetch` bytes ahead); `progress=True`
    shows a tqdm bar (pip install tqdm). `shard` maps name patterns (`fnmatch`: "h.*.attn.c_attn.weight") to
    `(devices, axis)`: a tensor whose name matches the first such pattern comes split along `axis` over `devices`
    (a ShardedTensor, as `Tensor.shard` makes), each device's slice read from the file once, straight to it.
    `direct_io=True` reads with O_DIRECT, past the page cache (for a cold file on fast storage, where that is faster;
    bench/io.py measures it), through aligned blocks; where the filesystem refuses O_DIRECT, the usual way.

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
    plan: list[tuple[str, list[str], int]] = []
    for pattern, spec in (shard or {}).items():
        if not isinstance(pattern, str) or not isinstance(spec, tuple) or len(spec) != 2 or \
                not isinstance(spec[1], int) or isinstance(spec[0], str) or not list(spec[0]):
            raise AzyxIOError(f"shard maps a name pattern to (devices, axis), got {pattern!r}: {spec!r}")
        plan.append((pattern, [RT.check_device(d) for d in spec[0]], spec[1]))
    stream = SafetensorsStream(path, name, prefetch, progress, plan)
    stream.direct_io = bool(direct_io)
    return stream


class _Slot(Target):
    """A tensor being read: its entry, its extents (`loads.Extent`, maybe shared with its neighbours), whether it is
    widened (bfloat16 to float32) or sharded; its buffer, readiness and error are its `Target`'s."""

    __slots__ = ("entry", "extents", "widen", "sharded")

    def __init__(self, entry: TensorEntry, widen: bool = False, sharded: bool = False) -> None:
        super().__init__(None, entry.nbytes * (2 if widen else 1))
        self.entry, self.widen, self.sharded = entry, widen, sharded
        self.extents: list[Extent] = []


class SafetensorsStream:
    """The async iterator of `stream_safetensors` (also an async context manager that closes it)."""

    def __init__(self, path: Any, device: str | None, prefetch: int, progress: bool,
                 shard: list[tuple[str, list[str], int]] | None = None):
        self.path, self.device, self.prefetch = path, device, prefetch
        self.shard = shard or []
        self.pinned = device is not None
        self.dev = RT.device("host:0")  # (chosen in `_open`)
        self.direct = True  # reads land in the device's memory (host memory); else in its ring's staging blocks
        self.direct_io = False  # O_DIRECT reads (`stream_safetensors`)
        self.widen_bf16 = False
        self.want_progress = progress
        self.bar: Any = None
        self.file: DiskFile | None = None
        self.entries: list[TensorEntry] = []
        self.next = 0  # index of the next entry to start reading
        self.last_use: dict[int, int] = {}  # a host device's pooled block size -> the last entry that takes one
        self.ahead: deque[_Slot] = deque()  # started, not yet handed out (file order)
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

    async def __anext__(self) -> tuple[str, Any]:
        if self.closed:
            raise StopAsyncIteration
        if self.file is None:
            await self._open()
        if not self.ahead:
            if self.next >= len(self.entries):
                await self.aclose()
                raise StopAsyncIteration
            await self._reserve(self.next + 1)
            self._start(self.prefetch, first=True)  # asked for: read it now, whatever its size
        slot = self.ahead[0]
        try:
            t: Any
            if slot.sharded:  # each device's slice, straight from the file
                t = await self._sharded(slot.entry)
            else:
                t = await self._landed(slot)
            await self._reserve(self._fits(self.ahead_bytes - slot.entry.nbytes))  # (cancelled: the slot stays first)
        except AzyxError as e:
            slot.buf, slot.extents = None, []  # (the error's traceback holds the slot: not its memory)
            traceback.clear_frames(e.__traceback__)  # nor the reader's frame (its buffers), kept by whoever keeps e
            await self.aclose()
            raise
        self.ahead.popleft()
        slot.buf, slot.extents = None, []  # (its extents may be shared with the next slots: they hold it a while)
        self.ahead_bytes -= slot.entry.nbytes
        self._start(self.prefetch)
        if self.bar is not None:
            self.bar.update(slot.entry.nbytes)
        return slot.entry.name, t

    async def aclose(self) -> None:
        """Stop: the reads already started (at most `prefetch` bytes) finish on their threads and their copies on the
        device, then free their buffers (`azyx.synchronize()` waits for them)."""
        self.closed = True
        self.ahead.clear()
        self.ahead_bytes = 0
        self.file = None
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    async def _open(self) -> None:
        # the device's backend probed off the loop (AUTO's backends for None), then the device chosen
        kinds = {d.partition(":")[0] for _, devs, _ in self.shard for d in devs}
        await RT.startup(RT.auto_kinds() if self.device is None else [self.device.partition(":")[0], *kinds])
        name = self.device if self.device is not None else RT.resolve_device(None, 0)[0]
        self.dev = dev = RT.device(name)
        if dev.storage:
            raise AzyxIOError(f"stream_safetensors needs a compute device, got {self.device!r}")
        self.direct = dev.host_memory
        self.widen_bf16 = dev.dialect is None or "bfloat16" not in dev.dialect.types
        self.file = await in_worker_thread(open_safetensors, self.path)
        self.entries = list(header_of(self.file).tensors.values())
        self.last_use = {bucket(max(self._nbytes(e), 1)): i for i, e in enumerate(self.entries)
                         if self._sharding(e.name) is None}
        if self.want_progress:
            from tqdm import tqdm

            total = sum(e.nbytes for e in self.entries)
            self.bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024,
                            desc=os.path.basename(self.file.path))
        if not self.direct:  # (its staging blocks taken off the loop: made, mapped or pinned where the pool lacks them)
            await in_worker_thread(dev.mem.ring().fill)
        await self._reserve(self._fits(0))
        self._start(self.prefetch)

    def _sharding(self, name: str) -> tuple[list[str], int] | None:
        return next(((devs, axis) for pattern, devs, axis in self.shard if fnmatch.fnmatchcase(name, pattern)), None)

    def _widens(self, entry: TensorEntry) -> bool:
        return self.widen_bf16 and entry.dtype is dtypes.bfloat16

    def _nbytes(self, entry: TensorEntry) -> int:
        """The bytes of the entry's buffer on the device (bfloat16 widened: twice the file's)."""
        return entry.nbytes * (2 if self._widens(entry) else 1)

    def _fits(self, ahead: int, budget: int | None = None) -> int:
        """The index past the entries that `_start` would start with `ahead` bytes read ahead (of `budget`: the
        prefetch)."""
        i = self.next
        budget = self.prefetch if budget is None else budget
        while i < len(self.entries) and ahead + self.entries[i].nbytes <= budget:
            ahead += self.entries[i].nbytes
            i += 1
        return i

    async def _reserve(self, end: int) -> None:
        """The buffers of the entries up to `end` that `_start` will make on the loop's thread (a staged device's: its
        copies are queued there), made first on a worker thread where the device's pool lacks them and making them
        is slow (`Device.reserve_min`: a driver's allocation, which waits on its locks: CUDA's cuMemAlloc, wgpu's
        create_buffer)."""
        dev = self.dev
        if self.direct or not dev.reserve_min:
            return
        sizes = [self._nbytes(e) for e in self.entries[self.next:end] if self._sharding(e.name) is None]
        # (made first where the pool's cache lacks them: blocks of other sizes there do not count, or another load
        # that had filled the cache left these to be made on the loop)
        missing = dev.allocator.uncached([n for n in sizes if n >= dev.reserve_min])
        if missing:
            try:
                await in_worker_thread(dev.reserve, missing)
            except AzyxError:  # (one that does not fit raises when its tensor is asked for: its neighbours load)
                pass

    def _start(self, budget: int, first: bool = False) -> None:
        """Start reading the next entries while the bytes ahead fit in `budget` (the next one whatever its size when
        `first`: it is asked for), in extents: consecutive entries share one up to EXTENT bytes; a larger entry is
        several (`Loads.load` reads them)."""
        assert self.file is not None
        data_start = header_of(self.file).data_start
        extents: list[Extent] = []
        end = min(len(self.entries), max(self._fits(self.ahead_bytes, budget), self.next + first))
        drop = self._trim(self.next, end) if self.direct else []
        cur: Extent | None = None
        while self.next < end:
            entry = self.entries[self.next]
            self.next += 1
            self.ahead_bytes += entry.nbytes
            if self._sharding(entry.name) is not None:
                self.ahead.append(_Slot(entry, sharded=True))
                cur = None
                continue
            widen = self._widens(entry)
            slot = _Slot(entry, widen)
            slot.drop = drop
            self.ahead.append(slot)
            if not self.dev.alloc_anywhere:  # (else its first read allocates it, on a reader thread; staged: `load`,
                # which queues its copies, from the pool's cache, reserved first)
                slot.allocate(self.dev)
            done = 0
            while done < entry.nbytes or not slot.extents:
                if cur is None or widen or cur.start + cur.nbytes != entry.begin + done or cur.nbytes >= EXTENT:
                    cur = Extent(FileRange(self.file, data_start, f"tensor {entry.name!r}"), entry.begin + done,
                                 widen, self.direct_io)
                    extents.append(cur)
                # (widened in place, on a host device, whole; staged, in pieces whose widened bytes fill a block)
                n = (entry.nbytes - done if self.direct else min(entry.nbytes - done, EXTENT // 2)) if widen else \
                    min(entry.nbytes - done, EXTENT - cur.nbytes)
                cur.parts.append((slot, done, n))
                cur.nbytes += n
                slot.extents.append(cur)
                done += n
            if widen:
                cur = None
        disk_device().loads.load(self.dev, extents)

    def _trim(self, begin: int, end: int) -> list[Any]:
        """(A host device, before the buffers of entries `begin` to `end` are made.) Where the device's pool has no
        cached block for one of them, take out of it the cached blocks that no entry left in the file would reuse (a
        tensor's block the consumer dropped, of a size no later tensor has: the first, largest one, often), for the
        new buffers to free before they are made (`Target.drop`): the pool grows for the stream only by what it holds
        ahead and the tensor in use, so the host memory of a stream stays within `prefetch` + the largest tensor.
        Blocks of sizes still to come stay cached (the next tensors reuse them)."""
        pool = self.dev.allocator
        if not pool.cached:
            return []
        sizes: dict[int, int] = {}
        for entry in self.entries[begin:end]:
            if self._sharding(entry.name) is None:
                b = bucket(max(self._nbytes(entry), 1))
                sizes[b] = sizes.get(b, 0) + 1
        if all(len(pool.cached_blocks(b)) >= k for b, k in sizes.items()):
            return []  # (the pool does not grow)
        kept = {id(m) for b, last in self.last_use.items() if last >= begin for m in pool.cached_blocks(b)}
        return pool.take_cached(keep=lambda m: id(m) in kept)

    async def _landed(self, slot: _Slot) -> Tensor:
        """The slot's tensor once its extents are read (their copies queued: its buffer ready at their value, like a
        plan's results; the device orders work on it after them, a read waits for them)."""
        disk = disk_device()
        await disk.timeline.wait(max(ext.value for ext in slot.extents))  # (cancelled: the slot stays first)
        if slot.error is not None:  # raised when this tensor is asked for, not while another is being used
            raise slot.error
        for ext in slot.extents:
            for v in (ext.value, *ext.values):
                if (err := disk.failure_in(v - 1, v)) is not None:
                    raise fresh_copy(err)
        assert slot.buf is not None
        slot.buf.ready = slot.ready
        return self._leaf(slot)

    def _leaf(self, slot: _Slot) -> Tensor:
        entry, buf = slot.entry, slot.buf
        assert buf is not None
        dtype = dtypes.float32 if slot.widen else entry.dtype
        node = Node(Op.LEAF, (), None, entry.shape, dtype, self.dev.name, self.pinned)
        node.buffer, node.view = buf, StridedView.contiguous(entry.shape)
        return Tensor._from_node(node)

    async def _sharded(self, entry: TensorEntry) -> Any:
        """A sharded entry: its slices (each device's bytes only, see azyx.storage) realized on their devices."""
        assert self.file is not None
        rule = self._sharding(entry.name)
        assert rule is not None
        devices, axis = rule
        whole = Tensor._from_node(disk_node(self.file, entry))
        return await whole.shard(devices, axis).realize()
