"""The CUDA backend without a GPU: the planner makes its GPU-style decisions for a device that renders CUDA C, and
NVRTC compiles every kernel to a cubin for Hopper (sm_90). On a machine with a GPU the op suite runs on cuda:0
itself (AZYX_TEST_DEVICES=cuda:0); here the rendering and the compiler are what can be checked."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("cuda.bindings.nvrtc", reason="cuda-bindings is not installed")
try:  # NVRTC's library ships in the nvidia-cuda-nvrtc wheel
    from cuda.bindings import nvrtc

    nvrtc.nvrtcVersion()
except Exception as e:  # pragma: no cover - depends on the environment
    pytest.skip(f"NVRTC unavailable: {e}", allow_module_level=True)

from kernel_families import BINARY, UNARY  # noqa: E402

import azyx  # noqa: E402
from azyx import Tensor  # noqa: E402
from azyx.backends.cuda_driver import nvrtc_compile  # noqa: E402
from azyx.codegen.dialect import CUDA, WARP_TILES  # noqa: E402
from azyx.codegen.kernel import render_kernel  # noqa: E402
from azyx.codegen.launch import group_size  # noqa: E402
from azyx.codegen.render import kernel_source  # noqa: E402
from azyx.codegen.templates import (
    gemm,  # noqa: E402
    gemm_sm90,  # noqa: E402
)
from azyx.errors import CompileError  # noqa: E402
from azyx.plan import KernelStep  # noqa: E402
from azyx.runtime import RT  # noqa: E402

DEV = "dummy:0"  # plans without running; made to render CUDA C here (conftest.cuda_planning)


def dims(step: KernelStep) -> tuple[tuple[int, int, int], int, int]:
    """(grid, threads per block, bytes zeroed first): the launch the renderer decided for a CUDA kernel."""
    return step.launch.grid, step.launch.group, step.launch.zero


def t(*shape: int, dtype: str = "float32") -> Tensor:
    return Tensor(np.random.default_rng(0).standard_normal(shape).astype(dtype), device=DEV)


def kernels_of(*targets: Tensor) -> list:
    return azyx.schedule(*targets).kernels


def compile_all(steps: list) -> bytes:
    cubin = nvrtc_compile(kernel_source([s.src for s in {s.name: s for s in steps}.values()], CUDA), "sm_90")
    assert cubin[:4] == b"\x7fELF"  # a cubin is an ELF image
    return cubin


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "bfloat16"])
def test_elementwise_ops_compile(cuda_planning: None, dtype: str) -> None:
    x = t(8, 33).cast(dtype)
    y = t(8, 33).cast(dtype) + 2
    outs = [getattr(x, name)() for name in UNARY] + [f(x, y) for f in BINARY]
    outs += [-x, x.gelu(approximate="tanh")]
    compile_all(kernels_of(*outs))


@pytest.mark.parametrize("dtype", ["int8", "uint8", "int16", "int32", "uint32", "int64", "bool"])
def test_integer_and_bool_ops_compile(cuda_planning: None, dtype: str) -> None:
    x = Tensor(np.arange(-20, 20).reshape(4, 10).astype(dtype), device=DEV)
    y = Tensor((np.arange(40).reshape(4, 10) % 7 + 1).astype(dtype), device=DEV)
    outs = [x + y, x * y, x.maximum(y), x < y, x == y, x.cast("float32"), x.sum(axis=1), x.max()]
    if dtype != "bool":
        outs += [x // y, x % y, x & y, x | y, x ^ y, ~x, x ** Tensor(np.full((4, 10), 2, dtype), device=DEV)]
    compile_all(kernels_of(*outs))


def test_reductions_movement_and_pads_compile(cuda_planning: None) -> None:
    x = t(16, 1024)
    outs = [x.sum(axis=1), x.sum(axis=0), x.max(axis=1), x.min(), x.sum(), x.mean(axis=1), x.prod(axis=1),
            x.softmax(axis=-1), x.log_softmax(axis=-1), x.T + 1, x.reshape(32, 512)[::2, 3:300].flip(1),
            x.pad(((1, 2), (3, 4))) * 2, x[:4].expand(2, 4, 1024).permute(2, 0, 1) + 0, (x > 0).max(axis=1)]
    compile_all(kernels_of(*outs))


def test_grouped_reduce_for_rows_and_split_full_reduce(cuda_planning: None) -> None:
    """A row sum reduces each row with a block of 256 threads reading neighbouring elements; a column sum keeps a
    thread per column (neighbouring threads read neighbouring columns); a full sum runs in two stages, the first
    grouped."""
    x = t(32, 2048)
    (row,) = kernels_of(x.sum(axis=1))
    assert group_size(row.kernel, CUDA) == 256 and "__syncthreads" in row.src
    assert dims(row) == ((32, 1, 1), 256, 0)
    (col,) = kernels_of(x.sum(axis=0))
    assert group_size(col.kernel, CUDA) == 0
    assert dims(col) == ((8, 1, 1), 256, 0)
    (many,) = kernels_of(t(4096, 32).sum(axis=1))  # outputs enough for a warp each: 8 rows per block
    assert group_size(many.kernel, CUDA) == 32 and "__shfl_xor_sync" in many.src and "__shared__" not in many.src
    assert dims(many) == ((512, 1, 1), 256, 0)
    full = kernels_of(t(1 << 16).sum())  # 64 grouped partial sums of 1024, then one pass over the 64
    assert group_size(full[0].kernel, CUDA) == 256 and full[0].kernel.global_size == 64
    compile_all([row, col, many, *full])


def test_column_reduce_splits_into_partial_rows(cuda_planning: None) -> None:
    """A column sum with hundreds of outputs: partial rows first (32 of them, each a work item per column reading
    neighbouring columns), then a work item per column over the 32; a row sum keeps its kernel, a transposed read of
    the same column sum splits too; a short column sum does not."""
    x = t(512, 256)
    first, second = kernels_of(x.sum(axis=0))
    assert first.kernel.global_size == 32 * 256 and group_size(first.kernel, CUDA) == 0
    assert second.kernel.global_size == 256 and group_size(second.kernel, CUDA) == 0
    assert dims(first) == ((32, 1, 1), 256, 0) and dims(second) == ((1, 1, 1), 256, 0)
    (row,) = kernels_of(x.sum(axis=1))
    assert group_size(row.kernel, CUDA) == 256
    assert len(kernels_of(x.T.sum(axis=1))) == 2  # the same column sum, read through a transpose
    assert len(kernels_of(x.T.sum(axis=0))) == 1  # a row sum of x
    (few,) = kernels_of(t(128, 300).sum(axis=0))  # too short to split
    compile_all([first, second, row, few, *kernels_of((x * x).max(axis=0) + 1)])


def test_narrow_indices_where_they_fit(cuda_planning: None) -> None:
    (k,) = kernels_of(t(64, 64) + 1)
    assert "int gid" in k.src and "long long gid" not in k.src


@pytest.mark.parametrize("shape", [(64, 96, 48), (33, 17, 29), (128, 64, 256)])
def test_matmul_uses_the_tiled_kernel(cuda_planning: None, shape: tuple[int, int, int]) -> None:
    m, k, n = shape
    a, b = t(m, k), t(k, n)
    steps = kernels_of(a @ b, a @ t(n, k).T, t(k, m).T @ b)
    for s in steps:
        g = gemm.match(s.kernel)
        assert g is not None and (g.m, g.n, g.k) == (m, n, k)
        assert "__shared__" in s.src
        assert dims(s)[1] == g.threads
    compile_all(steps)


def test_products_with_several_batch_axes_and_under_an_epilogue_use_the_tiled_kernel(cuda_planning: None) -> None:
    """Attention's per-head products ((B, H, T, D) @ (B, H, D, S): two batch axes that merge into one) take the
    tiled kernel, as does a Linear's product of many rows under its bias and activation (the product a kernel of its
    own, the epilogue another); a single row's product stays one fused kernel."""
    (scores,) = kernels_of(t(2, 4, 64, 32) @ t(2, 4, 64, 32).transpose(-1, -2))
    g = gemm.match(scores.kernel)
    assert g is not None and (g.batch, g.m, g.n, g.k) == (8, 64, 64, 32)
    linear = kernels_of((t(64, 256) @ t(512, 256).T + t(512)).gelu())
    assert [gemm.match(s.kernel) is not None for s in linear] == [True, False]
    (row,) = kernels_of(t(1, 256) @ t(512, 256).T + t(512))
    assert gemm.match(row.kernel) is None
    compile_all([scores, *linear, row])


