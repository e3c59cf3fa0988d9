"""azyx quickstart: build a graph synchronously, realize it asynchronously, keep the event loop free."""

import asyncio
import time

import numpy as np

import azyx
from azyx import Tensor


async def heartbeat(stop: asyncio.Event, ticks: list[float]) -> None:
    while not stop.is_set():
        ticks.append(time.perf_counter())
        await asyncio.sleep(0.001)


async def main() -> None:
    await azyx.start()  # probe the backends (drivers, device contexts) on a worker thread: the loop stays free
    print("devices:", azyx.devices())
    rng = np.random.default_rng(0)
    a_np, b_np = rng.standard_normal((512, 256), np.float32), rng.standard_normal((256, 128), np.float32)
    a, b = Tensor(a_np), Tensor(b_np)

    # building is synchronous and lazy: nothing runs yet
    t0 = time.perf_counter()
    logits = (a @ b).relu() * 0.5 + 1
    probs = logits.softmax(axis=-1)
    stats = probs.max(axis=-1).mean()
    print(f"built the graph in {(time.perf_counter() - t0) * 1e6:.0f} us; device {probs.device}")

    # realizing is awaitable: a heartbeat keeps ticking meanwhile
    stop, ticks = asyncio.Event(), []
    hb = asyncio.create_task(heartbeat(stop, ticks))
    t0 = time.perf_counter()
    await azyx.realize(probs, stats)
    first = time.perf_counter() - t0
    stop.set()
    await hb
    print(f"first realize (schedule + compile + run): {first * 1e3:.1f} ms, heartbeat ticked {len(ticks)} times")

    ref = np.maximum(a_np @ b_np, 0) * 0.5 + 1
    ref = np.exp(ref - ref.max(-1, keepdims=True))
    ref /= ref.sum(-1, keepdims=True)
    out = await probs.numpy()
    print("max |azyx - numpy| =", float(np.abs(out - ref).max()), " mean max prob =", round(await stats.item(), 6))

    # the same structure again (new data): the cached plan skips scheduling and compilation
    t0 = time.perf_counter()
    for _ in range(20):
        a = Tensor(rng.standard_normal((512, 256), np.float32))
        await ((a @ b).relu() * 0.5 + 1).softmax(axis=-1).realize()
    print(f"steady state: {(time.perf_counter() - t0) / 20 * 1e3:.2f} ms per build + realize")

    # many concurrent tasks share the runtime; each awaits its own result
    xs = [Tensor(np.full(1000, i, np.float32)) for i in range(50)]
    sums = await asyncio.gather(*[(x * 2).sum().item() for x in xs])
    assert sums == [2000.0 * i for i in range(50)]
    print("50 concurrent realizes: ok")


if __name__ == "__main__":
    asyncio.run(main())
