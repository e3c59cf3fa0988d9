"""GPT-2 (azyx.models.gpt2) against Hugging Face transformers on a small random checkpoint made here: logits, greedy
generation, KV-cache decoding against full forwards, batched decoding against one sequence at a time, slot reuse,
the sampler against a numpy reference, decode steps that compile nothing, bad input, and a tokenizer round trip."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import azyx
from azyx import Tensor
from azyx.errors import ArgumentError, DeviceError, StateDictError
from azyx.models import GPT2, Engine, NoFreeSlotError, load_tokenizer
from azyx.models.gpt2 import sample_tokens

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VOCAB, POSITIONS = 384, 64
TEXT = ["the quick brown fox jumps over the lazy dog", "a lazy tensor waits until it is awaited",
        "one plan per shape, every step the same plan", "tokens stream to async clients one by one"] * 4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("gpt2"))


def build_checkpoint(d: Path) -> Path:
    """A 2-layer GPT-2 with random weights (wider than the default init, so greedy choices are clear) in Hugging
    Face's layout, and a byte-level BPE tokenizer of the same vocabulary trained on fixed text, in directory `d`."""
    from tokenizers import ByteLevelBPETokenizer

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_head=4, n_embd=64, vocab_size=VOCAB, n_positions=POSITIONS,
                                  initializer_range=0.2, bos_token_id=0, eos_token_id=VOCAB - 1)
    transformers.GPT2LMHeadModel(cfg).eval().save_pretrained(d, safe_serialization=True)
    tok = ByteLevelBPETokenizer()
    tok.train_from_iterator(TEXT, vocab_size=VOCAB, min_frequency=1, special_tokens=["<|endoftext|>"],
                            show_progress=False)
    tok.save_model(str(d))
    return d


@pytest.fixture(scope="module")
def reference(checkpoint: Path) -> Any:
    return transformers.GPT2LMHeadModel.from_pretrained(checkpoint).eval()


async def load(checkpoint: Path, device: str = "c:0") -> GPT2:
    return await GPT2.from_pretrained(checkpoint, device=device)


def hf_logits(reference: Any, ids: list[list[int]]) -> np.ndarray:
    with torch.no_grad():
        return reference(torch.tensor(ids, dtype=torch.long)).logits.numpy()  # type: ignore[no-any-return]


