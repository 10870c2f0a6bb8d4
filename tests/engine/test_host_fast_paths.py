"""The host's fast paths against the general paths they short-cut, which are the oracles:
post-processing (`SequenceOutput.fast_delta`, `LLMEngine._postprocess` for plain requests: the
same token streams and engine batches, with every request forced onto the general path, give
the same deltas and stops) and the batch's sampling arrays (`SamplingCache`, equal to
`sampling_tensors` built afresh for every batch)."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest

from engine import llm_engine
from engine.batch import SamplingCache, sampling_tensors
from engine.llm_engine import LLMEngine
from engine.output_processor import SequenceOutput
from engine.request import Request, RequestOutput, SamplingParams

MODEL_LEN = 40


def _tokens(rng: random.Random, eos: tuple[int, ...], count: int) -> list[int]:
    """Byte tokens, ASCII and not (partial characters), with EOS and a few stop ids mixed in."""
    pool = [*range(32, 127), *range(128, 250), *eos, 7, 9]
    return [rng.choice(pool) for _ in range(count)]


def _general(seq: SequenceOutput, request: Request, token: int) -> tuple[object, object]:
    request.output_token_ids.append(token)
    decision = seq.append(request, token)
    if decision is not None:
        request.finish_reason, request.stop_reason = decision.reason, decision.stop_reason
    return decision, seq.take_delta(request, 0)


@pytest.mark.parametrize("seed", range(40))
def test_fast_delta_equals_append_then_take_delta(engine: LLMEngine, seed: int) -> None:
    rng = random.Random(seed)
    tokenizer = engine.tokenizer
    eos = tuple(tokenizer.eos_token_ids)
    max_tokens = rng.randint(1, 30)
    params = SamplingParams(
        temperature=0,
        max_tokens=max_tokens,
        min_tokens=rng.randint(0, min(max_tokens, 5)),
        ignore_eos=rng.random() < 0.3,
        stop_token_ids=rng.choice([(), (7,), (7, 9)]),
        include_stop_str_in_output=rng.random() < 0.5,
    )
    prompt = [65] * rng.randint(1, 20)
    fast_seq = SequenceOutput(tokenizer, params, MODEL_LEN)
    slow_seq = SequenceOutput(tokenizer, params, MODEL_LEN)
    fast_req = Request("fast", list(prompt), params, seed=0)
    slow_req = Request("slow", list(prompt), params, seed=0)
    taken = 0
    for token in _tokens(rng, eos, 40):
        expected = _general(slow_seq, slow_req, token)
        delta = fast_seq.fast_delta(fast_req, token)
        if delta is None:
            got = _general(fast_seq, fast_req, token)
        else:
            got, taken = (None, delta), taken + 1
        assert got == expected
        assert fast_req.output_token_ids == slow_req.output_token_ids
        if expected[0] is not None:  # the sequence stopped
            break
    assert taken > 0 or len(fast_req.output_token_ids) <= 1  # the fast path was taken


def _mixed_batch(engine: LLMEngine) -> list[list[RequestOutput]]:
    """Plain requests (stopping at EOS, a stop id or max_tokens) stepped beside ones that take
    the general path (n = 2, a stop string, logprobs); each step's outputs, without their
    times."""
    plain = [
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=3, max_tokens=20, min_tokens=4),
        SamplingParams(temperature=0.9, seed=5, max_tokens=30, stop_token_ids=(101, 32)),
        SamplingParams(temperature=0, max_tokens=50, ignore_eos=True),
    ]
    general = [
        SamplingParams(n=2, temperature=0.7, seed=1, max_tokens=10),
        SamplingParams(temperature=0.7, seed=2, max_tokens=15, stop=("e",)),
        SamplingParams(temperature=0, max_tokens=9, logprobs=2, ignore_eos=True),
    ]
    # Prompts within one page: no run finds another's in the prefix cache (the steps match).
    prompts = [[40 + i, 71, 110, 98 + i] for i in range(7)]
    steps = []
    for i, params in enumerate([plain[0], *general[:2], *plain[1:3], general[2], plain[3]]):
        engine.add_request(f"mixed-{i}", prompts[i], params)
    while engine.has_unfinished_requests():
        steps.append([_timeless(o) for o in engine.step()])
    return steps


def _timeless(output: RequestOutput) -> RequestOutput:
    return dataclasses.replace(output, arrival_time=None, scheduled_time=None)


def test_a_mixed_batch_equals_the_general_path(
    engine: LLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    fast = _mixed_batch(engine)
    monkeypatch.setattr(llm_engine, "_is_plain", lambda params: False)
    general = _mixed_batch(engine)
    assert fast == general
    assert engine.kv_cache.num_free_pages == engine.kv_cache.num_pages


def test_the_sampling_cache_equals_arrays_built_afresh() -> None:
    rng = random.Random(0)
    params = [
        SamplingParams(temperature=0.5, top_k=5, top_p=0.9, seed=1),
        SamplingParams(temperature=0, min_p=0.1),
        SamplingParams(temperature=1.0, min_tokens=3, max_tokens=20, stop_token_ids=(7,)),
        SamplingParams(temperature=0.7, logit_bias={3: 2.0}),
        SamplingParams(presence_penalty=0.5, frequency_penalty=0.1),
    ]
    # The first six are plain (the cache may keep their arrays), the others may not be.
    pool = [
        Request(f"r{i}", [1, 2, 3], params[i % 2] if i < 6 else rng.choice(params), seed=i)
        for i in range(12)
    ]
    eos = (2,)
    cache = SamplingCache(eos)
    batch = previous = pool[:6]
    reused = 0
    for step in range(300):
        if rng.random() < 0.2:  # the batch changes: some leave, some join, the order too
            batch = rng.sample(rng.choice([pool, pool[:6]]), rng.randint(1, 6))
        for r in batch:  # a token comes, or one is pending on the device
            r.num_pending_tokens = rng.randint(0, 1)
            r.output_token_ids.append(5)
        num_seqs = 8 if rng.random() < 0.8 else 16
        penalty_len = 512 if rng.random() < 0.1 else 0
        last = cache._last
        rows = {id(r): i for i, r in enumerate(previous)}  # the cache's last batch
        src = np.array([rows.get(id(r), -1) for r in batch], np.int64)
        outputs = np.array([r.num_output_tokens_with_pending for r in batch], np.int64)
        got = cache.tensors(list(batch), num_seqs, penalty_len, src, outputs)
        previous = batch
        reused += last is not None and got.temperature is last.temperature
        expected = sampling_tensors(batch, num_seqs, penalty_len, eos)
        for name, value in vars(expected).items():
            np.testing.assert_array_equal(getattr(got, name), value, err_msg=f"{name} {step}")
    assert reused > 10  # the cache was used at all
