"""The GLSL dialect without a Vulkan device: the planner renders GLSL compute shaders for a device whose dialect is
GLSL, and every shader compiles to SPIR-V with glslc and passes spirv-val (the Vulkan backend, issue 15, runs them).
Here the rendering, the shader interface and the launch geometry are what can be checked."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from kernel_families import BINARY, UNARY

import azyx
from azyx import Tensor
from azyx.codegen.dialect import GLSL
from azyx.plan import KernelStep
from azyx.runtime import RT

if shutil.which("glslc") is None:
    pytest.skip("glslc is not installed (Debian: glslc)", allow_module_level=True)

DEV = "dummy:0"  # plans without running; made to render GLSL here


@pytest.fixture
def glsl_planning(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    dev = RT.device(DEV)
    monkeypatch.setattr(dev, "dialect", GLSL)
    monkeypatch.setattr(dev, "tiles", False)
    monkeypatch.setattr(dev, "capacity", 1 << 30)  # room for the large arrays of the grid tests
    RT.plan_cache.clear()
    yield
    RT.plan_cache.clear()


def t(*shape: int, dtype: str = "float32") -> Tensor:
    return Tensor(np.random.default_rng(0).standard_normal(shape).astype(dtype), device=DEV)


def compiled(tmp_path: Path, *targets: Tensor) -> list[KernelStep]:
    """The plan's kernels, each compiled to SPIR-V by glslc and validated by spirv-val where installed."""
    steps = azyx.schedule(*targets).kernels
    for s in {s.name: s for s in steps}.values():
        src, spv = tmp_path / f"{s.name}.comp", tmp_path / f"{s.name}.spv"
        src.write_text(s.src)
        cmd = ["glslc", "-fshader-stage=compute", "--target-env=vulkan1.2", "-O", str(src), "-o", str(spv)]
        r = subprocess.run(cmd, capture_output=True, text=True)
        assert r.returncode == 0, f"{r.stderr}\n--- source ---\n{s.src}"
        assert spv.read_bytes()[:4] == b"\x03\x02\x23\x07"  # the SPIR-V magic number, little-endian
        if shutil.which("spirv-val"):
            r = subprocess.run(["spirv-val", "--target-env", "vulkan1.2", str(spv)], capture_output=True, text=True)
            assert r.returncode == 0, r.stderr
    return steps


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_elementwise_ops_compile(glsl_planning: None, tmp_path: Path, dtype: str) -> None:
    x = t(8, 33).cast(dtype)
    y = t(8, 33).cast(dtype) + 2
    outs = [getattr(x, name)() for name in UNARY] + [f(x, y) for f in BINARY]
    compiled(tmp_path, *outs, -x, x.gelu(approximate="tanh"))


def test_float64_ops_compile(glsl_planning: None, tmp_path: Path) -> None:
    """GLSL has double arithmetic, comparisons, floor and sqrt; its exp, log, sin... take float only, so the prelude
    computes them in double (azyx_exp and the rest, overloaded for float to the builtins)."""
    x, y = t(8, 33).cast("float64"), t(8, 33).cast("float64") + 2
    compiled(tmp_path, *[getattr(x, name)() for name in UNARY], *[f(x, y) for f in BINARY])
    compiled(tmp_path, x * y + 2.5, x / y, x // y, x % y, x.maximum(y), Tensor.where(x < y, x, y), x.sqrt(), x.floor(),
             x.sum(axis=1), x.cast("float32"), x.cast("float16"), x.cast("bfloat16"), x.cast("int8"))