def test_plain_float32_elementwise_kernels_move_16_bytes_per_access(cuda_planning: None) -> None:
    """Four points per thread with float4 loads and stores where every output runs along one loop of a length
    divisible by 4; a broadcast operand stays a scalar load per lane; anything else keeps one point per thread."""
    a, b, bias = t(4096), t(4096), t(1)
    (vec,) = kernels_of((a * b + bias).relu() * 0.5 + a)
    assert "float4 l1 = ((const float4*)d1)[gid];" in vec.src and "((float4*)d0)[gid] = s0;" in vec.src
    assert "d3[0]" in vec.src  # the broadcast bias, per lane
    assert dims(vec)[0][0] * dims(vec)[1] == 4096 // 4
    scalar = [kernels_of(t(4097) + 1)[0], kernels_of(t(4096, dtype="float16") * 2)[0], kernels_of(t(64, 64).T + 1)[0]]
    for s in scalar:
        assert "float4" not in s.src
    (mixed,) = kernels_of(t(4096) + t(4096)[::-1])  # the flipped operand reads against the loop: per lane
    assert "float4 l1" in mixed.src and "float4 l2" not in mixed.src
    compile_all([vec, mixed, *scalar])


def test_reductions_read_four_neighbours_at_once_along_the_reduce(cuda_planning: None) -> None:
    """Row sums, a row dot (two operands along the reduce) and both stages of a split full sum step four elements
    at a time with float4 loads; a reduce whose operand is read across it, or of a length not divisible by 4, stays
    scalar."""
    rows, dot = kernels_of(t(128, 1024).sum(axis=1))[0], kernels_of((t(64, 1024) * t(1024)).max(axis=1))[0]
    full = kernels_of(t(1 << 17).sum())
    for k in (rows, dot, full[0]):
        assert "*(const float4*)(d1 + " in k.src and "rl < 256" in k.src
    assert "float4 l2" in dot.src
    scalar = [kernels_of(t(256, 512).sum(axis=0))[0], kernels_of(t(64, 1022).sum(axis=1))[0],
              kernels_of(t(64, 1024, dtype="float16").sum(axis=1))[0]]
    for k in scalar:
        assert "float4" not in k.src
    compile_all([rows, dot, *full, *scalar])


