"""The memory part (azyx.memory.Memory) once its device has closed: each pool's blocks destroyed by that pool's own
`destroy` (a device's blocks and its host staging blocks are different kinds of memory: CUDA's device memory and
pinned memory), the cached ones at `close`, those still out as they come back."""

from __future__ import annotations

from typing import Any

from azyx.allocator import PoolAllocator
from azyx.device import Buffer
from azyx.memory import Lent, Memory, aligned_block
from azyx.runtime import RT


def test_close_destroys_each_pools_blocks_by_its_own_destroy() -> None:
    mem = Memory(RT.device("c:0"), Buffer)  # (the device names the pools; no buffer of this part is made)
    made: dict[str, list[Any]] = {"device": [], "staging": []}
    destroyed: dict[str, list[Any]] = {"device": [], "staging": []}

    def create(kind: str) -> Any:
        def new(size: int) -> Any:
            made[kind].append(aligned_block(size))
            return made[kind][-1]
        return new

    mem.pool = PoolAllocator(1 << 20, 1 << 20, create("device"), "device blocks")
    mem.destroy = destroyed["device"].append
    staging = PoolAllocator(1 << 20, 1 << 20, create("staging"), "staging blocks")
    mem.adopt(staging, destroyed["staging"].append)

    cached, size = mem.pool.alloc(256)
    mem.pool.free(cached, size)
    out, out_size = mem.pool.alloc(4096)  # still out when the device closes
    lent = Lent(staging, 512, give_back=mem.give_back)
    del lent  # (cached by the staging pool)
    kept = Lent(staging, 8192, give_back=mem.give_back)

    mem.close()
    assert [b[1] for b in destroyed["device"]] == [made["device"][0][1]]
    assert [b[1] for b in destroyed["staging"]] == [made["staging"][0][1]]

    mem.give_back(mem.pool, out, out_size)  # (as a buffer released after close)
    del kept
    assert [b[1] for b in destroyed["device"]] == [b[1] for b in made["device"]] and len(made["device"]) == 2
    assert [b[1] for b in destroyed["staging"]] == [b[1] for b in made["staging"]] and len(made["staging"]) == 2
    assert mem.pool.in_use == 0 and staging.in_use == 0
