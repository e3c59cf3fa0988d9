"""Sharded tensors (azyx.shard) over the test devices' pairs (c:0 + c:1, c:0 + opencl:0, ..., cuda:0 + cuda:1 where
present): layouts, elementwise ops and reductions where the shards are, collectives against numpy, row- and
column-parallel products and partial products, one ExecutionPlan with its transfer steps, and data-parallel training
of an MLP over two devices giving the parameters of one device on the whole batch."""

from __future__ import annotations

import numpy as np
import pytest
from test_faults import run_script

import azyx
from azyx import DataParallel, GradientTape, Tensor, nn, optim
from azyx.errors import ArgumentError, ShapeError
from azyx.plan import KernelStep, TransferStep
from azyx.runtime import RT
from azyx.shard import ShardedTensor, replicate

ALL = azyx.devices()
PAIRS = [("c:0", "c:1")] + [("c:0", d) for d in ALL if d.endswith(":0") and d not in ("c:0", "dummy:0")]
if "cuda:1" in ALL:
    PAIRS.append(("cuda:0", "cuda:1"))
rng = np.random.default_rng(5)


def randn(*shape: int) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)


@pytest.fixture(params=PAIRS, ids=lambda p: "+".join(p))
def pair(request: pytest.FixtureRequest) -> list[str]:
    return list(request.param)


async def test_shard_and_replicate_lay_out_pieces_like_array_split(pair: list[str]) -> None:
    x = randn(7, 5)
    s = Tensor(x).shard(pair, axis=0)
    assert isinstance(s, ShardedTensor) and s.shape == (7, 5) and s.sizes == (4, 3) and s.devices == pair
    assert [t.device for t in s.shards] == pair
    np.testing.assert_array_equal(await s.shards[1].numpy(), np.array_split(x, 2)[1])
    np.testing.assert_array_equal(await s.numpy(), x)
    cols = Tensor(x).shard(pair, axis=-1)
    assert cols.axis == 1 and cols.sizes == (3, 2)
    np.testing.assert_array_equal(await cols.gather(pair[1]).numpy(), x)
    r = replicate(Tensor(x), pair)
    assert r.replicated and all(t.shape == (7, 5) for t in r.shards)
    for t in r.shards:
        np.testing.assert_array_equal(await t.numpy(), x)


async def test_elementwise_and_reductions_run_where_the_shards_are(pair: list[str]) -> None:
    x, y, b = randn(9, 6), randn(9, 6), randn(6)
    sx, sy = Tensor(x).shard(pair, 0), Tensor(y).shard(pair, 0)
    z = ((sx * sy + 1.5).relu() - Tensor(b)) / 2.0  # a broadcast Tensor operand goes to each device
    assert z.devices == pair and z.axis == 0
    want = (np.maximum(x * y + 1.5, 0) - b) / 2
    np.testing.assert_allclose(await z.numpy(), want, rtol=1e-6, atol=1e-6)
    # over the split axis: per-device partial sums, all-reduced; along the other: rows stay split
    total = z.sum(axis=0)
    assert total.replicated and total.devices == pair
    for t in total.shards:
        np.testing.assert_allclose(await t.numpy(), want.sum(0), rtol=1e-5, atol=1e-5)
    rows = z.max(axis=1)
    assert rows.axis == 0 and rows.sizes == (5, 4)
    np.testing.assert_allclose(await rows.numpy(), want.max(1), rtol=1e-6)
    np.testing.assert_allclose(await z.mean().numpy(), want.mean(), rtol=1e-5, atol=1e-6)
    cols = Tensor(x).shard(pair, 1)
    np.testing.assert_allclose(await (cols * Tensor(b)).exp().sum(axis=0, keepdim=True).numpy(),
                               np.exp(x * b).sum(0, keepdims=True), rtol=1e-5)


