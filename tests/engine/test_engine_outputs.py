"""What a request gets back: stop strings, min_tokens, logprobs, prompt logprobs, aborts and
admission errors, checked against the full forward of the naive oracle."""

from __future__ import annotations

import random

import jax
import numpy as np
import pytest

from engine import naive
from engine.errors import InvalidRequestError
from engine.llm_engine import LLMEngine, run_to_completion
from engine.request import SamplingParams
from tests.engine.tiny_model import EOS_ID, VOCAB_SIZE


@pytest.fixture(autouse=True)
def no_leaks(engine: LLMEngine):
    yield
    assert not engine.has_unfinished_requests()
    engine.kv_cache.check_invariants()
    assert engine.kv_cache.num_free_pages == engine.kv_cache.num_pages


def run_one(engine: LLMEngine, prompt: list[int], params: SamplingParams):
    request_id = f"one-{random.random()}"
    engine.add_request(request_id, prompt, params)
    [output] = run_to_completion(engine, [request_id])
    return output


def prompt_of(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(length)]  # byte tokens only


def full_logprobs(tiny, ids: list[int]) -> np.ndarray:
    cfg, params, _ = tiny
    logits = np.asarray(naive.sequence_logits(params, np.asarray([ids]), cfg=cfg))[0]
    return np.asarray(jax.nn.log_softmax(logits, axis=-1))


def test_stop_string_is_never_emitted(engine: LLMEngine) -> None:
    prompt = prompt_of(0, 7)
    free = run_one(engine, prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    text = free.outputs[0].text
    stop = text[6:9]
    expected = text[: text.index(stop)]
    stopped = run_one(
        engine, prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop])
    )
    out = stopped.outputs[0]
    assert (out.text, out.finish_reason, out.stop_reason) == (expected, "stop", stop)
    included = run_one(
        engine,
        prompt,
        SamplingParams(
            temperature=0,
            max_tokens=24,
            ignore_eos=True,
            stop=[stop],
            include_stop_str_in_output=True,
        ),
    )
    assert included.outputs[0].text == expected + stop


def test_min_tokens_holds_back_eos(engine: LLMEngine) -> None:
    # A +50 bias makes EOS the greedy choice at every step; min_tokens bans it for 5 tokens.
    params = SamplingParams(temperature=0, max_tokens=20, min_tokens=5, logit_bias={EOS_ID: 50.0})
    out = run_one(engine, prompt_of(1, 5), params).outputs[0]
    assert len(out.token_ids) == 6 and out.token_ids[-1] == EOS_ID
    assert EOS_ID not in out.token_ids[:5]
    assert out.finish_reason == "stop"
    stopped_at_once = run_one(engine, prompt_of(1, 5), params.replace(min_tokens=0)).outputs[0]
    assert stopped_at_once.token_ids == [EOS_ID]


def test_logprobs_match_the_full_forward(tiny, engine: LLMEngine) -> None:
    prompt = prompt_of(2, 9)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3)
    out = run_one(engine, prompt, params).outputs[0]
    expected = full_logprobs(tiny, prompt + out.token_ids)
    assert out.logprobs is not None and len(out.logprobs) == 6
    for j, (token, entry) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        row = expected[len(prompt) - 1 + j]
        top3 = set(np.argsort(-row)[:3].tolist())
        assert set(entry) == top3 | {token}
        for t, lp in entry.items():
            assert lp == pytest.approx(row[t], abs=1e-4)


def test_prompt_logprobs_match_the_full_forward(tiny, engine: LLMEngine) -> None:
    prompt = prompt_of(3, 45)  # longer than the 32-token budget: prefilled in two chunks
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, prompt_logprobs=2)
    output = run_one(engine, prompt, params)
    expected = full_logprobs(tiny, prompt)
    assert output.prompt_logprobs is not None and len(output.prompt_logprobs) == len(prompt)
    assert output.prompt_logprobs[0] is None
    for pos, entry in enumerate(output.prompt_logprobs[1:], start=1):
        assert entry is not None and prompt[pos] in entry
        assert entry[prompt[pos]] == pytest.approx(expected[pos - 1, prompt[pos]], abs=1e-4)
        assert len(entry) in (2, 3)


def test_abort_frees_pages_at_once(engine: LLMEngine) -> None:
    engine.add_request("to-abort", prompt_of(4, 30), SamplingParams(max_tokens=50))
    engine.step()
    assert engine.kv_cache.num_free_pages < engine.kv_cache.num_pages
    engine.abort_request("to-abort")
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize(
    ("prompt_len", "params", "fragment"),
    [
        (250, SamplingParams(max_tokens=10), "maximum context length is 256 tokens"),
        (5, SamplingParams(max_tokens=300), "you requested 300 output tokens"),
        (0, SamplingParams(), "at least one token"),
    ],
)
def test_requests_that_can_never_fit_are_rejected(
    engine: LLMEngine, prompt_len: int, params: SamplingParams, fragment: str
) -> None:
    with pytest.raises(InvalidRequestError, match=fragment):
        engine.add_request(f"bad-{prompt_len}", prompt_of(5, prompt_len), params)
    assert not engine.has_unfinished_requests()


def test_out_of_vocabulary_ids_are_rejected(engine: LLMEngine) -> None:
    with pytest.raises(InvalidRequestError, match="out of range"):
        engine.add_request("oov", [1, VOCAB_SIZE + 3], SamplingParams())
    with pytest.raises(InvalidRequestError, match="logit_bias"):
        engine.add_request("oov2", [1, 2], SamplingParams(logit_bias={VOCAB_SIZE: 1.0}))
