"""Numbers are data: graphs that differ only in their Python numbers share one plan and compile nothing new, on every
device, and give numpy's values for every number (negative, -0.0, inf, nan, ints, narrow and wide floats); learning-rate
schedules follow PyTorch's LambdaLR trajectory; azyx.jit traces float and int arguments."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable

import numpy as np
import pytest

import azyx
from azyx import GradientTape, Tensor, dtypes, nn, optim
from azyx.runtime import RT

try:
    import torch
except ImportError:
    torch = None  # type: ignore[assignment]

RNG = np.random.default_rng(7)
VALUES = [1.5, -0.75, 0.0, -0.0, 3.0, -2.5e-3, 7.0e4, float("inf"), float("-inf"), float("nan")]


async def _family(device: str, build: Callable[[Tensor, float], Tensor], ref: Callable[[np.ndarray, float], np.ndarray],
                  x_np: np.ndarray, values: list[float], dtype: object = None, rtol: float = 1e-6) -> None:
    """Realize build(x, v) for every value: one plan, compiles only for the first, numpy's result for each."""
    x = Tensor(x_np, dtype=dtype, device=device)
    await x.realize()
    for _ in range(2):  # (the first run may upload x's host data to the device: the second plans as all later)
        out = await build(x, values[0]).numpy()
        np.testing.assert_allclose(out, ref(x_np, values[0]), rtol=rtol, atol=1e-6)
    plans, compiled = len(RT.plan_cache), RT.compiled
    for v in values[1:]:
        with np.errstate(all="ignore"):
            want = ref(x_np, v)
        got = await build(x, v).numpy()
        assert got.dtype == want.dtype, (v, got.dtype, want.dtype)
        np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol, err_msg=f"value {v!r}")
    assert len(RT.plan_cache) == plans, "a new number made a new plan"
    assert RT.compiled == compiled, "a new number compiled a kernel"


async def test_elementwise_with_scalars_plans_and_compiles_once(device: str) -> None:
    x_np = RNG.standard_normal((5, 7)).astype(np.float32)
    await _family(device, lambda x, a: ((x * a + 2.0).relu() * 0.5 - a) / 3.0,
                  lambda x, a: ((np.maximum(x * np.float32(a) + 2, 0) * np.float32(0.5) - np.float32(a)) /
                                np.float32(3)).astype(np.float32), x_np, VALUES)


async def test_a_crowd_of_requests_for_one_new_graph_plans_and_compiles_it_once(device: str) -> None:
    """200 concurrent requests whose graphs differ only in their numbers, of a structure no run has seen: one plan
    (the others wait for it instead of each planning it on a worker thread), one compile, numpy's value for each."""
    x_np = RNG.standard_normal(4096).astype(np.float32)
    x = await Tensor(x_np, device=device).realize()
    await (x + 1.0).realize()  # (a first use may upload x's host data: later plans find it on the device)
    depth = 3 + int(RNG.integers(0, 1 << 20)) % 5  # (a chain length and exponent no other test builds together)
    power = float(RNG.integers(2, 1 << 20) % 3 + 2)
    planned, compiled = RT.planned, RT.compiled

    async def request(a: float, b: float) -> float:
        y = x * a + b
        for _ in range(depth):
            y = (y * 0.5).abs() + b
        return float(await (y ** power).sum().item())

    pairs = [(float(a), float(b)) for a, b in RNG.uniform(-1, 1, (200, 2))]
    got = await asyncio.gather(*(request(a, b) for a, b in pairs))
    for (a, b), value in zip(pairs, got):
        y = x_np.astype(np.float64) * np.float32(a) + np.float32(b)
        for _ in range(depth):
            y = np.abs(y * 0.5) + np.float32(b)
        np.testing.assert_allclose(value, (y ** power).sum(), rtol=1e-4, err_msg=f"a={a} b={b}")
    assert RT.planned - planned == 1, f"{RT.planned - planned} plans made for one graph"
    assert RT.compiled > compiled  # (a new structure: its kernel was compiled, once, by the realize that planned it)


async def test_division_by_a_signed_zero_keeps_its_sign(device: str) -> None:
    # issue 13's bug 6: 0.0 and -0.0 compare equal, so a cache keyed by the value served the first one's kernel
    x = Tensor(np.ones(4, np.float32), device=device)
    assert (await (1.0 / (x * 0.0)).numpy()).tolist() == [math.inf] * 4
    y = Tensor(np.ones(4, np.float32), device=device)
    assert (await (1.0 / (y * -0.0)).numpy()).tolist() == [-math.inf] * 4


async def test_reduction_of_a_scaled_relu_is_one_plan(device: str) -> None:
    x_np = RNG.standard_normal(1000).astype(np.float32)
    await _family(device, lambda x, a: ((x * a + (1 - a)).relu() * 0.5).sum(),
                  lambda x, a: np.float32((np.maximum(x.astype(np.float64) * a + (1 - a), 0) * 0.5).sum()),
                  x_np, [0.25, 2.0, -1.0, 0.0, 10.0], rtol=1e-5)


