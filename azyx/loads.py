"""Loads: extents of files read into any device's memory by a pool of reader threads, the one pipeline of a stream
(azyx.io.stream) and of a plan's transfers out of files (the disk device's `send`).

A load is extents of up to EXTENT bytes (a plan's transfer into host memory: HOST_EXTENT) read in parallel, straight
into the destination's memory when that is host memory, else into the blocks of the destination's ring of staging
memory (pinned on CUDA), each copied to the device by its queue once read and read into again once that copy is done;
the thread that runs the plan only numbers the reads (one step per load) and queues the staged copies (the loop's, or
for a run of many such copies a worker's: `UnifiedExecutor.runs_long`), a reader thread (the booker, `_start_booked`)
starts the reads. The reads are numbered on the timeline of the device the pipeline is a part of (`Loads.source`: the
disk), which reaches a read's value once it and every earlier read are done; the destination's queue waits for that,
as for any other source device. Every byte read is counted by that device (`Loads.count`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np

from azyx import workers
from azyx.device import Buffer, Device
from azyx.errors import AzyxError
from azyx.files import DIRECT_ALIGN, FileRange, direct_block
from azyx.memory import EXTENT
from azyx.native import native

DIRECT_PIECE = (1 << 20) + DIRECT_ALIGN  # a reader thread's O_DIRECT block for reads into host memory (kept)
# a plan's transfer out of a file into host memory (the lazy path onto c) reads up to HOST_EXTENT bytes at a time (no
# staging block to fit): a read's Python on the reader threads (and the GIL) is paid half as often as with EXTENT (1 GiB
# onto c:0, second loads, 2-core AMD EPYC: user CPU 33 -> 22 ms per GiB, context switches 320 -> 200 at load ~200;
# bench/io.py, 6 alternated runs at load 9-45: 0.256 -> 0.215 CPU s per GB). A stream keeps EXTENT: with 16 MiB reads
# and a 128 MiB read-ahead its first load took 0.27 -> 0.37 CPU s per GB and its second was no faster
HOST_EXTENT = 2 * EXTENT
SPLIT = 8 << 20  # a read of at least twice this is split across threads: faulting fresh memory in is the slow part
SMALL = EXTENT // 8  # a read of at most this joins its neighbour's, whatever that one's size (`Loads._join`)
# reader threads: one per core but the loop's (a read from the page cache keeps a core busy; with one per core the
# loop's thread waited for a core: 16-core Xeon, 2 GiB onto c:0, lazy first load's heartbeat 5.3-8.6 -> 3.6-4.6 ms,
# 0.75-0.81x -> 0.91-1.02x of parallel preadv). A 2-core machine keeps 4 (below the loop's priority: `_reader_pool`)
READERS = max(4, (os.cpu_count() or 2) - 1)
_readers: list[concurrent.futures.ThreadPoolExecutor] = []
_readers_lock = threading.Lock()


def _reader_pool() -> concurrent.futures.ThreadPoolExecutor:
    """Threads that only read file ranges into memory (they never wait on anything, so splitting cannot deadlock),
    every one started at once (`workers.started_pool`: by the runtime's start-up, `start_readers`). Where the native
    core reads (`files.FileRange.read_views`: the GIL released from a read's first check to its last) they run below
    the loop's priority (`workers.lower_priority`): reading a file from the page cache is a copy that keeps a core busy,
    and on a machine with as many readers as cores, readers of the loop's priority kept its thread waiting for a core
    for 5-15 ms at a time (2 cores, 4 readers). Python reads hold the GIL between their system calls: those readers keep
    the loop's priority (see `workers._executor`)."""
    with _readers_lock:
        if not _readers:
            _readers.append(workers.started_pool(READERS, "azyx-disk",
                                                 workers.lower_priority if native is not None else None))
        return _readers[0]


start_readers = _reader_pool  # (the runtime's start-up: every reader thread started off the event loop)


class Target:
    """Where a load's bytes land: a buffer of the destination device (`buf`, or made by `allocate`'s first caller: a
    reader thread where the device allows it), the timeline value its copies reach (`ready`; 0: read straight into
    host memory), and `error`, set where its buffer could not be had (its bytes are then read and dropped). `drop`:
    blocks of the device's pool let go just before its buffer is made (shared with the other targets of a load: the
    first to allocate frees them), so that the memory they held is there for it."""

    __slots__ = ("buf", "nbytes", "ready", "error", "lock", "drop")

    def __init__(self, buf: Buffer | None = None, nbytes: int = 0):
        self.buf, self.nbytes = buf, nbytes
        self.ready = 0
        self.error: BaseException | None = None
        self.lock = threading.Lock()  # (several extents of one target may be read at once: the first allocates)
        self.drop: list[Any] = []

    def allocate(self, dev: Device) -> Buffer | None:
        """Its buffer on `dev` (`nbytes`), allocated by the first caller; None (and `error` set) where that failed."""
        with self.lock:
            if self.buf is None and self.error is None:
                self.drop.clear()
                try:
                    self.buf = dev.alloc(max(self.nbytes, 1))
                except AzyxError as e:
                    self.error = e
            return self.buf


class Extent:
    """One read of a load (`Loads.load`): `nbytes` bytes of `source` from byte `start` of it, landing in `parts`
    (target, byte offset in its buffer, bytes) one after the other. `widen`: bfloat16 widened to float32 on the way (a
    target's bytes are twice the read's; one part). `direct`: read with O_DIRECT where the filesystem allows it. Set
    by `load`: `value`, the source's timeline value its read reaches (its failure recorded there)."""

    __slots__ = ("source", "start", "nbytes", "parts", "widen", "direct", "value", "values")

    def __init__(self, source: FileRange, start: int, widen: bool = False, direct: bool = False):
        self.source, self.start, self.nbytes = source, start, 0
        self.parts: list[tuple[Target, int, int]] = []
        self.widen, self.direct = widen, direct
        self.value = 0
        self.values: list[int] = []  # (the values of later extents joined to this read: `Loads.load`)


class Loads:
    """The load pipeline of a device that reads files (`source`: the disk; a part of it): `load` reads extents into
    any device's memory, `send` is a plan's transfer of a file range, `read_range` and `read_split` a blocking read of
    one. `count(n)`: the source's account of one read of `n` bytes."""

    def __init__(self, source: Device, count: Callable[[int], None]):
        self.source, self.count = source, count
        self.lock = threading.Lock()
        self.submitted = 0  # the timeline value of the last read booked by `load`
        self.unread: dict[int, int] = {}  # timeline value -> pieces of its read not done yet (in value order)
        self.joinable: tuple[Extent, Device] | None = None  # the last read into host memory no reader took yet (`load`)
        self.booked: list[tuple[Extent, Device, np.ndarray | None, int, int]] = []  # reads to start (`_book`)
        self.booking = False  # whether a reader thread is starting them

    def send(self, src: Buffer, dst: Buffer, n: int) -> int:
        """A plan's transfer of `n` bytes of a file range (`src`, the source's buffer) into `dst` (any other device):
        `load`ed in extents of EXTENT bytes (HOST_EXTENT into host memory), read in parallel, off the loop. Returns the
        destination's value at which dst is written: its copies' (through its ring), or, read straight into host
        memory, its queue's hold until the reads are done."""
        ddev, rng = dst.device, src.mem
        target = Target(dst)
        extents = []
        step = HOST_EXTENT if ddev.host_memory else EXTENT
        for o in range(0, max(n, 1), step):
            ext = Extent(rng, o)
            ext.nbytes = min(step, n - o)
            ext.parts.append((target, o, ext.nbytes))
            extents.append(ext)
        self.load(ddev, extents)
        if ddev.host_memory:
            return ddev.hold([(self.source, extents[-1].value)], (src, dst))
        return target.ready

    def load(self, dev: Device, extents: list[Extent]) -> None:
        """Read `extents` (each at most EXTENT bytes, a plan's transfer's HOST_EXTENT into host memory; a widened one at
        most EXTENT // 2) into their targets on `dev`, on the reader threads, in parallel; this (the loop's thread,
        often) numbers them in one step, queues their copies where staged, and hands them to the booker (`_book`), which
        starts them. Into host memory (`dev`'s buffers, or a failed target's scratch), straight: a read of the bytes
        right after a read no reader has taken yet joins it where one of them is small (`_join`: one `preadv`). Else
        each through the next block of `dev`'s ring (`mem.ring`): read once the block's last copy is done, then copied
        into its targets by `dev`'s queue (`copy_from_host`, queued now, after the read on the source's timeline: a
        target's `ready`), so a load holds at most the ring's blocks. Each extent's `value`: the source's timeline value
        its read reaches (where its failure is recorded: a run covering the source's values raises it, a stream asks
        `failure_in`)."""
        ring = None if dev.host_memory else dev.mem.ring()
        with self.lock:  # (their values, in one step)
            for ext in extents:
                self.submitted += 1
                ext.value = self.submitted
                self.unread[ext.value] = 1
        if ring is None:
            return self._book([(ext, dev, None, 0, 0) for ext in extents])
        last, booked = 0, list[tuple[Extent, Device, np.ndarray | None, int, int]]()
        for ext in extents:
            bufs = [target.allocate(dev) for target, _, _ in ext.parts]  # (None: its error is raised when asked for)
            if all(buf is None for buf in bufs):  # nothing to read it for
                self._piece_done(ext.value, None)
                continue
            i, mem, keep, after = ring.take()
            rng = ext.source
            at = (-mem.ctypes.data) % DIRECT_ALIGN + (rng.offset + ext.start) % DIRECT_ALIGN if \
                ext.direct and not ext.widen and rng.runs is None else 0  # (where an O_DIRECT read lands)
            booked.append((ext, dev, mem, at, after))
            for (target, into, n), buf in zip(ext.parts, bufs):
                size = 2 * n if ext.widen else n
                if buf is not None:
                    last = dev.copy_from_host(mem[at : at + size], buf, [(self.source, ext.value)], keep,
                                              2 * into if ext.widen else into)
                    target.ready = max(target.ready, last)
                at += size
            ring.used(i, last)  # (the block is read into again once its copies are done)
        self._book(booked)
        if last:
            ring.give_back_after(last)

    def _book(self, reads: list[tuple[Extent, Device, np.ndarray | None, int, int]]) -> None:
        """Hand `reads` (extent, device, staging block or None, where in it, the device's value to read after) to the
        booker, a reader thread that starts them (`_start_booked`): the caller (the loop's thread, often) takes the
        lock once and wakes a thread at most once per batch, however many extents a load has. On an asyncio loop's
        thread the booker is woken once the loop's current step is over: a plan's run queues all its loads first. Woken
        at once, the readers' Python between their reads took the GIL from the loop's thread while it was still
        queueing the plan's copies (cuda:0, 128 tensors of 16 MiB: the realize's step 11.8-32.5 ms, then 8.3-11.4)."""
        with self.lock:
            self.booked.extend(reads)
            if self.booking or not reads:
                return
            self.booking = True
        try:
            asyncio.get_running_loop().call_soon(_reader_pool().submit, self._start_booked)
        except RuntimeError:  # (no asyncio loop on this thread)
            _reader_pool().submit(self._start_booked)

    def _start_booked(self) -> None:
        """(A reader thread.) Start the booked reads, in order (a batch of reads into host memory in file order), until
        none is left: a read into host memory once the next one of its batch is seen not to join it (`_join`: one
        `preadv`; the batch's last at its end, joinable by the next batch's first until a reader takes it); a read into
        a staging block once the device has done the block's last copy (`Timeline.on_reach`)."""
        while True:
            with self.lock:
                reads, self.booked = self.booked, []
                if not reads:
                    self.booking = False
                    return
            if all(block is None for _, _, block, _, _ in reads):  # (in file order: neighbours join; a stream's are)
                reads.sort(key=lambda r: (id(r[0].source.file), r[0].source.offset + r[0].start))
            held: tuple[Extent, Device] | None = None  # (the batch's last read into host memory, not started yet)
            for ext, dev, block, at, after in reads:
                if block is None:
                    with self.lock:
                        if self._join(ext, dev):
                            continue
                        self.joinable = None if ext.widen else (ext, dev)
                    if held is not None:
                        self._begin(*held)
                    held = (ext, dev)
                else:
                    self._begin(ext, dev, block, at, after)
            if held is not None:
                self._begin(*held)

    def _begin(self, ext: Extent, dev: Device, block: np.ndarray | None = None, at: int = 0, after: int = 0) -> None:
        """Start a booked read: into host memory at once, into a staging block once the device reaches `after`."""
        try:
            if block is None:
                _start_read([(self, ext, dev, None, 0)])
            else:
                dev.timeline.on_reach(after, partial(_start_read, [(self, ext, dev, block, at)]))
        except BaseException as e:  # (the pool shut down: its values fail rather than never come)
            for v in (ext.value, *ext.values):
                self._piece_done(v, e)

    def _join(self, ext: Extent, dev: Device) -> bool:
        """Under the lock: join `ext` to the open read (`joinable`) where its bytes follow that read's, on one file, and
        the two come to EXTENT bytes at most, or one of them is SMALL (then HOST_EXTENT + SMALL at most). Two large
        reads stay two, for two readers. A model's small tensors (biases, norms) lie between its large ones, each of
        them a read that cost a reader's Python (and the GIL) as much as a large one's (a lazy 2 GiB load onto c:0: 240
        reads, 112 of them of 4-16 KiB)."""
        if self.joinable is None:
            return False
        into, at = self.joinable
        a, b = into.source, ext.source
        n = into.nbytes + ext.nbytes
        if at is not dev or a.file is not b.file or a.runs is not None or b.runs is not None or ext.widen or \
                into.direct != ext.direct or a.offset + into.start + into.nbytes != b.offset + ext.start or \
                n > EXTENT and (min(into.nbytes, ext.nbytes) > SMALL or n > HOST_EXTENT + SMALL):
            return False
        into.parts += ext.parts
        into.nbytes += ext.nbytes
        into.values.append(ext.value)
        return True

    def _piece_done(self, v: int, err: BaseException | None) -> None:
        """A piece of read `v` is done (any thread): once all of it is, the source's timeline reaches the last value
        whose read and all earlier ones are done (reads finish out of order; the timeline's value only grows)."""
        with self.lock:
            if err is not None:
                self.source.record_failure(v, err)
            self.unread[v] -= 1
            if self.unread[v]:
                return
            del self.unread[v]
            reached = next(iter(self.unread), self.submitted + 1) - 1
        self.source.timeline.signal(reached)

    # blocking reads (reader and worker threads)
    def read_range(self, rng: FileRange, start: int, outs: list[memoryview], direct: np.ndarray | None = None
                   ) -> None:
        """`FileRange.read_views`, counted."""
        rng.read_views(start, outs, direct)
        self.count(sum(len(o) for o in outs))

    def read_split(self, rng: FileRange, start: int, out: memoryview) -> None:
        """`read_range` into one view, split into pieces (4 KiB multiples) read in parallel when large, the caller's
        thread reading the first: faulting fresh destination memory in is most of a cached file read's cost, and it
        parallelises."""
        n = len(out)
        pieces = min(os.cpu_count() or 1, n // SPLIT)
        if pieces < 2:
            if n:
                self.read_range(rng, start, [out])
            return
        step = (-(-n // pieces) + 4095) // 4096 * 4096
        bounds = [(lo, min(lo + step, n)) for lo in range(0, n, step)]
        rest = [_reader_pool().submit(_read_piece, [(self, rng, start + lo, out[lo:hi])]) for lo, hi in bounds[1:]]
        try:
            self.read_range(rng, start, [out[: bounds[0][1]]])
        finally:
            concurrent.futures.wait(rest)  # never return while a piece may still write into `out`
        for f in rest:
            f.result()


Read = tuple[Loads, Extent, Device, np.ndarray | None, int]  # (a read handed to a reader thread: `_read_job`)


def _read_piece(job: list[tuple[Loads, FileRange, int, memoryview]]) -> None:
    loads, rng, start, out = job.pop()  # hold nothing once done: the pool's work item outlives the call a moment
    loads.read_range(rng, start, [out])


def _start_read(job: list[Read]) -> None:
    _reader_pool().submit(_read_job, job)


def _read_job(job: list[Read]) -> None:
    """A load's read (`Loads.load`) on a reader thread; then the source's timeline reaches its values (the read's
    failure theirs), once nothing here holds its destinations."""
    loads, ext = job[0][:2]
    with loads.lock:
        if loads.joinable is not None and loads.joinable[0] is ext:
            loads.joinable = None  # taken: later reads open another
    values = [ext.value, *ext.values]
    del ext
    err: BaseException | None = None
    try:
        _read(*job.pop())
    except BaseException as e:
        err = e
    for v in values:
        loads._piece_done(v, err)


def _read(loads: Loads, ext: Extent, dev: Device, block: np.ndarray | None, at: int) -> None:
    """An extent's bytes into `block` from byte `at` of it, else (None) straight into its targets' buffers (host memory,
    allocated here where not yet); bfloat16 widened where asked."""
    rng, n = ext.source, ext.nbytes
    if block is not None:
        got = None
        if ext.direct and not ext.widen:
            aligned = block[(-block.ctypes.data) % DIRECT_ALIGN :]
            got = rng.file.read_direct(rng.offset + ext.start, n, aligned, rng.what)  # (None: O_DIRECT refused)
            if got is not None:
                loads.count(n)
        if got is None:
            loads.read_range(rng, ext.start, [block[at : at + n].data])
        if ext.widen:
            _widen(block[at:], n)
        return
    bufs = [t.allocate(dev) for t, _, _ in ext.parts]
    outs = [b.mem.reshape(-1).view(np.uint8)[into : into + size].data if b is not None else
            memoryview(bytearray(size)) for b, (_, into, size) in zip(bufs, ext.parts)]  # (a failed one's: scratch)
    bounce = _bounce() if ext.direct and not ext.widen else None
    loads.read_range(rng, ext.start, outs, bounce)
    if ext.widen and bufs[0] is not None:
        _widen(bufs[0].mem.reshape(-1).view(np.uint8), n)


_bounces = threading.local()


def _bounce() -> np.ndarray:
    """This reader thread's aligned block for O_DIRECT reads into host memory (DIRECT_PIECE bytes: a read goes through
    it a piece at a time; kept, faulted in once)."""
    block: np.ndarray | None = getattr(_bounces, "block", None)
    if block is None:
        block = _bounces.block = direct_block(DIRECT_PIECE)
    return block


def _widen(mem: np.ndarray, n: int) -> None:
    """bfloat16 (the first `n` bytes) widened in place to float32 (2n bytes): bfloat16 is a float32's upper half."""
    mem[: 2 * n].view(np.uint32)[:] = mem[:n].view(np.uint16).astype(np.uint32) << 16
