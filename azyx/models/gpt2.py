"""GPT-2 in azyx: the network (Hugging Face's parameter names and layouts, so its checkpoints load as they are), a KV
cache pooled in slots, and a generation engine that decodes many sequences in one step (continuous batching).

    model = await GPT2.from_pretrained("path/to/gpt2", device="c:0")  # config.json + model.safetensors, streamed
    logits = model(Tensor(ids))                                       # (B, T, vocab), a plain causal forward
    async for token in model.generate(prompt_ids, max_new_tokens=20, temperature=0.8, top_p=0.9, seed=1):
        ...

- `GPT2` is a `nn.Module` whose state dict is Hugging Face's `GPT2Model` (`wte.weight`, `h.0.attn.c_attn.weight`,
  ...); a file's `transformer.` prefix is dropped and `lm_head.weight` is the tied `wte.weight`. `c_attn`, `c_proj`
  and `c_fc` are Hugging Face's `Conv1D`: weight (in, out), `y = x @ W + b`.
- `KVCache`: per layer, keys and values of shape (slots + 1, heads, max_len, head_dim), allocated once; a sequence
  owns a slot from its prefill to its end, and its keys and values are written in place (`cache[slot, :, pos] = k`)
  at runtime positions. The extra slot is scratch, written by the padding rows of a batch.
- `Engine`: `await add(prompt)` prefills a sequence into a free slot (one plan per prompt-length bucket: the prompt
  is padded to a power of two, its length is data), `await step()` decodes one token of every active sequence in
  one plan (per batch-size bucket; every position, slot, length mask and sampling value is data, so a step never
  plans or compiles again; both are staged with `azyx.jit`, so a step replays its plan without building the
  graph), `remove(seq)` frees its slot at once. `generate(...)` streams one request's tokens while
  a runner task admits new requests between steps, so requests join and leave the running batch at any step; while
  the batch stays the same, each step is queued before the last one's tokens are read, and reads the tokens and
  positions that step wrote on the device, in one of two buffers the steps write in place in turn (`_Chain`: a
  step's kernels take the same arguments every other step).
  Each sequence is a state machine (new, waiting, prefilling, active, then finished; "finishing" when ended while
  its prefill runs) whose end frees whatever it holds in every state; a request's own failure (its prefill, its
  sampling values, its step) ends that request with the error, and the runner keeps serving the others.
- Sampling runs on the device, every knob per request and a runtime value: temperature (0: greedy), top-k, top-p
  (Hugging Face's rules: top-k keeps ties with the k-th logit, top-p keeps the smallest set of most likely tokens
  whose mass reaches p), then one draw from the kept distribution with a uniform number from the request's own
  seeded generator (`numpy.random.Generator(seed)`), so a seeded request gives the same tokens whatever else runs
  beside it. Thresholds are found by a search that tries 7 points per round (no sort: a round is one reduction
  over the vocabulary); the parts no row of a batch uses (all greedy, no top-k, no top-p) are left out of its plan.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections import deque
from collections.abc import AsyncIterator, Callable, Coroutine, Iterable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from azyx import nn
from azyx.dtypes import DType, dtypes, to_dtype
from azyx.errors import ArgumentError, AzyxError, AzyxIOError, RuntimeStateError, ShapeError, StateDictError
from azyx.io import stream_safetensors
from azyx.jit import jit
from azyx.realize import read_now, realize
from azyx.runtime import RT
from azyx.tensor import Tensor
from azyx.workers import in_worker_thread

WINDOW_BASE = 64  # the smallest number of cache rows a decode step attends over (then x4 per bucket, up to max_len)
PREFILL_TOKENS = 8192  # most prompt tokens (padded) one batched prefill takes (Engine.prefill_batch)
SEARCH_WIDTH = 7  # points a threshold search tries per round (one reduction over the vocabulary for all of them)
SEARCH_ROUNDS = 14  # rounds of the top-k and top-p threshold searches: the interval shrinks by 8**-14 = 2**-42
ACTIVATIONS = {"gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu_fast": "tanh", "gelu": "none"}


class NoFreeSlotError(AzyxError, RuntimeError):
    """Every slot of the KV cache holds a sequence: free one (`Engine.remove`) or wait for one to finish."""


# ------------------------------------------------------------------------------------------------ config
@dataclass(frozen=True)
class GPT2Config:
    """The fields of a Hugging Face GPT-2 `config.json` that the network uses (others are ignored)."""

    vocab_size: int = 50257
    n_positions: int = 1024
    n_embd: int = 768
    n_layer: int = 12
    n_head: int = 12
    n_inner: int | None = None  # the MLP's width; None: 4 * n_embd
    layer_norm_epsilon: float = 1e-5
    activation_function: str = "gelu_new"
    scale_attn_weights: bool = True
    scale_attn_by_inverse_layer_idx: bool = False
    tie_word_embeddings: bool = True
    bos_token_id: int | None = None
    eos_token_id: int | None = None

    def __post_init__(self) -> None:
        if self.activation_function not in ACTIVATIONS:
            raise ArgumentError(f"GPT-2 activation_function {self.activation_function!r} is not supported "
                                f"(one of {sorted(ACTIVATIONS)})")
        if self.n_head <= 0 or self.n_embd % self.n_head:
            raise ArgumentError(f"n_embd {self.n_embd} is not divisible into n_head={self.n_head} heads")

    @property
    def head_dim(self) -> int:
        """Size of one attention head: `n_embd // n_head`."""
        return self.n_embd // self.n_head

    @staticmethod
    def from_dict(d: dict[str, Any]) -> GPT2Config:
        """The config from a Hugging Face `config.json`'s dict (unknown keys ignored)."""
        names = {f.name for f in fields(GPT2Config)}
        return GPT2Config(**{k: v for k, v in d.items() if k in names})

    @staticmethod
    def from_json(path: str | Path) -> GPT2Config:
        """The config read from a Hugging Face `config.json` at `path` (`AzyxIOError` naming the file if unreadable)."""
        try:
            d = json.loads(Path(path).read_text())
        except (OSError, ValueError) as e:
            raise AzyxIOError(f"{path}: cannot read the model config ({e})") from None
        if d.get("reorder_and_upcast_attn"):
            raise ArgumentError(f"{path}: reorder_and_upcast_attn=true is not supported")
        return GPT2Config.from_dict(d)


# ------------------------------------------------------------------------------------------------ network
class AttentionView(Protocol):
    """Where a layer's attention takes its keys and values from: the tokens of this forward alone (causal), or the
    KV cache (a prefill writes it, a decode step writes one row per sequence and reads the whole slot)."""

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
        """Attention output (B, heads, T, head_dim) of layer `layer` for queries `q`, with keys `k` and values `v` of
        the forward's tokens, scaled by `scale`."""
        ...


class Causal:
    """Plain causal self-attention over the tokens of the forward (no cache)."""

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
        """Causal scaled dot-product attention of `q` over `k`/`v` (no cache)."""
        return nn.scaled_dot_product_attention(q, k, v, causal=True, scale=scale)


class Conv1D(nn.Module):
    """Hugging Face's GPT-2 `Conv1D`: a linear layer with its weight stored (in, out): `y = x @ weight + bias`."""

    def __init__(self, n_in: int, n_out: int, dtype: DType, device: str):
        self.weight = Tensor.zeros(n_in, n_out, dtype=dtype, device=device)
        self.bias = Tensor.zeros(n_out, dtype=dtype, device=device)

    def forward(self, x: Tensor) -> Tensor:
        """`x @ weight + bias`."""
        return x @ self.weight + self.bias


def attention_scale(config: GPT2Config, layer: int) -> float:
    """What layer `layer`'s attention scores are scaled by (the config's scale_attn_weights and
    scale_attn_by_inverse_layer_idx)."""
    scale = 1.0 / math.sqrt(config.head_dim) if config.scale_attn_weights else 1.0
    return scale / (layer + 1) if config.scale_attn_by_inverse_layer_idx else scale


