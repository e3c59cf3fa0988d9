"""CUDA devices with the rest of the runtime: uploads and downloads through pinned staging (small, chunked and
overlapped), peer copies between GPUs, one plan across cuda and c devices, cross-device waits, concurrency,
cancellation, graph replay of a steady plan, and memory accounting. Runs where a GPU is present (the lent H200:
`nvidia-h200` for one GPU, `nvidia-h200-x2` for the peer routes); the op suite itself runs with
AZYX_TEST_DEVICES=cuda:0."""

from __future__ import annotations

import asyncio
import gc

import numpy as np
import pytest
from runtime_state import settle
from scenarios import cancel_transfers, spread_tasks

import azyx
from azyx import Tensor
from azyx.executor import SyncStrategy
from azyx.graph import GRAPH
from azyx.plan import TransferStep
from azyx.runtime import RT

GPUS = [d for d in azyx.devices() if d.startswith("cuda:")]
pytestmark = pytest.mark.skipif(not GPUS, reason="no CUDA device")
two_gpus = pytest.mark.skipif(len(GPUS) < 2, reason="needs two CUDA devices")
rng = np.random.default_rng(6)


def test_sync_strategies() -> None:
    ex = RT.executor
    assert ex.sync_strategy("cuda:0", "cuda:0") is SyncStrategy.SAME_DEVICE
    assert ex.sync_strategy("cuda:0", "c:0") is SyncStrategy.HOST_STAGED
    if len(GPUS) > 1:
        assert ex.sync_strategy("cuda:0", "cuda:1") is SyncStrategy.PEER


@pytest.mark.parametrize("n", [1, 4097, 3 << 20, 5 << 20])  # one chunk staged at once ... several, overlapped
def test_uploads_and_downloads_of_every_size(n: int) -> None:
    xn = rng.standard_normal(n).astype(np.float32)
    t = Tensor(xn, device="c:0").to("cuda:0")
    np.testing.assert_array_equal(t.numpy_sync(), xn)
    back = (t * 2).to("c:1")
    np.testing.assert_array_equal(back.numpy_sync(), xn * 2)


@pytest.mark.parametrize("route", [("c:0", "cuda:0", "c:1", "cuda:0", "c:0"), ("cuda:0", "c:0", "cuda:0")])
def test_round_trips_keep_every_dtype(route: tuple[str, ...]) -> None:
    for dt in ["float32", "float64", "int32", "int8", "bool", "float16", "int64"]:
        xn = (rng.standard_normal(257) * 10).astype(dt)
        t = Tensor(xn, device=route[0])
        for d in route[1:]:
            t = t.to(d)
        np.testing.assert_array_equal(t.numpy_sync(), xn)


def test_a_chain_hopping_devices_is_one_plan_with_transfers() -> None:
    gpu_b = GPUS[-1]
    an, bn = rng.standard_normal((64, 96)).astype(np.float32), rng.standard_normal((96, 32)).astype(np.float32)
    a, b = Tensor(an, device="c:0"), Tensor(bn, device="c:0")
    h1 = (a * 2 + 1).to("cuda:0")
    h2 = (h1 @ b.to("cuda:0")).relu().to(gpu_b)  # peer where there are two GPUs
    h3 = (h2.sum(axis=1, keepdim=True) - h2).to("c:1")
    out = (h3 * 0.5 + h3.max()).to("c:0")
    plan = azyx.schedule(out)
    hops = {(s.src_device, s.dst_device) for s in plan.steps if isinstance(s, TransferStep)}
    assert ("c:0", "cuda:0") in hops and (gpu_b, "c:1") in hops
    r2 = np.maximum((an * 2 + 1) @ bn, 0)
    r3 = r2.sum(axis=1, keepdims=True) - r2
    np.testing.assert_allclose(out.numpy_sync(), r3 * 0.5 + r3.max(), rtol=1e-4, atol=1e-3)


@two_gpus
@pytest.mark.parametrize("n", [1000, 9 << 20])
def test_peer_copies_both_ways(n: int) -> None:
    xn = rng.standard_normal(n).astype(np.float32)
    x = Tensor(xn, device="cuda:0")
    y = (x + 1).to("cuda:1")
    z = (y * 3).to("cuda:0") - x  # cuda:1 waits for cuda:0's kernel, then cuda:0 for cuda:1's
    np.testing.assert_allclose(z.numpy_sync(), (xn + 1) * 3 - xn, rtol=1e-6, atol=1e-5)
    np.testing.assert_allclose(y.numpy_sync(), xn + 1, rtol=1e-6)