def hf_greedy(reference: Any, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = reference.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()  # type: ignore[no-any-return]


PROMPT = [5, 17, 200, 33, 9, 120, 71]


async def collect(stream: Any) -> list[int]:
    return [t async for t in stream]


async def test_logits_match_transformers(checkpoint: Path, reference: Any) -> None:
    model = await load(checkpoint)
    ids = [[1, 2, 3, 250, 7, 99, 31, 8, 300], [VOCAB - 1, 0, 55, 55, 55, 12, 200, 100, 4]]
    got = await model(Tensor(np.array(ids, np.int32), device=model.device)).numpy()
    np.testing.assert_allclose(got, hf_logits(reference, ids), rtol=1e-4, atol=1e-4)


async def test_loads_files_without_prefix_and_with_lm_head(checkpoint: Path, reference: Any, tmp_path: Path) -> None:
    from safetensors.numpy import load_file, save_file

    state = {k.removeprefix("transformer."): v for k, v in load_file(checkpoint / "model.safetensors").items()}
    state["lm_head.weight"] = state["wte.weight"]
    save_file(state, tmp_path / "gpt2.safetensors")
    (tmp_path / "config.json").write_text((checkpoint / "config.json").read_text())
    model = await GPT2.from_pretrained(tmp_path / "gpt2.safetensors", device="c:0")
    got = await model(Tensor(np.array([PROMPT], np.int32))).numpy()
    np.testing.assert_allclose(got, hf_logits(reference, [PROMPT]), rtol=1e-4, atol=1e-4)
    del state["h.1.mlp.c_fc.bias"]
    save_file(state, tmp_path / "gpt2.safetensors")
    with pytest.raises(StateDictError, match=r"h\.1\.mlp\.c_fc\.bias"):
        await GPT2.from_pretrained(tmp_path / "gpt2.safetensors", device="c:0")


async def test_logits_on_every_device(device: str, checkpoint: Path, reference: Any) -> None:
    model = await load(checkpoint, device)
    got = await model(Tensor(np.array([PROMPT[:4]], np.int32), device=device)).numpy()
    np.testing.assert_allclose(got, hf_logits(reference, [PROMPT[:4]]), rtol=1e-4, atol=1e-4)


async def test_greedy_generation_matches_transformers(checkpoint: Path, reference: Any) -> None:
    model = await load(checkpoint)
    got = [t async for t in model.generate(PROMPT, max_new_tokens=12, ignore_eos=True)]
    assert got == hf_greedy(reference, PROMPT, 12)


async def test_decode_with_the_cache_matches_a_full_forward(checkpoint: Path, reference: Any) -> None:
    model = await load(checkpoint)
    engine = Engine(model, slots=2)
    seq = await engine.add(PROMPT, engine.params(max_new_tokens=20, ignore_eos=True))
    assert engine.logits is not None
    steps = [await engine.logits.numpy()]
    for _ in range(6):
        await engine.step()
        steps.append((await engine.logits.numpy())[:1])
    full = hf_logits(reference, [PROMPT + seq.tokens[:-1]])[0]
    want = full[len(PROMPT) - 1:]
    np.testing.assert_allclose(np.concatenate(steps), want, rtol=1e-4, atol=1e-4)
    assert seq.tokens == list(want.argmax(-1))


async def test_batched_decode_matches_one_sequence_at_a_time(checkpoint: Path) -> None:
    model = await load(checkpoint)
    prompts = [PROMPT[:3], PROMPT + [11, 12, 13, 14]]

    async def decode(ps: list[list[int]]) -> tuple[list[list[int]], list[np.ndarray]]:
        engine = Engine(model, slots=2)
        seqs = [await engine.add(p, engine.params(max_new_tokens=8, ignore_eos=True)) for p in ps]
        logits = []
        for _ in range(5):
            await engine.step()
            assert engine.logits is not None
            logits.append((await engine.logits.numpy())[:len(ps)])
        return [s.tokens for s in seqs], logits

    together, logits = await decode(prompts)
    alone = [await decode([p]) for p in prompts]
    assert together == [a[0][0] for a in alone]
    for i, (_, single) in enumerate(alone):
        np.testing.assert_allclose(np.stack(logits)[:, i], np.stack(single)[:, 0], rtol=1e-5, atol=1e-5)


async def test_decode_steps_compile_nothing_after_the_first(checkpoint: Path) -> None:
    """Every step index, position, slot, length mask and sampling value is data: after the first step of a batch
    size (with temperature, top-k and top-p in use), later steps with new values replay the same plan (writing the
    cache's buffers in place) and plan or compile nothing."""
    model = await load(checkpoint)
    engine = Engine(model, slots=2)
    for p in (PROMPT[:5], PROMPT[:3]):
        await engine.add(p, engine.params(max_new_tokens=40, ignore_eos=True, temperature=0.5, top_k=40, top_p=0.9,
                                          seed=1))
    await engine.step()
    before, replays = azyx.stats(), engine.decode_step.replays
    buffers = [t._node.buffer.ptr for t in engine.cache.tensors()]
    rng = np.random.default_rng(0)
    for _ in range(10):
        for seq in engine.active.values():  # new sampling values for each step
            seq.params = engine.params(max_new_tokens=40, ignore_eos=True, temperature=float(rng.uniform(0.1, 2)),
                                       top_k=int(rng.integers(1, VOCAB)), top_p=float(rng.uniform(0.3, 0.99)))
        await engine.step()
        assert [t._node.buffer.ptr for t in engine.cache.tensors()] == buffers  # the cache written in place
    after = azyx.stats()
    assert (after.kernels, after.plans, after.traces) == (before.kernels, before.plans, before.traces)
    assert engine.decode_step.replays == replays + 10  # each step replayed the staged plan
    assert [s.cached for s in engine.active.values()] == [16, 14]


def ref_sample(logits: np.ndarray, temperature: float, top_k: int, top_p: float, u: float) -> int:
    """Hugging Face's warpers (temperature, top-k keeping ties, top-p over the ascending cumulative sum), then the
    inverse CDF at u."""
    x = logits.astype(np.float64)
    if temperature == 0:
        return int(x.argmax())
    x = x / temperature
    if 0 < top_k < len(x):
        x = np.where(x >= np.sort(x)[-top_k], x, -np.inf)
    p = np.exp(x - x.max())
    p /= p.sum()
    if top_p < 1:
        order = np.argsort(p, kind="stable")
        remove = np.cumsum(p[order]) <= 1 - top_p
        remove[-1] = False
        p[order[remove]] = 0
    cdf = np.cumsum(p)
    return int(np.searchsorted(cdf, u * cdf[-1], side="right"))


async def test_sampler_matches_a_numpy_reference() -> None:
    rng = np.random.default_rng(5)
    b, n = 24, 300
    logits = (rng.standard_normal((b, n)) * 3).astype(np.float32)
    temperature = np.array([0.0, 1.0, 0.7, 1.5] * 6, np.float32)
    top_k = np.array([n, 1, 5, 40, n, n, 2, 100] * 3, np.int32)
    top_p = np.array([1.0, 1.0, 0.9, 0.5, 0.2, 0.95] * 4, np.float32)
    u = rng.random(b).astype(np.float32)
    got = await sample_tokens(*(Tensor(a) for a in (logits, temperature, top_k, top_p, u))).numpy()
    want = [ref_sample(logits[i], float(temperature[i]), int(top_k[i]), float(top_p[i]), float(u[i]))
            for i in range(b)]
    assert got.tolist() == want


async def test_top_k_one_is_greedy_and_seeds_reproduce(checkpoint: Path) -> None:
    model = await load(checkpoint)
    greedy = [t async for t in model.generate(PROMPT, max_new_tokens=8, ignore_eos=True)]
    top1 = [t async for t in model.generate(PROMPT, max_new_tokens=8, ignore_eos=True, temperature=1.3, top_k=1,
                                            seed=3)]
    assert top1 == greedy
    kw: dict[str, Any] = dict(max_new_tokens=10, ignore_eos=True, temperature=1.5, top_k=100, top_p=0.95)
    runs = [[t async for t in model.generate(PROMPT, seed=s, **kw)] for s in (7, 7, 8)]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]
    # the same seeded request gives the same tokens when it runs beside another one
    streams = [model.generate(PROMPT, seed=7, **kw), model.generate(PROMPT[:2], seed=1, **kw)]
    together = await asyncio.gather(*(collect(s) for s in streams))
    assert together[0] == runs[0]


