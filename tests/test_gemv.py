"""The small-M product kernel (issue 38: decode's linear layers; azyx.codegen.templates.gemv, codegen.cgemv): planned
for a device that renders CUDA C (the dummy device made to), its CUDA source run on the host (tests/cuda_host.py: gcc, a
fiber per CUDA thread) against numpy: float32, bfloat16 and float16, M = 1..16 rows (split over blocks in groups
of rows, the last one short), K and N that are no multiple of the load width, both weight layouts (x @ W with W stored
(K, N), x @ W.T with W stored (N, K)), alone and with a layernorm in its prologue and bias, GELU and a residual in its
epilogue, all one kernel. NVRTC compiles the GPT-2 shapes' kernels for sm_90 where it is installed. On a machine with a
GPU, bench/gpu.py's gemv rows time them."""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from cuda_host import launch
from test_attention_decode import as_stored, from_stored
from test_fusion import gelu_tanh, layernorm

import azyx
from azyx import Tensor
from azyx.codegen.dialect import CUDA
from azyx.codegen.kernel import product_of, small_product
from azyx.graph import GRAPH
from azyx.plan import ExecutionPlan, KernelStep, TransferStep
from azyx.runtime import RT
from azyx.walk import canonicalize

DEV = "dummy:0"  # plans without running; made to render CUDA C here (conftest.cuda_planning)
TOL = {"float32": 1e-4, "bfloat16": 2e-2, "float16": 4e-3}


def run_on_host(out: Tensor, data: dict[int, np.ndarray], numel: int) -> tuple[KernelStep, np.ndarray]:
    """Plan `out` (one kernel), run its CUDA source on the host with the leaves' buffers `data` (by tensor id);
    (the step, the output buffer)."""
    walk = canonicalize(GRAPH, [out.id])
    plan: ExecutionPlan = azyx.schedule(out)
    (step,) = plan.kernels
    uploaded = {s.dst: s.src for s in plan.steps if isinstance(s, TransferStep)}  # (leaves still on the host)
    bufs = []
    for i, slot in enumerate(step.args):
        if i < step.outs:
            bufs.append(np.zeros(numel, data[next(iter(data))].dtype))
        else:
            slot = uploaded.get(slot, slot)
            assert slot < plan.n_inputs
            bufs.append(np.ascontiguousarray(data[walk.leaves[slot]]))
    scalars = tuple(float(walk.scalars[i]) for i in step.scalars)
    launch(step.src, step.name, step.launch.grid, step.launch.group, bufs, scalars)
    return step, bufs[0]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("rows, k, n, fused", [(1, 96, 80, False), (3, 75, 37, True), (16, 300, 72, True),
                                                (5, 64, 41, False), (16, 320, 48, True), (8, 200, 24, False),
                                                (13, 40, 700, True), (1, 16, 4096, False),
                                                (1, 6000, 40, False)])
def test_small_products_on_the_cuda_kernel(cuda_planning: None, dtype: str, transposed: bool, rows: int, k: int,
                                           n: int, fused: bool) -> None:
    """`x @ W` / `x @ W.T`, alone or as `gelu(layernorm(x) * g + beta) @ W + b) + r`: one kernel, the small-M one,
    equal to numpy on the (rounded) inputs."""
    rng = np.random.default_rng(rows * 1000 + k + n)
    raw = {"x": (rows, k), "w": (n, k) if transposed else (k, n), "g": (k,), "beta": (k,), "b": (n,), "r": (rows, n)}
    stored = {name: as_stored(rng.standard_normal(shape) * (0.2 if name == "w" else 1.0), dtype)
              for name, shape in raw.items()}
    host = {name: buf for name, (buf, _) in stored.items()}
    ref = {name: value for name, (_, value) in stored.items()}
    t = {name: Tensor(v.astype(np.float32), dtype=dtype, device=DEV) for name, v in ref.items()}
    w = t["w"].T if transposed else t["w"]
    w_ref = ref["w"].T if transposed else ref["w"]
    if fused:
        out = ((t["x"].layernorm() * t["g"] + t["beta"]) @ w + t["b"]).gelu(approximate="tanh") + t["r"]
        want = gelu_tanh(layernorm(ref["x"], ref["g"], ref["beta"]) @ w_ref + ref["b"]) + ref["r"]
    else:
        out = t["x"] @ w
        want = ref["x"] @ w_ref
    step, got = run_on_host(out, {t[name].id: v for name, v in host.items()}, rows * n)
    g = small_product(step.kernel, CUDA)
    assert g is not None and (g.m, g.n, g.k, g.along_k) == (rows, n, k, transposed)
    scale = np.abs(want).max()
    np.testing.assert_allclose(from_stored(got, dtype).reshape(rows, n) / scale, want / scale, atol=TOL[dtype])


