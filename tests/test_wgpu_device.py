"""The WebGPU device (azyx.backends.wgpu) on a real driver (wgpu's Vulkan backend over lavapipe in CI): its dtype rules
both ways (packed 8/16-bit types computed exactly; 64-bit types only with the adapter features, else a DTypeError
naming dtype and device), the adapter's limits (grids past 65535 workgroups, the storage binding size), the OpenGL
fallback refused, scalars bound without a recompile. Every result is checked against numpy."""

from __future__ import annotations

import gc
from typing import Any

import numpy as np
import pytest

import azyx
from azyx import Tensor
from azyx.errors import AllocationError, DTypeError
from azyx.runtime import RT

pytestmark = pytest.mark.skipif("wgpu:0" not in azyx.devices(), reason="no wgpu device (wgpu-py or a driver missing)")

from test_faults import run_script  # noqa: E402

DEV = "wgpu:0"


# ------------------------------------------------------------------------------------------------ dtypes, supported
@pytest.mark.parametrize("dtype", ["int8", "uint8", "int16"])
def test_narrow_ints_wrap_like_numpy_at_every_op(dtype: str) -> None:
    """Packed in u32 words, computed in i32, wrapped after each op: numpy's modular arithmetic, odd lengths (the last
    word shared by fewer elements) and neighbours in one word written by different work items."""
    info = np.iinfo(dtype)
    rng = np.random.default_rng(0)
    for n in (1, 3, 7, 1001):
        a = rng.integers(info.min, info.max + 1, n).astype(dtype)
        b = rng.integers(info.min, info.max + 1, n).astype(dtype)
        out = ((Tensor(a, device=DEV) * Tensor(b, device=DEV)) + 100).numpy_sync()
        np.testing.assert_array_equal(out, (a * b) + np.array(100, dtype))
        np.testing.assert_array_equal((-Tensor(a, device=DEV)).numpy_sync(), -a)
        np.testing.assert_array_equal(Tensor(a, device=DEV)[::-1].numpy_sync(), a[::-1])


def test_bools_pack_four_to_a_word_and_compare_and_reduce() -> None:
    rng = np.random.default_rng(1)
    a, b = rng.random(37) < 0.5, rng.random(37) < 0.5
    ta, tb = Tensor(a, device=DEV), Tensor(b, device=DEV)
    np.testing.assert_array_equal((ta & tb).numpy_sync(), a & b)
    np.testing.assert_array_equal((ta ^ tb).numpy_sync(), a ^ b)
    np.testing.assert_array_equal((~ta).numpy_sync(), ~a)
    x = rng.standard_normal(37).astype(np.float32)
    np.testing.assert_array_equal((Tensor(x, device=DEV) > 0).numpy_sync(), x > 0)
    assert Tensor(a, device=DEV).sum().numpy_sync() == a.sum()


def test_float16_and_bfloat16_round_like_their_type() -> None:
    """Stored as 16-bit halves of u32 words, computed in f32 and rounded to the type after each op (no shader-f16
    needed)."""
    rng = np.random.default_rng(2)
    x = rng.standard_normal(501).astype(np.float16)
    out = (Tensor(x, device=DEV) * 3 + 1).numpy_sync()
    assert out.dtype == np.float16
    np.testing.assert_array_equal(out, (x * np.float16(3)) + np.float16(1))
    bf = Tensor(x.astype(np.float32), device=DEV).cast(azyx.dtypes.bfloat16)
    back = (bf * 2).cast(azyx.dtypes.float32).numpy_sync()
    ref = ((x.astype(np.float32).view(np.uint32) + 0x7FFF + ((x.astype(np.float32).view(np.uint32) >> 16) & 1))
           >> 16 << 16).view(np.float32) * 2
    np.testing.assert_array_equal(back, ref)


def test_64_bit_types_with_the_adapter_features() -> None:
    dev = RT.device(DEV)
    if not {"shader-f64", "shader-int64"} <= dev.features:  # type: ignore[attr-defined]
        pytest.skip(f"{dev.label} lacks shader-f64 / shader-int64")  # type: ignore[attr-defined]
    x = np.linspace(-3, 3, 101)
    np.testing.assert_allclose((Tensor(x, device=DEV).exp() * 1.5).numpy_sync(), np.exp(x) * 1.5, rtol=1e-13)
    big = np.array([2**40, -(2**50), 3], np.int64)
    np.testing.assert_array_equal((Tensor(big, device=DEV) * 3 + 2**33).numpy_sync(), big * 3 + 2**33)


