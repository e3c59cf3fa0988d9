"""Tensor-parallel GPT-2 (azyx.models.gpt2_parallel) on c:0 + c:1 (and cuda:0 + cuda:1 where present) against the
same checkpoint on one device, and against transformers: logits of a plain forward, greedy tokens through an Engine
(prefill and cached decode steps, two sequences batched), the sharded load reading each device's slice, and bad
layouts raising."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from test_gpt2 import PROMPT, VOCAB, build_checkpoint, hf_greedy, hf_logits

import azyx
from azyx import Tensor
from azyx.errors import ArgumentError, StateDictError
from azyx.models import GPT2, Engine, GPT2Config
from azyx.models.gpt2_parallel import ShardedKVCache, TensorParallelGPT2

transformers = pytest.importorskip("transformers")
PAIR = ["c:0", "c:1"]
PAIRS = [PAIR] + ([["cuda:0", "cuda:1"]] if "cuda:1" in azyx.devices() else [])


@pytest.fixture(params=PAIRS, ids="+".join)
def pair(request: pytest.FixtureRequest) -> list[str]:
    return list(request.param)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("gpt2tp"))


@pytest.fixture(scope="module")
def reference(checkpoint: Path) -> Any:
    return transformers.GPT2LMHeadModel.from_pretrained(checkpoint).eval()


async def test_logits_equal_one_device_and_transformers(checkpoint: Path, reference: Any, pair: list[str]) -> None:
    one = await GPT2.from_pretrained(checkpoint, device=pair[0])
    tp = await TensorParallelGPT2.from_pretrained(checkpoint, devices=pair)
    # each device holds its heads' columns of c_attn and its rows of the projections
    block = tp.h[0]
    assert [w.weight.device for w in block.c_attn] == pair and [w.device for w in block.mlp_proj] == pair
    assert [w.weight.shape for w in block.c_attn] == [(64, 96), (64, 96)]
    assert [w.shape for w in block.attn_proj] == [(32, 64), (32, 64)]
    ids = [[1, 2, 3, 250, 7, 99, 31, 8, 300], [VOCAB - 1, 0, 55, 55, 55, 12, 200, 100, 4]]
    x = Tensor(np.array(ids, np.int32))
    want = await one(x).numpy()
    got = await tp(x).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got, hf_logits(reference, ids), rtol=1e-4, atol=1e-4)
    # from a one-device model's parameters, sliced here
    np.testing.assert_allclose(await TensorParallelGPT2.from_model(one, pair)(x).numpy(), want, rtol=1e-5, atol=1e-5)


async def test_engine_greedy_tokens_equal_one_device(checkpoint: Path, reference: Any, pair: list[str]) -> None:
    one = await GPT2.from_pretrained(checkpoint, device=pair[0])
    tp = await TensorParallelGPT2.from_pretrained(checkpoint, devices=pair)
    prompts = [PROMPT, PROMPT[:3] + [11, 12]]

    async def decode(model: GPT2) -> tuple[list[list[int]], list[np.ndarray]]:
        engine = Engine(model, slots=2)
        seqs = [await engine.add(p, engine.params(max_new_tokens=10, ignore_eos=True)) for p in prompts]
        logits = []
        for _ in range(6):
            await engine.step()
            assert engine.logits is not None
            logits.append(await engine.logits.numpy())
        return [s.tokens for s in seqs], logits

    tokens, logits = await decode(tp)
    assert isinstance(Engine(tp).cache, ShardedKVCache)
    want_tokens, want_logits = await decode(one)
    assert tokens == want_tokens
    np.testing.assert_allclose(np.stack(logits), np.stack(want_logits), rtol=1e-4, atol=1e-4)
    assert tokens[0][:7] == hf_greedy(reference, PROMPT, 7)
    streamed = [t async for t in tp.generate(PROMPT, max_new_tokens=8, ignore_eos=True)]
    assert streamed == hf_greedy(reference, PROMPT, 8)


async def test_bad_layouts_and_names_raise(checkpoint: Path) -> None:
    one = await GPT2.from_pretrained(checkpoint, device="c:0")
    with pytest.raises(ArgumentError, match="n_head=3"):
        TensorParallelGPT2(GPT2Config(n_layer=1, n_head=3, n_embd=48, vocab_size=10, n_positions=8), PAIR)
    with pytest.raises(ArgumentError, match="distinct"):
        TensorParallelGPT2(one.config, ["c:0", "c:0"])
    with pytest.raises(ArgumentError, match="devices"):
        await TensorParallelGPT2.from_pretrained(checkpoint, device="c:0")
    tp = TensorParallelGPT2(one.config, PAIR)
    with pytest.raises(StateDictError, match="h.7.ln_1.weight"):
        tp.load("h.7.ln_1.weight", Tensor(np.ones(64, np.float32)))
