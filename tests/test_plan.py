"""The scheduler: fusion decisions, the plan cache, views without kernels, constant folding, transfers."""

from __future__ import annotations

import numpy as np
import pytest

import azyx
from azyx import Tensor
from azyx.executor import SyncStrategy
from azyx.graph import GRAPH, Op
from azyx.plan import KernelStep, TransferStep
from azyx.runtime import RT

rng = np.random.default_rng(7)


def _kernels(*ts: Tensor) -> list[KernelStep]:
    return azyx.schedule(*ts).kernels


def test_elementwise_chain_is_one_kernel() -> None:
    a, b, c = (Tensor(rng.standard_normal((16, 8)).astype(np.float32)) for _ in range(3))
    y = ((a * b + c).relu() * 0.5 + a).exp().permute(1, 0).reshape(4, 32)
    assert len(_kernels(y)) == 1
    an, bn, cn = a.numpy_sync(), b.numpy_sync(), c.numpy_sync()
    np.testing.assert_allclose(y.numpy_sync(), np.exp(np.maximum(an * bn + cn, 0) * 0.5 + an).T.reshape(4, 32),
                               rtol=1e-5)


def test_reduce_fuses_its_inputs_and_same_size_consumers() -> None:
    x = Tensor(rng.standard_normal((32, 64)).astype(np.float32))
    y = ((x * 2).exp().sum(axis=1) + 1).sqrt()
    assert len(_kernels(y)) == 1
    xn = x.numpy_sync()
    np.testing.assert_allclose(y.numpy_sync(), np.sqrt(np.exp(xn * 2).sum(axis=1) + 1), rtol=1e-5)


def test_matmul_is_one_fused_multiply_reduce() -> None:
    a = Tensor(rng.standard_normal((64, 48)).astype(np.float32))
    b = Tensor(rng.standard_normal((48, 32)).astype(np.float32))
    ks = _kernels(a @ b)
    # one kernel: the generic reduce's accumulators, or the C backend's product template (64 rows take it)
    assert len(ks) == 1 and ("acc" in ks[0].src or "AZYX_HOST_GEMM" in ks[0].src)
    np.testing.assert_allclose((a @ b).numpy_sync(), a.numpy_sync() @ b.numpy_sync(), rtol=1e-4, atol=1e-4)


def test_softmax_realizes_its_reductions() -> None:
    x = Tensor(rng.standard_normal((8, 100)).astype(np.float32))
    assert len(_kernels(x.softmax())) == 3  # max, sum of exp, normalise


def test_pure_view_makes_no_kernel_and_shares_the_buffer() -> None:
    """On a host-memory device a view of host data is that data (a GPU would upload, and copy the view then)."""
    xn = rng.standard_normal((6, 4)).astype(np.float32)
    x = Tensor(xn, device="c:0").realize_sync()
    for view, ref in [(x.T, xn.T), (x[1:5:2, ::-1], xn[1:5:2, ::-1]), (x.reshape(3, 8), xn.reshape(3, 8)),
                      (x[None, 2].expand(3, 4), np.broadcast_to(xn[None, 2], (3, 4)))]:
        assert _kernels(view) == []
        np.testing.assert_array_equal(view.numpy_sync(), ref)
        assert GRAPH[view.id].buffer is GRAPH[x.id].buffer
    # a view of a view still reads right, and feeds kernels through its strides
    vv = x.T[::-1]
    np.testing.assert_array_equal((vv.realize_sync() + 1).numpy_sync(), xn.T[::-1] + 1)


def test_a_broadcast_single_element_fuses_into_its_consumer() -> None:
    s = Tensor(np.float32(2.0))
    xn = rng.standard_normal((64, 64)).astype(np.float32)
    z = Tensor(xn) * (s * 3 + 1).reciprocal()  # computed once per kernel (it depends on no loop): no kernel of its own
    ks = _kernels(z)
    assert len(ks) == 1
    np.testing.assert_allclose(z.numpy_sync(), xn / 7, rtol=1e-6)


