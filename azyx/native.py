"""azyx's native core (azyx/csrc, built by `pip install` for Python's stable ABI): the graph's node, the canonical
walk, the release of nodes, the operators' common cases, a run's scalar words and the calls of the launch path.
`native` is None where it was not built (no compiler) or AZYX_NATIVE=0 turns it off: the same then runs in Python."""

from __future__ import annotations

import importlib
import os
import warnings
from types import ModuleType

from azyx.csrc import source_abi


def _load() -> ModuleType | None:
    if os.environ.get("AZYX_NATIVE", "1") == "0":
        return None
    try:
        module = importlib.import_module("azyx._native")  # (a compiled module: no layer of the import contracts)
    except ImportError:
        return None
    # a module built from other sources than those beside it (a checkout pulled, not rebuilt) is not used; without
    # its sources (an installed build) the module's own ABI stands
    expected = source_abi()
    built = getattr(module, "ABI", None)
    if expected is not None and built != expected:
        warnings.warn(f"azyx._native at {module.__file__} was built from other sources (ABI {built}, not "
                      f"{expected}): running without it; rebuild it with `pip install -e .`", RuntimeWarning,
                      stacklevel=2)
        return None
    return module


native = _load()
