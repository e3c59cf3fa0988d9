"""azyx.jit: a replay computes what a call of the function computes (against numpy and against the same loop run
eagerly, bit for bit), rebinds the handles the function rebinds, draws new random numbers in the function's order,
traces again when the signature or a handle's layout changes, keeps the graph flat, and refuses bad use with
AzyxError subclasses."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from runtime_state import settle

import azyx
from azyx import ArgumentError, GradientTape, Tensor, nn, optim
from azyx.runtime import RT

RNG = np.random.default_rng(11)


def chain(s: Tensor, t: Tensor) -> Tensor:
    return ((((s * 1.5 + t) * 2 - s) / 3).relu() * t + 1).exp().sqrt() - s


def np_chain(s: np.ndarray, t: np.ndarray) -> np.ndarray:
    return np.sqrt(np.exp(np.maximum(((s * 1.5 + t) * 2 - s) / 3, 0) * t + 1)) - s


async def test_a_replay_computes_the_function_of_this_calls_arguments(device: str) -> None:
    f = azyx.jit(chain)
    for _ in range(5):
        s_np = RNG.standard_normal(1000).astype(np.float32)
        t_np = RNG.standard_normal(1000).astype(np.float32)
        out = await f(Tensor(s_np, device=device), Tensor(t_np, device=device))
        assert out.device == device and out.shape == (1000,)
        np.testing.assert_allclose(await out.numpy(), np_chain(s_np, t_np), rtol=2e-6, atol=2e-6)
    assert f.replays == 4  # the first call traced


async def test_the_same_tensor_twice_and_a_lazy_argument(device: str) -> None:
    f = azyx.jit(chain)
    s_np = RNG.standard_normal(64).astype(np.float32)
    s = Tensor(s_np, device=device)
    await s.realize()
    for _ in range(3):
        np.testing.assert_allclose(await (await f(s, s)).numpy(), np_chain(s_np, s_np), rtol=2e-6, atol=2e-6)
        lazy = s * 2  # realized before it is bound
        np.testing.assert_allclose(await (await f(s, lazy)).numpy(), np_chain(s_np, 2 * s_np), rtol=2e-6, atol=2e-6)
    assert f.replays >= 3


async def test_a_result_returned_twice_is_two_handles_of_it(device: str) -> None:
    @azyx.jit
    def f(a: Tensor) -> tuple[Tensor, Tensor]:
        y = (a * 3).relu()
        return y, y

    a_np = RNG.standard_normal(33).astype(np.float32)
    a = Tensor(a_np, device=device)
    for _ in range(4):  # (a host array's first use moves it to the device: the second call traces again there)
        y1, y2 = await f(a)
        assert y1.id == y2.id
        del y1  # (the other handle still holds the node)
        np.testing.assert_allclose(await y2.numpy(), np.maximum(a_np * 3, 0), rtol=1e-6)
    assert f.replays >= 2


async def test_results_keep_the_structure_and_may_be_arguments(device: str) -> None:
    @azyx.jit
    def f(a: Tensor, b: Tensor, scale: float) -> tuple[Tensor, Tensor, Tensor]:
        return a + b * scale, a, (a * b).sum()

    for _ in range(3):
        a_np, b_np = RNG.standard_normal((4, 5)).astype(np.float32), RNG.standard_normal((4, 5)).astype(np.float32)
        a, b = Tensor(a_np, device=device), Tensor(b_np, device=device)
        s, same, total = await f(a, b, 0.5)
        assert same.id == a.id
        np.testing.assert_allclose(await s.numpy(), a_np + 0.5 * b_np, rtol=1e-6)
        np.testing.assert_allclose(await total.item(), float((a_np * b_np).sum()), rtol=1e-5)
    replays, traces = f.replays, len(f.traces)
    a, b = Tensor(a_np, device=device), Tensor(b_np, device=device)  # (host data again, as the trace saw it)
    out = await f(a, b, 2.0)  # a traced number: a new value replays the same trace
    np.testing.assert_allclose(await out[0].numpy(), a_np + 2 * b_np, rtol=1e-6)
    assert len(f.traces) == traces and f.replays == replays + 1


async def test_a_new_shape_traces_again_and_both_traces_stay() -> None:
    f = azyx.jit(lambda x: x.sum(axis=0))
    for shape in [(3, 4), (5, 2), (3, 4), (5, 2)]:
        x_np = RNG.standard_normal(shape).astype(np.float32)
        np.testing.assert_allclose(await (await f(Tensor(x_np))).numpy(), x_np.sum(axis=0), rtol=1e-5)
    assert len(f.traces) == 2 and f.replays == 2


def make_training(device: str, kind: str, dropout: float) -> tuple[Any, Any, optim.Optimizer]:
    azyx.manual_seed(5)
    model = nn.Sequential(nn.Linear(6, 16, device=device), nn.Dropout(dropout), nn.Linear(16, 3, device=device))
    opt: optim.Optimizer = (optim.SGD(model.parameters(), lr=0.1, momentum=0.9) if kind == "sgd"
                            else optim.Adam(model.parameters(), lr=0.02))

    def step(x: Tensor, y: Tensor) -> Tensor:
        with GradientTape() as tape:
            loss = nn.cross_entropy(model(x), y)
        opt.step(tape.gradient(loss, opt.params))
        return loss

    return model, step, opt


@pytest.mark.parametrize("kind", ["sgd", "adam"])
@pytest.mark.parametrize("dropout", [0.0, 0.3])
async def test_a_jitted_training_loop_is_bit_identical_to_the_eager_one(device: str, kind: str,
                                                                        dropout: float) -> None:
    rng = np.random.default_rng(3)
    data = [(rng.standard_normal((20, 6)).astype(np.float32), rng.integers(0, 3, 20).astype(np.int32))
            for _ in range(4)]

    async def run(jitted: bool) -> tuple[list[float], list[np.ndarray]]:
        _, step, opt = make_training(device, kind, dropout)
        f = azyx.jit(step) if jitted else None
        losses = []
        with azyx.train():
            for i in range(8):
                x, y = (Tensor(a, device=device) for a in data[i % 4])
                if f is not None:
                    loss = await f(x, y)
                else:
                    loss = step(x, y)
                    await azyx.realize(loss, *opt.tensors())
                losses.append(await loss.item())
        if f is not None:  # the second call traces again where the first one's state was host data to upload
            assert f.replays >= 6
        return losses, [await t.numpy() for t in opt.tensors()]

    eager_losses, eager_state = await run(False)
    jit_losses, jit_state = await run(True)
    assert jit_losses == eager_losses
    for a, b in zip(jit_state, eager_state):
        np.testing.assert_array_equal(a, b)
    assert sum(eager_losses[4:]) < sum(eager_losses[:4])  # the same four batches, later: it learns
    if dropout:  # new masks on every replay: the same batch gives another loss on its next visit
        assert len(set(jit_losses)) == len(jit_losses)


async def test_a_replay_draws_new_numbers_like_the_function_would() -> None:
    f = azyx.jit(lambda x: x + Tensor.rand(*x.shape) + Tensor.randn(*x.shape) * 0)
    x = Tensor(np.zeros(256, np.float32))
    azyx.manual_seed(9)
    got = [await (await f(x)).numpy() for _ in range(4)]
    azyx.manual_seed(9)
    want = []
    for _ in range(4):  # the same draws, in the same order, as calls of the function
        want.append(await (Tensor.rand(256) + Tensor.randn(256) * 0).numpy())
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)
    assert not np.array_equal(got[0], got[1]) and f.replays >= 2  # (a GPU: x uploaded by the first call, traced again)


async def test_a_handle_rebound_outside_between_calls_is_read_anew(device: str) -> None:
    w = Tensor(np.ones(4, np.float32), device=device)

    @azyx.jit
    def decay(x: Tensor) -> Tensor:
        w.assign(w * 0.5)
        return (w * x).sum()

    x = Tensor(np.arange(4, dtype=np.float32), device=device)
    assert await (await decay(x)).item() == pytest.approx(0.5 * 6)
    assert await (await decay(x)).item() == pytest.approx(0.25 * 6)
    w.assign(w + 1)  # lazy, outside: realized before the replay binds it
    replays = decay.replays
    assert await (await decay(x)).item() == pytest.approx(0.625 * 6)
    np.testing.assert_allclose(await w.numpy(), np.full(4, 0.625, np.float32))
    assert decay.replays == replays + 1


async def test_a_handle_written_in_place_keeps_its_node_and_returns_its_value(device: str) -> None:
    """A handle whose new value the plan writes into the buffer it holds (`cache[i] = x`, a KV cache's write) stays
    on its node on a replay (nothing rebound); returned by a replay, it is a second handle of that node; the values
    are the function's."""
    cache = Tensor.zeros(4, 3, device=device)  # (made on the device: a numpy array's tensor stays host memory, which a
    await cache.realize()                      # plan copies onto the device instead of writing into it)

    @azyx.jit
    def write(i: int, x: Tensor) -> tuple[Tensor, Tensor]:
        cache[i] = x * 2
        return cache, x.sum()

    want = np.zeros((4, 3), np.float32)
    ids, buffers = [], []
    for i in range(4):
        x = np.arange(3, dtype=np.float32) + i
        got, total = await write(i, Tensor(x, device=device))
        want[i] = x * 2
        np.testing.assert_allclose(await got.numpy(), want)
        assert await total.item() == pytest.approx(float(x.sum()))
        ids.append(cache.id)
        buffers.append(cache._node.buffer)
        assert got.id == cache.id and (got is not cache or i == 0)  # (the trace returns the handle itself)
        del got
    assert write.replays == 3 and all(b is buffers[0] for b in buffers)  # one plan, written in place
    assert ids[1] == ids[2] == ids[3]  # the replays left the handle on its node
    np.testing.assert_allclose(await cache.numpy(), want)


async def test_tensors_read_from_outside_are_constants_of_the_trace() -> None:
    c = Tensor(np.full(3, 2.0, np.float32))
    f = azyx.jit(lambda x: x * c)
    x = await (Tensor(np.ones(3, np.float32)) + 0).realize()  # on its device (host data would be uploaded by call 1)
    await f(x)
    c = Tensor(np.full(3, 5.0, np.float32))  # a new tensor under the closure's name: the trace keeps the old one
    np.testing.assert_array_equal(await (await f(x)).numpy(), np.full(3, 2.0, np.float32))


@pytest.mark.parametrize("kind", ["sgd", "adam"])
async def test_an_optimisers_rate_changed_between_calls_is_read_on_each_replay(device: str, kind: str) -> None:
    # a schedule sets opt.lr outside the step: a replay binds the new rate (it once kept the trace's rate)
    rng = np.random.default_rng(8)
    x_np, y_np = rng.standard_normal((20, 6)).astype(np.float32), rng.integers(0, 3, 20).astype(np.int32)
    results = []
    for jitted in (False, True):
        _, step, opt = make_training(device, kind, 0.0)
        sched = optim.LambdaLR(opt, lambda e: 0.5 ** e)
        f = azyx.jit(step) if jitted else None
        for _ in range(5):
            x, y = Tensor(x_np, device=device), Tensor(y_np, device=device)
            if f is not None:
                await f(x, y)
            else:
                await azyx.realize(step(x, y), *opt.tensors())
            sched.step()
        if f is not None:
            assert len(f.traces) == 1 and f.replays >= 3
        results.append([await t.numpy() for t in opt.tensors()])
    for a, b in zip(*results):
        np.testing.assert_array_equal(a, b)


async def test_replays_keep_the_graph_and_the_pools_flat(device: str) -> None:
    _, step, opt = make_training(device, "adam", 0.0)
    f = azyx.jit(step)
    x = Tensor(RNG.standard_normal((20, 6)).astype(np.float32), device=device)
    y = Tensor(RNG.integers(0, 3, 20).astype(np.int32), device=device)
    for _ in range(5):
        await f(x, y)
    base = await settle()
    plans = len(RT.plan_cache)
    for _ in range(200):
        loss = await f(x, y)
        del loss
    assert await settle() == base and len(RT.plan_cache) == plans


async def test_a_modules_training_mode_is_guarded() -> None:
    azyx.manual_seed(4)
    model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5))
    f = azyx.jit(lambda x: model(x))
    x = await (Tensor(RNG.standard_normal((4, 8)).astype(np.float32)) + 0).realize()
    model.eval()
    plain = await model(x).numpy()
    model.train()
    outs = [await (await f(x)).numpy() for _ in range(3)]
    assert all((o == 0).sum() > 0 for o in outs) and not np.array_equal(outs[1], outs[2])  # dropout, new masks
    model.eval()  # the trace was made in training mode: this call traces again, without dropout
    for _ in range(2):
        np.testing.assert_array_equal(await (await f(x)).numpy(), plain)
    model.train()
    assert ((await (await f(x)).numpy()) == 0).sum() > 0


