"""The PyTorch peer a good engineer deploys for GPT-2 decoding (the gpt-fast recipe, written here from its public
description): a static KV cache of fixed shape, a decode step whose every tensor keeps its address, and on CUDA the
whole step captured once in a `torch.cuda.CUDAGraph` and replayed per token; the next token (greedy) is read back to
the host each step, as a server streaming tokens must. On a CPU the same static step runs eagerly.

Weights come from a transformers `GPT2LMHeadModel` (Conv1D layout: x @ W + b), cast to `dtype`.
"""

from __future__ import annotations

import math
import time
from typing import Any


class StaticGPT2:
    """GPT-2 decode with a static KV cache for `batch` sequences of up to `max_len` tokens, all at one position
    (prompts of one length, as the benchmark's are)."""

    def __init__(self, torch: Any, hf: Any, batch: int, max_len: int, dtype: Any, device: str) -> None:
        self.torch, self.batch, self.max_len, self.device = torch, batch, max_len, device
        cfg = hf.config
        self.n_head, self.n_embd, self.eps = cfg.n_head, cfg.n_embd, cfg.layer_norm_epsilon
        sd = {k: v.detach().to(device=device, dtype=dtype).contiguous() for k, v in hf.state_dict().items()}
        self.wte, self.wpe = sd["transformer.wte.weight"], sd["transformer.wpe.weight"]
        self.layers = [{name: sd[f"transformer.h.{i}.{name}"] for name in (
            "ln_1.weight", "ln_1.bias", "attn.c_attn.weight", "attn.c_attn.bias", "attn.c_proj.weight",
            "attn.c_proj.bias", "ln_2.weight", "ln_2.bias", "mlp.c_fc.weight", "mlp.c_fc.bias", "mlp.c_proj.weight",
            "mlp.c_proj.bias")} for i in range(cfg.n_layer)]
        self.ln_f = (sd["transformer.ln_f.weight"], sd["transformer.ln_f.bias"])
        head = self.n_embd // self.n_head
        shape = (batch, self.n_head, max_len, head)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in self.layers]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in self.layers]
        # the step's static inputs and output: tokens, the position (a 0-d tensor: a new value replays the same graph)
        self.tokens = torch.zeros(batch, dtype=torch.long, device=device)
        self.pos = torch.zeros((), dtype=torch.long, device=device)
        self.next = torch.zeros(batch, dtype=torch.long, device=device)
        self.graph: Any = None
        self.decode_seconds = 0.0  # of the last generate: from the first new token read back to the last

    def _step(self) -> None:
        torch, F = self.torch, self.torch.nn.functional
        b, h, e = self.batch, self.n_head, self.n_embd
        where = self.pos.view(1)  # (indexing by a 0-d tensor would read it back: no capture)
        x = self.wte.index_select(0, self.tokens) + self.wpe.index_select(0, where)  # (b, e)
        visible = (torch.arange(self.max_len, device=self.device) <= self.pos).view(1, 1, 1, -1)
        for w, keys, values in zip(self.layers, self.keys, self.values):
            y = F.layer_norm(x, (e,), w["ln_1.weight"], w["ln_1.bias"], self.eps)
            q, k, v = torch.addmm(w["attn.c_attn.bias"], y, w["attn.c_attn.weight"]).split(e, dim=1)
            q, k, v = (t.view(b, h, 1, e // h) for t in (q, k, v))
            keys.index_copy_(2, where, k)
            values.index_copy_(2, where, v)
            a = F.scaled_dot_product_attention(q, keys, values, attn_mask=visible, scale=1 / math.sqrt(e // h))
            x = x + torch.addmm(w["attn.c_proj.bias"], a.reshape(b, e), w["attn.c_proj.weight"])
            y = F.layer_norm(x, (e,), w["ln_2.weight"], w["ln_2.bias"], self.eps)
            y = F.gelu(torch.addmm(w["mlp.c_fc.bias"], y, w["mlp.c_fc.weight"]), approximate="tanh")
            x = x + torch.addmm(w["mlp.c_proj.bias"], y, w["mlp.c_proj.weight"])
        x = F.layer_norm(x, (e,), self.ln_f[0], self.ln_f[1], self.eps)
        self.next.copy_((x @ self.wte.T).argmax(dim=-1))

    def capture(self) -> None:
        """On CUDA: warm the step up on a side stream, then capture it as one graph."""
        torch = self.torch
        if not self.device.startswith("cuda"):
            return
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.no_grad(), torch.cuda.stream(side):
            for _ in range(3):
                self._step()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        # thread-local: azyx's own threads use the same GPU meanwhile (a global capture forbids their driver calls)
        with torch.no_grad(), torch.cuda.graph(self.graph, capture_error_mode="thread_local"):
            self._step()

    def step(self, tokens: Any, pos: int) -> Any:
        """Feed `tokens` (b,) at position `pos`; returns the greedy next tokens, read back to the host."""
        self.tokens.copy_(tokens, non_blocking=True)
        self.pos.fill_(pos)
        if self.graph is not None:
            self.graph.replay()
        else:
            with self.torch.no_grad():
                self._step()
        return self.next.cpu()

    def generate(self, prompts: list[list[int]], n: int) -> list[list[int]]:
        """Greedy `n` new tokens for each of `batch` prompts of one length (the prompt fed a token per step)."""
        torch = self.torch
        assert len(prompts) == self.batch and len({len(p) for p in prompts}) == 1
        for t in (*self.keys, *self.values):
            t.zero_()
        cols = torch.tensor(prompts, dtype=torch.long)
        out: list[list[int]] = [[] for _ in prompts]
        nxt = None
        for i in range(cols.shape[1]):
            nxt = self.step(cols[:, i].to(self.device), i)
        pos = cols.shape[1]
        t0 = time.perf_counter()
        for _ in range(n):
            assert nxt is not None
            for row, t in zip(out, nxt.tolist()):
                row.append(t)
            if len(out[0]) == n:
                break
            nxt = self.step(nxt.to(self.device), pos)
            pos += 1
        self.decode_seconds = time.perf_counter() - t0
        return out
