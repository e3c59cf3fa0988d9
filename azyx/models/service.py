"""What a model service needs to keep one request from hurting another, independent of the web framework: request
bodies read with a size limit (checked before reading, and while streaming) and a time limit, parsed off the loop
when large, nesting bombs refused; every field of a body checked against what the kernels take (ints that fit
int32, finite numbers in range, strings that encode as UTF-8, lists of bounded length), a bad one raising
`BadRequest` that names it; work dropped when its client leaves (`until_disconnect`); large answers encoded off the
loop (`json_bytes`). `azyx serve` (azyx.serve) uses it.

    try:
        body = await read_json(request.headers, request.stream(), limits)
        temperature = number(body, "temperature", 0.0, low=0.0, high=FLOAT32_MAX)
    except BadRequest as e:
        return JSONResponse({"error": str(e), "field": e.field}, e.status)
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from azyx.errors import ArgumentError
from azyx.workers import in_worker_thread

INT32_MAX = (1 << 31) - 1
FLOAT32_MAX = 3.4028234663852886e38
OFF_LOOP_BYTES = 1 << 16  # bodies and answers past this size are parsed / encoded on a worker thread
T = TypeVar("T")


class BadRequest(ArgumentError):
    """A request the service refuses: `field` names the offending field ("body" for the body itself), `status` is
    the HTTP status to answer (400; 413 for a body over the limit; 408 for a body not sent in time)."""

    def __init__(self, field: str, message: str, status: int = 400):
        super().__init__(f"{field}: {message}")
        self.field, self.status = field, status


class ClientGone(Exception):
    """The client disconnected before its answer was ready (its work was cancelled)."""


@dataclass(frozen=True)
class Limits:
    """Per-request bounds of a body: its bytes (checked against Content-Length before reading, and while streaming)
    and the seconds to receive it."""

    max_body_bytes: int = 1 << 20
    body_timeout: float = 10.0


def short(value: Any, limit: int = 60) -> str:
    """repr(value) cut to `limit` characters (a value in an error message may be as long as its sender made it)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 128:
        return f"an int of {len(str(value)) if value.bit_length() < 10_000 else 'many'} digits"
    r = repr(value)
    return r if len(r) <= limit else r[: limit - 3] + "..."


async def read_json(headers: Mapping[str, str], chunks: AsyncIterator[bytes], limits: Limits = Limits()) -> Any:
    """The JSON value of a request body: its Content-Length checked before anything is read, the bytes counted as
    they stream in (a body without a length, or longer than it said, stops at the limit), all of it within
    `body_timeout` seconds; parsed on a worker thread when large. Raises BadRequest (413, 408 or 400)."""
    length = headers.get("content-length")
    if length is not None:
        if not length.isdigit():
            raise BadRequest("body", f"Content-Length {short(length)} is not a number")
        if int(length) > limits.max_body_bytes:
            raise BadRequest("body", f"{length} bytes exceed the limit of {limits.max_body_bytes}", 413)
    parts: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(limits.body_timeout):
            async for chunk in chunks:
                size += len(chunk)
                if size > limits.max_body_bytes:
                    raise BadRequest("body", f"more than the limit of {limits.max_body_bytes} bytes", 413)
                parts.append(chunk)
    except TimeoutError:
        raise BadRequest("body", f"not received within {limits.body_timeout} s", 408) from None
    raw = b"".join(parts)
    return await in_worker_thread(parse_json, raw) if len(raw) > OFF_LOOP_BYTES else parse_json(raw)


def parse_json(raw: bytes) -> Any:
    """json.loads, with every failure (bad UTF-8, bad JSON, nesting past the parser's depth) as BadRequest."""
    try:
        return json.loads(raw)
    except RecursionError:
        raise BadRequest("body", "the JSON is nested too deeply") from None
    except ValueError as e:
        raise BadRequest("body", f"the body is not JSON ({short(str(e), 80)})") from None


async def json_bytes(value: Any, off_loop: bool = True) -> bytes:
    """`value` as compact JSON bytes (NaN and infinities refused: ValueError), encoded on a worker thread unless
    `off_loop` is False (a small answer: the thread's hop would cost more than the encoding)."""
    return await in_worker_thread(_dumps, value) if off_loop else _dumps(value)


def _dumps(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":"), allow_nan=False).encode()


# ------------------------------------------------------------------------------------------------ fields
def body_object(body: Any, expected: str) -> dict[str, Any]:
    """The body as a JSON object, else BadRequest naming what was expected."""
    if not isinstance(body, dict):
        raise BadRequest("body", f"expected {expected}, got {type(body).__name__}")
    return body


