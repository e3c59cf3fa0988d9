"""The sources of azyx's native core (the extension module azyx._native, built by setup.py for Python's stable ABI),
one file per concern, and their ABI: a hash of the sources themselves.

- native.h: the types and functions the files share
- node.c: the graph's node (azyx.graph.Node) and what `setup` tells the walk
- walk.c: the canonical walk (azyx.walk), the release of nodes and `become_leaf` (azyx.graph.Graph)
- build.c: the operators' common cases (azyx.tensor's `_binop`, `_unary`, `_reduce`), `realized` and `Method`
- pool.c: the caching allocator's free lists (azyx.allocator.PoolAllocator)
- call.c: a batch's call into the C runtime (`TableCall`), a run's scalar words (`pack_words`), driver calls
- queue.c: a CUDA device's command queue (`Queue`), replaying its record
- lane.c: a plan of one kernel on a CUDA device (`Lane`), replaying its frozen record
- read.c: positional reads of a file range into buffers, the GIL released throughout (azyx.files)
- module.c: the module's table and its types

setup.py passes `source_abi()` to the build as AZYX_ABI, which the module keeps as `ABI`; azyx.native loads a built
module only where its ABI is that of the sources beside it (a checkout pulled, not rebuilt, runs without it)."""

from __future__ import annotations

import hashlib
from pathlib import Path

HERE = Path(__file__).parent
SOURCES = ("native.h", "node.c", "walk.c", "build.c", "pool.c", "call.c", "queue.c", "lane.c", "read.c", "module.c")


def source_abi(folder: Path = HERE) -> str | None:
    """The ABI of the sources in `folder`: 16 hex digits of a SHA-256 over each file's name and bytes; None where
    they are not there (an installed build without its sources: the module's own ABI is then taken as it is)."""
    digest = hashlib.sha256()
    for name in SOURCES:
        path = folder / name
        if not path.is_file():
            return None
        data = path.read_bytes()
        digest.update(name.encode() + b"\0" + len(data).to_bytes(8, "little") + data)
    return digest.hexdigest()[:16]