@pytest.mark.parametrize("other", ["c:1", "opencl:0"])
async def test_one_plan_reading_in_place_or_with_transfer_steps(other: str) -> None:
    """The partial sums' all-reduce in the pieces' plan: on C devices one kernel on c:0 combines both partial sums,
    reading c:1's in place, and a kernel on c:1 reads that sum in place (no transfer step; realized, c:1's piece holds
    c:0's buffer); a pair whose memory is not shared moves them by transfer steps."""
    if other not in ALL:
        pytest.skip(f"{other} is not present")
    x = randn(8, 4)
    s = Tensor(x).shard(["c:0", other], 0)
    await s.realize()
    total = (s * 2.0).sum(axis=0)
    used = total.shards[1] * 3.0  # a kernel on `other` reads its piece of the sum
    plan = azyx.schedule(total.shards[0], used)
    kernels = [st for st in plan.steps if isinstance(st, KernelStep)]
    assert {k.device for k in kernels} == {"c:0", other}
    shared = other == "c:1"
    assert any(isinstance(st, TransferStep) for st in plan.steps) is not shared
    assert any(plan.slots[a].device != k.device for k in kernels for a in k.args) is shared
    await azyx.realize(total.shards[0], used)
    np.testing.assert_allclose(await total.shards[0].numpy(), 2 * x.sum(0), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(await used.numpy(), 6 * x.sum(0), rtol=1e-5, atol=1e-5)
    mine = await total.shards[1].realize()
    assert mine.device == other and (mine._node.buffer is total.shards[0]._node.buffer) is shared
    np.testing.assert_allclose(await mine.numpy(), 2 * x.sum(0), rtol=1e-5, atol=1e-5)


async def test_a_buffer_two_tensors_hold_is_never_written_in_place() -> None:
    """An all-reduce's pieces on C devices hold one buffer (each device's kernels read it in place; an all-gather's
    and a broadcast's too), as a realized view holds its base's: an assignment into one of them writes a copy, and the
    others keep their values."""
    x = randn(6)
    total = ShardedTensor([Tensor(x, device="c:0"), Tensor(2 * x, device="c:1")], None).all_reduce("sum")
    await total.realize()
    a, b = total.shards
    assert a._node.buffer is b._node.buffer and b.device == "c:1"
    doubled = b * 2.0  # a kernel on c:1 reads the sum where it lies: no transfer step
    assert not any(isinstance(st, TransferStep) for st in azyx.schedule(doubled).steps)
    a[0:2] = 0.0  # (its old value has no other handle: a buffer of its own would be written in place)
    await a.realize()
    want = 3 * x
    np.testing.assert_allclose(await doubled.numpy(), 2 * want, rtol=1e-6)
    np.testing.assert_allclose(await b.numpy(), want, rtol=1e-6)
    want[:2] = 0.0
    np.testing.assert_allclose(await a.numpy(), want, rtol=1e-6)
    for whole in (Tensor(x).shard(["c:0", "c:1"], 0).all_gather(), total.broadcast(1)):  # one buffer too
        await whole.realize()
        assert whole.shards[0]._node.buffer is whole.shards[1]._node.buffer
    np.testing.assert_array_equal(await whole.shards[0].numpy(), 3 * x)
    y = await Tensor(x).realize()
    view = await y.reshape(2, 3).realize()
    y[0:6] = 0.0
    np.testing.assert_array_equal(await y.numpy(), np.zeros(6, np.float32))
    np.testing.assert_array_equal(await view.numpy(), x.reshape(2, 3))


@pytest.mark.parametrize("devs", [["c:0", "c:1"], ["c:0", "opencl:0"], ["c:0", "c:1", "opencl:0"],
                                  ["cuda:0", "cuda:1"]], ids=lambda d: "+".join(d))
async def test_collectives_against_numpy(devs: list[str]) -> None:
    if not set(devs) <= set(ALL):
        pytest.skip(f"{devs} are not all present")
    n = len(devs)
    parts = [randn(5, 7) for _ in devs]
    partial = ShardedTensor([Tensor(p).to(d) for p, d in zip(parts, devs)], None)  # e.g. each device's gradients
    for op, ref in (("sum", np.sum), ("max", np.max), ("min", np.min)):
        rings = [partial._all_reduce(op, 3)] if op == "sum" else []  # (3 chunks: transfers where memory is not shared)
        for out in (partial.all_reduce(op), *rings):
            assert out.replicated and out.devices == devs
            for t in out.shards:
                np.testing.assert_allclose(await t.numpy(), ref(np.stack(parts), axis=0), rtol=1e-5, atol=1e-6)
    scattered = partial.reduce_scatter(axis=1)
    assert scattered.axis == 1 and scattered.devices == devs
    np.testing.assert_allclose(await scattered.numpy(), np.sum(parts, axis=0), rtol=1e-5, atol=1e-6)
    gathered = Tensor(parts[0]).shard(devs, 1).all_gather()
    for t in gathered.shards:
        np.testing.assert_array_equal(await t.numpy(), parts[0])
    for t in partial.broadcast(src=n - 1).shards:
        np.testing.assert_array_equal(await t.numpy(), parts[-1])


async def test_two_gpus_read_each_others_piece_over_the_link() -> None:
    """Two CUDA devices with peer access: the all-reduce's kernel on each reads the other's piece where it lies (an
    argument on the other device, no transfer step); without peer access, transfer steps. Both give numpy's sum."""
    if "cuda:1" not in ALL:
        pytest.skip("two CUDA devices are needed")
    parts = [randn(1000, 33) for _ in range(2)]
    partial = ShardedTensor([Tensor(p).to(d) for p, d in zip(parts, ["cuda:0", "cuda:1"])], None)
    await azyx.realize(*partial.shards)
    out = partial.all_reduce("sum")
    plan = azyx.schedule(*out.shards)
    peer = RT.device("cuda:0").reads_peer(RT.device("cuda:1"))
    kernels = [st for st in plan.steps if isinstance(st, KernelStep)]
    assert {k.device for k in kernels} == {"cuda:0", "cuda:1"}
    assert any(isinstance(st, TransferStep) for st in plan.steps) is not peer
    assert any(plan.slots[a].device != k.device for k in kernels for a in k.args) is peer
    for t in out.shards:
        np.testing.assert_allclose(await t.numpy(), parts[0] + parts[1], rtol=1e-6)


async def test_matrix_products_with_a_sharded_operand(pair: list[str]) -> None:
    a, w = randn(10, 8), randn(8, 6)
    rows = Tensor(a).shard(pair, 0) @ replicate(Tensor(w), pair)  # row parallel
    assert rows.axis == 0
    np.testing.assert_allclose(await rows.numpy(), a @ w, rtol=1e-5, atol=1e-5)
    cols = Tensor(a) @ Tensor(w).shard(pair, 1)  # column parallel
    assert cols.axis == 1 and cols.sizes == (3, 3)
    np.testing.assert_allclose(await cols.numpy(), a @ w, rtol=1e-5, atol=1e-5)
    inner = Tensor(a).shard(pair, 1) @ Tensor(w).shard(pair, 0)  # partial products, all-reduced
    assert inner.replicated
    for t in inner.shards:
        np.testing.assert_allclose(await t.numpy(), a @ w, rtol=1e-5, atol=1e-5)


def test_bad_layouts_raise() -> None:
    x = Tensor(randn(6, 4))
    with pytest.raises(ShapeError, match="layouts"):
        _ = x.shard(["c:0", "c:1"], 0) + x.shard(["c:0", "c:1"], 1)
    with pytest.raises(ShapeError, match="fewer elements"):
        Tensor(randn(1, 4)).shard(["c:0", "c:1"], 0)
    with pytest.raises(ArgumentError, match="distinct"):
        x.shard(["c:0", "c:0"], 0)
    with pytest.raises(ArgumentError, match="all_gather"):
        x.shard(["c:0", "c:1"], 0).all_reduce()
    with pytest.raises(azyx.DeviceError, match="nope:3"):
        x.shard(["c:0", "nope:3"], 0)


class MLP(nn.Module):
    def __init__(self, device: str) -> None:
        self.l1 = nn.Linear(12, 16, device=device)
        self.l2 = nn.Linear(16, 3, device=device)

    def forward(self, x: Tensor) -> Tensor:
        return self.l2(self.l1(x).relu())


async def test_data_parallel_training_matches_one_device(pair: list[str]) -> None:
    """Adam on the MLP: each device a replica and its rows of the batch (DataParallel), gradients all-reduced in the
    step's plan; after 5 steps the replicas equal one device trained on the whole batch (within float
    reassociation), and the losses agree."""
    xs, ys = randn(5, 10, 12), rng.integers(0, 3, size=(5, 10)).astype(np.int32)
    azyx.manual_seed(1)
    single = MLP(pair[0])
    opt = optim.Adam(single.parameters(), lr=0.05)
    azyx.manual_seed(1)  # the first replica's initial values are single's; DataParallel gives them to the others
    dp = DataParallel(MLP, pair)
    opts = [optim.Adam(m.parameters(), lr=0.05) for m in dp.replicas]
    for x, y in zip(xs, ys):
        with GradientTape() as tape:
            want_loss = nn.cross_entropy(single(Tensor(x, device=pair[0])), Tensor(y, device=pair[0]))
        opt.step(tape.gradient(want_loss, single.parameters()))
        loss, grads = dp.gradients(lambda m, xi, yi: nn.cross_entropy(m(xi), yi), Tensor(x, device=pair[0]),
                                   Tensor(y, device=pair[0]))
        for o, g in zip(opts, grads):
            o.step(g)
        step = [loss, *(t for o in opts for t in o.tensors())]
        plan = azyx.schedule(*step)  # one plan: both devices' steps and the all-reduces
        assert set(pair) <= {st.device for st in plan.steps if isinstance(st, KernelStep)}
        assert any(isinstance(st, TransferStep) for st in plan.steps)
        await azyx.realize(want_loss, *opt.tensors(), *step)
        np.testing.assert_allclose(await loss.numpy(), await want_loss.numpy(), rtol=1e-5)
    want = [await p.numpy() for p in single.parameters()]
    for m in dp.replicas:
        for got, w in zip([await p.numpy() for p in m.parameters()], want):
            np.testing.assert_allclose(got, w, rtol=1e-4, atol=1e-5)


async def test_jit_takes_sharded_arguments_and_replays(pair: list[str]) -> None:
    """A jitted data-parallel step with ShardedTensor arguments traces once per layout, replays with new batches
    (their pieces bound like any argument), and gives the un-jitted step's losses and parameters."""
    data = [(randn(8, 12), rng.integers(0, 3, size=8).astype(np.int32)) for _ in range(4)]
    runs = []
    for use_jit in (False, True):
        azyx.manual_seed(3)
        dp = DataParallel(MLP, pair)
        opts = [optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in dp.replicas]

        def step(x: ShardedTensor, y: ShardedTensor) -> Tensor:
            loss, grads = dp.gradients(lambda m, xi, yi: nn.cross_entropy(m(xi), yi), x, y)
            for o, g in zip(opts, grads):
                o.step(g)
            return loss

        jitted = azyx.jit(step)
        losses = []
        for x, y in data:
            xs, ys = Tensor(x).shard(pair, 0), Tensor(y).shard(pair, 0)
            if use_jit:
                loss = await jitted(xs, ys)
            else:
                loss = step(xs, ys)
                await azyx.realize(loss, *(t for o in opts for t in o.tensors()))
            losses.append(float(await loss.numpy()))
        if use_jit:
            assert jitted.replays >= len(data) - 2
        runs.append((losses, [await p.numpy() for p in dp.parameters()]))
    np.testing.assert_allclose(runs[1][0], runs[0][0], rtol=1e-5)
    for got, want in zip(runs[1][1], runs[0][1]):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


SHARD_FAULT = """
import asyncio
import numpy as np
import azyx
from azyx import Tensor
from azyx.runtime import RT

azyx.configure({"c": {"devices": 2}})

async def main():
    x = np.arange(12, dtype=np.float32).reshape(6, 2)
    s = Tensor(x).shard(["c:0", "c:1"], 0)
    await s.realize()
    RT.device("c:1").fail(RuntimeError("injected fault"))
    for build in (lambda: (s * 2).sum(axis=0), lambda: s.all_gather()):
        try:
            await build().realize()
            raise AssertionError("no error")
        except azyx.DeviceFailedError as e:
            assert "c:1" in str(e) and "injected fault" in str(e), str(e)
    # the rest of the runtime works on
    assert ((await (Tensor(x, device="c:0") * 3).numpy()) == x * 3).all()
    print("OK")

asyncio.run(main())
"""


def test_a_failed_shard_device_fails_dependent_realizes_and_the_rest_works() -> None:
    """c:1 fails under a sharded tensor (in a fresh interpreter): every realize that needs its piece raises
    DeviceFailedError naming it, at once (no hang); c:0 keeps working."""
    assert run_script(SHARD_FAULT).strip().endswith("OK")


COLLECTIVES = """
import asyncio
import numpy as np
import azyx
from azyx import Tensor
from azyx.shard import ShardedTensor

azyx.configure({"c": {"devices": 4}})
rng = np.random.default_rng(11)
REF = {"sum": np.add.reduce, "max": np.maximum.reduce, "min": np.minimum.reduce}


def f64(x):
    return np.asarray(x, np.float64)


# per dtype: the range its pieces are drawn from (sums of 4 stay in range and exact; none: normal) and its shapes
DRAWN = {"float32": (None, ((3,), (7, 5), (2, 40001))), "int32": ((-1000, 1000), ((3,), (7, 5), (2, 40001))),
         "float16": (None, ((1,), (7, 5))), "float64": (None, ((1,), (7, 5))), "int64": ((-1000, 1000), ((1,), (7, 5))),
         "uint8": ((0, 64), ((1,), (7, 5))), "int8": ((-30, 30), ((7, 5),)), "int16": ((-1000, 1000), ((7, 5),)),
         "uint32": ((0, 1000), ((7, 5),)), "bool": ((0, 2), ((7, 5),)), "bfloat16": ((-30, 30), ((7, 5),))}


async def main() -> None:
    for n in (2, 3, 4):
        devs = [f"c:{i}" for i in range(n)]
        for dtype, (drawn, shapes) in DRAWN.items():
            # (rings of 3 and 4: the dtypes whose sums are exact or toleranced alike; each case is a compile)
            if dtype not in {2: DRAWN, 3: ("float32", "int32"), 4: ("float32",)}[n]:
                continue
            for shape in shapes:
                if drawn is None:
                    parts = [rng.standard_normal(shape).astype(dtype) for _ in devs]
                else:  # (bfloat16: small integers, exact in it, drawn as float32)
                    parts = [rng.integers(*drawn, shape).astype(np.float32 if dtype == "bfloat16" else dtype)
                             for _ in devs]
                s = ShardedTensor([Tensor(p, dtype=dtype, device=d) for p, d in zip(parts, devs)], None)
                wants = {op: REF[op](parts) for op in REF}
                if dtype == "bool":  # (a sum of bools is their or, as Tensor's +)
                    wants["sum"] = np.logical_or.reduce(parts)
                for op, want in wants.items():
                    for chunks in (None, 1, 3) if dtype == "float32" else (None, 2):
                        got = s._all_reduce(op, chunks)
                        assert got.devices == devs and got.replicated
                        for t in got.shards:
                            tol = 1e-2 if dtype == "float16" else 1e-5
                            np.testing.assert_allclose(f64(await t.numpy()), f64(want), rtol=tol, atol=tol * n)
                # reduce-scatter, all-gather and broadcast of the same pieces
                if len(shape) == 2:
                    rs = s.reduce_scatter(axis=1)
                    assert rs.axis == 1 and rs.sizes == tuple(len(b) for b in np.array_split(np.arange(shape[1]), n))
                    np.testing.assert_allclose(f64(await rs.numpy()), f64(wants["sum"]), rtol=1e-2, atol=1e-2 * n)
                    split = Tensor(parts[0], dtype=dtype).shard(devs, 0 if shape[0] >= n else 1)
                    for t in split.all_gather().shards:
                        np.testing.assert_array_equal(await t.numpy(), parts[0])
                for t in s.broadcast(n - 1).shards:
                    np.testing.assert_array_equal(await t.numpy(), parts[-1])
    print("OK")

asyncio.run(main())
"""


def test_collectives_match_numpy_for_every_dtype_odd_sizes_and_2_to_4_devices() -> None:
    """all-reduce (the swap, a ring, rings side by side; each op), reduce-scatter, all-gather and broadcast over 2
    C devices for every dtype, over 3 for float32 and int32, over 4 for float32 (a process of its own: four devices
    configured before the runtime starts) against numpy."""
    assert run_script(COLLECTIVES, timeout=600).strip().endswith("OK")