async def test_where_clip_pad_full_and_pow_take_their_numbers_as_arguments(device: str) -> None:
    x_np = RNG.standard_normal((4, 6)).astype(np.float32)
    values = [0.5, -1.25, 2.0, 0.0, 1e30]
    await _family(device, lambda x, v: Tensor.where(x > 0, x, v), lambda x, v: np.where(x > 0, x, np.float32(v)),
                  x_np, values)
    await _family(device, lambda x, v: x.clip(-abs(v), abs(v)),
                  lambda x, v: np.clip(x, -np.float32(abs(v)), np.float32(abs(v))), x_np, values)
    await _family(device, lambda x, v: x.pad(((1, 2), (0, 1)), value=v),
                  lambda x, v: np.pad(x, ((1, 2), (0, 1)), constant_values=np.float32(v)), x_np, values)
    await _family(device, lambda x, v: x + Tensor.full((4, 6), v, device=device),
                  lambda x, v: x + np.float32(v), x_np, values)
    await _family(device, lambda x, v: x.abs() ** v, lambda x, v: np.abs(x) ** np.float32(v),
                  x_np, [1.5, -0.25, 3.5, 0.75], rtol=1e-5)  # (0.5, 1 and 2 are sqrt, identity and square)


async def test_integer_scalars_on_integer_tensors(device: str) -> None:
    x_np = RNG.integers(-50, 50, (3, 5)).astype(np.int32)
    await _family(device, lambda x, v: x * v + (v - 1), lambda x, v: x * np.int32(v) + np.int32(v - 1),
                  x_np, [3, -7, 0, 1 << 20])
    await _family(device, lambda x, v: x // v, lambda x, v: x // np.int32(v), x_np, [3, -7, 1, 11])
    x64 = RNG.integers(-(1 << 40), 1 << 40, 6).astype(np.int64)
    await _family(device, lambda x, v: x + v, lambda x, v: x + np.int64(v), x64, [1 << 41, -(1 << 35), 5],
                  dtype=dtypes.int64)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float64"])
async def test_narrow_and_wide_floats_bind_their_numbers(device: str, dtype: str) -> None:
    if dtype == "float64" and device.startswith("opencl"):
        import pyopencl as cl  # noqa: F401  (PoCL has doubles; a device without them skips)
    x_np = RNG.standard_normal(9)
    if dtype == "bfloat16":
        x = np.asarray(x_np, np.float32)
        values = [0.5, -3.0, 2.0]
        await _family(device, lambda t, v: (t * v + v), lambda t, v: (t * np.float32(v) + np.float32(v)),
                      (x.view(np.uint32) & 0xFFFF0000).view(np.float32), values, dtype=dtypes.bfloat16, rtol=1e-2)
        return
    npdt = np.dtype(dtype)
    values = [0.5, -3.0, 1e-3, 2.0]
    await _family(device, lambda t, v: t * v + v, lambda t, v: (t * npdt.type(v) + npdt.type(v)).astype(npdt),
                  x_np.astype(npdt), values, rtol=1e-3 if dtype == "float16" else 1e-12)  # (f16: in f32)


async def test_the_dummy_device_accounts_scalar_arguments() -> None:
    dummy = RT.device("dummy:0")
    before = dummy.scalars_bound
    x = Tensor(np.zeros(4, np.float32), device="dummy:0")
    for a in (1.0, 2.0, 3.0):
        await (x * a + 1.0).realize()
    assert dummy.scalars_bound - before == 3 * 2  # each run binds its two numbers


# ---- learning-rate schedules ---------------------------------------------------------------------------------------
def _lr_lambda(epoch: int) -> float:
    return 0.9 ** epoch * (1.0 + 0.1 * (epoch % 3))


@pytest.mark.skipif(torch is None, reason="PyTorch is not installed")
@pytest.mark.parametrize("kind", ["sgd", "adam"])
async def test_a_lambda_lr_schedule_follows_pytorch_and_compiles_once(device: str, kind: str) -> None:
    x_np = RNG.standard_normal((16, 5)).astype(np.float32)
    y_np = RNG.standard_normal((16, 2)).astype(np.float32)
    w_np = RNG.standard_normal((5, 2)).astype(np.float32)
    w = Tensor(w_np.copy(), device=device)
    x, y = Tensor(x_np, device=device), Tensor(y_np, device=device)
    opt = optim.SGD([w], lr=0.05, momentum=0.9) if kind == "sgd" else optim.Adam([w], lr=0.05)
    sched = optim.lr_scheduler.LambdaLR(opt, _lr_lambda)
    wt = torch.tensor(w_np.copy(), requires_grad=True)
    topt = torch.optim.SGD([wt], lr=0.05, momentum=0.9) if kind == "sgd" else torch.optim.Adam([wt], lr=0.05)
    tsched = torch.optim.lr_scheduler.LambdaLR(topt, _lr_lambda)
    xt, yt = torch.from_numpy(x_np), torch.from_numpy(y_np)
    plans = compiled = -1
    for step in range(12):
        with GradientTape() as tape:
            loss = (x @ w - y).square().mean()
        await azyx.realize(loss, *opt.step(tape.gradient(loss, [w])))
        sched.step()
        topt.zero_grad()
        ((xt @ wt - yt) ** 2).mean().backward()
        topt.step()
        tsched.step()
        assert opt.lr == pytest.approx(tsched.get_last_lr()[0], rel=1e-12)
        np.testing.assert_allclose(await w.numpy(), wt.detach().numpy(), rtol=2e-5, atol=2e-5)
        if step == 2:  # the plan and its kernels exist: no later step (each with a new rate) adds any
            plans, compiled = len(RT.plan_cache), RT.compiled
    assert (len(RT.plan_cache), RT.compiled) == (plans, compiled)


# ---- azyx.jit and numbers ------------------------------------------------------------------------------------------
async def _computed(x_np: np.ndarray, device: str | None) -> Tensor:
    """x_np in a buffer of the device (host data for a GPU-style device is uploaded by the first plan that reads it,
    which makes a second trace: the argument's layout changed)."""
    return await (Tensor(x_np, device=device) * 1.0).realize()


async def test_a_jitted_function_called_with_50_floats_traces_once(device: str) -> None:
    @azyx.jit
    def f(x: Tensor, scale: float, shift: float) -> Tensor:
        return (x * scale + shift * 0.5).relu() - scale ** 2

    x_np = RNG.standard_normal(33).astype(np.float32)
    x = await _computed(x_np, device)
    await (await f(x, 1.0, 0.0)).realize()
    compiled = RT.compiled
    for i in range(50):
        scale, shift = float(RNG.standard_normal()), float(RNG.standard_normal())
        got = await (await f(x, scale, shift)).numpy()
        want = np.maximum(x_np * np.float32(scale) + np.float32(shift * 0.5), 0) - np.float32(scale ** 2)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=f"call {i}")
    assert len(f.traces) == 1 and f.replays >= 50
    assert RT.compiled == compiled


