"""The tiled float32 product (azyx.gemm) against numpy on every device, in each shape its kernels treat apart: both
operands' layouts (the slices of 8 k where both run along k, 16 otherwise), tiles of 128 x 128, 128 x 64 and 64 x 64,
sizes that are whole tiles and sizes that are not, K split over blocks with atomics, batched and broadcast products,
offset and strided operands, a product under an epilogue."""

from __future__ import annotations

import numpy as np
import pytest
from compare import assert_matches

from azyx import Tensor

SHAPES = [(256, 384, 512), (17, 65, 33), (1000, 300, 130), (64, 2048, 64), (128, 64, 256), (130, 260, 36)]  # m, k, n


def _data(*shape: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


@pytest.mark.parametrize("mkn", SHAPES, ids=str)
@pytest.mark.parametrize("layout", ["a@b", "a@w.T", "x.T@b", "x.T@w.T"])
def test_product_layouts(device: str, mkn: tuple[int, int, int], layout: str) -> None:
    m, k, n = mkn
    a = _data(m, k) if layout.startswith("a") else _data(k, m).T
    b = _data(k, n, seed=1) if layout.endswith("b") else _data(n, k, seed=1).T
    ta = Tensor(a.T.copy(), device=device).T if not layout.startswith("a") else Tensor(a, device=device)
    tb = Tensor(b.T.copy(), device=device).T if not layout.endswith("b") else Tensor(b, device=device)
    assert_matches(ta @ tb, a.astype(np.float64) @ b, dtype="float32", rtol=1e-4, atol=1e-3)


def test_batched_broadcast_offset_and_strided_products(device: str) -> None:
    x, w, y = _data(3, 70, 96), _data(80, 96, seed=1), _data(3, 96, 40, seed=2)
    tx, tw, ty = (Tensor(v, device=device) for v in (x, w, y))
    tol = {"dtype": "float32", "rtol": 1e-4, "atol": 1e-3}
    assert_matches(tx @ tw.T, x.astype(np.float64) @ w.T, **tol)  # a weight shared by the batch
    assert_matches(tx @ ty, x.astype(np.float64) @ y, **tol)  # batched
    assert_matches(tx[1:, 3:67, 4:92] @ ty[1:, 4:92, ::2], x[1:, 3:67, 4:92].astype(np.float64) @ y[1:, 4:92, ::2],
                   **tol)  # offsets and strides
    assert_matches(tx[:, ::-1] @ tw[::-1].T, x[:, ::-1].astype(np.float64) @ w[::-1].T, **tol)  # negative strides
    assert_matches((tx @ tw.T + Tensor(w[:, 0], device=device)).relu(),
                   np.maximum(x.astype(np.float64) @ w.T + w[:, 0], 0), **tol)  # under its epilogue
