"""Every ```python block of README.md runs as written, each in a fresh process (in a temporary directory, so the
files a block writes go there), as a script whose top-level `await` runs on an event loop (as in `python -m
asyncio`). A block after `<!-- continues -->` runs in the same process after the block before it (it uses what that
one made); a block after `<!-- norun: why -->` is not run (it needs what CI does not have), and those stay few."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"

# runs a file as a script whose top-level awaits run in one asyncio.run (the asyncio REPL's compile flag)
RUNNER = """
import ast, asyncio, sys, types
path = sys.argv[1]
code = compile(open(path).read(), path, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
main = types.ModuleType("__main__")
sys.modules["__main__"] = main
result = eval(code, main.__dict__)
if asyncio.iscoroutine(result):
    asyncio.run(result)
"""

FENCE = re.compile(r"^(?P<indent>[ ]*)```(?P<lang>\w*)[ ]*$")
MARK = re.compile(r"^\s*<!--\s*(?P<what>norun|continues)\b(?P<why>[^>]*)-->\s*$")


@dataclass
class Block:
    line: int  # of its opening fence, 1-based
    code: str
    mark: str  # "", "norun" or "continues"


def readme_blocks(text: str) -> list[Block]:
    """The ```python blocks of a markdown text (indented ones inside lists too), with the mark on the line before."""
    lines, blocks, i = text.split("\n"), [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        start, indent, lang = i, m["indent"], m["lang"]
        i += 1
        while i < len(lines) and lines[i].strip() != "```":
            i += 1
        if lang == "python":
            body = "\n".join(lines[start + 1:i])
            prev = next((lines[j] for j in range(start - 1, -1, -1) if lines[j].strip()), "")
            mark = MARK.match(prev)
            assert len(indent) == len(lines[i]) - len(lines[i].lstrip()), f"README.md:{start + 1}: fence indents"
            blocks.append(Block(start + 1, textwrap.dedent(body) + "\n", mark["what"] if mark else ""))
        i += 1
    return blocks


def programs(blocks: list[Block]) -> list[tuple[str, str]]:
    """(id, source) of each program to run: a block, with the blocks marked `continues` after it appended."""
    out: list[tuple[str, str]] = []
    for b in blocks:
        if b.mark == "norun":
            continue
        if b.mark == "continues":
            assert out, f"README.md:{b.line}: a block marked continues needs a block before it"
            name, src = out[-1]
            out[-1] = (f"{name}+{b.line}", f"{src}\n# README.md:{b.line}\n{b.code}")
        else:
            out.append((f"README.md:{b.line}", f"# README.md:{b.line}\n{b.code}"))
    return out


BLOCKS = readme_blocks(README.read_text(encoding="utf-8"))
PROGRAMS = programs(BLOCKS)


def test_readme_blocks_found_and_few_skipped() -> None:
    assert len(BLOCKS) >= 8
    skipped = [b.line for b in BLOCKS if b.mark == "norun"]
    assert len(skipped) <= 2, f"README blocks that do not run: lines {skipped}"


def test_markdown_parsing() -> None:
    text = ("intro\n```python\na = 1\n```\n```sh\nnot python\n```\n<!-- norun: needs a GPU -->\n```python\ngpu()\n"
            "```\n- item:\n  <!-- continues -->\n  ```python\n  b = a + 1\n  ```\n")
    blocks = readme_blocks(text)
    assert [(b.line, b.code, b.mark) for b in blocks] == [(2, "a = 1\n", ""), (9, "gpu()\n", "norun"),
                                                          (14, "b = a + 1\n", "continues")]
    assert programs(blocks) == [("README.md:2+14", "# README.md:2\na = 1\n\n# README.md:14\nb = a + 1\n")]


@pytest.mark.parametrize("name,source", PROGRAMS, ids=[p[0] for p in PROGRAMS])
def test_readme_block_runs(name: str, source: str, tmp_path: Path) -> None:
    script = tmp_path / "block.py"
    script.write_text(source)
    env = {k: v for k, v in os.environ.items() if k not in ("AZYX_CONFIG", "AZYX_DEBUG")}
    env["XDG_CONFIG_HOME"] = str(tmp_path)  # no configuration file but what a block sets itself
    r = subprocess.run([sys.executable, "-c", RUNNER, str(script)], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, f"{name} failed:\n{source}\n--- stdout\n{r.stdout}\n--- stderr\n{r.stderr}"
