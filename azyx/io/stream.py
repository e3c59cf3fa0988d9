"""Streaming a safetensors file onto a device: realized tensors one by one, with bounded read-ahead.

The file is read by several worker threads (positional reads, never on the event loop) in extents of up to `EXTENT`
bytes: consecutive small tensors share one `preadv`, a large tensor is several extents read in parallel. On a device
whose memory is host memory (the C backend) each extent lands straight in its tensors' pooled device buffers (no copy
after the read). On another device (CUDA, OpenCL, Vulkan, wgpu) each extent lands in a block of the stream's ring of
`RING` staging blocks, memory the device writes from fastest (`Device.staging_block`: pinned on CUDA, allocated and
pinned on a worker thread, once), and is copied to the tensors' device buffers as soon as the stream sees it landed
(whenever the loop wakes for any read), while the next extents are being read into the other blocks; a block is read
into again once its copy is done (the loop waits for that only when every block's copy is under way). A tensor larger
than the ring streams through it. A tensor is handed out as soon as all its bytes have landed (staged: are read and
their copies queued, its buffer ready at their value, as a plan's results are), in file order.

While you work on one tensor, the next ones are already being read, as long as the bytes read ahead fit in `prefetch`
(64 MiB by default); a tensor larger than that is read when you ask for it. So the memory the stream holds is at most
the tensor you are working on plus `prefetch`: drop each tensor when you are done with it (a loop variable keeps the
previous one alive until the next is assigned). A host device's pool keeps freed blocks for reuse; that memory is the
pool's (reused by later tensors of the same size), not the stream's.

`shard={pattern: (devices, axis)}` hands out the tensors whose names match a pattern (`fnmatch`) as
`azyx.shard.ShardedTensor`s: each device's slice read from the file (only its bytes) straight into its memory.
"""

from __future__ import annotations

import concurrent.futures
import fnmatch
import os
import threading
import traceback
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from azyx.backends.disk import DIRECT_ALIGN, DiskFile, direct_block, direct_span
from azyx.device import Buffer, Device
from azyx.dtypes import dtypes
from azyx.errors import AzyxError, AzyxIOError
from azyx.fileformat import TensorEntry
from azyx.graph import Node, Op, StridedView
from azyx.runtime import RT
from azyx.storage import disk_device, disk_node, header_of, open_safetensors
from azyx.tensor import Tensor
from azyx.workers import in_worker_thread, result_of, start_in_worker_thread

# The read pipeline's facts, sized for a GPU host of about 16 cores (bench/io.py measures them); nothing else sizes it.
PREFETCH = 64 << 20  # bytes of tensors read ahead of the one handed out, by default
EXTENT = 8 << 20  # bytes per read: consecutive smaller tensors share one, a larger tensor is read in several. A read
# from the page cache runs at ~5 GB/s per thread, so one takes ~1.6 ms: long against what each costs the loop (a
# wake-up, the copy's submission: tens of microseconds), short against a file of gigabytes
RING = 8  # staging blocks of a staged device's stream (read into, copied from, reused in turn once their copy is
# done): at most this many reads in flight (each on a worker thread: one per core), RING * EXTENT bytes of host memory
# (pinned on CUDA, on worker threads, once per process: the staging pool keeps them), whatever the tensors' sizes
BLOCK = EXTENT + 2 * DIRECT_ALIGN  # a ring block's bytes (room for an O_DIRECT read's aligned ends)


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


class _Extent:
    """One read: `nbytes` bytes of the file from `offset`, landing in `parts` (slot, byte offset in its tensor,
    length), in file order; `job` the read on a reader thread: its result None (read into the tensors' own memory)
    or the (staging array, what keeps it) it was read into."""

    __slots__ = ("offset", "nbytes", "parts", "job", "copied")

    def __init__(self, offset: int) -> None:
        self.offset, self.nbytes = offset, 0
        self.parts: list[tuple[_Slot, int, int]] = []
        self.job: concurrent.futures.Future[Any] | None = None
        self.copied = False


