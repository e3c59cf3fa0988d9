"""Long runs stay flat (issue 13): a training loop with a learning rate that changes every step, awaited, pipelined
(several steps in flight, as a service keeps them) and under azyx.jit, keeps what `azyx.stats()` reports flat once
warmed up: live graph nodes, cached plans, jit traces, compiled kernels, every device's pool bytes and the process's
RSS. It also trains: its first steps match PyTorch's (same init, data and schedule) and its loss falls.
bench/longrun.py runs the same loop for 10,000 steps per mode."""

from __future__ import annotations

import asyncio
import gc
import os
import weakref
from typing import Any

import numpy as np
import pytest

import azyx
from azyx import GradientTape, Tensor, nn, optim
from azyx.allocator import bucket
from azyx.runtime import RT

try:
    import torch
except ImportError:
    torch = None  # type: ignore[assignment]

SIZES, BATCH, N_BATCHES = (16, 32, 4), 16, 8
WARM_UP, STEPS, CHECKED = 200, 700, 5  # stats after WARM_UP steps and after STEPS; parameters after CHECKED steps
IN_FLIGHT = 4  # pipelined: steps submitted before the oldest is awaited
RSS_SLACK = 16 << 20  # interpreter and allocator noise (measured: well under 1 MiB); a leak of 1 KiB a step is 0.5 MiB


def rate(epoch: int) -> float:
    """A new rate every step, alternating (so a rate that is not bound anew shows in the first steps), decaying."""
    return (0.5 if epoch % 2 else 1.0) / (1 + epoch / 100)


def batches() -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(13)
    return [(rng.standard_normal((BATCH, SIZES[0])).astype(np.float32),
             rng.integers(0, SIZES[-1], BATCH).astype(np.int32)) for _ in range(N_BATCHES)]


class MLP(nn.Module):
    def __init__(self, device: str) -> None:
        self.l1 = nn.Linear(SIZES[0], SIZES[1], device=device)
        self.l2 = nn.Linear(SIZES[1], SIZES[2], device=device)

    def forward(self, x: Tensor) -> Tensor:
        return self.l2(self.l1(x).relu())


async def settled() -> azyx.Stats:
    await azyx.synchronize()  # queued work holds its buffers
    gc.collect()
    return azyx.stats()


async def train(device: str, mode: str) -> dict[str, Any]:
    """STEPS steps of Adam under a LambdaLR, a fresh batch uploaded each step; stats after WARM_UP and at the end."""
    data = batches()
    azyx.manual_seed(3)
    model = MLP(device)
    init = [await p.numpy() for p in model.parameters()]
    opt = optim.Adam(model.parameters(), lr=0.02)
    sched = optim.LambdaLR(opt, rate)

    def build(x: Tensor, y: Tensor) -> Tensor:
        with GradientTape() as tape:
            loss = nn.cross_entropy(model(x), y)
        opt.step(tape.gradient(loss, opt.params))
        return loss

    jitted = azyx.jit(build)
    running: list[asyncio.Future[Any]] = []
    out: dict[str, Any] = {"init": init, "losses": [], "stats": []}
    for i in range(STEPS):
        xn, yn = data[i % N_BATCHES]
        x, y = Tensor(xn, device=device), Tensor(yn, device=device)
        if mode == "jit":
            loss = await jitted(x, y)
        elif mode == "pipelined":
            loss = build(x, y)
            running.append(asyncio.ensure_future(azyx.realize(loss, *opt.tensors())))
            await asyncio.sleep(0)  # the task submits the step's plan; the next step is built while it runs
            if len(running) >= IN_FLIGHT:
                await running.pop(0)
        else:
            loss = build(x, y)
            await azyx.realize(loss, *opt.tensors())
        sched.step()
        if i < N_BATCHES or i >= STEPS - N_BATCHES:
            out["losses"].append(await loss.item())
        if i + 1 == CHECKED:
            out["checked"] = [await p.numpy() for p in model.parameters()]
        del loss, x, y
        if i + 1 in (WARM_UP, STEPS):
            for task in running:
                await task
            running.clear()
            out["stats"].append(await settled())
    out["replays"] = jitted.replays
    out["step_bytes"] = step_bytes(azyx.schedule(build(*(Tensor(a, device=device) for a in data[0])),
                                                 *opt.tensors()), device)  # (one more step, planned, not run)
    return out


def step_bytes(plan: azyx.ExecutionPlan, device: str) -> int:
    """What one run of `plan` takes from `device`'s pool: its slots past the inputs, rounded as the pool rounds."""
    return sum(bucket(max(s.nbytes, 1)) for s in plan.slots[plan.n_inputs:] if s.device == device)


