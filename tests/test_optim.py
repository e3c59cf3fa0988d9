"""azyx.optim: every optimiser against a numpy reference of its update rule (and torch.optim when importable),
Tensor.assign, one plan per training step with a plan cache that stops growing, a 10,000-iteration loop whose graph
size and RSS stay flat, and a small classifier reaching the accuracy PyTorch reaches from the same init."""

from __future__ import annotations

import asyncio
import os
import statistics
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import azyx
from azyx import GradientTape, Tensor, nn, optim
from azyx.graph import GRAPH
from azyx.realize import run_sync
from azyx.runtime import RT

try:
    import torch
except ImportError:
    torch = None  # type: ignore[assignment]


# ---- a least-squares problem with a closed-form gradient ------------------------------------------------------------
RNG = np.random.default_rng(0)
A, B = RNG.standard_normal((8, 3)), RNG.standard_normal((8, 2))
W0, C0 = RNG.standard_normal((3, 2)), RNG.standard_normal(2)


def np_grads(w: np.ndarray, c: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    r = A @ w + c - B  # loss = mean(r**2)
    return 2 * A.T @ r / r.size, 2 * r.sum(axis=0) / r.size


def ref_trajectory(kind: str, hp: dict[str, Any], steps: int) -> list[np.ndarray]:
    """The documented update rules, in numpy (PyTorch's formulas)."""
    ps = [W0.copy(), C0.copy()]
    state: list[dict[str, Any]] = [{"buf": np.zeros_like(p), "m": np.zeros_like(p), "v": np.zeros_like(p)} for p in ps]
    lr = hp["lr"]
    for t in range(1, steps + 1):
        gs = np_grads(*ps)
        for p, g, s in zip(ps, gs, state):
            wd = hp.get("weight_decay", 0.0)
            if kind == "sgd":
                g = g + wd * p
                if hp.get("momentum"):
                    s["buf"] = hp["momentum"] * s["buf"] + g
                    g = g + hp["momentum"] * s["buf"] if hp.get("nesterov") else s["buf"]
                p -= lr * g
            else:
                b1, b2 = hp.get("betas", (0.9, 0.999))
                if kind == "adamw":
                    p *= 1 - lr * hp.get("weight_decay", 1e-2)
                else:
                    g = g + wd * p
                s["m"] = b1 * s["m"] + (1 - b1) * g
                s["v"] = b2 * s["v"] + (1 - b2) * g * g
                p -= lr / (1 - b1**t) * s["m"] / (np.sqrt(s["v"] / (1 - b2**t)) + hp.get("eps", 1e-8))
    return ps


OPTIMS: list[tuple[str, str, dict[str, Any]]] = [
    ("sgd", "SGD", {"lr": 0.1}),
    ("sgd", "SGD", {"lr": 0.05, "momentum": 0.9}),
    ("sgd", "SGD", {"lr": 0.05, "momentum": 0.8, "nesterov": True, "weight_decay": 0.1}),
    ("adam", "Adam", {"lr": 0.05}),
    ("adam", "Adam", {"lr": 0.02, "betas": (0.8, 0.99), "eps": 1e-6, "weight_decay": 0.05}),
    ("adamw", "AdamW", {"lr": 0.05, "weight_decay": 0.1}),
]


def azyx_trajectory(device: str, cls: str, hp: dict[str, Any], steps: int) -> list[np.ndarray]:
    w, c = Tensor(W0, device=device), Tensor(C0, device=device)
    a, b = Tensor(A, device=device), Tensor(B, device=device)
    opt = getattr(optim, cls)([w, c], **hp)
    for _ in range(steps):
        with GradientTape() as tape:
            loss = ((a @ w + c) - b).square().mean()
        out = opt.step(tape.gradient(loss, [w, c]))
        assert out[:2] == [w, c] and len(out) == 2 + len(opt.state)
        run_sync(azyx.realize(loss, *out))
    return [w.numpy_sync(), c.numpy_sync()]


@pytest.mark.parametrize("kind,cls,hp", OPTIMS, ids=[f"{c}-{'-'.join(map(str, h))}" for _, c, h in OPTIMS])
def test_optimisers_follow_their_update_rules(device: str, kind: str, cls: str, hp: dict[str, Any]) -> None:
    got = azyx_trajectory(device, cls, hp, 6)
    for g, ref in zip(got, ref_trajectory(kind, hp, 6)):
        np.testing.assert_allclose(g, ref, rtol=1e-10, atol=1e-12)
    if torch is None:
        return
    tw, tc = torch.tensor(W0, requires_grad=True), torch.tensor(C0, requires_grad=True)
    topt = getattr(torch.optim, cls)([tw, tc], **hp)
    ta, tb = torch.tensor(A), torch.tensor(B)
    for _ in range(6):
        topt.zero_grad()
        ((ta @ tw + tc) - tb).square().mean().backward()
        topt.step()
    np.testing.assert_allclose(got[0], tw.detach().numpy(), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(got[1], tc.detach().numpy(), rtol=1e-10, atol=1e-12)


def test_optimiser_argument_errors(device: str) -> None:
    w = Tensor(np.ones(3, np.float32), device=device)
    with pytest.raises(azyx.ArgumentError, match="-1"):
        optim.SGD([w], lr=-1)
    with pytest.raises(azyx.DTypeError, match="int32"):
        optim.Adam([Tensor(np.ones(2, np.int32), device=device)])
    with pytest.raises(azyx.ArgumentError, match="nesterov"):
        optim.SGD([w], nesterov=True)
    with pytest.raises(azyx.ArgumentError, match=r"\(0.9, 1.0\)"):
        optim.Adam([w], betas=(0.9, 1.0))
    opt = optim.SGD([w], lr=0.1)
    with pytest.raises(azyx.ArgumentError, match="2 gradients for 1"):
        opt.step([w, w])
    with pytest.raises(azyx.ShapeError, match=r"\(2,\)"):
        opt.step([Tensor(np.ones(2, np.float32), device=device)])
    opt.step([None])  # None: that parameter is left as it is
    np.testing.assert_array_equal(w.numpy_sync(), np.ones(3))


def test_assign_rebinds_the_handle_with_checks(device: str) -> None:
    w = Tensor(np.array([1.0, 2.0], np.float32), device=device)
    alias = Tensor(w)  # another handle to the old value
    assert w.assign(w * 3 + 1) is w
    np.testing.assert_array_equal(w.numpy_sync(), [4.0, 7.0])
    np.testing.assert_array_equal(alias.numpy_sync(), [1.0, 2.0])  # functional: the old value is untouched
    w.assign(np.array([5.0, 6.0]))  # array-likes become tensors of w's dtype on w's device
    assert w.dtype == azyx.dtypes.float32
    np.testing.assert_array_equal(w.numpy_sync(), [5.0, 6.0])
    with pytest.raises(azyx.ShapeError, match=r"\(3,\).*\(2,\)"):
        w.assign(Tensor(np.ones(3, np.float32), device=device))
    with pytest.raises(azyx.DTypeError, match="float64"):
        w.assign(Tensor(np.ones(2), device=device))
    if "c:1" in azyx.devices() and device == "c:0":
        with pytest.raises(azyx.DeviceError, match="c:1"):
            w.assign(Tensor(np.ones(2, np.float32), device="c:1"))
    np.testing.assert_array_equal(w.numpy_sync(), [5.0, 6.0])  # a refused assign leaves the handle as it was


def test_assign_moves_an_automatically_placed_handle_to_its_new_value(device: str) -> None:
    """A parameter made without a device (AUTO) and data placed on `device`: the update is computed where the data
    is, and the parameter's handle goes there (a pinned handle refuses instead, above)."""
    w0 = np.array([[0.5, -1.0], [2.0, 0.25]], np.float32)
    xs = np.array([[1.0, 2.0], [3.0, -1.0]], np.float32)
    w = Tensor(w0)
    w.realize_sync()
    x = Tensor(xs, device=device)
    opt = optim.SGD([w], lr=0.1)
    with azyx.GradientTape() as tape:
        loss = (x @ w).sum()
    opt.step(tape.gradient(loss, [w]))
    grad = xs.sum(axis=0)[:, None] * np.ones((1, 2), np.float32)  # d sum(x @ w) / dw
    np.testing.assert_allclose(w.numpy_sync(), w0 - 0.1 * grad, rtol=1e-6)
    assert w.device == device


# ---- a training loop: one plan per step, a flat graph, flat memory ------------------------------------------------
class MLP(nn.Module):
    def __init__(self, sizes: list[int], device: str | None) -> None:
        self.layers = [nn.Linear(a, b, device=device) for a, b in zip(sizes, sizes[1:])]

    def forward(self, x: Tensor) -> Tensor:
        for layer in self.layers[:-1]:
            x = layer(x).relu()
        return self.layers[-1](x)


def make_step(model: nn.Module, opt: optim.Optimizer) -> Callable[[Tensor, Tensor], Any]:
    async def step(x: Tensor, y: Tensor) -> Tensor:
        with GradientTape() as tape:
            loss = nn.cross_entropy(model(x), y)
        await azyx.realize(loss, *opt.step(tape.gradient(loss, opt.params)))
        return loss

    return step


async def test_each_step_is_one_plan_and_the_cache_hits_from_the_second_step(device: str) -> None:
    await _one_plan_per_step(device)


async def test_with_auto_placement_too() -> None:
    await _one_plan_per_step(None)  # model and data placed by the runtime, unpinned: helpers follow (no re-plan)


async def _one_plan_per_step(dev: str | None) -> None:
    azyx.manual_seed(0)
    model = MLP([5, 16, 3], dev)
    opt = optim.Adam(model.parameters(), lr=1e-2)
    step = make_step(model, opt)
    rng = np.random.default_rng(0)
    batches = [(Tensor(rng.standard_normal((8, 5)).astype(np.float32), device=dev),
                Tensor(rng.integers(0, 3, 8).astype(np.int32), device=dev)) for _ in range(3)]
    with GradientTape() as tape:
        loss = nn.cross_entropy(model(batches[0][0]), batches[0][1])
    opt.step(tape.gradient(loss, opt.params))
    plan = azyx.schedule(loss, *opt.tensors())  # forward, backward and update of every parameter: one plan
    assert len(plan.outputs) == 1 + len(opt.tensors()) and len(plan.kernels) > 5
    await azyx.realize(loss, *opt.tensors())
    size = len(RT.plan_cache)
    if not RT.device(model.parameters()[0].device).host_memory:  # inputs first held in host memory move over on
        for x, y in batches:  # their first use, which changes their leaves' keys once: warm up on every batch
            await step(x, y)
        size = len(RT.plan_cache)
    losses = [await (await step(*batches[i % 3])).item() for i in range(12)]
    assert len(RT.plan_cache) == size  # the same structure every step (on C, the first included): the cached plan
    assert losses[-1] < losses[0]


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs /proc/self/statm (Linux)")
async def test_ten_thousand_steps_keep_graph_and_memory_flat() -> None:
    device = "c:0"
    azyx.manual_seed(1)
    model = MLP([4, 8, 3], device)
    opt = optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    step = make_step(model, opt)
    rng = np.random.default_rng(1)
    x = Tensor(rng.standard_normal((6, 4)).astype(np.float32), device=device)
    y = Tensor(rng.integers(0, 3, 6).astype(np.int32), device=device)
    for _ in range(300):  # warm-up: plans compiled, pools and caches filled
        await step(x, y)
    graph_base, rss_base, plans = len(GRAPH), _rss_bytes(), len(RT.plan_cache)
    samples = []
    for i in range(10_000):
        loss = await step(x, y)
        del loss
        assert len(GRAPH) == graph_base, f"iteration {i}: {len(GRAPH)} live nodes, baseline {graph_base}"
        if i % 1000 == 999:
            samples.append(_rss_bytes() - rss_base)
    # fixed slack for allocator and interpreter noise (measured: under 100 KiB) and for blocks the process makes once
    # meanwhile (CI runs, in a worker that had run other tests: one step of 4,084 KiB; two of 5,108 and 3,576 KiB, flat
    # before, between and after). A leak grows in every interval: the median interval's growth, 16 KiB over 1,000
    # steps, is 16 bytes a step, less than one leaked node, handle or buffer per step
    trend = statistics.median(b - a for a, b in zip(samples, samples[1:]))
    assert max(samples) < 16 << 20, f"RSS grew by {[s >> 10 for s in samples]} KiB over the loop"
    assert trend < 16 << 10, f"RSS trend {[s >> 10 for s in samples]} KiB"
    assert len(RT.plan_cache) == plans


# ---- a classifier trained from the same init as PyTorch --------------------------------------------------------------
def spirals(n: int, seed: int, noise: float) -> tuple[np.ndarray, np.ndarray]:
    """Three interleaved noisy spirals in 2-D: not linearly separable, and with overlap, so that a good model stays
    below 100% and the comparison with PyTorch means something."""
    rng = np.random.default_rng(seed)
    xs, ys = [], []
    for c in range(3):
        r = np.linspace(0.1, 1.0, n)
        theta = np.linspace(c * 2 * np.pi / 3, c * 2 * np.pi / 3 + 3.0, n) + rng.normal(0, 0.12, n)
        xs.append(np.stack([r * np.cos(theta), r * np.sin(theta)], axis=1) + rng.normal(0, noise, (n, 2)))
        ys.append(np.full(n, c))
    return np.concatenate(xs).astype(np.float32), np.concatenate(ys).astype(np.int32)


async def test_classifier_reaches_the_accuracy_pytorch_reaches() -> None:
    device, steps = "c:0", 300
    x_np, y_np = spirals(100, seed=3, noise=0.1)
    xt_np, yt_np = spirals(100, seed=5, noise=0.1)  # held out
    azyx.manual_seed(4)
    model = MLP([2, 32, 32, 3], device)
    init = [await p.numpy() for p in model.parameters()]
    opt = optim.Adam(model.parameters(), lr=0.01)
    step = make_step(model, opt)
    x, y = Tensor(x_np, device=device), Tensor(y_np, device=device)
    for _ in range(steps):
        loss = await step(x, y)
    acc = float(((await model(x).argmax(axis=-1).numpy()) == y_np).mean())
    test_acc = float(((await model(Tensor(xt_np, device=device)).argmax(axis=-1).numpy()) == yt_np).mean())
    final_loss = await loss.item()
    if torch is None:
        assert acc >= 0.93 and test_acc >= 0.85, (acc, test_acc)
        return
    tmodel = torch.nn.Sequential(torch.nn.Linear(2, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32), torch.nn.ReLU(),
                                 torch.nn.Linear(32, 3))
    with torch.no_grad():
        for tp, p in zip(tmodel.parameters(), init):  # the same init, copied over
            tp.copy_(torch.from_numpy(p))
    topt = torch.optim.Adam(tmodel.parameters(), lr=0.01)
    tx, ty = torch.from_numpy(x_np), torch.from_numpy(y_np.astype(np.int64))
    for _ in range(steps):
        topt.zero_grad()
        tloss = torch.nn.functional.cross_entropy(tmodel(tx), ty)
        tloss.backward()
        topt.step()
    with torch.no_grad():
        tacc = float((tmodel(tx).argmax(dim=-1).numpy() == y_np).mean())
        ttest = float((tmodel(torch.from_numpy(xt_np)).argmax(dim=-1).numpy() == yt_np).mean())
    print(f"accuracy: azyx {acc:.4f} (held out {test_acc:.4f}), PyTorch {tacc:.4f} (held out {ttest:.4f}); "
          f"final loss: azyx {final_loss:.4f}, PyTorch {tloss.item():.4f}")
    assert 0.9 <= tacc < 1.0, f"the reference should learn but not memorise: {tacc}"
    assert abs(acc - tacc) <= 0.02 and abs(test_acc - ttest) <= 0.03, (acc, tacc, test_acc, ttest)
    assert abs(final_loss - tloss.item()) <= 0.1 * tloss.item(), (final_loss, tloss.item())


@pytest.mark.parametrize("kind", ["sgd", "adam"])
async def test_a_pipelined_loop_trains_exactly_like_the_awaited_one(kind: str) -> None:
    # step i's realize runs as a task (its batch queued in C) while step i+1 is built; then it is awaited
    device, steps = "c:0", 6
    rng = np.random.default_rng(7)
    data = [(rng.standard_normal((128, 64)).astype(np.float32), rng.integers(0, 4, 128).astype(np.int32))
            for _ in range(3)]

    def setup() -> tuple[MLP, optim.Optimizer, list[tuple[Tensor, Tensor]]]:
        azyx.manual_seed(2)
        model = MLP([64, 128, 4], device)
        opt: optim.Optimizer = (optim.SGD(model.parameters(), lr=0.05, momentum=0.9) if kind == "sgd"
                                else optim.Adam(model.parameters(), lr=1e-2))
        return model, opt, [(Tensor(x, device=device), Tensor(y, device=device)) for x, y in data]

    def build(model: MLP, opt: optim.Optimizer, x: Tensor, y: Tensor) -> list[Tensor]:
        with GradientTape() as tape:
            loss = nn.cross_entropy(model(x), y)
        return [loss, *opt.step(tape.gradient(loss, opt.params))]

    model, opt, batches = setup()
    init = [await p.numpy() for p in model.parameters()]
    awaited = []
    for i in range(steps):
        targets = build(model, opt, *batches[i % 3])
        await azyx.realize(*targets)
        awaited.append(await targets[0].item())
    want = [await t.numpy() for t in opt.tensors()]

    model, opt, batches = setup()
    queued = RT.device(device).queue.native_last
    running: list[tuple[asyncio.Future[None], Tensor]] = []
    for i in range(steps):
        targets = build(model, opt, *batches[i % 3])
        running.append((asyncio.ensure_future(azyx.realize(*targets)), targets[0]))
        await asyncio.sleep(0)  # its plan is submitted; the next step is built while it runs
        if len(running) > 1:
            await running.pop(0)[0]
    await running.pop()[0]
    assert RT.device(device).queue.native_last > queued  # the steps' batches went to the C runner
    got = [await t.numpy() for t in opt.tensors()]
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)
    if torch is None:
        return
    tmodel = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 4))
    with torch.no_grad():
        for tp, p in zip(tmodel.parameters(), init):
            tp.copy_(torch.from_numpy(p))
    topt = (torch.optim.SGD(tmodel.parameters(), lr=0.05, momentum=0.9) if kind == "sgd"
            else torch.optim.Adam(tmodel.parameters(), lr=1e-2))
    tlosses = []
    for i in range(steps):
        x, y = data[i % 3]
        topt.zero_grad()
        tloss = torch.nn.functional.cross_entropy(tmodel(torch.from_numpy(x)), torch.from_numpy(y.astype(np.int64)))
        tloss.backward()
        topt.step()
        tlosses.append(tloss.item())
    np.testing.assert_allclose(awaited, tlosses, rtol=1e-4, atol=1e-5)
    for a, tp in zip(got, tmodel.parameters()):  # opt.tensors() starts with the parameters, in order
        np.testing.assert_allclose(a, tp.detach().numpy(), rtol=1e-4, atol=1e-5)
