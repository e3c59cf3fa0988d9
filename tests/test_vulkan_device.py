"""The Vulkan device (azyx.backends.vulkan) on a real driver (lavapipe in CI), driven directly: each test hands the
device its own compute shaders (KernelSteps made by hand, on the renderer's interface: buffers by address from the words
binding) and checks the results against numpy; the last runs the GLSL renderer's kernels through the whole path.
Each test runs in a fresh interpreter with two logical devices on physical device 0 (so that waits and copies between
vulkan devices run too)."""

from __future__ import annotations

import shutil

import pytest

try:
    import vulkan  # noqa: F401
except (ImportError, OSError) as e:  # OSError: no Vulkan loader
    pytest.skip(f"the vulkan package or the Vulkan loader is missing: {e}", allow_module_level=True)
if shutil.which("glslc") is None:
    pytest.skip("glslc is not installed", allow_module_level=True)

from test_faults import run_script  # noqa: E402

PRELUDE = '''
import asyncio, time
import numpy as np
import azyx
azyx.configure({"c": {"devices": 1}, "vulkan": {"enabled": True, "device_ids": [0, 0]}})
from azyx.runtime import RT
from azyx.dtypes import dtypes, scalar_packer
from azyx.ir import Kernel, ValueBuilder
from azyx.codegen.launch import Launch
from azyx.plan import KernelStep
from azyx.symbolic import const

if "vulkan:0" not in azyx.devices():
    print("SKIP: no vulkan device")
    raise SystemExit(0)
vk0 = RT.device("vulkan:0")
cdev = RT.device("c:0")

def step(name, src, nbufs, grid, group, scalars=(), dev="vulkan:0"):
    """A KernelStep of the shader `src` with `nbufs` buffers and scalar arguments of the dtypes `scalars`."""
    vb = ValueBuilder()
    val = vb.const(0.0, dtypes.float32)
    for i, dt in enumerate(scalars):
        val = vb.alu("add", dtypes.float32, val, vb.cast(vb.arg(i, dt), dtypes.float32))
    k = Kernel([dtypes.float32] * nbufs, [], [], [(const(0), val)])
    return KernelStep(dev, name, src, tuple(range(nbufs)), 1, k, launch=Launch(grid, group))

def compile(dev, *steps):
    asyncio.run(dev.compile(list(steps)))

def upload(dev, arr):
    buf = dev.alloc(arr.nbytes)
    dev.write(buf, np.ascontiguousarray(arr).view(np.uint8))
    return buf

def download(buf, dtype, n):
    out = np.empty(n, dtype)
    buf.device.timeline.wait_sync(buf.ready)
    buf.device.read_into(buf, out.view(np.uint8))
    return out

def shader(body, *types, local=64):
    """A compute shader on the device's interface: buffer j (of GLSL type types[j]) is `bj` (`bj[i]`), its address
    words 2j and 2j+1 of the words binding `w`, which holds the scalars after the addresses."""
    out = ["#version 450", "#extension GL_EXT_buffer_reference : require",
           "#extension GL_EXT_shader_explicit_arithmetic_types : require",
           "#extension GL_EXT_shader_8bit_storage : require", f"layout(local_size_x = {local}) in;",
           "layout(std430, set = 0, binding = 0) readonly buffer W { uint w[]; };"]
    for j, t in enumerate(types):
        out.append(f"layout(buffer_reference, std430) buffer R{j} {{ {t} v[]; }};")
        out.append(f"#define b{j} r{j}.v")
    args = " ".join(f"R{j} r{j} = R{j}(packUint2x32(uvec2(w[{2 * j}], w[{2 * j + 1}])));" for j in range(len(types)))
    return "\\n".join(out) + "\\n" + body.replace("void main() {", "void main() { " + args, 1)

def slow_c_write(buf, data, seconds=0.3):
    """A work item on c:0 that sleeps, then writes `data` at the host address `buf.ptr`; returns its value."""
    import ctypes
    def work():
        time.sleep(seconds)
        ctypes.memmove(buf.ptr, data.ctypes.data, data.nbytes)
    return cdev.submit(work, [], 1 << 30)
'''

