"""Every benchmark script runs in its quick mode (small sizes, one repeat, peers skipped when missing, nothing
written to bench/RESULTS.md), so a benchmark that breaks fails CI instead of rotting. Times are printed, never
asserted."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT_S = 600
SCRIPTS = sorted(p.name for p in (ROOT / "bench").glob("*.py"))


def _skip_reason(script: str) -> str | None:
    if script == "soak.py":  # (its two soaks, each a server's start-up and warm-up, are the suite's test_soak.py)
        return "tests/test_soak.py runs bench/soak.py's soaks (soak_generate, soak_embed) and its rows"
    if script == "gpu.py":
        try:
            import azyx

            if not any(d.startswith("cuda") for d in azyx.devices()):
                return "no CUDA device"
            import torch  # noqa: F401
        except ImportError:
            return "no PyTorch for the GPU peer"
    if script == "serve.py":  # (wrk and the MiniLM package are optional: without them, notes)
        for mod in ("starlette", "uvicorn", "httpx", "jinja2", "prometheus_client", "tokenizers"):
            try:
                __import__(mod)
            except ImportError:
                return f"{mod} is not installed"
    return None


def _abort_group(pgid: int) -> None:
    """SIGABRT each process of group `pgid`, the newest first and one at a time (so their stacks do not interleave);
    the leader last."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:  # (state, ppid, pgrp, ...)
            members.append(int(stat.parent.name))
    for pid in sorted(members, key=lambda p: (p == pgid, -p)):
        try:
            os.kill(pid, signal.SIGABRT)
        except ProcessLookupError:
            continue
        time.sleep(1)  # (its stacks written before the next one's)


@pytest.mark.parametrize("script", SCRIPTS)
def test_bench_script_runs_in_quick_mode(script: str, tmp_path: Path) -> None:
    reason = _skip_reason(script)
    if reason is not None:
        pytest.skip(reason)
    out = tmp_path / "RESULTS.md"
    # (PYTHONFAULTHANDLER: a script that hangs is sent SIGABRT at the timeout, and every Python process of its group
    # prints each thread's stack, which the failure then shows: where it hung, not just that it did)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1"}
    # (scale.py's Ray rows start a three-node cluster, 250 s of a CI worker: tests/test_distributed.py runs
    # azyx.distributed on its own cluster, and `bench/scale.py --quick --ray` runs the rows)
    extra = ["--no-ray"] if script == "scale.py" else []
    proc = subprocess.Popen([sys.executable, f"bench/{script}", "--quick", *extra, "--out", str(out)], cwd=ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        _abort_group(proc.pid)
        try:
            stdout, stderr = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired as e:  # still not gone: what it printed up to now
            stdout, stderr = (b.decode(errors="replace") if isinstance(b, bytes) else b or ""
                              for b in (e.stdout, e.stderr))
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        pytest.fail(f"bench/{script} --quick hung for {TIMEOUT_S} s; the stacks of its processes:\n{stderr[-12000:]}"
                    f"\n{stdout[-2000:]}")
    assert proc.returncode == 0, f"bench/{script} --quick failed:\n{stdout[-3000:]}\n{stderr[-3000:]}"
    assert "FAILED" not in stdout and "WRONG RESULT" not in stdout, stdout[-3000:]