@pytest.mark.parametrize("batch, dtype", [(1, "float32"), (16, "bfloat16")])
def test_a_decode_step_is_four_small_product_kernels(cuda_planning: None, batch: int, dtype: str) -> None:
    """A GPT-2 layer at decode time (attention aside; a narrow one: the dummy device's memory), planned for CUDA:
    its four linear layers are four kernels, each the small-M one (ln_1 and its statistics in the QKV product's
    prologue, the biases, GELU and residual adds in epilogues)."""

    from test_fusion import PassThrough

    from azyx.models.gpt2 import Block, GPT2Config

    e = 96
    config = GPT2Config(n_layer=1, n_head=4, n_embd=e, vocab_size=64, n_positions=16)
    block = Block(config, 0, getattr(azyx.dtypes, dtype), DEV)
    for _, p in block.named_parameters():
        p.assign(Tensor(np.zeros(p.shape, np.float32), dtype=dtype, device=DEV))
    out = block(Tensor(np.zeros((batch, 1, e), np.float32), dtype=dtype, device=DEV), PassThrough())
    shapes = []
    for step in azyx.schedule(out).kernels:
        g = small_product(step.kernel, CUDA)
        assert g is not None
        shapes.append((g.m, g.k, g.n))
    assert shapes == [(batch, e, 3 * e), (batch, e, e), (batch, e, 4 * e), (batch, 4 * e, e)]


@pytest.mark.parametrize("transposed", [False, True])
def test_views_with_offsets(cuda_planning: None, transposed: bool) -> None:
    """The weight a slice of a wider (taller) one and the activation rows a slice too: read where they lie (an offset
    and strides that keep 16-byte loads aligned), equal to numpy."""
    rng = np.random.default_rng(7)
    k, n = 64, 48
    shapes = {"x": (5, k), "w": (n + 8, k) if transposed else (k, n + 8), "b": (n,)}
    stored = {name: as_stored(rng.standard_normal(shape), "float32") for name, shape in shapes.items()}
    t = {name: Tensor(value.astype(np.float32), device=DEV) for name, (_, value) in stored.items()}
    ref = {name: value for name, (_, value) in stored.items()}
    w = t["w"][4:4 + n].T if transposed else t["w"][:, 4:4 + n]
    w_ref = ref["w"][4:4 + n].T if transposed else ref["w"][:, 4:4 + n]
    out = t["x"][1:4] @ w + t["b"]
    step, got = run_on_host(out, {t[name].id: buf for name, (buf, _) in stored.items()}, 3 * n)
    g = small_product(step.kernel, CUDA)
    assert g is not None and g.w_off != 0 and g.vec == 4
    want = ref["x"][1:4] @ w_ref + ref["b"]
    np.testing.assert_allclose(got.reshape(3, n), want, rtol=1e-4, atol=1e-4)


