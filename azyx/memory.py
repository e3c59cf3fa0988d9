"""A device's memory part (device.Device's `mem`), written once for every backend: its pool of blocks and what it may
hold of host staging, the buffers it makes and takes back, and what happens to blocks once the device has closed. A
backend says only how a block is made (the pool's `create`), how one is destroyed (`destroy`) and where a block's
address is (`address`). Its host staging is a pool of blocks the API copies from fastest (`Staging`, by
`Memory.staging`), and for file loads a ring of blocks (`Ring`, by `Memory.ring`), made of what the device's
`host_staging` lends."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from azyx.allocator import MemoryUsage, PoolAllocator
from azyx.errors import AllocationError

ALIGN = 64  # host blocks' alignment
# a host block of HUGE_MIN bytes or more (numpy asks the kernel for transparent huge pages on arrays that large) starts
# at a multiple of HUGE, a huge page: else the kernel backs its unaligned first and last parts with 4 KiB pages, and a
# file load's first touch of fresh memory (most of its cost) took 0.51 s of system time per GB instead of 0.29 (2-core
# AMD EPYC VM, 16 MiB blocks: 29,700 page faults against 780). The block then takes up to HUGE bytes more of address
# space (`block_bytes`: what numpy allocates, and tracemalloc counts), never touched, so not memory.
HUGE, HUGE_MIN = 2 << 20, 4 << 20
# file loads staged through host memory (azyx.loads: the stream and the lazy path): bytes
# per read (a read from the page cache runs at ~5 GB/s per thread: ~1.6 ms, long against what each costs the loop,
# short against a file of gigabytes), and a device's ring of staging blocks, read into and copied from in turn (at most
# RING reads in flight per device, RING * RING_BLOCK bytes of host memory whatever the file's size; a device that
# stages through pinned memory pins them once, at its start, off the loop)
EXTENT = 8 << 20
RING = 8
RING_BLOCK = EXTENT + 2 * 4096  # (room for an O_DIRECT read's aligned ends: files.DIRECT_ALIGN)


class Memory:
    """The pool (`pool`: allocator.PoolAllocator over the backend's "create a block of n bytes"; None on a device
    without one) of `capacity` bytes, buffers of at most `max_block` bytes each (0: no limit; `max_block_name`: the
    API's name of the limit), and the pools of host staging blocks (`staging`) that a device lends as `Lent`.
    `buffer(device, nbytes, mem, ptr, pooled)` makes a buffer (device.Buffer). Once `close`d, cached blocks are
    destroyed (`destroy`: None, they are dropped) and so are blocks given back later; where the backend counts the
    blocks its pools make (`count`), `on_empty` runs once the device has closed and its last block is destroyed (the
    API's context may go then)."""

    def __init__(self, device: Any, buffer: Callable[..., Any]):
        self.device, self.buffer = device, buffer
        self.pool: PoolAllocator | None = None
        # the staging pools, which `close` empties with the pool, each with its own `destroy` (None: the device's)
        self.pools: dict[PoolAllocator, Callable[[Any], None] | None] = {}
        self.capacity = 0
        self.max_block, self.max_block_name = 0, ""
        self.address: Callable[[Any], int] = lambda block: 0  # a block's address (Buffer.ptr), where the API has one
        self.destroy: Callable[[Any], None] | None = None
        self.closed = False
        self.live = 0  # blocks made (`count`) and not destroyed yet, on any thread
        self.on_empty: Callable[[], None] | None = None
        self.lock = threading.Lock()
        self.loads: Ring | None = None  # (`ring`)

    def open_pool(self, options: dict[str, Any], default: float, create: Callable[[int], Any], cache_share: float = 1.0,
                  pool: type[PoolAllocator] = PoolAllocator, **kw: Any) -> PoolAllocator:
        """The device's pool of blocks that `create(n)` makes, over its config section's `memory` bytes (else
        `default`), caching up to `cache_share` of that in blocks given back for reuse (`kw`: the pool's options)."""
        self.capacity = int(options.get("memory") or default)
        self.pool = pool(self.capacity, int(self.capacity * cache_share), create, self.device.name, **kw)
        return self.pool

    def ring(self) -> Ring:
        """The device's ring of host staging blocks for file loads (one per device: its loads' reads and copies take
        turns in it; made at its first load)."""
        with self.lock:
            if self.loads is None:
                self.loads = Ring(self.device)
            return self.loads

    def staging(self, create: Callable[[int], Any], what: str, cache_limit: int = 1 << 40,
                view: Callable[[Any], np.ndarray] | None = None, pool: type[PoolAllocator] = PoolAllocator,
                destroy: Callable[[Any], None] | None = None) -> Staging:
        """Host staging blocks made by `create` (a `pool` of them, emptied with the device's pool at `close`; its
        blocks destroyed by `destroy` where they are not the device's kind: `adopt`)."""
        staging = Staging(pool(1 << 40, cache_limit, create, f"{self.device.name} {what}"), self.give_back, view)
        self.adopt(staging.pool, destroy)
        return staging

    def adopt(self, pool: PoolAllocator, destroy: Callable[[Any], None] | None = None) -> None:
        """A pool of host staging blocks that `close` empties with the device's pool, its blocks destroyed by
        `destroy` where they are not the device's kind of block (CUDA's pinned memory beside its device memory)."""
        self.pools[pool] = destroy

    def usage(self) -> MemoryUsage:
        assert self.pool is not None
        return self.pool.usage()

    def free(self) -> int:
        """Bytes the device can still take."""
        assert self.pool is not None
        return self.capacity - self.pool.in_use

    def too_large(self, nbytes: int) -> AllocationError:
        """The error of a buffer of `nbytes` bytes, over the API's limit (`max_block`)."""
        dev = self.device
        return AllocationError(f"{dev.name}: a buffer of {nbytes} bytes is larger than one may be on "
                               f"{getattr(dev, 'label', dev.name)} ({self.max_block_name} = {self.max_block} bytes)")

    def alloc(self, nbytes: int) -> Any:
        """A buffer of at least `nbytes` bytes from the pool (AllocationError past `max_block` or the capacity)."""
        assert self.pool is not None
        if self.max_block and nbytes > self.max_block:
            raise self.too_large(nbytes)
        block, size = self.pool.alloc(nbytes)
        return self.buffer(self.device, size, block, self.address(block), True)

    def alloc_many(self, sizes: list[int]) -> list[Any]:
        """A buffer of each size, taken from the pool in one step (all or none)."""
        assert self.pool is not None
        if self.max_block and (big := [n for n in sizes if n > self.max_block]):
            raise self.too_large(big[0])
        return [self.buffer(self.device, size, block, self.address(block), True)
                for block, size in self.pool.alloc_many(sizes)]

    def release(self, buf: Any) -> None:
        """A buffer's block back to the pool (device.Buffer.__del__)."""
        assert self.pool is not None
        block = buf.mem if buf.pooled else None  # (not pooled: only its count)
        if self.closed:
            self.give_back(self.pool, block, buf.nbytes)
        else:
            self.pool.free(block, buf.nbytes)

    def give_back(self, pool: PoolAllocator, block: Any, size: int) -> None:
        """A block back to `pool` (a Buffer's, a Lent's); once the device has closed, destroyed instead."""
        if not self.closed or block is None:
            pool.free(block, size)
            return
        pool.free(None, size)
        self._destroyed(block, self.pools.get(pool))

    def _destroyed(self, block: Any, destroy: Callable[[Any], None] | None = None) -> None:
        destroy = destroy or self.destroy
        if destroy is not None:
            destroy(block)
            if self.live:  # (a backend that counts its blocks)
                self.count(-1)

    def count(self, n: int) -> None:
        """`n` blocks more made by the pools (fewer: destroyed); once closed, the last one destroyed runs `on_empty`
        (once)."""
        with self.lock:
            self.live += n
            empty, on_empty = self.closed and not self.live, self.on_empty
            if empty:
                self.on_empty = None
        if empty and on_empty is not None:
            on_empty()

    def close(self) -> None:
        """From now on blocks given back are destroyed; those cached now are destroyed here."""
        self.closed = True
        for pool, destroy in [(self.pool, None), *self.pools.items()]:
            if pool is not None:
                for block in pool.take_cached():
                    self._destroyed(block, destroy)
                if isinstance(pool, OwnedPool):  # its hold on the blocks still lent (they go with their lenders)
                    pool.blocks.clear()
        self.count(0)  # (or the last block given back, later)


class HostBlocks(Memory):
    """Host memory: 64-byte aligned numpy blocks, each pooled with its address ((array, address): numpy's ctypes.data
    costs a microsecond, read once per block), a buffer's `mem` the array and its `ptr` the address."""

    pool: PoolAllocator

    def __init__(self, device: Any, buffer: Callable[..., Any], capacity: int, cache_limit: int):
        super().__init__(device, buffer)
        self.capacity = capacity
        self.pool = PoolAllocator(capacity, cache_limit, aligned_block, device.name)

    def alloc(self, nbytes: int) -> Any:  # (the hot path of a host device's run: no limit to check, a call less)
        (mem, ptr), size = self.pool.alloc(nbytes)
        return self.buffer(self.device, size, mem, ptr, True)

    def alloc_many(self, sizes: list[int]) -> list[Any]:
        return [self.buffer(self.device, size, mem, ptr, True) for (mem, ptr), size in self.pool.alloc_many(sizes)]

    def release(self, buf: Any) -> None:
        self.pool.free((buf.mem, buf.ptr) if buf.pooled else None, buf.nbytes)  # (a hot path: a call less)


def memory_bytes() -> int:
    """This machine's memory (bytes)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 8 << 30


def block_bytes(size: int) -> int:
    """The bytes `aligned_block(size)` allocates: room to align its start."""
    return size + (HUGE if size >= HUGE_MIN else ALIGN)


def aligned_block(size: int) -> tuple[np.ndarray, int]:
    """A 64-byte aligned host block of `size` bytes (a huge page's multiple where it is HUGE_MIN or more) and its
    address."""
    align = HUGE if size >= HUGE_MIN else ALIGN
    raw = np.empty(block_bytes(size), np.uint8)
    off = (-raw.ctypes.data) % align
    mem = raw[off:off + size]
    return mem, mem.ctypes.data


class Lent:
    """A block lent by a pool (a device's staging memory: pinned, mapped), given back with its last reference, by
    `give_back(pool, block, size)` (default: the pool's `free`). `block`: one the pool had cached (`reuse`), else one
    is taken now."""

    __slots__ = ("pool", "block", "size", "give_back")
    block: Any
    size: int

    def __init__(self, pool: PoolAllocator, nbytes: int, block: tuple[Any, int] | None = None,
                 give_back: Callable[[PoolAllocator, Any, int], None] | None = None):
        self.pool, self.give_back = pool, give_back
        self.block, self.size = block if block is not None else pool.alloc(nbytes)

    def __del__(self) -> None:
        try:
            if hasattr(self, "size"):  # not when the allocation failed
                if self.give_back is None:
                    self.pool.free(self.block, self.size)
                else:
                    self.give_back(self.pool, self.block, self.size)
        except Exception:  # interpreter shutdown
            pass


class Staging:
    """A device's host staging, written once (made by its memory part: `Memory.staging`): a pool of blocks that the
    API copies to and from fastest (pinned memory, mapped buffers), each lent as a `Lent` that gives it back with its
    last reference (destroyed instead once the device has closed: `give_back`), and where the blocks stay mapped, a
    block's host memory (`view`: uint8), which `host` lends another device to read into."""

    def __init__(self, pool: PoolAllocator, give_back: Callable[[PoolAllocator, Any, int], None],
                 view: Callable[[Any], np.ndarray] | None):
        self.pool, self.give_back, self.view = pool, give_back, view

    def lend(self, nbytes: int, block: tuple[Any, int] | None = None) -> Lent:
        """A block of at least `nbytes` bytes (`block`: one the pool had cached), lent until its last reference."""
        return Lent(self.pool, nbytes, block, self.give_back)

    def cached(self, nbytes: int) -> Lent | None:
        """A block of at least `nbytes` bytes that the pool has cached, lent; None where it has none (making one takes
        time: pinning memory, milliseconds)."""
        block = self.pool.reuse(nbytes)
        return None if block is None else self.lend(nbytes, block)

    def host(self, nbytes: int) -> tuple[np.ndarray, Lent]:
        """`nbytes` bytes of a lent block's host memory (a block of one byte at least), and the Lent that keeps them
        valid (`Device.host_staging`)."""
        assert self.view is not None
        lent = self.lend(max(nbytes, 1))
        return self.view(lent.block)[:nbytes], lent

    def at(self, host: np.ndarray, keep: Any) -> int | None:
        """Where `host` starts in its block, where `keep` is a block of this staging (`host` came from `host`: a copy
        from it is one command of the API); else None."""
        if not (isinstance(keep, Lent) and keep.pool is self.pool):
            return None
        assert self.view is not None
        return host.ctypes.data - self.view(keep.block).ctypes.data if host.nbytes else 0


class OwnedPool(PoolAllocator):
    """A pool that holds each block it makes (`blocks`, by id) until it lets it go: no block the pool lends or keeps
    is ever garbage. For an API whose block objects release their handle when finalized (wgpu-py's buffers): a
    Buffer or Lent that dies in a reference cycle gives its block back from its finalizer, in the same pass of the
    cyclic GC that finalizes the block's object; a pool holding its blocks only through their lenders would keep such
    a released block and lend it again. Blocks given back past `keep` cached bytes are let go here (the pool
    underneath drops none): by their last reference (wgpu-native outlives it for the commands queued that use them)."""

    def __init__(self, capacity: int, keep: int, create: Callable[[int], Any], what: str):
        self.blocks: dict[int, Any] = {}
        self.keep, self.make = keep, create
        super().__init__(capacity, 1 << 62, self._own, what)
        self.give = self.free  # the pool's own give-back (the native pool's, where the native core is)
        self.free = self._free  # type: ignore[method-assign]

    def _own(self, size: int) -> Any:
        mem = self.make(size)
        self.blocks[id(mem)] = mem
        return mem

    def _free(self, mem: Any, size: int) -> None:
        """A block back (any thread, a finalizer's included): cached, or let go past `keep` cached bytes."""
        if mem is not None and self.cached + size > self.keep:
            self.blocks.pop(id(mem), None)
            mem = None
        self.give(mem, size)

    def take_cached(self, keep: Callable[[Any], bool] | None = None) -> list[Any]:
        out = super().take_cached(keep)
        for mem in out:
            self.blocks.pop(id(mem), None)
        return out


class Ring:
    """A device's staging blocks for loads (`Device.host_staging`, `RING_BLOCK` bytes each, `size` at most), read into
    and copied from in turn: a block is read into again once its last copy is done (the read waits for that on the
    disk's side), so a load of any size holds at most `size` blocks. Taken at the first read after an idle time (a
    device that pins them pinned them at its start: `host_staging` finds them cached), given back when the last copy
    is done and no read is waiting."""

    def __init__(self, dev: Any, size: int = RING):
        self.dev, self.size = dev, size
        self.blocks: list[tuple[np.ndarray, Any, int]] = []  # (memory, keep, its last copy's value)
        self.turn = 0  # reads taken so far
        self.lock = threading.Lock()  # (`idle` runs on the thread that completes the last copy)

    def take(self) -> tuple[int, np.ndarray, Any, int]:
        """The next block in turn: (its index, memory, keep, the value of its last copy)."""
        with self.lock:
            i = self.turn % self.size
            self.turn += 1
            if i == len(self.blocks):
                mem, keep = self.dev.host_staging(RING_BLOCK)
                self.blocks.append((mem, keep, 0))
            return i, *self.blocks[i]

    def fill(self) -> None:
        """Take the blocks not taken yet (a worker thread: a device's `staging_block` may pin or map memory there)."""
        while True:
            with self.lock:
                if len(self.blocks) >= self.size:
                    return
            mem, keep = self.dev.staging_block(RING_BLOCK)
            with self.lock:
                if len(self.blocks) < self.size:
                    self.blocks.append((mem, keep, 0))

    def used(self, i: int, v: int) -> None:
        """Block `i`'s copies reach value `v` (it is read into again after that)."""
        with self.lock:
            mem, keep, last = self.blocks[i]
            self.blocks[i] = (mem, keep, max(last, v))

    def give_back_after(self, v: int) -> None:
        """Once value `v` is reached (a load's last copy), give the blocks back if nothing took one since."""
        with self.lock:
            turn = self.turn
        self.dev.timeline.on_reach(v, lambda: self.idle(turn))

    def idle(self, turn: int) -> None:
        with self.lock:
            if self.turn == turn:
                self.blocks.clear()
                self.turn = 0