SAXPY = '''void main() {
  uint i = gl_GlobalInvocationID.x;
  if (i < N) b0[i] = b1[i] * uintBitsToFloat(w[4]) + uintBitsToFloat(w[6]);
}
'''


def run(body: str, timeout: float = 120) -> str:
    out = run_script(PRELUDE + body, timeout=timeout)
    if out.startswith("SKIP"):
        pytest.skip(out.strip())
    return out


def test_an_elementwise_kernel_takes_two_float_scalars_through_the_words_binding() -> None:
    """a * s + t with s, t float32 scalars (words 4 and 6, after the two addresses), then a second kernel in the same
    command buffer reading the first one's output (the barrier between dispatches)."""
    run(f'''
SRC = shader({SAXPY!r}.replace("N", "1000u"), "float", "float")
n = 1000
s1 = step("saxpy_a", SRC, 2, (16, 1, 1), 64, (dtypes.float32, dtypes.float32))
compile(vk0, s1)
pack = scalar_packer([dtypes.float32, dtypes.float32], (0, 1))
a = np.linspace(-3, 3, n, dtype=np.float32)
inp, mid, out = upload(vk0, a), vk0.alloc(4 * n), vk0.alloc(4 * n)
v = vk0.launch_many([(s1, [mid, inp], pack([2.5, -1.0])), (s1, [out, mid], pack([-0.5, 4.0]))], [])
out.ready = mid.ready = v
# (a driver may fuse a * s + t into one fma: one rounding fewer than numpy's)
np.testing.assert_allclose(download(mid, np.float32, n), a * 2.5 - 1.0, rtol=1e-6, atol=1e-6)
np.testing.assert_allclose(download(out, np.float32, n), (a * 2.5 - 1.0) * -0.5 + 4.0, rtol=1e-6, atol=1e-6)
v = vk0.launch(s1, [out, inp], [], pack([0.0, 7.0]))  # (new words, a recycled command buffer)
out.ready = v
np.testing.assert_allclose(download(out, np.float32, n), np.full(n, 7.0, np.float32))
''')


def test_int64_and_int8_kernels_where_the_device_has_the_types() -> None:
    out = run('''
SRC64 = shader("""
void main() { uint i = gl_GlobalInvocationID.x; if (i < 100u) b0[i] = b1[i] * 3l + (1l << 40); }
""", "int64_t", "int64_t", local=32)
SRC8 = shader("""
void main() { uint i = gl_GlobalInvocationID.x; if (i < 100u) b0[i] = int8_t(b1[i] * int8_t(3) + int8_t(1)); }
""", "int8_t", "int8_t", local=32)
done = []
if vk0.features["shaderInt64"]:
    s = step("i64", SRC64, 2, (4, 1, 1), 32)
    compile(vk0, s)
    a = np.arange(-50, 50, dtype=np.int64) * (1 << 33)
    out = vk0.alloc(a.nbytes)
    out.ready = vk0.launch(s, [out, upload(vk0, a)], [])
    np.testing.assert_array_equal(download(out, np.int64, 100), a * 3 + (1 << 40))
    done.append("int64")
if vk0.features["storageBuffer8BitAccess"] and vk0.features["shaderInt8"]:
    s = step("i8", SRC8, 2, (4, 1, 1), 32)
    compile(vk0, s)
    a = np.arange(-50, 50, dtype=np.int8)
    out = vk0.alloc(a.nbytes)
    out.ready = vk0.launch(s, [out, upload(vk0, a)], [])
    np.testing.assert_array_equal(download(out, np.int8, 100), (a.astype(np.int32) * 3 + 1).astype(np.int8))
    done.append("int8")
print("done", *done)
''')
    if "int64" not in out or "int8" not in out:
        pytest.skip(f"the device lacks a type: {out.strip()}")