async def test_a_decision_made_from_a_traced_number_is_guarded(device: str) -> None:
    @azyx.jit
    def f(x: Tensor, t: float) -> Tensor:
        return x * t if t > 0 else x - t  # Python branches on the value: a guard, not a constant

    x_np = RNG.standard_normal(8).astype(np.float32)
    x = await _computed(x_np, device)
    for t in (2.0, 3.0, -1.0, -4.0, 0.5):
        np.testing.assert_allclose(await (await f(x, t)).numpy(), x_np * np.float32(t) if t > 0 else
                                   x_np - np.float32(t), rtol=1e-6)
    assert len(f.traces) == 1  # one signature; the branch that flipped traced again under it
    assert f.replays >= 2


async def test_static_argnames_and_int_arguments(device: str) -> None:
    @azyx.jit(static_argnames=("n",))
    def f(x: Tensor, n: int, k: int) -> Tensor:
        return x.reshape(n, -1).sum(axis=1) * k

    x_np = RNG.standard_normal(12).astype(np.float32)
    x = await _computed(x_np, device)
    for n, k in [(3, 2), (3, 5), (4, 5), (3, -1), (2, 7)]:
        np.testing.assert_allclose(await (await f(x, n, k)).numpy(), x_np.reshape(n, -1).sum(axis=1) * k, rtol=1e-5)
    assert len(f.traces) == 3  # n is static: one trace per n; k is traced
    with pytest.raises(azyx.AzyxError):
        azyx.jit(lambda x: x, static_argnames=("nope",))


async def test_an_lr_schedule_under_jit_replays() -> None:
    model = nn.Linear(6, 3)
    opt = optim.SGD(model.parameters(), lr=0.1)
    x_np = RNG.standard_normal((8, 6)).astype(np.float32)
    y_np = RNG.standard_normal((8, 3)).astype(np.float32)

    @azyx.jit
    def step(x: Tensor, y: Tensor, lr: float) -> Tensor:
        opt.lr = lr
        with GradientTape() as tape:
            loss = (model(x) - y).square().mean()
        opt.step(tape.gradient(loss, opt.params))
        return loss

    ws = [(await p.numpy()).astype(np.float64) for p in opt.params]  # weight (out, in), bias
    x, y = await _computed(x_np, None), await _computed(y_np, None)
    for i in range(6):
        lr = 0.1 * 0.5 ** i
        await step(x, y, lr)
        # the same step in numpy (float64), with this step's rate
        w, b = ws
        g = 2 * (x_np @ w.T + b - y_np) / y_np.size
        ws = [w - lr * (g.T @ x_np), b - lr * g.sum(axis=0)]
    for p, want in zip(opt.params, ws):
        np.testing.assert_allclose(await p.numpy(), want, rtol=1e-4, atol=1e-5)
    # one signature; on a GPU-style device the parameters' first values are host data that the first call uploads,
    # so the second call traces again (README): at most two traces, every later call a replay
    assert len(step.traces) == 1 and step.replays >= 4