async def test_stop_tokens_and_max_new_tokens(checkpoint: Path, reference: Any) -> None:
    model = await load(checkpoint)
    want = hf_greedy(reference, PROMPT, 10)
    stop = want[4]
    first = want.index(stop)
    stream = model.generate(PROMPT, max_new_tokens=10, stop_token_ids=[stop])
    assert [t async for t in stream] == want[:first] and stream.finish_reason == "stop"
    stream = model.generate(PROMPT, max_new_tokens=10, eos_token_id=stop)
    assert [t async for t in stream] == want[:first] and stream.finish_reason == "stop"
    stream = model.generate(PROMPT, max_new_tokens=3, ignore_eos=True)
    assert [t async for t in stream] == want[:3] and stream.finish_reason == "length"


async def test_a_freed_slot_is_reused_with_correct_results(checkpoint: Path, reference: Any) -> None:
    model = await load(checkpoint)
    engine = Engine(model, slots=2)
    params = engine.params(max_new_tokens=30, ignore_eos=True)
    a = await engine.add(PROMPT, params)
    b = await engine.add([9, 8, 7, 6, 5, 4, 3, 2, 1, 10, 11], params)
    for _ in range(4):
        await engine.step()
    with pytest.raises(NoFreeSlotError, match="all 2 slots"):
        await engine.add(PROMPT, params)
    engine.remove(b)
    assert b.finish_reason == "cancelled" and engine.cache.free == [b.slot]
    c = await engine.add([3, 1], params)  # into b's slot, whose rows hold b's longer history
    assert c.slot == b.slot
    for _ in range(5):
        await engine.step()
    assert c.tokens == hf_greedy(reference, [3, 1], 6)
    assert a.tokens == hf_greedy(reference, PROMPT, 10)


