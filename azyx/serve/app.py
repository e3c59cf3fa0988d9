"""The OpenAI-compatible server as an ASGI app (`make_app(ServeConfig(models=[DIR, ...]))`, served by uvicorn).

Endpoints (OpenAI's request and response shapes; unknown fields are ignored, as vLLM does):
- `POST /v1/completions`: `prompt` a string, a list of strings, token ids or lists of them; `max_tokens` (16),
  `temperature` (1.0; 0: greedy), `top_p`, `n`, `stop` (a string or a list: matched on the decoded text across
  token boundaries, never returned), `seed` (choice i of n draws with seed + i), `logprobs` (0-5: each token's
  log-probability under the model and the most likely tokens'), `echo`, `stream` (server-sent events ending with
  `data: [DONE]`; `stream_options.include_usage`), `presence_penalty`, `frequency_penalty`, `logit_bias`, and
  vLLM's extras `top_k`, `min_p`, `repetition_penalty`, `stop_token_ids`, `ignore_eos` (every sampling value is
  data on the device: a new value compiles nothing; a stop token, of `stop_token_ids` or the model's eos unless
  `ignore_eos`, ends its choice with finish_reason "stop" and is not returned, where vLLM returns one that is not a
  special token). `echo` with `logprobs` scores the prompt too (one forward pass:
  each prompt token's log-probability given those before it, null for the first, as OpenAI and vLLM answer; with
  `max_tokens: 0`, the prompt alone). `best_of` (>= n, not streamed) generates best_of choices per prompt (choice i
  seeded seed + i) and answers the n whose tokens have the highest summed log-probability under the model, as vLLM
  did; `usage` counts every token generated. `suffix` answers 400 naming it (no insertion; vLLM refuses it too).
- `POST /v1/chat/completions`: `messages` rendered by the model directory's chat template (tokenizer_config.json's
  `chat_template`, jinja2 in a sandbox) or, for a model without one, `DEFAULT_CHAT_TEMPLATE` (one `role: content`
  line per message, then `assistant:`); `max_tokens` / `max_completion_tokens`, `logprobs` (bool) with
  `top_logprobs` (0-20), streaming deltas; the same sampling fields as completions.
- `POST /v1/embeddings`: `input` a string, a list of strings, token ids or lists of them; `encoding_format`
  "float" (each number the shortest of at most 9 significant digits that reads back as the float32 value:
  `short_floats`) or "base64" (little-endian float32); both exact; inputs batched
  dynamically by the service (`max_batch_tokens` padded tokens per batch, as TEI); an input longer than the model's
  window is refused (400 naming it) or, with `truncate`, truncated.
- `GET /v1/models`; `GET /health` (200 {"status": "ok"} once every model serves, 503 {"status": "loading"} while
  the weights load: it answers from the start); `GET /metrics` (Prometheus text: requests by route and status,
  prompt and generated tokens, time to first token and inter-token latency histograms, queue depth, slots in use,
  the event loop's heartbeat lateness; read-only, nothing a client sends resets any of it).

Behaviour: errors are OpenAI's body `{"error": {"message", "type", "param", "code"}}`: 400 a bad field (named in
`param`), 401 a missing or wrong API key (`api_key`: `Authorization: Bearer KEY` on /v1/*), 404 an unknown route
or model, 408 a body not sent in time or a request past `request_timeout`, 413 a body over `max_body_bytes` (or too
many inputs, or characters), 422 a body that is JSON but not an object, 429 with `Retry-After` when every slot and
waiting place is taken (or the embedding queue is full), 503 while loading. Every bound is checked before work
starts; a client that disconnects has its sequences removed (their KV-cache slots free at once) and its queued
embeddings dropped; a request's tokens are bounded (`max_tokens`, prompt tokens by the KV cache's window, `n`,
prompts per request), long texts are tokenized on a worker thread, large answers encoded off the loop.
"""

from __future__ import annotations

import asyncio
import base64
import gc
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from azyx.errors import ArgumentError, AzyxError, AzyxIOError
from azyx.models import service as svc
from azyx.models.bert import BATCH_TOKENS, EmbeddingService, MiniLM, QueueFull
from azyx.models.gpt2 import GPT2, Engine, NoFreeSlotError, TokenStream, load_tokenizer
from azyx.models.text import TextStream
from azyx.stats import Heartbeat
from azyx.workers import in_worker_thread

if TYPE_CHECKING:
    from starlette.requests import Request
    from starlette.responses import Response

GENERATION_TYPES = ("gpt2",)
EMBEDDING_TYPES = ("bert", "roberta", "xlm-roberta", "distilbert", "mpnet")  # (config.json's model_type)
DEFAULT_CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                         "{% if add_generation_prompt %}assistant:{% endif %}")
WARM_PROMPTS = (1, 2, 4, 8, 16, 32)  # prompt-length buckets planned at start-up
TOKENIZE_ON_LOOP_CHARS = 2048  # a longer text is tokenized on a worker thread
ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/v1/models", "/health", "/metrics")
MAX_LOGIT_BIAS = 300  # token ids a logit_bias may name (OpenAI's limit)
ROLES = ("system", "developer", "user", "assistant", "tool")
ARRIVED = "azyx.arrived"  # the ASGI scope's key of a request's arrival time (perf_counter), set by `Outer`


# how long an idle connection stays open: longer than clients keep theirs (5 s in httpx, which the openai package
# uses; uvicorn's own default is 5 s too), so no client sends a request on a connection the server is closing at that
# moment (the client would see a reset, httpx.ReadError, with no way to know whether the request was received)
KEEP_ALIVE_S = 75


@dataclass(frozen=True)
class ServeConfig:
    """What `azyx serve` serves and its bounds: `models` (directories), the device, KV-cache `slots` and requests
    that may `waiting` for one (past both: 429), the address (127.0.0.1 unless told otherwise), an optional API key,
    and per-request limits."""

    models: tuple[str, ...] = ()
    device: str = "c:0"
    slots: int = 8
    waiting: int = 64
    prefill_batch: int = 1  # waiting prompts of one length bucket prefilled in one plan (Engine.prefill_batch)
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    body: svc.Limits = field(default_factory=lambda: svc.Limits(max_body_bytes=1 << 20))
    request_timeout: float = 600.0  # seconds a request may take, streamed or not (then 408, or an error event)
    max_tokens: int = 4096  # the most tokens a request may ask per choice
    max_n: int = 16  # choices per request
    max_prompts: int = 32  # prompts per completions request (times n: at most max_choices sequences)
    max_choices: int = 64
    max_prompt_chars: int = 65_536
    max_stop: int = 16
    max_stop_chars: int = 256
    max_messages: int = 256
    max_inputs: int = 256  # embedding inputs per request
    max_input_chars: int = 16_384
    max_batch: int = 32  # embedding batch sentences
    max_batch_tokens: int = BATCH_TOKENS  # padded tokens per embedding batch (its shapes are planned at load)
    max_queued: int = 4096  # embedding sentences waiting
    truncate: bool = False  # embeddings: truncate inputs past the model's window (else 400)
    warmup: bool = True  # plan and compile the common shapes before serving