# ------------------------------------------------------------------------------------------------ dtypes, refused
def test_64_bit_types_without_the_features_raise_naming_dtype_and_device() -> None:
    """A real adapter with its 64-bit features left off (config "features": []): float64 and int64 kernels raise a
    DTypeError naming the dtype, the device and the feature; transfers of their bytes still work, and so does the
    next float32 realize."""
    out = run_script('''
        import numpy as np
        import azyx
        from azyx import Tensor
        from azyx.errors import DTypeError
        azyx.configure({"wgpu": {"features": []}})
        for dtype, feature in (("float64", "shader-f64"), ("int64", "shader-int64")):
            x = np.arange(5).astype(dtype)
            try:
                (Tensor(x, device="wgpu:0") * 2).numpy_sync()
                raise SystemExit(f"{dtype}: no error")
            except DTypeError as e:
                assert dtype in str(e) and "wgpu:0" in str(e) and feature in str(e), e
            back = Tensor(x).to("wgpu:0").to("c:0").numpy_sync()
            np.testing.assert_array_equal(back, x)
        np.testing.assert_array_equal((Tensor(np.arange(5, dtype=np.float32), device="wgpu:0") * 2).numpy_sync(),
                                      np.arange(5) * 2)
        print("OK")
    ''')
    assert "OK" in out


def test_float64_without_int64_computes_but_takes_no_scalar() -> None:
    """shader-f64 alone: float64 kernels compute (NaN tests by comparison, not bits), but a float64 scalar argument,
    which arrives as a 64-bit word, needs shader-int64: a DTypeError naming both."""
    out = run_script('''
        import numpy as np
        import azyx
        from azyx import Tensor
        from azyx.errors import DTypeError
        azyx.configure({"wgpu": {"features": ["shader-f64"]}})
        x = np.array([0.5, np.nan, -2.0, 3.0])
        t = Tensor(x, device="wgpu:0")
        np.testing.assert_allclose(t.exp().numpy_sync(), np.exp(x), rtol=1e-13)
        np.testing.assert_array_equal(t.max().numpy_sync(), np.nan)
        try:
            (t * 2.5).numpy_sync()
            raise SystemExit("no error")
        except DTypeError as e:
            assert "float64" in str(e) and "shader-int64" in str(e) and "wgpu:0" in str(e), e
        print("OK")
    ''')
    assert "OK" in out


def test_the_renderer_refuses_what_the_features_do_not_allow() -> None:
    from azyx.codegen.wgsl import render_wgsl
    from azyx.dtypes import dtypes
    from azyx.ir import Kernel, ValueBuilder
    from azyx.symbolic import const

    vb = ValueBuilder()
    k = Kernel([dtypes.float64], [], [], [(const(0), vb.const(1.5, dtypes.float64))])
    with pytest.raises(DTypeError, match="float64.*shader-f64"):
        render_wgsl(k, "wgpu:7", frozenset())
    name, src, _ = render_wgsl(k, "wgpu:7", frozenset({"shader-f64"}))
    assert "array<f64>" in src and name in src


# ------------------------------------------------------------------------------------------------ limits
def test_a_grid_past_65535_workgroups_folds_into_two_dimensions() -> None:
    n = 65535 * 64 + 77  # one work item per element: 65537 groups of 64
    x = np.arange(n, dtype=np.float32)
    t = Tensor(x, device=DEV) * 2 - 1
    np.testing.assert_array_equal(t.numpy_sync(), x * 2 - 1)
    rows = np.random.default_rng(3).standard_normal((70000, 128)).astype(np.float32)  # a work group per row
    np.testing.assert_allclose(Tensor(rows, device=DEV).sum(axis=1).numpy_sync(), rows.sum(axis=1), rtol=1e-4,
                               atol=1e-4)


def test_a_tensor_past_the_storage_binding_size_binds_as_ranges() -> None:
    """Past max-storage-buffer-binding-size (128 MiB on lavapipe) a kernel binds a buffer as several ranges and picks
    one by index: elementwise, reversed (every element read from the other range) and reduced."""
    limit = RT.device(DEV).max_binding  # type: ignore[attr-defined]
    n = limit // 4 + 4099
    if n * 4 * 6 > 4 << 30:
        pytest.skip(f"a binding limit of {limit} bytes: too large a tensor to test here")
    x = (np.arange(n, dtype=np.int64) % 1000).astype(np.float32)
    t = Tensor(x, device=DEV)
    np.testing.assert_array_equal((t * 2 + 1).numpy_sync(), x * 2 + 1)
    np.testing.assert_array_equal((t.flip(0) - t).numpy_sync(), x[::-1] - x)
    np.testing.assert_allclose(t.sum().numpy_sync(), x.astype(np.float64).sum(), rtol=1e-4)
    b = Tensor(np.arange(limit + 5, dtype=np.int64).astype(np.uint8), device=DEV)  # packed: bytes past the limit
    tail = (b + 1)[-7:].numpy_sync()
    np.testing.assert_array_equal(tail, ((np.arange(limit - 2, limit + 5) + 1) % 256).astype(np.uint8))


