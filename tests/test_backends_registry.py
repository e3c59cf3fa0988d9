"""A backend is its module: adding one touches no other file of azyx (beside, where it needs a new language, one
dialect row or renderer subclass of the code generator). Shown by adding one from a temporary directory and using it,
and by grepping the shared modules for backend names."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from azyx import config
from azyx.registry import BACKENDS

# the module of a new backend, complete: a host-memory device that runs the C backend's kernels under its own kind
# (it subclasses the C device to be short; a real one would subclass Device or the shared bases)
ECHO = '''
from azyx.backends.c import CDevice

CONFIG = {"enabled": True, "devices": 2, "memory": 1 << 28, "loudness": 3}


class EchoDevice(CDevice):
    kind = "echo"
'''

SCRIPT = """
import asyncio, sys
import numpy as np
from azyx import backends, config, registry
backends.__path__.append(sys.argv[1])  # (where the new module lies: beside the package's own, as if added to it)
registry.register()
import azyx
azyx.configure({"echo": {"loudness": 4}})
names = asyncio.run(azyx.start("echo"))
x = azyx.Tensor(np.arange(6, dtype=np.float32), device="echo:1")
print(names)
print(config.DEFAULTS["echo"]["loudness"])
print(asyncio.run((x * 3).numpy()).tolist())
try:
    azyx.configure({"echo": {"loudnes": 1}})
except config.ConfigError as e:
    print("ConfigError", "echo.loudness" in str(e))
"""


def test_a_new_backend_is_its_module_alone(tmp_path: Path) -> None:
    (tmp_path / "echo.py").write_text(ECHO)
    env = {k: v for k, v in os.environ.items() if not k.startswith("AZYX_")}
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    names, loudness, values, error = out.stdout.strip().split("\n")
    assert names == str(["echo:0", "echo:1"]), out.stdout
    assert int(loudness) == 3  # its own default (configure's 4 applies to the runtime's config, not DEFAULTS)
    assert values == str((np.arange(6, dtype=np.float32) * 3).tolist()), out.stdout
    assert error == "ConfigError True", out.stdout


def test_each_backend_carries_its_config_section() -> None:
    for kind, b in BACKENDS.items():
        assert b.module == f"azyx.backends.{kind}"
        assert config.DEFAULTS[kind] == {**b.config, "compile_timeout_s": b.config.get("compile_timeout_s",
                                                                                       config.COMPILE_TIMEOUT_S)}
    assert list(config.DEFAULTS)[-len(config.SETTINGS):] == list(config.SETTINGS)
    assert sorted(config.DEFAULTS["runtime"]["auto"]) == sorted(k for k, b in BACKENDS.items() if b.auto)