class ApiError(Exception):
    """An answer in OpenAI's error shape: HTTP `status`, `message`, `type`, `param` (the field), `code`."""

    def __init__(self, status: int, message: str, param: str | None = None, type: str = "invalid_request_error",
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _api_error(e: BaseException) -> ApiError:
    """The API error of an exception a handler raised (its own, a bad field's, a full queue's)."""
    if isinstance(e, ApiError):
        return e
    if isinstance(e, svc.BadRequest):
        code = {413: "request_too_large", 408: "timeout"}.get(e.status)
        return ApiError(e.status, str(e), e.field, code=code)
    if isinstance(e, NoFreeSlotError | QueueFull):
        return ApiError(429, str(e), type="rate_limit_error", code="rate_limit_exceeded", headers={"Retry-After": "1"})
    if isinstance(e, ArgumentError):
        return ApiError(400, str(e))
    return ApiError(500, f"{type(e).__name__}: {e}", type="server_error")


# ------------------------------------------------------------------------------------------------ models
@dataclass
class Generator:
    """A generation model being served: its engine, tokenizer and chat template."""

    name: str
    engine: Engine
    tokenizer: Any
    chat_template: str
    specials: dict[str, str]


@dataclass
class Embedder:
    """An embedding model being served: the model and its batching service."""

    name: str
    model: MiniLM
    service: EmbeddingService


def model_type(directory: str | Path) -> str:
    """config.json's `model_type` of a model directory (AzyxIOError naming the file if unreadable)."""
    path = Path(directory) / "config.json"
    try:
        return str(json.loads(path.read_text()).get("model_type", ""))
    except (OSError, ValueError) as e:
        raise AzyxIOError(f"{path}: cannot read the model config ({e})") from None


def chat_template(directory: str | Path) -> tuple[str, dict[str, str]]:
    """The chat template of tokenizer_config.json (its default one where it names several), or
    DEFAULT_CHAT_TEMPLATE; and the special tokens a template may use (bos_token, eos_token)."""
    path = Path(directory) / "tokenizer_config.json"
    cfg = json.loads(path.read_text()) if path.is_file() else {}
    template = cfg.get("chat_template") or DEFAULT_CHAT_TEMPLATE
    if isinstance(template, list):  # [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None) or DEFAULT_CHAT_TEMPLATE
    specials = {}
    for key in ("bos_token", "eos_token"):
        v = cfg.get(key)
        specials[key] = v.get("content", "") if isinstance(v, dict) else str(v or "")
    return str(template), specials


def _model_name(directory: str | Path) -> str:
    return Path(directory).resolve().name


# ------------------------------------------------------------------------------------------------ metrics
class Metrics:
    """The server's Prometheus metrics, in a registry of its own (read by GET /metrics; nothing resets them)."""

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = r = CollectorRegistry()
        self.requests = Counter("azyx_requests", "HTTP requests by route and status", ["route", "status"], registry=r)
        self.prompt_tokens = Counter("azyx_prompt_tokens", "Prompt (and embedded input) tokens", ["model"],
                                     registry=r)
        self.generated_tokens = Counter("azyx_generation_tokens", "Generated tokens", ["model"], registry=r)
        latency = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
        self.ttft = Histogram("azyx_time_to_first_token_seconds", "Time from a request to its first token",
                              ["model"], buckets=latency, registry=r)
        self.itl = Histogram("azyx_inter_token_latency_seconds", "Time between a stream's tokens", ["model"],
                             buckets=latency, registry=r)
        self.queue_depth = Gauge("azyx_queue_depth", "Requests waiting for a KV-cache slot and embedding inputs "
                                 "waiting for a batch", registry=r)
        self.slots_in_use = Gauge("azyx_slots_in_use", "KV-cache slots holding a sequence", registry=r)
        self.slots = Gauge("azyx_slots", "KV-cache slots", registry=r)
        self.lateness = Gauge("azyx_heartbeat_lateness_seconds", "The event loop's worst heartbeat lateness over "
                              "the last 10 seconds", registry=r)
        self.worst_lateness = Gauge("azyx_heartbeat_worst_lateness_seconds", "The event loop's worst heartbeat "
                                    "lateness since serving began", registry=r)


# ------------------------------------------------------------------------------------------------ fields
def _choice_count(body: dict[str, Any], cfg: ServeConfig, stream: bool) -> tuple[int, int]:
    """`n`, the choices answered per prompt, and `best_of`, the sequences generated per prompt (n by default; more:
    the n of highest cumulative log-probability are answered, as vLLM does; never streamed)."""
    n = svc.integer(body, "n", 1, low=1, high=cfg.max_n)
    assert n is not None
    best_of = svc.integer(body, "best_of", n, low=1, high=cfg.max_n)
    assert best_of is not None
    if best_of < n:
        raise ApiError(400, f"best_of={best_of} must be at least n={n}", "best_of")
    if stream and best_of > n:
        raise ApiError(400, f"best_of={best_of} > n={n} cannot be streamed (the best are known at the end)",
                       "best_of")
    return n, best_of


def _best(choices: list[Choice], per: int, keep: int) -> list[Choice]:
    """Of each prompt's `per` finished choices (in order), the `keep` of highest cumulative log-probability (the sum
    of their tokens' under the model), indexed again prompt by prompt."""
    out = []
    for p in range(0, len(choices), per):
        group = sorted(choices[p: p + per], key=lambda c: -sum(lp for _, lp, _ in c.logprobs))[:keep]
        for j, c in enumerate(group):
            c.index = p // per * keep + j
            out.append(c)
    return out


def _penalties(body: dict[str, Any], vocab: int) -> dict[str, Any]:
    """The penalties, logit_bias ({"token id": value in [-100, 100]}, at most MAX_LOGIT_BIAS) and min_p of a body;
    `suffix` (not supported) answers 400."""
    if body.get("suffix") is not None:
        raise ApiError(400, "suffix is not supported by azyx serve", "suffix", code="unsupported")
    bias = body.get("logit_bias") or {}
    if not isinstance(bias, dict) or len(bias) > MAX_LOGIT_BIAS:
        raise ApiError(400, f"must be an object of at most {MAX_LOGIT_BIAS} token ids, got {svc.short(bias)}",
                       "logit_bias")
    pairs = []
    for k, v in bias.items():
        if not (isinstance(k, str) and k.isdigit() and int(k) < vocab):
            raise ApiError(400, f"key {svc.short(k)} is not a token id of the vocabulary of {vocab}", "logit_bias")
        name = f"logit_bias.{k}"
        pairs.append((int(k), svc.number({name: v}, name, 0.0, low=-100.0, high=100.0)))
    return {"presence_penalty": svc.number(body, "presence_penalty", 0.0, low=-2.0, high=2.0),
            "frequency_penalty": svc.number(body, "frequency_penalty", 0.0, low=-2.0, high=2.0),
            "repetition_penalty": svc.number(body, "repetition_penalty", 1.0, low=0.0, high=1e3, low_open=True),
            "min_p": svc.number(body, "min_p", 0.0, low=0.0, high=1.0), "logit_bias": tuple(pairs)}


def _stops(body: dict[str, Any], cfg: ServeConfig) -> list[str]:
    v = body.get("stop")
    if v is None:
        return []
    if isinstance(v, str):
        v = [v]
        body = {**body, "stop": v}
    return svc.texts(body, "stop", cfg.max_stop, cfg.max_stop_chars, non_empty=True)


def _token_ids(v: Any, name: str, vocab: int, limit: int) -> list[int]:
    if not v or len(v) > limit:
        raise ApiError(400, f"must hold 1 to {limit} token ids, got {len(v)}", name)
    for i, t in enumerate(v):
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
            raise ApiError(400, f"token id {svc.short(t)} at {i} is not in the vocabulary of {vocab}", name)
    return list(v)


def _sampling(body: dict[str, Any], cfg: ServeConfig, g: Generator, max_tokens_field: str = "max_tokens"
              ) -> dict[str, Any]:
    """The engine's arguments of a completions or chat body (each bad field: 400 naming it)."""
    vocab = g.engine.model.config.vocab_size
    max_tokens = svc.integer(body, max_tokens_field, None, low=0, high=cfg.max_tokens)
    if max_tokens is None and max_tokens_field != "max_tokens":
        max_tokens = svc.integer(body, "max_tokens", None, low=0, high=cfg.max_tokens)
    top_k = svc.integer(body, "top_k", 0, low=-1)
    stop_ids = body.get("stop_token_ids")
    if stop_ids is not None and not isinstance(stop_ids, list):
        raise ApiError(400, f"must be a list of token ids, got {svc.short(stop_ids)}", "stop_token_ids")
    return {
        "max_new_tokens": 16 if max_tokens is None else max_tokens,
        "temperature": svc.number(body, "temperature", 1.0, low=0.0, high=2.0),
        "top_p": svc.number(body, "top_p", 1.0, low=0.0, high=1.0, low_open=True),
        "top_k": 0 if top_k is None or top_k < 0 else top_k,
        "seed": svc.integer(body, "seed", None, low=0, high=(1 << 63) - 1),
        "ignore_eos": svc.flag(body, "ignore_eos", False),
        "stop_token_ids": _token_ids(stop_ids, "stop_token_ids", vocab, cfg.max_stop) if stop_ids else [],
        **_penalties(body, vocab),
    }


def _stream_options(body: dict[str, Any], stream: bool) -> bool:
    opts = body.get("stream_options")
    if opts is None:
        return False
    if not isinstance(opts, dict):
        raise ApiError(400, f"must be an object, got {svc.short(opts)}", "stream_options")
    if not stream:
        raise ApiError(400, "stream_options is only allowed with stream: true", "stream_options")
    return svc.flag(opts, "include_usage", False)


# ------------------------------------------------------------------------------------------------ choices
@dataclass
class Choice:
    """One sequence of a request: its stream, its text so far, its tokens' log-probabilities when asked."""

    index: int
    stream: TokenStream
    text: TextStream
    prompt_text: str = ""
    prompt_logprobs: list[tuple[int, float | None, list[tuple[int, float]] | None]] = field(default_factory=list)
    pieces: list[str] = field(default_factory=list)
    logprobs: list[tuple[int, float, list[tuple[int, float]]]] = field(default_factory=list)  # (token, lp, top)
    finish_reason: str | None = None


Emit = Callable[[Choice, str, list[tuple[int, float, list[tuple[int, float]]]], str | None], None]


async def _drive(choice: Choice, g: Generator, metrics: Metrics, started: float, emit: Emit) -> None:
    """Read `choice`'s tokens into text (whole characters, stop strings cut), handing each new piece to `emit` with
    the tokens' log-probabilities since the last piece; then its end (`finish_reason`)."""
    stream, text = choice.stream, choice.text
    last, count = started, 0
    pending: list[tuple[int, float, list[tuple[int, float]]]] = []
    async for token in stream:
        now = time.perf_counter()
        (metrics.itl if count else metrics.ttft).labels(g.name).observe(now - last)
        last = now
        metrics.generated_tokens.labels(g.name).inc()
        if stream.seq.params.logprobs is not None:
            lp, top = stream.logprobs[count]
            pending.append((token, lp, top))
        count += 1
        piece = text.push(token)
        if piece or pending:
            emit(choice, piece, pending, None)
            pending = []
        if text.stopped is not None:  # a stop string completed on the text: it was never handed out
            stream.cancel("stop")
            break
    rest = text.flush()
    reason = stream.finish_reason
    # ("stop": a stop string or token; "length": max_tokens or the window; a stream cut short, by a timeout or its
    # client leaving, keeps its own reason)
    choice.finish_reason = "stop" if text.stopped is not None or reason == "stop" else reason or "length"
    emit(choice, rest, pending, choice.finish_reason)


def _completion_logprobs(g: Generator, entries: list[Any], offset: int) -> dict[str, Any]:
    """The completions API's logprobs object of some tokens (token, log-probability, top tokens) whose text starts
    at `offset`; an echoed prompt's first token has neither (null, as OpenAI and vLLM answer)."""
    dec = g.tokenizer.decode
    tokens = [dec([t]) for t, _, _ in entries]
    offsets = []
    for s in tokens:
        offsets.append(offset)
        offset += len(s)
    return {"tokens": tokens, "token_logprobs": [lp for _, lp, _ in entries],
            "top_logprobs": [None if top is None else {dec([t]): lp for t, lp in top} for _, _, top in entries],
            "text_offset": offsets}


def _chat_logprobs(g: Generator, entries: list[tuple[int, float, list[tuple[int, float]]]]) -> dict[str, Any]:
    """The chat API's logprobs object ({"content": [...]}) of some tokens."""
    dec = g.tokenizer.decode

    def one(t: int, lp: float) -> dict[str, Any]:
        s = dec([t])
        return {"token": s, "logprob": lp, "bytes": list(s.encode())}

    return {"content": [{**one(t, lp), "top_logprobs": [one(u, ulp) for u, ulp in top]} for t, lp, top in entries]}


# ------------------------------------------------------------------------------------------------ the app
def make_app(config: ServeConfig) -> Any:
    """The server as an ASGI app (Starlette inside an outer layer that counts requests and checks the API key). The
    models load in the background at start-up (GET /health answers meanwhile); `app.state.ready` is set once every
    one serves, `app.state.serving` holds them ("generators", "embedders" by name) and the loop's heartbeat ("beat")."""
    return Server(config).app()


def _model_kinds(cfg: ServeConfig) -> dict[str, str]:
    """Each model directory's `model_type` (ArgumentError for no directory, a type not served, or two models of
    one name)."""
    if not cfg.models:
        raise ArgumentError("azyx serve needs at least one model directory")
    kinds = {}
    for d in cfg.models:
        t = model_type(d)
        if t not in GENERATION_TYPES + EMBEDDING_TYPES:
            raise ArgumentError(f"{d}: model_type {t!r} is not served (generation: {', '.join(GENERATION_TYPES)}; "
                                f"embeddings: {', '.join(EMBEDDING_TYPES)})")
        kinds[d] = t
    names = [_model_name(d) for d in cfg.models]
    if len(set(names)) != len(names):
        raise ArgumentError(f"two models share a name (their directories' names): {names}")
    return kinds


def _error_response(e: BaseException) -> Response:
    from starlette.responses import JSONResponse

    err = _api_error(e)
    return JSONResponse(err.body(), err.status, headers=err.headers)


def _event(data: Any) -> bytes:
    """One server-sent event."""
    return b"data: " + json.dumps(data, ensure_ascii=False).encode() + b"\n\n"


Shape = Callable[[Choice, str, list[Any], str | None, bool], dict[str, Any]]


@dataclass
class Reply:
    """A request's running choices and what answering them needs: `shape` makes each choice's entry (its text, its
    tokens' log-probabilities, its finish_reason; the last argument: streamed), `first` a streamed choice's opening
    entry (or None), `obj` names the answer's object; `include_usage`: a streamed answer ends with the usage."""

    g: Generator
    request: Request
    choices: list[Choice]
    prompt_tokens: int
    shape: Shape
    obj: str
    first: Callable[[Choice], dict[str, Any] | None]
    include_usage: bool = False
    rid: str = field(init=False)
    created: int = field(init=False)
    started: float = field(init=False)

    def __post_init__(self) -> None:
        self.rid = f"{'chatcmpl' if self.obj.startswith('chat') else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        # (time to first token: from the request's arrival)
        self.started = self.request.scope.get(ARRIVED, time.perf_counter())

    def usage(self) -> dict[str, int]:
        done = sum(len(c.stream.tokens) for c in self.choices)
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": done,
                "total_tokens": self.prompt_tokens + done}

    def cancel_all(self) -> None:
        for c in self.choices:
            c.stream.cancel()

    def chunk(self, entries: list[dict[str, Any]]) -> dict[str, Any]:
        """A streamed answer's chunk of some choices' entries."""
        obj = self.obj + ".chunk" if self.obj.startswith("chat") else self.obj
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.g.name, "choices": entries}

    def whole(self, per: int, keep: int) -> dict[str, Any]:
        """The answer of the finished choices: of each prompt's `per` choices the `keep` best (best_of; usage counts
        every token generated)."""
        kept = _best(self.choices, per, keep) if per > keep else self.choices
        return {"id": self.rid, "object": self.obj, "created": self.created, "model": self.g.name,
                "choices": [self.shape(c, c.prompt_text + "".join(c.pieces), c.logprobs, c.finish_reason, False)
                            for c in kept], "usage": self.usage()}



