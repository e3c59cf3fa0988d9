"""Backends: one module per device API, each holding only what differs for its API (device.py is the protocol).

A backend registers itself here, by kind: the module and its Device class. A backend's module is imported when the
runtime first needs that backend (its probe: `probe`), so a missing package or driver disables that backend only
(AZYX_DEBUG=1 says why, and `python -m azyx` lists it), and a program that uses one backend never waits for the
others. How many devices a backend has is the class's own business (`Device.count`).
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

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


def _driver_library(names: list[str]) -> Callable[[], None]:
    """A check that one of the driver's shared libraries loads (a millisecond where it is missing, where importing the
    backend's bindings would take tens)."""

    def check() -> None:
        for name in names:
            try:
                ctypes.CDLL(name)
                return
            except OSError:
                continue
        raise OSError(f"no driver library ({' or '.join(names)}) found")

    return check


# kind -> a cheap check run before the backend's module is imported: it raises where the backend cannot have a device
PRECHECKS: dict[str, Callable[[], None]] = {}
if sys.platform == "linux":
    PRECHECKS["cuda"] = _driver_library(["libcuda.so.1", "libcuda.so"])


def load_backend(kind: str) -> type[Device]:
    """The Device class of a backend (importing its module: raises where its package or driver is missing)."""
    mod, cls = BACKENDS[kind]
    device_class = getattr(importlib.import_module(mod), cls)
    assert issubclass(device_class, Device)
    return device_class


@dataclass
class Probe:
    """What probing one backend found: its devices, or why it was skipped; the thread it ran on, how long it took,
    and what the driver wrote to stderr meanwhile (kept, never printed: `python -m azyx` and AZYX_DEBUG=1 show it)."""

    kind: str
    devices: list[Device] = field(default_factory=list)
    skipped: str | None = None  # why the backend has no device (disabled, package or driver missing, ...)
    thread: int = 0  # threading.get_ident() of the thread that probed
    seconds: float = 0.0
    stderr: str = ""


def probe(kind: str, section: dict[str, Any]) -> Probe:
    """Start a backend's devices from its config section (with driver output on stderr captured: `quiet`). A missing
    package or driver, or a device that fails to start, disables the backend only: the probe says why."""
    record = Probe(kind, thread=threading.get_ident())
    start = time.perf_counter()
    if not section.get("enabled", kind != "dummy"):
        record.skipped = "disabled in the configuration"
        return record
    with quiet() as captured:
        try:
            if kind in PRECHECKS:
                PRECHECKS[kind]()
            device_class = load_backend(kind)
            record.devices = [device_class(i, section) for i in range(device_class.count(section))]
            if not record.devices:
                record.skipped = "no device found"
        except Exception as e:  # a missing package or driver disables that backend only
            record.devices, record.skipped = [], f"{type(e).__name__}: {e}"
    record.stderr = captured[0]
    record.seconds = time.perf_counter() - start
    return record


_QUIET = threading.Lock()  # (file descriptor 2 is the process's: one capture at a time)


@contextlib.contextmanager
def quiet() -> Iterator[list[str]]:
    """Capture what is written to file descriptor 2 (stderr) meanwhile, by C code too (drivers print there, below
    Python's sys.stderr), into a temporary file; yields a list whose one item is the captured text once the block
    ends. The descriptor is process-wide: what another thread writes to stderr during the block is captured too, so
    the probes that use this are short and run once."""
    out = [""]
    with _QUIET, tempfile.TemporaryFile() as tmp:
        with contextlib.suppress(Exception):
            sys.stderr.flush()
        try:
            saved = os.dup(2)
        except OSError:  # (no stderr to capture: a daemon's)
            yield out
            return
        os.dup2(tmp.fileno(), 2)
        try:
            yield out
        finally:
            with contextlib.suppress(Exception):
                sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            out[0] = tmp.read().decode(errors="replace")