async def test_concurrent_streams_join_and_leave_the_batch(checkpoint: Path, reference: Any) -> None:
    model = await load(checkpoint)
    engine = Engine(model, slots=3)
    prompts = [PROMPT, [4, 4, 4], [100, 200, 300, 1, 2]]
    lengths = [9, 3, 6]

    async def client(i: int) -> list[int]:
        await asyncio.sleep(0.02 * i)  # arrive while the others decode
        return [t async for t in engine.generate(prompts[i], max_new_tokens=lengths[i], ignore_eos=True)]

    got = await asyncio.gather(*(client(i) for i in range(3)))
    assert got == [hf_greedy(reference, p, n) for p, n in zip(prompts, lengths)]
    stream = engine.generate(PROMPT, max_new_tokens=50, ignore_eos=True)
    async for _ in stream:
        stream.cancel()  # a client that goes away: its slot is free at once
    assert stream.finish_reason == "cancelled" and not engine.active and len(engine.cache.free) == 3


async def test_streamed_steps_queue_ahead_and_give_the_step_by_step_tokens(checkpoint: Path, reference: Any) -> None:
    """While a batch stays the same, the runner queues each step before the last one's tokens are read (the device's
    tokens fed on): greedy streams give transformers' tokens, seeded sampled streams the tokens the same requests get
    from `step()` one at a time (one draw per step, in order), a stop token ends its stream where it falls, and a
    stream cancelled mid-way frees its slot."""
    model = await load(checkpoint)
    engine = Engine(model, slots=3)
    greedy = engine.generate(PROMPT, max_new_tokens=12, ignore_eos=True)
    sampled = engine.generate([5, 6, 7], max_new_tokens=10, temperature=0.9, top_k=20, top_p=0.95, seed=3,
                              ignore_eos=True)
    want_greedy = hf_greedy(reference, PROMPT, 12)
    stop = want_greedy[7]
    stopped = engine.generate(PROMPT, max_new_tokens=12, stop_token_ids=[stop], ignore_eos=True)
    got = await asyncio.gather(collect(greedy), collect(sampled), collect(stopped))
    assert engine.chained > 0
    assert got[0] == want_greedy
    assert got[2] == want_greedy[:want_greedy.index(stop)] and stopped.finish_reason == "stop"
    alone = Engine(model, slots=1)
    seq = await alone.add([5, 6, 7], alone.params(max_new_tokens=10, temperature=0.9, top_k=20, top_p=0.95, seed=3,
                                                  ignore_eos=True))
    while not seq.done:
        await alone.step()
    assert got[1] == seq.tokens and alone.chained == 0
    stream = engine.generate(PROMPT, max_new_tokens=40, ignore_eos=True)
    n = 0
    async for _ in stream:
        n += 1
        if n == 5:
            stream.cancel()
    assert stream.finish_reason == "cancelled" and len(engine.cache.free) == 3


async def test_warmed_up_streams_trace_nothing_chained_or_not(checkpoint: Path, reference: Any) -> None:
    """After `warmup`, streams whose steps run chained (tokens fed from the device) and not trace no new decode step."""
    model = await load(checkpoint)
    engine = Engine(model, slots=2)
    await engine.warmup(prompt_lengths=[len(PROMPT), 3])
    traces = len(engine.decode_step.traces)
    got = await asyncio.gather(collect(engine.generate(PROMPT, max_new_tokens=8, ignore_eos=True)),
                               collect(engine.generate([4, 4, 4], max_new_tokens=5, ignore_eos=True)))
    assert got == [hf_greedy(reference, PROMPT, 8), hf_greedy(reference, [4, 4, 4], 5)]
    assert engine.chained > 0 and len(engine.decode_step.traces) == traces


