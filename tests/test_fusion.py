"""Fusion into products (issue 38 item 1), on every device: a layernorm computed in the prologue of the matrix-vector
product after it (its statistics too), a bias, an activation and a residual add in its epilogue, by rules the
scheduler applies to any graph (azyx.schedule: KernelBuild.prologue / statistic), on devices that run a work item per
output point (GPUs; a host device keeps the layernorm apart: the cost rule). Fused products against numpy and against
the same graph computed unfused (the layernorm realized first) in float32, bfloat16 and float16; a GPT-2 layer's
decode step's kernels counted (one per linear layer) and decode logits against transformers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import azyx
from azyx import Tensor
from azyx.codegen.kernel import product_of
from azyx.ir import attention_of, toposort
from azyx.plan import ExecutionPlan, KernelStep
from azyx.runtime import RT

TOL = {"float32": 2e-4, "bfloat16": 3e-2, "float16": 4e-3}


def gpu_style(device: str) -> bool:
    """Whether `device` runs a work item per output point (a GPU; OpenCL, Vulkan and WebGPU here on the CPU), where
    the scheduler fuses prologues into matrix-vector products (KernelBuild.prologue), rather than a host device."""
    dl = RT.device(device).dialect
    return dl is not None and bool(dl.global_ids)


def sums(plan: ExecutionPlan) -> list[KernelStep]:
    """The plan's kernels that sum (products, and statistics where they did not fuse), attention aside."""
    return [s for s in plan.steps if isinstance(s, KernelStep) and attention_of(s.kernel) is None
            and any(v.op == "reduce" and v.arg[0] == "sum" for v in toposort(*s.kernel.values))]


async def rounded(x: np.ndarray, dtype: str) -> np.ndarray:
    """`x` as azyx holds it in `dtype`, widened back to float64 (numpy's reference computes in float64)."""
    return (await Tensor(x.astype(np.float32)).cast(dtype).cast("float32").numpy()).astype(np.float64)


def layernorm(x: np.ndarray, w: np.ndarray, b: np.ndarray, eps: float = 1e-5) -> np.ndarray:
    mu = x.mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + eps) * w + b


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("rows", [1, 3])
async def test_prologue_and_epilogue_fuse_into_a_product(device: str, dtype: str, rows: int) -> None:
    """`gelu(layernorm(x) @ W + b) + r` (W stored (K, N), as GPT-2's Conv1D) and `layernorm(x) @ W.T` (stored (N, K),
    as nn.Linear and a tied head): one kernel each, equal to numpy and to the unfused graph."""
    rng = np.random.default_rng(rows)
    k, n = 96, 80
    data = {name: rng.standard_normal(shape) * scale for name, shape, scale in
            (("x", (rows, k), 2.0), ("w", (k, n), 0.1), ("wt", (n, k), 0.1), ("g", (k,), 1.0), ("beta", (k,), 0.5),
             ("b", (n,), 1.0), ("r", (rows, n), 1.0))}
    ref = {name: await rounded(v, dtype) for name, v in data.items()}
    t = {name: Tensor(v.astype(np.float32), device=device).cast(dtype) for name, v in data.items()}
    for v in t.values():
        await v.realize()

    def ln(x: Tensor) -> Tensor:
        return x.layernorm() * t["g"] + t["beta"]

    h = layernorm(ref["x"], ref["g"], ref["beta"])
    cases = [(lambda x: (ln(x) @ t["w"] + t["b"]).gelu(approximate="tanh") + t["r"],
              lambda x: (x @ t["w"] + t["b"]).gelu(approximate="tanh") + t["r"],
              gelu_tanh(h @ ref["w"] + ref["b"]) + ref["r"]),
             (lambda x: ln(x) @ t["wt"].T, lambda x: x @ t["wt"].T, h @ ref["wt"].T)]
    for i, (fused, after, want) in enumerate(cases):
        out = fused(t["x"])
        plan = azyx.schedule(out)
        dev = RT.device(device)
        # one kernel; but where the device's product template takes the product (the host's for x @ W.T of few
        # rows), which reads its operands from memory, the layernorm is realized first; and a weight read along its
        # rows (W.T) may be copied transposed first where the device tiles products over contiguous columns
        steps = [s for s in plan.steps if isinstance(s, KernelStep)]
        if not gpu_style(device):  # a host device recomputes no prologue (KernelBuild.prologue): the layernorm's
            assert len(sums(plan)) == 3  # statistics, each a kernel, then the product
        elif not any(product_of(s.kernel, dev.dialect, dev.threads) for s in steps):
            assert len(sums(plan)) == 1 and (i == 1 or len(steps) == 1)
        got = (await out.cast("float32").numpy()).astype(np.float64)
        normed = ln(t["x"])
        await normed.realize()  # the unfused graph: the layernorm in a buffer of its own first
        unfused = (await after(normed).cast("float32").numpy()).astype(np.float64)
        scale = np.abs(want).max()
        np.testing.assert_allclose(got / scale, want / scale, atol=TOL[dtype])
        np.testing.assert_allclose(got / scale, unfused / scale, atol=TOL[dtype])


