"""Test configuration: two logical C devices (so cross-device transfers run in CI) and a dummy device for
scheduler tests. The op suite runs once per device kind (`device` fixture)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

import azyx
from azyx.runtime import RT

azyx.configure({"c": {"devices": 2}, "dummy": {"enabled": True, "devices": 1, "memory": 1 << 20, "compute": 0.0}})

# one device of each kind: c:1 behaves like c:0, so the op suite runs on c:0 (and opencl:0, ... when present)
DEVICES = [d for d in azyx.devices() if d.endswith(":0")]
if os.environ.get("AZYX_TEST_DEVICES"):
    DEVICES = os.environ["AZYX_TEST_DEVICES"].split(",")


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> str:
    return request.param  # type: ignore[no-any-return]


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
