"""azyx.compiler, the compiler part's common ground: what a compiler binary says about itself is asked once and kept in
the disk cache (the C device's version and macros, Vulkan's glslc version), and an artifact is built once per key."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from azyx import compiler
from azyx.config import cache_dir


@pytest.mark.skipif(shutil.which("gcc") is None, reason="no gcc")
def test_what_a_compiler_says_is_its_output_kept_on_disk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    want = subprocess.run(["gcc", "--version"], capture_output=True, text=True, check=True).stdout
    assert compiler.compiler_says("c", "gcc", "--version") == want
    kept = sorted((cache_dir() / "c").glob("*.txt"))
    assert [p.read_text() for p in kept] == [want]
    # asked again: the kept answer (the cached file is what comes back: rewrite it and the answer follows)
    kept[0].write_text("kept answer")
    assert compiler.compiler_says("c", "gcc", "--version") == "kept answer"
    # what else the answer depends on is part of its key: another key asks the compiler again
    assert compiler.compiler_says("c", "gcc", "--version", key=("another cpu",)) == want
    assert compiler.compiler_says("c", "azyx-no-such-compiler", "--version") == ""


def test_an_artifact_is_built_once_per_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    built: list[Path] = []

    def build(tmp: Path) -> None:
        built.append(tmp)
        tmp.write_bytes(b"artifact %d" % len(built))

    key = compiler.artifact_key("source", "flags")
    first = compiler.cached_build("kind", key, ".bin", build)
    again = compiler.cached_build("kind", key, ".bin", build)
    other = compiler.cached_build("kind", compiler.artifact_key("source", "other flags"), ".bin", build)
    assert first == again != other and len(built) == 2
    assert (first.read_bytes(), other.read_bytes()) == (b"artifact 1", b"artifact 2")
    assert not list(first.parent.glob("*.tmp"))  # (built under a private name, moved into place)
