"""Scale-out: sharded tensors over a pair of devices of one host (azyx.shard), and hosts of a Ray cluster.

    python bench/scale.py [--quick] [--devices c:0,c:1] [--no-ray | --ray] [--collectives] [--out bench/RESULTS.md]

Rows: an all-reduce of a float32 tensor over the pair (each device's partial values, the sum on both) beside the
executor's copy of the same bytes from one device to the other (the ceiling the all-reduce is judged by: target >=
0.7x), as the default (C devices: one kernel reading both pieces in place, whose buffer the second device's piece holds;
elsewhere a swap of copies) and as rings in 4 chunks (pipelined); all-gather, reduce-scatter and broadcast of the same
bytes beside the same copy; on C devices the all-reduce over four (c:0..c:3); where both are CUDA devices, the
all-reduce of 1 GiB beside torch.distributed's NCCL all-reduce of the same bytes over the same two GPUs (two processes,
same run); tensor-parallel GPT-2 decode (azyx.models.gpt2_parallel through an Engine, 4 sequences, greedy) over the pair
beside the same model on the first device (the tokens checked equal); a data-parallel training step of bench/train.py's
MLP (784-256-10, Adam, the same global batch) on both devices beside the same step on the first alone (target on two
GPUs: >= 1.6x steps/s); where Ray is installed, the same step data-parallel over two hosts of a local Ray cluster
(azyx.distributed: a head and two worker nodes on this machine) beside one host, and the overhead per step of going
through Ray (one host via Ray beside the same step in this process: the plan as a compiled Ray graph, and as actor
calls, azyx.distributed.COMPILE off); a tiny plan through Ray beside in this process, and Ray's own compiled graph
through an actor on the host's node that returns its input (the round trip every step pays on this machine), and
one of the data-parallel step's shape over both hosts' nodes whose actors only send each other the gradients'
bytes (the floor of the two-host step); each pair timed in turns, the fastest of each kept (`ray_rows`). The pair
defaults to cuda:0,cuda:1 where both exist, else c:0,c:1 (two logical C devices share the machine's cores).
Writes between `<!-- bench:scale:start -->` and `<!-- bench:scale:end -->`; never asserts.
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


async def fastest_in_turns(a: Callable[[], Awaitable[Any]], b: Callable[[], Awaitable[Any]], reps: int
                           ) -> tuple[float, float]:
    """The fastest of `reps` runs of `a` and of `b`, run in turns (a, b, a, b, ...): on a shared machine a burst of
    other load falls on both alike, and the fastest run of each is the one it disturbed least."""
    await a()
    await b()
    ta, tb = [], []
    for _ in range(reps):
        for fn, times in ((a, ta), (b, tb)):
            t0 = time.perf_counter()
            await fn()
            times.append(time.perf_counter() - t0)
    return min(ta), min(tb)


async def collective_rows(devs: list[str], mib: int, reps: int) -> list[list[str]]:
    """all-reduce (default, and rings in 4 chunks), all-gather, reduce-scatter and broadcast of `mib` MiB of float32
    over `devs`, each beside a copy of the same bytes from the first device to the second (`fastest_in_turns`);
    results checked against numpy."""
    n = mib << 18  # float32 elements
    rng = np.random.default_rng(0)
    parts = [Tensor(rng.standard_normal(n, dtype=np.float32), device=d) for d in devs]
    await azyx.realize(*parts)
    partial = ShardedTensor(parts, None)
    split = Tensor(rng.standard_normal(n, dtype=np.float32)).shard(devs, 0)
    await split.realize()
    ops: dict[str, Callable[[], Any]] = {
        "all-reduce": lambda: partial._all_reduce("sum"), "all-reduce, ring in 4 chunks":
        lambda: partial._all_reduce("sum", 4), "all-gather": split.all_gather,
        "reduce-scatter": lambda: partial.reduce_scatter(0), "broadcast": lambda: partial.broadcast(0)}
    want = sum([await p.numpy() for p in parts])
    for name in ("all-reduce", "all-reduce, ring in 4 chunks"):
        assert np.allclose(await ops[name]().shards[-1].numpy(), want, rtol=1e-5, atol=1e-5), f"WRONG RESULT: {name}"
    assert np.allclose(await ops["reduce-scatter"]().numpy(), want, rtol=1e-5, atol=1e-5), "WRONG: reduce-scatter"
    assert np.array_equal(await ops["all-gather"]().shards[-1].numpy(), await split.numpy()), "WRONG: all-gather"
    nbytes = 4 * n
    rows = []
    for name, op in ops.items():
        t_op, t_copy = await fastest_in_turns(lambda: op().realize(), lambda: parts[0].to(devs[1]).realize(),  # noqa: B023
                                              3 * reps)
        ratio = t_copy / t_op
        target = ("met" if ratio >= 0.7 else "not met") if name == "all-reduce" and len(devs) == 2 else \
            "stated (C devices: one buffer, nothing moves)" if name == "broadcast" and devs[0].startswith("c:") else \
            "stated"
        rows.append([f"{name} {mib} MiB f32 over {len(devs)}", f"{nbytes / t_op / 1e9:.2f} GB/s",
                     f"copy {devs[0]} -> {devs[1]}: {nbytes / t_copy / 1e9:.2f} GB/s", f"{ratio:.2f}x", target])
    return rows


def _nccl_worker(rank: int, nbytes: int, reps: int, port: int, out: Any) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    torch.cuda.set_device(rank)
    x = torch.ones(nbytes // 4, device=f"cuda:{rank}")
    for _ in range(3):
        dist.all_reduce(x)
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(x)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    if rank == 0:
        out.put(statistics.median(times))
    dist.destroy_process_group()


async def nccl_row(devs: list[str], mib: int, reps: int) -> list[str]:
    """azyx's all-reduce of `mib` MiB over two CUDA devices beside torch.distributed's NCCL all-reduce of the same
    bytes over GPUs 0 and 1 (two processes; target >= 0.9x of NCCL's bandwidth)."""
    import socket

    import torch.multiprocessing as mp

    n = mib << 18
    parts = [Tensor(np.ones(n, np.float32), device=d) for d in devs]
    await azyx.realize(*parts)
    partial = ShardedTensor(parts, None)
    t_azyx = await timed(lambda: partial.all_reduce("sum").realize(), reps)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.SimpleQueue()
    procs = [ctx.Process(target=_nccl_worker, args=(r, 4 * n, reps, port, q)) for r in range(2)]
    for p in procs:
        p.start()
    t_nccl = await asyncio.to_thread(q.get)
    for p in procs:
        p.join()
    ratio = t_nccl / t_azyx
    return [f"all-reduce {mib} MiB f32 over {' + '.join(devs)}", f"{4 * n / t_azyx / 1e9:.2f} GB/s",
            f"torch.distributed NCCL: {4 * n / t_nccl / 1e9:.2f} GB/s", f"{ratio:.2f}x",
            "met" if ratio >= 0.9 else "not met"]


async def tensor_parallel_row(devs: list[str], steps: int, reps: int) -> list[str]:
    """Decode steps of 4 greedy sequences through an Engine: GPT-2 split over `devs` beside the same model on the
    first device (random weights; GPT-2 small's shape on CUDA, a narrower one on C devices)."""
    from azyx.models import GPT2, Engine, GPT2Config
    from azyx.models.gpt2_parallel import TensorParallelGPT2

    cuda = devs[0].startswith("cuda")
    cfg = GPT2Config(vocab_size=50257 if cuda else 4096, n_positions=256, n_embd=768 if cuda else 256,
                     n_layer=12 if cuda else 4, n_head=12 if cuda else 8)
    one = GPT2(cfg, device=devs[0])
    rng = np.random.default_rng(3)
    for name, p in one.named_parameters():
        w = rng.standard_normal(p.shape) * 0.05 + name.endswith(("ln_1.weight", "ln_2.weight", "ln_f.weight"))
        p.assign(Tensor(w.astype(np.float32), device=devs[0]))
    await azyx.realize(*one.parameters())
    tp = TensorParallelGPT2.from_model(one, devs)
    await azyx.realize(*tp.parameters())
    prompts = [[int(t) for t in rng.integers(0, cfg.vocab_size, 8 + 3 * i)] for i in range(4)]

    async def decode(model: GPT2) -> tuple[float, list[list[int]]]:
        engine = Engine(model, slots=4)
        seqs = [await engine.add(p, engine.params(max_new_tokens=10_000, ignore_eos=True)) for p in prompts]
        await engine.step()  # (its plan made and compiled)

        async def run() -> None:
            for _ in range(steps):
                await engine.step()

        t = await timed(run, reps, warmup=0) / steps
        return t, [s.tokens[:8] for s in seqs]

    t1, tokens1 = await decode(one)
    tn, tokens_n = await decode(tp)
    assert tokens1 == tokens_n, "WRONG RESULT: tensor-parallel tokens differ from one device's"
    return [f"tensor-parallel GPT-2 decode ({cfg.n_layer} layers, {cfg.n_embd} wide), 4 sequences, greedy",
            f"{4 / tn:.0f} tokens/s on {len(devs)}", f"{4 / t1:.0f} tokens/s on {devs[0]}", f"{t1 / tn:.2f}x",
            "tokens equal" + ("" if cuda else " (speed: a GPU row)")]


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


class Echo:
    """A Ray actor that does nothing: compiled graphs through it time Ray's own overhead per execution. `sizes`: the
    float32 arrays it sends (`send`: a host's gradients, as a program exports them)."""

    def __init__(self, sizes: tuple[int, ...] = ()) -> None:
        self.arrays = {i: np.zeros(n, np.float32) for i, n in enumerate(sizes)}

    def echo(self, x: int) -> int:
        return x

    def send(self, x: int) -> dict[int, np.ndarray]:
        return self.arrays

    def take(self, x: int, *sent: dict[int, np.ndarray]) -> int:
        return x


def step_graph(nodes: list[str], sizes: tuple[int, ...]) -> tuple[Any, list[Any]]:
    """Ray's compiled graph of a step's shape over `nodes`, with nothing done: an actor on each node (`Echo`); on one,
    it returns its input (the round trip every step pays); on more, each sends its arrays and each takes its own and
    the others' (the exchange of a data-parallel step's gradients too)."""
    import ray
    from ray.dag import InputNode, MultiOutputNode
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    actors = [ray.remote(Echo).options(num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(
        n, soft=False)).remote(sizes) for n in nodes]
    with InputNode() as inp:
        if len(actors) == 1:
            graph = actors[0].echo.bind(inp)
        else:
            sent = [a.send.bind(inp) for a in actors]
            graph = MultiOutputNode([a.take.bind(inp, sent[i], *sent[:i], *sent[i + 1:])
                                     for i, a in enumerate(actors)])
    compiled = graph.experimental_compile()
    ray.get(compiled.execute(0), timeout=120)  # (the actors' processes start first: slow on a loaded machine)
    return compiled, actors


def executions(graph: Any, steps: int) -> Callable[[], Awaitable[None]]:
    """`steps` executions of a compiled graph, each awaited through a worker thread (as azyx.distributed's are)."""
    import ray

    async def run() -> None:
        for _ in range(steps):
            await asyncio.to_thread(lambda: ray.get(graph.execute(0)))

    return run


async def ray_rows(steps: int, reps: int) -> list[list[str]]:
    """azyx.distributed on a local Ray cluster (a head without CPUs, where this driver runs, and two worker nodes of
    one CPU each: every host is on a node other than the driver's, as on a real cluster). Each pair of rows is timed
    in turns, the fastest of each kept (`fastest_in_turns`): the data-parallel step over both hosts beside the same
    step on one of them (each host's C device on its node's one thread, so that two hosts do not ask four threads of
    this machine's two cores); the step through Ray on one host (a compiled graph; the host's runtime as this
    process's) beside the same step in this process, which is the overhead per step (target <= 0.2 ms); the same
    step by actor calls; a tiny plan; and Ray's own floor (`step_graph`): a compiled graph through an actor on a
    worker node that returns its input (a round trip between two nodes, which every step pays), and one of the
    data-parallel step's shape over both hosts' nodes, whose actors only send each other the gradients' bytes, beside
    the round trip (in turns: what the exchange itself costs Ray here)."""
    try:
        import ray
        from ray.cluster_utils import Cluster as RayCluster
    except ImportError:
        return []
    from azyx import distributed
    from azyx.distributed import Cluster, Host, all_reduce, realize, scatter

    local = RayCluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False,
                                                            "object_store_memory": 100 << 20})
    for _ in range(2):
        local.add_node(num_cpus=1, object_store_memory=100 << 20)
    ray.init(address=local.address, log_to_driver=False)
    rng = np.random.default_rng(2)
    x = rng.standard_normal((BATCH, SIZES[0]), dtype=np.float32)
    y = rng.integers(0, SIZES[-1], BATCH).astype(np.int32)
    n_params = 4
    turns = 4 * reps
    try:
        async def stepper(hosts: list[Host]) -> Callable[[], Awaitable[None]]:
            trainers = [await h.create(Trainer) for h in hosts]
            xs, ys = await scatter(hosts, x), await scatter(hosts, y)

            async def run() -> None:
                for _ in range(steps):
                    outs = [h.call(local_grads, tr, xi, yi, xi.shape[0] / BATCH, outputs=n_params + 1)
                            for h, tr, xi, yi in zip(hosts, trainers, xs, ys)]
                    summed = [all_reduce([o[j] for o in outs]) for j in range(1, n_params + 1)]
                    await realize(*(h.call(apply, tr, *(g[i] for g in summed))
                                    for i, (h, tr) in enumerate(zip(hosts, trainers))))

            return run

        pair = await Cluster.start(hosts=2, config={"c": {"threads": 1}})
        t1, t2 = await fastest_in_turns(await stepper(pair.hosts[:1]), await stepper(pair.hosts), turns)
        t1, t2 = t1 / steps, t2 / steps
        sizes = tuple(int(np.prod(p.shape)) for p in MLP("c:0").parameters())
        floors = [step_graph([h.node for h in hosts], sizes) for hosts in (pair.hosts[:1], pair.hosts)]
        f1, f2 = (t / steps for t in await fastest_in_turns(*(executions(g, steps) for g, _ in floors), turns))
        for g, actors in floors:
            g.teardown()
            for a in actors:
                ray.kill(a)
        pair.shutdown()

        cluster = await Cluster.start(hosts=1)
        one = cluster.hosts[0]
        via_ray = await stepper([one])
        tr = Trainer()
        xl, yl = Tensor(x), Tensor(y)

        async def in_process() -> None:
            for _ in range(steps):
                grads = local_grads(tr, xl, yl, 1.0)
                apply(tr, *grads[1:])
                await azyx.realize(grads[0], *tr.tensors())

        t_ray, t0 = (t / steps for t in await fastest_in_turns(via_ray, in_process, turns))

        async def by_calls() -> None:
            distributed.COMPILE = False
            try:
                await via_ray()
            finally:
                distributed.COMPILE = True

        t_calls, t0_calls = (t / steps for t in await fastest_in_turns(by_calls, in_process, turns))
        gaps = await heartbeat(via_ray, turns)
        idle = await heartbeat(lambda: asyncio.sleep(t_ray * steps), turns)  # (the same time, nothing to await)
        tiny = await one.tensor(np.ones(4, np.float32))
        tiny_local = await Tensor(np.ones(4, np.float32)).realize()
        t_tiny, t_tiny_local = await fastest_in_turns(lambda: realize(tiny + 1.0),
                                                      lambda: (tiny_local + 1.0).realize(), 20 * reps)
        cluster.shutdown()
        graph, _ = step_graph([one.node], ())
        t_ray_thread, t_ray_direct = await fastest_in_turns(
            lambda: asyncio.to_thread(lambda: ray.get(graph.execute(0))), _sync(lambda: ray.get(graph.execute(0))),
            20 * reps)
        graph.teardown()
    finally:
        distributed.COMPILE = True
        ray.shutdown()
        local.shutdown()
    overhead = t_ray - t0
    return [[f"data-parallel MLP step over a local Ray cluster, batch {BATCH}", f"{1 / t2:.1f} steps/s on 2 hosts",
             f"{1 / t1:.1f} steps/s on 1 host", f"{t1 / t2:.2f}x",
             ">= 0.9x: " + ("met" if t1 / t2 >= 0.9 else "not met")],
            [f"Ray's own compiled graph of that step's shape, nothing done (an actor on each host's node sending the "
             f"other the gradients, {4 * sum(sizes) / 1e6:.2f} MB): the floor of the 2-host step, beside the same "
             "graph on 1 host", f"{f2 * 1e3:.2f} ms on 2 hosts", f"{f1 * 1e3:.2f} ms on 1 host", "",
             f"2 hosts' exchange: {(f2 - f1) * 1e3:.2f} ms a step more"],
            ["a step through Ray on 1 host (a compiled graph) beside the same step in this process",
             f"{t_ray * 1e3:.2f} ms ({overhead * 1e3:.2f} ms overhead)", f"{t0 * 1e3:.2f} ms", f"{t0 / t_ray:.2f}x",
             "<= 0.2 ms: " + ("met" if overhead <= 2e-4 else "not met")],
            ["the same step through Ray by actor calls (no compiled graph)", f"{t_calls * 1e3:.2f} ms "
             f"({(t_calls - t0_calls) * 1e3:.2f} ms overhead)", f"{t0_calls * 1e3:.2f} ms",
             f"{t0_calls / t_calls:.2f}x", "before"],
            ["the driver's event loop while it awaits those steps (compiled): a heartbeat's gaps (2 ms sleeps), "
             "beside the same heartbeat while the loop awaits only a sleep as long",
             f"median {statistics.median(gaps) * 1e3:.2f} ms, longest {max(gaps) * 1e3:.1f} ms",
             f"median {statistics.median(idle) * 1e3:.2f} ms, longest {max(idle) * 1e3:.1f} ms", "",
             "free" if statistics.median(gaps) < 1.5 * statistics.median(idle) else "blocked"],
            ["a tiny plan (x + 1, 4 floats) through Ray on 1 host beside in this process",
             f"{t_tiny * 1e6:.0f} us", f"{t_tiny_local * 1e6:.0f} us", f"{(t_tiny - t_tiny_local) * 1e6:.0f} us more",
             "stated"],
            ["Ray's own compiled graph to the host's node and back (an actor that returns its input), from a worker "
             "thread / directly: the floor of every step", f"{t_ray_thread * 1e6:.0f} us / {t_ray_direct * 1e6:.0f} us",
             "", "", "Ray's < 50 us: " + ("met" if t_ray_direct < 50e-6 else "not met on this machine")]]


