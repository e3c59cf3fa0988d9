"""Scale-out: sharded tensors over a pair of devices of one host (azyx.shard), and hosts of a Ray cluster.

    python bench/scale.py [--quick] [--devices c:0,c:1] [--out bench/RESULTS.md]

Rows: an all-reduce of a float32 tensor over the pair (each device's partial values, the sum on both) beside the
executor's copy of the same bytes from one device to the other (the ceiling the all-reduce is judged by: target >=
0.7x), as the default two-device swap and as rings in 4 chunks (pipelined); a data-parallel training step of
bench/train.py's MLP (784-256-10, Adam, the same global batch) on both devices beside the same step on the first
alone (target on two GPUs: >= 1.6x steps/s); where Ray is installed, the same step data-parallel over two hosts of a
local Ray cluster (azyx.distributed: a head and two worker nodes on this machine) beside one host, and the overhead
per step of going through Ray (one host via Ray beside the same step in this process). The pair defaults to
cuda:0,cuda:1 where both exist, else c:0,c:1 (two logical C devices share the machine's cores). Writes between
`<!-- bench:scale:start -->` and `<!-- bench:scale:end -->`; never asserts.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))
from common import machine_line, write_section  # noqa: E402  (beside this script)

import azyx  # noqa: E402
from azyx import DataParallel, GradientTape, ShardedTensor, Tensor, nn, optim  # noqa: E402

START, END = "<!-- bench:scale:start -->", "<!-- bench:scale:end -->"
SIZES, BATCH = (784, 256, 10), 512


class MLP(nn.Module):
    def __init__(self, device: str) -> None:
        self.l1 = nn.Linear(SIZES[0], SIZES[1], device=device)
        self.l2 = nn.Linear(SIZES[1], SIZES[2], device=device)

    def forward(self, x: Tensor) -> Tensor:
        return self.l2(self.l1(x).relu())


async def timed(fn: Callable[[], Awaitable[Any]], repeats: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        await fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        await fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


async def all_reduce_row(devs: list[str], mib: int, reps: int, chunks: int | None = None) -> list[str]:
    n = mib << 18  # float32 elements
    rng = np.random.default_rng(0)
    parts = [Tensor(rng.standard_normal(n, dtype=np.float32), device=d) for d in devs]
    await azyx.realize(*parts)
    partial = ShardedTensor(parts, None)
    t_reduce = await timed(lambda: partial._all_reduce("sum", chunks).realize(), reps)
    t_copy = await timed(lambda: parts[0].to(devs[1]).realize(), reps)
    got = await partial.all_reduce("sum").shards[1].numpy()
    want = sum([await p.numpy() for p in parts])
    assert np.allclose(got, want, rtol=1e-5, atol=1e-5), "WRONG RESULT: all-reduce"
    nbytes = 4 * n
    ratio = t_copy / t_reduce
    how = "" if chunks is None else f", ring in {chunks} chunks"
    return [f"all-reduce {mib} MiB f32{how}", f"{nbytes / t_reduce / 1e9:.2f} GB/s", f"copy {devs[0]} -> {devs[1]}: "
            f"{nbytes / t_copy / 1e9:.2f} GB/s", f"{ratio:.2f}x", "met" if ratio >= 0.7 else "not met"]


async def data_parallel_row(devs: list[str], steps: int, reps: int) -> list[str]:
    rng = np.random.default_rng(1)
    x = rng.standard_normal((BATCH, SIZES[0]), dtype=np.float32)
    y = rng.integers(0, SIZES[-1], BATCH).astype(np.int32)

    def loss_fn(m: MLP, xi: Tensor, yi: Tensor) -> Tensor:
        return nn.cross_entropy(m(xi), yi)

    azyx.manual_seed(0)
    one = MLP(devs[0])
    opt = optim.Adam(one.parameters(), lr=1e-3)
    x1, y1 = Tensor(x, device=devs[0]), Tensor(y, device=devs[0])

    async def single() -> None:
        for _ in range(steps):
            with GradientTape() as tape:
                loss = loss_fn(one, x1, y1)
            opt.step(tape.gradient(loss, one.parameters()))
            await azyx.realize(loss, *opt.tensors())

    azyx.manual_seed(0)
    dp = DataParallel(MLP, devs)
    opts = [optim.Adam(m.parameters(), lr=1e-3) for m in dp.replicas]
    xs, ys = Tensor(x).shard(devs, 0), Tensor(y).shard(devs, 0)
    await azyx.realize(*xs.shards, *ys.shards)

    async def parallel() -> None:
        for _ in range(steps):
            loss, grads = dp.gradients(loss_fn, xs, ys)
            for o, g in zip(opts, grads):
                o.step(g)
            await azyx.realize(loss, *(t for o in opts for t in o.tensors()))

    t1 = await timed(single, reps) / steps
    tn = await timed(parallel, reps) / steps
    speedup = t1 / tn
    target = "met" if speedup >= 1.6 else "not met"
    return [f"data-parallel MLP step, batch {BATCH}", f"{1 / tn:.1f} steps/s on {len(devs)}",
            f"{1 / t1:.1f} steps/s on {devs[0]}", f"{speedup:.2f}x", target + (" (GPU target)" if
                                                                              devs[0].startswith("c:") else "")]


class Trainer:
    """What a Ray host keeps: the MLP and its Adam (`tensors()`: realized with each program that uses it)."""

    def __init__(self) -> None:
        azyx.manual_seed(0)
        self.model = MLP("c:0")
        self.opt = optim.Adam(self.model.parameters(), lr=1e-3)

    def tensors(self) -> list[Tensor]:
        return self.opt.tensors()


def local_grads(tr: Trainer, x: Tensor, y: Tensor, share: float) -> tuple[Tensor, ...]:
    with GradientTape() as tape:
        loss = nn.cross_entropy(tr.model(x), y) * share
    return (loss, *tape.gradient(loss, tr.model.parameters()))


def apply(tr: Trainer, *grads: Tensor) -> Tensor:
    tr.opt.step(list(grads))
    return tr.model.parameters()[0]


async def ray_rows(steps: int, reps: int) -> list[list[str]]:
    try:
        import ray
        from ray.cluster_utils import Cluster as RayCluster
    except ImportError:
        return []
    from azyx.distributed import Cluster, all_reduce, realize, scatter

    local = RayCluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False,
                                                            "object_store_memory": 100 << 20})
    for _ in range(2):
        local.add_node(num_cpus=1, object_store_memory=100 << 20)
    ray.init(address=local.address, log_to_driver=False)
    rng = np.random.default_rng(2)
    x = rng.standard_normal((BATCH, SIZES[0]), dtype=np.float32)
    y = rng.integers(0, SIZES[-1], BATCH).astype(np.int32)
    n_params = 4
    try:
        cluster = await Cluster.start(hosts=2)

        async def timed_on(hosts: list[Any]) -> float:
            trainers = [await h.create(Trainer) for h in hosts]
            xs, ys = await scatter(hosts, x), await scatter(hosts, y)

            async def run() -> None:
                for _ in range(steps):
                    outs = [h.call(local_grads, tr, xi, yi, xi.shape[0] / BATCH, outputs=n_params + 1)
                            for h, tr, xi, yi in zip(hosts, trainers, xs, ys)]
                    summed = [all_reduce([o[j] for o in outs]) for j in range(1, n_params + 1)]
                    await realize(*(h.call(apply, tr, *(g[i] for g in summed))
                                    for i, (h, tr) in enumerate(zip(hosts, trainers))))

            return await timed(run, reps) / steps

        t1, t2 = await timed_on(cluster.hosts[:1]), await timed_on(cluster.hosts)
        cluster.shutdown()
    finally:
        ray.shutdown()
        local.shutdown()
    tr = Trainer()
    xl, yl = Tensor(x), Tensor(y)

    async def in_process() -> None:
        for _ in range(steps):
            grads = local_grads(tr, xl, yl, 1.0)
            apply(tr, *grads[1:])
            await azyx.realize(grads[0], *tr.tensors())

    t0 = await timed(in_process, reps) / steps
    return [[f"data-parallel MLP step over a local Ray cluster, batch {BATCH}", f"{1 / t2:.1f} steps/s on 2 hosts",
             f"{1 / t1:.1f} steps/s on 1 host", f"{t1 / t2:.2f}x", "correct (tests/test_distributed.py)"],
            ["a step through Ray on 1 host beside the same step in this process",
             f"{t1 * 1e3:.1f} ms ({(t1 - t0) * 1e3:.1f} ms overhead)", f"{t0 * 1e3:.1f} ms", f"{t0 / t1:.2f}x",
             "stated"]]


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--devices", default="")
    ap.add_argument("--out", default=str(REPO / "bench" / "RESULTS.md"))
    args = ap.parse_args()
    azyx.configure({"c": {"devices": 2}})
    have = azyx.devices()
    devs = args.devices.split(",") if args.devices else (
        ["cuda:0", "cuda:1"] if "cuda:1" in have else ["c:0", "c:1"])
    mib, steps, reps = (16, 3, 2) if args.quick else (256 if devs[0].startswith("cuda") else 64, 20, 5)
    rows = [await all_reduce_row(devs, mib, reps), await all_reduce_row(devs, mib, reps, 4),
            await data_parallel_row(devs, steps, reps),
            *await ray_rows(3 if args.quick else 10, reps)]
    text = "\n".join([
        START, "", f"## Scale-out on one host: {' + '.join(devs)} ({'quick' if args.quick else 'full'} run, "
        f"{time.strftime('%Y-%m-%d')})", "", machine_line(), "",
        "| workload | azyx | peer in the same run | ratio | target |", "|---|---|---|---|---|",
        *("| " + " | ".join(r) + " |" for r in rows), "", END, ""])
    print(text)
    write_section(Path(args.out), START, END, text)


if __name__ == "__main__":
    asyncio.run(main())