def short_floats(a: np.ndarray) -> list[Any]:
    """float32 values as the doubles nearest their decimals of 9 significant digits, as (nested) lists: each reads
    back as its float32 value (9 digits always do) and JSON writes it in at most 9 digits, where the double of the
    float32 value itself takes 17 (a 384-float embedding: 8.1 kB and ~260 us of JSON on the loop; this: 5.5 kB,
    ~160 us). Zeros, infinities and NaN stay as they are."""
    x = a.astype(np.float64)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        k = 8 - np.floor(np.log10(np.abs(x)))  # (10^k scales the value to 9 digits before the point)
    # 10^k exact (|k| <= 22): the product or quotient that undoes it rounds once, to the decimal's nearest double
    exact = np.isfinite(k) & (np.abs(k) <= 22)
    k = np.where(exact, k, 0)
    scale = np.power(10.0, np.abs(k))
    y = np.where(exact, np.where(k >= 0, np.round(x * scale) / scale, np.round(x / scale) * scale), x)
    flat = y.reshape(-1)
    for i in np.flatnonzero(np.isfinite(flat) & ~exact.reshape(-1) & (flat != 0)):  # (below 1e-14, above 1e30)
        flat[i] = float(f"{flat[i]:.9g}")
    return y.tolist()


class Server:
    """What a served app's routes share: the config, the models by name (loaded in the background at start-up:
    `ready` once every one serves, else `state["error"]`), the metrics and the loop's heartbeat. Its methods are the
    routes, the checks of their fields, and the running and answering of choices."""

    def __init__(self, cfg: ServeConfig):
        self.cfg = cfg
        self.kinds = _model_kinds(cfg)
        self.metrics = Metrics()
        self.beat = Heartbeat()
        self.generators: dict[str, Generator] = {}
        self.embedders: dict[str, Embedder] = {}
        self.ready = asyncio.Event()
        self.state: dict[str, Any] = {"error": None, "created": int(time.time())}

    def app(self) -> Outer:
        """The ASGI app of the routes, inside `Outer`; its state holds `ready`, the config, the metrics and
        `serving` (the models by kind and name, the load state, the heartbeat)."""
        from starlette.applications import Starlette
        from starlette.exceptions import HTTPException
        from starlette.routing import Route

        routes = [Route("/v1/completions", self.answering(self.completions), methods=["POST"]),
                  Route("/v1/chat/completions", self.answering(self.chat), methods=["POST"]),
                  Route("/v1/embeddings", self.answering(self.embeddings), methods=["POST"]),
                  Route("/v1/models", self.models), Route("/health", self.health), Route("/metrics", self.metrics_page)]
        inner = Starlette(routes=routes, lifespan=self.lifespan, exception_handlers={HTTPException: self.http_error})
        app = Outer(inner, self.metrics, self.cfg.api_key)
        app.state.ready, app.state.config, app.state.metrics = self.ready, self.cfg, self.metrics
        app.state.serving = {"generators": self.generators, "embedders": self.embedders, "state": self.state,
                             "beat": self.beat}
        return app

    def answering(self, handle: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
        """A route of `handle`: a bad request answers its API error, a client gone 499 (nobody reads it)."""
        from starlette.requests import ClientDisconnect
        from starlette.responses import Response

        async def route(request: Request) -> Response:
            try:
                return await handle(request)
            except (ApiError, AzyxError) as e:
                return _error_response(e)
            except (svc.ClientGone, ClientDisconnect):
                return Response(status_code=499)

        return route

    # -------------------------------------------------------------------------------------------- life
    @asynccontextmanager
    async def lifespan(self, app: Any) -> AsyncIterator[None]:
        tasks = [asyncio.create_task(self.beat.run()), asyncio.create_task(self.load())]
        try:
            yield
        finally:
            for t in tasks:
                t.cancel()
            for g in self.generators.values():
                await g.engine.close()
            for e in self.embedders.values():
                await e.service.__aexit__(None, None, None)

    async def load(self) -> None:
        """Load every model, then set `ready`; a failure is kept in `state["error"]` (the server keeps answering:
        /health says why it does not serve)."""
        # no full collection while the models load and warm up: the heap grows by the plans' kernels, and Python's
        # collector went over all of it each time it grew by a quarter (on the loop's thread or on a worker planning,
        # holding the GIL): 100-320 ms each, 5-6 times in a start-up of GPT-2 and MiniLM (the loop slept 300 ms on
        # the GIL). The young generations are still collected; what start-up made lives on, frozen below
        t0, t1, t2 = gc.get_threshold()
        gc.set_threshold(t0, t1, 1 << 30)
        try:
            for d in self.cfg.models:
                if self.kinds[d] in GENERATION_TYPES:
                    await self.load_generator(d)
                else:
                    await self.load_embedder(d)
            # frozen: later full collections skip it (else a pause of tens of ms). The young generations are
            # collected first; a full collection over the heap (~160k objects after GPT-2's and MiniLM's warm-up,
            # mostly the plans' kernels) held the loop 120-130 ms and found no garbage
            gc.collect(1)
            gc.freeze()
            self.ready.set()
        except Exception as e:
            self.state["error"] = f"{type(e).__name__}: {e}"
        finally:
            gc.set_threshold(t0, t1, t2)

    async def load_generator(self, d: str) -> None:
        cfg = self.cfg
        model = await GPT2.from_pretrained(d, device=cfg.device)
        eng = Engine(model, slots=cfg.slots, max_waiting=cfg.waiting, prefill_batch=cfg.prefill_batch)
        if cfg.warmup:
            await eng.warmup(prompt_lengths=WARM_PROMPTS, sampled=True, logprobs=True)
        template, specials = chat_template(d)
        name = _model_name(d)
        tokenizer = await in_worker_thread(load_tokenizer, d)  # (reading tokenizer.json: ~25 ms, holding the GIL)
        self.generators[name] = Generator(name, eng, tokenizer, template, specials)

    async def load_embedder(self, d: str) -> None:
        cfg = self.cfg
        m = await MiniLM.load(cfg.device, directory=Path(d))
        service = EmbeddingService(m, cfg.max_batch, 0.0, cfg.max_queued, cfg.max_batch_tokens)
        await service.__aenter__()
        if cfg.warmup:  # every packed shape a batch can take, planned before serving (none while it serves)
            await m.warmup(cfg.max_batch, cfg.max_batch_tokens)
        name = _model_name(d)
        self.embedders[name] = Embedder(name, m, service)

    def gauges(self) -> None:
        gens, embs = list(self.generators.values()), list(self.embedders.values())
        metrics = self.metrics
        metrics.queue_depth.set(sum(len(g.engine.waiting) for g in gens) + sum(e.service.queued for e in embs))
        metrics.slots_in_use.set(sum(len(g.engine.active) for g in gens))
        metrics.slots.set(sum(g.engine.cache.slots for g in gens))
        metrics.lateness.set(self.beat.worst_within(10.0) / 1e3)
        metrics.worst_lateness.set(self.beat.worst_ms / 1e3)

    # -------------------------------------------------------------------------------------------- checks
    def serving(self) -> None:
        """503 unless every model serves."""
        if not self.ready.is_set():
            if self.state["error"]:
                raise ApiError(503, f"the models failed to load: {self.state['error']}", type="server_error",
                               code="load_failed")
            raise ApiError(503, "the models are loading", type="server_error", code="loading",
                           headers={"Retry-After": "1"})

    def pick(self, body: dict[str, Any], table: dict[str, Any], what: str) -> Any:
        """The model `body` names in `table` (the only one if it names none)."""
        name = body.get("model")
        if name is None and len(table) == 1:
            return next(iter(table.values()))
        if not isinstance(name, str):
            raise ApiError(400, f"must name a model, got {svc.short(name)}", "model")
        if name not in table:
            raise ApiError(404, f"the model {svc.short(name)} does not exist or does not serve {what} "
                           f"(served: {', '.join(table) or 'none'})", "model", code="model_not_found")
        return table[name]

    async def read_body(self, request: Request) -> dict[str, Any]:
        body = await svc.read_json(request.headers, request.stream(), self.cfg.body)
        if not isinstance(body, dict):
            raise ApiError(422, f"the body must be a JSON object, got {type(body).__name__}", "body")
        return body

    async def encode(self, g: Generator, text: str, name: str) -> list[int]:
        """The token ids of a text (on a worker thread when long), checked against the model's window."""
        def run() -> list[int]:
            try:
                ids: list[int] = g.tokenizer.encode(text).ids
            except Exception as e:  # (the tokenizer's own failure: this request's)
                raise ApiError(400, f"cannot be tokenized ({svc.short(str(e), 80)})", name) from None
            return ids

        ids = await in_worker_thread(run) if len(text) > TOKENIZE_ON_LOOP_CHARS else run()
        limit = g.engine.cache.max_len
        if not ids:
            raise ApiError(400, "must not be empty (no tokens)", name)
        if len(ids) > limit:
            raise ApiError(400, f"has {len(ids)} tokens, more than the model's window of {limit}", name,
                           code="context_length_exceeded")
        return ids

    async def prompts_of(self, body: dict[str, Any], g: Generator) -> list[list[int]]:
        """The token ids of a completions body's `prompt` (a string, strings, token ids or lists of them)."""
        cfg = self.cfg
        v = body.get("prompt")
        vocab, limit = g.engine.model.config.vocab_size, g.engine.cache.max_len
        if isinstance(v, str):
            return [await self.encode(g, svc.text(body, "prompt", cfg.max_prompt_chars) or "", "prompt")]
        if not isinstance(v, list) or not v:
            raise ApiError(400, f"must be a string, a list of strings, token ids or lists of them, got {svc.short(v)}",
                           "prompt")
        if len(v) > cfg.max_prompts and not all(isinstance(t, int) for t in v):
            raise ApiError(413, f"{len(v)} prompts exceed the limit of {cfg.max_prompts}", "prompt",
                           code="request_too_large")
        if all(isinstance(t, int) and not isinstance(t, bool) for t in v):
            return [_token_ids(v, "prompt", vocab, limit)]
        if all(isinstance(t, str) for t in v):
            texts = svc.texts(body, "prompt", cfg.max_prompts, cfg.max_prompt_chars)
            return [await self.encode(g, t, f"prompt[{i}]") for i, t in enumerate(texts)]
        if all(isinstance(t, list) for t in v):
            return [_token_ids(p, f"prompt[{i}]", vocab, limit) for i, p in enumerate(v)]
        raise ApiError(400, "must be a string, a list of strings, token ids or lists of them (not mixed)", "prompt")

    def check_room(self, g: Generator, sequences: int) -> None:
        """`sequences` asked of the engine: 413 past `max_choices`, 429 (before any work) past its free slots and
        waiting places."""
        if sequences > self.cfg.max_choices:
            raise ApiError(413, f"{sequences} sequences (prompts x n, or best_of) exceed the limit of "
                           f"{self.cfg.max_choices}", "n", code="request_too_large")
        eng = g.engine
        room = eng.cache.slots + eng.max_waiting - len(eng.live)
        if sequences > room:
            raise NoFreeSlotError(f"{sequences} sequences asked, room for {max(room, 0)} (every slot and waiting "
                                  f"place taken)")

    @asynccontextmanager
    async def timeout(self) -> AsyncIterator[None]:
        """The request's time limit (`request_timeout`): past it, 408."""
        try:
            async with asyncio.timeout(self.cfg.request_timeout):
                yield
        except TimeoutError:
            raise self.timed_out() from None

    def timed_out(self) -> ApiError:
        return ApiError(408, f"the request took longer than {self.cfg.request_timeout} s", type="timeout",
                        code="timeout")

    async def generation_request(self, request: Request, what: str, max_tokens_field: str = "max_tokens"
                                 ) -> tuple[dict[str, Any], Generator, bool, bool, tuple[int, int], dict[str, Any],
                                            list[str]]:
        """The fields completions and chat share: the body, the model, stream, include_usage, (n, best_of), the
        engine's arguments and the stop strings."""
        cfg = self.cfg
        self.serving()
        body = await self.read_body(request)
        g = self.pick(body, self.generators, what)
        stream = svc.flag(body, "stream", False)
        include_usage = _stream_options(body, stream)
        n = _choice_count(body, cfg, stream)
        return body, g, stream, include_usage, n, _sampling(body, cfg, g, max_tokens_field), _stops(body, cfg)

    # -------------------------------------------------------------------------------------------- running choices
    async def score(self, g: Generator, request: Request, prompts: list[list[int]], top: int) -> list[list[Any]]:
        """The prompts' tokens with their log-probabilities and `top` most likely tokens (echo with logprobs):
        (token, None, None) for each prompt's first token."""
        async def each() -> list[list[Any]]:
            return [await g.engine.prompt_logprobs(p, top) for p in prompts]

        async with self.timeout():
            rows = await svc.unless_gone(each(), request.receive)
        return [[(t, None, None) if e is None else (t, *e) for t, e in zip(p, r)] for p, r in zip(prompts, rows)]

    def start(self, g: Generator, prompts: list[list[int]], n: int, args: dict[str, Any], stop: list[str],
              logprobs: int | None, echo: bool, scored: list[list[Any]] | None = None) -> list[Choice]:
        """Every choice's stream (`n` per prompt; with `scored`, the prompts' own log-probabilities for an echo),
        or none (a full engine: 429 before any work)."""
        self.check_room(g, len(prompts) * n)
        choices: list[Choice] = []
        try:
            for p, ids in enumerate(prompts):
                for j in range(n):
                    a = dict(args)
                    if a["seed"] is not None:
                        a["seed"] = (a["seed"] + j) % (1 << 64)
                    stream = g.engine.generate(ids, **a, logprobs=logprobs)
                    prompt_text = g.tokenizer.decode(ids) if echo else ""
                    choices.append(Choice(p * n + j, stream, TextStream(g.tokenizer, stop), prompt_text,
                                          scored[p] if scored else []))
        except BaseException:
            for c in choices:
                c.stream.cancel()
            raise
        self.metrics.prompt_tokens.labels(g.name).inc(sum(len(p) for p in prompts))
        return choices

    async def answer(self, reply: Reply, stream: bool, per: int = 1, keep: int = 1) -> Response:
        """Run the choices: one JSON answer (`stream` false: of each prompt's `per` choices the `keep` best) or
        server-sent events."""
        from starlette.responses import Response, StreamingResponse

        if stream:
            return StreamingResponse(self.events(reply), media_type="text/event-stream")
        await self.run_to_end(reply)
        answer = reply.whole(per, keep)
        return Response(await svc.json_bytes(answer, off_loop=len(reply.choices) > 4), media_type="application/json")

    async def run_to_end(self, reply: Reply) -> None:
        """Drive every choice to its end, collecting its pieces and log-probabilities (408 past the time limit; a
        client gone stops them all)."""
        def collect(c: Choice, piece: str, entries: list[Any], finish: str | None) -> None:
            c.pieces.append(piece)
            c.logprobs.extend(entries)

        async def all_choices() -> None:
            await asyncio.gather(*(_drive(c, reply.g, self.metrics, reply.started, collect) for c in reply.choices))

        try:
            async with self.timeout():
                await svc.unless_gone(all_choices(), reply.request.receive)
        finally:
            reply.cancel_all()

    async def events(self, reply: Reply) -> AsyncIterator[bytes]:
        """The server-sent events of a streamed reply: each choice's opening entry, then the choices' pieces as they
        come (an error as an error event; past `request_timeout`, a timeout event), the usage if asked, [DONE]. A
        client that leaves has its sequences cancelled at once, not at the next send."""
        queue: asyncio.Queue[dict[str, Any] | BaseException | None] = asyncio.Queue()

        def put(c: Choice, piece: str, entries: list[Any], finish: str | None) -> None:
            if piece or entries or finish:
                queue.put_nowait(reply.chunk([reply.shape(c, piece, entries, finish, True)]))

        async def one(c: Choice) -> None:
            try:
                await _drive(c, reply.g, self.metrics, reply.started, put)
            except Exception as e:
                queue.put_nowait(e)
            finally:
                queue.put_nowait(None)

        async def gone() -> None:
            await svc.until_disconnect(reply.request.receive)
            reply.cancel_all()

        watch = asyncio.create_task(gone())
        tasks = [asyncio.create_task(one(c)) for c in reply.choices]
        try:
            for c in reply.choices:
                head = reply.first(c)
                if head is not None:
                    yield _event(reply.chunk([head]))
            left = len(reply.choices)
            try:
                async with asyncio.timeout(self.cfg.request_timeout):
                    while left:
                        item = await queue.get()
                        if item is None:
                            left -= 1
                        elif isinstance(item, BaseException):
                            yield _event(_api_error(item).body())
                        else:
                            yield _event(item)
            except TimeoutError:
                reply.cancel_all()
                yield _event(self.timed_out().body())
            if reply.include_usage:
                yield _event({**reply.chunk([]), "usage": reply.usage()})
            yield b"data: [DONE]\n\n"
        finally:
            watch.cancel()
            reply.cancel_all()
            for t in tasks:
                t.cancel()

    # -------------------------------------------------------------------------------------------- routes
    async def completions(self, request: Request) -> Response:
        """POST /v1/completions."""
        body, g, stream, include_usage, (n, best_of), args, stop = await self.generation_request(request,
                                                                                                 "completions")
        logprobs = svc.integer(body, "logprobs", None, low=0, high=5)
        echo = svc.flag(body, "echo", False)
        prompts = await self.prompts_of(body, g)
        self.check_room(g, len(prompts) * best_of)
        scored = await self.score(g, request, prompts, logprobs) if echo and logprobs is not None else None
        # (best_of > n ranks the choices by their tokens' log-probabilities: the engine keeps them)
        kept = logprobs if logprobs is not None or best_of == n else 0
        choices = self.start(g, prompts, best_of, args, stop, kept, echo, scored)
        offsets: dict[int, int] = {}

        def shape(c: Choice, text: str, entries: list[Any], finish: str | None, streamed: bool) -> dict[str, Any]:
            lp = None
            if logprobs is not None:
                if not streamed:  # (the whole text: an echoed prompt's tokens first)
                    entries = c.prompt_logprobs + entries
                base = offsets.get(c.index, 0 if not streamed else len(c.prompt_text))
                lp = _completion_logprobs(g, entries, base)
                offsets[c.index] = base + len(text)
            return {"index": c.index, "text": text, "logprobs": lp, "finish_reason": finish}

        def first(c: Choice) -> dict[str, Any] | None:  # (streamed echo: the prompt first)
            lp = _completion_logprobs(g, c.prompt_logprobs, 0) if logprobs is not None else None
            return {"index": c.index, "text": c.prompt_text, "logprobs": lp, "finish_reason": None} \
                if c.prompt_text else None

        reply = Reply(g, request, choices, sum(len(p) for p in prompts), shape, "text_completion", first,
                      include_usage)
        return await self.answer(reply, stream, best_of, n)

    async def chat(self, request: Request) -> Response:
        """POST /v1/chat/completions."""
        body, g, stream, include_usage, (n, best_of), args, stop = await self.generation_request(
            request, "chat completions", "max_completion_tokens")
        want = svc.flag(body, "logprobs", False)
        top = svc.integer(body, "top_logprobs", None, low=0, high=20)
        if top is not None and not want:
            raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        text = self.render(g, body)
        if len(text) > self.cfg.max_prompt_chars:
            raise ApiError(413, f"the rendered messages have {len(text)} characters, more than the limit of "
                           f"{self.cfg.max_prompt_chars}", "messages", code="request_too_large")
        prompt = await self.encode(g, text, "messages")
        self.check_room(g, best_of)
        choices = self.start(g, [prompt], best_of, args, stop, (top or 0) if want else 0 if best_of > n else None,
                             False)

        def shape(c: Choice, text: str, entries: list[Any], finish: str | None, streamed: bool) -> dict[str, Any]:
            lp = _chat_logprobs(g, entries) if want else None
            msg = {"content": text} if streamed else {"role": "assistant", "content": text}
            return {"index": c.index, "delta" if streamed else "message": msg if text or not streamed else {},
                    "logprobs": lp, "finish_reason": finish}

        def first(c: Choice) -> dict[str, Any] | None:
            return {"index": c.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                    "finish_reason": None}

        reply = Reply(g, request, choices, len(prompt), shape, "chat.completion", first, include_usage)
        return await self.answer(reply, stream, best_of, n)

    def render(self, g: Generator, body: dict[str, Any]) -> str:
        """A chat body's messages rendered by the model's chat template (400 if it cannot render them)."""
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        v = body.get("messages")
        if not isinstance(v, list) or not v:
            raise ApiError(400, f"must be a non-empty list of messages, got {svc.short(v)}", "messages")
        if len(v) > self.cfg.max_messages:
            raise ApiError(413, f"{len(v)} messages exceed the limit of {self.cfg.max_messages}", "messages",
                           code="request_too_large")
        messages = [self.message(m, f"messages[{i}]") for i, m in enumerate(v)]
        try:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            return env.from_string(g.chat_template).render(messages=messages, add_generation_prompt=True,
                                                           **g.specials)
        except TemplateError as e:
            raise ApiError(400, f"the chat template cannot render these messages ({svc.short(str(e), 120)})",
                           "messages") from None

    def message(self, m: Any, name: str) -> dict[str, Any]:
        """One chat message as the template reads it: its role and its content's text (text parts joined)."""
        if not isinstance(m, dict):
            raise ApiError(400, f"must be an object, got {svc.short(m)}", name)
        role = m.get("role")
        if role not in ROLES:
            raise ApiError(400, f"role must be one of {', '.join(ROLES)}, got {svc.short(role)}", f"{name}.role")
        content = m.get("content")
        limit = self.cfg.max_prompt_chars
        if isinstance(content, list):  # [{"type": "text", "text": ...}]
            parts = []
            for j, p in enumerate(content):
                if not isinstance(p, dict) or p.get("type") != "text":
                    raise ApiError(400, f"only text parts are supported, got {svc.short(p)}", f"{name}.content[{j}]")
                key = f"{name}.content[{j}].text"
                parts.append(svc.text({key: p.get("text")}, key, limit) or "")
            content = "".join(parts)
        elif content is None and role == "assistant":
            content = ""
        else:
            key = f"{name}.content"
            content = svc.text({key: content}, key, limit)
        return {"role": role, "content": content}

    async def embeddings(self, request: Request) -> Response:
        """POST /v1/embeddings."""
        from starlette.responses import Response

        self.serving()
        body = await self.read_body(request)
        e = self.pick(body, self.embedders, "embeddings")
        fmt = body.get("encoding_format", "float")
        if fmt not in ("float", "base64"):
            raise ApiError(400, f"must be \"float\" or \"base64\", got {svc.short(fmt)}", "encoding_format")
        dims = svc.integer(body, "dimensions", None, low=1)
        if dims is not None and dims != e.model.hidden:
            raise ApiError(400, f"this model's embeddings have {e.model.hidden} dimensions, not {dims}",
                           "dimensions", code="unsupported")
        encoded = await self.inputs_of(body, e)
        tokens = sum(len(x) for x in encoded)
        self.metrics.prompt_tokens.labels(e.name).inc(tokens)
        async with self.timeout():
            rows = await svc.unless_gone(e.service.embed_ids(encoded), request.receive)
        if fmt == "base64":
            data = [base64.b64encode(r.astype("<f4").tobytes()).decode() for r in rows]
        else:
            data = short_floats(rows)
        answer = {"object": "list", "model": e.name, "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
                  "data": [{"object": "embedding", "index": i, "embedding": d} for i, d in enumerate(data)]}
        return Response(await svc.json_bytes(answer, off_loop=rows.size > 4096), media_type="application/json")

    async def inputs_of(self, body: dict[str, Any], e: Embedder) -> list[list[int]]:
        """The inputs' token ids (each checked against the window: truncated with `truncate`, else 400)."""
        cfg = self.cfg
        v = body.get("input")
        vocab, window = e.model.vocab_size, e.model.max_length
        if isinstance(v, str):
            v = [v]
            body = {**body, "input": v}
        if not isinstance(v, list) or not v:
            raise ApiError(400, f"must be a string, a list of strings, token ids or lists of them, got {svc.short(v)}",
                           "input")
        nested = not all(isinstance(t, int) and not isinstance(t, bool) for t in v)
        if not nested:
            v = [v]
        if len(v) > cfg.max_inputs:
            raise ApiError(413, f"{len(v)} inputs exceed the limit of {cfg.max_inputs}", "input",
                           code="request_too_large")
        if all(isinstance(t, str) for t in v):
            texts = svc.texts(body, "input", cfg.max_inputs, cfg.max_input_chars, non_empty=True)
            big = sum(len(t) for t in texts) > TOKENIZE_ON_LOOP_CHARS
            ids, cut = await in_worker_thread(e.model.encode_checked, texts) if big else \
                e.model.encode_checked(texts)
            if not cfg.truncate and any(cut):
                i = cut.index(True)
                raise ApiError(400, f"has more tokens than the model's window of {window} (the server refuses "
                               f"rather than truncates)", f"input[{i}]", code="context_length_exceeded")
            return ids
        if all(isinstance(t, list) for t in v):
            out = []
            for i, ids in enumerate(v):
                name = f"input[{i}]" if nested else "input"
                if len(ids) > window:
                    if not cfg.truncate:
                        raise ApiError(400, f"has {len(ids)} tokens, more than the model's window of {window}", name,
                                       code="context_length_exceeded")
                    ids = ids[:window]
                out.append(_token_ids(ids, name, vocab, window))
            return out
        raise ApiError(400, "must be a string, a list of strings, token ids or lists of them (not mixed)", "input")

    async def models(self, request: Request) -> Response:
        """GET /v1/models."""
        from starlette.responses import JSONResponse

        data = [{"id": name, "object": "model", "created": self.state["created"], "owned_by": "azyx",
                 "kind": "generation" if name in self.generators else "embedding"}
                for name in [*self.generators, *self.embedders]]
        return JSONResponse({"object": "list", "data": data})

    async def health(self, request: Request) -> Response:
        """GET /health: 200 once every model serves, else 503 (loading, or failed and why)."""
        from starlette.responses import JSONResponse

        if self.ready.is_set():
            return JSONResponse({"status": "ok"})
        error = self.state["error"]
        return JSONResponse({"status": "failed" if error else "loading", **({"error": error} if error else {})}, 503)

    async def metrics_page(self, request: Request) -> Response:
        """GET /metrics (Prometheus text)."""
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
        from starlette.responses import Response

        self.gauges()
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def http_error(self, request: Request, exc: Exception) -> Response:
        """Starlette's own errors (no such route, a method not allowed) in OpenAI's error shape."""
        from starlette.exceptions import HTTPException

        status = exc.status_code if isinstance(exc, HTTPException) else 500
        what = {404: "no such route", 405: "method not allowed"}.get(status, "error")
        return _error_response(ApiError(status, f"{what}: {request.method} {request.url.path}",
                                        code=what.replace(" ", "_")))


class Outer:
    """The ASGI layer around the app: notes each HTTP request's arrival (`ARRIVED`), counts every HTTP answer by
    route and status (`azyx_requests_total`) and, with an API key, answers 401 to a /v1/ request without
    `Authorization: Bearer KEY`."""

    def __init__(self, app: Any, metrics: Metrics, api_key: str | None):
        self.app, self.metrics, self.api_key = app, metrics, api_key
        self.state = app.state

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        scope[ARRIVED] = time.perf_counter()
        path = scope["path"]
        route = path if path in ROUTES else "other"

        async def counted(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                self.metrics.requests.labels(route, str(message["status"])).inc()
            await send(message)

        if self.api_key is not None and path.startswith("/v1/"):
            auth = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
            if not _same(auth, f"Bearer {self.api_key}"):
                err = ApiError(401, "a valid API key is needed (Authorization: Bearer KEY)",
                               type="authentication_error", code="invalid_api_key")
                body = json.dumps(err.body()).encode()
                await counted({"type": "http.response.start", "status": 401,
                               "headers": [(b"content-type", b"application/json"),
                                           (b"content-length", str(len(body)).encode())]})
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, counted)


def _same(a: str, b: str) -> bool:
    import hmac

    return hmac.compare_digest(a.encode(), b.encode())


def embeddings_of(answer: dict[str, Any]) -> np.ndarray:
    """The (n, dim) float32 rows of an /v1/embeddings answer, float or base64 (a client's helper)."""
    rows = [np.frombuffer(base64.b64decode(d["embedding"]), "<f4") if isinstance(d["embedding"], str)
            else np.asarray(d["embedding"], np.float32) for d in sorted(answer["data"], key=lambda d: d["index"])]
    return np.stack(rows)