def test_a_2d_dispatch_runs_more_groups_than_one_dimension_takes() -> None:
    """70000 groups (over maxComputeWorkGroupCount's 65535 on lavapipe) as a 35000 x 2 grid; a grid over the limit in
    one dimension is refused."""
    run('''
SRC = shader("""void main() {
  uint g = gl_WorkGroupID.y * gl_NumWorkGroups.x + gl_WorkGroupID.x;
  uint i = g * 64u + gl_LocalInvocationID.x;
  b0[i] = float(i) * 0.5;
}
""", "float")
n = 70000 * 64
s = step("grid2d", SRC, 1, (35000, 2, 1), 64)
compile(vk0, s)
out = vk0.alloc(4 * n)
out.ready = vk0.launch(s, [out], [])
np.testing.assert_array_equal(download(out, np.float32, n), np.arange(n, dtype=np.float32) * 0.5)
big = step("grid2d", SRC, 1, (vk0.max_groups[0] + 1, 1, 1), 64)
try:
    vk0.launch(big, [out], [])
except AssertionError as e:
    assert "maxComputeWorkGroupCount" in str(e), e
else:
    raise SystemExit("a grid over the limit was launched")
''')


def test_transfers_through_the_executor_between_vulkan_c_and_opencl() -> None:
    """c:0 -> vulkan:0 -> vulkan:0 (a copy command) -> vulkan:1 (peer: one VkDevice) -> c:0, small (staged at once)
    and 20 MiB (host copies on worker threads); vulkan <-> opencl through the destination's staging when present."""
    run('''
ex = RT.executor
vk1 = RT.device("vulkan:1")
for n in (1000, 5 << 20):
    a = np.random.default_rng(n).standard_normal(n).astype(np.float32)
    c_in = cdev.alloc(a.nbytes); cdev.write(c_in, a.view(np.uint8))
    chain = [c_in, vk0.alloc(a.nbytes), vk0.alloc(a.nbytes), vk1.alloc(a.nbytes), cdev.alloc(a.nbytes)]
    for src, dst in zip(chain, chain[1:]):
        ex.execute_transfer(src, dst)
    assert ex.sync_strategy("vulkan:0", "vulkan:1").value == "peer-to-peer"
    np.testing.assert_array_equal(download(chain[-1], np.float32, n), a)
    np.testing.assert_array_equal(download(chain[3], np.float32, n), a)
    if "opencl:0" in ex.devices:
        cl = RT.device("opencl:0")
        there, back = cl.alloc(a.nbytes), vk0.alloc(a.nbytes)
        ex.execute_transfer(chain[2], there)
        ex.execute_transfer(there, back)
        np.testing.assert_array_equal(download(back, np.float32, n), a)
        print("opencl", n)
''')


def test_work_waits_on_a_c_device_and_vulkan_devices_wait_on_each_other() -> None:
    """A kernel on vulkan:0 that waits for a C work item (a host-opened gate) still writing its input, a copy from
    it that vulkan:1 waits for (vulkan:0's timeline semaphore), and a transfer from a C buffer not ready yet."""
    run(f'''
SRC = shader({SAXPY!r}.replace("N", "4096u"), "float", "float")
vk1 = RT.device("vulkan:1")
s = step("saxpy_w", SRC, 2, (64, 1, 1), 64, (dtypes.float32, dtypes.float32))
compile(vk0, s)
n = 4096
a = np.arange(n, dtype=np.float32)
inp, out = vk0.alloc(4 * n), vk0.alloc(4 * n)
if vk0.mapped:  # C writes the kernel's input into the mapped memory
    vc = slow_c_write(inp, a)
else:  # device-local: C writes a buffer of its own, the kernel's input is written by a copy command before the kernel
    vk0.write(inp, a.view(np.uint8))
    vc = slow_c_write(cdev.alloc(4 * n), a)
v = vk0.launch(s, [out, inp], [(cdev, vc)], scalar_packer([dtypes.float32, dtypes.float32], (0, 1))([2.0, 1.0]))
out.ready = v
assert not vk0.poll(v), "the kernel ran before the C work it waits for"
there = vk1.alloc(4 * n)
RT.executor.execute_transfer(out, there)  # vulkan:1 waits on vulkan:0's semaphore
np.testing.assert_array_equal(download(there, np.float32, n), a * 2 + 1)
assert cdev.timeline.value >= vc

c_buf = cdev.alloc(4 * n)
c_buf.ready = slow_c_write(c_buf, a * 3)
dst = vk0.alloc(4 * n)
RT.executor.execute_transfer(c_buf, dst)  # copy_from_host after the C work: its host copy on a worker thread
np.testing.assert_array_equal(download(dst, np.float32, n), a * 3)
''')


