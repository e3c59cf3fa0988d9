"""AZYX_DEBUG: a bitmask read once at import; each stage prints to stderr when its bit is set."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

DEVICES, PLANS, LAUNCHES, IR, SOURCE, SEARCH = 1, 2, 4, 8, 16, 32  # SEARCH: what the kernel search tried, won

try:
    LEVEL = int(os.environ.get("AZYX_DEBUG", "0") or 0)
except ValueError:
    LEVEL = 0


def enabled(bit: int) -> bool:
    return bool(LEVEL & bit)


def log(bit: int, msg: str | Callable[[], str]) -> None:
    """Print `msg` (or the result of calling it, built only when enabled) if `bit` is on."""
    if LEVEL & bit:
        text = msg() if callable(msg) else msg
        print(f"azyx: {text}", file=sys.stderr, flush=True)
