"""Faults survived (issue 13): each fault is injected for real, never mocked: an allocator that refuses memory, a
compiler wrapper script that fails or hangs, a device that fails (`Device.fail`, or a trapping kernel on a GPU), a
file truncated or removed under a lazy tensor. Every test checks the error (its type and what its message names)
and then that the runtime still computes right (compared with numpy)."""

from __future__ import annotations

import asyncio
import gc
import os
import random
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import DEVICES

import azyx
from azyx import Tensor
from azyx.realize import submit
from azyx.runtime import RT

ROOT = Path(__file__).resolve().parent.parent


async def runtime_still_works(device: str) -> None:
    """A fresh realize on `device` computes the right values."""
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    got = await (Tensor(x, device=device) * 2 + 1).sum(axis=0).numpy()
    np.testing.assert_allclose(got, (x * 2 + 1).sum(axis=0))


def run_script(script: str, *args: str, timeout: float = 120) -> str:
    """Run `script` in a fresh interpreter (a device failure is for good: it must not outlive the test); returns its
    output and fails the test, showing it, unless it exits 0."""
    path = os.pathsep.join(p for p in (str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path}
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(script), *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=ROOT)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


# ------------------------------------------------------------------------------------------------ memory
def in_use(pool: Any) -> int:
    with pool.locked():  # (takes in frees queued by other threads)
        pass
    return int(pool.in_use)


async def refused_realize(pool: Any, outs: list[Tensor]) -> tuple[str, int]:
    """Realize `outs` while `pool` refuses its second new block (its raw allocation raises, as a driver out of memory
    does): the AllocationError's message and how many blocks were asked for."""
    create, calls = pool.create, []

    def refusing(size: int) -> Any:
        calls.append(size)
        if len(calls) == 2:
            raise MemoryError("injected: the device is out of memory")
        return create(size)

    pool.create = refusing
    try:
        with pytest.raises(azyx.AllocationError) as info:
            await azyx.realize(*outs)
    finally:
        pool.create = create
    return str(info.value), len(calls)


