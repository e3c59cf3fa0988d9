"""azyx.distributed on a local Ray cluster that the test starts (a head and two worker nodes, processes of this machine
on its own address): a runtime per "host", remote tensors awaited from the driver's event loop, graphs split
into per-host programs joined by transfers through the object store, data-parallel training over the two hosts
giving one host's parameters, and a dead host failing what needs it while the other works on; a plan run again
as a Ray compiled graph giving the same values, the driver's loop turning while it runs, dropped handles' values
freed with the next run."""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

ray = pytest.importorskip("ray", reason="ray is not installed (pip install 'azyx[ray]')")

from ray.cluster_utils import Cluster as RayCluster  # noqa: E402

from azyx import GradientTape, Tensor, distributed, nn, optim  # noqa: E402
from azyx.distributed import Cluster, RemoteError, RemoteTensor, all_reduce, realize, scatter  # noqa: E402

pytestmark = pytest.mark.serial  # (a Ray cluster of three processes: alone, not beside the xdist workers)
rng = np.random.default_rng(9)
# the functions and classes below run on the hosts: shipped by value (the hosts cannot import this test module)
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[None]:
    local = RayCluster(initialize_head=True, head_node_args={
        "num_cpus": 0, "include_dashboard": False, "object_store_memory": 80 << 20})
    for _ in range(2):
        local.add_node(num_cpus=1, object_store_memory=80 << 20)
    ray.init(address=local.address, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()
        local.shutdown()


@pytest.fixture
async def cluster(ray_cluster: None) -> Any:
    c = await Cluster.start(hosts=2)
    yield c
    c.shutdown()


async def test_each_host_is_a_runtime_of_its_own_node(cluster: Cluster) -> None:
    a, b = cluster.hosts
    assert a.node != b.node and "c:0" in a.devices and "c:0" in b.devices
    x = rng.standard_normal((4, 3)).astype(np.float32)
    t = await a.tensor(x)
    assert isinstance(t, RemoteTensor) and t.shape == (4, 3) and t.dtype == "float32"
    np.testing.assert_array_equal(await t.numpy(), x)
    y = (t * 2 + 1).relu().sum(axis=0)  # lazy, on a's runtime
    assert not y.realized
    np.testing.assert_allclose(await y.numpy(), np.maximum(x * 2 + 1, 0).sum(0), rtol=1e-6)


async def test_a_graph_over_two_hosts_splits_into_per_host_programs(cluster: Cluster) -> None:
    a, b = cluster.hosts
    x, w = rng.standard_normal((6, 5)).astype(np.float32), rng.standard_normal((5, 3)).astype(np.float32)
    tx, tw = await a.tensor(x), await b.tensor(w)
    h = (tx * 0.5).exp()  # on a
    y = h.to(b) @ tw  # carried to b, multiplied there
    z = (y.sum(axis=1) + tx.sum(axis=1).to(b)).to(a) * 2  # back on a
    await realize(y, z)  # a, then b, then a: three programs chained by ObjectRefs
    want_y = np.exp(x * 0.5) @ w
    np.testing.assert_allclose(await y.numpy(), want_y, rtol=1e-5)
    want_z = (want_y.sum(1) + x.sum(1)) * 2  # (a sum that can cancel to near 0: its error is its terms' scale's)
    scale = float((np.abs(want_y).sum(1) + np.abs(x).sum(1)).max()) * 2
    np.testing.assert_allclose(await z.numpy(), want_z, rtol=1e-5, atol=1e-6 * scale)
    assert y.realized and y.host is b and z.host is a
    for op, ref in (("sum", np.add), ("max", np.maximum)):  # one value per host, combined, back on each
        v = rng.standard_normal(6).astype(np.float32)
        on_a, on_b = all_reduce([tx.sum(axis=1), (await b.tensor(v)) * 1.0], op)
        assert on_a.host is a and on_b.host is b
        got_a, got_b = await on_a.numpy(), await on_b.numpy()
        np.testing.assert_allclose(got_a, ref(x.sum(1), v), rtol=1e-5)
        np.testing.assert_array_equal(got_a, got_b)  # (each host combined the same values in the same order)
    # an operand on another host without .to(): carried to the op's host (its first operand's)
    np.testing.assert_allclose(await (tx.sum(axis=0) + (await b.tensor(np.ones(5, np.float32)))).numpy(),
                               x.sum(0) + 1, rtol=1e-6)


async def test_many_awaits_from_the_driver_loop_run_concurrently(cluster: Cluster) -> None:
    a, b = cluster.hosts
    xs = [rng.standard_normal(100).astype(np.float32) for _ in range(10)]
    ts = await asyncio.gather(*((a if i % 2 else b).tensor(x) for i, x in enumerate(xs)))
    got = await asyncio.gather(*((t * float(i)).sum().numpy() for i, t in enumerate(ts)))
    for i, (g, x) in enumerate(zip(got, xs)):
        np.testing.assert_allclose(g, (x * i).sum(), rtol=1e-5, atol=1e-5)


def heavy(x: Tensor, n: int) -> Tensor:
    """`n` matrix products in a row: a program that takes a while on its host."""
    for _ in range(n):
        x = (x @ x).tanh()
    return x


async def test_compiled_runs_free_dropped_values_with_the_run_and_leave_the_driver_loop_free(
        cluster: Cluster) -> None:
    a, b = cluster.hosts
    x = rng.standard_normal((256, 256)).astype(np.float32) / 16
    tx = await a.tensor(x)
    held = await b.tensor(np.arange(256, dtype=np.float32))

    def count(host: Any) -> Any:
        return host.actor.__ray_call__.remote(lambda self: len(self.values))

    want = x
    for _ in range(24):
        want = np.tanh(want @ want)
    gaps: list[float] = []
    kept = await count(a)
    for i in range(4):  # run 1 by actor calls, run 2 compiles, runs 3 and 4 compiled
        y = a.call(heavy, tx, 24).to(b).sum(axis=1) + held  # a, then b
        t0 = last = time.perf_counter()
        run = asyncio.ensure_future(y.numpy())
        while not run.done():  # a heartbeat on the driver's loop while the hosts work
            await asyncio.sleep(0.002)
            gaps.append(time.perf_counter() - last)
            last = time.perf_counter()
        np.testing.assert_allclose(await run, want.sum(1) + np.arange(256), rtol=1e-4, atol=1e-3)
        if i >= 2:  # (a loop blocked while the graph runs turns once; a free one every 2 ms, less what load takes: a
            # run of 12 ms turned it 4 times in a CI run on a loaded machine: three turns tell the two apart)
            assert len(gaps) >= 3, (gaps, time.perf_counter() - t0)
        gaps.clear()
        del y  # its value on b: freed with the next run on b (no actor call of its own)
    assert [len(p.hosts) for p in distributed._PLANS.values() if p.dag] == [2]
    assert await count(a) == kept and await count(b) == 2 and len(b.freed) == 1  # (held, and the last y: waiting)
    np.testing.assert_array_equal(await held.numpy(), np.arange(256, dtype=np.float32))


class Trainer:
    """What each host keeps: a model and its optimiser (`tensors()`: realized with every program that uses it)."""

    def __init__(self, state: dict[str, np.ndarray]) -> None:
        self.model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
        self.model.load_state_dict(state)
        self.opt = optim.SGD(self.model.parameters(), lr=0.1, momentum=0.9)

    def tensors(self) -> list[Tensor]:
        return self.opt.tensors()


def local_grads(tr: Trainer, x: Tensor, y: Tensor, share: float) -> tuple[Tensor, ...]:
    with GradientTape() as tape:
        loss = nn.cross_entropy(tr.model(x), y) * share
    return (loss, *tape.gradient(loss, tr.model.parameters()))


def apply(tr: Trainer, *grads: Tensor) -> Tensor:
    tr.opt.step(list(grads))
    return tr.model.parameters()[0]


def params(tr: Trainer) -> Tensor:
    return Tensor.cat([p.reshape(-1) for p in tr.model.parameters()])


async def test_data_parallel_training_over_two_hosts_equals_one(cluster: Cluster) -> None:
    init = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3)).state_dict()
    state = {k: await v.numpy() for k, v in init.items()}
    batches = [(rng.standard_normal((10, 8)).astype(np.float32), rng.integers(0, 3, 10).astype(np.int32))
               for _ in range(4)]
    hosts = cluster.hosts
    trainers = [await h.create(Trainer, state) for h in hosts]
    for x, y in batches:
        xs, ys = await scatter(hosts, x), await scatter(hosts, y)
        outs = [h.call(local_grads, tr, xi, yi, xi.shape[0] / len(x), outputs=5)  # the loss, 4 gradients
                for h, tr, xi, yi in zip(hosts, trainers, xs, ys)]
        summed = [all_reduce([o[j] for o in outs]) for j in range(1, 5)]  # per gradient: the sum on each host
        steps = [h.call(apply, tr, *(g[i] for g in summed)) for i, (h, tr) in enumerate(zip(hosts, trainers))]
        await realize(*steps)
    # the reference: one process, the whole batch
    ref = Trainer(state)
    for x, y in batches:
        with GradientTape() as tape:
            loss = nn.cross_entropy(ref.model(Tensor(x)), Tensor(y))
        ref.opt.step(tape.gradient(loss, ref.model.parameters()))
    want = await params(ref).numpy()
    for h, tr in zip(hosts, trainers):
        np.testing.assert_allclose(await h.call(params, tr).numpy(), want, rtol=1e-4, atol=1e-5)