def torch_reference(init: list[np.ndarray]) -> list[np.ndarray]:
    """The parameters after CHECKED steps of the same loop in PyTorch."""
    model = torch.nn.Sequential(torch.nn.Linear(SIZES[0], SIZES[1]), torch.nn.ReLU(), torch.nn.Linear(SIZES[1],
                                                                                                    SIZES[2]))
    with torch.no_grad():
        for tp, p in zip(model.parameters(), init):
            tp.copy_(torch.from_numpy(p))
    opt = torch.optim.Adam(model.parameters(), lr=0.02)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, rate)
    data = batches()
    for i in range(CHECKED):
        x, y = data[i % N_BATCHES]
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(torch.from_numpy(x)), torch.from_numpy(y.astype(np.int64))).backward()
        opt.step()
        sched.step()
    return [p.detach().numpy() for p in model.parameters()]


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="RSS from /proc/self/statm (Linux)")
@pytest.mark.parametrize("mode", ["awaited", "pipelined", "jit"])
async def test_a_long_training_loop_stays_flat(device: str, mode: str) -> None:
    r = await train(device, mode)
    a, b = r["stats"]
    assert abs(b.nodes - a.nodes) <= 2, f"live graph nodes {a.nodes} -> {b.nodes}"
    assert (b.plans, b.traces, b.kernels) == (a.plans, a.traces, a.kernels), f"{a}\n{b}"
    # the pool may make new blocks only where steps overlap: how many in-flight steps' buffers are live at once (the
    # pool's high-water mark) follows the devices' timing; the warm-up saw at least one step's, and no more than
    # IN_FLIGHT + 1 fit. On a device with a queue an awaited step may also see its work done (a poll) before the waiter
    # thread gave its buffers back: the next step's may then be one step's more, once
    overlap = IN_FLIGHT if mode == "pipelined" else 0 if RT.device(device).host_memory else 1
    for d in b.memory:  # every buffer held at the end was held after the warm-up; the pool made no new blocks ...
        assert b.memory[d].in_use <= a.memory[d].in_use, f"{d}: pool {a.memory[d]} -> {b.memory[d]}"
        slack = overlap * r["step_bytes"] if d == device else 0  # (... but for the overlap above)
        assert b.pool_bytes(d) <= a.pool_bytes(d) + slack, f"{d}: pool {a.memory[d]} -> {b.memory[d]}"
    assert b.rss - a.rss < RSS_SLACK, f"RSS grew {(b.rss - a.rss) / 2**20:.1f} MiB over {STEPS - WARM_UP} steps"
    if mode == "jit":
        assert r["replays"] >= STEPS - 2  # the first call traces (and the second, where host data was uploaded)
    first, last = r["losses"][:N_BATCHES], r["losses"][N_BATCHES:]
    assert np.mean(last) < 0.5 * np.mean(first), (first, last)
    if torch is not None:
        for got, want in zip(r["checked"], torch_reference(r["init"])):
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


async def test_a_plan_reuses_the_buffers_of_its_finished_run(device: str) -> None:
    # a device whose queue returns buffers when their commands complete (OpenCL) took them back only at its next
    # enqueue, after a plan's first allocations: every awaited run of a plan made a second set of blocks
    a = await Tensor(np.ones((128, 128), np.float32), device=device).realize()
    await ((a * 0.5 + 1).relu() @ a).sum().realize()
    first = azyx.stats().memory[device]  # (without synchronize: what the run itself left)
    for i in range(10):
        await ((a * float(i) + 1).relu() @ a).sum().realize()
    after = (await settled()).memory[device]
    assert after.in_use + after.cached <= first.in_use + first.cached, (first, after)


async def test_stats_report_the_runtime() -> None:
    s = await settled()
    assert s.rss > 0 and set(azyx.devices()) <= set(s.memory)
    t = Tensor(np.ones(1000, np.float32), device="c:0") * 2
    assert azyx.stats().nodes > s.nodes + 1  # the data's leaf and the product (and its scalar)
    await t.realize()
    after = await settled()
    assert after.memory["c:0"].in_use >= s.memory["c:0"].in_use + 4000 and after.nodes == s.nodes + 1  # a leaf now
    assert "nodes" in str(after)


def test_loops_run_one_after_another_are_not_kept() -> None:
    # a crowd of realizes (a gather) paces itself per loop; that bookkeeping once kept every loop it had seen

    loops: list[weakref.ref[asyncio.AbstractEventLoop]] = []

    async def crowd() -> None:
        loops.append(weakref.ref(asyncio.get_running_loop()))
        xs = [Tensor(np.full(8, i, np.float32), device="c:0") for i in range(20)]
        await asyncio.gather(*[(x * 2).sum().realize() for x in xs])

    for _ in range(3):
        asyncio.run(crowd())  # (a sync test: no loop of pytest's runs here)
    gc.collect()
    assert all(r() is None for r in loops), "a closed loop is kept alive"