async def test_bad_input_raises_and_the_model_stays_usable(checkpoint: Path, reference: Any) -> None:
    with pytest.raises(DeviceError, match="nope:0"):
        await GPT2.from_pretrained(checkpoint, device="nope:0")
    model = await load(checkpoint)
    with pytest.raises(ArgumentError, match=f"{POSITIONS + 1} tokens"):
        model.generate([1] * (POSITIONS + 1))
    with pytest.raises(ArgumentError, match="-0.5"):
        model.generate(PROMPT, temperature=-0.5)
    for p in (0.0, 1.5):
        with pytest.raises(ArgumentError, match=f"top_p must be in \\(0, 1\\], got {p}"):
            model.generate(PROMPT, top_p=p)
    with pytest.raises(ArgumentError, match=f"token id {VOCAB}"):
        model.generate([1, VOCAB])
    engine = Engine(model, slots=1)
    stream = engine.generate(PROMPT, max_new_tokens=4, ignore_eos=True)
    with pytest.raises(NoFreeSlotError):
        engine.generate(PROMPT)
    assert [t async for t in stream] == hf_greedy(reference, PROMPT, 4)
    assert [t async for t in engine.generate(PROMPT, max_new_tokens=2, ignore_eos=True)] == \
        hf_greedy(reference, PROMPT, 2)


async def test_tokenizer_round_trip(checkpoint: Path, reference: Any) -> None:
    tok = load_tokenizer(checkpoint)
    assert json.loads((checkpoint / "vocab.json").read_text())["<|endoftext|>"] == 0
    text = "the lazy fox waits"
    ids = tok.encode(text).ids
    assert tok.decode(ids) == text and max(ids) < VOCAB
    model = await load(checkpoint)
    out = [t async for t in model.generate(ids, max_new_tokens=8, ignore_eos=True)]
    assert out == hf_greedy(reference, ids, 8)
    assert tok.decode(ids + out).startswith(text)
    assert tok.decode(out) == tok.decode(hf_greedy(reference, ids, 8))


async def test_warmup_plans_every_shape_before_the_first_request(checkpoint: Path, reference: Any) -> None:
    model = await load(checkpoint)
    engine = Engine(model, slots=4, max_waiting=4)
    await engine.warmup(prompt_lengths=[len(PROMPT), 3], sampled=True)
    s = azyx.stats()
    prompts = [PROMPT, PROMPT[:3], PROMPT[2:], PROMPT[:5]]  # batches of 1 to 4 as they join and leave
    greedy = [engine.generate(p, max_new_tokens=5 + i, ignore_eos=True) for i, p in enumerate(prompts)]
    sampled = engine.generate(PROMPT, max_new_tokens=4, temperature=0.9, top_k=30, top_p=0.8, seed=3, ignore_eos=True)
    got = await asyncio.gather(*(collect(g) for g in [*greedy, sampled]))
    assert got[0] == hf_greedy(reference, PROMPT, 5) and len(got[4]) == 4
    after = azyx.stats()
    assert (after.plans, after.kernels, after.traces) == (s.plans, s.kernels, s.traces)


async def test_a_crowd_of_prompts_prefills_in_one_plan(checkpoint: Path, reference: Any) -> None:
    """Requests waiting together whose prompts fall in one length bucket are prefilled in one plan (`prefill_batch`),
    each into its own slot, and decode transformers' tokens; another bucket's prompt waits for a plan of its own; a
    request whose own sampling values do not fit fails alone; warmed up, the crowd traces nothing."""
    model = await load(checkpoint)
    engine = Engine(model, slots=6, prefill_batch=4)
    await engine.warmup(prompt_lengths=[len(PROMPT), 3])
    groups: list[int] = []
    prefill = engine._prefill

    async def counted(seqs: list[Any], rows: list[Any]) -> None:
        groups.append(len(seqs))
        await prefill(seqs, rows)

    engine._prefill = counted  # type: ignore[method-assign]
    traces = len(engine.prefill_step.traces), len(engine.decode_step.traces)
    prompts = [PROMPT, PROMPT[:5], PROMPT[1:], [4, 4, 4], PROMPT[2:]]  # lengths 7, 5, 6, 3, 5: buckets 8, 8, 8, 4, 8
    streams = [engine.generate(p, max_new_tokens=6 + i, ignore_eos=True) for i, p in enumerate(prompts)]
    bad = engine.generate(PROMPT, max_new_tokens=4, temperature=0.5, ignore_eos=True)
    object.__setattr__(bad.seq.params, "top_k", 2**40)  # (past validation: a bug upstream would do this)
    got = await asyncio.gather(*(collect(s) for s in streams), collect(bad), return_exceptions=True)
    assert got[:5] == [hf_greedy(reference, p, 6 + i) for i, p in enumerate(prompts)]
    assert isinstance(got[5], ArgumentError) and "top_k" in str(got[5])
    assert groups == [4, 1] and bad.finish_reason == "error"  # (the bad one: failed before a prefill took it)
    assert (len(engine.prefill_step.traces), len(engine.decode_step.traces)) == traces
    assert len(engine.cache.free) == 6


