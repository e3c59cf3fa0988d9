"""Small-M products split over K on CUDA (issue 38: decode's linear layers at batch 17-64 on tensor cores and in
float32; gemm.split_k, schedule.Planner.split_product), planned for a device that renders CUDA C (the dummy device
made to, with an H200's multiprocessors): stage 1, the product of the parts of K in float32 (tensor cores: the mma
kernel, run by tests/test_mma_emulated.py's emulator; float32: the CUDA-core kernel, run on the host by
tests/cuda_host.py), then stage 2, the sum of the parts fused with the product's epilogue (bias, GELU, residual) and
the one rounding to the product's dtype, against numpy; the same product unsplit (a device of unknown
multiprocessors) too. NVRTC compiles the GPT-2 shapes' kernels. On a GPU, .scratch's split-K script (see the branch's
report) times them."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from cuda_host import launch
from test_attention_decode import as_stored, from_stored
from test_fusion import gelu_tanh
from test_mma_emulated import emulate

import azyx
from azyx import Tensor
from azyx.codegen.dialect import CUDA, WARP_TILES
from azyx.codegen.kernel import product_of, small_product
from azyx.codegen.templates import gemm
from azyx.graph import GRAPH
from azyx.plan import ExecutionPlan, KernelStep, TransferStep
from azyx.runtime import RT
from azyx.walk import canonicalize

DEV = "dummy:0"  # plans without running; made to render CUDA C here (conftest.cuda_planning)
H200_SMS = 132
TOL = {"float32": 1e-5, "bfloat16": 1.6e-2, "float16": 2e-3}


@pytest.fixture
def sms(cuda_planning: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(RT.device(DEV), "multiprocessors", H200_SMS)


def run_plan(out: Tensor, data: dict[int, np.ndarray]) -> tuple[list[KernelStep], np.ndarray]:
    """Plan `out` and run its kernels on the host in order: tensor-core products by the emulator, others by
    cuda_host; (the kernel steps, the output's buffer)."""
    walk = canonicalize(GRAPH, [out.id])
    plan: ExecutionPlan = azyx.schedule(out)
    uploaded = {s.dst: s.src for s in plan.steps if isinstance(s, TransferStep)}  # (leaves still on the host)
    bufs: dict[int, np.ndarray] = {}

    def buf(slot: int) -> np.ndarray:
        slot = uploaded.get(slot, slot)
        if slot not in bufs:
            s = plan.slots[slot]
            kind = {4: np.float32, 2: np.uint16}[s.dtype.itemsize]
            bufs[slot] = np.ascontiguousarray(data[walk.leaves[slot]]).reshape(-1) if slot < plan.n_inputs else \
                np.zeros(s.nbytes // s.dtype.itemsize, kind)
        return bufs[slot]

    for step in plan.kernels:
        args = [buf(s) for s in step.args]
        g = product_of(step.kernel, CUDA)
        if g is not None and g.mma:  # (the emulator reads float64 memory of each operand parameter)
            mem = {i: from_stored(a, g.dtype) for i, a in enumerate(args) if i}
            gx, gy, gz = step.launch.grid
            c = emulate(step.src, g, mem, [(x, y, z) for z in range(gz) for y in range(gy) for x in range(gx)])
            args[0][:] = as_stored(c, g.c_dtype)[0]  # (C rounded once to its dtype, as the kernel's epilogue does)
        else:
            launch(step.src, step.name, step.launch.grid, step.launch.group, args)
    return plan.kernels, bufs[uploaded.get(plan.kernels[-1].args[0], plan.kernels[-1].args[0])]


@pytest.mark.parametrize("dtype, m, k, n, epilogue, transposed", [
    ("bfloat16", 32, 384, 64, True, False), ("float16", 17, 387, 72, True, True),
    ("float32", 33, 256, 40, True, False), ("float32", 64, 384, 64, False, True),
    ("float32", 32, 384, 64, True, False), ("float32", 20, 256, 130, True, True),
    ("bfloat16", 64, 256, 17, False, False)])
def test_a_split_product_with_its_epilogue_equals_numpy(sms: None, monkeypatch: pytest.MonkeyPatch, dtype: str,
                                                        m: int, k: int, n: int, epilogue: bool,
                                                        transposed: bool) -> None:
    """`gelu(x @ W + b) + r` (or `x @ W` alone) split over K: two kernels, the product of the parts (its K a part of
    K, a batch element each, float32 C) and the sum with the epilogue; equal to numpy on the rounded inputs, and to
    the same product planned unsplit. K odd (387: parts of 129, element loads), M and N ragged."""
    rng = np.random.default_rng(m + k + n)
    raw = {"x": (m, k), "w": (n, k) if transposed else (k, n), "b": (n,), "r": (m, n)}
    stored = {name: as_stored(rng.standard_normal(shape) * (0.1 if name == "w" else 1.0), dtype)
              for name, shape in raw.items()}
    ref = {name: value for name, (_, value) in stored.items()}
    t = {name: Tensor(v.astype(np.float32), dtype=dtype, device=DEV) for name, v in ref.items()}
    w = t["w"].T if transposed else t["w"]
    w_ref = ref["w"].T if transposed else ref["w"]
    if epilogue:
        out = (t["x"] @ w + t["b"]).gelu(approximate="tanh") + t["r"]
        want = gelu_tanh(ref["x"] @ w_ref + ref["b"]) + ref["r"]
    else:
        out = t["x"] @ w
        want = ref["x"] @ w_ref
    data = {t[name].id: buf for name, (buf, _) in stored.items()}
    parts = gemm.split_k(m, n, k, dtype, H200_SMS)
    assert parts > 1
    scale = np.abs(want).max()
    for split in (True, False):
        if not split:
            monkeypatch.setattr(RT.device(DEV), "multiprocessors", 0)
            RT.plan_cache.clear()
        steps, got = run_plan(out, data)
        products = [g for g in (product_of(s.kernel, CUDA) for s in steps) if g is not None]
        assert len(steps) == 2 if split else len(steps) == 1 + epilogue
        assert [(g.m, g.n, g.k, g.batch) for g in products] == [(m, n, k // parts, parts) if split else (m, n, k, 1)]
        assert products[0].c_dtype == ("float32" if split else dtype)
        np.testing.assert_allclose(from_stored(got, dtype).reshape(m, n) / scale, want / scale, atol=TOL[dtype])


def test_the_split_is_decided_from_the_shape_and_the_multiprocessors() -> None:
    """gemm.split_k: GPT-2's decode products at batch 32 split to about one block per multiprocessor (12 tiles of
    32 x 768 on 132: 6 parts of K = 768, 8 of 3072 in 16 bits; float32's 6 tiles of 32 x 128: 12 parts), none where
    the device is not known, where the tiles fill half of it, where a part would hold fewer than SPLIT_SLICES slices,
    or where no divisor of K keeps its parts on 8 elements (K a multiple of 8: 16-byte loads)."""
    assert gemm.split_k(32, 768, 768, "bfloat16", H200_SMS) == 6
    assert gemm.split_k(32, 768, 3072, "float16", H200_SMS) == 8
    assert gemm.split_k(64, 2304, 768, "bfloat16", H200_SMS) == 4
    assert gemm.split_k(32, 768, 768, "float32", H200_SMS) == 12  # (6 tiles of 32 x 128 in float32)
    assert gemm.split_k(32, 768, 768, "bfloat16", 0) == 1
    assert gemm.split_k(256, 4096, 768, "bfloat16", H200_SMS) == 1  # (256 tiles)
    assert gemm.split_k(256, 384, 512, "bfloat16", H200_SMS) == 1  # (24 tiles, but past SPLIT_ROWS: wgmma's on sm_90)
    assert gemm.split_k(32, 768, 192, "bfloat16", H200_SMS) == 1  # (parts of 96 < 4 slices of 32)
    assert gemm.split_k(32, 768, 8 * 131, "bfloat16", H200_SMS) == 1  # (parts of 131 x 8 / d: not on 8 elements)
    assert gemm.split_k(32, 768, 387, "bfloat16", H200_SMS) == 3  # (K odd: parts of 129)


@pytest.mark.parametrize("rows", [1, 16])
def test_a_few_rows_keep_the_small_product_kernel(sms: None, rows: int) -> None:
    """M <= GEMV_ROWS: the small-M kernel (templates.gemv), one kernel with its epilogue, never split."""
    rng = np.random.default_rng(rows)
    x, w, b = (Tensor(rng.standard_normal(s).astype(np.float32), dtype="bfloat16", device=DEV)
               for s in ((rows, 768), (768, 256), (256,)))
    (step,) = azyx.schedule((x @ w + b).gelu()).kernels
    assert small_product(step.kernel, CUDA) is not None


def test_the_gpt2_split_kernels_compile() -> None:
    """NVRTC compiles stage 1 of GPT-2's decode products at batch 32 and 64 (float32 C, 16-bit operands; at 32 rows
    also in 64 x 64 tiles) for sm_90."""
    nvrtc = pytest.importorskip("cuda.bindings.nvrtc", reason="cuda-bindings is not installed")
    try:  # NVRTC's library ships in the nvidia-cuda-nvrtc wheel
        nvrtc.nvrtcVersion()
    except Exception as e:  # pragma: no cover - depends on the environment
        pytest.skip(f"NVRTC unavailable: {e}")
    from azyx.backends.cuda_driver import nvrtc_compile
    from azyx.codegen.render import kernel_source
    from azyx.codegen.templates import gemm_cuda

    srcs = []
    for dtype in ("bfloat16", "float16", "float32"):
        for m in (32, 64):
            for k, n in ((768, 2304), (768, 3072), (768, 768), (3072, 768)):
                p = gemm.split_k(m, n, k, dtype, H200_SMS)
                kp = k // p
                out = "float32" if dtype != "float32" else ""
                g = gemm.Gemm(m, n, kp, p, (1, 0, kp, k, 1), (2, 0, kp * n, n, 1), WARP_TILES, dtype, out=out)
                tile = gemm.few_rows_tile(m, n, g.mma)
                assert p > 1 and g.split[0] == 1 and g.tile == tile == ((64, 64) if m > 32 else (32, 64) if g.mma else
                                                                        (32, 128))
                srcs.append(gemm_cuda.render_cuda(g, f"k_{dtype}_{m}_{k}_{n}"))
                if g.mma and m <= 32:  # (the 64 x 64 tile, a searched variant)
                    g = replace(g, variant=gemm.MMA_TILES.index((64, 64)) + 1)
                    srcs.append(gemm_cuda.render_cuda(g, f"k_{dtype}_{m}_{k}_{n}_64"))
    assert nvrtc_compile(kernel_source(srcs, CUDA), "sm_90")[:4] == b"\x7fELF"  # (a cubin: an ELF image)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_decode_layer_at_batch_32_keeps_its_kernel_count(sms: None, monkeypatch: pytest.MonkeyPatch,
                                                            dtype: str) -> None:
    """A GPT-2 layer at decode time, batch 32 (attention aside; a narrow one, the dummy device's memory, its parts
    allowed a slice each): each of its four linear layers splits over K, and the layer plans into as many kernels
    as unsplit, each split's sum fused into the kernel of its bias, GELU or residual."""
    from test_fusion import PassThrough

    from azyx.models.gpt2 import Block, GPT2Config

    monkeypatch.setattr(gemm, "SPLIT_SLICES", 1)
    monkeypatch.setattr(RT.device(DEV), "free_memory", lambda: 1 << 30)  # (float32's partial sums: more than 1 MiB)
    e = 96
    config = GPT2Config(n_layer=1, n_head=4, n_embd=e, vocab_size=64, n_positions=16)
    block = Block(config, 0, getattr(azyx.dtypes, dtype), DEV)
    for _, p in block.named_parameters():
        p.assign(Tensor(np.zeros(p.shape, np.float32), dtype=dtype, device=DEV))
    x = Tensor(np.zeros((32, 1, e), np.float32), dtype=dtype, device=DEV)
    counts, splits = [], []
    for sms_ in (H200_SMS, 0):
        monkeypatch.setattr(RT.device(DEV), "multiprocessors", sms_)
        RT.plan_cache.clear()
        kernels = azyx.schedule(block(x, PassThrough())).kernels
        counts.append(len(kernels))
        splits.append([g.batch for g in (product_of(s.kernel, CUDA) for s in kernels) if g is not None])
    assert len(splits[0]) == 4 and all(p > 1 for p in splits[0]) and splits[1] == [1, 1, 1, 1]
    assert counts[0] == counts[1]