def integer(body: Mapping[str, Any], name: str, default: int | None, low: int = 0, high: int = INT32_MAX
            ) -> int | None:
    """Field `name`: an int in [low, high] (JSON's 2.0 is refused: an integer is asked for), or `default` if absent
    or null."""
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise BadRequest(name, f"must be an integer, got {short(v)}")
    if not low <= v <= high:
        raise BadRequest(name, f"must be in [{low}, {high}], got {short(v)}")
    return v


def number(body: Mapping[str, Any], name: str, default: float, low: float = -FLOAT32_MAX,
           high: float = FLOAT32_MAX, low_open: bool = False) -> float:
    """Field `name`: a finite number in [low, high] ((low, high] with `low_open`) that float32 holds, as a float, or
    `default` if absent or null."""
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise BadRequest(name, f"must be a number, got {short(v)}")
    try:
        f = float(v)
    except OverflowError:
        f = math.inf
    if not math.isfinite(f) or f < low or f > high or (low_open and f == low):
        interval = f"{'(' if low_open else '['}{low:g}, {high:g}]"
        raise BadRequest(name, f"must be a finite number in {interval}, got {short(v)}")
    return f


def query_number(params: Mapping[str, str], name: str, default: float, low: float, high: float) -> float:
    """A URL query parameter `name` as a finite number in [low, high], or `default` if absent."""
    v = params.get(name)
    if v is None:
        return default
    try:
        f = float(v)
    except ValueError:
        raise BadRequest(name, f"must be a number, got {short(v)}") from None
    if not (math.isfinite(f) and low <= f <= high):
        raise BadRequest(name, f"must be a finite number in [{low:g}, {high:g}], got {short(v)}")
    return f


def flag(body: Mapping[str, Any], name: str, default: bool) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise BadRequest(name, f"must be true or false, got {short(v)}")
    return v


def text(body: Mapping[str, Any], name: str, max_chars: int, required: bool = True) -> str | None:
    """Field `name`: a string of at most `max_chars` characters that encodes as UTF-8 (no lone surrogate)."""
    v = body.get(name)
    if v is None and not required:
        return None
    return _string(name, v, max_chars)


def texts(body: Mapping[str, Any], name: str, max_items: int, max_chars: int, default: list[str] | None = None,
          non_empty: bool = False) -> list[str]:
    """Field `name`: a list of at most `max_items` strings, each at most `max_chars` characters (non-empty with
    `non_empty`) that encode as UTF-8; the item named by its index (`sentences[3]`)."""
    v = body.get(name)
    if v is None and default is not None:
        return default
    if not isinstance(v, list):
        raise BadRequest(name, f"must be a list of strings, got {short(v)}")
    if len(v) > max_items:
        raise BadRequest(name, f"{len(v)} items exceed the limit of {max_items}", 413)
    out = [_string(f"{name}[{i}]", s, max_chars) for i, s in enumerate(v)]
    if non_empty and not all(out):
        raise BadRequest(f"{name}[{out.index('')}]", "must not be empty")
    return out


def _string(name: str, v: Any, max_chars: int) -> str:
    if not isinstance(v, str):
        raise BadRequest(name, f"must be a string, got {short(v)}")
    if len(v) > max_chars:
        raise BadRequest(name, f"{len(v)} characters exceed the limit of {max_chars}", 413)
    try:
        v.encode("utf-8")
    except UnicodeEncodeError as e:
        raise BadRequest(name, f"is not valid Unicode ({e.reason}: {short(v[e.start:e.end])} at index {e.start})"
                         ) from None
    return v


# ------------------------------------------------------------------------------------------------ disconnects
async def until_disconnect(receive: Callable[[], Awaitable[Mapping[str, Any]]]) -> None:
    """Returns when the ASGI client disconnects (call it once the body has been read: before, it would take the
    body's `http.request` messages). Past the body, an ASGI server answers `receive()` only when the connection is
    lost or the response complete (uvicorn may also wake it with an empty `http.request`, skipped here), so this
    never returns while a client that stays waits for a streamed answer."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def unless_gone(work: Awaitable[T], receive: Callable[[], Awaitable[Mapping[str, Any]]]) -> T:
    """`await work`, cancelled at once if the client disconnects first (then ClientGone): whatever the work queued
    for that client is dropped by its cancellation."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(until_disconnect(receive))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
            try:
                await task
            except BaseException:  # (its cancellation, or a failure nobody waits for any more)
                pass
        watch.cancel()
    if task.cancelled():
        raise ClientGone("the client disconnected")
    return task.result()