async def test_decode_attention_reads_the_cache_through_the_slots(checkpoint: Path, reference: Any) -> None:
    """Each layer's attention in a decode step is the decode kernel reading the cache where it lies, each sequence's
    rows through its slot (no gather kernel copies the window), and greedy tokens stay transformers'."""
    from azyx.ir import attention_of

    model = await load(checkpoint)
    engine = Engine(model, slots=2)
    assert await collect(engine.generate(PROMPT, max_new_tokens=6, ignore_eos=True)) == hf_greedy(reference, PROMPT, 6)
    steps = [engine.decode_step, *engine.decode_step.layouts.values()]
    plans = [t.plan for j in steps for t in j.traces.values() if t.plan is not None]
    assert plans
    for plan in plans:
        specs = [attention_of(s.kernel) for s in plan.kernels]
        first = [a for a in specs if a is not None and a.stage == 1]
        assert len(first) == model.config.n_layer and all(a.gather == engine.cache.slots + 1 for a in first)


async def test_decode_steps_attend_over_windows_that_follow_the_lengths(checkpoint: Path, reference: Any) -> None:
    model = await load(checkpoint)
    engine = Engine(model, slots=2, min_window=4)  # windows of 4, 16 and 64 rows: sequences cross two of them
    assert engine.windows == [4, 16, 64]
    long, short = PROMPT + PROMPT, PROMPT[:3]
    got = await asyncio.gather(collect(engine.generate(long, max_new_tokens=12, ignore_eos=True)),
                               collect(engine.generate(short, max_new_tokens=20, ignore_eos=True)))
    assert got == [hf_greedy(reference, long, 12), hf_greedy(reference, short, 20)]


async def test_chained_steps_read_and_write_the_same_buffers_step_after_step(checkpoint: Path, reference: Any) -> None:
    """A streamed step chained on the one before reads its slots, tokens, positions and sampling values from buffers
    whose addresses do not change from step to step (the state two steps share, written in place: on a GPU, kernels
    whose arguments stay the same), and the tokens stay transformers'; a logprobs request's steps keep their
    logits, whose log-probabilities are those of transformers' logits."""
    model = await load(checkpoint)
    engine = Engine(model, slots=1)
    seen: list[tuple[int, ...]] = []
    submit = engine.decode_step.submit

    async def spy(*args: Any, **kwargs: Any) -> Any:
        seen.append(tuple(a._node.buffer.ptr for a in args))  # (the arguments are realized: a step's inputs)
        return await submit(*args, **kwargs)

    engine.decode_step.submit = spy  # type: ignore[method-assign]
    got = await collect(engine.generate(PROMPT, max_new_tokens=16, ignore_eos=True))
    assert got == hf_greedy(reference, PROMPT, 16)
    assert engine.chained >= 12 and len(seen) == 15
    # the first step's inputs come from the host; each chained step reads one of two states, written in place
    assert len(set(seen[1:])) == 2 and seen[1::2] == [seen[1]] * len(seen[1::2])
    stream = engine.generate(PROMPT, max_new_tokens=6, ignore_eos=True, logprobs=2)
    tokens = await collect(stream)
    full = hf_logits(reference, [PROMPT + tokens[:-1]])[0][len(PROMPT) - 1:].astype(np.float64)
    lp = full - np.log(np.exp(full - full.max(-1, keepdims=True)).sum(-1, keepdims=True)) - full.max(-1, keepdims=True)
    np.testing.assert_allclose([x for x, _ in stream.logprobs], lp[np.arange(6), tokens], rtol=1e-4, atol=1e-4)
