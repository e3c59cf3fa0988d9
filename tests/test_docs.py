"""The reference: every public function and method has a docstring, their examples run, the API reference builds
without a warning or a broken link (docs/build.py, `bash dev.sh docs`), and azyx's types reach a user's type checker
through the editable install `dev.sh` makes."""

from __future__ import annotations

import doctest
import importlib
import importlib.util
import inspect
import os
import re
import subprocess
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent

# the modules a user programs against; azyx's own exports (Tensor, realize, ...) through azyx.__all__
PUBLIC_MODULES = ["azyx", "azyx.nn", "azyx.optim", "azyx.io", "azyx.jit", "azyx.tape", "azyx.stats", "azyx.shard",
                  "azyx.distributed", "azyx.models", "azyx.models.gpt2", "azyx.dtypes", "azyx.errors", "azyx.tensor"]
# dunders that are API a user calls by their syntax (t[i], t[i] = v, await t, module(x))
PUBLIC_DUNDERS = {"__call__", "__getitem__", "__setitem__", "__await__"}


def _public_names(mod: types.ModuleType) -> list[str]:
    if hasattr(mod, "__all__"):
        return list(mod.__all__)
    return [n for n, v in vars(mod).items() if not n.startswith("_")
            and (inspect.isclass(v) or inspect.isfunction(v)) and getattr(v, "__module__", None) == mod.__name__]


def _own_doc(obj: Any) -> str:
    doc = obj.__doc__ if isinstance(getattr(obj, "__doc__", None), str) else ""
    if inspect.isclass(obj) and doc.startswith(f"{obj.__name__}("):  # a dataclass's generated signature
        return ""
    return doc.strip()


def _members(cls: type) -> Iterator[tuple[str, Any]]:
    """The public methods and properties a class defines (and those of its azyx bases), as (name, documented)."""
    for klass in cls.__mro__:
        if not klass.__module__.startswith("azyx"):
            continue
        for name, v in vars(klass).items():
            if name.startswith("_") and name not in PUBLIC_DUNDERS:
                continue
            if isinstance(v, staticmethod | classmethod):
                v = v.__func__
            if isinstance(v, property):
                yield f"{klass.__qualname__}.{name}", v
            elif callable(v) and not inspect.isclass(v):
                yield f"{klass.__qualname__}.{name}", v


def public_api(modules: list[str] = PUBLIC_MODULES) -> dict[str, Any]:
    """Every public function, class, method and property of `modules`, by a dotted name (each object once)."""
    out: dict[str, Any] = {}
    seen: set[int] = set()
    for m in modules:
        mod = importlib.import_module(m)
        for n in _public_names(mod):
            obj = getattr(mod, n)
            if inspect.ismodule(obj) or not callable(obj) or id(obj) in seen:
                continue
            seen.add(id(obj))
            out[f"{m}.{n}"] = obj
            if inspect.isclass(obj) and obj.__module__.startswith("azyx"):
                for qual, member in _members(obj):
                    key = f"{obj.__module__}.{qual}"
                    if id(member) not in seen:
                        seen.add(id(member))
                        out[key] = member
    return out


def undocumented(api: dict[str, Any]) -> list[str]:
    return sorted(name for name, obj in api.items() if not _own_doc(obj))


def test_every_public_function_and_method_has_a_docstring() -> None:
    api = public_api()
    assert len(api) > 300  # the walk reaches Tensor's methods, nn, optim, io, models...
    assert "azyx.tensor.Tensor.softmax" in api and "azyx.nn.Linear.forward" in api
    assert undocumented(api) == []


def test_reference_page_lists_every_tensor_method() -> None:
    """docs/reference.md names every public method and property of Tensor (in a `code` span)."""
    from azyx import Tensor

    text = (ROOT / "docs" / "reference.md").read_text(encoding="utf-8")
    spans = " ".join(re.findall(r"`([^`]+)`", text))
    hooks = {"sharder"}  # (azyx.shard's function, installed on Tensor: not a method users call)
    names = {q.rsplit(".", 1)[1] for q, _ in _members(Tensor)} - hooks - PUBLIC_DUNDERS
    assert len(names) > 90
    assert sorted(n for n in names if not re.search(rf"(?<![\w.]){re.escape(n)}\b|\.{re.escape(n)}\b", spans)) == []


