"""The shape of the code, measured: code generation is the azyx/codegen package of files no longer than 700 lines
(the WGSL renderer under 400); no function of azyx is longer than 80 lines; the native core's C sources are files of
at most 600 lines; and no code outside azyx/backends/ asks what a device is by comparing with a backend's or
dialect's name (it reads the capability from the device's Dialect)."""

from __future__ import annotations

import ast
from pathlib import Path

import azyx

ROOT = Path(azyx.__file__).parent
CODEGEN = ROOT / "codegen"
NAMES = {"c", "cuda", "opencl", "vulkan", "wgpu", "glsl", "wgsl", "cl", "host"}


def _lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def test_codegen_files_are_short() -> None:
    lengths = {str(p.relative_to(ROOT)): _lines(p) for p in sorted(CODEGEN.rglob("*.py"))}
    assert {"codegen/cfamily.py", "codegen/wgsl.py", "codegen/dialect.py", "codegen/launch.py"} <= set(lengths)
    assert {p: n for p, n in lengths.items() if n > 700} == {}
    assert lengths["codegen/wgsl.py"] < 400


def test_functions_are_short() -> None:
    long = {}
    for path in sorted(ROOT.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                n = node.end_lineno - node.lineno + 1  # type: ignore[operator]
                if n > 80:
                    long[f"{path.relative_to(ROOT)}:{node.lineno} {node.name}"] = n
    assert long == {}


def test_native_sources_are_short() -> None:
    lengths = {p.name: _lines(p) for p in sorted((ROOT / "csrc").glob("*.[ch]"))}
    assert {"node.c", "walk.c", "queue.c", "lane.c"} <= set(lengths)
    assert {p: n for p, n in lengths.items() if n > 600} == {}


def _names_compared(node: ast.Compare) -> set[str]:
    """The backend or dialect names a comparison (==, !=, in, not in) tests a value against."""
    if not all(isinstance(op, ast.Eq | ast.NotEq | ast.In | ast.NotIn) for op in node.ops):
        return set()
    found = set()
    for side in (node.left, *node.comparators):
        items = side.elts if isinstance(side, ast.Tuple | ast.List | ast.Set) else [side]
        found |= {x.value for x in items if isinstance(x, ast.Constant) and x.value in NAMES}
    return found


def test_no_backend_names_compared_outside_backends() -> None:
    hits = []
    for path in sorted(ROOT.rglob("*.py")):
        if path.is_relative_to(ROOT / "backends"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare) and (names := _names_compared(node)):
                hits.append(f"{path.relative_to(ROOT)}:{node.lineno} {sorted(names)}")
    assert hits == []


def test_the_name_check_finds_a_comparison() -> None:
    """The check above sees each form it forbids (else it would pass by seeing nothing)."""
    forms = ['dl.name == "cuda"', '"opencl" != kind', 'target in ("c", "cl")', 'x not in ["glsl"]']
    for form in forms:
        (expr,) = ast.parse(form).body
        assert isinstance(expr, ast.Expr) and isinstance(expr.value, ast.Compare) and _names_compared(expr.value)
    (plain,) = ast.parse('name == "cudax" or "c:0" in names').body
    assert isinstance(plain, ast.Expr) and not any(
        _names_compared(n) for n in ast.walk(plain.value) if isinstance(n, ast.Compare))