async def test_a_method_under_jit() -> None:
    class Scale:
        def __init__(self, k: float):
            self.k = k

        @azyx.jit
        def apply(self, x: Tensor) -> Tensor:
            return x * self.k

    a, b = Scale(2.0), Scale(3.0)
    x = await (Tensor(np.arange(3, dtype=np.float32)) + 0).realize()
    for _ in range(2):
        np.testing.assert_array_equal(await (await a.apply(x)).numpy(), [0, 2, 4])
        np.testing.assert_array_equal(await (await b.apply(x)).numpy(), [0, 3, 6])
    assert Scale.apply.replays == 2


async def test_bad_use_raises_argument_errors() -> None:
    async def coro(x: Tensor) -> Tensor:
        return x

    with pytest.raises(ArgumentError, match="coroutine"):
        azyx.jit(coro)
    f = azyx.jit(lambda x, table: x + 1)
    with pytest.raises(ArgumentError, match="'table'|argument 1"):
        await f(Tensor([1.0]), [1, 2])
    g = azyx.jit(lambda x: {"y": x})
    with pytest.raises(ArgumentError, match="returned a dict"):
        await g(Tensor([1.0]))
    h = azyx.jit(lambda x: x * 2)  # the runtime stays usable
    np.testing.assert_array_equal(await (await h(Tensor([1.0]))).numpy(), [2.0])
    assert Tensor.tracer is None
