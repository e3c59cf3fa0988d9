"""Build azyx's API reference (HTML, with pdoc) from its docstrings, and check it.

    python docs/build.py [OUTPUT_DIR]      (default: docs/api; `bash dev.sh docs` runs it)

Any warning pdoc raises while rendering (an unresolvable annotation, a docstring it cannot parse) fails the build,
and so does a broken link: every relative `href` of the generated pages must name a page that was written, and its
`#anchor` an id on that page. Exit status 0 only when both hold.
"""

from __future__ import annotations

import html.parser
import sys
import warnings
from pathlib import Path
from urllib.parse import unquote, urldefrag

# the modules a user programs against: azyx's own page holds what `azyx/__init__.py` exports (Tensor, realize, ...),
# and pdoc adds the submodules its `__all__` names (io, nn, optim, jit, stats, dtypes), less the internal ones that
# share a name with an exported function ("!" excludes)
MODULES = ["azyx", "azyx.tape", "azyx.shard", "azyx.distributed", "azyx.models", "azyx.errors",
           "!azyx.realize", "!azyx.schedule", "!azyx.tune"]


class _Links(html.parser.HTMLParser):
    """The hrefs and the ids of one HTML page."""

    def __init__(self) -> None:
        super().__init__()
        self.hrefs: list[str] = []
        self.ids: set[str] = set()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        for k, v in attrs:
            if k == "href" and v is not None:
                self.hrefs.append(v)
            elif k in ("id", "name") and v is not None:
                self.ids.add(v)


def broken_links(root: Path) -> list[str]:
    """Every relative link under `root` whose page or anchor does not exist, as 'page: href'."""
    pages = {p.resolve(): p for p in root.rglob("*.html")}
    parsed: dict[Path, _Links] = {}
    for p in pages:
        parser = _Links()
        parser.feed(p.read_text(encoding="utf-8"))
        parsed[p] = parser
    bad = []
    for p, links in parsed.items():
        for href in links.hrefs:
            if href.startswith(("http://", "https://", "mailto:", "data:", "javascript:")):
                continue
            target, anchor = urldefrag(href)
            dest = (p.parent / unquote(target)).resolve() if target else p
            if not dest.exists():
                bad.append(f"{p.relative_to(root.resolve())}: {href} (no such page)")
            elif anchor and dest.suffix == ".html" and unquote(anchor) not in parsed[dest].ids:
                bad.append(f"{p.relative_to(root.resolve())}: {href} (no such anchor)")
    return bad


def build(out: Path) -> list[str]:
    """Render the reference into `out`; returns the problems found (pdoc's warnings, broken links): none is a pass."""
    import importlib

    import pdoc
    import pdoc.render

    # imported first: a warning a third-party package gives at import is not the reference's
    for m in (m for m in MODULES if not m.startswith("!")):
        importlib.import_module(m)
    pdoc.render.configure(docformat="markdown", show_source=False, search=False,
                          footer_text="azyx: an asyncio-native lazy tensor runtime")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pdoc.pdoc(*MODULES, output_directory=out)
    return [f"pdoc: {w.message}" for w in caught] + broken_links(out)


def main() -> int:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent / "api"
    problems = build(out)
    for p in problems:
        print(p, file=sys.stderr)
    if not problems:
        print(f"API reference: {out / 'index.html'}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