def test_a_matmul_of_few_tiles_splits_k_and_adds_atomically(cuda_planning: None) -> None:
    (s,) = kernels_of(t(64, 1024) @ t(1024, 64))
    g = gemm.match(s.kernel)
    assert g is not None and g.split == (8, 128) and g.grid() == (1, 1, 8)
    assert "atomicAdd" in s.src and dims(s)[2] == 64 * 64 * 4  # C is zeroed before the launch
    compile_all([s])


def test_matmul_with_an_epilogue_renders_generically(cuda_planning: None) -> None:
    (s,) = kernels_of((t(16, 32) @ t(32, 8)).relu())
    assert gemm.match(s.kernel) is None
    compile_all([s])


def test_nvrtc_errors_raise_compile_error() -> None:
    with pytest.raises(CompileError, match="NVRTC failed"):
        nvrtc_compile('extern "C" __global__ void broken(float* x) { x[0] = undefined_name; }', "sm_90")


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "float64"])
def test_gather_scatter_and_assignment_compile(cuda_planning: None, dtype: str) -> None:
    """Issue 18's kernels in CUDA C: a load at an index read from memory, its scatter-add gradient, and a write of a
    view at a runtime position (and at an index tensor)."""
    from azyx import GradientTape

    table, ids = t(50, 16).cast(dtype), Tensor(np.array([[3, -1], [49, 3]], np.int32), device=DEV)
    rows = (table[ids] * 2).exp()
    picked = table.gather(1, Tensor(np.zeros((50, 4), np.int64), device=DEV))
    w = t(50, 16)
    with GradientTape() as tape:
        loss = (w[ids] * w[ids]).sum()
    (g,) = tape.gradient(loss, [w])
    cache = t(4, 8, 16).cast(dtype)
    cache[:, 3] = table[:4]
    cache[Tensor(np.array([0, 2], np.int32), device=DEV), 1:5] = 0.5
    compile_all(kernels_of(rows, picked, g, cache))