async def test_a_statistic_is_computed_once_per_row(device: str) -> None:
    """A layernorm on its own (no product after it) never has each point of its normalizing kernel reduce the whole
    row again (the cost rule, STAT_RATIO): on a GPU-style device it is one row kernel (a work group per row computes
    the mean and the variance once, then normalizes the row: KernelBuild.row_statistic), on a host device its
    statistics are kernels of their own."""
    x = np.random.default_rng(0).standard_normal((4, 256)).astype(np.float32)
    out = Tensor(x, device=device).layernorm()
    kernels = sums(azyx.schedule(out))
    if gpu_style(device):
        assert len(kernels) == 1 and kernels[0].kernel.rows
    else:
        assert len(kernels) == 2  # mean and variance, each once per row
    want = (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + 1e-5)
    np.testing.assert_allclose(await out.numpy(), want, rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------------------------------------ GPT-2 decode
@pytest.fixture(scope="module")
def gpt2(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from test_gpt2 import build_checkpoint

    d = build_checkpoint(tmp_path_factory.mktemp("gpt2"))
    return d, transformers.GPT2LMHeadModel.from_pretrained(d).eval()


class PassThrough:
    """An attention view that hands the values back (the decode attention is a kernel of its own: issue 38 item 3's)."""

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
        return v


@pytest.mark.parametrize("batch", [1, 2])
async def test_a_decoder_layers_decode_step_is_four_kernels(device: str, batch: int) -> None:
    """One GPT-2 layer at decode time (one new token per sequence), attention aside: on a GPU-style device its four
    linear layers are one kernel each (ln_1 in the QKV product's prologue and its bias in the epilogue; c_proj's bias
    and the residual; ln_2, c_fc's bias and GELU; the second c_proj's bias and the residual), equal to numpy."""
    from azyx.models.gpt2 import Block, GPT2Config

    e = 48
    config = GPT2Config(n_layer=1, n_head=4, n_embd=e, vocab_size=64, n_positions=16)
    block = Block(config, 0, azyx.dtypes.float32, device)
    rng = np.random.default_rng(batch)
    params = {name: rng.standard_normal(p.shape).astype(np.float32) * (0.3 if p.ndim == 2 else 1.0)
              for name, p in block.named_parameters()}
    for name, p in block.named_parameters():
        p.assign(Tensor(params[name], device=device))
        await p.realize()
    x = rng.standard_normal((batch, 1, e)).astype(np.float32)
    out = block(Tensor(x, device=device), PassThrough())
    plan = azyx.schedule(out)
    # (on a host device, each layernorm is three kernels more: its statistics and the normalized rows)
    assert len([s for s in plan.steps if isinstance(s, KernelStep)]) == (4 if gpu_style(device) else 10)
    w = {k: v.astype(np.float64) for k, v in params.items()}
    h = layernorm(x, w["ln_1.weight"], w["ln_1.bias"]) @ w["attn.c_attn.weight"] + w["attn.c_attn.bias"]
    x1 = x + h[..., 2 * e:] @ w["attn.c_proj.weight"] + w["attn.c_proj.bias"]
    f = gelu_tanh(layernorm(x1, w["ln_2.weight"], w["ln_2.bias"]) @ w["mlp.c_fc.weight"] + w["mlp.c_fc.bias"])
    want = x1 + f @ w["mlp.c_proj.weight"] + w["mlp.c_proj.bias"]
    np.testing.assert_allclose(await out.numpy(), want, rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize("batch", [1, 2])
async def test_decode_steps_give_transformers_logits(device: str, gpt2: tuple[Path, Any], batch: int) -> None:
    """Decode steps of GPT-2 (2 layers) through Engine, its products fused as above, its cache's keys and values
    written for every sequence of the batch by one kernel per layer: the logits are transformers' (a full forward)."""
    import torch

    from azyx.models import GPT2, Engine

    path, reference = gpt2
    model = await GPT2.from_pretrained(path, device=device)
    engine = Engine(model, slots=batch)
    prompts = [[5, 17, 200, 33, 9], [7, 8, 100, 250]][:batch]
    seqs = [await engine.add(p, engine.params(max_new_tokens=8, ignore_eos=True)) for p in prompts]
    for _ in range(3):
        await engine.step()
    assert engine.logits is not None
    got = await engine.logits.numpy()
    for i, seq in enumerate(seqs):
        ids = seq.prompt + seq.tokens[:-1]
        with torch.no_grad():
            want = reference(torch.tensor([ids])).logits[0, -1].numpy()
        np.testing.assert_allclose(got[i], want, rtol=1e-4, atol=1e-4)
    (trace,) = [tr for tr in engine.decode_step.traces.values()]
    assert trace.plan is not None
    writes = [s for s in trace.plan.steps if isinstance(s, KernelStep) and s.kernel.inplace]
    # a layer's keys and values, every row at once, and the next step's state (tokens, positions: `_Chain`), in place
    assert len(writes) == model.config.n_layer + 1

