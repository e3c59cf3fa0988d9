"""`azyx.plot_graph`: the graph behind some tensors as Graphviz dot (and an image when `dot` is installed)."""

from __future__ import annotations

import shutil
import subprocess
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from azyx.graph import GRAPH

if TYPE_CHECKING:
    from azyx.tensor import Tensor


def plot_graph(tensors: Tensor | Sequence[Tensor], path: str | Path) -> Path:
    """Write the graph reachable from `tensors` to `path` (.dot); also render `path` with .svg/.png/.pdf if asked
    for that suffix and Graphviz is installed. Without Graphviz it writes the .dot beside it and warns
    (RuntimeWarning). Returns the path written."""
    ts = [tensors] if not isinstance(tensors, Sequence) else list(tensors)
    lines = ["digraph azyx {", "  rankdir=BT; node [shape=box, fontname=monospace, fontsize=10];"]
    for i, n in GRAPH.below([t.id for t in ts]):
        label = f"{i}: {n.op.name}"
        if n.arg is not None and n.op.name not in ("LEAF",):
            label += f" {n.arg}"
        label += f"\\n{n.shape} {n.dtype.name} {n.device}"
        style = ', style=filled, fillcolor="#ddeeff"' if n.buffer is not None else ""
        lines.append(f'  n{i} [label="{label}"{style}];')
        for s in n.src:
            lines.append(f"  n{s} -> n{i};")
    for t in ts:
        lines.append(f'  n{t.id} [peripheries=2];')
    lines.append("}")
    path = Path(path)
    dot_text = "\n".join(lines) + "\n"
    if path.suffix in (".png", ".svg", ".pdf"):
        dot_path = path.with_suffix(".dot")
        dot_path.write_text(dot_text)
        if shutil.which("dot"):
            subprocess.run(["dot", f"-T{path.suffix[1:]}", str(dot_path), "-o", str(path)], check=True)
            return path
        warnings.warn(f"plot_graph: Graphviz's `dot` is not installed, so {path} was not rendered; wrote the graph "
                      f"as {dot_path} instead (install Graphviz to render it)", RuntimeWarning, stacklevel=2)
        return dot_path
    path.write_text(dot_text)
    return path
