"""Backends: one module per device API. Each registers a factory in BACKENDS; a backend whose driver or
package is missing is skipped at start-up (AZYX_DEBUG=1 says why)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from azyx.device import Device

# name -> (module, class name); imported lazily so a missing package only disables its backend
BACKENDS: dict[str, tuple[str, str]] = {
    "c": ("azyx.backends.c", "CDevice"),
    "opencl": ("azyx.backends.opencl", "OpenCLDevice"),
    "cuda": ("azyx.backends.cuda", "CUDADevice"),
    "dummy": ("azyx.backends.dummy", "DummyDevice"),
}


def device_count(kind: str, section: dict[str, Any]) -> int:
    """How many devices of a backend to start: what the config says, or what the driver reports."""
    if kind == "opencl" and "devices" not in section:
        from azyx.backends.opencl import device_list

        return len(device_list(section))
    if kind == "cuda" and "devices" not in section:
        from azyx.backends.cuda import init

        return init()
    return int(section.get("devices", 1))


def load_backend(name: str) -> Callable[[int, dict[str, Any]], Device]:
    import importlib

    mod, cls = BACKENDS[name]
    return getattr(importlib.import_module(mod), cls)  # type: ignore[no-any-return,unused-ignore]
