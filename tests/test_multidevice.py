"""One plan across c:0, c:1 and opencl:0: transfers by sync strategy, cross-device waits, placement, concurrency,
cancellation, and the OpenCL backend's errors and absence."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import numpy as np
import pytest
from runtime_state import settle
from scenarios import cancel_transfers, spread_tasks

import azyx
from azyx import Tensor
from azyx.executor import SyncStrategy
from azyx.plan import TransferStep
from azyx.runtime import RT

pytestmark = pytest.mark.skipif("opencl:0" not in azyx.devices(), reason="no OpenCL device (install PoCL)")
rng = np.random.default_rng(3)


def test_sync_strategies() -> None:
    ex = RT.executor
    assert ex.sync_strategy("c:0", "c:0") is SyncStrategy.SAME_DEVICE
    assert ex.sync_strategy("c:0", "c:1") is SyncStrategy.PEER
    assert ex.sync_strategy("opencl:0", "opencl:0") is SyncStrategy.SAME_DEVICE
    assert ex.sync_strategy("c:0", "opencl:0") is SyncStrategy.HOST_STAGED
    assert ex.sync_strategy("opencl:0", "c:1") is SyncStrategy.HOST_STAGED


def test_a_chain_hopping_devices_is_one_plan_with_transfers() -> None:
    an, bn = rng.standard_normal((32, 48)).astype(np.float32), rng.standard_normal((48, 16)).astype(np.float32)
    a, b = Tensor(an, device="c:0"), Tensor(bn, device="c:0")
    h1 = (a * 2 + 1).to("opencl:0")  # c:0 -> opencl:0
    h2 = (h1 @ b.to("opencl:0")).relu().to("c:1")  # opencl:0 -> c:1
    h3 = (h2.sum(axis=1, keepdim=True) - h2).to("c:0")  # c:1 -> c:0
    out = h3 * 0.5 + h3.max()
    plan = azyx.schedule(out)
    hops = [(s.src_device, s.dst_device) for s in plan.steps if isinstance(s, TransferStep)]
    assert ("c:0", "opencl:0") in hops and ("opencl:0", "c:1") in hops and ("c:1", "c:0") in hops
    assert set(plan.devices) == {"c:0", "c:1", "opencl:0"}
    r2 = np.maximum((an * 2 + 1) @ bn, 0)
    r3 = r2.sum(axis=1, keepdims=True) - r2
    np.testing.assert_allclose(out.numpy_sync(), r3 * 0.5 + r3.max(), rtol=1e-4, atol=1e-3)
    assert out.device == "c:0"


@pytest.mark.parametrize("route", [("c:0", "opencl:0", "c:1", "c:0"), ("opencl:0", "c:1", "opencl:0", "c:0")])
def test_round_trips_keep_every_dtype(route: tuple[str, ...]) -> None:
    for dt in ["float32", "float64", "int32", "int8", "bool", "float16"]:
        xn = (rng.standard_normal(257) * 10).astype(dt)
        t = Tensor(xn, device=route[0])
        for d in route[1:]:
            t = t.to(d)
        np.testing.assert_array_equal(t.numpy_sync(), xn)


async def test_200_concurrent_tasks_spread_over_all_devices() -> None:
    base = await settle()
    await spread_tasks(["c:0", "c:1", "opencl:0"], rng)
    assert await settle() == base


@pytest.mark.parametrize("yields", [0, 1, 3, 10])
async def test_cancelling_mid_transfer_leaks_nothing(yields: int) -> None:
    base = await settle()
    await cancel_transfers(yields, "opencl:0", 1 << 20)
    assert await settle() == base


def test_auto_placement_keeps_a_kernel_with_its_inputs() -> None:
    xn = rng.standard_normal(1 << 16).astype(np.float32)
    x = Tensor(xn).realize_sync()  # AUTO: lands on a device (not pinned)
    home = x.device
    other = next(d for d in azyx.devices() if d != home)
    y = (x * 3).exp().sum()
    saved = RT.device(other).compute
    try:
        RT.device(other).compute = saved * 2  # faster, but moving 256 KiB there costs more than computing here
        plan = azyx.schedule(y)
        assert {k.device for k in plan.kernels} == {home} and not any(isinstance(s, TransferStep) for s in plan.steps)
    finally:
        RT.device(other).compute = saved
    np.testing.assert_allclose(y.numpy_sync(), np.exp(xn * 3).sum(), rtol=1e-4)


def test_auto_placement_moves_heavy_work_to_a_much_faster_device() -> None:
    an = rng.standard_normal((256, 256)).astype(np.float32)
    a = Tensor(an).realize_sync()
    home = a.device
    other = next(d for d in azyx.devices() if d != home)
    y = (a @ a).relu() @ a
    saved = RT.device(other).compute
    try:
        RT.device(other).compute = saved * 1e4
        plan = azyx.schedule(y)
        assert {k.device for k in plan.kernels} == {other}
        assert any(isinstance(s, TransferStep) and s.dst_device == other for s in plan.steps)
        np.testing.assert_allclose(y.numpy_sync(), np.maximum(an @ an, 0) @ an, rtol=1e-3, atol=1e-2)
    finally:
        RT.device(other).compute = saved
    assert y.device == other  # an AUTO tensor reports where its data is


def test_auto_device_for_new_tensors_prefers_free_compute() -> None:
    order = RT.auto_order()
    assert order[0] in azyx.devices()
    best = max(azyx.devices(), key=lambda d: RT.device(d).compute)
    assert RT.resolve_device(None, 16) == (order[0], False)
    assert RT.device(order[0]).compute == RT.device(best).compute


async def test_opencl_queues_a_steady_command_on_the_calling_thread() -> None:
    """PoCL's enqueue blocks while its thread compiles a launch's work-group function: a command with a launch queued
    for the first time goes to the device's submit thread, and so does any while one such is running; then the same
    launches and the reads are queued by their caller (no hand-over to that thread), with the same values."""
    dev = RT.device("opencl:0")
    x = Tensor(np.arange(1000, dtype=np.float32), device="opencl:0")
    await x.realize()
    before = dev.queue.handed
    want = np.maximum(np.arange(1000, dtype=np.float32) * 2 - 7, 0)
    np.testing.assert_allclose(await ((x * 2 - 7).relu()).numpy(), want)  # (a new launch)
    assert dev.queue.handed > before
    await azyx.synchronize()
    for _ in range(2):  # (the first again: the read of the steady run's output may have been handed over)
        before = dev.queue.handed
        np.testing.assert_allclose(await ((x * 2 - 7).relu()).numpy(), want)
    assert dev.queue.handed == before
    np.testing.assert_allclose(await ((x * 1e-3).exp().sum()).numpy(), np.exp(np.arange(1000) * 1e-3).sum(), rtol=1e-5)
    assert dev.queue.handed > before  # (new launches)


async def test_opencl_build_error_carries_the_build_log() -> None:
    x = Tensor(np.ones(8, np.float32), device="opencl:0") + 2.5
    step = azyx.schedule(x).kernels[0]
    broken = dataclasses.replace(step, name="k_broken", src=step.src.replace(step.name, "k_broken").replace(
        "{", "{ this_is_not_opencl;", 1))
    with pytest.raises(azyx.CompileError, match="this_is_not_opencl"):
        await RT.device("opencl:0").compile([broken])
    np.testing.assert_allclose(await x.numpy(), np.full(8, 3.5))


def test_opencl_backend_is_skipped_cleanly_without_pyopencl(tmp_path: object) -> None:
    script = ("import sys; sys.modules['pyopencl'] = None\n"
              "import azyx, numpy as np\nprint('DEVICES', azyx.devices())\n"
              "print('RESULT', (azyx.Tensor([1.0, 2.0]) * 2).numpy_sync().tolist())\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("AZYX_")}
    out = subprocess.run([sys.executable, "-c", script], env={**env, "AZYX_DEBUG": "1"}, capture_output=True,
                         text=True, timeout=120, check=True)
    assert "backend opencl skipped" in out.stderr and "pyopencl" in out.stderr
    assert "opencl" not in out.stdout.split("DEVICES")[1].splitlines()[0]
    assert "RESULT [2.0, 4.0]" in out.stdout
