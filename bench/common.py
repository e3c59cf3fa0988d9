"""What every benchmark table states about the machine it ran on (figures differ 2-5x between CPU models)."""

from __future__ import annotations

import os
import platform
import subprocess
import threading
import time
from pathlib import Path
from typing import Any


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def gpu_name() -> str:
    """The first GPU's name as nvidia-smi gives it ("GPU unknown" without one)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30)
        return out.stdout.strip().splitlines()[0]
    except (OSError, IndexError, subprocess.SubprocessError):
        return "GPU unknown"


def machine_line() -> str:
    """`machine: <CPU model>, N logical cores, load average a b c` for a results table."""
    try:
        load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        load = "unknown"
    return f"machine: {cpu_model()}, {os.cpu_count()} logical cores, load average {load}"


def write_section(path: Path, start: str, end: str, text: str) -> None:
    """Replace the section of `path` from the marker `start` to the marker `end` (both in `text`) with `text`;
    append it where the file has no such section."""
    old = path.read_text() if path.exists() else "# azyx benchmark results\n"
    a, b = old.find(start), old.find(end)
    if a >= 0 and b > a:
        new = old[:a] + text.rstrip("\n") + old[b + len(end):]
    else:
        new = old.rstrip("\n") + "\n\n" + text
    path.write_text(new if new.endswith("\n") else new + "\n")


def time_calls(obj: Any, name: str, thread: int | None = None) -> list[float]:
    """Time every call of `obj`'s method `name` from now on (an instance attribute wraps it; `del obj.<name>` ends
    it), or only those made on the thread `thread` (an ident): the list that each call's seconds are appended to."""
    plain, seconds = getattr(obj, name), list[float]()

    def timed(*args: Any, **kwargs: Any) -> Any:
        if thread is not None and threading.get_ident() != thread:
            return plain(*args, **kwargs)
        t0 = time.perf_counter()
        try:
            return plain(*args, **kwargs)
        finally:
            seconds.append(time.perf_counter() - t0)

    setattr(obj, name, timed)
    return seconds