def test_a_computed_value_read_whole_through_a_transpose_is_not_copied() -> None:
    xn, wn, yn = (rng.standard_normal(s).astype(np.float32) for s in ((32, 48), (16, 48), (32, 20)))
    c = "c:0"  # a device with register-tiled matmuls (which read their right operand transposed)
    g = (Tensor(xn, device=c) @ Tensor(wn, device=c).T).relu()  # read by two kernels: it gets a buffer of its own
    dw, db = g.T @ Tensor(yn, device=c), g.sum(axis=0)
    ks = _kernels(dw, db)  # W transposed once (matmul operand), g, dw (reading g through a view), db
    assert len(ks) == 4
    gn = np.maximum(xn @ wn.T, 0)
    np.testing.assert_allclose(dw.numpy_sync(), gn.T @ yn, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(db.numpy_sync(), gn.sum(axis=0), rtol=1e-4, atol=1e-4)


def test_constants_fold_at_build_time() -> None:
    t = (Tensor.full((3, 4), 2.0) + 3) * Tensor.ones(3, 4) - 1
    n = GRAPH[t.id]
    assert n.op is Op.CONST and n.arg == 4.0
    x = Tensor(np.ones((3, 4), np.float32))
    k = _kernels(x * (Tensor.full((3, 4), 2.0) * 3))[0]
    # the folded constant is one scalar argument of the kernel (bound per run), not a buffer and not a literal
    assert "6.0" not in k.src and len(k.args) == 2 and k.scalars == (0,)


def test_plan_cache_skips_scheduling_for_a_repeated_structure() -> None:
    def graph(data: np.ndarray) -> Tensor:
        x = Tensor(data)
        return ((x * 3).relu() + x).sum(axis=0)

    d1, d2 = (rng.standard_normal((5, 7)).astype(np.float32) for _ in range(2))
    out1 = graph(d1).numpy_sync()
    before = len(RT.plan_cache)
    p1 = azyx.schedule(graph(d1))
    p2 = azyx.schedule(graph(d2))
    assert p1 is p2 and len(RT.plan_cache) == before
    np.testing.assert_allclose(out1, (np.maximum(d1 * 3, 0) + d1).sum(0), rtol=1e-5)
    np.testing.assert_allclose(graph(d2).numpy_sync(), (np.maximum(d2 * 3, 0) + d2).sum(0), rtol=1e-5)
    assert len(RT.plan_cache) == before
    # the structure includes how inputs are shared: x + x and x + y are different plans
    x, y = Tensor(d1), Tensor(d2)
    assert azyx.schedule(x + x) is not azyx.schedule(x + y)
    np.testing.assert_allclose((x + x).numpy_sync(), d1 + d1)
    np.testing.assert_allclose((x + y).numpy_sync(), d1 + d2)


def test_transfers_between_c_devices() -> None:
    xn = rng.standard_normal(1000).astype(np.float32)
    x = Tensor(xn, device="c:0")
    y = ((x * 2).to("c:1") + 1).to("c:0") * x
    plan = azyx.schedule(y)
    transfers = [s for s in plan.steps if isinstance(s, TransferStep)]
    assert [(s.src_device, s.dst_device) for s in transfers] == [("c:0", "c:1"), ("c:1", "c:0")]
    assert RT.executor.sync_strategy("c:0", "c:1") is SyncStrategy.PEER
    assert RT.executor.sync_strategy("c:0", "c:0") is SyncStrategy.SAME_DEVICE
    assert plan.devices == ("c:0", "c:1")
    assert azyx.schedule(x * 3).devices == ("c:0",)
    np.testing.assert_allclose(y.numpy_sync(), (xn * 2 + 1) * xn, rtol=1e-6)
    assert y.device == "c:0"


def test_mixing_pinned_devices_needs_an_explicit_move() -> None:
    a, b = Tensor([1.0], device="c:0"), Tensor([2.0], device="c:1")
    with pytest.raises(azyx.DeviceError, match="c:1"):
        a + b
    np.testing.assert_allclose((a + b.to("c:0")).numpy_sync(), [3.0])
    # an AUTO-placed operand follows the pinned one
    auto = Tensor([5.0])
    assert (auto + b).device == "c:1"
    np.testing.assert_allclose((auto + b).numpy_sync(), [7.0])


def test_dummy_device_plans_and_accounts_without_computing() -> None:
    dummy = RT.device("dummy:0")
    x = Tensor.zeros(64, 64, device="dummy:0") + 1
    y = (x @ x).relu()
    plan = azyx.schedule(y)
    assert plan.devices == ("dummy:0",)
    before = list(dummy.launched)
    y.realize_sync()
    assert dummy.launched[len(before):] == [k.name for k in plan.kernels]
    with pytest.raises(azyx.DeviceError, match="dummy"):
        y.numpy_sync()


def test_a_plan_that_fits_nowhere_raises_and_the_runtime_stays_usable() -> None:
    big = Tensor.zeros(1024, 1024, device="dummy:0") + 1  # 4 MiB on a 1 MiB device
    with pytest.raises(azyx.AllocationError, match="4194304 bytes on dummy:0"):
        big.realize_sync()
    small = Tensor.zeros(16, device="dummy:0") + 1
    small.realize_sync()
    np.testing.assert_allclose((Tensor([1.0, 2.0]) * 2).numpy_sync(), [2.0, 4.0])


def test_auto_placement_prefers_compute_then_memory() -> None:
    from azyx.runtime import Runtime

    rt = Runtime()
    rt.configure({"c": {"devices": 1}, "cuda": {"enabled": False}, "opencl": {"enabled": False},
                  "vulkan": {"enabled": False}, "wgpu": {"enabled": False},
                  "dummy": {"enabled": True, "memory": 1 << 20, "compute": 1e9}})
    try:
        assert rt.auto_order()[0] == "dummy:0"
        assert rt.resolve_device(None, 1 << 10) == ("dummy:0", False)  # most compute, and it fits
        assert rt.resolve_device(None, 1 << 24) == ("c:0", False)  # does not fit there: next by compute
        assert rt.resolve_device("c:0", 1 << 40) == ("c:0", True)  # explicit devices are honoured
        with pytest.raises(azyx.AllocationError, match="fit on no device"):
            rt.resolve_device(None, 1 << 60)
        with pytest.raises(azyx.DeviceError, match="'tpu:3'"):
            rt.resolve_device("tpu:3", 1)
    finally:
        rt.shutdown()


async def test_compiler_failure_raises_compile_error_with_its_message() -> None:
    from azyx.backends.c import CDevice

    x = Tensor(np.arange(4111, dtype=np.float32)) + 41.5  # (a loop bound no other test has: a kernel not yet built)
    step = azyx.schedule(x).kernels[0]
    bad = CDevice(9, {"compiler": "gcc", "flags": ["-O2", "-fazyx-no-such-flag"]})
    with pytest.raises(azyx.CompileError, match="azyx-no-such-flag"):
        await bad.compile([step])
    np.testing.assert_allclose(await x.numpy(), np.arange(4111) + 41.5)


async def test_memory_is_pooled_and_returned() -> None:
    import gc

    dev = RT.device("c:0")
    x = Tensor(rng.standard_normal(1 << 16).astype(np.float32), device="c:0")

    async def in_use() -> int:
        await azyx.synchronize()  # queued work holds its buffers until it has run
        gc.collect()
        return dev.allocator.in_use

    base = await in_use()
    for _ in range(3):
        y = await (x * 2 + 1).realize()
        assert await in_use() == base + (1 << 18)
        del y
        assert await in_use() == base
    assert dev.allocator.cached >= 1 << 18


async def test_the_plan_cache_is_bounded_least_recently_used_first(device: str) -> None:
    with pytest.raises(azyx.AzyxError, match="plan_cache_size.*0"):
        azyx.configure({"runtime": {"plan_cache_size": 0}})
    cache, saved = RT.plan_cache, RT.plan_cache.capacity
    cache.capacity = len(cache) + 3
    try:
        xs = [np.arange(n, dtype=np.float32) for n in range(1, 9)]  # 8 structures (shapes), 3 places
        for x in xs + xs[:2]:
            got = await (Tensor(x, device=device) * 2 + 1).numpy()
            np.testing.assert_array_equal(got, x * 2 + 1)  # an evicted structure is planned again
            assert len(cache) <= cache.capacity
        def by_use() -> list[tuple]:  # least recently used first
            return sorted(cache, key=lambda k: cache.stamps[id(cache[k])])

        order = by_use()
        np.testing.assert_array_equal(await (Tensor(xs[0], device=device) * 2 + 1).numpy(), xs[0] * 2 + 1)
        assert set(cache) == set(order)  # a hit: no new plan ...
        hit = by_use()[-1]
        assert hit != order[-1] and by_use() == [k for k in order if k != hit] + [hit]  # ... now the most recent
        oldest = cache.least_recent()
        assert oldest == by_use()[0]
        await (Tensor(np.ones(11, np.float32), device=device) * 2 + 1).numpy()  # a new structure drops the oldest
        assert oldest not in cache and hit in cache and len(cache) <= cache.capacity
    finally:
        cache.capacity = saved


async def test_a_new_graph_is_walked_once_and_again_only_where_it_changed_while_planned(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A realize that misses the plan cache plans the walk it made and runs the plan on it (one walk); where the graph
    changed while it was planned (a tensor rebound, a node realized by another realize), it walks again and computes
    the graph as it is now."""
    import asyncio
    import importlib

    realize_module = importlib.import_module("azyx.realize")  # (the module: `azyx.realize` is the function)

    walks: list[list[int]] = []
    real = realize_module.canonicalize
    monkeypatch.setattr(realize_module, "canonicalize", lambda g, targets: walks.append(targets) or real(g, targets))
    xn = rng.standard_normal((41, 43)).astype(np.float32)  # (a shape no other test has: new plans, new kernels)
    x = await Tensor(xn, device="c:0").realize()
    walks.clear()
    y = (x * 3.25 + 0.5).exp()
    np.testing.assert_allclose(await y.numpy(), np.exp(xn * np.float32(3.25) + np.float32(0.5)), rtol=1e-5)
    assert len(walks) == 1  # (the read of a realized tensor walks nothing)
    # rebound while its realize plans: the realize computes the tensor's new value
    t = (x * 2.5 + 0.125).abs().sqrt()
    task = asyncio.create_task(t.realize())
    await asyncio.sleep(0)  # (the task walks and starts planning, then waits for its compile)
    t.assign((x * 5.5 + 0.125).abs().sqrt())
    await task
    # (atol: where x * 5.5 + 0.125 is near 0, a fused multiply-add rounds once and numpy twice: the root of that
    # difference is ~1e-7 absolute, past rtol alone for some draws of the module's generator)
    np.testing.assert_allclose(await t.numpy(), np.sqrt(np.abs(xn * np.float32(5.5) + np.float32(0.125))), rtol=1e-5,
                               atol=1e-6)
    # a node of the graph realized by another realize meanwhile (a cached plan: at once), its sources freed: the graph
    # is walked again and that node's buffer is read
    await (x * 1.75 - 0.25).realize()
    a = x * 1.75 - 0.25
    b = (a * a + 1.0).log()
    await asyncio.gather(b.realize(), a.realize())
    an = xn * np.float32(1.75) - np.float32(0.25)
    np.testing.assert_allclose(await a.numpy(), an, rtol=1e-5, atol=1e-6)  # (a fused multiply-add)
    np.testing.assert_allclose(await b.numpy(), np.log(an * an + 1), rtol=1e-5, atol=1e-6)