def test_cancelled_waits_and_close_leave_no_memory_and_no_vulkan_objects() -> None:
    """Work dropped by its caller (a cancelled realize: nobody waits for it, its buffers are let go while it still
    waits for a C work item) gives its buffers back once done; close waits for the queue, destroys what the device
    made, and a buffer still out at close is destroyed when it goes (then the VkDevice goes too)."""
    run(f'''
from azyx.backends import vulkan as vkmod
SRC = shader({SAXPY!r}.replace("N", "1024u"), "float", "float")
s = step("saxpy_c", SRC, 2, (16, 1, 1), 64, (dtypes.float32, dtypes.float32))
compile(vk0, s)
words = scalar_packer([dtypes.float32, dtypes.float32], (0, 1))([1.0, 0.0])

async def cancelled():
    inp, out = vk0.alloc(4096), vk0.alloc(4096)
    vc = slow_c_write(cdev.alloc(4096), np.ones(1024, np.float32), 0.5)  # (a C work item the kernel waits for)
    v = vk0.launch(s, [out, inp], [(cdev, vc)], words)
    del inp, out
    task = asyncio.ensure_future(vk0.timeline.wait(v))
    await asyncio.sleep(0.05)
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass
    assert vk0.memory().in_use > 0
    await RT.executor.synchronize_all()
    return v

v = asyncio.run(cancelled())
assert vk0.timeline.value >= v and not vk0.failures
assert vk0.memory().in_use == 0, vk0.memory()
kept = vk0.alloc(4096)
assert vkmod._CONTEXTS
RT.shutdown()
assert vk0.queue.closed and vk0.mem.live > 0, vk0.mem.live  # (the kept buffer)
del kept
assert vk0.mem.live == 0 and not vkmod._CONTEXTS, (vk0.mem.live, vkmod._CONTEXTS)
print("ok")
''')


def test_a_glsl_error_raises_compile_error_naming_the_device_and_the_kernel() -> None:
    run('''
from azyx.errors import CompileError
bad = step("broken_kernel", "#version 450\\nlayout(local_size_x = 1) in;\\nvoid main() { undefined_thing = 1; }\\n",
           1, (1, 1, 1), 1)
try:
    compile(vk0, bad)
except CompileError as e:
    msg = str(e)
    assert "vulkan:0" in msg and "broken_kernel" in msg and "undefined_thing" in msg, msg
else:
    raise SystemExit("no CompileError")
assert not vk0.has_program("broken_kernel")
''')