async def test_200_concurrent_tasks_spread_over_all_devices() -> None:
    base = await settle()
    await spread_tasks(["c:0", "c:1", *GPUS], rng)
    assert await settle() == base


@pytest.mark.parametrize("yields", [0, 1, 3, 10])
async def test_cancelling_mid_transfer_leaks_nothing(yields: int) -> None:
    base = await settle()
    await cancel_transfers(yields, "cuda:0", 3 << 20)
    assert await settle() == base


async def test_a_steady_plan_replays_as_a_cuda_graph() -> None:
    """A single-device plan of several kernels, run again on new data: from the second sighting of the same buffers
    it is one graph launch, and every run still computes its own inputs."""
    dev = RT.device("cuda:0")
    x = Tensor(rng.standard_normal((256, 512)).astype(np.float32), device="cuda:0")
    for _ in range(8):
        x = x * 0.5 + 0.25  # new data each run, made on the device (host data would make it a two-device plan)
        await x.realize()
        out = ((x * 3).softmax(axis=-1) @ x.T).sum(axis=0)  # several kernels: max, sum, normalise, matmul, sum
        got = await out.numpy()
        xn = (await x.numpy()).astype(np.float64)
        e = np.exp(xn * 3 - (xn * 3).max(axis=-1, keepdims=True))
        ref = ((e / e.sum(axis=-1, keepdims=True)) @ xn.T).sum(axis=0)
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4)
    assert any(not isinstance(g, int) for g in dev.graph_cache.graphs.values())  # type: ignore[attr-defined]


async def test_a_plan_of_one_kernel_runs_through_the_devices_lane() -> None:
    """A plan of one kernel is run by the device's lane (one native call from bindings to launch and event): with a new
    scalar each run it computes numpy's values, each run is one command on the stream, its output blocks come back to
    the pool, and a run that reads the last one's output waits for nothing the stream does not order."""
    from azyx.native import native
    from azyx.walk import canonicalize

    dev = RT.device("cuda:0")
    xn = rng.standard_normal(4096).astype(np.float32)
    x = Tensor(xn, device="cuda:0")
    await x.realize()
    await ((x * 0.5 + 1).relu()).realize()  # (planned and compiled)
    await RT.executor.synchronize_all()
    gc.collect()  # (an earlier test's garbage frees its blocks now, not mid-test)
    in_use = dev.allocator.in_use
    for k in range(40):
        a = 0.25 * k - 3.0
        before = dev.queued()
        y = (x * a + 1).relu()
        await y.realize()
        assert dev.queued() == before + 1
        np.testing.assert_allclose(await y.numpy(), np.maximum(xn * np.float32(a) + 1, 0), rtol=1e-6, atol=1e-6)
        del y
    probe = (x * 2.0 + 1).relu()
    plan = RT.plan_cache.get(canonicalize(GRAPH, [probe.id]).key)
    assert plan is not None and len(plan.kernels) == 1
    assert (RT.executor.prepared[plan].lane is not None) == (native is not None)
    await RT.executor.synchronize_all()
    gc.collect()
    assert dev.allocator.in_use == in_use  # (every run's output block went back)
    chain = x
    for k in range(20):  # each run reads the previous run's output, still on the stream
        chain = (chain * 0.5 + float(k)).relu()
        await chain.realize()
    want = xn.copy()
    for k in range(20):
        want = np.maximum(want * np.float32(0.5) + np.float32(k), 0)
    np.testing.assert_allclose(await chain.numpy(), want, rtol=1e-5)


async def test_driver_calls_hold_the_gil_on_the_loop_and_let_it_go_elsewhere() -> None:
    """The launch path's ctypes calls keep the GIL on the loop's thread (hundreds a step); on any other thread they let
    it go (there a call may block on the driver's lock while another thread pins memory)."""
    hot = RT.device("cuda:0").hot
    assert hot.here() is hot
    off_loop = await asyncio.to_thread(hot.here)
    assert off_loop is hot.releasing and off_loop is not hot


