"""The `azyx` command (`python -m azyx`): what this machine offers azyx.

    azyx            the report: version, the native core, every device with its memory and speed estimate, every
                    backend skipped and why, the configuration file and cache directories
    azyx doctor     the report, then a small computation on every device checked against numpy; exits 1 where a
                    device fails or none can run (or the configuration is not one; 2 on a bad command line)
    azyx serve      an OpenAI-compatible server of the models given (`--model DIR`, see azyx.serve; needs the
                    `azyx[serve]` extra)

Each subcommand is a function of its parsed arguments that returns the exit status (`COMMANDS`).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import sys
from collections.abc import Callable
from typing import Any, TextIO

import numpy as np

import azyx
from azyx import config
from azyx.native import native
from azyx.runtime import RT


def version() -> str:
    """azyx's installed version (its package metadata), or "unknown" where it runs from a source tree alone."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as package_version

    try:
        return package_version("azyx")
    except PackageNotFoundError:
        return "unknown"


def native_state() -> str:
    """Whether the native core (azyx/csrc) runs, and why not where it does not."""
    if native is not None:
        return f"built, in use ({native.__file__})"
    if os.environ.get("AZYX_NATIVE", "1") == "0":
        return "off (AZYX_NATIVE=0): the same code runs in Python"
    return "not built (no compiler at install, or built from other sources): the same code runs in Python"


def _mib(nbytes: int) -> str:
    return f"{nbytes / (1 << 20):,.0f} MiB"


def report(out: TextIO, verbose: bool = False) -> list[str]:
    """Write the report to `out` (probing every backend); returns the listed compute devices."""
    names = azyx.devices()
    auto = RT.auto_order()
    print(f"azyx {version()} (Python {sys.version.split()[0]}, numpy {np.__version__})", file=out)
    print(f"native core: {native_state()}", file=out)
    print(f"devices ({len(names)}; AUTO places work on {auto[0] if auto else 'none'}, "
          f"chosen among backends {', '.join(RT.auto_kinds())}):", file=out)
    for name in names:
        dev = RT.device(name)
        what = dev.identity()
        label = what.get("cpu") or what.get("label") or dev.kind
        print(f"  {name:<10} {_mib(dev.capacity):>14} memory, {_mib(dev.free_memory()):>14} free, "
              f"~{dev.compute:,.0f} GFLOP/s (estimate), {dev.threads} threads  {label}", file=out)
    # (a backend off by default, a test device such as the dummy, is not listed as skipped when it is off)
    skipped = [(kind, p.skipped) for kind, p in RT.probes.items() if p.skipped and not (
        p.skipped.startswith("disabled") and not config.DEFAULTS[kind].get("enabled", True))]
    print(f"backends skipped ({len(skipped)}):", file=out)
    for kind, why in skipped:
        print(f"  {kind:<10} {why}", file=out)
    if verbose:
        for kind, p in RT.probes.items():
            print(f"probe of {kind}: {p.seconds * 1e3:.0f} ms", file=out)
            if p.stderr:
                print("  " + p.stderr.rstrip().replace("\n", "\n  "), file=out)
    print(f"config file: {config.config_path()}" + ("" if config.config_path().is_file() else " (none: defaults)"),
          file=out)
    print(f"cache directory (compiled kernels, search winners): {config.cache_dir()}", file=out)
    return names


async def _check(name: str) -> str | None:
    """A small computation on `name` (an elementwise chain and a reduction) against numpy: None when right, else what
    went wrong."""
    xn = np.arange(1, 65, dtype=np.float32)
    try:
        x = azyx.Tensor(xn, device=name)
        got = await ((x * 0.5 + 1).exp().log().sum()).item()
    except Exception as e:  # (a doctor reports every failure; it raises none)
        return f"{type(e).__name__}: {e}"
    want = float((xn * 0.5 + 1).sum())
    return None if abs(got - want) <= 1e-4 * abs(want) else f"wrong result {got} (numpy: {want})"


def info(args: argparse.Namespace) -> int:
    report(sys.stdout, args.verbose)
    return 0


def doctor(args: argparse.Namespace) -> int:
    names = report(sys.stdout, args.verbose)
    working = 0
    print("computing on each device:")
    for name in names:
        problem = asyncio.run(_check(name))
        working += problem is None
        print(f"  {name:<10} {'ok' if problem is None else 'FAILED: ' + problem}")
    if not working:
        print("no device can run azyx's kernels: see the skipped backends above (AZYX_DEBUG=1 says more)",
              file=sys.stderr)
        return 1
    print(f"{working} of {len(names)} devices work")
    return 0 if working == len(names) else 1


