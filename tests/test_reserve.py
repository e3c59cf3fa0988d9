"""A plan whose run makes large new buffers on a device where making one is slow (`Device.reserve_min`: CUDA's driver
allocations wait on the driver's lock) has them made on a worker thread first, so the run on the loop's thread takes
them from the pool's cache. Shown on c:0 with `reserve_min` set for the test: the blocks its run needs are created on
threads other than the loop's, and the results are numpy's."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import azyx
from azyx import Tensor
from azyx.runtime import RT


@pytest.fixture
def slow_allocs(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """c:0 with reserve_min 1 MiB, its cache emptied, and every block its allocator creates recorded with the
    creating thread: (thread id, bytes)."""
    azyx.devices()
    dev = RT.device("c:0")
    monkeypatch.setattr(dev, "reserve_min", 1 << 20, raising=False)
    made: list[tuple[int, int]] = []
    create = dev.allocator.create

    def recording(size: int):  # type: ignore[no-untyped-def]
        made.append((threading.get_ident(), size))
        return create(size)

    monkeypatch.setattr(dev.allocator, "create", recording)
    dev.allocator.take_cached()  # (nothing cached: the run's blocks must be made)
    return made


async def test_large_new_buffers_are_made_off_the_loop(slow_allocs: list[tuple[int, int]]) -> None:
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal((1024, 1024)).astype(np.float32) for _ in range(5)]
    # (a shape no other test plans: each realize below makes its buffers anew)
    outs = [(Tensor(x, device="c:0") * 2 + 1).exp2().reshape(512, 2048) for x in xs]
    RT.device("c:0").allocator.take_cached()
    slow_allocs.clear()
    await azyx.realize(*outs)  # new plan: planned, compiled, noted; its run reserves first
    loop = threading.get_ident()
    big = [(tid, n) for tid, n in slow_allocs if n >= 1 << 20]
    assert big, "the run made no large block"
    assert all(tid != loop for tid, _ in big), f"large blocks made on the loop's thread: {big}"
    for x, out in zip(xs, outs):
        np.testing.assert_allclose(await out.numpy(), np.exp2(x * 2 + 1).reshape(512, 2048), rtol=1e-5)

    # a cached plan's run again, its pool emptied: reserved on a worker, then taken from the cache
    again = [(Tensor(x, device="c:0") * 2 + 1).exp2().reshape(512, 2048) for x in xs]
    RT.device("c:0").allocator.take_cached()
    slow_allocs.clear()
    await azyx.realize(*again)
    big = [(tid, n) for tid, n in slow_allocs if n >= 1 << 20]
    assert big and all(tid != loop for tid, _ in big), big
    np.testing.assert_allclose(await again[1].numpy(), np.exp2(xs[1] * 2 + 1).reshape(512, 2048), rtol=1e-5)


async def test_reserved_blocks_are_pooled_once(slow_allocs: list[tuple[int, int]]) -> None:
    """A reservation's blocks go back to the pool once each: a cached plan's run after one, beside live results of
    an earlier run, gets blocks of its own (a block pooled twice was handed to two live buffers, and a run
    overwrote the other's result: wrong sums on an H200)."""
    rng = np.random.default_rng(1)
    xs = [rng.standard_normal((1024, 1024)).astype(np.float32) for _ in range(5)]

    def graph(x: np.ndarray) -> Tensor:
        return (Tensor(x, device="c:0") * 3 - 1).reshape(2048, 512)

    RT.device("c:0").allocator.take_cached()
    first = [graph(x) for x in xs]
    await azyx.realize(*first)  # new plan: noted, reserved, run
    RT.device("c:0").allocator.take_cached()
    second = [graph(x + 1) for x in xs]
    await azyx.realize(*second)  # the cached plan: reserved again, run
    third = [graph(x - 1) for x in xs]
    await azyx.realize(*third)  # from the pool's cache
    for shift, group in ((0, first), (1, second), (-1, third)):
        for x, out in zip(xs, group):
            want = ((x + shift) * 3 - 1).reshape(2048, 512)
            np.testing.assert_allclose(await out.numpy(), want, rtol=1e-6, atol=1e-6)