def test_a_reduce_longer_than_a_drivers_loop_bound_is_whole() -> None:
    """One work group sums 33558533 ones (a length with no divisor to split it by): 524k steps per work item, past
    llvmpipe's 65535 loop iterations per shader (the renderer unrolls to stay below it)."""
    n = 33558533
    assert Tensor(np.ones(n, np.float32), device=DEV).sum().numpy_sync() == n  # (data: nothing to constant-fold)
    rows = Tensor(np.ones((3, 1000003), np.float32), device=DEV).sum(axis=1).numpy_sync()
    np.testing.assert_array_equal(rows, np.full(3, 1000003, np.float32))


def test_a_buffer_past_the_buffer_size_limit_is_refused_naming_both() -> None:
    limit = RT.device(DEV).mem.max_block
    if limit >= RT.device(DEV).capacity:
        pytest.skip(f"{DEV} takes buffers up to {limit} bytes, past its memory: its allocator refuses first")
    with pytest.raises(AllocationError, match=f"{limit} bytes"):
        Tensor.zeros(limit // 4 + 1, device=DEV).realize_sync()
    np.testing.assert_array_equal(Tensor.ones(5, device=DEV).numpy_sync(), np.ones(5, np.float32))  # still works


def test_kernels_bind_no_more_storage_buffers_than_the_adapter_allows() -> None:
    dev = RT.device(DEV)
    if dev.max_buffers > 1000:  # type: ignore[attr-defined]
        pytest.skip(f"{DEV} binds {dev.max_buffers} storage buffers per kernel: a graph past that takes too long")  # type: ignore[attr-defined]
    n = dev.max_buffers + 4  # type: ignore[attr-defined]
    xs = [np.full(3, i, np.float32) for i in range(n)]
    total = Tensor(xs[0], device=DEV)
    for x in xs[1:]:
        total = total + Tensor(x, device=DEV)
    np.testing.assert_array_equal(total.numpy_sync(), np.sum(xs, axis=0))


# ------------------------------------------------------------------------------------------------ adapters, scalars
def test_the_opengl_fallback_is_refused_unless_configured() -> None:
    from azyx.backends.wgpu import REAL_BACKENDS, adapters

    assert all(a.info["backend_type"] in REAL_BACKENDS for a in adapters({}))
    assert all(a.info["backend_type"] == "OpenGL" for a in adapters({"backends": ["OpenGL"]}))
    assert RT.device(DEV).adapter.info["backend_type"] != "OpenGL"  # type: ignore[attr-defined]
    with pytest.raises(azyx.AzyxError, match="'vulkan'"):  # (wgpu spells it Vulkan)
        adapters({"backends": ["vulkan"]})
    with pytest.raises(azyx.AzyxError, match="'fast'"):
        adapters({"power_preference": "fast"})


async def test_new_scalar_values_compile_nothing() -> None:
    dev = RT.device(DEV)
    x = np.linspace(-1, 1, 33, dtype=np.float32)
    t = Tensor(x, device=DEV)
    await (t * 0.5 + 0.25).realize()
    before = len(dev.programs)
    for s in (1.5, -2.0, 3.25, 1e-3):
        np.testing.assert_allclose(await (t * s + s).numpy(), x * np.float32(s) + np.float32(s), rtol=1e-6)
    assert len(dev.programs) == before


# ------------------------------------------------------------------------------------------------ pooled memory
def test_blocks_given_back_by_the_cyclic_gc_stay_usable() -> None:
    """A Buffer or a lent staging/upload block that dies in a reference cycle gives its wgpu buffer back to the pool
    from its finalizer, in the same GC pass that finalizes the wgpu buffer itself (wgpu-py releases its handle then):
    the pool must not hand out a released buffer. Then sixteen 4 MiB uploads at once (through upload buffers) into
    buffers from the pool and their read-backs (through staging buffers), against numpy."""
    dev = RT.device(DEV)
    n, count = 4 << 20, 16
    rng = np.random.default_rng(7)
    gc.collect()
    cycle: list[Any] = [dev.alloc(n) for _ in range(count)]
    cycle += [staging.lend(n) for staging in (dev.staging, dev.uploads) for _ in range(4)]  # type: ignore[attr-defined]
    cycle.append(cycle)
    del cycle
    assert gc.collect()
    data = [rng.integers(0, 256, n, np.uint8) for _ in range(count)]
    outs = [np.zeros(n, np.uint8) for _ in range(count)]
    bufs = [dev.alloc(n) for _ in range(count)]
    before = dev.queued()
    writes = [dev.copy_from_host(d, b, [], d) for d, b in zip(data, bufs)]
    last = max(dev.copy_to_host(b, o, [(dev, w)]) for b, o, w in zip(bufs, outs, writes))
    dev.timeline.wait_sync(last)
    assert dev.failure_in(before, last) is None, dev.failure_in(before, last)
    for d, o in zip(data, outs):
        np.testing.assert_array_equal(o, d)