def test_the_walk_finds_what_lacks_a_docstring() -> None:
    mod = types.ModuleType("doc_probe")

    class Layer:
        """documented"""

        def forward(self) -> None:
            pass

        @property
        def size(self) -> int:
            return 1

        def _private(self) -> None:
            pass

    def helper() -> None:
        pass

    Layer.__module__ = helper.__module__ = "doc_probe"
    mod.Layer, mod.helper = Layer, helper  # type: ignore[attr-defined]
    sys.modules["doc_probe"] = mod
    try:
        found = undocumented(public_api(["doc_probe"]))
    finally:
        del sys.modules["doc_probe"]
    assert found == ["doc_probe.helper"]  # Layer's module is not azyx's: its members are not walked
    Layer.__module__ = "azyx.probe"
    assert undocumented({f"x.{q}": v for q, v in _members(Layer)}) == [
        "x.test_the_walk_finds_what_lacks_a_docstring.<locals>.Layer.forward",
        "x.test_the_walk_finds_what_lacks_a_docstring.<locals>.Layer.size"]


def test_docstring_examples_run() -> None:
    """The `>>>` examples of the public API's docstrings, each checked against the output it shows."""
    finder, runner = doctest.DocTestFinder(recurse=False), doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    ran = 0
    for name, obj in public_api().items():
        target = obj.fget if isinstance(obj, property) else obj
        parts = name.split(".")  # run in the globals of the module the name is in, as doctest.testmod does
        home = next(sys.modules[m] for m in (".".join(parts[:i]) for i in range(len(parts), 0, -1)) if m in sys.modules)
        for test in finder.find(target, name, globs=dict(vars(home))):
            if test.examples:
                runner.run(test)
                ran += len(test.examples)
    assert ran >= 20
    assert runner.failures == 0, f"{runner.failures} docstring examples failed (printed above)"


def _build_module() -> Any:
    spec = importlib.util.spec_from_file_location("azyx_docs_build", ROOT / "docs" / "build.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_reference_builds_without_warnings_or_broken_links(tmp_path: Path) -> None:
    pytest.importorskip("pdoc", reason="the docs extra: pip install -e '.[docs]' (dev.sh installs it)")
    problems = _build_module().build(tmp_path)
    assert problems == []
    page = (tmp_path / "azyx.html").read_text()
    for anchor in ("Tensor.softmax", "Tensor.realize", "realize", "GradientTape"):
        assert f'id="{anchor}"' in page
    assert (tmp_path / "azyx" / "nn.html").exists() and (tmp_path / "azyx" / "models.html").exists()


def test_markdown_links_resolve() -> None:
    """The relative links of README.md and docs/*.md name files of the repository."""
    bad = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text(encoding="utf-8")):
            if not target.startswith(("http://", "https://", "mailto:")) and not (page.parent / target).exists():
                bad.append(f"{page.relative_to(ROOT)}: {target}")
    assert bad == []


def test_link_check_finds_missing_pages_and_anchors(tmp_path: Path) -> None:
    (tmp_path / "a.html").write_text('<a href="b.html#here">ok</a><a href="b.html#gone">x</a><a href="c.html">y</a>'
                                     '<a href="#top">z</a><a href="https://example.org/">w</a><p id="top"></p>')
    (tmp_path / "b.html").write_text('<h1 id="here">b</h1>')
    assert _build_module().broken_links(tmp_path) == ["a.html: b.html#gone (no such anchor)",
                                                      "a.html: c.html (no such page)"]


def test_a_type_checker_sees_azyx_types(tmp_path: Path) -> None:
    """mypy on a user's file, outside the repository, finds azyx where `dev.sh` installed it (an editable install
    in compat mode: a path in a .pth file; setuptools' default import hook would leave every azyx name Any) and
    catches a forgotten await."""
    (tmp_path / "user.py").write_text("from azyx import Tensor\n\n"
                                      "value: float = Tensor([1.0]).item()  # forgot the await\n"
                                      "ok: Tensor = Tensor([1.0]).relu()\n")
    env = {k: v for k, v in os.environ.items() if k not in ("MYPYPATH", "PYTHONPATH")}
    r = subprocess.run([sys.executable, "-m", "mypy", "--python-executable", sys.executable, "--no-incremental",
                        "--cache-dir", str(tmp_path / ".mypy_cache"), "user.py"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert 'Cannot find implementation or library stub for module named "azyx"' not in r.stdout, (
        "mypy cannot see the installed azyx: install it as `dev.sh` does "
        "(pip install -e . --config-settings editable_mode=compat)\n" + r.stdout)
    assert r.returncode == 1, r.stdout + r.stderr
    assert 'user.py:3: error: Incompatible types in assignment (expression has type "Coroutine[' in r.stdout, r.stdout
    assert 'Maybe you forgot to use "await"?' in r.stdout
    assert "user.py:4" not in r.stdout  # a correct line passes: the types are azyx's, not Any