@pytest.mark.parametrize("dtype", ["int8", "uint8", "int16", "int32", "uint32", "int64", "bool"])
def test_integer_and_bool_ops_compile(glsl_planning: None, tmp_path: Path, dtype: str) -> None:
    x = Tensor(np.arange(-20, 20).reshape(4, 10).astype(dtype), device=DEV)
    y = Tensor((np.arange(40).reshape(4, 10) % 7 + 1).astype(dtype), device=DEV)
    outs = [x + y, x * y, x.maximum(y), x < y, x == y, x.cast("float32"), x.cast("float16"), x.cast("bfloat16"),
            x.sum(axis=1), x.max()]
    if dtype != "bool":
        outs += [x // y, x % y, x & y, x | y, x ^ y, ~x, x ** Tensor(np.full((4, 10), 2, dtype), device=DEV)]
    compiled(tmp_path, *outs)


def test_reductions_movement_and_pads_compile(glsl_planning: None, tmp_path: Path) -> None:
    x = t(16, 1024)
    compiled(tmp_path, x.sum(axis=1), x.sum(axis=0), x.max(axis=1), x.min(), x.sum(), x.mean(axis=1),
             x.prod(axis=1), x.softmax(axis=-1), x.log_softmax(axis=-1), x.T + 1,
             x.reshape(32, 512)[::2, 3:300].flip(1), x.pad(((1, 2), (3, 4))) * 2,
             x[:4].expand(2, 4, 1024).permute(2, 0, 1) + 0, (x > 0).max(axis=1), x.argmax(axis=1),
             t(64, 32) @ t(32, 48))


def test_the_shader_interface(glsl_planning: None, tmp_path: Path) -> None:
    """Buffers are buffer references (outputs first, inputs read-only) whose addresses are the first words of binding 0,
    the scalars' words follow them (scalar j of a kernel with n buffers: words 2(n+j) and 2(n+j)+1), the work group
    size is the launch's, and grouped reduces keep their shared memory at global scope."""
    x = t(4, 4096)
    (step,) = compiled(tmp_path, (x * 1.5 + 0.25).sum(axis=1))
    src = step.src
    assert "void main()" in src and f"// {step.name}" in src
    assert "binding = 0) restrict readonly buffer W { uint sw[]; }" in src
    assert "buffer_reference_align = 4) restrict buffer B0 { float v[]; }" in src
    assert "buffer_reference_align = 4) restrict readonly buffer B1 { float v[]; }" in src
    assert "B0 p0 = B0(packUint2x32(uvec2(sw[0], sw[1])));" in src and "B1(packUint2x32(uvec2(sw[2], sw[3])))" in src
    assert "uintBitsToFloat(sw[4])" in src and "uintBitsToFloat(sw[6])" in src
    assert f"layout(local_size_x = {step.launch.group}) in;" in src
    assert step.launch.grid == (4, 1, 1) and step.launch.group == GLSL.group_size  # a work group per row
    assert src.index("shared float") < src.index("void main()")


def test_grids_past_the_dimension_limit_fold_into_rows(glsl_planning: None, tmp_path: Path) -> None:
    """Vulkan guarantees 65535 work groups per dimension (lavapipe has no more): a longer grid becomes rows of 65535
    groups, and the work items past the last point return (whole groups, for a grouped kernel)."""
    n = 65535 * GLSL.block + 1001  # (odd: a multiple of 4 would take four points per work item, in vectors)
    (step,) = compiled(tmp_path, t(n) * 2 + 1)
    assert step.launch.grid == (65535, 2, 1) and step.launch.group == GLSL.block
    assert step.launch.items >= n and f"if (gid >= {n}) return;" in step.src
    (step,) = compiled(tmp_path, t(4 * n) * 2 + 1)  # four points per work item: 16-byte loads and stores
    assert step.launch.grid == (65535, 2, 1) and "vec4 l1 = Q1(" in step.src and "Q0(" in step.src
    rows = t(70000, 256).sum(axis=1)
    (step,) = compiled(tmp_path, rows)
    assert step.launch.grid == (65535, 2, 1) and "if (gid >= 70000) return;" in step.src


def test_kernels_stay_within_the_devices_binding_limit(glsl_planning: None, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A device that binds at most 8 storage buffers per kernel (Vulkan's maxPerStageDescriptorStorageBuffers, a
    scalar words buffer included): a sum of 20 tensors with scalars, and 12 elementwise updates that would merge into
    one kernel, are split into kernels that each fit."""
    monkeypatch.setattr(RT.device(DEV), "max_buffers", 8)
    xs = [t(64) for _ in range(20)]
    total = xs[0]
    for x in xs[1:]:
        total = total + x * 0.5
    updates = [x * 0.9 + 0.1 for x in xs[:12]]
    for targets in ([total], updates):
        steps = compiled(tmp_path, *targets)
        assert len(steps) > 1 and all(len(s.args) + bool(s.scalars) <= 8 for s in steps)
