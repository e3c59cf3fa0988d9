"""The caching allocator every backend pools its memory with: size-bucketed free lists (a block freed is reused
by a request of nearly the same size, like PyTorch's caching allocator) and in-use accounting, which is what
device choice reads as free memory. Only how a block is created differs per backend."""

from __future__ import annotations

import collections
import contextlib
import heapq
import threading
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

from azyx.errors import AllocationError
from azyx.native import native


class MemoryUsage(NamedTuple):
    """A device's memory, in bytes: what its buffers hold now, and what its pool keeps for reuse."""

    in_use: int
    cached: int


def bucket(nbytes: int) -> int:
    """Round a request up so that freed blocks are reused by requests of nearly the same size."""
    if nbytes <= 4096:
        return max(64, 1 << (nbytes - 1).bit_length())
    gran = 4096 if nbytes <= (1 << 20) else 1 << 16
    return -(-nbytes // gran) * gran


class Slabs:
    """Small blocks (of at most `piece_max` bytes) carved from slabs of `size` bytes (a driver's allocations are slow,
    and few), at offsets aligned to `align`: per key (a memory type) the slab being carved, per slab how many of its
    pieces are out, and per piece its slab. A device's pool makes its blocks by `block` and destroys them by
    `destroy`: the decision "a piece or the API's own block" is made here, once for every backend."""

    def __init__(self, size: int, align: int, piece_max: int):
        self.size, self.align, self.piece_max = size, align, piece_max
        self.lock = threading.Lock()
        self.carving: dict[Any, tuple[Any, int]] = {}  # key -> its slab being carved, the bytes carved from it
        self.pieces: dict[Any, int] = {}  # slab -> its pieces out (`carve` less `drop`)
        self.of: dict[Any, Any] = {}  # piece -> its slab (`block`)

    def block(self, key: Any, size: int, whole: Callable[[int], Any], piece: Callable[[Any, int, int], Any]) -> Any:
        """A block of `size` bytes: past `piece_max` the API's own (`whole(size)`), else `piece(slab, at, size)`, the
        block of `size` bytes at `at` in a slab of `key`'s (a slab: `whole(self.size)`)."""
        if size > self.piece_max:
            return whole(size)
        slab, at = self.carve(key, size, lambda: whole(self.size))
        block = piece(slab, at, size)
        self.of[block] = slab
        return block

    def destroy(self, block: Any, destroy: Callable[[Any], Any]) -> None:
        """`block` is gone for good: `destroy`ed where it is the API's own; a piece, its slab once it was the last."""
        slab = self.of.pop(block, None)
        if slab is None:
            destroy(block)
        elif self.drop(slab):
            destroy(slab)

    def carve(self, key: Any, size: int, new: Callable[[], Any]) -> tuple[Any, int]:
        """A piece of `size` bytes: its slab and its offset there; `new()` makes a slab where the one being carved
        for `key` has no room left."""
        with self.lock:
            slab, used = self.carving.get(key, (None, 0))
            at = -(-used // self.align) * self.align
            if slab is None or at + size > self.size:
                slab, at = new(), 0
            self.carving[key] = (slab, at + size)
            self.pieces[slab] = self.pieces.get(slab, 0) + 1
            return slab, at

    def drop(self, slab: Any) -> bool:
        """A piece of `slab` is gone for good; True: it was its last (and the slab is forgotten)."""
        with self.lock:
            self.pieces[slab] -= 1
            if self.pieces[slab]:
                return False
            del self.pieces[slab]
            self.carving = {k: c for k, c in self.carving.items() if c[0] is not slab}  # (nothing more from it)
            return True


class PoolAllocator:
    """Free lists per bucket and in-use accounting. `free` may be called from a finalizer (`Buffer.__del__`) at any
    point of any thread, the thread inside an `alloc` included: the cyclic GC runs finalizers wherever an allocation
    triggers it. With the native core each step is one C call under the GIL (`native.Pool`), which no finalizer can
    interrupt; in Python a free never waits for the lock: it queues itself, and whoever holds the lock takes the queue
    in before letting go."""

    def __init__(self, capacity: int, cache_limit: int, create: Callable[[int], Any], what: str, lowest: bool = False):
        """`create(size)` makes a new block (raising when the device is out of memory); `what` names the device in
        errors. `lowest`: blocks are addresses (ints), and a request takes the lowest cached one of its size, so a plan
        that runs again from the same free blocks gets the same addresses (CUDA replays such a run as a graph); else
        the block freed last."""
        self.create, self.what, self.lowest = create, what, lowest
        self.put: Callable[[list[Any], Any], None] = heapq.heappush if lowest else list.append
        self.take: Callable[[list[Any]], Any] = heapq.heappop if lowest else list.pop
        self._lock = threading.Lock()
        self._pending: collections.deque[tuple[Any, int]] = collections.deque()  # frees not yet taken in
        self.free_lists: dict[int, list[Any]] = {}
        self._capacity, self._cache_limit, self._in_use, self._cached = capacity, cache_limit, 0, 0
        self.pool = native.Pool(capacity, cache_limit, lowest) if native is not None else None
        if self.pool is not None:
            self.free = self.pool.give  # type: ignore[method-assign]  # (a Buffer's free: one C call)

    @property
    def in_use(self) -> int:
        return self.pool.in_use if self.pool is not None else self._in_use

    @property
    def cached(self) -> int:
        return self.pool.cached if self.pool is not None else self._cached

    @property
    def capacity(self) -> int:
        return self.pool.capacity if self.pool is not None else self._capacity

    @capacity.setter
    def capacity(self, value: int) -> None:
        self._capacity = value
        if self.pool is not None:
            self.pool.capacity = value

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Hold the lock (to read the free lists and counts together from outside)."""
        self._lock.acquire()
        try:
            yield
        finally:
            self._unlock()

    def _unlock(self) -> None:
        """Take in the queued frees, then release; again if more came between the last look and the release."""
        while True:
            while self._pending:
                mem, size = self._pending.popleft()
                self._in_use -= size
                if mem is not None and self._cached + size <= self._cache_limit:
                    self.put(self.free_lists.setdefault(size, []), mem)
                    self._cached += size
            self._lock.release()
            if not self._pending or not self._lock.acquire(blocking=False):
                return

    def _refused(self, nbytes: int, in_use: int) -> AllocationError:
        return AllocationError(f"{self.what}: cannot allocate {nbytes} bytes: over its capacity of {self.capacity} "
                               f"bytes ({in_use} in use)")

    def _created(self, nbytes: int, size: int) -> Any:
        """A new block of `size` bytes, counted in use already (given back if the device refuses it)."""
        try:
            return self.create(size)
        except Exception as e:  # MemoryError, a driver's out-of-resources error
            self.free(None, size)
            raise AllocationError(f"{self.what}: cannot allocate {nbytes} bytes ({size} as pooled): out of "
                                  f"device memory ({type(e).__name__}: {e})") from None

    def alloc(self, nbytes: int) -> tuple[Any, int]:
        """A block of at least `nbytes`: (memory, its bucketed size)."""
        if self.pool is not None:
            got = self.pool.take(nbytes)
            if got is None:
                raise self._refused(nbytes, self.pool.in_use)
            mem, size = got
            return (mem if mem is not None else self._created(nbytes, size)), size
        size = bucket(max(nbytes, 1))
        self._lock.acquire()
        try:
            lst = self.free_lists.get(size)
            mem = self.take(lst) if lst else None
            if mem is not None:
                self._cached -= size
            elif self._in_use + size > self._capacity:
                raise self._refused(nbytes, self._in_use)
            self._in_use += size
        finally:
            self._unlock()
        if mem is None:
            mem = self._created(nbytes, size)
        return mem, size

    def alloc_many(self, sizes: list[int]) -> list[tuple[Any, int]]:
        """Blocks of at least each of `sizes` bytes, taken in one step (a plan step's dozens of temporary buffers);
        all or none: a refused one gives back those taken before it."""
        if self.pool is not None:
            got = self.pool.take_many(sizes)
            if isinstance(got, int):  # (the one refused: nothing was taken)
                raise self._refused(sizes[got], self.pool.in_use)
            out: list[tuple[Any, int]] = got
        else:
            out = []
            self._lock.acquire()
            try:
                for nbytes in sizes:
                    size = bucket(max(nbytes, 1))
                    lst = self.free_lists.get(size)
                    if lst:
                        self._cached -= size
                        out.append((self.take(lst), size))
                    elif self._in_use + size > self._capacity:
                        error = self._refused(nbytes, self._in_use - sum(sz for _, sz in out))  # (before this step)
                        for mem, sz in out:
                            self.free(mem, sz)  # (queued: taken in as the lock is let go)
                        raise error
                    else:
                        out.append((None, size))
                    self._in_use += size
            finally:
                self._unlock()
        for i, (mem, size) in enumerate(out):
            if mem is None:
                try:
                    out[i] = (self.create(size), size)
                except Exception as e:  # MemoryError, a driver's out-of-resources error
                    for m, sz in out:
                        self.free(m, sz)
                    raise AllocationError(f"{self.what}: cannot allocate {sizes[i]} bytes ({size} as pooled): out of "
                                          f"device memory ({type(e).__name__}: {e})") from None
        return out

    def reuse(self, nbytes: int) -> tuple[Any, int] | None:
        """A cached block of at least `nbytes` (memory, its bucketed size), or None: never creates one."""
        if self.pool is not None:
            return self.pool.reuse(nbytes)
        size = bucket(max(nbytes, 1))
        with self.locked():
            lst = self.free_lists.get(size)
            if not lst:
                return None
            self._cached -= size
            self._in_use += size
            return self.take(lst), size

    def cached_blocks(self, size: int) -> list[Any]:
        """The blocks cached under bucketed size `size` (a copy of that free list)."""
        if self.pool is not None:
            return self.pool.blocks(size)
        with self.locked():
            return list(self.free_lists.get(size, []))

    def uncached(self, sizes: list[int]) -> list[int]:
        """The bucketed sizes of the blocks that `alloc`s of `sizes` bytes would make: those its cache lacks (cached
        blocks of other sizes serve none of them)."""
        want = collections.Counter(bucket(max(n, 1)) for n in sizes)
        return [b for b, k in want.items() for _ in range(k - len(self.cached_blocks(b)))]

    def account(self, nbytes: int) -> None:
        """`nbytes` more in use (fewer where negative) outside the free lists: host data a buffer wraps."""
        if self.pool is not None:
            self.pool.account(nbytes)
            return
        with self.locked():
            self._in_use += nbytes

    def usage(self) -> MemoryUsage:
        """Bytes in use and bytes cached, read together."""
        if self.pool is not None:
            return MemoryUsage(*self.pool.usage())
        with self.locked():
            return MemoryUsage(self._in_use, self._cached)

    def take_cached(self, keep: Callable[[Any], bool] | None = None) -> list[Any]:
        """Every cached block, out of the free lists (for its owner to give back to the driver); those `keep` says
        so of stay cached."""
        if self.pool is not None:
            lists = self.pool.drain()
            out = []
            for size, blocks in lists.items():
                for mem in blocks:
                    if keep is not None and keep(mem):
                        self.pool.give(mem, size)
                        self.pool.account(size)  # (give counts a block out of use: this one was cached, not lent)
                    else:
                        out.append(mem)
            return out
        with self.locked():
            lists, self.free_lists, self._cached = self.free_lists, {}, 0
            if keep is None:
                return [mem for blocks in lists.values() for mem in blocks]
            out = []
            for size, blocks in lists.items():
                kept = [mem for mem in blocks if keep(mem)]
                out += [mem for mem in blocks if not keep(mem)]
                if kept:
                    if self.put is heapq.heappush:
                        heapq.heapify(kept)
                    self.free_lists[size] = kept
                    self._cached += size * len(kept)
            return out

    def free(self, mem: Any, size: int) -> None:
        """Give a block back (`mem` None: only its `size` leaves the in-use count). Never waits (see the class)."""
        self._pending.append((mem, size))
        if self._lock.acquire(blocking=False):
            self._unlock()
