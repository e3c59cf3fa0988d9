"""Backends found, registered and probed: the generic half of "a backend is its module".

A backend registers by its module: azyx/backends/<kind>.py with a `CONFIG` (see `Backend`) and a Device subclass
of that kind; nothing else names it (test_backends_registry holds the rule). This module finds those modules without
importing them (`register`: their config sections join config.DEFAULTS as azyx is imported) and imports one when the
runtime first needs that backend (its probe: `probe`), so a missing package or driver disables that backend only
(AZYX_DEBUG=1 says why, and `python -m azyx` lists it), and a program that uses one backend never waits for the
others. How many devices a backend has is the class's own business (`Device.count`).
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import os
import pkgutil
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from azyx import backends, config
from azyx.device import Device


@dataclass(frozen=True)
class Backend:
    """What registers a backend: its module (azyx.backends.<kind>) and, read from that module's source without
    importing it (its API's package is imported only when the backend is probed), three constants at its top level:
    `CONFIG` (its config section's defaults: the module carries them), `AUTO` (whether AUTO places work on it by
    default, config `runtime.auto`) and `LIBRARIES` (driver libraries of which one must load before the module is
    imported: a millisecond where the driver is missing, where importing the API's bindings would take tens)."""

    module: str
    config: dict[str, Any]
    auto: bool = False
    libraries: tuple[str, ...] = ()


def _constants(src: str, names: tuple[str, ...]) -> dict[str, Any]:
    """The values of the module-level constants `names` in a module's source (`NAME = <expression of literals>`, the
    expression's lines up to the next line that starts a statement at column 0)."""
    out = {}
    for name in names:
        at = src.find(f"\n{name} = ")
        if at < 0:
            continue
        lines = src[at + len(name) + 4:].split("\n", 40)[:40]
        n = 1 + next((i for i, line in enumerate(lines[1:]) if line[:1] not in ("", " ", ")", "]", "}")),
                     len(lines) - 1)
        out[name] = eval("\n".join(lines[:n]), {"__builtins__": {}})  # (the package's own source: constants only)
    return out


def _discover() -> dict[str, Backend]:
    """Every module of azyx.backends whose source sets `CONFIG` at its top level is a backend, its kind its module's
    name: adding a backend is adding its module."""
    found = {}
    for info in sorted(pkgutil.iter_modules(backends.__path__), key=lambda i: i.name):
        name = f"{backends.__name__}.{info.name}"
        spec = info.module_finder.find_spec(name, None)
        loader: Any = spec.loader if spec is not None else None
        src = loader.get_source(name) if loader is not None else None
        consts = _constants(src or "", ("CONFIG", "AUTO", "LIBRARIES"))
        if "CONFIG" in consts:
            found[info.name] = Backend(name, consts["CONFIG"], bool(consts.get("AUTO")),
                                       tuple(consts.get("LIBRARIES", ())))
    return found


BACKENDS: dict[str, Backend] = {}


def register() -> None:
    """Find the backends (`_discover`) and add their config sections to config.DEFAULTS (done as this module is
    imported; again where a module was added to azyx.backends' path since)."""
    BACKENDS.update(_discover())
    config.add_backends({kind: b.config for kind, b in BACKENDS.items()}, [k for k, b in BACKENDS.items() if b.auto])


register()


def _precheck(libraries: tuple[str, ...]) -> None:
    """Raise where none of a backend's driver libraries loads."""
    for name in libraries:
        try:
            ctypes.CDLL(name)
            return
        except OSError:
            continue
    raise OSError(f"no driver library ({' or '.join(libraries)}) found")


def load_backend(kind: str) -> type[Device]:
    """The Device class of a backend: its module's Device subclass of that kind (importing the module: raises where
    its package or driver is missing)."""
    mod = importlib.import_module(BACKENDS[kind].module)
    found = [c for c in vars(mod).values() if isinstance(c, type) and issubclass(c, Device) and c.kind == kind]
    assert len(found) == 1, f"{mod.__name__} defines {len(found)} Device classes of kind {kind!r}"
    return found[0]


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
    if not section.get("enabled", BACKENDS[kind].config.get("enabled", True)):
        record.skipped = "disabled in the configuration"
        return record
    with quiet() as captured:
        try:
            if BACKENDS[kind].libraries and sys.platform == "linux":
                _precheck(BACKENDS[kind].libraries)
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