class _Slot:
    """A tensor being read: its entry, its destination buffer, its extents, and (staged) the device timeline value its
    copies reach."""

    __slots__ = ("entry", "buf", "extents", "ready", "widen", "sharded", "error", "lock")

    def __init__(self, entry: TensorEntry, widen: bool = False, sharded: bool = False) -> None:
        self.entry, self.widen, self.sharded = entry, widen, sharded
        self.buf: Buffer | None = None
        self.error: BaseException | None = None  # its buffer or a read failed (raised when it is asked for)
        self.lock = threading.Lock()  # (its extents may be read at once: the first allocates its buffer)
        self.extents: list[_Extent] = []
        self.ready = 0

    def allocate(self, dev: Device) -> Buffer | None:
        """Its buffer on `dev`, allocated by the first caller (a reader thread where the device allows it: off the
        loop); None (and `error` set) where that failed."""
        with self.lock:
            if self.buf is None and self.error is None:
                try:
                    self.buf = dev.alloc(max(self.entry.nbytes * (2 if self.widen else 1), 1))
                except AzyxError as e:
                    self.error = e
            return self.buf


class SafetensorsStream:
    """The async iterator of `stream_safetensors` (also an async context manager that closes it)."""

    def __init__(self, path: Any, device: str | None, prefetch: int, progress: bool,
                 shard: list[tuple[str, list[str], int]] | None = None):
        self.path, self.device, self.prefetch = path, device, prefetch
        self.shard = shard or []
        self.pinned = device is not None
        self.dev = RT.device("host:0")  # (chosen in `_open`)
        self.direct = True  # reads land in the device's memory (host memory); else in staging blocks
        self.direct_io = False  # O_DIRECT reads (`stream_safetensors`)
        self.widen_bf16 = False
        self.want_progress = progress
        self.bar: Any = None
        self.file: DiskFile | None = None
        self.entries: list[TensorEntry] = []
        self.next = 0  # index of the next entry to start reading
        self.ahead: deque[_Slot] = deque()  # started, not yet handed out (file order)
        self.queued: deque[_Extent] = deque()  # staged reads waiting for a ring block (file order)
        self.reading: deque[_Extent] = deque()  # staged reads whose copies are not issued yet (file order)
        self.ring: list[tuple[np.ndarray, Any, int]] = []  # free staging blocks: (memory, keep, its last copy's value)
        self.blocks = 0  # ring blocks made so far (at most `ring_size`)
        self.ring_size = max(1, min(RING, prefetch // EXTENT))
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
            self._start(self.prefetch, first=True)  # asked for: read it now, whatever its size
        slot = self.ahead[0]
        try:
            t: Any
            if slot.sharded:  # each device's slice, straight from the file
                t = await self._sharded(slot.entry)
            elif self.direct:
                for ext in slot.extents:
                    assert ext.job is not None
                    await result_of(ext.job)  # cancelled here: the slot stays first, the next call waits again
                if slot.error is not None:  # raised when this tensor is asked for, not while another is being used
                    raise slot.error
                t = self._leaf(slot)
            else:
                t = await self._staged(slot)
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
        """Stop: the reads already started (at most `prefetch` bytes) finish on their threads, then free their
        buffers (`azyx.synchronize()` waits for them)."""
        self.closed = True
        self.ahead.clear()
        self.queued.clear()
        self.reading.clear()
        self.ring.clear()
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
        if self.want_progress:
            from tqdm import tqdm

            total = sum(e.nbytes for e in self.entries)
            self.bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024,
                            desc=os.path.basename(self.file.path))
        self._start(self.prefetch)

    def _sharding(self, name: str) -> tuple[list[str], int] | None:
        return next(((devs, axis) for pattern, devs, axis in self.shard if fnmatch.fnmatchcase(name, pattern)), None)

    def _start(self, budget: int, first: bool = False) -> None:
        """Start reading the next entries while the bytes ahead fit in `budget` (the next one whatever its size when
        `first`: it is asked for), in extents: consecutive entries share one up to EXTENT bytes; a larger entry is
        several."""
        assert self.file is not None
        data_start = header_of(self.file).data_start
        extents: list[_Extent] = []
        cur: _Extent | None = None
        while self.next < len(self.entries):
            entry = self.entries[self.next]
            if self.ahead_bytes + entry.nbytes > budget and not first:
                break
            first = False
            self.next += 1
            self.ahead_bytes += entry.nbytes
            if self._sharding(entry.name) is not None:
                self.ahead.append(_Slot(entry, sharded=True))
                cur = None
                continue
            widen = self.widen_bf16 and entry.dtype is dtypes.bfloat16
            slot = _Slot(entry, widen)
            self.ahead.append(slot)
            if not self.dev.alloc_anywhere:  # (else the slot's first read allocates it, on a worker thread)
                slot.allocate(self.dev)
            at = data_start + entry.begin
            done = 0
            while done < entry.nbytes or not slot.extents:
                if cur is None or widen or cur.offset + cur.nbytes != at + done or cur.nbytes >= EXTENT:
                    cur = _Extent(at + done)
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
        if not self.direct:
            self.queued.extend(extents)
            self._pump()
            return
        for ext in extents:
            ext.job = start_in_worker_thread(_read_extent, [(self.file, ext, self.dev, self.direct_io)])

    def _pump(self) -> None:
        """Staged: start the queued reads that a ring block is free for (its copy done; a new block while the ring is
        not full: made on the reader thread)."""
        while self.queued:
            reached = self.dev.timeline.value
            free = next((i for i, (_, _, last) in enumerate(self.ring) if last <= reached), None)
            if free is None and self.blocks >= self.ring_size:
                return
            if free is None:
                self.blocks += 1
            block = self.ring.pop(free)[:2] if free is not None else None
            ext = self.queued.popleft()
            ext.job = start_in_worker_thread(_read_staged, [(self.file, ext, self.dev, block, self.direct_io)])
            self.reading.append(ext)

    def _copy_landed(self) -> None:
        """Staged: issue the device copies of every extent read so far (in file order), each from its ring block, which
        goes back to the ring (read into again once the copy is done)."""
        while self.reading and self.reading[0].job is not None and self.reading[0].job.done():
            ext = self.reading.popleft()
            assert ext.job is not None
            ext.copied = True
            if (err := ext.job.exception()) is not None:
                self.blocks -= 1  # (its block went with the failed read)
                for slot, _, _ in ext.parts:  # raised to whoever asks for its tensors
                    slot.error = slot.error or err
                continue
            mem, landed, keep = ext.job.result()
            last, at = 0, 0
            for slot, into, n in ext.parts:
                size = 2 * n if slot.widen else n
                if slot.buf is not None:  # (else its allocation failed: raised when it is asked for)
                    v = self.dev.copy_from_host(landed[at : at + size], slot.buf, [], keep,
                                                2 * into if slot.widen else into)
                    slot.ready = last = max(slot.ready, v)
                at += size
            self.ring.append((mem, keep, last))
            self.dev.timeline.on_reach(last, _nothing)  # (a device that notices completion lazily watches it now)

    async def _staged(self, slot: _Slot) -> Tensor:
        """Staged: the slot's tensor once all its extents are read and their copies queued; meanwhile each wake-up (a
        read landing) issues the copies of what landed and starts reads into the blocks they free."""
        while True:
            self._copy_landed()
            self._pump()
            if all(ext.copied for ext in slot.extents):
                break
            if not self.reading:  # every block's copy is under way: the first done frees one
                await self.dev.timeline.wait(min(last for _, _, last in self.ring))
                continue
            job = self.reading[0].job  # (the slot's extents not copied yet are read or queued behind it)
            assert job is not None
            try:
                await result_of(job)  # cancelled here: the slot stays first, the next call waits again
            except Exception:  # noqa: S112  (the read's error is its tensors': `_copy_landed` records it)
                continue
        if slot.error is not None:
            raise slot.error
        assert slot.buf is not None
        # handed out with its copies queued, not done: like a plan's results, the buffer is ready at their value (the
        # device orders work on it after them; a read waits for them), and the loop goes on issuing the next copies
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


def _read_extent(job: list[tuple[DiskFile, _Extent, Device, bool]]) -> None:
    """On a worker thread: one extent straight into its tensors' buffers on a host device; bfloat16 widened for
    devices without it. `direct_io`: read with O_DIRECT, through this thread's aligned block, where the filesystem
    allows it."""
    file, ext, dev, direct_io = job.pop()
    widen = ext.parts[0][0].widen
    bufs = [slot.allocate(dev) for slot, _, _ in ext.parts]  # (where not allocated on the loop already)
    outs = [buf.mem.reshape(-1).view(np.uint8)[into : into + n].data if buf is not None else
            memoryview(bytearray(n)) for buf, (_, into, n) in zip(bufs, ext.parts)]  # (bytes of a failed one)
    bounce = _bounce(direct_span(ext.offset, ext.nbytes)) if direct_io and not widen else None
    disk_device().read_extent(file, ext.offset, outs, _what(ext), bounce)
    if widen and bufs[0] is not None:
        _widen(bufs[0].mem.reshape(-1).view(np.uint8), ext.nbytes)


def _read_staged(job: list[tuple[DiskFile, _Extent, Device, tuple[np.ndarray, Any] | None, bool]]
                 ) -> tuple[np.ndarray, np.ndarray, Any]:
    """On a worker thread: one extent into a ring block (`block`: its memory and keep, its last copy done; None: a new
    block of the device's staging pool, pinned here on CUDA); returns the block's memory, the part of it the bytes
    landed in, and its keep. bfloat16 widened for devices without it. `direct_io`: read with O_DIRECT straight into
    the block (its aligned part), where the filesystem allows it."""
    file, ext, dev, block, direct_io = job.pop()
    for slot, _, _ in ext.parts:  # (where not allocated on the loop already)
        slot.allocate(dev)
    mem, keep = dev.staging_block(BLOCK) if block is None else block
    widen = ext.parts[0][0].widen
    assert ext.nbytes * (2 if widen else 1) <= EXTENT, "an extent larger than a ring block"
    if direct_io and not widen:
        aligned = mem[(-mem.ctypes.data) % DIRECT_ALIGN :]
        if aligned.nbytes >= direct_span(ext.offset, ext.nbytes):
            got = disk_device().read_direct(file, ext.offset, ext.nbytes, aligned, _what(ext))
            if got is not None:
                return mem, got, keep
    disk_device().read_extent(file, ext.offset, [mem[: ext.nbytes].data], _what(ext))
    if widen:
        _widen(mem, ext.nbytes)
    return mem, mem[: ext.nbytes * (2 if widen else 1)], keep


def _nothing() -> None:
    pass


def _what(ext: _Extent) -> str:
    return f"tensor {ext.parts[0][0].entry.name!r}"


_bounces = threading.local()


def _bounce(span: int) -> np.ndarray:
    """This worker thread's aligned block for O_DIRECT reads into host devices' memory (kept: faulted in once)."""
    block: np.ndarray | None = getattr(_bounces, "block", None)
    if block is None or block.nbytes < span:
        block = _bounces.block = direct_block(max(span, EXTENT + 2 * DIRECT_ALIGN))
    return block


def _widen(mem: np.ndarray, n: int) -> None:
    """bfloat16 (the first `n` bytes) widened in place to float32 (2n bytes): bfloat16 is a float32's upper half."""
    mem[: 2 * n].view(np.uint32)[:] = mem[:n].view(np.uint16).astype(np.uint32) << 16
