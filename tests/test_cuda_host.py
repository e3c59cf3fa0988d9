"""tests/cuda_host.py itself (the host emulation of CUDA kernels that test_gemv, test_split_k and
test_attention_decode run rendered kernels on): a warp's shuffles exchange the partners' values, so a butterfly sum
is the warp's sum and one with a wrong partner is not; a read of another thread's shared-memory write needs the
`__syncthreads` between them; a barrier that some threads skip fails the launch instead of hanging."""

from __future__ import annotations

import numpy as np
import pytest
from cuda_host import launch

WARP_SUM = """extern "C" __global__ void warp_sum(float* __restrict__ out, const float* __restrict__ x) {
  const int t = blockIdx.x * blockDim.x + threadIdx.x;
  float v = x[t];
  for (int o = 16; o >= 1; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, PARTNER);
  out[t] = v;
}
"""

ROTATE = """extern "C" __global__ void rotate(float* __restrict__ out, const float* __restrict__ x) {
  __shared__ float s[64];
  const int t = threadIdx.x, n = blockDim.x;
  s[t] = x[blockIdx.x * n + t];
  BARRIER
  out[blockIdx.x * n + t] = s[(t + 1) % n];
}
"""


def run(src: str, name: str, threads: int, x: np.ndarray) -> np.ndarray:
    """Kernel `name` of `src` over 2 blocks of `threads` with input `x`: its output."""
    out = np.zeros_like(x)
    launch(src, name, (2, 1, 1), threads, [out, x])
    return out


def test_a_warp_sums_by_shuffles_with_its_partners() -> None:
    """Butterfly shuffles (lane ^ 16, 8, .. 1) leave every lane of each warp its warp's sum; with the partner lane ^ o
    ^ 1 (a wrong one: lane ^ 0 is the lane itself) they do not."""
    x = np.arange(2 * 96, dtype=np.float32) % 7 - 3  # (2 blocks of 3 warps)
    want = np.repeat(x.reshape(-1, 32).sum(1), 32)
    np.testing.assert_array_equal(run(WARP_SUM.replace("PARTNER", "o"), "warp_sum", 96, x), want)
    assert not np.array_equal(run(WARP_SUM.replace("PARTNER", "o ^ 1"), "warp_sum", 96, x), want)


def test_shared_memory_is_read_after_the_barrier() -> None:
    """Each thread reads its neighbour's shared-memory write: right after `__syncthreads`, and not without it (the
    fibers run to their barrier one after another, so the neighbour's write has not happened yet)."""
    x = np.arange(2 * 64, dtype=np.float32) + 1
    want = np.roll(x.reshape(2, 64), -1, axis=1).reshape(-1)
    np.testing.assert_array_equal(run(ROTATE.replace("BARRIER", "__syncthreads();"), "rotate", 64, x), want)
    assert not np.array_equal(run(ROTATE.replace("BARRIER", ""), "rotate", 64, x), want)


def test_a_barrier_some_threads_skip_fails_the_launch() -> None:
    """`__syncthreads` inside a branch that half the block takes: the GPU hangs; the emulation raises."""
    src = ROTATE.replace("BARRIER", "if (t < 32) __syncthreads();")
    with pytest.raises(AssertionError, match="a barrier that not every thread"):
        launch(src, "rotate", (1, 1, 1), 64, [np.zeros(64, np.float32), np.ones(64, np.float32)])