RENDERED = PRELUDE + """
from azyx import Tensor
rng = np.random.default_rng(0)
a, b = rng.standard_normal((64, 48)).astype(np.float32), rng.standard_normal((48, 32)).astype(np.float32)
x, y = Tensor(a, device="vulkan:0"), Tensor(b, device="vulkan:0")
np.testing.assert_allclose(((x * 1.5 - 0.25).relu() + x.exp() * 0.5).numpy_sync(),
                           np.maximum(a * 1.5 - 0.25, 0) + np.exp(a) * 0.5, rtol=1e-5, atol=1e-6)
np.testing.assert_allclose((x @ y).numpy_sync(), a @ b, rtol=1e-4, atol=1e-4)
np.testing.assert_allclose(x.sum(axis=1).numpy_sync(), a.sum(axis=1), rtol=1e-5, atol=1e-5)
np.testing.assert_allclose(x.softmax(axis=-1).numpy_sync(), np.exp(a) / np.exp(a).sum(-1, keepdims=True), rtol=1e-5)
np.testing.assert_array_equal((x.T[::2] > 0).numpy_sync(), a.T[::2] > 0)
i = Tensor(np.arange(-50, 50, dtype=np.int32), device="vulkan:0")
np.testing.assert_array_equal(((i * 3) // 7 % 5).numpy_sync(), (np.arange(-50, 50) * 3) // 7 % 5)
import math
d = rng.uniform(-3, 3, 256)
xd = Tensor(d, device="vulkan:0")
erf = np.vectorize(math.erf)
for got, want in [(xd.exp(), np.exp(d)), (xd.abs().log(), np.log(np.abs(d))), (xd.sin(), np.sin(d)),
                  (xd.cos(), np.cos(d)), ((xd * 0.4).tan(), np.tan(d * 0.4)), (xd.tanh(), np.tanh(d)),
                  (xd.exp2(), np.exp2(d)), (xd.abs().log2(), np.log2(np.abs(d))),
                  (xd.softplus(), np.maximum(d, 0) + np.log1p(np.exp(-np.abs(d)))), (xd.erf(), erf(d)),
                  (xd.abs() ** 1.7, np.abs(d) ** 1.7), ((xd * 100).sin(), np.sin(d * 100))]:
    np.testing.assert_allclose(got.numpy_sync(), want, rtol=1e-12, atol=1e-14)
n = 40  # more buffers than lavapipe lets a shader bind (32): read by address, one kernel reads them all
many = [Tensor(np.full(8, k, np.float32), device="vulkan:0") for k in range(n)]
total = many[0]
for t in many[1:]:
    total = total + t * 1.0
plan = azyx.schedule(total)
assert vk0.max_buffers == 0 and len(plan.kernels) == 1 and len(plan.kernels[0].args) == n + 1
np.testing.assert_array_equal(total.numpy_sync(), np.full(8, n * (n - 1) / 2, np.float32))
a_big = np.arange(48 << 20, dtype=np.float32)  # 192 MiB: past one binding's 128 MiB
big = Tensor(a_big, device="vulkan:0")
np.testing.assert_array_equal((big * 2 + 1).numpy_sync(), a_big * 2 + 1)
assert big.max().numpy_sync() == a_big.max() and big[-3:].numpy_sync().tolist() == a_big[-3:].tolist()
print("OK")
"""


def test_rendered_glsl_kernels_run_and_match_numpy_past_the_binding_limits() -> None:
    """The GLSL dialect's kernels run on the device (elementwise with scalars, a product, reductions, views, integer
    division and modulo, float64 exp/log/sin/... which GLSL has for float only, computed by the prelude): numpy's
    values. Buffers are read by address: one kernel sums more tensors than a shader may bind storage buffers
    (maxPerStageDescriptorStorageBuffers), and a buffer past one binding's range (maxStorageBufferRange) is read
    and written whole."""
    out = run_script(RENDERED)
    if out.strip().startswith("SKIP"):
        pytest.skip(out.strip())
    assert out.strip().endswith("OK"), out