def serve_config(args: argparse.Namespace) -> Any:
    """The `ServeConfig` that `azyx serve`'s arguments `args` ask for (the bounds left out keep its defaults)."""
    from azyx.serve import ServeConfig

    def given(*names: str) -> dict[str, Any]:
        return {n: getattr(args, n) for n in names if getattr(args, n) is not None}

    body = dataclasses.replace(ServeConfig().body, **given("max_body_bytes", "body_timeout"))
    return ServeConfig(models=tuple(args.model), device=args.device, slots=args.slots, waiting=args.waiting,
                       host=args.host, port=args.port, api_key=args.api_key or os.environ.get("AZYX_API_KEY"),
                       truncate=args.truncate, body=body,
                       **given("request_timeout", "max_tokens", "max_batch", "max_batch_tokens", "prefill_batch"))


def serve(args: argparse.Namespace) -> int:
    """`azyx serve --model DIR ...`: the OpenAI-compatible server (azyx.serve) under uvicorn, until interrupted."""
    try:
        import uvicorn

        from azyx.serve import KEEP_ALIVE_S, make_app
    except ImportError as e:
        print(f"azyx serve needs its extra: pip install 'azyx[serve]' ({e})", file=sys.stderr)
        return 1
    if not args.model:
        print("azyx serve: give at least one --model DIR", file=sys.stderr)
        return 2
    cfg = serve_config(args)
    app = make_app(cfg)
    print(f"azyx serve: http://{cfg.host}:{cfg.port}/v1 ({', '.join(cfg.models)} on {cfg.device})", flush=True)
    uvicorn.run(app, host=cfg.host, port=cfg.port, log_level=args.log_level, loop="asyncio",
                timeout_keep_alive=KEEP_ALIVE_S)
    return 0


COMMANDS: dict[str, tuple[Callable[[argparse.Namespace], int], str]] = {
    "info": (info, "the report (the default)"),
    "doctor": (doctor, "the report, then a computation on every device; exit status 1 where one fails or none runs"),
    "serve": (serve, "an OpenAI-compatible server (/v1/completions, /v1/chat/completions, /v1/embeddings) of the "
                     "models given"),
}


def _positive(text: str) -> int:
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n


def _serve_arguments(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("--model", action="append", default=[], metavar="DIR",
                    help="a Hugging Face model directory (config.json, model.safetensors, tokenizer); GPT-2 serves "
                         "completions and chat, BERT-family (MiniLM) embeddings; give it twice to serve both")
    sp.add_argument("--device", default="c:0", help="the device the models run on (default c:0)")
    sp.add_argument("--slots", type=int, default=8, help="sequences decoded together (the KV cache's slots)")
    sp.add_argument("--waiting", type=int, default=64, help="requests that may wait for a slot (past that: 429)")
    sp.add_argument("--prefill-batch", type=_positive, default=None, help="prompts of one length bucket that arrive "
                    "together are prefilled in one plan, up to this many (default 1; each batch bucket up to it is "
                    "planned at start-up)")
    sp.add_argument("--host", default="127.0.0.1", help="the address to bind (default 127.0.0.1: this host only)")
    sp.add_argument("--port", type=int, default=8000)
    sp.add_argument("--api-key", default=None, help="requests to /v1/ need `Authorization: Bearer KEY` (or set "
                                                    "AZYX_API_KEY)")
    sp.add_argument("--truncate", action="store_true", help="embeddings: truncate inputs longer than the model's "
                                                             "window (default: refuse them with 400)")
    sp.add_argument("--max-body-bytes", type=int, help="a request body past this many bytes answers 413, before it "
                                                         "is read (default 1 MiB)")
    sp.add_argument("--body-timeout", type=float, help="seconds a client may take to send a body, then 408 (default "
                                                       "10)")
    sp.add_argument("--request-timeout", type=float, help="seconds a request may take, streamed or not, then 408 or "
                                                          "an error event (default 600)")
    sp.add_argument("--max-tokens", type=int, help="the most tokens a request may ask per choice, more: 400 "
                                                   "(default 4096)")
    sp.add_argument("--max-batch", type=_positive, help="embeddings: sentences a batch may hold (default 32)")
    sp.add_argument("--max-batch-tokens", type=_positive, help="embeddings: padded tokens (sentences x the longest) a "
                                                         "batch may hold, as TEI's; the batch shapes planned at load "
                                                         "follow from it (default 2048)")
    sp.add_argument("--log-level", default="warning", help="uvicorn's log level")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="azyx", description="azyx: an asyncio-native lazy tensor runtime")
    p.add_argument("-v", "--verbose", action="store_true", help="also each probe's time and what drivers printed")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in COMMANDS.items():
        sp = sub.add_parser(name, help=help_text)
        sp.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                        help="also each probe's time and what drivers printed")
        if name == "serve":
            _serve_arguments(sp)
    return p


def main(argv: list[str] | None = None) -> int:
    """The `azyx` command's entry point: returns its exit status."""
    args: Any = parser().parse_args(argv)
    fn, _ = COMMANDS[args.command or "info"]
    try:
        return fn(args)
    except azyx.AzyxError as e:  # (a configuration that is not one, say: said plainly, no traceback)
        print(f"azyx: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
