"""Streaming (non-temporal) stores in the C dialect's kernels (codegen.launch.streams): a plain elementwise kernel
writing a large float32 output along its one loop stores it past the caches, a small one stores plainly; both give
numpy's values, whatever the output's length (the unaligned head and the tail of each thread's part store plainly)."""

from __future__ import annotations

import numpy as np
import pytest

import azyx
from azyx import Tensor
from azyx.codegen.launch import STREAM_BYTES
from azyx.errors import IndexOutOfRange
from azyx.runtime import RT
from azyx.shard import ShardedTensor

RNG = np.random.default_rng(41)
LARGE = STREAM_BYTES // 4 + 13  # elements: past the threshold, a length no vector width divides


def _source(t: Tensor, device: str) -> str:
    (step,) = azyx.schedule(t).kernels
    return RT.device(device).render_ir(step.kernel)[1]


@pytest.mark.parametrize("device", ["c:0", "c:1"])
def test_a_large_elementwise_kernel_streams_its_output_and_gives_numpys_values(device: str) -> None:
    a, b, c = (RNG.standard_normal(LARGE + 3, dtype=np.float32) for _ in range(3))
    # inputs read at an offset of 3 elements (12 bytes: no vector alignment), a scalar, a fused chain
    ta, tb, tc = (Tensor(x, device=device)[3:] for x in (a, b, c))
    t = (ta * tb + tc).relu() * 0.5 + ta
    assert "AZYX_NT_STORE(" in _source(t, device)
    want = np.maximum(a[3:] * b[3:] + c[3:], 0) * np.float32(0.5) + a[3:]
    np.testing.assert_allclose(t.numpy_sync(), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("n", [1000, STREAM_BYTES // 4 - 8])
def test_a_small_elementwise_kernel_stores_plainly(n: int) -> None:
    a = RNG.standard_normal(n, dtype=np.float32)
    t = Tensor(a, device="c:0") * 3 - 1
    assert "AZYX_NT" not in _source(t, "c:0")
    np.testing.assert_allclose(t.numpy_sync(), a * np.float32(3) - 1, rtol=1e-6, atol=1e-6)


def test_a_large_kernel_of_another_shape_stores_plainly() -> None:
    """A reduce and a non-float32 output keep plain stores, and their values."""
    x = RNG.standard_normal((LARGE // 64, 64), dtype=np.float32)
    rows = Tensor(x, device="c:0").sum(axis=1)
    assert "AZYX_NT" not in _source(rows, "c:0")
    np.testing.assert_allclose(rows.numpy_sync(), x.sum(axis=1), rtol=1e-4, atol=1e-4)
    i = RNG.integers(-1000, 1000, LARGE, dtype=np.int32)
    doubled = Tensor(i, device="c:0") * 2
    assert "AZYX_NT" not in _source(doubled, "c:0")
    np.testing.assert_array_equal(doubled.numpy_sync(), i * 2)


async def test_the_all_reduce_over_c0_and_c1_streams_and_sums() -> None:
    parts = [RNG.standard_normal(LARGE, dtype=np.float32) for _ in range(2)]
    shards = [Tensor(p, device=d) for p, d in zip(parts, ("c:0", "c:1"), strict=True)]
    await azyx.realize(*shards)
    total = ShardedTensor(shards, None)._all_reduce("sum")
    (step,) = azyx.schedule(*total.shards).kernels
    assert "AZYX_NT_STORE(" in RT.device(step.device).render_ir(step.kernel)[1]
    for s in total.shards:
        np.testing.assert_allclose(await s.numpy(), parts[0] + parts[1], rtol=1e-6, atol=1e-6)


def test_a_large_gather_streams_and_still_checks_its_indices() -> None:
    """The index a gather reads is checked inside the streamed loop: in range, numpy's values; out of range, raised."""
    x = RNG.standard_normal(1000, dtype=np.float32)
    i = RNG.integers(0, 1000, LARGE).astype(np.int32)
    t = Tensor(x, device="c:0")[Tensor(i, device="c:0")]
    assert "AZYX_NT_STORE(" in _source(t, "c:0")
    np.testing.assert_array_equal(t.numpy_sync(), x[i])
    i[[LARGE // 3, LARGE - 5]] = 1000  # in the streamed middle and the plainly stored tail
    with pytest.raises(IndexOutOfRange, match="1000"):
        Tensor(x, device="c:0")[Tensor(i, device="c:0")].numpy_sync()
