"""Tensor-parallel GPT-2: each layer's heads and MLP columns split over the devices of one host (Megatron's layout),
served by the same `Engine` as the one-device model.

    model = await TensorParallelGPT2.from_pretrained("path/to/gpt2", devices=["cuda:0", "cuda:1"])
    async for token in model.generate(prompt_ids, max_new_tokens=20):  # one device's tokens (greedy)
        ...

Per layer, every device holds its heads' columns of `c_attn` (queries, keys and values of heads array_split over the
devices) and its slice of the MLP's `c_fc` columns (column-parallel), and the matching rows of both `c_proj`s
(row-parallel): each device attends over its own heads (its own KV cache, `ShardedKVCache`) and computes a partial
projection; one all-reduce (`ShardedTensor.all_reduce`) per sub-layer sums the partial projections on every device,
where the replicated layer norms, biases and residual stream go on. The embeddings, the final norm and the head run
on the first device (the residual stream is copied from it to the others once per forward). On devices that read
each other's memory (C devices) the all-reduce is one kernel per device reading both partials in place
(`azyx.schedule.shares_memory`); elsewhere the executor's transfers. Loading (`from_pretrained`) reads each device's
rows or columns of the row- and column-parallel weights straight to it (`stream_safetensors(..., shard=...)`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from azyx import nn
from azyx.dtypes import DType
from azyx.errors import ArgumentError, ShapeError, StateDictError
from azyx.models.gpt2 import (
    ACTIVATIONS,
    GPT2,
    AttentionView,
    Conv1D,
    Decode,
    GPT2Config,
    KVCache,
    Prefill,
    attention_scale,
    load_checkpoint,
)
from azyx.runtime import RT
from azyx.shard import ShardedTensor, _split_bounds
from azyx.tensor import Tensor


class ParallelBlock(nn.Module):
    """One transformer layer over `devices`: per device, its heads of the attention and its columns of the MLP (see the
    module's docstring); replicated layer norms and output biases."""

    def __init__(self, config: GPT2Config, layer: int, dtype: DType, devices: list[str]):
        e, eps, hd = config.n_embd, config.layer_norm_epsilon, config.head_dim
        inner = config.n_inner or 4 * e
        self.heads = [hi - lo for lo, hi in _split_bounds(config.n_head, len(devices))]
        widths = [hi - lo for lo, hi in _split_bounds(inner, len(devices))]
        self.layer, self.scale = layer, attention_scale(config, layer)
        self.ln_1 = [nn.LayerNorm(e, eps=eps, dtype=dtype, device=d) for d in devices]
        self.ln_2 = [nn.LayerNorm(e, eps=eps, dtype=dtype, device=d) for d in devices]
        self.c_attn = [Conv1D(e, 3 * h * hd, dtype, d) for h, d in zip(self.heads, devices)]
        self.attn_proj = [Tensor.zeros(h * hd, e, dtype=dtype, device=d) for h, d in zip(self.heads, devices)]
        self.attn_bias = [Tensor.zeros(e, dtype=dtype, device=d) for d in devices]
        self.c_fc = [Conv1D(e, w, dtype, d) for w, d in zip(widths, devices)]
        self.mlp_proj = [Tensor.zeros(w, e, dtype=dtype, device=d) for w, d in zip(widths, devices)]
        self.mlp_bias = [Tensor.zeros(e, dtype=dtype, device=d) for d in devices]
        self.act = nn.GELU(ACTIVATIONS[config.activation_function])

    def forward(self, xs: list[Tensor], views: list[AttentionView]) -> list[Tensor]:
        """The residual stream `xs` (one copy per device, (B, T, n_embd)) through the layer; each device attends over
        its heads through its `views` entry."""
        parts = []
        for x, ln, qkv, w, view, h in zip(xs, self.ln_1, self.c_attn, self.attn_proj, views, self.heads):
            b, t, _ = x.shape
            width = w.shape[0]
            q, k, v = (z.reshape(b, t, h, width // h).transpose(1, 2) for z in qkv(ln(x)).split(width, axis=-1))
            out = view.attend(self.layer, q, k, v, self.scale)
            parts.append(out.transpose(1, 2).reshape(b, t, width) @ w)
        xs = [x + s + bias for x, s, bias in zip(xs, _summed(parts), self.attn_bias)]
        parts = [self.act(fc(ln(x))) @ w for x, ln, fc, w in zip(xs, self.ln_2, self.c_fc, self.mlp_proj)]
        return [x + s + bias for x, s, bias in zip(xs, _summed(parts), self.mlp_bias)]


def _summed(parts: list[Tensor]) -> list[Tensor]:
    """The devices' partial projections summed, on every device (the layer's one all-reduce per sub-layer)."""
    return ShardedTensor(parts, None).all_reduce("sum").shards


class ShardedKVCache(KVCache):
    """A KV cache per device, each for that device's heads (`parts`), sharing one set of slots: what the `Engine` of
    a `TensorParallelGPT2` decodes with."""

    def __init__(self, config: GPT2Config, slots: int, max_len: int, dtype: DType, devices: list[str]):
        heads = [hi - lo for lo, hi in _split_bounds(config.n_head, len(devices))]
        self.parts = [KVCache(GPT2Config(**{**config.__dict__, "n_head": h, "n_embd": h * config.head_dim}), slots,
                              max_len, dtype, d) for h, d in zip(heads, devices)]
        self.slots, self.max_len = slots, max_len
        self.kv = []  # (each part holds its own)
        self.free = list(range(slots))

    def tensors(self) -> list[Tensor]:
        """Every part's keys-and-values tensors."""
        return [t for p in self.parts for t in p.tensors()]


def _local(view: AttentionView, i: int, device: str) -> AttentionView:
    """Device `i`'s side of `view`: its part of the cache, the view's indices copied to `device`."""
    if isinstance(view, Decode):
        cache = view.cache
        assert isinstance(cache, ShardedKVCache)
        return Decode(cache.parts[i], view.slots.to(device), view.positions.to(device), view.window)
    if isinstance(view, Prefill):
        cache = view.cache
        assert isinstance(cache, ShardedKVCache)
        return Prefill(cache.parts[i], view.slots.to(device))
    return view


class TensorParallelGPT2(GPT2):
    """GPT-2 with each layer split over `devices` (see the module's docstring); the embeddings, final norm and head on
    the first (`device`, where logits and an `Engine`'s inputs are). Parameters are zeros until loaded
    (`from_pretrained`, or `from_model`). `model(ids)`, `generate` and `Engine(model)` work as for `GPT2`."""

    def __init__(self, config: GPT2Config, devices: Sequence[str], dtype: Any = None):
        devs = [RT.check_device(d) for d in devices]
        if not devs or len(set(devs)) != len(devs):
            raise ArgumentError(f"tensor parallelism needs distinct devices, got {list(devices)}")
        if config.n_head % len(devs):
            raise ArgumentError(f"n_head={config.n_head} heads do not split evenly over {len(devs)} devices")
        super().__init__(GPT2Config(**{**config.__dict__, "n_layer": 0}), dtype, devs[0])
        self.config, self.devices = config, devs
        self.h = [ParallelBlock(config, i, self.dtype, devs) for i in range(config.n_layer)]  # type: ignore[misc]

    def layers(self, x: Tensor, view: AttentionView) -> Tensor:
        """The layers over `x` (on the first device): copied to every device, the layers, the first device's copy."""
        xs = [x._readable_on(d) for d in self.devices]
        views = [_local(view, i, d) for i, d in enumerate(self.devices)]
        for block in self.h:
            xs = block(xs, views)
        return xs[0]

    def kv_cache(self, slots: int, max_len: int) -> KVCache:
        """A `ShardedKVCache`: each device's heads' keys and values on it."""
        return ShardedKVCache(self.config, slots, max_len, self.dtype, self.devices)

    def load(self, name: str, t: Tensor | ShardedTensor) -> None:
        """Assign checkpoint tensor `name` (Hugging Face's GPT2Model name, e.g. "h.0.attn.c_attn.weight") to this
        model's parameters as `LAYOUT` says: whole onto the first device's, replicated onto every device's, or each
        device's slice (a ShardedTensor cut along `SPLIT`'s axis, as `from_pretrained` streams it, or a Tensor cut
        here). Raises StateDictError for an unknown name, ShapeError for a tensor of the wrong shape."""
        layer, _, rest = name.removeprefix("h.").partition(".")
        if not name.startswith("h."):
            params = dict(self.named_parameters())
            if name not in params:
                raise StateDictError(f"unexpected tensor {name!r} for GPT-2")
            _assign(params[name], t if isinstance(t, Tensor) else t.gather(self.device), name)
            return
        if rest not in LAYOUT or not layer.isdigit() or int(layer) >= len(self.h):
            raise StateDictError(f"unexpected tensor {name!r} for GPT-2")
        attr, fld, how = LAYOUT[rest]
        mine = [getattr(m, fld) if fld else m for m in getattr(self.h[int(layer)], attr)]
        if how in AXES:
            pieces = (t if isinstance(t, ShardedTensor) else t.shard(self.devices, AXES[how])).shards
        else:
            whole = t if isinstance(t, Tensor) else t.gather(self.device)
            if how == "heads":  # (.., 3 * n_embd): queries, keys and values, each cut by heads
                lead, e = whole.shape[:-1], whole.shape[-1] // 3
                if whole.shape[-1] != 3 * self.config.n_embd:
                    raise ShapeError(f"{name!r} has shape {whole.shape}, GPT-2 needs {3 * self.config.n_embd} "
                                     f"columns")
                cut = whole.reshape(*lead, 3, e).shard(self.devices, -1).shards
                pieces = [c.reshape(*lead, 3 * c.shape[-1]) for c in cut]
            else:
                pieces = [whole.to(d) for d in self.devices]
        for p, piece in zip(mine, pieces, strict=True):
            _assign(p, piece, name)

    @staticmethod
    def from_model(model: GPT2, devices: Sequence[str]) -> TensorParallelGPT2:
        """`model`'s parameters split over `devices` (lazy: realized with the first forward, or `realize`)."""
        out = TensorParallelGPT2(model.config, devices, model.dtype)
        for name, t in model.named_parameters():
            out.load(name, t)
        return out

    @staticmethod
    async def from_pretrained(path: str | Path, device: str | None = None, dtype: Any = None,
                              devices: Sequence[str] = ()) -> TensorParallelGPT2:
        """Load a Hugging Face GPT-2 checkpoint (as `GPT2.from_pretrained`) split over `devices`: the row- and
        column-parallel weights read each device's slice straight to it (`SPLIT`), the rest onto the first device
        (and copied to the others where replicated). Give `devices`, not `device`."""
        if device is not None or not devices:
            raise ArgumentError("a tensor-parallel GPT-2 is loaded onto `devices` (a list), not one `device`")
        p = Path(path)
        directory, weights = (p, p / "model.safetensors") if p.is_dir() else (p.parent, p)
        await RT.startup(sorted({d.partition(":")[0] for d in devices}))
        model = TensorParallelGPT2(GPT2Config.from_json(directory / "config.json"), devices, dtype)
        split = {prefix + pattern: (model.devices, axis) for pattern, axis in SPLIT.items()
                 for prefix in ("", "transformer.")}
        await load_checkpoint(weights, model, lambda key, name, t: model.load(key, t), _names(model), split)
        return model


# per layer, Hugging Face's name (after "h.N.") -> (the ParallelBlock attribute holding it per device, the field of
# each, how it is laid out over the devices: replicated, heads (c_attn), rows or columns of its slice)
LAYOUT = {"ln_1.weight": ("ln_1", "weight", "replicated"), "ln_1.bias": ("ln_1", "bias", "replicated"),
          "ln_2.weight": ("ln_2", "weight", "replicated"), "ln_2.bias": ("ln_2", "bias", "replicated"),
          "attn.c_attn.weight": ("c_attn", "weight", "heads"), "attn.c_attn.bias": ("c_attn", "bias", "heads"),
          "attn.c_proj.weight": ("attn_proj", "", "rows"), "attn.c_proj.bias": ("attn_bias", "", "replicated"),
          "mlp.c_fc.weight": ("c_fc", "weight", "columns"), "mlp.c_fc.bias": ("c_fc", "bias", "rows"),
          "mlp.c_proj.weight": ("mlp_proj", "", "rows"), "mlp.c_proj.bias": ("mlp_bias", "", "replicated")}
AXES = {"rows": 0, "columns": 1}
# what each device reads a slice of from a checkpoint (stream_safetensors' shard patterns) and along which axis
SPLIT = {f"h.*.{rest}": AXES[how] for rest, (_, _, how) in LAYOUT.items() if how in AXES}


def _names(model: TensorParallelGPT2) -> set[str]:
    """The checkpoint names a model needs (Hugging Face's GPT2Model names)."""
    top = {n for n, _ in model.named_parameters() if not n.startswith("h.")}
    return top | {f"h.{i}.{rest}" for i in range(len(model.h)) for rest in LAYOUT}


def _assign(p: Tensor, t: Tensor, name: str) -> None:
    if t.shape != p.shape:
        raise ShapeError(f"{name!r} has shape {t.shape} here, the tensor-parallel GPT-2 needs {p.shape}")
    p.assign(t.cast(p.dtype).to(p.device))
