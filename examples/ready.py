"""Time to ready, for the example services: from the script's start (this module's import, the examples' first), a
thread asks GET /health every 50 ms while the model loads (it answers meanwhile: 503 "loading"), then, once it says
200, sends one real request and prints the seconds from start to that request's answer, with how many /health
answers came while loading and the slowest of them:

    ready: first request (POST /v1/embeddings) answered 3.42 s after start; /health answered 61 times while the
    model loaded, the slowest in 4 ms
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from typing import Any

STARTED = time.perf_counter()
POLL_S = 0.05


def watch(base: str, path: str, body: dict[str, Any]) -> threading.Thread:
    """Start the watching thread (a daemon) for the service at `base` (http://host:port): `body` is the JSON of the
    first request, POSTed to `path` once /health says the service serves."""

    def run() -> None:
        polls, slowest = 0, 0.0
        while True:
            t0 = time.perf_counter()
            try:
                with urllib.request.urlopen(base + "/health", timeout=60) as r:
                    status = r.status
            except urllib.error.HTTPError as e:
                status = e.code
            except OSError:  # (not listening yet)
                time.sleep(POLL_S)
                continue
            slowest = max(slowest, time.perf_counter() - t0)
            if status == 200:
                break
            polls += 1
            if status != 503:
                print(f"ready: GET /health answered {status}: not loading, not serving", flush=True)
                return
            time.sleep(POLL_S)
        req = urllib.request.Request(base + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=600) as r:
                r.read()
        except (OSError, urllib.error.HTTPError) as e:
            print(f"ready: the first request (POST {path}) failed: {e}", flush=True)
            return
        print(f"ready: first request (POST {path}) answered {time.perf_counter() - STARTED:.2f} s after start; "
              f"/health answered {polls} times while the model loaded, the slowest in {slowest * 1e3:.0f} ms",
              flush=True)

    thread = threading.Thread(target=run, name="ready-watch", daemon=True)
    thread.start()
    return thread
