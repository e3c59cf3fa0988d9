"""Integer-tensor indices out of range raise IndexOutOfRange when realized, on every device (issue 36): the kernels
flag them in the device's check words, which the run's record reads with its completion. torch raises IndexError for
each of these; azyx used to clamp silently."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import azyx
from azyx import Tensor, nn
from azyx.errors import IndexOutOfRange


def _raises(f: object, value: int, size: int) -> None:
    with pytest.raises(IndexOutOfRange, match=rf"index {value} is out of range for an axis of size {size}") as e:
        f()  # type: ignore[operator]
    assert isinstance(e.value, IndexError) and isinstance(e.value, azyx.AzyxError)


def test_getitem_with_an_index_tensor_out_of_range(device: str) -> None:
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    t = Tensor(x, device=device)
    with pytest.raises(IndexError):
        torch.from_numpy(x)[torch.tensor([0, 5])]
    _raises(lambda: t[Tensor([0, 5], device=device)].numpy_sync(), 5, 3)
    _raises(lambda: t[:, Tensor([0, -5], device=device)].numpy_sync(), -5, 4)
    _raises(lambda: (t[Tensor([[1], [3]], device=device)] * 2).numpy_sync(), 3, 3)
    # in range (negatives from the end) it reads as numpy does, and the device stays usable after the error
    np.testing.assert_array_equal(t[Tensor([2, -3, 0], device=device)].numpy_sync(), x[[2, -3, 0]])
    np.testing.assert_array_equal(t[:, Tensor([-1], device=device)].numpy_sync(), x[:, [-1]])


def test_gather_out_of_range(device: str) -> None:
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    idx = np.array([[0], [4], [1]])
    with pytest.raises(RuntimeError):  # (torch's gather raises RuntimeError "index 4 is out of bounds")
        torch.from_numpy(x).gather(1, torch.from_numpy(idx))
    t = Tensor(x, device=device)
    _raises(lambda: t.gather(1, Tensor(idx, device=device)).numpy_sync(), 4, 4)
    good = np.array([[0], [3], [1]])
    np.testing.assert_array_equal(t.gather(1, Tensor(good, device=device)).numpy_sync(),
                                  torch.from_numpy(x).gather(1, torch.from_numpy(good)).numpy())


def test_int64_indices_out_of_range(device: str) -> None:
    x = Tensor(np.arange(5, dtype=np.float32), device=device)
    _raises(lambda: x[Tensor([1, 2**33], dtype="int64", device=device)].numpy_sync(), 2**33, 5)
    _raises(lambda: x[Tensor([-6], dtype="int64", device=device)].numpy_sync(), -6, 5)


def test_embedding_id_out_of_range(device: str) -> None:
    emb = nn.Embedding(10, 4, device=device)
    with pytest.raises(IndexError):
        torch.nn.Embedding(10, 4)(torch.tensor([1, 12]))
    _raises(lambda: emb(Tensor([1, 12], device=device)).numpy_sync(), 12, 10)
    w = emb.weight.numpy_sync()
    np.testing.assert_array_equal(emb(Tensor([1, 9], device=device)).numpy_sync(), w[[1, 9]])


def test_cross_entropy_target_out_of_range(device: str) -> None:
    logits = np.random.default_rng(0).standard_normal((3, 10)).astype(np.float32)
    with pytest.raises(IndexError):
        torch.nn.functional.cross_entropy(torch.from_numpy(logits), torch.tensor([1, 10, 2]))
    lg = Tensor(logits, device=device)
    _raises(lambda: nn.cross_entropy(lg, Tensor([1, 10, 2], device=device)).numpy_sync(), 10, 10)
    want = torch.nn.functional.cross_entropy(torch.from_numpy(logits), torch.tensor([1, 9, 2])).item()
    got = nn.cross_entropy(lg, Tensor([1, 9, 2], device=device)).numpy_sync()
    np.testing.assert_allclose(got, want, rtol=1e-5)


def test_cross_entropy_gradient_with_a_bad_target_raises(device: str) -> None:
    """The loss and its gradient come from one realize (the silent case of the issue: loss 1.1513, gradient 0)."""
    lg = Tensor(np.zeros((2, 10), np.float32), device=device)
    with azyx.GradientTape() as tape:
        loss = nn.cross_entropy(lg, Tensor([3, 10], device=device))
    (g,) = tape.gradient(loss, [lg])
    _raises(lambda: g.numpy_sync(), 10, 10)


def test_one_hot_out_of_range(device: str) -> None:
    with pytest.raises(RuntimeError):
        torch.nn.functional.one_hot(torch.tensor([0, 4]), 4)
    _raises(lambda: Tensor([0, 4], device=device).one_hot(4).numpy_sync(), 4, 4)
    got = Tensor([0, 3, 1], device=device).one_hot(4).numpy_sync()
    np.testing.assert_array_equal(got, torch.nn.functional.one_hot(torch.tensor([0, 3, 1]), 4).numpy())


def test_setitem_with_an_index_tensor_out_of_range(device: str) -> None:
    t = Tensor(np.zeros(4, np.float32), device=device)
    t[Tensor([1, 7], device=device)] = 1.0
    with pytest.raises(IndexOutOfRange, match="index 7 is out of range for an axis of size 4"):
        t.numpy_sync()


def test_the_error_reaches_later_realizes_that_read_the_result(device: str) -> None:
    t = Tensor(np.arange(4, dtype=np.float32), device=device)
    bad = t[Tensor([9], device=device)]
    _raises(lambda: bad.realize_sync(), 9, 4)
    _raises(lambda: (bad + 1).numpy_sync(), 9, 4)
    np.testing.assert_array_equal((t + 1).numpy_sync(), [1, 2, 3, 4])


def test_only_the_run_with_the_bad_index_raises(device: str) -> None:
    """Runs in flight together on one device: the one whose index is out of range raises, the others do not."""
    import asyncio

    x = np.arange(20, dtype=np.float32).reshape(5, 4)
    t = Tensor(x, device=device)

    async def main() -> list[object]:
        good = [t[Tensor([i % 5, 4 - i % 5], device=device)] * 1.0 for i in range(4)]
        bad = t[Tensor([1, 8], device=device)] * 1.0
        return await asyncio.gather(*(g.numpy() for g in good[:2]), bad.numpy(), *(g.numpy() for g in good[2:]),
                                    return_exceptions=True)

    got = asyncio.run(main())
    assert isinstance(got[2], IndexOutOfRange) and "index 8 " in str(got[2])
    for i, g in zip([0, 1, 2, 3], got[:2] + got[3:]):
        np.testing.assert_array_equal(g, x[[i % 5, 4 - i % 5]])


def test_checks_off_with_azyx_checks_0() -> None:
    """AZYX_CHECKS=0: kernels do not check (indices clamp into the axis, as before)."""
    code = ("import azyx; from azyx import Tensor; t = Tensor([1.0, 2.0, 3.0], device='c:0'); "
            "print(t[Tensor([0, 5], device='c:0')].numpy_sync().tolist())")
    env = {**os.environ, "AZYX_CHECKS": "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[1.0, 3.0]"


def test_checked_kernels_compile_as_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """CUDA renders from the same C-family code: its checked gather, scatter and assignment kernels compile (NVRTC,
    sm_90, without a GPU) and write the check words."""
    pytest.importorskip("cuda.bindings.nvrtc", reason="cuda-bindings is not installed")
    from azyx.backends.cuda_driver import nvrtc_compile
    from azyx.codegen.dialect import CUDA
    from azyx.codegen.render import kernel_source
    from azyx.runtime import RT

    try:
        from cuda.bindings import nvrtc

        nvrtc.nvrtcVersion()
    except Exception as e:  # pragma: no cover - depends on the environment
        pytest.skip(f"NVRTC unavailable: {e}")
    dev = "dummy:0"
    monkeypatch.setattr(RT.device(dev), "dialect", CUDA)
    monkeypatch.setattr(RT.device(dev), "tiles", False)
    RT.plan_cache.clear()
    try:
        w = Tensor(np.ones((10, 4), np.float32), device=dev)
        ids = Tensor(np.array([1, 12], np.int64), device=dev)
        with azyx.GradientTape() as tape:
            loss = (w[ids] * 2).sum() + nn.cross_entropy(w, Tensor(np.arange(10, dtype=np.int32) % 4, device=dev))
        (g,) = tape.gradient(loss, [w])
        cache = Tensor(np.zeros((4, 3), np.float32), device=dev)
        cache[Tensor(np.array([0, 2], np.int32), device=dev)] = 0.5
        steps = azyx.schedule(g, cache).kernels
        checked = [s for s in steps if s.kernel.check >= 0]
        assert {v.arg.what for s in checked for v in azyx.ir.index_sites(s.kernel)} == {"gather", "scatter", "assign"}
        assert all(f"d{s.kernel.check}[0] = " in s.src for s in checked)
        cubin = nvrtc_compile(kernel_source([s.src for s in {s.name: s for s in steps}.values()], CUDA), "sm_90")
        assert cubin[:4] == b"\x7fELF"
    finally:
        RT.plan_cache.clear()