async def test_small_copies_with_no_pinned_block_cached_pin_off_the_loop() -> None:
    """A small upload and a small read find the staging pool empty: the block is pinned on the submitter thread (a
    fresh pin takes milliseconds), and the data arrives whole."""
    from azyx.backends.cuda_driver import cu

    dev = RT.device("cuda:0")
    await settle()
    for block in dev.staging.pool.take_cached():
        cu.cuMemFreeHost(block.ptr)
    xn = rng.standard_normal(1000).astype(np.float32)
    t = await Tensor(xn, device="cuda:0").realize()
    for block in dev.staging.pool.take_cached():
        cu.cuMemFreeHost(block.ptr)
    np.testing.assert_array_equal(await (t * 3).numpy(), xn * 3)
    assert dev.staging.pool.usage().cached > 0  # (the read's block, pinned on the submitter, is kept for the next)
    np.testing.assert_array_equal(await (t - 1).numpy(), xn - 1)


async def test_small_blocks_are_pieces_of_slabs_and_hold_their_data() -> None:
    """Blocks of up to 256 KiB are carved from 2 MiB slabs (a cuMemAlloc each would cost the loop 0.3-1.5 ms when a
    crowd's pool grows), at 256-byte-aligned addresses; each holds its own data; emptying the cache keeps them."""
    from azyx.backends.cuda import SLAB, SLAB_ALIGN

    dev = RT.device("cuda:0")
    slabs = len(dev.slabs.pieces)  # (the slabs made: each has pieces out until the device closes)
    xs = [rng.standard_normal(n).astype(np.float32) for n in (1, 17, 250, 1000, 4097, 30000, 65536)] * 8
    ts = [await (Tensor(x, device="cuda:0") * 2 + 1).realize() for x in xs]
    ptrs = [GRAPH[t.id].buffer.ptr for t in ts]  # type: ignore[union-attr]
    assert len(set(ptrs)) == len(ptrs)
    assert all(p % SLAB_ALIGN == 0 and p in dev.slabs.of for p in ptrs)
    assert len(dev.slabs.pieces) - slabs <= 1 + sum(x.nbytes for x in xs) * 2 // SLAB
    dev.empty_cache()
    for t, x in zip(ts, xs):
        np.testing.assert_array_equal(await t.numpy(), x * 2 + 1)
    del ts
    await settle()
    dev.empty_cache()
    assert dev.allocator.usage().cached > 0  # (the pieces stay cached for the next small blocks)
    y = rng.standard_normal(3000).astype(np.float32)
    np.testing.assert_array_equal(await (Tensor(y, device="cuda:0") - 1).numpy(), y - 1)


def test_a_staging_block_in_a_garbage_cycle_goes_back_to_its_pool_intact() -> None:
    """Pinned staging blocks reach the cyclic GC inside garbage cycles (a traceback, a cancelled task's frames): the
    block goes back to the pool and must still be its own pinned memory. (It was once freed under the pool by its
    own finalizer, then handed out again: two blocks aliased, copies failed or read each other's data.)"""
    import gc

    from azyx.backends.cuda_driver import check, cu

    dev = RT.device("cuda:0")
    size_attr = cu.CUpointer_attribute.CU_POINTER_ATTRIBUTE_RANGE_SIZE
    for n in (64, 8192, 3 << 20):
        staged = dev.staging.lend(n)  # type: ignore[attr-defined]
        ptr, size = staged.block.ptr, staged.size
        cycle: list[object] = [staged]
        cycle.append(cycle)
        del staged, cycle
        gc.collect()
        assert ptr in [b.ptr for b in dev.staging.pool.cached_blocks(size)]  # type: ignore[attr-defined]
        assert check(cu.cuPointerGetAttribute(size_attr, ptr), "cuPointerGetAttribute") == size
        xn = rng.standard_normal(n // 4).astype(np.float32)
        np.testing.assert_array_equal((Tensor(xn, device="c:0").to("cuda:0") + 1).numpy_sync(), xn + 1)


def test_memory_accounting_and_allocation_errors() -> None:
    dev = RT.device("cuda:0")
    before = dev.free_memory()
    buf = dev.alloc(256 << 20)
    assert dev.free_memory() <= before - (256 << 20)
    del buf
    assert dev.free_memory() >= before - (1 << 20)
    with pytest.raises(azyx.AllocationError, match="cuda:0"):
        dev.alloc(dev.capacity + (1 << 30))
    np.testing.assert_allclose((Tensor([1.0, 2.0], device="cuda:0") * 2).numpy_sync(), [2.0, 4.0])
