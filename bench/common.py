"""What every benchmark table states about the machine it ran on (figures differ 2-5x between CPU models)."""

from __future__ import annotations

import os
import platform
from pathlib import Path


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_line() -> str:
    """`machine: <CPU model>, N logical cores, load average a b c` for a results table."""
    try:
        load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        load = "unknown"
    return f"machine: {cpu_model()}, {os.cpu_count()} logical cores, load average {load}"