class Attention(nn.Module):
    """GPT-2's self-attention block (`c_attn`, `c_proj`): heads split out of one projection, attended through a view."""
    def __init__(self, config: GPT2Config, layer: int, dtype: DType, device: str):
        e = config.n_embd
        self.c_attn = Conv1D(e, 3 * e, dtype, device)
        self.c_proj = Conv1D(e, e, dtype, device)
        self.n_head, self.layer = config.n_head, layer
        self.scale = attention_scale(config, layer)

    def forward(self, x: Tensor, view: AttentionView) -> Tensor:
        """Self-attention of `x` (B, T, n_embd) through `view` (causal, or the KV cache); same shape."""
        b, t, e = x.shape
        h = self.n_head
        q, k, v = (z.reshape(b, t, h, e // h).transpose(1, 2) for z in self.c_attn(x).split(e, axis=-1))
        out = view.attend(self.layer, q, k, v, self.scale)  # (b, h, t, e // h)
        return self.c_proj(out.transpose(1, 2).reshape(b, t, e))


class MLP(nn.Module):
    """GPT-2's feed-forward block: `c_proj(gelu_tanh(c_fc(x)))`."""
    def __init__(self, config: GPT2Config, dtype: DType, device: str):
        inner = config.n_inner or 4 * config.n_embd
        self.c_fc = Conv1D(config.n_embd, inner, dtype, device)
        self.c_proj = Conv1D(inner, config.n_embd, dtype, device)
        self.act = nn.GELU(ACTIVATIONS[config.activation_function])

    def forward(self, x: Tensor) -> Tensor:
        """`c_proj(act(c_fc(x)))`, same shape as `x`."""
        return self.c_proj(self.act(self.c_fc(x)))


class Block(nn.Module):
    """One transformer layer: pre-norm attention and MLP, each added to the residual stream."""
    def __init__(self, config: GPT2Config, layer: int, dtype: DType, device: str):
        e, eps = config.n_embd, config.layer_norm_epsilon
        self.ln_1 = nn.LayerNorm(e, eps=eps, dtype=dtype, device=device)
        self.attn = Attention(config, layer, dtype, device)
        self.ln_2 = nn.LayerNorm(e, eps=eps, dtype=dtype, device=device)
        self.mlp = MLP(config, dtype, device)

    def forward(self, x: Tensor, view: AttentionView) -> Tensor:
        """`x + attn(ln_1(x))`, then `+ mlp(ln_2(x))`; same shape as `x`."""
        x = x + self.attn(self.ln_1(x), view)
        return x + self.mlp(self.ln_2(x))


class Embedding(nn.Module):
    """A lookup table (nn.Embedding's name and layout) made of zeros until loaded."""

    def __init__(self, n: int, dim: int, dtype: DType, device: str):
        self.weight = Tensor.zeros(n, dim, dtype=dtype, device=device)

    def forward(self, idx: Tensor) -> Tensor:
        """The table's rows at integer indices `idx`: shape `idx.shape + (dim,)`."""
        return self.weight[idx]


class GPT2(nn.Module):
    """GPT-2 with a language-model head tied to the token embedding. Parameters are zeros until loaded
    (`from_pretrained`, or `load_state_dict` with Hugging Face's `GPT2Model` names).

    `model(ids)` maps (B, T) token ids to (B, T, vocab) logits with causal attention over the T tokens;
    `model.generate(...)` streams tokens through a default `Engine` (4 slots) made on first use."""

    def __init__(self, config: GPT2Config, dtype: Any = None, device: str | None = None):
        self.config = config
        self.dtype = to_dtype(dtype) if dtype is not None else dtypes.float32
        self.device = RT.check_device(device) if device is not None else RT.resolve_device(None, 0)[0]
        dt, dev = self.dtype, self.device
        self.wte = Embedding(config.vocab_size, config.n_embd, dt, dev)
        self.wpe = Embedding(config.n_positions, config.n_embd, dt, dev)
        self.h = [Block(config, i, dt, dev) for i in range(config.n_layer)]
        self.ln_f = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon, dtype=dt, device=dev)
        self.lm_head = None if config.tie_word_embeddings else Embedding(config.vocab_size, config.n_embd, dt, dev)
        self._engine: Engine | None = None

    @staticmethod
    async def from_pretrained(path: str | Path, device: str | None = None, dtype: Any = None) -> GPT2:
        """Load a Hugging Face GPT-2 checkpoint: `path` is its directory (config.json, model.safetensors) or the
        safetensors file (config.json beside it). The weights are streamed tensor by tensor onto `device` (None: AUTO's
        first device) and cast to `dtype` (float32 by default). Raises `StateDictError` for a missing
        or unknown tensor, `ShapeError` for a tensor of the wrong shape, `DeviceError` for an unknown device."""
        p = Path(path)
        directory, weights = (p, p / "model.safetensors") if p.is_dir() else (p.parent, p)
        # the device's backend (AUTO's for None) probed off the loop: a driver's start takes up to seconds
        await RT.startup([device.partition(":")[0]] if isinstance(device, str) else RT.auto_kinds())
        model = GPT2(GPT2Config.from_json(directory / "config.json"), dtype, device)
        params = dict(model.named_parameters())

        def load(key: str, name: str, t: Tensor) -> None:
            if key not in params:
                raise StateDictError(f"{weights}: unexpected tensor {name!r} for GPT-2")
            if t.shape != params[key].shape:
                raise ShapeError(f"{weights}: {name!r} has shape {t.shape}, GPT-2 {key!r} needs {params[key].shape}")
            params[key].assign(t.cast(model.dtype))

        await load_checkpoint(weights, model, load, set(params))
        return model

    def hidden(self, ids: Tensor, positions: Tensor | None = None, view: AttentionView | None = None) -> Tensor:
        """The final hidden states (after ln_f), (B, T, n_embd), of token ids (B, T); `positions` (B, T) default to
        0..T-1."""
        if ids.ndim != 2:
            raise ShapeError(f"GPT-2 takes (batch, length) token ids, got shape {ids.shape}")
        t = ids.shape[1]
        if t > self.config.n_positions:
            raise ArgumentError(f"{t} tokens exceed GPT-2's n_positions={self.config.n_positions}")
        pos = self.wpe.weight[:t] if positions is None else self.wpe(positions)
        return self.ln_f(self.layers(self.wte(ids) + pos, view if view is not None else Causal()))

    def layers(self, x: Tensor, view: AttentionView) -> Tensor:
        """The transformer layers over embedded tokens `x` (B, T, n_embd), attending through `view`."""
        for block in self.h:
            x = block(x, view)
        return x

    def head(self, x: Tensor) -> Tensor:
        """Logits of hidden states: the language-model head (the token embedding, transposed, when tied)."""
        return x @ (self.lm_head if self.lm_head is not None else self.wte).weight.T

    def forward(self, ids: Tensor, positions: Tensor | None = None, view: AttentionView | None = None) -> Tensor:
        """Logits (B, T, vocab_size) for token ids `ids` (B, T); `positions` default to 0..T-1, `view` to causal
        attention over the T tokens (a KV cache's prefill or decode view otherwise)."""
        return self.head(self.hidden(ids, positions, view))

    def kv_cache(self, slots: int, max_len: int) -> KVCache:
        """A KV cache for this model's layers (what an `Engine` decodes with): `slots` sequences of `max_len`."""
        return KVCache(self.config, slots, max_len, self.dtype, self.device)

    def engine(self) -> Engine:
        """The default engine of `generate` (4 slots of n_positions tokens), made on first use."""
        if self._engine is None:
            self._engine = Engine(self)
        return self._engine

    def generate(self, prompt: Iterable[int], max_new_tokens: int = 16, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, seed: int | None = None, stop_token_ids: Iterable[int] = (),
                 eos_token_id: int | None = None, ignore_eos: bool = False) -> TokenStream:
        """`async for token in model.generate(prompt_ids, ...)`: see `Engine.generate`."""
        return self.engine().generate(prompt, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                                      top_p=top_p, seed=seed, stop_token_ids=stop_token_ids,
                                      eos_token_id=eos_token_id, ignore_eos=ignore_eos)


async def load_checkpoint(weights: Path, model: GPT2, load: Callable[[str, str, Any], None], need: set[str],
                          shard: dict[str, tuple[list[str], int]] | None = None) -> None:
    """Stream a Hugging Face GPT-2 safetensors file onto `model.device`: `load(key, name, tensor)` for each tensor,
    `key` its GPT2Model name (a file's `transformer.` prefix dropped, older files' causal-mask buffers skipped,
    `lm_head.weight` as the tied `wte.weight` where the model ties them); then the model's parameters realized.
    `StateDictError` names the keys of `need` the file lacks. `shard`: stream_safetensors' (name patterns handed out
    as ShardedTensors, each device's slice read straight to it)."""
    loaded: set[str] = set()
    async for name, t in stream_safetensors(weights, device=model.device, shard=shard):
        key = name.removeprefix("transformer.")
        if key.endswith((".attn.bias", ".attn.masked_bias")):  # older files keep the causal mask as a buffer
            continue
        if key == "lm_head.weight" and model.lm_head is None:
            key = "wte.weight"  # tied: the same table (files usually leave it out)
            if key in loaded:
                continue
        load(key, name, t)
        loaded.add(key)
    missing = sorted(need - loaded)
    if missing:
        raise StateDictError(f"{weights}: missing tensors {missing}")
    await realize(*model.parameters())


# ------------------------------------------------------------------------------------------------ KV cache
class KVCache:
    """Keys and values of every layer for `slots` sequences of up to `max_len` tokens, allocated once as one tensor
    (slots + 1, 2, heads, max_len, head_dim) per layer (`kv`: [:, 0] the keys, [:, 1] the values; the last slot is
    scratch for padding rows) and written in place: a step writes a layer's new keys and values in one kernel.
    `allocate()` hands out a free slot (NoFreeSlotError when none is), `release(slot)` takes it back."""

    def __init__(self, config: GPT2Config, slots: int, max_len: int, dtype: DType, device: str):
        if not isinstance(slots, int) or slots < 1:
            raise ArgumentError(f"a KV cache needs at least one slot, got slots={slots!r}")
        if not isinstance(max_len, int) or not 1 <= max_len <= config.n_positions:
            raise ArgumentError(f"max_len must be in [1, n_positions={config.n_positions}], got {max_len!r}")
        self.slots, self.max_len = slots, max_len
        shape = (slots + 1, 2, config.n_head, max_len, config.head_dim)
        self.kv = [Tensor.zeros(*shape, dtype=dtype, device=device) for _ in range(config.n_layer)]
        self.free = list(range(slots))

    @property
    def scratch(self) -> int:
        """The scratch slot's index (the last one): where padding rows of a batch write."""
        return self.slots

    def tensors(self) -> list[Tensor]:
        """Every layer's keys-and-values tensor: what a step that writes the cache rebinds."""
        return list(self.kv)

    def allocate(self) -> int:
        """A free slot's index, the lowest (`NoFreeSlotError` when every slot holds a sequence)."""
        if not self.free:
            raise NoFreeSlotError(f"all {self.slots} slots of the KV cache hold sequences")
        return self.free.pop(0)

    def release(self, slot: int) -> None:
        """Give `slot` back to the free slots."""
        assert 0 <= slot < self.slots and slot not in self.free, f"slot {slot} is not in use"
        self.free.append(slot)
        self.free.sort()


class Prefill:
    """Prompts of a batch, one a row (padded on the right to one length): row i's keys and values written to rows
    0..T-1 of slot `slots[i]` (a padding row's: the scratch slot), causal attention over the row's own tokens (a
    prompt's padding comes after it: no real position attends to it, and the decode steps overwrite its cache rows
    before they read them)."""

    def __init__(self, cache: KVCache, slots: Tensor):
        self.cache, self.slots = cache, slots

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
        """Write every row's keys and values into rows 0..T-1 of its slot, then attend causally over them."""
        t = k.shape[2]
        self.cache.kv[layer][self.slots, :, :, :t] = Tensor.stack([k, v], axis=1)  # every row's at once: one kernel
        return nn.scaled_dot_product_attention(q, k, v, causal=True, scale=scale)


class Decode:
    """One new token per sequence: row i's key and value written at `positions[i]` of slot `slots[i]`, then its
    query attends to that slot's rows 0..positions[i] (a mask from the runtime positions), reading the first `window`
    rows of the cache only (a bucket above the batch's longest sequence: `Engine._window`)."""

    def __init__(self, cache: KVCache, slots: Tensor, positions: Tensor, window: int):
        self.cache, self.slots, self.positions, self.window = cache, slots, positions, window
        b, n = slots.shape[0], window
        rows = Tensor.arange(n, dtype=dtypes.int32, device=slots.device).reshape(1, n)
        self.mask = (rows <= positions.reshape(b, 1)).reshape(b, 1, 1, n)

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
        """Write each row's new key and value at its position in its slot, then attend over the slot's rows up to it."""
        kv = self.cache.kv[layer]
        # every row's key and value at once: one kernel, not one per row nor one for the keys and one for the values
        kv[self.slots, :, :, self.positions] = Tensor.stack([k[:, :, 0], v[:, :, 0]], axis=1)
        w = self.window  # (every row's positions are below it: the rows past it are never read, nor gathered)
        return nn.scaled_dot_product_attention(q, kv[:, 0, :, :w][self.slots], kv[:, 1, :, :w][self.slots],
                                               mask=self.mask, scale=scale)


# ------------------------------------------------------------------------------------------------ sampling
def sample_tokens(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor, uniform: Tensor, *,
                  sample: bool = True, filter_k: bool = True, filter_p: bool = True, min_p: Tensor | None = None,
                  bias: Tensor | None = None, scale: Tensor | None = None) -> Tensor:
    """One token per row of (B, V) logits, as int32 (B,): greedy where temperature is 0, else drawn from
    softmax(logits / temperature) restricted to the top_k largest logits (with ties; V keeps all) and then to the
    top_p nucleus (1.0 keeps all), by inverting the kept distribution's CDF at `uniform` (B values in [0, 1)).
    Every argument but the logits is a (B,) tensor: values are data, a new one compiles nothing. The keywords
    leave parts out of the graph when no row needs them (`sample=False`: every row greedy; `filter_k=False`: no
    row filters by top-k; `filter_p=False`: none by top-p): each combination is one plan.

    Optional parts (None: left out of the plan), each a tensor of per-row values: `scale` (B, V) divides positive
    logits and multiplies negative ones (a repetition penalty: the penalty at the tokens seen, 1 elsewhere), then
    `bias` (B, V) is added (a logit bias, presence and frequency penalties), before greedy and sampling alike;
    `min_p` (B,) keeps the tokens whose probability is at least min_p times the most likely one's (0 keeps all)."""
    b, n = logits.shape
    x = logits.float()
    if scale is not None:
        x = Tensor.where(x > 0.0, x / scale, x * scale)
    if bias is not None:
        x = x + bias
    greedy = x.argmax(-1)
    if not sample:
        return greedy.cast(dtypes.int32)
    keep = None
    if filter_k:  # the k-th largest logit: count(x >= lo) >= k > count(x >= hi)
        k = top_k.reshape(b, 1)
        lo, hi = _search(x.min(-1, keepdim=True), x.max(-1, keepdim=True) + 1.0, SEARCH_ROUNDS,
                         lambda t: (x.unsqueeze(1) >= t.unsqueeze(-1)).sum(-1) >= k)
        keep = x >= lo
    t = temperature.reshape(b, 1).maximum(1e-6)
    p = (Tensor.where(keep, x / t, -math.inf) if keep is not None else x / t).softmax(-1)
    if filter_p:  # keep the tokens whose more likely tokens weigh less than top_p: mass(p > lo) >= top_p > mass(p > hi)
        nucleus = top_p.reshape(b, 1)
        lo, hi = _search(Tensor.full((b, 1), -1.0, device=x.device), p.max(-1, keepdim=True), SEARCH_ROUNDS,
                         lambda t: Tensor.where(p.unsqueeze(1) > t.unsqueeze(-1), p.unsqueeze(1), 0.0).sum(-1)
                         >= nucleus)
        p = Tensor.where((p > lo) | (nucleus >= 1.0), p, 0.0)
    if min_p is not None:
        p = Tensor.where(p >= min_p.reshape(b, 1) * p.max(-1, keepdim=True), p, 0.0)
    # the first token whose cumulative mass passes u * total: C(first) <= u * total < C(last)
    target = uniform.reshape(b, 1) * p.sum(-1, keepdim=True)
    index = Tensor.arange(n, dtype=dtypes.int32, device=x.device)
    rounds, size = 0, n
    while size > 1:
        rounds, size = rounds + 1, -(-size // (SEARCH_WIDTH + 1))
    first, last = _search(Tensor.full((b, 1), -1, dtype=dtypes.int32, device=x.device),
                          Tensor.full((b, 1), n - 1, dtype=dtypes.int32, device=x.device), rounds,
                          lambda i: Tensor.where(index <= i.unsqueeze(-1), p.unsqueeze(1), 0.0).sum(-1) <= target)
    return Tensor.where(temperature <= 0.0, greedy, last.reshape(b)).cast(dtypes.int32)


def top_logprobs(logits: np.ndarray, tokens: list[int], counts: list[int]
                 ) -> list[tuple[float, list[tuple[int, float]]]]:
    """Per row of (B, V) logits: the log-probability (log_softmax, in float64) of `tokens[row]` and the
    `counts[row]` most likely tokens as (id, log-probability), most likely first."""
    x = logits.astype(np.float64)
    x -= x.max(-1, keepdims=True)
    lp = x - np.log(np.exp(x).sum(-1, keepdims=True))
    out = []
    for row, tok, k in zip(lp, tokens, counts):
        top = np.argpartition(-row, k)[:k] if 0 < k < row.size else np.arange(row.size if k else 0)
        top = top[np.argsort(-row[top], kind="stable")]
        out.append((float(row[tok]), [(int(t), float(row[t])) for t in top]))
    return out


def _search(lo: Tensor, hi: Tensor, rounds: int, holds: Callable[[Tensor], Tensor]) -> tuple[Tensor, Tensor]:
    """Narrow (B, 1) intervals [lo, hi], where `holds` (true at lo, false at hi, monotone) turns false:
    each round tries SEARCH_WIDTH points of the interval at once ((B, SEARCH_WIDTH) to `holds`) and keeps the
    piece where it changes. Integer intervals stay integer."""
    steps = Tensor(np.arange(1, SEARCH_WIDTH + 1, dtype=np.int32), device=lo.device).reshape(1, SEARCH_WIDTH)
    for _ in range(rounds):
        if lo.dtype.is_float:
            mid = lo + (hi - lo) * (steps.float() * (1.0 / (SEARCH_WIDTH + 1)))
        else:
            mid = lo + (hi - lo) * steps // (SEARCH_WIDTH + 1)
        ok = holds(mid)
        lo, hi = Tensor.where(ok, mid, lo).max(-1, keepdim=True), Tensor.where(ok, hi, mid).min(-1, keepdim=True)
    return lo, hi


@dataclass(frozen=True)
class SamplingParams:
    """One request's sampling: temperature (0: greedy), top_k (0: off), top_p (1.0: off), seed (None: fresh
    entropy), max_new_tokens, the token ids that end it (not yielded), and `logprobs` (None: off; n: each token's
    log-probability under the model's distribution and the n most likely tokens', in `Sequence.logprobs`)."""

    max_new_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    logprobs: int | None = None
    # penalties as OpenAI and vLLM define them: presence subtracts once from the logit of each token generated so
    # far, frequency once per time it was generated; repetition divides (positive) or multiplies (negative) the
    # logits of the tokens of the prompt and the output (1.0: off); logit_bias adds (token, value) pairs; min_p
    # keeps the tokens at least min_p times as likely as the most likely one
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_p: float = 0.0

    def __post_init__(self) -> None:
        # every value bounded by what the kernels take: int32 for counts, float32 for numbers (a value past them
        # would fail in the runner, not here)
        if not _is_int(self.max_new_tokens) or not 0 <= self.max_new_tokens <= INT32_MAX:
            raise ArgumentError(f"max_new_tokens must be an int in [0, {INT32_MAX}], got {_short(self.max_new_tokens)}")
        if not _is_number(self.temperature) or not 0.0 <= self.temperature <= FLOAT32_MAX:
            raise ArgumentError(f"temperature must be a finite number >= 0, got {_short(self.temperature)}")
        if not _is_int(self.top_k) or not 0 <= self.top_k <= INT32_MAX:
            raise ArgumentError(f"top_k must be an int in [0, {INT32_MAX}] (0: off), got {_short(self.top_k)}")
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ArgumentError(f"top_p must be in (0, 1], got {_short(self.top_p)}")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < 1 << 64):
            raise ArgumentError(f"seed must be an int in [0, 2**64) or None, got {_short(self.seed)}")
        if not all(_is_int(t) and 0 <= t <= INT32_MAX for t in self.stop_token_ids):
            raise ArgumentError(f"stop_token_ids must be ints in [0, {INT32_MAX}], got {_short(self.stop_token_ids)}")
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ArgumentError(f"logprobs must be an int in [0, {MAX_LOGPROBS}] or None, got {_short(self.logprobs)}")
        for name, low, high in (("presence_penalty", -2.0, 2.0), ("frequency_penalty", -2.0, 2.0),
                                ("repetition_penalty", 1e-3, 1e3), ("min_p", 0.0, 1.0)):
            v = getattr(self, name)
            if not _is_number(v) or not low <= v <= high:
                raise ArgumentError(f"{name} must be a number in [{low:g}, {high:g}], got {_short(v)}")
            object.__setattr__(self, name, float(v))
        if not all(_is_int(t) and 0 <= t <= INT32_MAX and _is_number(v) and -100 <= v <= 100
                   for t, v in self.logit_bias):
            raise ArgumentError(f"logit_bias must map token ids to numbers in [-100, 100], got "
                                f"{_short(self.logit_bias)}")
        object.__setattr__(self, "temperature", float(self.temperature))
        object.__setattr__(self, "top_p", float(self.top_p))

    @property
    def penalized(self) -> bool:
        """Whether the logits are adjusted by what the sequence holds (presence, frequency, repetition)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)


INT32_MAX = (1 << 31) - 1
MAX_LOGPROBS = 20  # most likely tokens a request may ask the log-probabilities of, per position
FLOAT32_MAX = float(np.finfo(np.float32).max)


def _is_int(v: Any) -> bool:
    return isinstance(v, int | np.integer) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    """A real number that converts to a float (not a bool, not an int past float's range: 10**400)."""
    if isinstance(v, bool) or not isinstance(v, int | float | np.integer | np.floating):
        return False
    try:
        return math.isfinite(float(v))
    except OverflowError:
        return False


def _short(v: Any, limit: int = 60) -> str:
    """repr(v), cut to `limit` characters (a value in an error message may be as long as its sender made it)."""
    r = repr(v) if not (isinstance(v, int) and v.bit_length() > 256) else f"an int of {v.bit_length()} bits"
    return r if len(r) <= limit else r[: limit - 3] + "..."


class _Inbox:
    """A sequence's tokens on their way to its stream (then None at its end, or the error that ended it), for one
    consumer (`TokenStream.__anext__`). A consumer that finds nothing waits on a future, and the next item is handed
    over in that future itself, not through the deque: a batch-32 step wakes 32 consumers, each with no queue work
    past its own wake-up. An item handed over to a consumer cancelled before it ran goes back to the deque's front."""

    __slots__ = ("items", "waiter")

    def __init__(self) -> None:
        self.items: deque[int | BaseException | None] = deque()
        self.waiter: asyncio.Future[int | BaseException | None] | None = None

    def put_nowait(self, item: int | BaseException | None) -> None:
        waiter = self.waiter
        if waiter is not None:
            self.waiter = None
            if not waiter.done():  # (done: its consumer was cancelled while it waited)
                waiter.set_result(item)
                return
        self.items.append(item)

    def dropped(self, waiter: asyncio.Future[int | BaseException | None]) -> None:
        """The consumer waiting on `waiter` was cancelled: an item handed over in it goes back to the deque's front."""
        if waiter.done() and not waiter.cancelled():
            self.items.appendleft(waiter.result())
        elif self.waiter is waiter:
            self.waiter = None


@dataclass(eq=False)
class Sequence:
    """A request in the engine: its prompt, what it generated so far, and where it stands."""

    prompt: list[int]
    params: SamplingParams
    slot: int = -1  # its KV-cache slot while prefilling or active (then the last one it held)
    cached: int = 0  # tokens whose keys and values are in the cache (the next token's position)
    pending: int = -1  # the last token sampled, fed at the next step
    tokens: list[int] = field(default_factory=list)  # generated (and handed out) tokens
    # with params.logprobs: per generated token, its log-probability and the most likely tokens' (id, logprob)
    logprobs: list[tuple[float, list[tuple[int, float]]]] = field(default_factory=list)
    # with penalties: how often each token of the vocabulary was generated, and the prompt's tokens
    counts: np.ndarray | None = None
    in_prompt: np.ndarray | None = None
    finish_reason: str | None = None  # "stop", "length", "cancelled" or "error"
    # where it stands: "new" -> "waiting" (for a slot) -> "prefilling" (holds a slot, its prompt in flight) ->
    # "active" (holds a slot, decoded by each step) -> "finished"; a sequence ended while its prefill is in flight
    # is "finishing" until the prefill returns and its slot is freed
    state: str = "new"
    # its generator of uniform numbers (params.seed's), made at its first sampled draw: a greedy row reads none, and
    # default_rng() takes 30-80 us (OS entropy, seed hashing), which a crowd of greedy requests paid on the loop
    rng: np.random.Generator | None = None
    # its next uniform numbers, drawn from `rng` DRAWS at a time (the same stream as one draw a step), last first
    draws: list[float] = field(default_factory=list)
    # the params whose sampling values were last checked against the kernels' ranges, and those values (SamplingParams
    # is frozen: a sampled step checks a row's values once, not each step)
    checked: SamplingParams | None = None
    values: tuple[float, int, float] = (0.0, 0, 1.0)
    queue: _Inbox = field(default_factory=_Inbox)

    @property
    def done(self) -> bool:
        """True once the sequence has finished (`finish_reason` is set)."""
        return self.finish_reason is not None


def _buckets(limit: int) -> list[int]:
    """1, 2, 4, ... below `limit`, then `limit`."""
    return [1 << i for i in range(limit.bit_length()) if 1 << i < limit] + [limit]


def _bucket(n: int, limit: int) -> int:
    """The first of `_buckets(limit)` that holds `n` (<= limit)."""
    b = 1 << max(n - 1, 0).bit_length()
    return b if b < limit else limit


@dataclass(eq=False)
class _Launched:
    """A decode step queued on the device: its sequences, rows (None: padding), its logits (None unless a row asked
    for logprobs), the read of the state it wrote (its tokens: `_Chain`; `read_now`'s coroutine, awaited by `_land`),
    and its other inputs."""

    seqs: list[Sequence]
    rows: list[Sequence | None]
    logits: Tensor | None
    read: Coroutine[Any, Any, np.ndarray]
    # its inputs besides the state, which a chained step takes again (the rows and their values are the same; a
    # sampled step's floats are new: its uniform draws)
    floats: Tensor
    flags: dict[str, bool]
    extras: dict[str, Tensor | None]
    # what `_chainable` asks, known at the launch so that it costs no pass over the rows: the engine's `changes`
    # when the launch took its rows (a sequence ended, failed or joined since: not the same batch), how many steps
    # after this one's the batch has room for (each row's token budget and cache), whether a row's sampling reads
    # the tokens so far (penalties), and the highest position a row feeds (the attention window)
    changes: int = 0
    room: int = 0
    penalized: bool = False
    top: int = 0


DRAWS = 32  # a sampled sequence's uniform numbers drawn at once (`Engine._sampling_row`)
TOKEN, POSITION, TOP_K = range(3)  # the rows of a decode step's state (`_Chain`)
STATE_ROWS = 3


class _Chain:
    """A batch bucket's decode state on the device, (STATE_ROWS, B) int32: each row's token, position and top-k;
    and its rows' slots (B,), which a chained step reads again. `state` is what the next step reads; the step writes
    the state after it in place into `written` (one kernel), and `turn(...)` then swaps the two, so chained steps
    read and write the same two buffers in turn: every kernel that reads the slots, tokens or positions (each
    layer's key and value writes and attention) keeps its arguments from step to step (on CUDA, no parameter update
    of the step's graph). `start(slots, state)`: a step's slots and state from the host."""

    def __init__(self, written: Tensor):
        self.written = written  # (realized: a buffer of its own)
        self.state: Tensor | None = None
        self.slots: Tensor | None = None

    def start(self, slots: Tensor, state: Tensor) -> None:
        """The next step reads `slots` and `state` (uploaded by the host)."""
        self.slots, self.state = slots, state

    def turn(self, wrote: Tensor) -> Tensor:
        """After a step that returned `wrote` (its handle of what it wrote into `written`): that state is the next
        step's, and the state the step read is where the next one writes (`written`'s buffer is then held by nothing
        else, so the next step's write stays in place). Returns the tensor of the state written (the next step's)."""
        if wrote is self.written:  # (a call that traced returns the handle itself, which is rebound here)
            wrote = Tensor.zeros(*wrote.shape, dtype=dtypes.int32, device=wrote.device).assign(wrote)
        assert self.state is not None
        self.written.assign(self.state)
        self.state = wrote
        return wrote


# ------------------------------------------------------------------------------------------------ engine
class Engine:
    """Continuous batching over a `KVCache` of `slots` sequences of up to `max_len` tokens (default n_positions).

    Step by step (what a service loop calls): `seq = await add(prompt, params)` prefills a free slot and samples
    the first token; `await step()` feeds every active sequence's last token in one plan and returns the new tokens;
    `remove(seq)` frees the slot at once. A sequence that meets a stop token, max_new_tokens or max_len is removed
    by the step that ends it. Or, streaming: `async for token in engine.generate(prompt, ...)`, many at once; a
    runner task admits new requests between steps and decodes every active one together; with `prefill_batch` > 1 it
    prefills up to that many waiting prompts of one length bucket in one plan (a crowd arriving at once starts
    together). Every call on the model (prefill, step) runs under one lock, so they never interleave."""

    def __init__(self, model: GPT2, slots: int = 4, max_len: int | None = None, max_waiting: int = 0,
                 min_window: int = WINDOW_BASE, prefill_batch: int = 1):
        if max_waiting < 0:
            raise ArgumentError(f"max_waiting must be >= 0, got {max_waiting}")
        if min_window < 1:
            raise ArgumentError(f"min_window must be >= 1, got {min_window}")
        if not isinstance(prefill_batch, int) or not 1 <= prefill_batch <= slots:
            raise ArgumentError(f"prefill_batch must be in [1, slots={slots}], got {prefill_batch!r}")
        self.model = model
        # requests waiting together whose prompts fall in one length bucket are prefilled in one plan, up to this
        # many (and PREFILL_TOKENS padded tokens): a crowd arriving at once starts together (vLLM batches prefills
        # alike); each batch bucket up to it is a plan of its own that `warmup` makes
        self.prefill_batch = prefill_batch
        self.max_waiting = max_waiting  # streamed requests that may wait for a slot (past that: NoFreeSlotError)
        self.cache = model.kv_cache(slots, max_len or model.config.n_positions)
        self.active: dict[int, Sequence] = {}  # slot -> its sequence
        self.waiting: deque[Sequence] = deque()  # streamed requests not yet prefilled
        self.live: set[Sequence] = set()  # every sequence not finished (waiting, prefilling, active, finishing)
        self.lock = asyncio.Lock()
        self.runner: asyncio.Task[None] | None = None
        self.ready = False
        # the last prefill's or step's logits (rows, vocab), realized (a streamed step's only where a row asked for
        # logprobs: else None), and the sequence of each row (None: padding)
        self.logits: Tensor | None = None
        self.rows: list[Sequence | None] = []
        self.batch: list[Sequence] = []  # the sequences of the step in flight (or the last one)
        self.inflight: _Launched | None = None  # a step queued whose tokens are not read yet (the runner's)
        self.chained = 0  # steps queued before the last one's tokens were read (for tests and debugging)
        self.changes = 0  # counts the changes of the active batch (a sequence ended or joined): `_chainable`
        self.greedy: dict[int, Tensor] = {}  # per batch size, the floats of a step no row of which samples
        self.chains: dict[int, _Chain] = {}  # per batch size, the decode state on the device (`_Chain`)
        # the graphs, staged: the first call of a shape traces and plans it, later ones replay the plan (the cache
        # handles they write are rebound to the new values; the weights are the trace's: reload means a new engine)
        # the cache rows a decode step reads: the first bucket of WINDOW_BASE * 4**i (and max_len) above the
        # batch's longest sequence, so a step's attention and cache reads follow the sequences' lengths
        self.windows = [w for w in (min_window << 2 * i for i in range(16)) if w < self.cache.max_len] + \
            [self.cache.max_len]
        self.prefill_step = jit(self._prefill_graph)
        self.decode_step = jit(self._decode_graph, static_argnames="window")
        self.score_step = jit(self._score_graph)

    # ---------------------------------------------------------------- requests
    def request(self, prompt: Iterable[int], params: SamplingParams) -> Sequence:
        """A new sequence, its prompt checked against the vocabulary and max_len (ArgumentError names the value)."""
        ids = [int(i) for i in prompt]
        v, limit = self.model.config.vocab_size, self.cache.max_len
        if not ids:
            raise ArgumentError("the prompt is empty: GPT-2 needs at least one token")
        if len(ids) > limit:
            raise ArgumentError(f"the prompt has {len(ids)} tokens, more than the model's limit of {limit}")
        bad = [i for i in ids if not 0 <= i < v]
        if bad:
            raise ArgumentError(f"token id {bad[0]} is outside the vocabulary of {v}")
        bad = [t for t, _ in params.logit_bias if not 0 <= t < v]
        if bad:
            raise ArgumentError(f"logit_bias token id {bad[0]} is outside the vocabulary of {v}")
        seq = Sequence(ids, params)
        if params.penalized:
            seq.counts = np.zeros(v, np.float32)
            seq.in_prompt = np.zeros(v, bool)
            seq.in_prompt[ids] = True
        return seq

    def params(self, max_new_tokens: int = 16, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
               seed: int | None = None, stop_token_ids: Iterable[int] = (), eos_token_id: int | None = None,
               ignore_eos: bool = False, logprobs: int | None = None, **penalties: Any) -> SamplingParams:
        """SamplingParams with the model's eos token (or `eos_token_id`) among the stop tokens, unless ignore_eos;
        `penalties`: SamplingParams' presence_penalty, frequency_penalty, repetition_penalty, logit_bias, min_p."""
        eos = eos_token_id if eos_token_id is not None else self.model.config.eos_token_id
        stops = tuple(int(s) for s in stop_token_ids) + ((eos,) if eos is not None and not ignore_eos else ())
        if isinstance(penalties.get("logit_bias"), dict):
            penalties["logit_bias"] = tuple(penalties["logit_bias"].items())
        return SamplingParams(max_new_tokens, temperature, top_k, top_p, seed, stops, logprobs, **penalties)

    async def add(self, prompt: Iterable[int], params: SamplingParams | None = None) -> Sequence:
        """Prefill `prompt` into a free slot and sample its first token (in `seq.tokens`, unless it stopped it).
        Raises NoFreeSlotError when every slot is taken."""
        seq = self.request(prompt, params or self.params())
        if not self.cache.free:
            raise NoFreeSlotError(f"all {self.cache.slots} slots of the KV cache hold sequences")
        async with self.lock:
            await self._settle()
            self.live.add(seq)
            try:
                await self._prefill([seq], [self._sampling_row(seq)])
            except BaseException:
                self.remove(seq, "error")
                raise
        return seq

    async def step(self) -> dict[Sequence, int]:
        """One decode step of every active sequence; returns each one's new token (a stop token included: that
        sequence is then finished and removed)."""
        async with self.lock:
            return await self._step()

    def remove(self, seq: Sequence, reason: str = "cancelled") -> None:
        """End `seq` now, whatever its state: waiting, it leaves the queue; active, its slot is free for the next
        request; prefilling, its slot is freed as soon as the prefill in flight returns (nothing waits on it). Its
        stream ends."""
        if seq.done:
            return
        seq.finish_reason = reason
        self.changes += 1
        if seq.state == "waiting":
            self.waiting.remove(seq)
        elif seq.state == "active":
            del self.active[seq.slot]
            self.cache.release(seq.slot)
        if seq.state == "prefilling":
            seq.state = "finishing"  # (_prefill frees the slot and ends it)
        else:
            seq.state = "finished"
            self.live.discard(seq)
        seq.queue.put_nowait(None)

    def fail(self, seq: Sequence, error: BaseException) -> None:
        """End `seq` with `error` (its stream raises it); nothing else is touched."""
        if not seq.done:
            seq.queue.put_nowait(error)
        self.remove(seq, "error")

    def generate(self, prompt: Iterable[int], max_new_tokens: int = 16, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, seed: int | None = None, stop_token_ids: Iterable[int] = (),
                 eos_token_id: int | None = None, ignore_eos: bool = False,
                 logprobs: int | None = None, **penalties: Any) -> TokenStream:
        """`async for token in engine.generate(prompt_ids, ...)`: the request's new tokens as they are decoded,
        batched with every other request in flight. Bad arguments raise here (ArgumentError naming the value), so
        does a full pool (NoFreeSlotError; with `max_waiting`, that many requests past the slots wait for one, in
        arrival order). `stream.cancel()` (or `aclose()`) ends it and frees its slot at once. With `logprobs` (n),
        each token's log-probability and the n most likely tokens' are in `stream.logprobs` when it is handed out.
        `penalties`: presence_penalty, frequency_penalty, repetition_penalty, logit_bias ({token: value}), min_p
        (see SamplingParams): per-row values on the device, a new value compiles nothing."""
        p = self.params(max_new_tokens, temperature, top_k, top_p, seed, stop_token_ids, eos_token_id, ignore_eos,
                        logprobs, **penalties)
        seq = self.request(prompt, p)
        if len(self.live) >= self.cache.slots + self.max_waiting:
            raise NoFreeSlotError(f"all {self.cache.slots} slots of the KV cache hold sequences"
                                  + (f" and {self.max_waiting} requests wait for one" if self.max_waiting else ""))
        if p.max_new_tokens == 0:
            self._finish(seq, "length")
        else:
            seq.state = "waiting"
            self.waiting.append(seq)
            self.live.add(seq)
            if self.runner is None or self.runner.done():
                self.runner = asyncio.get_running_loop().create_task(self._run())
                # (its failure reaches every stream; retrieving it here keeps asyncio from reporting it again)
                self.runner.add_done_callback(lambda t: t.cancelled() or t.exception())
        return TokenStream(self, seq)

    async def prompt_logprobs(self, prompt: Iterable[int], top: int = 0
                              ) -> list[tuple[float, list[tuple[int, float]]] | None]:
        """Each prompt token's log-probability given the tokens before it and the `top` most likely tokens' there, as
        `stream.logprobs` holds them for generated tokens; None for the first token (nothing precedes it). One causal
        forward pass of the prompt, padded to its length bucket (one plan per bucket; no cache slot is used), under
        the engine's lock; the log-softmax runs on a worker thread. A bad prompt raises ArgumentError."""
        ids = self.request(prompt, self.params()).prompt
        n = len(ids)
        length = _bucket(n, self.cache.max_len)
        async with self.lock:
            logits = await self.score_step(self._device([ids + [0] * (length - n)], dtypes.int32))
            rows = (await logits.numpy())[: n - 1]  # (position i predicts token i + 1)
        scored = await in_worker_thread(top_logprobs, rows, ids[1:], [top] * (n - 1)) if n > 1 else []
        return [None, *scored]

    def _window(self, n: int) -> int:
        return next(w for w in self.windows if w >= n)

    async def warmup(self, batch_sizes: Iterable[int] | None = None, prompt_lengths: Iterable[int] = (),
                     sampled: bool = False, logprobs: bool = False) -> None:
        """Trace, plan and compile the decode step of every batch bucket that `batch_sizes` fall in (default: every
        one up to the slots) at every attention window (`windows`), and the prefill of every bucket of
        `prompt_lengths`, greedy (and, with `sampled`, with temperature, top-k and top-p on; with `logprobs`, also
        the steps that keep their logits for the rows that ask for logprobs), before serving. A
        shape's first step otherwise builds, walks and releases its whole graph on the event loop (tens of ms for
        GPT-2 small) while the streams in flight wait. Runs on the scratch slot: no sequence's cache is touched."""
        variants = [dict(sample=False, filter_k=False, filter_p=False)]
        if sampled:
            variants.append(dict(sample=True, filter_k=True, filter_p=True))
        steps = [{**v, "logits": keep} for keep in ((False, True) if logprobs else (False,)) for v in variants]
        sizes = range(1, self.cache.slots + 1) if batch_sizes is None else batch_sizes
        async with self.lock:
            await self._settle()
            await self._ready()
            scratch = self.cache.scratch
            shapes = [(b, w) for b in sorted({_bucket(n, self.cache.slots) for n in sizes}) for w in self.windows]
            for b, w in shapes:
                for flags in steps:
                    # the step's inputs as `_launch` makes them: floats uploaded where a row samples, else the
                    # device's greedy zeros
                    rows = [(1.0, 1, 1.0, 0.0) if flags["sample"] else self._sampling_row(None)] * b
                    # traced, then replayed (the first run uploads the greedy zeros: a trace of their own), then
                    # chained (`_launch`) on the state a step wrote: tensors a step made on the device may key a trace
                    # of their own
                    chain = await self._chain(b)
                    for i in range(5):
                        if i < 3:
                            chain.start(self._device([scratch] * b, dtypes.int32),
                                        self._device([[0] * b, [0] * b, [r[1] for r in rows]], dtypes.int32))
                        floats, _ = self._decode_floats(rows)
                        out = await self.decode_step(chain.slots, chain.state, floats, **flags, window=w)
                        chain.turn(out[0])
            for length in sorted({_bucket(n, self.cache.max_len) for n in prompt_lengths}):
                for b in _buckets(self._prefill_limit(length)):
                    sampling, _ = self._sampling([None] * b)
                    ids = self._device([[0] * length] * b, dtypes.int32)
                    for flags in variants:
                        await self.prefill_step(ids, self._device([scratch] * b, dtypes.int32),
                                                self._device([0] * b, dtypes.int32), *sampling, **flags)

    async def close(self) -> None:
        """Stop the runner; every stream in flight ends with RuntimeStateError."""
        if self.runner is not None:
            self.runner.cancel()
            try:
                await self.runner
            except asyncio.CancelledError:
                pass
            self.runner = None

    # ---------------------------------------------------------------- the work
    async def _run(self) -> None:
        """The runner: prefills waiting requests into free slots and steps the active ones until none is left. While
        the batch stays the same, the next step is queued before the last one's tokens are read (`_launch` chained
        on the device's tokens): the host's work for a step overlaps the device's for the one before. A request's
        own failure (its prefill, its sampling values, a step) ends that request (or the step's batch) with the
        error; the runner keeps serving the others."""
        try:
            while self.active or self.waiting or self.inflight is not None:
                async with self.lock:
                    chained = self.inflight if self.inflight is not None and self._chainable(self.inflight) else None
                    if chained is None:
                        await self._settle()
                        while self.waiting and self.cache.free:
                            group, rows = [], []
                            for seq in self._prefill_group():
                                try:  # (a request's own sampling values that do not fit fail it alone)
                                    rows.append(self._sampling_row(seq))
                                    group.append(seq)
                                except Exception as e:
                                    self.fail(seq, e)
                            try:
                                if group:
                                    await self._prefill(group, rows)
                            except Exception as e:
                                for seq in group:
                                    self.fail(seq, e)
                    if self.active:
                        failed: Exception | None = None
                        try:
                            launched = await self._launch(chained)
                        except Exception as e:  # the step's batch fails; later requests are served
                            launched, failed = None, e
                        try:
                            await self._settle()  # (the chained step's tokens: read while `launched` runs)
                        finally:
                            self.inflight = launched
                        if failed is not None:
                            for seq in self.batch:
                                self.fail(seq, failed)
                # a step whose work was done when awaited never gave the loop a turn: the clients' sends, new
                # requests and disconnects are handled between steps, not after a whole sequence
                await asyncio.sleep(0)
        except BaseException as e:
            err = e if isinstance(e, Exception) else RuntimeStateError("the generation engine was closed")
            if self.inflight is not None:  # (its tokens are never read)
                self.inflight.read.close()
                self.inflight = None
            for seq in list(self.live):
                self.fail(seq, err)
            raise

    async def _ready(self) -> None:
        if not self.ready:  # the cache as buffers, so that every write is in place (and plans the same)
            await realize(*self.cache.tensors())
            self.ready = True

    def _device(self, data: Any, dtype: DType) -> Tensor:
        return Tensor(np.asarray(data, dtype=dtype.numpy), dtype=dtype, device=self.model.device)

    def _sampling_row(self, seq: Sequence | None) -> tuple[float, int, float, float]:
        """A row's sampling values (padding: greedy), checked to fit the kernels' float32 and int32, with the
        request's uniform number drawn from its own generator; a value that does not fit raises (for that request)."""
        v = self.model.config.vocab_size
        if seq is None:
            return 0.0, v, 1.0, 0.0
        p = seq.params
        if seq.checked is not p:
            t, k, top_p = float(p.temperature), int(p.top_k or v), float(p.top_p)
            if not (0.0 <= t <= FLOAT32_MAX and 0 <= k <= INT32_MAX and 0.0 < top_p <= 1.0):
                raise ArgumentError(f"sampling values past the kernels' range: temperature {_short(p.temperature)}, "
                                    f"top_k {_short(p.top_k)}, top_p {_short(p.top_p)}")
            seq.checked, seq.values = p, (t, k, top_p)
        t, k, top_p = seq.values
        if t == 0.0:  # (greedy: the sampler reads no uniform number)
            return t, k, top_p, 0.0
        if not seq.draws:
            if seq.rng is None:
                seq.rng = np.random.default_rng(p.seed)
            seq.draws = seq.rng.random(DRAWS).tolist()[::-1]
        return t, k, top_p, seq.draws.pop()

    def _decode_floats(self, rows: list[tuple[float, int, float, float]]) -> tuple[Tensor, dict[str, bool]]:
        """A decode step's floats (3, B) of temperature, top-p and the uniform draw (no row sampling: zeros the device
        holds, which no kernel reads), and the sampler's parts some row uses."""
        t, _, p, u = zip(*rows)
        parts = self._parts(rows)
        if parts["sample"]:
            return self._device([t, p, u], dtypes.float32), parts
        floats = self.greedy.get(len(rows))
        if floats is None:
            floats = self.greedy[len(rows)] = self._device(np.zeros((3, len(rows))), dtypes.float32)
        return floats, parts

    async def _chain(self, b: int) -> _Chain:
        """Batch bucket `b`'s chain (made on first use, its buffers realized: a step writes into them in place)."""
        chain = self.chains.get(b)
        if chain is None:
            chain = _Chain(self._device(np.zeros((STATE_ROWS, b)), dtypes.int32))
            await realize(chain.written)
            self.chains[b] = chain
        return chain

    def _parts(self, rows: list[tuple[float, int, float, float]]) -> dict[str, bool]:
        """Which parts of the sampler some row of `rows` (`_sampling_row`s) uses (the others are left out of the
        plan)."""
        v = self.model.config.vocab_size
        sampled = [r for r in rows if r[0] > 0]
        return dict(sample=bool(sampled), filter_k=any(r[1] < v for r in sampled),
                    filter_p=any(r[2] < 1.0 for r in sampled))

    def _sampling(self, seqs: list[Sequence | None]) -> tuple[list[Tensor], dict[str, bool]]:
        """The per-row sampling tensors of `seqs` (their `_sampling_row`s; a prefill's), and which parts of the
        sampler some row uses."""
        return self._sampling_of([self._sampling_row(s) for s in seqs])

    def _sampling_of(self, rows: list[tuple[float, int, float, float]]) -> tuple[list[Tensor], dict[str, bool]]:
        """`_sampling` of rows made already (`_sampling_row` draws the row's uniform number: once a row)."""
        t, k, p, u = zip(*rows)
        return [self._device(t, dtypes.float32), self._device(k, dtypes.int32), self._device(p, dtypes.float32),
                self._device(u, dtypes.float32)], self._parts(rows)

    def _extras(self, rows: list[Sequence | None]) -> dict[str, Tensor | None]:
        """The optional parts of the sampler some row of a batch uses, as per-row tensors (None: left out of the
        plan): `scale` (repetition penalty at the tokens of the prompt and the output), `bias` (logit_bias, presence
        and frequency penalties over the tokens generated so far), `min_p`."""
        v = self.model.config.vocab_size
        seqs = [s for s in rows if s is not None]
        out: dict[str, Tensor | None] = {}
        if any(s.params.repetition_penalty != 1.0 for s in seqs):
            scale = np.ones((len(rows), v), np.float32)
            for i, s in enumerate(rows):
                if s is not None and s.counts is not None and s.in_prompt is not None:
                    scale[i, s.in_prompt | (s.counts > 0)] = s.params.repetition_penalty
            out["scale"] = self._device(scale, dtypes.float32)
        if any(s.params.logit_bias or s.params.presence_penalty or s.params.frequency_penalty for s in seqs):
            bias = np.zeros((len(rows), v), np.float32)
            for i, s in enumerate(rows):
                if s is None:
                    continue
                for t, value in s.params.logit_bias:
                    bias[i, t] += value
                if s.counts is not None:
                    bias[i] -= s.params.presence_penalty * (s.counts > 0) + s.params.frequency_penalty * s.counts
            out["bias"] = self._device(bias, dtypes.float32)
        if any(s.params.min_p > 0 for s in seqs):
            out["min_p"] = self._device([s.params.min_p if s is not None else 0.0 for s in rows], dtypes.float32)
        return out

    def _prefill_graph(self, ids: Tensor, slots: Tensor, lasts: Tensor, temperature: Tensor, top_k: Tensor,
                       top_p: Tensor, uniform: Tensor, sample: bool, filter_k: bool,
                       filter_p: bool, **extras: Tensor | None) -> tuple[Tensor, Tensor]:
        """Prompts (B, T), one a row, into `slots` (B): each row's next token and logits (B, vocab) at its position
        `lasts` (B; tensors: data)."""
        b = ids.shape[0]
        h = self.model.hidden(ids, view=Prefill(self.cache, slots))
        e = h.shape[-1]
        logits = self.model.head(h.gather(1, lasts.reshape(b, 1, 1).expand(b, 1, e)).reshape(b, e))
        token = sample_tokens(logits, temperature, top_k, top_p, uniform, sample=sample, filter_k=filter_k,
                              filter_p=filter_p, **extras)
        return token, logits

    def _decode_graph(self, slots: Tensor, state: Tensor, floats: Tensor, sample: bool, filter_k: bool, filter_p: bool,
                      window: int, logits: bool = False, **extras: Tensor | None) -> tuple[Tensor, ...]:
        """One token per row at its position of its slot (`slots`, B), `state` (STATE_ROWS, B) holding each row's
        token, position and top-k (`_Chain`), `floats` (3, B) its temperature, top-p and uniform draw. The next step's
        state (each row's token sampled, its position one further) is written in place into the batch's chain
        (`_Chain.written`) and returned: the host reads the tokens there, a chained step reads the state there, so
        the buffers that every layer's kernels read and the step writes keep their addresses from step to step. With
        `logits` (a row asked for logprobs), the logits (B, vocab) are returned too (else they stay a temporary of
        the step)."""
        tokens, positions, top_k = state[TOKEN], state[POSITION], state[TOP_K]
        temperature, top_p, uniform = floats[0], floats[1], floats[2]
        b = tokens.shape[0]
        view = Decode(self.cache, slots, positions, window)
        out = self.model(tokens.reshape(b, 1), positions.reshape(b, 1), view).reshape(b, -1)
        token = sample_tokens(out, temperature, top_k, top_p, uniform, sample=sample, filter_k=filter_k,
                              filter_p=filter_p, **extras)
        written = self.chains[b].written
        written[:] = Tensor.stack([token, positions + 1, top_k])
        return (written, out) if logits else (written,)

    def _score_graph(self, ids: Tensor) -> Tensor:
        """The logits (T, vocab) of a prompt (1, T) under causal attention over its own tokens (no cache)."""
        return self.model(ids)[0]

    def _prefill_limit(self, length: int) -> int:
        """The most prompts of padded `length` one prefill takes (`prefill_batch`, within PREFILL_TOKENS)."""
        return max(1, min(self.prefill_batch, PREFILL_TOKENS // length))

    def _prefill_group(self) -> list[Sequence]:
        """The waiting requests to prefill next, taken off the queue: the first in line, and after it those whose
        prompts fall in its length bucket, up to `_prefill_limit` and the free slots (a crowd's prompts of one
        bucket start in one plan; the others wait for the next)."""
        first = self.waiting.popleft()
        length = _bucket(len(first.prompt), self.cache.max_len)
        limit = min(self._prefill_limit(length), len(self.cache.free))
        group = [first]
        for seq in list(self.waiting):
            if len(group) >= limit:
                break
            if _bucket(len(seq.prompt), self.cache.max_len) == length:
                self.waiting.remove(seq)
                group.append(seq)
        for seq in group:
            seq.state = "new"  # (off the queue)
        return group

    async def _prefill(self, seqs: list[Sequence], rows: list[tuple[float, int, float, float]]) -> None:
        """Prefill `seqs` (state "new", prompts of one length bucket; `rows` their `_sampling_row`s) into free slots
        in one plan: "prefilling" while their prompts run, then "active" with their first tokens; one ended meanwhile
        ("finishing") has its slot freed when the prefill returns. A failure frees the slots and raises."""
        for seq in seqs:
            seq.state = "prefilling"
        await self._ready()
        live = []
        for seq, row in zip(seqs, rows):
            if seq.state == "finishing":  # ended before its prompt ran: it never held a slot
                seq.state = "finished"
                self.live.discard(seq)
            else:
                seq.slot = self.cache.allocate()
                live.append((seq, row))
        if not live:
            return
        batch = [seq for seq, _ in live]
        try:
            length = _bucket(max(len(s.prompt) for s in batch), self.cache.max_len)
            pad = _bucket(len(batch), self._prefill_limit(length)) - len(batch)  # (padding rows: the scratch slot)
            ids = self._device([s.prompt + [0] * (length - len(s.prompt)) for s in batch] + [[0] * length] * pad,
                               dtypes.int32)
            slots = self._device([s.slot for s in batch] + [self.cache.scratch] * pad, dtypes.int32)
            lasts = self._device([len(s.prompt) - 1 for s in batch] + [0] * pad, dtypes.int32)
            sampling, flags = self._sampling_of([row for _, row in live] + [self._sampling_row(None)] * pad)
            # (queued, not awaited: reading the tokens waits for the step and the read together, one round trip)
            token, logits = await self.prefill_step.submit(ids, slots, lasts, *sampling, **flags,
                                                           **self._extras([*batch, *[None] * pad]))
            self.logits, self.rows = logits, [*batch, *[None] * pad]
            firsts = [int(t) for t in (await token.numpy())[:len(batch)]]
            lps = await self._logprobs(logits, batch, firsts)
        except BaseException:
            for seq in batch:
                self._unslot(seq)
            raise
        for seq, first, lp in zip(batch, firsts, lps):
            if seq.state == "finishing":  # ended while its prompt ran
                self._unslot(seq)
                continue
            seq.cached, seq.state = len(seq.prompt), "active"
            self.active[seq.slot] = seq
            self.changes += 1
            self._accept(seq, first, lp)

    def _unslot(self, seq: Sequence) -> None:
        """A prefill that did not make `seq` active: its slot back to the pool; ended if it was ("finishing")."""
        self.cache.release(seq.slot)
        if seq.state == "finishing":
            seq.state = "finished"
            self.live.discard(seq)
        else:
            seq.state = "new"

    def _chainable(self, step: _Launched) -> bool:
        """Whether the step after `step` may be queued before `step`'s tokens are read: the same sequences go on (none
        ended, none joined since `step`'s launch, and no waiting request a free slot would take), none reaches its
        token budget or the cache's end with `step`'s token, and no row's sampling reads the tokens generated so far
        (penalties). What it reads was counted at `step`'s launch (`_launch`): no pass over the rows."""
        if self.waiting and self.cache.free:
            return False
        return step.changes == self.changes and step.room > 0 and not step.penalized

    async def _launch(self, after: _Launched | None = None, logits: bool = False) -> _Launched | None:
        """Queue a decode step of every active sequence and start reading its tokens; None when no sequence is left.
        `after`: a step in flight whose tokens are not read yet (`_chainable`): this one feeds them from the device,
        one position further. The step keeps its logits (`self.logits`) with `logits` (`step()`'s) or where a row
        asked for logprobs."""
        if not self.ready:
            await self._ready()
        changes = self.changes  # (the batch as taken now: any change from here on, awaits included, breaks the chain)
        values: list[tuple[float, int, float, float]] = []
        seqs: list[Sequence] = []
        if after is not None and not after.flags["sample"]:  # (the same rows and checked values: no row draws)
            seqs = after.seqs
        else:
            for s in [s for _, s in sorted(self.active.items())] if after is None else after.seqs:
                try:
                    values.append(self._sampling_row(s))
                    seqs.append(s)
                except Exception as e:  # this request's own values: it fails, the batch goes on
                    self.fail(s, e)
        self.batch = seqs
        if not seqs or (after is not None and len(seqs) != len(after.seqs)):
            return None
        b = _bucket(len(seqs), self.cache.slots)
        chain = self.chains.get(b) or await self._chain(b)
        if after is None:  # the batch's state from the host: its rows' slots, tokens, positions and top-k
            rows: list[Sequence | None] = [*seqs, *[None] * (b - len(seqs))]
            values += [self._sampling_row(None)] * (b - len(seqs))
            positions = [s.cached if s else 0 for s in rows]
            scratch, limit = self.cache.scratch, self.cache.max_len
            chain.start(self._device([s.slot if s else scratch for s in rows], dtypes.int32),
                        self._device([[s.pending if s else 0 for s in rows], positions, [k for _, k, _, _ in values]],
                                     dtypes.int32))
            # (the steps after this one that every row has room for: its token budget and the cache's end)
            room = min(min(s.params.max_new_tokens - len(s.tokens), limit - s.cached - 1) for s in seqs) - 1
            penalized = any(s.params.penalized or s.params.logit_bias for s in seqs)
            top = max(positions)
        else:  # the state the step before wrote on the device (each row one position further, the same values)
            self.chained += 1
            rows, room, penalized, top = after.rows, after.room - 1, after.penalized, after.top + 1
            if values:
                values += [self._sampling_row(None)] * (b - len(seqs))
        if after is not None and not after.flags["sample"]:
            floats, flags, extras = after.floats, after.flags, after.extras
        else:
            floats, flags = self._decode_floats(values)
            extras = self._extras(rows) if after is None else after.extras
            flags["logits"] = logits or any(s.params.logprobs is not None for s in seqs)
        window = self._window(top + 1)
        state, *kept = await self.decode_step.submit(chain.slots, chain.state, floats, **flags, window=window,
                                                     **extras)
        state = chain.turn(state)
        # the tokens' read (the state the step wrote) queued now: behind this step, ahead of the next one (a chained
        # step is queued before it is awaited, and writes the other buffer); awaited by `_land` (or closed: `_run`)
        read = read_now(state)
        return _Launched(seqs, rows, kept[0] if kept else None, read, floats, flags, extras, changes, room,
                         penalized, top)

    async def _land(self, step: _Launched) -> dict[Sequence, int]:
        """Read a launched step's tokens and hand each to its sequence (those ended meanwhile skip theirs)."""
        self.logits, self.rows = step.logits, step.rows
        out = (await step.read)[TOKEN].tolist()
        seqs = step.seqs
        # (a step keeps no logits where no row asked for logprobs: `_launch`)
        lps = await self._logprobs(step.logits, seqs, out) if step.logits is not None else [None] * len(seqs)
        got: dict[Sequence, int] = {}
        for seq, tok, lp in zip(seqs, out, lps):
            if seq.finish_reason is not None:  # removed while the step ran (`done`)
                continue
            seq.cached += 1
            got[seq] = tok
            self._accept(seq, tok, lp)
        return got

    async def _settle(self) -> dict[Sequence, int]:
        """Land the step in flight, if any (before anything that reads or changes the batch); its failure ends its
        batch."""
        step, self.inflight = self.inflight, None
        if step is None:
            return {}
        try:
            return await self._land(step)
        except Exception as e:
            for seq in step.seqs:
                self.fail(seq, e)
            return {}

    async def _step(self) -> dict[Sequence, int]:
        await self._settle()
        launched = await self._launch(logits=True)
        return await self._land(launched) if launched is not None else {}

    async def _logprobs(self, logits: Tensor | None, seqs: list[Sequence], tokens: list[int]
                        ) -> list[tuple[float, list[tuple[int, float]]] | None]:
        """Per row, for the sequences that asked (`params.logprobs`), the log-probability of its token under the
        model's distribution (log_softmax of the logits) and the most likely tokens'; None for the others. The
        logits come to the host only when some row asked, and the log-softmax runs on a worker thread."""
        want = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
        out: list[tuple[float, list[tuple[int, float]]] | None] = [None] * len(seqs)
        if want:
            assert logits is not None, "a step with rows that ask for logprobs keeps its logits"
            rows = (await logits.numpy())[want]
            counts = [seqs[i].params.logprobs or 0 for i in want]
            for i, entry in zip(want, await in_worker_thread(top_logprobs, rows, [tokens[i] for i in want], counts)):
                out[i] = entry
        return out

    def _accept(self, seq: Sequence, token: int, logprob: tuple[float, list[tuple[int, float]]] | None = None
                ) -> None:
        """A sampled token: a stop token ends the sequence, any other is handed out (then a full budget or a full
        slot ends it)."""
        if token in seq.params.stop_token_ids:
            self._finish(seq, "stop")
            return
        if logprob is not None:
            seq.logprobs.append(logprob)
        if seq.counts is not None:
            seq.counts[token] += 1
        seq.tokens.append(token)
        seq.pending = token
        seq.queue.put_nowait(token)
        if len(seq.tokens) >= seq.params.max_new_tokens or seq.cached >= self.cache.max_len:
            self._finish(seq, "length")

    def _finish(self, seq: Sequence, reason: str) -> None:
        self.remove(seq, reason)


class TokenStream:
    """The async iterator of `Engine.generate`: the request's tokens as they come; `cancel()` (or `aclose()`, or
    leaving `async with stream:`) ends it at once, freeing its slot; `finish_reason` says why it ended ("stop",
    "length", "cancelled", "error"). A task cancelled while it waits for a token leaves the sequence decoding:
    cancel the stream too (a service does when its client goes away)."""

    def __init__(self, engine: Engine, seq: Sequence):
        self.engine, self.seq = engine, seq

    @property
    def finish_reason(self) -> str | None:
        """Why the stream ended ("stop", "length", "cancelled", "error"), or None while it runs."""
        return self.seq.finish_reason

    @property
    def tokens(self) -> list[int]:
        """The tokens generated so far."""
        return self.seq.tokens

    @property
    def logprobs(self) -> list[tuple[float, list[tuple[int, float]]]]:
        """With `logprobs=n`: per token handed out, its log-probability and the n most likely tokens' (id, logprob)."""
        return self.seq.logprobs

    def __aiter__(self) -> AsyncIterator[int]:
        return self

    async def __anext__(self) -> int:
        inbox = self.seq.queue
        if inbox.items:
            item = inbox.items.popleft()
        else:
            waiter = inbox.waiter = asyncio.get_running_loop().create_future()  # (the next item comes in it)
            try:
                item = await waiter
            except asyncio.CancelledError:
                inbox.dropped(waiter)
                raise
        if type(item) is int:
            return item
        if item is None:
            raise StopAsyncIteration
        raise item  # type: ignore[misc]

    def cancel(self, reason: str = "cancelled") -> None:
        """End the stream now (its slot is freed, whatever the sequence's state); `reason` becomes its
        finish_reason unless it had ended already ("stop" for a stop string a caller matched on the text)."""
        self.engine.remove(self.seq, reason)

    async def aclose(self) -> None:
        """Coroutine: `cancel()` (an async generator's close, for `contextlib.aclosing`)."""
        self.cancel()

    async def __aenter__(self) -> TokenStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.cancel()


def load_tokenizer(directory: str | Path) -> Any:
    """GPT-2's byte-level BPE tokenizer (the `tokenizers` package) from `directory`: its tokenizer.json, else its
    vocab.json and merges.txt. Returns an object with `encode(text).ids` and `decode(ids)`."""
    d = Path(directory)
    try:
        import tokenizers
    except ImportError:
        raise AzyxIOError("load_tokenizer needs the tokenizers package: pip install tokenizers") from None
    if (d / "tokenizer.json").is_file():
        return tokenizers.Tokenizer.from_file(str(d / "tokenizer.json"))
    if (d / "vocab.json").is_file() and (d / "merges.txt").is_file():
        return tokenizers.ByteLevelBPETokenizer(str(d / "vocab.json"), str(d / "merges.txt"))
    raise AzyxIOError(f"{d}: no tokenizer.json, nor vocab.json and merges.txt")