@pytest.fixture(params=["opencl:0", "vulkan:0"])
def forced(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """opencl:0 or vulkan:0 with the small-M kernel turned on (their dialects leave it off on a CPU: there the generic
    kernels ran (1, 768) @ (768, 3072) with its prologue and epilogue 8-20x faster, PoCL 0.8 against 16 ms, lavapipe 7
    against 53), so that its OpenCL C and GLSL renderings run here."""
    name = request.param
    if name not in azyx.devices():
        pytest.skip(f"no {name}")
    dev = RT.device(name)
    monkeypatch.setattr(dev, "dialect", dataclasses.replace(dev.dialect, gemv=True))
    RT.plan_cache.clear()
    yield name
    RT.plan_cache.clear()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("rows, k, n", [(1, 75, 37), (16, 300, 41), (13, 60, 700)])
async def test_the_kernel_in_opencl_and_glsl(forced: str, dtype: str, transposed: bool, rows: int, k: int,
                                             n: int) -> None:
    """The same kernel through OpenCL C (vload4, a shared-memory tree where CUDA shuffles) on opencl:0 and through
    GLSL on vulkan:0: `gelu(layernorm(x) * g + beta) @ W + b) + r` in one kernel, equal to numpy."""
    rng = np.random.default_rng(rows + k)
    shapes = {"x": (rows, k), "w": (n, k) if transposed else (k, n), "g": (k,), "beta": (k,), "b": (n,),
              "r": (rows, n)}
    ref = {name: as_stored(rng.standard_normal(shape) * (0.2 if name == "w" else 1.0), dtype)[1]
           for name, shape in shapes.items()}
    t = {name: Tensor(v.astype(np.float32), dtype=dtype, device=forced) for name, v in ref.items()}
    w = t["w"].T if transposed else t["w"]
    out = ((t["x"].layernorm() * t["g"] + t["beta"]) @ w + t["b"]).gelu(approximate="tanh") + t["r"]
    (step,) = azyx.schedule(out).kernels
    assert small_product(step.kernel, RT.device(forced).dialect) is not None
    got = (await out.cast("float32").numpy()).astype(np.float64)
    want = gelu_tanh(layernorm(ref["x"], ref["g"], ref["beta"]) @ (ref["w"].T if transposed else ref["w"]) +
                     ref["b"]) + ref["r"]
    scale = np.abs(want).max()
    np.testing.assert_allclose(got / scale, want / scale, atol=TOL[dtype])


@pytest.mark.skipif(shutil.which("glslc") is None, reason="glslc is not installed")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("transposed", [False, True])
def test_the_vulkan_gpu_shader_compiles(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, dtype: str,
                                        transposed: bool) -> None:
    """The kernel as a Vulkan GPU device's dialect renders it (subgroup shuffles, work groups of 256; the small-M
    kernel on): a fused product's shader compiles to SPIR-V (glslc) and validates (spirv-val, where installed)."""
    from azyx.codegen.dialect import glsl_dialect as dialect_for

    dev = RT.device(DEV)
    monkeypatch.setattr(dev, "dialect", dialect_for((), True, 32))
    monkeypatch.setattr(dev, "tiles", False)
    RT.plan_cache.clear()
    try:
        x, g, b = (Tensor(np.zeros(shape, np.float32), dtype=dtype, device=DEV) for shape in ((3, 96), (96,), (80,)))
        w = Tensor(np.zeros((80, 96) if transposed else (96, 80), np.float32), dtype=dtype, device=DEV)
        (step,) = azyx.schedule(((x.layernorm() * g) @ (w.T if transposed else w) + b).gelu()).kernels
    finally:
        RT.plan_cache.clear()
    assert small_product(step.kernel, dev.dialect) is not None and "subgroupShuffleXor" in step.src
    src, spv = tmp_path / "k.comp", tmp_path / "k.spv"
    src.write_text(step.src)
    r = subprocess.run(["glslc", "-fshader-stage=compute", "--target-env=vulkan1.2", "-O", str(src), "-o", str(spv)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    if shutil.which("spirv-val"):
        r = subprocess.run(["spirv-val", "--target-env", "vulkan1.2", str(spv)], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr


def test_a_weight_per_row_keeps_the_tiled_kernel(cuda_planning: None) -> None:
    """16 rows, two against each matrix of its own ((8, 2, 64) @ (8, 64, 128), attention's scores per head): no weight
    is read once for all rows, so the product stays the tiled template's (batched), not the small-M kernel."""
    q, k = (Tensor(np.zeros(shape, np.float32), device=DEV) for shape in ((8, 2, 64), (8, 64, 128)))
    (step,) = azyx.schedule(q @ k).kernels
    assert small_product(step.kernel, CUDA) is None and product_of(step.kernel, CUDA) is not None


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("rows, k, n", [(1, 768, 2304), (4, 768, 768), (16, 3072, 768), (3, 75, 37),
                                        (16, 768, 3072), (13, 3072, 768), (1, 2048, 4096),
                                        (1, 8192, 512)])
async def test_on_a_cuda_device(dtype: str, transposed: bool, rows: int, k: int, n: int) -> None:
    """On a machine with a GPU (cuda:0; skipped here): GPT-2's decode products and a ragged one as the small-M
    kernel, with the layernorm prologue and the bias, GELU and residual epilogue, one kernel, against numpy."""
    if "cuda:0" not in azyx.devices():
        pytest.skip("no cuda:0")
    dl = RT.device("cuda:0").dialect
    rng = np.random.default_rng(rows + k + n)
    shapes = {"x": (rows, k), "w": (n, k) if transposed else (k, n), "g": (k,), "beta": (k,), "b": (n,),
              "r": (rows, n)}
    ref = {name: as_stored(rng.standard_normal(shape) * (0.05 if name == "w" else 1.0), dtype)[1]
           for name, shape in shapes.items()}
    t = {name: Tensor(v.astype(np.float32), dtype=dtype, device="cuda:0") for name, v in ref.items()}
    w = t["w"].T if transposed else t["w"]
    out = ((t["x"].layernorm() * t["g"] + t["beta"]) @ w + t["b"]).gelu(approximate="tanh") + t["r"]
    (step,) = azyx.schedule(out).kernels
    assert small_product(step.kernel, dl) is not None
    got = (await out.cast("float32").numpy()).astype(np.float64)
    want = gelu_tanh(layernorm(ref["x"], ref["g"], ref["beta"]) @ (ref["w"].T if transposed else ref["w"]) +
                     ref["b"]) + ref["r"]
    scale = np.abs(want).max()
    np.testing.assert_allclose(got / scale, want / scale, atol=TOL[dtype])


def test_gathered_rows_under_a_layernorm_keep_the_small_product_kernel(cuda_planning: None) -> None:
    """A decode step's first layer: the embedding (rows gathered at the tokens and positions) under a layernorm, into
    the QKV product. The small-M kernel loads at affine addresses, so the gathers are realized first (kernels of their
    own) and the product, its layernorm in its prologue, is still the small-M kernel."""
    e, vocab, positions, rows = 96, 64, 16, 2
    zeros = lambda *shape: Tensor(np.zeros(shape, np.float32), device=DEV)  # noqa: E731
    wte, wpe, g, beta, w, b = zeros(vocab, e), zeros(positions, e), zeros(e), zeros(e), zeros(e, 3 * e), zeros(3 * e)
    tokens = Tensor(np.zeros(rows, np.int32), device=DEV)
    pos = Tensor(np.zeros(rows, np.int32), device=DEV)
    x = wte[tokens] + wpe[pos]
    mu = x.mean(-1, keepdim=True)
    out = ((x - mu) / (((x - mu) * (x - mu)).mean(-1, keepdim=True) + 1e-5).sqrt() * g + beta) @ w + b
    kernels = azyx.schedule(out).kernels
    products = [small_product(s.kernel, CUDA) for s in kernels]
    assert [(p.m, p.k, p.n) for p in products if p is not None] == [(rows, e, 3 * e)]
    gathers = [s for s in kernels if s.kernel.check >= 0]  # (the kernels that read an index check it)
    assert len(gathers) == 2 and all(small_product(s.kernel, CUDA) is None for s in gathers)
