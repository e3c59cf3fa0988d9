"""Train a small MLP classifier with azyx: GradientTape for gradients, azyx.nn for layers and the loss, azyx.optim
for a lazy Adam step; each iteration's forward, backward and update run as ONE plan. The step is an `azyx.jit`
function: its graph is built and planned on the first call, and later calls replay that plan with the new batch
(fresh dropout masks included) without building anything."""

import asyncio
import time

import numpy as np

import azyx
from azyx import GradientTape, Tensor, nn, optim


def blobs(n: int, classes: int, dim: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Gaussian clusters around random centres: a synthetic classification task."""
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((classes, dim)) * 0.6
    y = rng.integers(0, classes, n)
    x = centres[y] + rng.standard_normal((n, dim))
    return x.astype(np.float32), y.astype(np.int32)


class MLP(nn.Module):
    def __init__(self, sizes: list[int]) -> None:
        self.layers = [nn.Linear(a, b) for a, b in zip(sizes, sizes[1:])]
        self.drop = nn.Dropout(0.1)

    def forward(self, x: Tensor) -> Tensor:
        for layer in self.layers[:-1]:
            x = self.drop(layer(x).relu())
        return self.layers[-1](x)


async def main() -> None:
    azyx.manual_seed(0)
    classes, dim, batch = 5, 20, 64
    x_all, y_all = blobs(5120, classes, dim, seed=1)
    x_train, y_train, x_test, y_test = x_all[:4096], y_all[:4096], x_all[4096:], y_all[4096:]
    model = MLP([dim, 128, 64, classes])
    opt = optim.Adam(model.parameters(), lr=3e-3)
    print(f"device {azyx.devices()[0]}; parameters: {sum(p.numel() for p in model.parameters())}")

    batches = [(Tensor(x_train[i : i + batch]), Tensor(y_train[i : i + batch]))
               for i in range(0, len(x_train), batch)]
    @azyx.jit
    def train_step(x: Tensor, y: Tensor) -> Tensor:
        with GradientTape() as tape:
            loss = nn.cross_entropy(model(x), y)
        opt.step(tape.gradient(loss, opt.params))  # rebinds the parameters and the optimiser state (lazily)
        return loss

    model.train()
    steps, t0 = 0, time.perf_counter()
    for epoch in range(5):
        for x, y in batches:
            loss = await train_step(x, y)  # forward + backward + update: one plan, replayed from the second call
            steps += 1
        model.eval()
        pred = await model(Tensor(x_test)).argmax(axis=-1).numpy()
        model.train()
        rate = steps / (time.perf_counter() - t0)
        print(f"epoch {epoch}: loss {await loss.item():.4f}, test accuracy {(pred == y_test).mean():.3f}, "
              f"{rate:.0f} steps/s, {len(azyx.runtime.RT.plan_cache)} cached plans, {train_step.replays} replays")


if __name__ == "__main__":
    asyncio.run(main())
