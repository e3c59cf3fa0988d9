"""Lazy tensors over safetensors files (`load_safetensors`, `metadata_of`): see azyx.storage for how they are built
and what realizing them reads."""

from __future__ import annotations

from typing import Any

from azyx.storage import disk_node, header_of, open_safetensors
from azyx.tensor import Tensor


def load_safetensors(path: Any) -> dict[str, Tensor]:
    """Every tensor of a safetensors file as a lazy disk tensor, in file order; reads the header only.

    >>> import numpy as np, azyx
    >>> from safetensors.numpy import save_file
    >>> save_file({"a": np.ones(3, np.float32), "b": np.zeros((2, 2), np.int64)}, "/tmp/azyx_doc2.safetensors")
    >>> ts = azyx.io.load_safetensors("/tmp/azyx_doc2.safetensors")
    >>> sorted((k, t.shape, t.dtype.name, t.device) for k, t in ts.items())
    [('a', (3,), 'float32', 'disk'), ('b', (2, 2), 'int64', 'disk')]
    >>> (ts["a"].to("c:0") + 1).numpy_sync().tolist()
    [2.0, 2.0, 2.0]
    """
    f = open_safetensors(path)
    return {name: Tensor._from_node(disk_node(f, e)) for name, e in header_of(f).tensors.items()}


def metadata_of(path: Any) -> dict[str, str]:
    """The file's `__metadata__` (empty when it has none); reads the header only."""
    return dict(header_of(open_safetensors(path)).metadata or {})
