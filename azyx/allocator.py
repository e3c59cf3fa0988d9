"""The caching allocator every backend pools its memory with: size-bucketed free lists (a block freed is reused
by a request of nearly the same size, like PyTorch's caching allocator) and in-use accounting, which is what
device choice reads as free memory. Only how a block is created differs per backend."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from azyx.errors import AllocationError


def bucket(nbytes: int) -> int:
    """Round a request up so that freed blocks are reused by requests of nearly the same size."""
    if nbytes <= 4096:
        return max(64, 1 << (nbytes - 1).bit_length())
    gran = 4096 if nbytes <= (1 << 20) else 1 << 16
    return -(-nbytes // gran) * gran


class PoolAllocator:
    def __init__(self, capacity: int, cache_limit: int, create: Callable[[int], Any], what: str):
        self.capacity, self.cache_limit, self.create, self.what = capacity, cache_limit, create, what
        self.lock = threading.Lock()
        self.free_lists: dict[int, list[Any]] = {}
        self.in_use = 0
        self.cached = 0

    def alloc(self, nbytes: int) -> tuple[Any, int]:
        """A block of at least `nbytes`: (memory, its bucketed size)."""
        size = bucket(max(nbytes, 1))
        with self.lock:
            lst = self.free_lists.get(size)
            mem = lst.pop() if lst else None
            if mem is not None:
                self.cached -= size
            elif self.in_use + size > self.capacity:
                raise AllocationError(f"allocating {nbytes} bytes exceeds the {self.what}'s capacity of "
                                      f"{self.capacity} bytes ({self.in_use} in use)")
            self.in_use += size
        if mem is None:
            try:
                mem = self.create(size)
            except Exception as e:  # MemoryError, a driver's out-of-resources error
                with self.lock:
                    self.in_use -= size
                raise AllocationError(f"{self.what}: allocating {size} bytes failed: {e}") from None
        return mem, size

    def free(self, mem: Any, size: int) -> None:
        with self.lock:
            self.in_use -= size
            if self.cached + size <= self.cache_limit:
                self.free_lists.setdefault(size, []).append(mem)
                self.cached += size
