"""Test configuration: two logical C devices (so cross-device transfers run in CI) and a dummy device for
scheduler tests. The op suite runs once per device kind (`device` fixture)."""

from __future__ import annotations

import os
import zlib
from collections.abc import Iterator
from pathlib import Path

import pytest

import azyx
from azyx.codegen.dialect import CUDA
from azyx.native import native
from azyx.runtime import RT

azyx.configure({"c": {"devices": 2}, "dummy": {"enabled": True, "devices": 1, "memory": 1 << 20, "compute": 0.0}})

# one device of each kind: c:1 behaves like c:0, so the op suite runs on c:0 (and opencl:0, ... when present)
DEVICES = [d for d in azyx.devices() if d.endswith(":0")]
if os.environ.get("AZYX_TEST_DEVICES"):
    DEVICES = os.environ["AZYX_TEST_DEVICES"].split(",")


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> str:
    return request.param  # type: ignore[no-any-return]


# CI's passes with and without the native core (AZYX_NATIVE=0; dev.sh). AZYX_TEST_SPLIT=native and =python (with
# AZYX_NATIVE=0) split the suite in two, in the time of one pass: each device-parametrized test runs with the core on
# half the devices and without it on the other half (which half alternates from test to test), so every such test and
# every device runs both ways; the other tests run once, with it. AZYX_TEST_SPLIT=devices keeps every
# device-parametrized test (a whole second pass of them, with AZYX_NATIVE=0, after a full one).
SPLIT = os.environ.get("AZYX_TEST_SPLIT")
assert SPLIT in (None, "native", "python", "devices"), f"AZYX_TEST_SPLIT={SPLIT!r}: native, python or devices"
# AZYX_TEST_EACH=N (CI: 2): each device-parametrized test runs on N of the devices, the first (c:0, the fastest)
# and N - 1 of the others in turn from test to test, so every device still runs about (N - 1) / (len - 1) of them.
# CI's 30 minutes on 2 cores do not hold every test on every device: PoCL and lavapipe take about a second a test,
# compiling each kernel in LLVM (all on all, with and without the native core: about an hour). Unset: every device
EACH = min(int(os.environ.get("AZYX_TEST_EACH") or len(DEVICES)), len(DEVICES))
assert EACH >= 1, f"AZYX_TEST_EACH={EACH}: 1 or more"


def split_side(nodeid: str, device: str | None) -> str | None:
    """Which half of CI's split runs the test `nodeid` (on `device`, where it takes the `device` fixture): "native" or
    "python"; "" for none (a device not among the test's EACH); None for a test on no device of DEVICES, which the
    `devices` pass leaves out."""
    if device is None or device not in DEVICES:
        return None
    base = zlib.crc32(nodeid.replace(device, "").encode())
    i = DEVICES.index(device)
    if i and (i - 1 - base) % (len(DEVICES) - 1) >= EACH - 1:
        return ""
    return ("native", "python")[(base + i) % 2]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if SPLIT is None and EACH == len(DEVICES):
        return
    assert SPLIT is None or (SPLIT == "native") == (native is not None), \
        "AZYX_TEST_SPLIT=python or devices go with AZYX_NATIVE=0"
    keep, drop = [], []
    for item in items:
        callspec = getattr(item, "callspec", None)
        side = split_side(item.nodeid, callspec.params.get("device") if callspec is not None else None)
        if SPLIT is None:  # (AZYX_TEST_EACH alone: each device test on its EACH devices, with the core as it is)
            kept = side != ""
        else:
            kept = bool(side) if SPLIT == "devices" else (side if side is not None else "native") == SPLIT
        (keep if kept else drop).append(item)
    items[:] = keep
    config.hook.pytest_deselected(items=drop)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--fuzz-long", action="store_true",
                     help="tests/test_fuzz.py: thousands of random graphs per device with fresh randomness "
                          "(AZYX_FUZZ_EXAMPLES=N sets the count)")


@pytest.fixture
def fresh_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Every device's winner cache in an empty directory of this test's own (and back afterwards)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("AZYX_SEARCH_BUDGET", "20")
    saved = {name: dev.__dict__.pop("_winners", None) for name, dev in RT.started_devices().items()}
    RT.plan_cache.clear()
    yield tmp_path
    for name, dev in RT.started_devices().items():
        dev.__dict__.pop("_winners", None)
        if saved.get(name) is not None:
            dev.__dict__["_winners"] = saved[name]
    RT.plan_cache.clear()


CUDA_PLANNING = "dummy:0"  # plans without running; `cuda_planning` makes it render CUDA C


@pytest.fixture
def cuda_planning(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The dummy device (CUDA_PLANNING) plans as a CUDA device would (CUDA's dialect, no register tiling), on a
    machine without a GPU: tests read the kernels it plans and render."""
    dev = RT.device(CUDA_PLANNING)
    monkeypatch.setattr(dev, "dialect", CUDA)
    monkeypatch.setattr(dev, "tiles", False)
    RT.plan_cache.clear()
    yield
    RT.plan_cache.clear()
