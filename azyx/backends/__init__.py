"""Backends: one module per device API, each holding only what differs for its API (device.py is the protocol).

A backend registers itself here, by kind: the module and its Device class. Modules are imported when the runtime
starts, so a missing package or driver disables its backend only (AZYX_DEBUG=1 says why); how many devices it has is
the class's own business (`Device.count`).
"""

from __future__ import annotations

import importlib

from azyx.device import Device

# kind -> (module, class name)
BACKENDS: dict[str, tuple[str, str]] = {
    "c": ("azyx.backends.c", "CDevice"),
    "opencl": ("azyx.backends.opencl", "OpenCLDevice"),
    "cuda": ("azyx.backends.cuda", "CUDADevice"),
    "vulkan": ("azyx.backends.vulkan", "VulkanDevice"),
    "wgpu": ("azyx.backends.wgpu", "WgpuDevice"),
    "dummy": ("azyx.backends.dummy", "DummyDevice"),
}


def load_backend(kind: str) -> type[Device]:
    """The Device class of a backend (importing its module: raises where its package or driver is missing)."""
    mod, cls = BACKENDS[kind]
    device_class = getattr(importlib.import_module(mod), cls)
    assert issubclass(device_class, Device)
    return device_class
