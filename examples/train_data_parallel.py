"""Train the MLP of examples/train_mlp.py data-parallel over two devices: a replica of the model on each, each
device half of every batch, the gradients all-reduced; each step (both devices' forward, backward, the all-reduces
and both updates) is ONE plan, an `azyx.jit` function replayed from its second call.

    python examples/train_data_parallel.py [devices]   # e.g. cuda:0,cuda:1 (default: c:0,c:1)
"""

import asyncio
import sys
import time

from train_mlp import blobs  # (beside this script: the synthetic task)

import azyx
from azyx import DataParallel, Tensor, nn, optim


class MLP(nn.Module):
    def __init__(self, sizes: list[int], device: str) -> None:
        self.layers = [nn.Linear(a, b, device=device) for a, b in zip(sizes, sizes[1:])]

    def forward(self, x: Tensor) -> Tensor:
        for layer in self.layers[:-1]:
            x = layer(x).relu()
        return self.layers[-1](x)


async def main() -> None:
    azyx.configure({"c": {"devices": 2}})
    devices = sys.argv[1].split(",") if len(sys.argv) > 1 else ["c:0", "c:1"]
    azyx.manual_seed(0)
    classes, dim, batch = 5, 20, 64
    x_all, y_all = blobs(5120, classes, dim, seed=1)
    x_train, y_train, x_test, y_test = x_all[:4096], y_all[:4096], x_all[4096:], y_all[4096:]
    dp = DataParallel(lambda d: MLP([dim, 128, 64, classes], d), devices)
    opts = [optim.Adam(m.parameters(), lr=3e-3) for m in dp.replicas]
    batches = [(Tensor(x_train[i : i + batch]).shard(devices, 0), Tensor(y_train[i : i + batch]).shard(devices, 0))
               for i in range(0, len(x_train), batch)]

    @azyx.jit
    def train_step(x: azyx.ShardedTensor, y: azyx.ShardedTensor) -> Tensor:
        loss, grads = dp.gradients(lambda m, xi, yi: nn.cross_entropy(m(xi), yi), x, y)
        for opt, g in zip(opts, grads):
            opt.step(g)  # the same summed gradients on every replica: they stay equal
        return loss

    steps, t0 = 0, time.perf_counter()
    for epoch in range(5):
        for x, y in batches:
            loss = await train_step(x, y)
            steps += 1
        pred = await dp.replicas[-1](Tensor(x_test, device=devices[-1])).argmax(axis=-1).numpy()
        rate = steps / (time.perf_counter() - t0)
        print(f"epoch {epoch}: loss {await loss.item():.4f}, test accuracy {(pred == y_test).mean():.3f} (on "
              f"{devices[-1]}), {rate:.0f} steps/s, {train_step.replays} replays")


if __name__ == "__main__":
    asyncio.run(main())