@pytest.mark.parametrize("device", DEVICES)
async def test_a_refused_allocation_raises_frees_what_the_run_took_and_the_next_realize_works(device: str) -> None:
    """The device's allocator refuses its second new block (its raw allocation raises, as a driver out of memory
    does): the realize raises AllocationError naming the device and the bytes, every block the run took is back in
    the pool when it raises, and the same realize then works."""
    pool = RT.device(device).allocator  # type: ignore[attr-defined]
    n = 3001  # (a size no other test's plan has)
    x = np.linspace(-1, 1, n, dtype=np.float32)
    src = Tensor(x, device="c:1")  # copied over first: the failing run has submitted that copy when it fails

    def graph() -> list[Tensor]:
        a = src.to(device)
        return [(a * 2).exp(), (a - 1).relu() * 3]

    plan = azyx.schedule(*graph())
    assert [type(s).__name__ for s in plan.steps] == ["TransferStep", "KernelStep"], plan.steps
    await azyx.realize(*graph())  # compiled and run once
    await azyx.synchronize()
    gc.collect()  # (an earlier test's garbage cycle, a caught error's frames, frees its blocks now, not mid-test)
    pool.take_cached()  # every block the run needs is now a new one, made by `create`
    before = in_use(pool)
    outs = graph()
    msg, calls = await refused_realize(pool, outs)  # the copy's block is made; the kernel's first output's is refused
    assert device in msg and f"{n * 4} bytes" in msg and "out of device memory" in msg, msg
    assert calls == 2
    assert in_use(pool) == before, "blocks the failed run took are still in use"
    got = [await o.numpy() for o in outs]  # the targets were not realized: they compute now
    np.testing.assert_allclose(got[0], np.exp(x * 2), rtol=1e-5)
    np.testing.assert_allclose(got[1], np.maximum(x - 1, 0) * 3, rtol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
async def test_a_step_whose_buffers_are_made_together_gives_all_back_when_one_is_refused(device: str) -> None:
    """A plan step of several kernels makes their outputs' buffers together (`Device.alloc_many`): when the device
    refuses the second new block, the realize raises AllocationError naming the device, no block of the step stays in
    use, and the same graph then computes numpy's values."""
    pool = RT.device(device).allocator  # type: ignore[attr-defined]
    n = 3003  # (a size no other test's plan has)
    x = np.linspace(-1, 1, n, dtype=np.float32)
    a = await Tensor(x, device=device).realize()

    def graph() -> list[Tensor]:
        return [(a * 3).exp(), (a + 2).sum(), (a - 1).relu().max()]

    assert len(azyx.schedule(*graph()).kernels) >= 2
    await azyx.realize(*graph())
    await azyx.synchronize()
    gc.collect()
    pool.take_cached()
    before = in_use(pool)
    outs = graph()
    msg, _ = await refused_realize(pool, outs)
    assert device in msg and "out of device memory" in msg, msg
    assert in_use(pool) == before, "blocks the failed step took are still in use"
    got = [await o.numpy() for o in outs]
    np.testing.assert_allclose(got[0], np.exp(x * 3), rtol=1e-5)
    np.testing.assert_allclose(got[1], (x.astype(np.float64) + 2).sum(), rtol=1e-5)
    np.testing.assert_allclose(got[2], np.maximum(x - 1, 0).max(), rtol=1e-6)


# ------------------------------------------------------------------------------------------------ compilers
_RANDOM = random.SystemRandom()


def new_graph(device: str, copies: int = 1) -> tuple[list[Tensor], np.ndarray]:
    """`copies` graphs of one structure (so one kernel) that `device` has not compiled, in this process or in an
    on-disk compile cache of earlier runs and other test processes: a random chain of 24 sqrt-or-add-one steps."""
    steps = [_RANDOM.random() < 0.5 for _ in range(24)]
    x = np.linspace(0, 1, 1000, dtype=np.float32).reshape(1, 1000)

    def chain(y: Any) -> Any:
        for root in steps:
            y = (y.sqrt() if isinstance(y, Tensor) else np.sqrt(y)) if root else y + 1
        return y

    ys = [chain(Tensor(x, device=device) * 3 + 1) for _ in range(copies)]
    dev = RT.device(device)
    assert not any(dev.has_program(k.name) for k in azyx.schedule(ys[0]).kernels)
    return ys, chain(x * 3 + 1)


def wrapper(tmp_path: Path, name: str, body: str) -> str:
    """An executable compiler wrapper script; each compile (a run with an output file, `-o`) appends a line to its log
    (`<script>.log`); a probe of what the compiler targets (`-dM -E`, as the C device makes one) is no compile."""
    path = tmp_path / name
    path.write_text(f"#!/bin/sh\ncase \" $* \" in *' -o '*) echo run >> '{path}.log';; esac\n{body}\n")
    path.chmod(0o755)
    return str(path)


def runs_of(script: str) -> int:
    log = Path(script + ".log")
    return len(log.read_text().splitlines()) if log.exists() else 0


@pytest.fixture
async def c_device() -> Any:
    """c:0 with its compiler settings restored after the test. Something has been compiled on it first: the C runtime
    is built once, by a process's first compile, so a compiler the test swaps in compiles kernels alone."""
    dev = RT.device("c:0")
    saved = dev.compiler, dev.compile_timeout_s  # type: ignore[attr-defined]
    await (Tensor(np.ones(3, np.float32), device="c:0") * 2).realize()
    yield dev
    dev.compiler, dev.compile_timeout_s = saved  # type: ignore[attr-defined]


async def test_a_failing_compiler_raises_compile_error_and_the_failure_is_not_cached(tmp_path: Path,
                                                                                       c_device: Any) -> None:
    """The C compiler (config key `compiler`) is a wrapper that fails its first run and runs gcc after that: the
    first realize raises CompileError with the compiler's stderr; the same realize then compiles and works (nothing
    of the failed compile was kept, in memory or in the on-disk cache, which the wrapper's path is part of)."""
    cc = wrapper(tmp_path, "cc-fails-once", f"""
if [ -e '{tmp_path}/failed' ]; then exec gcc "$@"; fi
touch '{tmp_path}/failed'
echo "injected: the compiler broke" >&2
exit 1""")
    c_device.compiler = cc
    (y,), want = new_graph("c:0")
    names = [k.name for k in azyx.schedule(y).kernels]
    with pytest.raises(azyx.CompileError) as info:
        await y.realize()
    msg = str(info.value)
    assert "c:0" in msg and "injected: the compiler broke" in msg and "exit 1" in msg and names[0] in msg, msg
    assert not c_device.has_program(names[0])
    np.testing.assert_allclose(await y.numpy(), want, rtol=1e-6)  # the same compiler works now
    assert runs_of(cc) == 2


async def ticks_while(task: asyncio.Future[Any]) -> float:
    """The longest the event loop went without running this coroutine while `task` ran (a loop-latency probe)."""
    loop = asyncio.get_running_loop()
    longest, last = 0.0, loop.time()
    while not task.done():
        await asyncio.sleep(0.01)
        now = loop.time()
        longest, last = max(longest, now - last), now
    return longest


@pytest.mark.parametrize("device", DEVICES)
async def test_a_compile_past_compile_timeout_s_raises_for_every_waiter(tmp_path: Path, device: str,
                                                                        c_device: Any) -> None:
    """A compile that runs past `compile_timeout_s`: on a C device the compiler is a wrapper that hangs (and has a
    child of its own: the whole process group is killed); on others (an in-process compiler that cannot be killed)
    the limit is 1 ms (a wgpu build, too fast for that, hangs). Two realizes that need the same kernels both get the
    CompileError, naming the device, a kernel and the limit, from one compile; the loop runs on meanwhile; then the
    compile works."""
    dev = RT.device(device)
    saved = dev.compile_timeout_s
    ys, want = new_graph(device, copies=2)
    name = azyx.schedule(ys[0]).kernels[0].name
    cc = None
    release = threading.Event()
    limit = 0.001
    if dev.kind == "c":
        cc = wrapper(tmp_path, "cc-hangs", f"sleep 600 & echo $! > '{tmp_path}/child'\nwait")
        dev.compiler, limit = cc, 1.0  # type: ignore[attr-defined]
    elif dev.kind == "wgpu":  # its in-process build takes ~1.5 ms, often done before the loop looks: one that hangs
        real_build = dev.build

        def hanging(*args: Any) -> Any:
            release.wait(60)
            return real_build(*args)

        dev.build = hanging  # type: ignore[method-assign]
    dev.compile_timeout_s = limit
    try:
        both = asyncio.gather(*[y.realize() for y in ys], return_exceptions=True)
        longest = await ticks_while(both)
        errors = await asyncio.wait_for(both, 60)  # (bounded: a compiler left running must not hang the suite)
    finally:
        dev.compile_timeout_s = saved
        if dev.kind == "wgpu":
            dev.build = real_build  # type: ignore[method-assign]
        release.set()
    for err in errors:
        assert isinstance(err, azyx.CompileError), repr(err)
        msg = str(err)
        assert device in msg and name in msg and f"compile_timeout_s={limit:g} s" in msg, msg
    assert longest < 0.5, f"the event loop stalled for {longest:.3f} s while compiling"
    if cc is not None:
        assert runs_of(cc) == 1  # one compile, two waiters
        child = int((tmp_path / "child").read_text())
        stat = Path(f"/proc/{child}/stat")
        assert not stat.exists() or stat.read_text().split(") ")[1].startswith("Z"), "the compiler's child survived"
        dev.compiler = "gcc"  # type: ignore[attr-defined]
    for y in ys:
        np.testing.assert_allclose(await y.numpy(), want, rtol=1e-6)


CONFIG_SCRIPT = """
import asyncio, sys
import numpy as np
import azyx
from azyx.runtime import RT

azyx.configure({"c": {"compiler": sys.argv[1], "compile_timeout_s": 2.5}})
assert RT.device("c:0").compile_timeout_s == 2.5 and RT.device("c:0").compiler == sys.argv[1]
try:
    (azyx.Tensor(np.ones(3, np.float32), device="c:0") + 1).numpy_sync()
    raise AssertionError("no error")
except azyx.CompileError as e:
    assert "c:0" in str(e) and "injected" in str(e), str(e)
print("OK")
"""


def test_the_compiler_and_its_time_limit_come_from_the_config(tmp_path: Path) -> None:
    cc = wrapper(tmp_path, "cc-fails", "echo injected >&2\nexit 1")
    assert run_script(CONFIG_SCRIPT, cc).strip().endswith("OK")
    assert runs_of(cc) == 1


# ------------------------------------------------------------------------------------------------ files
async def save(path: Path, **arrays: np.ndarray) -> None:
    await azyx.io.save_safetensors(path, {name: Tensor(a) for name, a in arrays.items()})


@pytest.mark.parametrize("device", DEVICES)
async def test_a_file_truncated_under_a_lazy_tensor_raises_naming_tensor_and_file(tmp_path: Path,
                                                                                    device: str) -> None:
    p = tmp_path / "w.safetensors"
    w_np = np.arange(4096, dtype=np.float32)
    await save(p, w=w_np)
    w = Tensor.from_safetensors(p, "w")  # opened lazily: the header is read, no data
    os.truncate(p, os.path.getsize(p) - 1000)  # the file shrinks before the realize
    y = w.to(device) * 2
    with pytest.raises(azyx.AzyxIOError) as info:
        await y.realize()
    msg = str(info.value)
    assert "tensor 'w'" in msg and str(p) in msg and "truncated" in msg, msg
    # no partial result: the tensor whose work failed raises again, and so does anything computed from it
    with pytest.raises(azyx.AzyxIOError, match="tensor 'w'"):
        await y.numpy()
    with pytest.raises(azyx.AzyxIOError, match="tensor 'w'"):
        await (y + 1).numpy()
    with pytest.raises(azyx.AzyxIOError, match="tensor 'w'"):
        await w.numpy()  # read straight from the file
    await runtime_still_works(device)
    q = tmp_path / "ok.safetensors"  # a file that stays whole still loads
    await save(q, w=w_np)
    np.testing.assert_array_equal(await (Tensor.from_safetensors(q, "w").to(device) * 2).numpy(), w_np * 2)


async def test_a_file_removed_or_replaced_before_it_is_opened_raises_cannot_open(tmp_path: Path) -> None:
    p = tmp_path / "gone.safetensors"
    await save(p, w=np.ones(8, np.float32))
    os.remove(p)
    for opener in (lambda: Tensor.from_safetensors(p, "w"), lambda: azyx.io.load_safetensors(p)):
        with pytest.raises(azyx.AzyxIOError, match="cannot open") as info:
            opener()
        assert str(p) in str(info.value)
    p.write_bytes(b"\x05\x00")  # replaced by something that is no safetensors file
    with pytest.raises(azyx.AzyxIOError) as info:
        Tensor.from_safetensors(p, "w")
    assert str(p) in str(info.value)
    await runtime_still_works(DEVICES[0])


async def test_a_file_deleted_after_it_was_opened_still_reads(tmp_path: Path) -> None:
    """On Linux an open descriptor keeps a deleted file's data: a lazy tensor opened before the delete still reads it
    (the documented behaviour, not a fault)."""
    p = tmp_path / "kept.safetensors"
    w_np = np.arange(64, dtype=np.float32)
    await save(p, w=w_np)
    w = Tensor.from_safetensors(p, "w")
    os.remove(p)
    np.testing.assert_array_equal(await (w.to(DEVICES[0]) + 1).numpy(), w_np + 1)


# ------------------------------------------------------------------------------------------------ per-run failures
@pytest.mark.parametrize("device", DEVICES)
async def test_a_failure_is_raised_to_the_realizes_that_depend_on_it_only(tmp_path: Path, device: str) -> None:
    """A work item that fails (a file read) fails its own run and the runs that read its results, not unrelated
    realizes on the same device, even when nobody waited for the failed run."""
    p = tmp_path / "t.safetensors"
    await save(p, w=np.ones(2048, np.float32))
    x = np.arange(10, dtype=np.float32)
    good = Tensor(x, device=device)
    await (good * 3).numpy()  # (compiled beforehand, so the runs below only submit)
    bad = Tensor.from_safetensors(p, "w").to(device) + 1
    os.truncate(p, 100)
    await submit([bad])  # submitted; nobody waits for it yet
    await azyx.synchronize()  # the failed read has run
    np.testing.assert_array_equal(await (good * 3).numpy(), x * 3)  # unrelated: not its failure
    with pytest.raises(azyx.AzyxIOError, match="tensor 'w'"):
        await bad.realize()
    with pytest.raises(azyx.AzyxIOError, match="tensor 'w'"):
        await (bad.sum() + good).numpy()  # reads the failed result
    # concurrent realizes on one device: each gets its own outcome
    results = await asyncio.gather((bad * 2).numpy(), (good - 1).numpy(), return_exceptions=True)
    assert isinstance(results[0], azyx.AzyxIOError), results[0]
    np.testing.assert_array_equal(results[1], x - 1)
    await runtime_still_works(device)


# ------------------------------------------------------------------------------------------------ failed devices
FAIL_SCRIPT = """
import asyncio, sys, threading
import numpy as np
import azyx
from azyx import Tensor
from azyx.realize import submit
from azyx.runtime import RT
from azyx.runtime import RT

azyx.configure({"c": {"devices": 2}})
name = sys.argv[1]

async def main():
    dev, other = RT.device(name), RT.device("c:1")
    x = np.arange(6, dtype=np.float32)
    assert ((await (Tensor(x, device=name) + 1).numpy()) == x + 1).all()
    # work in flight on the device when it fails: it waits (on the device side) for c:1, which a gated work item holds
    gate = threading.Event()
    other.submit(gate.wait, [], 1 << 40)
    try:
        await fail_in_flight(dev, Tensor(x, device="c:1").exp().to(name) * 3, x)
    finally:
        gate.set()
    # the other devices keep working, AUTO placement included
    assert ((await (Tensor(x, device="c:1") * 5).numpy()) == x * 5).all()
    assert ((await (Tensor(x) - 2).numpy()) == x - 2).all()
    print("OK")

async def fail_in_flight(dev, y, x):
    await submit([y])
    waiting = asyncio.ensure_future(y.realize())
    await asyncio.sleep(0)  # (one turn of the loop: the task now waits on the device's timeline)
    caught = []
    thread = threading.Thread(target=lambda: caught.append(_catch(dev.timeline.wait_sync, dev.queued())))
    thread.start()
    assert not waiting.done()
    dev.fail(RuntimeError("injected fault"))
    for err in (await asyncio.gather(waiting, return_exceptions=True))[0], _join(thread, caught):
        assert isinstance(err, azyx.DeviceFailedError), repr(err)
        assert dev.name in str(err) and "injected fault" in str(err), str(err)
    try:  # new work for the failed device is refused at once
        await (Tensor(x, device=dev.name) * 2).numpy()
        raise AssertionError("no error")
    except azyx.DeviceFailedError as e:
        assert dev.name in str(e) and "injected fault" in str(e), str(e)
    assert dev.name not in azyx.devices()

def _catch(fn, *args):
    try:
        fn(*args)
    except BaseException as e:
        return e
    return None

def _join(thread, caught):
    thread.join(30)
    assert not thread.is_alive(), "a worker wait hangs on a failed device"
    return caught[0]

asyncio.run(main())
"""


@pytest.mark.parametrize("device", DEVICES)
def test_a_failed_device_fails_its_waiters_and_the_others_keep_working(device: str) -> None:
    if device == "c:1":
        pytest.skip("c:1 is the device that stays up")
    assert run_script(FAIL_SCRIPT, device).strip().endswith("OK")


CUDA_TRAP_SCRIPT = """
import asyncio
import numpy as np
import azyx
from azyx import Tensor
from azyx.backends.cuda_driver import check, cu, nvrtc_compile
from azyx.runtime import RT

async def main():
    dev = RT.device("cuda:0")
    x = np.arange(8, dtype=np.float32)
    assert ((await (Tensor(x, device="cuda:0") + 1).numpy()) == x + 1).all()
    # a kernel that faults (a trap; an out-of-bounds store behaves alike), on the device's own stream
    cubin = nvrtc_compile('extern "C" __global__ void azyx_trap(int* p) { p[1 << 30] = 1; __trap(); }', dev.arch)
    dev.use()
    fn = check(cu.cuModuleGetFunction(check(cu.cuModuleLoadData(cubin), "load"), b"azyx_trap"), "function")
    arg = np.array([0], np.uint64)
    params = np.array([arg.ctypes.data], np.uint64)
    dev._submit(lambda: check(cu.cuLaunchKernel(fn, 1, 1, 1, 1, 1, 1, 0, dev.stream, params.ctypes.data, 0), "trap"),
                [], (arg, params))
    try:  # work queued behind it, and its waiter
        await (Tensor(x, device="cuda:0") * 2).numpy()
        raise AssertionError("no error")
    except azyx.DeviceFailedError as e:
        assert "cuda:0" in str(e) and "CUDA_ERROR" in str(e), str(e)
    try:
        await (Tensor(x, device="cuda:0") * 3).numpy()
        raise AssertionError("no error")
    except azyx.DeviceFailedError as e:
        assert "cuda:0" in str(e), str(e)
    assert "cuda:0" not in azyx.devices()
    assert ((await (Tensor(x, device="c:0") * 5).numpy()) == x * 5).all()  # another device works on
    print("OK")

asyncio.run(main())
"""


@pytest.mark.skipif("cuda:0" not in azyx.devices(), reason="no CUDA device")
def test_a_kernel_that_faults_on_the_gpu_fails_its_device_only() -> None:
    """A trapping kernel on cuda:0 (in a fresh interpreter: a faulted CUDA context stays unusable): the realize
    queued behind it raises DeviceFailedError naming the device and the CUDA error, later work for cuda:0 is
    refused, and c:0 computes on."""
    assert run_script(CUDA_TRAP_SCRIPT).strip().endswith("OK")