@pytest.fixture
def roomy(cuda_planning: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(RT.device(DEV), "capacity", 1 << 31)  # products of large shapes (nothing is allocated)


def products(*targets: Tensor) -> list:
    return [s for s in kernels_of(*targets) if gemm.match(s.kernel, WARP_TILES, True) is not None]


def compile_for(steps: list, arch: str) -> None:
    assert nvrtc_compile(kernel_source([s.src for s in {s.name: s for s in steps}.values()], CUDA), arch)[:4] == \
        b"\x7fELF"


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("shape", [(17, 65, 33), (64, 96, 48), (1000, 1024, 520), (2048, 256, 4096)])
def test_half_matmul_uses_tensor_cores_in_every_layout(roomy: None, dtype: str,
                                                       shape: tuple[int, int, int]) -> None:
    """float16 and bfloat16 products render as the mma.sync kernel (float32 accumulators, C in the input dtype) for
    A @ B, x @ W.T (W as stored), A.T @ B, A.T @ W.T, a batched product and one with a broadcast right operand; 16-byte
    cp.async copies where an operand's contiguous axis allows, element loads otherwise (odd sizes); they compile for
    Hopper and Ampere. (The broadcast one is a single product of its batch's rows.)"""
    m, k, n = shape
    a, b, w = t(m, k).cast(dtype), t(k, n).cast(dtype), t(n, k).cast(dtype)
    at = t(k, m).cast(dtype).T
    outs = [a @ b, a @ w.T, at @ b, at @ w.T]
    if m * n * k <= 1 << 22:
        outs += [t(3, m, k).cast(dtype) @ t(3, k, n).cast(dtype), t(2, m, k).cast(dtype) @ w.T]
    mma = products(*outs)
    assert len(mma) == len(outs)
    for s in mma:
        g = gemm.match(s.kernel, WARP_TILES, True)
        assert g is not None and g.mma and g.dtype == dtype and (g.m * g.batch % m, g.n, g.k) == (0, n, k)
        assert "mma.sync.aligned.m16n8k16.row.col.f32" in s.src and "ldmatrix" in s.src
        assert dims(s)[1] == g.threads and dims(s)[2] == 0
        aligned = k % 8 == 0 and m % 8 == 0 and n % 8 == 0
        assert ("azyx_cp16(" in s.src.split("__global__")[1]) == aligned
    compile_for(mma, "sm_90")
    compile_for(mma, "sm_80")


def test_tensor_core_tiles_and_grid(roomy: None) -> None:
    """128 x 128 tiles of 8 warps where they make a block per multiprocessor or more (4096^2: 32 x 32 blocks), else
    64 x 64 of 4 warps; K is never split (C is float16)."""
    (big,) = products(t(4096, 64).cast("bfloat16") @ t(64, 4096).cast("bfloat16"))
    g = gemm.match(big.kernel, WARP_TILES, True)
    assert g is not None and g.tile == (128, 128) and dims(big) == ((32, 32, 1), 256, 0)
    (small,) = products(t(4, 100, 64).cast("float16") @ t(4, 64, 200).cast("float16"))
    g = gemm.match(small.kernel, WARP_TILES, True)
    assert g is not None and g.tile == (64, 64) and g.split == (1, 64) and dims(small) == ((4, 2, 4), 128, 0)


def test_half_matmul_without_tensor_cores_renders_generically(cuda_planning: None) -> None:
    """Before sm_80 (the dialect without tensor cores), and for a small product fused with its epilogue, the generic
    kernel."""
    import dataclasses

    dev = RT.device(DEV)
    x, y = t(64, 64).cast("float16"), t(64, 64).cast("float16")
    (relu,) = [s for s in kernels_of((x[:32, :32] @ y[:32, :32]).relu()) if s.kernel.stores[0][1].has_reduce]
    assert gemm.match(relu.kernel, WARP_TILES, True) is None
    dev.dialect = dataclasses.replace(CUDA, tensor_cores=False)  # (the fixture's monkeypatch restores it)
    RT.plan_cache.clear()
    (old,) = [s for s in kernels_of(x @ y) if s.kernel.stores[0][1].has_reduce]
    assert "mma.sync" not in old.src
    compile_all([relu, old])


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_a_half_product_under_an_epilogue_takes_the_tensor_cores(roomy: None, dtype: str) -> None:
    """x @ W.T + b (nn.Linear), an activation after it, a cast to float32: the product is a kernel of its own on the
    tensor cores and the epilogue reads it (schedule's tiled_product); a product over a short K stays fused."""
    x, w, b = t(256, 512).cast(dtype), t(384, 512).cast(dtype), t(384).cast(dtype)
    for out in ((x @ w.T + b), (x @ w.T + b).gelu(), (x @ w.T).cast("float32") * 2):
        steps = [s for s in kernels_of(out) if s.kernel.stores[0][1].has_reduce]
        assert len(steps) == 1 and "mma.sync" in steps[0].src
        assert not kernels_of(out)[-1].kernel.stores[0][1].has_reduce  # the epilogue, last
    small = [s for s in kernels_of(t(16, 32).cast(dtype) @ t(32, 8).cast(dtype) + 1)
             if s.kernel.stores[0][1].has_reduce]
    assert len(small) == 1 and "mma.sync" not in small[0].src
    h = t(4, 100, 512).cast(dtype)  # a batch of sequences through the same Linear
    steps = [s for s in kernels_of(h @ w.T + b) if s.kernel.stores[0][1].has_reduce]
    assert len(steps) == 1 and "mma.sync" in steps[0].src
    compile_all(kernels_of(x @ w.T + b, h @ w.T + b))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_hopper_products_take_wgmma_and_compile_for_sm90a(roomy: None, dtype: str) -> None:
    """On compute capability 9.0 (render_kernel's `sm90`: its multiprocessors) a float16/bfloat16 product whose
    sizes are multiples of the tiles, A's K contiguous and B's K or N contiguous (A @ B, x @ W.T, views at aligned
    offsets), takes gemm_sm90's kernel: wgmma fed by TMA, three tensor maps after the buffers, 384 threads, a block
    per multiprocessor (or tile), over 48 KiB of shared memory; it compiles for sm_90a. The rest keep mma.sync."""
    a, b, w = t(2048, 512).cast(dtype), t(512, 1024).cast(dtype), t(1024, 512).cast(dtype)
    big = t(300, 512).cast(dtype)
    fit = products(a @ b, a @ w.T, t(4096, 256).cast(dtype) @ t(256, 4096).cast(dtype),
                   big[8:136, :256] @ big[:256, 64:192])
    rendered = [render_kernel(s.kernel, CUDA, 1, sm90=132) for s in fit]
    for (_, src, launch), grid in zip(rendered, [128, 128, 132, 1], strict=True):
        assert "wgmma.mma_async.sync.aligned.m64n" in src and "cp.async.bulk.tensor.2d" in src
        assert "mma.sync" not in src
        assert launch.grid == (grid, 1, 1) and launch.group == gemm_sm90.THREADS and len(launch.maps) == 3
        assert 48 << 10 < launch.smem <= 227 << 10
    wide = [launch.maps[1].box for _, _, launch in rendered[2:3]]
    assert wide == [(64, 64)]  # 4096^2 in 128 x 256 tiles: B (K, N) in boxes of [64 k][64 n], four a stage
    at = t(512, 2048).cast(dtype).T
    others = products(at @ b, t(1000, 512).cast(dtype) @ b, t(3, 256, 512).cast(dtype) @ t(3, 512, 256).cast(dtype))
    old = [render_kernel(s.kernel, CUDA, 1, sm90=132)[1] for s in others]
    assert all("mma.sync.aligned.m16n8k16" in src for src in old)  # A's M contiguous, M no multiple of 128, a batch
    assert all("wgmma" not in s.src for s in fit)  # (a device not of compute capability 9.0)
    # one module, as a plan's kernels are built: the two kernels' helpers side by side
    assert nvrtc_compile(kernel_source([src for _, src, _ in rendered] + old, CUDA), "sm_90a")[:4] == b"\x7fELF"


def test_kernel_parameters_carry_tensor_maps_by_value(monkeypatch: pytest.MonkeyPatch) -> None:
    """A launch's kernelParams point at each buffer's address, then at each tensor map's 128 bytes (64-byte aligned),
    encoded over the address of the buffer it names."""
    import ctypes

    from azyx.backends import cuda

    monkeypatch.setattr(cuda, "encode_tensor_map", lambda m, base: (base + m.arg).to_bytes(8, "little") * 16)
    maps = tuple(gemm_sm90.TensorMap(arg, 0, (64, 64), 128, (64, 64), "bfloat16") for arg in (1, 2, 0))
    ptrs = (0x1000, 0x2000, 0x3000)
    _, params, at = cuda._kernel_params(ptrs, maps)
    assert at == params.buffer_info()[0] and len(params) == 6
    assert [ctypes.c_uint64.from_address(p).value for p in params[:3]] == list(ptrs)
    for p, m in zip(params[3:], maps, strict=True):
        assert p % 64 == 0 and ctypes.string_at(p, 128) == (ptrs[m.arg] + m.arg).to_bytes(8, "little") * 16
    assert len(cuda._kernel_params(ptrs, ())[1]) == 3


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_attention_is_one_kernel_that_compiles(roomy: None, dtype: str) -> None:
    """scaled_dot_product_attention is one kernel of azyx.attention (no (L, S) buffer) with every kind of mask, a
    head dim it takes; its grid is (query blocks, batch points); half dtypes take the tensor-core kernel where the
    head dims are multiples of 16; float32 heads past 64 take the float32 kernel's dynamic shared memory form."""
    from azyx import nn
    from azyx.codegen.templates import attention
    from azyx.ir import attention_of

    q, k, v = (t(2, 4, 100, 64).cast(dtype) for _ in range(3))
    keep = Tensor(np.random.default_rng(1).random((100, 100)) < 0.5, device=DEV)
    outs = [nn.scaled_dot_product_attention(q, k, v), nn.scaled_dot_product_attention(q, k, v, causal=True),
            nn.scaled_dot_product_attention(q, k, v, mask=keep, scale=0.2),
            nn.scaled_dot_product_attention(q, k[:, :, :70], v[:, :, :70, :40], mask=t(100, 70).cast(dtype))]
    steps = []
    for out in outs:  # (besides the casts of the inputs)
        (step,) = [s for s in kernels_of(out) if attention_of(s.kernel) is not None]
        assert all(s.nbytes < 8 * 100 * 100 * 4 for s in azyx.schedule(out).slots)
        assert step.launch.grid == (-(-100 // attention.CUDA_BQ), 8, 1)
        half_tiles = dtype != "float32" and attention_of(step.kernel).Ev % 16 == 0  # type: ignore[union-attr]
        assert ("mma.sync" in step.src) == half_tiles  # tensor cores for half dtypes, float32 FMA otherwise
        steps.append(step)
    compile_all(steps)
    wide = t(2, 10, 80).cast(dtype)  # a head past 64: the float32 kernel's tiles in dynamic shared memory
    (step,) = [s for s in kernels_of(nn.scaled_dot_product_attention(wide, wide, wide)) if attention_of(s.kernel)]
    assert ("mma.sync" in step.src) == (dtype != "float32")
    assert (step.launch.smem > 48 << 10) == (dtype == "float32")
    steps.append(step)
    big = t(2, 4, 100, 136).cast(dtype)
    q, k, v = big[..., :128], big[..., 8:136], big[..., 1:129]  # v's rows start at odd elements: copied first
    more = kernels_of(nn.scaled_dot_product_attention(q, k, v))
    (step,) = [s for s in more if attention_of(s.kernel)]
    steps += more
    a = attention_of(step.kernel)
    assert a is not None
    if dtype == "float32":  # (read where they lie: the float32 kernel reads elements through their strides)
        assert "mma.sync" not in step.src and (a.q[0], a.k[0], a.v[0]) == (0, 8, 1)
    else:
        assert "mma.sync" in step.src and a.v[0] == 0 and a.q[0] == 0 and a.k[0] == 8
    compile_all(steps)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_decode_attention_plans_into_its_kernels_that_compile(roomy: None, dtype: str) -> None:
    """A decode step's attention (one query row; the keys a window of a cache, a valid-lengths mask over heads) plans
    into the decode form: grid (rows, chunks) then its combine (rows, 1) where the rows leave the GPU idle, one kernel
    where they do not; a view whose rows do not start on 16 bytes is copied first; all compile."""
    from azyx import nn
    from azyx.codegen.templates import attention
    from azyx.ir import attention_of

    cache = t(5, 12, 4096, 72).cast(dtype)
    q = t(4, 12, 1, 64).cast(dtype)
    lengths = np.array([1, 100, 4000, 4096])[:, None]
    keep = Tensor(np.arange(4096)[None, :] < lengths, device=DEV).reshape(4, 1, 1, 4096)
    steps, others = [], []
    for keys, rows in ((cache[:4, :, :, :64], 48), (cache[1:, :, :, 1:65], 48)):
        got = kernels_of(nn.scaled_dot_product_attention(q, keys, keys, mask=keep))
        stages = [(s, attention_of(s.kernel)) for s in got if attention_of(s.kernel) is not None]
        splits = attention.decode_splits(CUDA, rows, 4096)
        assert splits > 1 and [a.stage for _, a in stages] == [1, 2]  # type: ignore[union-attr]
        assert [s.launch.grid for s, _ in stages] == [(rows, splits, 1), (rows, 1, 1)]
        others.append(len(got) - 2)
        steps += got
    assert others[1] == others[0] + 1  # (the unaligned keys copied)
    slots = Tensor(np.array([3, 0, 4, 1], np.int32), device=DEV)  # (a decode step's: the cache's rows by slot)
    keys, values = cache[:, :, :, :64][slots], cache[:, :, :, 8:72][slots]
    gathered = kernels_of(nn.scaled_dot_product_attention(q, keys, values))
    stages = [attention_of(s.kernel) for s in gathered if attention_of(s.kernel) is not None]
    assert [a.gather for a in stages] == [5, 5] and len(gathered) == 2 + (dtype != "float32") * 2  # type: ignore
    assert "const int* __restrict__ d4, int* __restrict__ d5" in gathered[-2].src  # (the index, its check words)
    steps += gathered
    big = t(64, 12, 1, 128).cast(dtype)
    (one,) = [s for s in kernels_of(nn.scaled_dot_product_attention(big, t(64, 12, 256, 128).cast(dtype),
                                                                     t(64, 12, 256, 128).cast(dtype)))
              if attention_of(s.kernel) is not None]
    assert attention_of(one.kernel).splits == 1 and one.launch.grid == (768, 1, 1)  # type: ignore[union-attr]
    compile_all([*steps, one])


def test_float32_products_keep_their_accumulators_in_registers(roomy: None) -> None:
    """The float32 kernel's tiles (4 warps; 128 x 128 tiles at 16 x 8 a lane, 128 accumulators) compile for sm_90
    without spilling, in each layout of its operands (ptxas's report)."""
    x, y, w, v = t(1536, 256), t(256, 1536), t(1536, 256), t(1024, 256)
    tiles = set()
    for out in (x @ y, x @ w.T, t(256, 1536).T @ y, v @ t(256, 512), v @ t(512, 256).T, t(64, 256) @ t(256, 64)):
        (s,) = kernels_of(out)
        g = gemm.match(s.kernel)
        assert g is not None and dims(s)[1] == g.threads == 128
        tiles.add(g.tile)
        assert_no_spills(s.src, g)
    assert tiles == {(128, 128), (128, 64), (64, 64)}
    assert gemm.match(kernels_of(x @ y)[0].kernel).simt == gemm.SimtTile(128, 128, 2, 2, lm=4, bk=8)  # type: ignore


def test_products_of_32_rows_take_32_row_tiles(roomy: None) -> None:
    """A float32 product of 32 rows or fewer computes no rows of zeros: 32 x 128 tiles of 4 warps, or 32 x 64 tiles of 2
    warps for a wide one (an LM head's), both compiling for sm_90 without spilling."""
    for out, tile, threads in ((t(32, 768) @ t(768, 3072), (32, 128), 128), (t(24, 256) @ t(256, 20000), (32, 64), 64)):
        (s,) = kernels_of(out)
        g = gemm.match(s.kernel)
        assert g is not None and g.tile == tile and dims(s)[1] == g.threads == threads
        assert_no_spills(s.src, g)


def assert_no_spills(src: str, g: gemm.Gemm) -> None:
    """The kernel compiles for sm_90 and ptxas reports no register spills."""
    err, prog = nvrtc.nvrtcCreateProgram(src.encode(), b"k.cu", 0, [], [])
    opts = [b"--gpu-architecture=sm_90", b"--ptxas-options=-v"]
    assert nvrtc.nvrtcCompileProgram(prog, len(opts), opts)[0] == nvrtc.nvrtcResult.NVRTC_SUCCESS
    size = nvrtc.nvrtcGetProgramLogSize(prog)[1]
    log = b" " * size
    nvrtc.nvrtcGetProgramLog(prog, log)
    assert b"0 bytes spill stores, 0 bytes spill loads" in log, (g.tile, g.simt, log.decode())


class PassThrough:
    """An attention view that hands the values back (the decode attention is planned on its own)."""

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
        return v


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("batch", [1, 32])
def test_fused_decode_layer_renders_and_compiles(roomy: None, dtype: str, batch: int) -> None:
    """GPT-2 small's layer at decode time (attention aside): at batch 1 four kernels (layernorm, bias, GELU and the
    residual fused into the products: tests/test_fusion.py), each product reduced by a block per output with its
    layernorm's statistics computed by that block first; at batch 32 the products take the tiled template. NVRTC
    compiles every kernel for sm_90."""
    from azyx.dtypes import to_dtype
    from azyx.models.gpt2 import Block, GPT2Config

    e = 768
    block = Block(GPT2Config(n_layer=1, n_head=12, n_embd=e), 0, to_dtype(dtype), DEV)
    for _, p in block.named_parameters():
        p.assign(t(*p.shape).cast(dtype))
    steps = kernels_of(block(t(batch, 1, e).cast(dtype), PassThrough()))
    if batch == 1:
        assert len(steps) == 4 and all(group_size(s.kernel, CUDA) for s in steps)
    compile_all(steps)