async def heartbeat(work: Callable[[], Awaitable[Any]], repeats: int) -> list[float]:
    """The gaps between a ticker's turns on this event loop (2 ms sleeps) while `work` runs `repeats` times."""
    gaps: list[float] = []
    done = False

    async def tick() -> None:
        last = time.perf_counter()
        while not done:
            await asyncio.sleep(0.002)
            gaps.append(time.perf_counter() - last)
            last = time.perf_counter()

    ticker = asyncio.ensure_future(tick())
    for _ in range(repeats):
        await work()
    done = True
    await ticker
    return gaps


def _sync(fn: Callable[[], Any]) -> Callable[[], Awaitable[Any]]:
    """`fn` as a coroutine function that calls it on the loop (a blocking call timed without a thread hop)."""
    async def call() -> Any:
        return fn()

    return call


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--devices", default="")
    ap.add_argument("--out", default=str(REPO / "bench" / "RESULTS.md"))
    ap.add_argument("--no-ray", action="store_true", help="leave out the Ray cluster's rows")
    ap.add_argument("--collectives", action="store_true", help="the collectives' rows alone")
    ap.add_argument("--ray", action="store_true", help="the Ray cluster's rows alone")
    args = ap.parse_args()
    azyx.configure({"c": {"devices": 4}})
    have = azyx.devices()
    devs = args.devices.split(",") if args.devices else (
        ["cuda:0", "cuda:1"] if "cuda:1" in have else ["c:0", "c:1"])
    cuda = all(d.startswith("cuda") for d in devs)
    mib, steps, reps = (4, 2, 1) if args.quick else (256 if cuda else 64, 20, 5)
    if args.ray:
        rows = await ray_rows(1 if args.quick else 10, reps)
        args.collectives = True
    else:
        rows = await collective_rows(devs, mib, reps)
    if devs[0].startswith("c:") and not args.ray:
        rows.append((await collective_rows([f"c:{i}" for i in range(4)], mib, reps))[0])
    if cuda and len(devs) == 2 and not args.ray:
        rows.append(await nccl_row(devs, 64 if args.quick else 1024, reps))
    if not args.collectives:
        rows += [await tensor_parallel_row(devs, 4 if args.quick else 16, reps),
                 await data_parallel_row(devs, steps, reps),
                 *([] if args.no_ray else await ray_rows(1 if args.quick else 10, reps))]
    text = "\n".join([
        START, "", f"## Scale-out on one host: {' + '.join(devs)} ({'quick' if args.quick else 'full'} run, "
        f"{time.strftime('%Y-%m-%d')})", "", machine_line(), "",
        "| workload | azyx | peer in the same run | ratio | target |", "|---|---|---|---|---|",
        *("| " + " | ".join(r) + " |" for r in rows), "", END, ""])
    print(text)
    write_section(Path(args.out), START, END, text)


if __name__ == "__main__":
    asyncio.run(main())
