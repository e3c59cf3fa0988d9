"""A steady plan replays its launch list (issue 38): from a plan's first run, each batch of its kernels on a device
that can (C, CUDA, OpenCL) is a frozen record (`device.Replay`) into which a run binds its buffers and scalar words, its
temporaries in one allocation per run. On every device: results equal numpy's across changing scalar values and
input buffers, realized outputs stay valid across later runs, a cancelled realize and a failed run leave the next
runs right. Devices that do not replay run the same plans launch by launch and must give the same values."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import azyx
from azyx import Tensor
from azyx.errors import IndexOutOfRange
from azyx.plan import ExecutionPlan
from azyx.runtime import RT

LAYERS = 6  # matrix products in a row: a kernel each (none fuses into the next)
WIDTH = 16
rng = np.random.default_rng(38)
WEIGHTS = [(rng.standard_normal((WIDTH, WIDTH)) / 4).astype(np.float32) for _ in range(LAYERS)]


def replays(device: str) -> bool:
    """Whether the device freezes steady batches (the test then asserts that the plan's batch was frozen)."""
    return RT.device(device).kind in ("c", "cuda", "opencl")


def chain(x: Tensor, ws: list[Tensor], s: float | Tensor) -> tuple[Tensor, Tensor]:
    """A middle result (kept as a target) and the end of a chain of products, each scaled by `s`."""
    mid = x
    for w in ws[:LAYERS // 2]:
        mid = (mid @ w) * s
    y = mid
    for w in ws[LAYERS // 2:]:
        y = ((y @ w) * s).relu() + 0.25
    return mid, y


def reference(x: np.ndarray, s: float) -> tuple[np.ndarray, np.ndarray]:
    mid = x
    for w in WEIGHTS[:LAYERS // 2]:
        mid = (mid @ w) * np.float32(s)
    y = mid
    for w in WEIGHTS[LAYERS // 2:]:
        y = np.maximum((y @ w) * np.float32(s), 0) + np.float32(0.25)
    return mid, y


def frozen(plan: ExecutionPlan) -> list:
    """The plan's frozen batches (the executor's record of it)."""
    prepared = RT.executor.prepared.get(plan)
    return [seg.replay for seg in prepared.segments if seg.replay is not None] if prepared is not None else []


async def weights(device: str) -> list[Tensor]:
    ws = [Tensor(w, device=device) for w in WEIGHTS]
    for w in ws:
        await w.realize()
    return ws


async def test_steady_runs_equal_numpy_across_scalars_and_inputs(device: str) -> None:
    ws = await weights(device)
    kept = []
    for i in range(6):
        xn = rng.standard_normal((2, WIDTH)).astype(np.float32)
        s = 0.9 + 0.05 * i  # a new value each run: a kernel argument, never a new plan
        x = Tensor(xn, device=device)  # a new input buffer each run
        await x.realize()
        mid, y = chain(x, ws, s)
        await azyx.realize(mid, y)
        kept.append((mid, y, xn, s))
    plan = RT.executor.last[0]
    assert plan is not None
    if replays(device):
        records = frozen(plan)
        # its temporaries in one allocation per run, where kernels take addresses
        assert records and all(r.arena_size > 0 or not RT.device(device).arena for r in records)
    # every run's outputs are still right once later runs have run (none shares memory with a later run's)
    for mid, y, xn, s in kept:
        ref_mid, ref_y = reference(xn, s)
        np.testing.assert_allclose(await mid.numpy(), ref_mid, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(await y.numpy(), ref_y, rtol=1e-5, atol=1e-5)


async def test_a_large_temporary_keeps_its_own_buffer_beside_the_arena(device: str,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A temporary of more than ARENA_PIECE bytes has its own buffer each run, and the batch's small temporaries still
    share its arena (a batch-32 decode step's logits beside its ~140 small temporaries); runs equal numpy's."""
    monkeypatch.setattr("azyx.device.ARENA_PIECE", 1024)
    ws = await weights(device)
    wide_n = (rng.standard_normal((WIDTH, 128)) / 4).astype(np.float32)
    narrow_n = (rng.standard_normal((128, WIDTH)) / 8).astype(np.float32)
    wide, narrow = Tensor(wide_n, device=device), Tensor(narrow_n, device=device)
    await azyx.realize(wide, narrow)
    kept = []
    for i in range(4):
        xn = rng.standard_normal((4, WIDTH)).astype(np.float32)
        s = 1.0 + i / 8
        x = Tensor(xn, device=device)
        h = ((x @ wide) * s).relu()  # (4, 128) float32: 2 KiB, past the patched ARENA_PIECE
        y = chain(h @ narrow, ws, s)[1]
        await y.realize()
        kept.append((y, xn, s))
    plan = RT.executor.last[0]
    assert plan is not None
    if replays(device) and RT.device(device).arena:
        (record,) = frozen(plan)
        big = [sl for sl in record.bound if plan.slots[sl].kind == "temp" and plan.slots[sl].nbytes > 1024]
        assert big and record.arena and all(plan.slots[sl].nbytes <= 1024 for sl in record.arena)
    for y, xn, s in kept:
        h = np.maximum((xn @ wide_n) * np.float32(s), 0)
        np.testing.assert_allclose(await y.numpy(), reference(h @ narrow_n, s)[1], rtol=1e-4, atol=1e-4)


async def test_jit_replays_bind_new_values(device: str) -> None:
    ws = await weights(device)

    @azyx.jit
    def step(x: Tensor, s: float) -> Tensor:
        return chain(x, ws, s)[1]

    xn = rng.standard_normal((1, WIDTH)).astype(np.float32)
    x = Tensor(xn, device=device)
    outs = [(await step(x, 1.0 + i / 16), 1.0 + i / 16) for i in range(7)]
    for y, s in outs:
        np.testing.assert_allclose(await y.numpy(), reference(xn, s)[1], rtol=1e-5, atol=1e-5)
    # the same value again (a jit's constants: its words packed once) and a new input
    x2n = rng.standard_normal((1, WIDTH)).astype(np.float32)
    for xin, xref in ((x, xn), (Tensor(x2n, device=device), x2n), (x, xn)):
        y = await step(xin, 1.25)
        np.testing.assert_allclose(await y.numpy(), reference(xref, 1.25)[1], rtol=1e-5, atol=1e-5)


async def test_cancelled_realize_leaves_later_runs_right(device: str) -> None:
    ws = await weights(device)
    xn = rng.standard_normal((4096, WIDTH)).astype(np.float32)  # (work a C device queues: the realize waits for it)
    x = Tensor(xn, device=device)
    await x.realize()
    for i in range(2):
        await azyx.realize(*chain(x, ws, 1.0 + i / 8))
    for i in range(3):
        mid, y = chain(x, ws, 2.0)
        task = asyncio.ensure_future(y.numpy())
        await asyncio.sleep(0)  # (submitted: the task waits for its work)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        del mid, y
        mid, y = chain(x, ws, 0.75 + i / 4)
        ref_mid, ref_y = reference(xn, 0.75 + i / 4)
        np.testing.assert_allclose(await y.numpy(), ref_y, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(await mid.numpy(), ref_mid, rtol=1e-5, atol=1e-5)


async def test_runs_in_flight_at_once_each_get_their_own_temporaries(device: str) -> None:
    """Runs of one frozen plan submitted before any has completed each take their own arena block (more blocks than
    an OpenCL record keeps sub-buffers for) and their own input and scale: every result equals numpy's."""
    ws = await weights(device)
    await azyx.realize(*chain(Tensor(np.zeros((1024, WIDTH), np.float32), device=device), ws, 1.0))
    inputs = [rng.standard_normal((1024, WIDTH)).astype(np.float32) for _ in range(8)]
    xs = [Tensor(xn, device=device) for xn in inputs]
    await azyx.realize(*xs)
    outs = [chain(x, ws, 0.5 + i / 8)[1] for i, x in enumerate(xs)]
    got = await asyncio.gather(*(y.numpy() for y in outs))
    for i, (xn, y) in enumerate(zip(inputs, got)):
        np.testing.assert_allclose(y, reference(xn, 0.5 + i / 8)[1], rtol=1e-5, atol=1e-5)


async def test_failed_run_does_not_poison_the_next(device: str) -> None:
    """A run whose index is out of range raises IndexOutOfRange (its own check words); the runs before and after it,
    of the same frozen plan, give numpy's values."""
    ws = await weights(device)
    table = rng.standard_normal((5, WIDTH)).astype(np.float32)
    emb = Tensor(table, device=device)
    await emb.realize()

    def run(ids: list[int], s: float) -> Tensor:
        return chain(emb[Tensor(np.array(ids, np.int32), device=device)], ws, s)[1]

    for i, ids in enumerate([[0, 4], [1, 2], [3, 3], [4, 0]]):
        np.testing.assert_allclose(await run(ids, 1.0 + i / 8).numpy(), reference(table[ids], 1.0 + i / 8)[1],
                                   rtol=1e-5, atol=1e-5)
    if replays(device):
        assert frozen(RT.executor.last[0])  # type: ignore[arg-type]
    with pytest.raises(IndexOutOfRange, match="index 7 is out of range for an axis of size 5"):
        await run([1, 7], 1.5).numpy()
    for ids, s in (([2, 1], 0.5), ([4, 4], 1.5)):
        np.testing.assert_allclose(await run(ids, s).numpy(), reference(table[ids], s)[1], rtol=1e-5, atol=1e-5)


async def test_steady_runs_hold_no_more_memory(device: str) -> None:
    """A steady loop's runs take their temporaries' one allocation from the pool again: what the device holds after
    many runs is what it held after a few."""
    ws = await weights(device)
    xn = rng.standard_normal((4, WIDTH)).astype(np.float32)
    x = Tensor(xn, device=device)
    await x.realize()
    dev = RT.device(device)
    for _ in range(4):
        y = chain(x, ws, 1.0)[1]
        await y.realize()
    await RT.executor.synchronize_all()
    held = dev.memory().in_use
    for i in range(20):
        y = chain(x, ws, 1.0 + i / 64)[1]
        await y.realize()
    await RT.executor.synchronize_all()
    np.testing.assert_allclose(await y.numpy(), reference(xn, 1.0 + 19 / 64)[1], rtol=1e-5, atol=1e-5)
    assert dev.memory().in_use <= held


async def test_temporaries_past_the_arena_limit_have_buffers_and_the_rest_stay(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where a batch's temporaries need more room than ARENA_MAX, those that find none get buffers of their own and
    the rest stay in the arena (not all or none): a chain whose first products are wide keeps its narrow temporaries
    there; the runs equal numpy's."""
    from azyx import device

    wide_n = (rng.standard_normal((WIDTH, 256)) / 4).astype(np.float32)
    back_n = (rng.standard_normal((256, WIDTH)) / 16).astype(np.float32)
    ws = await weights("c:0")
    wide, back = Tensor(wide_n, device="c:0"), Tensor(back_n, device="c:0")
    await azyx.realize(wide, back)

    def step(x: Tensor, s: float) -> Tensor:
        h = (((x @ wide) * s).relu() @ back) * s  # (8, 256) float32 temporaries: 8 KiB each
        return chain(h, ws, s)[1]

    xn = rng.standard_normal((8, WIDTH)).astype(np.float32)
    x = Tensor(xn, device="c:0")
    await step(x, 1.0).realize()
    plan = RT.executor.last[0]
    assert plan is not None
    (replay,) = frozen(plan)
    seg = [s for s in RT.executor.prepared[plan].segments if s.replay is replay][0]
    rooms = {s: n for s, (_, n) in replay.extents.items()}
    assert max(rooms.values()) >= 8192 and min(rooms.values()) < 1024
    monkeypatch.setattr(device, "ARENA_MAX", 4096)  # (room for the narrow ones, not the wide)
    extents, size = device.arena_of(plan, seg.kernels, seg.frees)
    assert extents and size <= 4096 and set(extents) == {s for s, n in rooms.items() if n < 8192}
    for i in range(3):  # (a plan made under the patched limit runs right)
        RT.executor.prepared.pop(plan, None)
        RT.executor.last = (None, RT.executor.last[1])
        got = await step(x, 1.0 + i / 8).numpy()
        h = (np.maximum((xn @ wide_n) * np.float32(1 + i / 8), 0) @ back_n) * np.float32(1 + i / 8)
        np.testing.assert_allclose(got, reference(h, 1.0 + i / 8)[1], rtol=1e-4, atol=1e-4)


async def test_cuda_table_holds_what_each_launch_takes() -> None:
    """The table CUDA binds a frozen batch into (cuda._Frozen: the data of its graph) holds, per kernel, what
    its launch item would pass (its buffers' addresses, a temporary's in the run's one allocation, then its scalar
    words), checked on a plan frozen on c:0 (no GPU needed: the table is data); temporaries alive together (from
    the kernel that writes one to the last that reads it) do not overlap, and some apart in time share room."""
    pytest.importorskip("cuda.bindings.driver", reason="cuda-bindings is not installed")
    from azyx.backends.cuda import _Frozen
    from azyx.device import ARENA_ALIGN

    ws = await weights("c:0")
    x = Tensor(rng.standard_normal((2, WIDTH)).astype(np.float32), device="c:0")
    await x.realize()
    for i in range(2):
        await chain(x, ws, 1.0 + i)[1].realize()
    plan = RT.executor.last[0]
    assert plan is not None
    (replay,) = frozen(plan)
    steps = replay.batch.steps
    lives = {s: [i for i, k in enumerate(steps) if s in k.args] for s in replay.arena}
    spans = {s: (off, off + plan.slots[s].nbytes) for s, off in replay.arena.items()}
    assert spans and all(a % ARENA_ALIGN == 0 and b <= replay.arena_size for a, b in spans.values())
    shared = 0
    for s, (a, b) in spans.items():
        for t, (c, d) in spans.items():
            if s < t and a < d and c < b:  # (sharing room: only with a temporary whose life is over)
                assert lives[s][-1] < lives[t][0] or lives[t][-1] < lives[s][0], (s, t, lives[s], lives[t])
                shared += 1
    assert shared
    assert replay.arena_size < sum(b - a for a, b in spans.values())
    dev = RT.device("c:0")
    bufs: list = [None] * len(plan.slots)
    for s in replay.bound:
        bufs[s] = dev.alloc(max(plan.slots[s].nbytes, 1))
    arena = dev.alloc(replay.arena_size)
    programs = {k.name: 1000 + i for i, k in enumerate(replay.batch.steps)}
    table = _Frozen(replay, programs)
    moved = list(bufs)  # (the first bound slot in a buffer of its own: a run that binds another)
    moved[replay.bound[0]] = dev.alloc(max(plan.slots[replay.bound[0]].nbytes, 1))
    for scalars in ([1.5] * plan.n_scalars, [-0.25 + i / 8 for i in range(plan.n_scalars)]):
        for run in (bufs, moved, bufs):
            got = table.launches(table.table(replay.addresses(run, arena), replay.words(scalars)))
            want = [(programs[k.name], k.launch, tuple(run[s].ptr if s not in replay.arena else
                                                       arena.ptr + replay.arena[s] for s in k.args) + k.words(scalars),
                     k.name) for k in replay.batch.steps]
            assert got == want
        # runs that bind the same buffers and values reuse the addresses and table kept (a chained step's)
        kept = replay.addresses(bufs, arena)
        assert replay.addresses(list(bufs), arena) is kept
        assert table.table(kept, replay.words(list(scalars))) is table.table(kept, replay.words(scalars))


@pytest.mark.parametrize("inline_updates", [48, 0])
async def test_cuda_graph_replays_new_buffers_and_scalars_as_data(inline_updates: int,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA a steady frozen batch is one graph: new input and output buffers and a scalar that change every run (a
    decode step's tokens, positions and logits) update the captured kernels' parameters instead of capturing a graph
    per run, and every run gives numpy's values, those launched before the capture, at it and after it, each read
    once later runs have replayed the graph with other values. With INLINE_UPDATES 0 every update is made by the
    submit thread (a crowd's first steps: too many updates for the loop's thread)."""
    if "cuda:0" not in azyx.devices():
        pytest.skip("no CUDA device")
    from azyx.backends import cuda_graph
    from azyx.backends.cuda_graph import _Graph

    monkeypatch.setattr(cuda_graph, "INLINE_UPDATES", inline_updates)
    rows = 2 if inline_updates else 3  # (a plan of its own: its graph is captured here, not by the other case)

    ws = await weights("cuda:0")
    cache = RT.device("cuda:0").graph_cache
    before = sum(isinstance(g, _Graph) for g in cache.graphs.values())
    kept = []
    for i in range(12):
        s = 0.75 + i / 32
        xn = rng.standard_normal((rows, WIDTH)).astype(np.float32)
        x = Tensor(xn, device="cuda:0")  # a new input buffer each run
        mid, y = chain(x, ws, s)
        await azyx.realize(mid, y)
        kept.append((mid, y, xn, s))
    graphs = sum(isinstance(g, _Graph) for g in cache.graphs.values()) - before
    assert graphs == 1, f"{graphs} graphs captured for one plan across 12 runs"
    for mid, y, xn, s in kept:
        ref_mid, ref_y = reference(xn, s)
        np.testing.assert_allclose(await mid.numpy(), ref_mid, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(await y.numpy(), ref_y, rtol=1e-5, atol=1e-5)


def test_a_run_launches_the_executable_graph_that_holds_its_values() -> None:
    """`_Graph.turn`: a run whose values an executable graph holds already launches that one (no update); another
    takes the one launched longest ago."""
    from azyx.backends.cuda_graph import _Graph

    g = _Graph([10, 11, 12], None, [])
    g.tables[:] = [b"a", b"b", b"c"]
    assert [g.turn(t) for t in (b"b", b"b", b"x")] == [1, 1, 0]  # 0: launched longest ago
    g.tables[0] = b"x"
    assert [g.turn(t) for t in (b"c", b"y", b"a")] == [2, 1, 0]  # 1 then 0: the least recently launched
    assert g.turn(b"x") == 0


async def test_cuda_runs_on_values_a_graph_holds_update_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """A steady plan run on a few sets of buffers in turn (a chained decode step's inputs and outputs cycle so) makes
    no parameter update once each set has an executable graph of its own, and every run gives numpy's values."""
    if "cuda:0" not in azyx.devices():
        pytest.skip("no CUDA device")
    from azyx.backends import cuda_graph

    updates = []
    update = cuda_graph.GraphCache.update
    monkeypatch.setattr(cuda_graph.GraphCache, "update", lambda self, *a: updates.append(a[2]) or update(self, *a))
    ws = await weights("cuda:0")
    inputs = [rng.standard_normal((2, WIDTH)).astype(np.float32) for _ in range(3)]
    xs = [Tensor(xn, device="cuda:0") for xn in inputs]
    await azyx.realize(*xs)
    counts = []
    for i in range(18):
        before = len(updates)
        mid, y = chain(xs[i % 3], ws, 0.5)
        await azyx.realize(mid, y)
        ref_mid, ref_y = reference(inputs[i % 3], 0.5)
        np.testing.assert_allclose(await y.numpy(), ref_y, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(await mid.numpy(), ref_mid, rtol=1e-5, atol=1e-5)
        counts.append(len(updates) - before)
    assert sum(counts[-6:]) == 0, counts


async def test_jit_submit_hands_back_queued_results_that_read_right(device: str) -> None:
    """`jit.submit` returns a replay's results once queued: reading each gives numpy's values (several submitted before
    any is read), a bad index raises at the read of its own run, and later submissions still read right."""
    ws = await weights(device)
    table = rng.standard_normal((5, WIDTH)).astype(np.float32)
    emb = Tensor(table, device=device)
    await emb.realize()

    @azyx.jit
    def step(ids: Tensor, s: float) -> Tensor:
        return chain(emb[ids], ws, s)[1]

    def ids_of(ids: list[int]) -> Tensor:
        return Tensor(np.array(ids, np.int32), device=device)

    await step(ids_of([0, 1]), 1.0)  # (traced: later calls replay)
    runs = [([0, 4], 1.0), ([1, 2], 1.125), ([3, 3], 0.75), ([4, 0], 1.5)]
    outs = [await step.submit(ids_of(ids), s) for ids, s in runs]
    assert step.replays >= len(runs)
    for y, (ids, s) in zip(outs, runs):
        np.testing.assert_allclose(await y.numpy(), reference(table[ids], s)[1], rtol=1e-5, atol=1e-5)
    dev = RT.device(device)
    assert dev.zeroed_checks  # clean runs leave their check words zero, for later runs to take as they are
    for _ in range(2):  # (a failed run's words are not taken again: the runs after it read clean)
        bad = await step.submit(ids_of([1, 7]), 1.5)
        good = await step.submit(ids_of([2, 1]), 0.5)
        with pytest.raises(IndexOutOfRange, match="index 7 is out of range for an axis of size 5"):
            await bad.numpy()
        np.testing.assert_allclose(await good.numpy(), reference(table[[2, 1]], 0.5)[1], rtol=1e-5, atol=1e-5)


async def test_jit_uploads_the_constants_it_makes_once(device: str) -> None:
    """Host data a jitted function makes for its device (an index ramp, a table from numpy) goes to the device at the
    trace, once: the trace binds the device's copy, so no replay uploads it again; every call equals numpy's."""
    table = rng.standard_normal((3, WIDTH)).astype(np.float32)

    @azyx.jit
    def f(x: Tensor) -> Tensor:
        ramp = Tensor.arange(WIDTH, dtype="float32", device=device)
        return (x * ramp + Tensor(table, device=device)).argmax(-1)

    for _ in range(4):
        xn = rng.standard_normal((3, WIDTH)).astype(np.float32)
        got = await (await f(Tensor(xn, device=device))).numpy()
        np.testing.assert_array_equal(got, (xn * np.arange(WIDTH, dtype=np.float32) + table).argmax(-1))
    assert f.replays >= 3
    (trace,) = f.traces.values()
    bound = [b for b in trace.constants if b is not None]
    assert bound and all(b.device.name == device for b in bound), [b.device.name for b in bound]