GPU_DIALECT = '''
import dataclasses
from azyx.codegen.dialect import glsl_dialect as dialect_for
from azyx import Tensor
ctx = vk0.ctx
# the dialect a GPU gets (tiled products, subgroup shuffles), on this device whatever it is (lavapipe: 8 lanes)
warp = ctx.subgroup or 0
if warp < 4:
    print("SKIP: the device's subgroups do not shuffle")
    raise SystemExit(0)
vk0.dialect, vk0.tiles = dialect_for(tuple(ctx.preserve_nan), True, warp), False
RT.plan_cache.clear()
rng = np.random.default_rng(7)

async def check():
    for m, k, n in [(128, 64, 128), (100, 37, 70), (3, 5, 7), (130, 257, 66)]:
        a, b = rng.standard_normal((m, k), dtype=np.float32), rng.standard_normal((k, n), dtype=np.float32)
        ta, tb = Tensor(a, device="vulkan:0"), Tensor(b, device="vulkan:0")
        tbt = Tensor(np.ascontiguousarray(b.T), device="vulkan:0").T  # B read along k (PyTorch's Linear layout)
        tat = Tensor(np.ascontiguousarray(a.T), device="vulkan:0").T  # A read along its rows
        (step,) = azyx.schedule(ta @ tbt).kernels
        assert "shared vec4 As" in step.src, step.src
        for got in (ta @ tb, ta @ tbt, tat @ tb):
            np.testing.assert_allclose(await got.numpy(), a @ b, rtol=1e-4, atol=1e-4)
    x, y = rng.standard_normal((3, 64, 32), dtype=np.float32), rng.standard_normal((3, 32, 48), dtype=np.float32)
    got = await (Tensor(x, device="vulkan:0") @ Tensor(y, device="vulkan:0")).numpy()
    np.testing.assert_allclose(got, x @ y, rtol=1e-4, atol=1e-4)
    # per-head products (two batch axes as one) and a Linear's product under its bias (a kernel of its own)
    q, kt = rng.standard_normal((2, 3, 40, 16), dtype=np.float32), rng.standard_normal((2, 3, 24, 16), dtype=np.float32)
    scores = Tensor(q, device="vulkan:0") @ Tensor(kt, device="vulkan:0").transpose(-1, -2)
    assert all("shared vec4 As" in s.src for s in azyx.schedule(scores).kernels)
    np.testing.assert_allclose(await scores.numpy(), q @ kt.transpose(0, 1, 3, 2), rtol=1e-4, atol=1e-4)
    h, w, bias = (rng.standard_normal(sh, dtype=np.float32) for sh in ((32, 96), (80, 96), (80,)))
    lin = (Tensor(h, device="vulkan:0") @ Tensor(w, device="vulkan:0").T + Tensor(bias, device="vulkan:0")).relu()
    assert any("shared vec4 As" in s.src for s in azyx.schedule(lin).kernels)
    np.testing.assert_allclose(await lin.numpy(), np.maximum(h @ w.T + bias, 0), rtol=1e-4, atol=1e-4)
    # reductions through subgroup shuffles: many rows (a subgroup per row), few long rows (a group per row)
    for shape in [(5000, 40), (3, 100000), (64, 4096)]:
        m = rng.standard_normal(shape, dtype=np.float32)
        t = Tensor(m, device="vulkan:0")
        assert any("subgroupShuffleXor" in s.src for s in azyx.schedule(t.sum(axis=1)).kernels)
        np.testing.assert_allclose(await t.sum(axis=1).numpy(), m.sum(axis=1), rtol=1e-4, atol=1e-3)
        np.testing.assert_array_equal(await t.max(axis=1).numpy(), m.max(axis=1))
        np.testing.assert_array_equal(await t.argmax(axis=1).numpy(), m.argmax(axis=1))
    iv = rng.integers(-1000, 1000, size=(700, 300)).astype(np.int32)
    np.testing.assert_array_equal(await Tensor(iv, device="vulkan:0").sum(axis=1).numpy(), iv.sum(axis=1))
    print("OK")

asyncio.run(check())
'''


def test_the_gpu_dialect_tiled_products_and_subgroup_shuffles_run_and_match_numpy() -> None:
    """The dialect a Vulkan GPU gets (matrix products in azyx.gemm's shared-memory tiled shader, reductions combined
    by subgroup shuffles), run on this device whatever it is (lavapipe in CI: 8-lane subgroups): numpy's values for
    products with either operand transposed, ragged sizes and a batch, and row reductions of every shape class."""
    out = run(GPU_DIALECT, timeout=300)
    assert out.strip().endswith("OK"), out
