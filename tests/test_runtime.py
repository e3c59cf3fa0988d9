"""Runtime surface: configuration file, AZYX_DEBUG stages, plot_graph, the gradient-tape hook, devices."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import azyx
from azyx import Tensor
from azyx.graph import GRAPH, Op

SCRIPT = """
import numpy as np, azyx
from azyx import Tensor
print("DEVICES", azyx.devices())
x = Tensor(np.arange(12, dtype=np.float32).reshape(3, 4), device="c:0")
y = ((x * 2).sum(axis=1) + 1).to(azyx.devices()[-1])
print("RESULT", y.numpy_sync().tolist())
"""


def _run(env_extra: dict[str, str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AZYX_")}
    env.update(env_extra)
    env.setdefault("XDG_CONFIG_HOME", str(tmp_path / "noconfig"))
    return subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=120,
                          check=True)


def test_config_file_from_azyx_config(tmp_path: Path) -> None:
    cfg = tmp_path / "azyx.json"
    cfg.write_text(json.dumps({"c": {"devices": 3, "threads": 1}, "opencl": {"enabled": False},
                                      "cuda": {"enabled": False}, "vulkan": {"enabled": False},
                                      "wgpu": {"enabled": False}}))
    out = _run({"AZYX_CONFIG": str(cfg)}, tmp_path)
    assert "DEVICES ['c:0', 'c:1', 'c:2']" in out.stdout
    assert "RESULT [13.0, 45.0, 77.0]" in out.stdout


def test_config_file_from_xdg_config_home(tmp_path: Path) -> None:
    (tmp_path / "xdg" / "azyx").mkdir(parents=True)
    (tmp_path / "xdg" / "azyx" / "config.json").write_text(json.dumps({"c": {"devices": 2},
                                                                        "opencl": {"enabled": False},
                                                                        "cuda": {"enabled": False},
                                                                        "vulkan": {"enabled": False},
                                                                        "wgpu": {"enabled": False}}))
    out = _run({"XDG_CONFIG_HOME": str(tmp_path / "xdg")}, tmp_path)
    assert "DEVICES ['c:0', 'c:1']" in out.stdout
    out = _run({}, tmp_path)  # no file: defaults, one C device (and whatever OpenCL and Vulkan devices there are)
    listed = out.stdout.split("DEVICES ")[1].splitlines()[0]
    assert "'c:0'" in listed and "'c:1'" not in listed and "RESULT [13.0, 45.0, 77.0]" in out.stdout


def test_debug_bitmask_prints_each_stage(tmp_path: Path) -> None:
    cfg = tmp_path / "azyx.json"
    cfg.write_text(json.dumps({"c": {"devices": 2}}))
    env = {"AZYX_CONFIG": str(cfg), "XDG_CACHE_HOME": str(tmp_path / "cache")}  # a cold cache: it compiles
    err = _run({**env, "AZYX_DEBUG": str(1 | 2 | 4 | 8 | 16)}, tmp_path).stderr
    assert "device c:0" in err and "device c:1" in err  # 1: devices
    assert "ExecutionPlan:" in err and "transfer slot" in err  # 2: plans
    assert "work=" in err and " us" in err  # 4: launches with timings
    assert "reduce float32 sum over" in err  # 8: IR
    assert "void k_" in err  # 16: generated source
    quiet = _run({**env, "AZYX_DEBUG": "0"}, tmp_path).stderr
    assert "azyx:" not in quiet


def test_configure_validates_and_refuses_once_tensors_exist() -> None:
    with pytest.raises(azyx.AzyxError, match="section 'c'"):
        azyx.configure({"c": 3})
    t = Tensor([1.0])
    with pytest.raises(azyx.RuntimeStateError, match="live nodes"):
        azyx.configure({"c": {"devices": 1}})
    np.testing.assert_allclose((t + 1).numpy_sync(), [2.0])


def test_plot_graph_writes_dot(tmp_path: Path) -> None:
    a = Tensor(np.ones((2, 3), np.float32))
    b = (a * 2).sum(axis=0)
    path = azyx.plot_graph(b, tmp_path / "g.dot")
    text = path.read_text()
    assert text.startswith("digraph azyx") and "REDUCE" in text and "BINARY" in text and "LEAF" in text
    assert text.count("->") >= 3
    np.testing.assert_allclose(b.numpy_sync(), [4.0, 4.0, 4.0])


def test_a_live_tape_keeps_how_realized_nodes_were_made() -> None:
    x = Tensor(np.arange(4, dtype=np.float32))
    with azyx.GradientTape() as tape:
        y = x * 2 + 1
    y.realize_sync()
    n = GRAPH[y.id]
    assert y.id in tape.ids and n.op is Op.BINARY and n.src and n.buffer is not None
    z = x * 3 + 1  # no tape: realized nodes forget their sources, so the graph stays small
    before = len(GRAPH)
    z.realize_sync()
    assert GRAPH[z.id].op is Op.LEAF and len(GRAPH) < before
    np.testing.assert_allclose(y.numpy_sync(), np.arange(4) * 2 + 1)


def test_devices_and_unknown_device() -> None:
    assert "c:0" in azyx.devices() and "c:1" in azyx.devices() and "dummy:0" not in azyx.devices()
    with pytest.raises(azyx.DeviceError, match="'gpu:7'"):
        Tensor([1.0], device="gpu:7")
    with pytest.raises(azyx.DeviceError, match="'c:9'"):
        Tensor([1.0]).to("c:9")
    assert Tensor([1.0], device="c").device == "c:0"


async def test_a_cached_realize_leaves_no_garbage_cycles() -> None:
    # a training step realizes every iteration: garbage cycles would make the cyclic GC run about once per step
    import gc

    w = Tensor(np.ones((16, 8), np.float32))
    x = Tensor(np.ones((4, 16), np.float32))
    # the first realize plans and compiles (that may leave cycles); on a device without host memory it also uploads x
    # and w, so the second plans anew for the uploaded inputs; the third hits the plan cache everywhere
    for i in range(3):
        gc.collect(0)  # what the step makes is young: a collection of the youngest generation finds its cycles
        gc.disable()
        try:
            with azyx.GradientTape() as tape:
                loss = (x @ w).relu().sum()
            grad = tape.gradient(loss, w)
            await azyx.realize(loss, grad)
            del loss, grad, tape
            found = gc.collect(0)
        finally:
            gc.enable()
        assert i < 2 or found == 0, f"realize {i} left {found} objects in reference cycles"


def test_a_buffer_freed_by_the_cyclic_gc_while_its_pool_is_locked_is_taken_back() -> None:
    """The cyclic GC runs finalizers wherever the interpreter checks for it, also on a thread inside an allocator's
    lock: a Buffer freed there must not wait for that lock (its own thread holds it: the suite hung on two GPUs)."""
    import gc

    from azyx.runtime import RT

    dev = RT.device("c:0")
    pool = dev.allocator  # type: ignore[attr-defined]
    gc.collect()  # garbage that earlier tests left (an exception's frames holding a tensor) goes first
    buf = dev.alloc(1 << 16)
    size = buf.nbytes
    cycle: list[object] = [buf]
    cycle.append(cycle)
    used = pool.in_use
    del buf, cycle
    with pool.locked():
        gc.collect()  # the Buffer's finalizer runs here, on this thread, with the lock held
    assert pool.in_use == used - size
    again = dev.alloc(1 << 16)  # the block was taken back into the free lists
    assert pool.in_use == used
    del again


@pytest.mark.parametrize("device", ["opencl:0", "vulkan:0"])
def test_poll_advances_the_timeline_without_the_waiter_thread(device: str) -> None:
    # what a realize does on an idle loop before it sleeps: once the command has completed (its OpenCL event, the
    # Vulkan timeline semaphore), `poll` advances the timeline on the calling thread; the waiter thread is held back
    # here, so only `poll` can have done it
    import threading

    from azyx.realize import run_sync, submit
    from azyx.runtime import RT

    if device not in azyx.devices():
        pytest.skip(f"no {device}")
    dev = RT.device(device)
    x_np = np.arange(4096, dtype=np.float32)
    x = Tensor(x_np, device=device).realize_sync()
    gate = threading.Event()
    wait_event = dev.wait_event

    def held(ev: object, v: int) -> bool:
        gate.wait(timeout=60)
        return wait_event(ev, v)

    dev.wait_event = held  # type: ignore[method-assign]
    try:
        y = x * 2.0 + 1.0
        run_sync(submit((y,)))
        v = GRAPH[y.id].buffer.ready  # type: ignore[union-attr]
        assert not dev.poll(v + 1000), "a value never submitted is not reached"
        for _ in range(100_000):
            if dev.poll(v, 1e-3):
                break
        assert dev.timeline.value >= v and not gate.is_set()
    finally:
        gate.set()
        del dev.wait_event
    np.testing.assert_array_equal(y.numpy_sync(), x_np * 2 + 1)
