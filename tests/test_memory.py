"""The memory part (azyx.memory.Memory) once its device has closed: each pool's blocks destroyed by that pool's own
`destroy` (a device's blocks and its host staging blocks are different kinds of memory: CUDA's device memory and
pinned memory), the cached ones at `close`, those still out as they come back."""

from __future__ import annotations

from typing import Any

from azyx.allocator import PoolAllocator, Slabs
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


def test_slabs_make_small_blocks_pieces_and_destroy_a_slab_with_its_last_piece() -> None:
    """allocator.Slabs, which CUDA's and Vulkan's pools make their blocks by: a block up to `piece_max` bytes is a
    piece of a slab (aligned, within it, no two overlapping), a larger one the API's own; destroying every piece of a
    slab destroys that slab once, and a whole block is destroyed itself."""
    slabs = Slabs(1 << 12, 256, 1 << 10)
    made: list[tuple[int, int]] = []  # (address, size) of each block of the "API", in host memory
    destroyed: list[int] = []

    def whole(size: int) -> int:
        array, address = aligned_block(size)
        made.append((address, size))
        keep.append(array)
        return address

    keep: list[Any] = []
    sizes = [1, 100, 256, 1000, 1024, 700, 5000, 3]
    blocks = [slabs.block(None, n, whole, lambda slab, at, _: slab + at) for n in sizes]
    slab_of = {b: s for b, s in slabs.of.items()}
    assert sorted(slab_of) == sorted(b for b, n in zip(blocks, sizes) if n <= 1 << 10)
    assert (blocks[6], 5000) in made  # (the large one: the API's own)
    for b, n in zip(blocks, sizes):
        if n <= 1 << 10:
            assert (b - slab_of[b]) % 256 == 0 and (slab_of[b], 1 << 12) in made and b + n <= slab_of[b] + (1 << 12)
    spans = sorted((b, b + n) for b, n in zip(blocks, sizes))
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))
    for b in blocks:
        slabs.destroy(b, destroyed.append)
    assert sorted(destroyed) == sorted(a for a, _ in made) and not slabs.of and not slabs.pieces