async def _dead(actor: Any) -> None:
    """Return once `actor`'s death is seen: ray.kill only asks the cluster to kill it, and a call made before the
    kill lands still runs (a realize right after ray.kill may find the host alive and compute)."""
    async with asyncio.timeout(60):
        while True:
            try:
                await actor.describe.remote()
            except ray.exceptions.RayActorError:
                return


async def test_a_dead_host_fails_what_needs_it_and_the_other_works_on(ray_cluster: None) -> None:
    c = await Cluster.start(hosts=2)
    a, b = c.hosts
    ta, tb = await a.tensor(np.ones(3, np.float32)), await b.tensor(np.ones(3, np.float32))
    ray.kill(b.actor)
    await _dead(b.actor)
    with pytest.raises(RemoteError, match="host 1"):
        await (ta + tb).numpy()  # (b holds tb)
    with pytest.raises(RemoteError, match="host 1"):
        await (tb * 2).numpy()
    np.testing.assert_array_equal(await (ta * 3).numpy(), np.full(3, 3, np.float32))
    c.shutdown()


async def test_a_plan_run_again_is_a_compiled_graph_a_dead_host_fails_it_and_a_new_cluster_compiles_anew(
        ray_cluster: None) -> None:
    c = await Cluster.start(hosts=2)
    a, b = c.hosts
    data = [(rng.standard_normal((6, 5)).astype(np.float32), rng.standard_normal((5, 3)).astype(np.float32))
            for _ in range(4)]

    async def over_both(hosts: list[Any], x: np.ndarray, w: np.ndarray) -> tuple[RemoteTensor, ...]:
        tx, tw = await hosts[0].tensor(x), await hosts[1].tensor(w)
        y = (tx * 0.5).exp().to(hosts[1]) @ tw  # on the second host
        z = y.sum(axis=1).to(hosts[0]) + tx.sum(axis=1)  # back on the first
        return y, z, (tx * 2).max(axis=0)  # the last: a plan of the first host alone

    async def check(y: RemoteTensor, z: RemoteTensor, x: np.ndarray, w: np.ndarray) -> None:
        want_y = np.exp(x * 0.5) @ w
        np.testing.assert_allclose(await y.numpy(), want_y, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(await z.numpy(), want_y.sum(1) + x.sum(1), rtol=1e-5, atol=1e-5)

    gaps: list[float] = []

    async def ticking(work: Any) -> None:
        """Await `work` while a ticker notes the loop's longest gap between turns (compiling happens off it)."""
        done = asyncio.ensure_future(work)
        last = time.perf_counter()
        while not done.done():
            await asyncio.sleep(0.01)
            gaps.append(time.perf_counter() - last)
            last = time.perf_counter()
        await done

    for i, (x, w) in enumerate(data[:3]):  # the first run of each plan by actor calls, the later ones compiled
        y, z, m = await over_both([a, b], x, w)
        gaps.clear()
        t0 = time.perf_counter()
        await ticking(realize(y, z))
        if i == 1:  # compiled the graph over both hosts meanwhile: seconds, the loop's turns far shorter
            assert max(gaps) < (time.perf_counter() - t0) / 2
        await realize(m)
        await check(y, z, x, w)
        np.testing.assert_array_equal(await m.numpy(), (x * 2).max(0))
    compiled = {frozenset(h.index for h in p.hosts.values()): p for p in distributed._PLANS.values() if p.dag}
    assert set(compiled) == {frozenset({0, 1}), frozenset({0})} and all(p.runs == 3 for p in compiled.values())
    alone = compiled[frozenset({0})].dag
    x, w = data[3]
    y, z, m = await over_both([a, b], x, w)
    ray.kill(b.actor)
    await _dead(b.actor)
    with pytest.raises(RemoteError, match="host 1"):
        await realize(y, z)  # its compiled graph needs b
    await realize(m)  # a's own plan runs on, as the same compiled graph
    np.testing.assert_array_equal(await m.numpy(), (x * 2).max(0))
    assert [p.dag for p in distributed._PLANS.values() if p.dag] == [alone]
    c2 = await Cluster.start(hosts=2)  # a changed cluster: its plans compiled anew
    for x, w in data[:2]:
        y, z, _ = await over_both(c2.hosts, x, w)
        await realize(y, z)
        await check(y, z, x, w)
    assert len([p for p in distributed._PLANS.values() if p.dag and c2.hosts[1] in p.hosts.values()]) == 1
    c2.shutdown()
    c.shutdown()
    assert not distributed._PLANS  # (shutting a cluster down tears its compiled graphs down)
