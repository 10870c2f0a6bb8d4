"""Sharded engines against the single-device engine (the oracle), through the whole engine:
greedy tokens identical; logits, and the logprobs the engine returns, equal within 1e-5
(float32; relative to the value where it exceeds 1: tensor parallelism sums a matmul's partial
products in another order, which moves a logit of 7.7 by up to ~2e-5, 2 ulp-scale steps)."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from engine.llm_engine import LLMEngine, run_to_completion
from engine.step import forward_logits
from sharding.multihost import put_replicated
from tests.sharding.conftest import GREEDY, PROMPTS, build_engine

TOLERANCE = 1e-5


def generate(engine: LLMEngine) -> list[tuple[list[int], list[dict[int, float]]]]:
    ids = [f"r{i}" for i in range(len(PROMPTS))]
    for request_id, prompt in zip(ids, PROMPTS, strict=True):
        engine.add_request(request_id, prompt, GREEDY)
    outputs = run_to_completion(engine, ids)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs or []) for o in outputs]


def prefill_logits(engine: LLMEngine) -> np.ndarray:
    """f32[S, V] logits of the first step (all prompts' prefill), straight from the model."""
    ids = [f"p{i}" for i in range(len(PROMPTS))]
    for request_id, prompt in zip(ids, PROMPTS, strict=True):
        engine.add_request(request_id, prompt, GREEDY)
    out = engine.scheduler.schedule()
    runner = engine.runner
    batch = runner.builder.build(out, engine.kv_cache, penalties=False)
    if runner.plan is not None:
        batch = put_replicated(batch, runner.plan.replicated)
    run = jax.jit(forward_logits, static_argnames="options")
    logits, _ = run(runner.params, runner.kv_caches, batch, options=runner.options())
    for request_id in ids:
        engine.abort_request(request_id)
    return np.asarray(logits)[: len(PROMPTS)]


@pytest.fixture(scope="module")
def single_device(tiny):
    engine = build_engine(tiny)
    return prefill_logits(engine), generate(engine)


def assert_same(got, want) -> None:
    worst = 0.0
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(got, want, strict=True):
        assert tokens == want_tokens
        for entry, want_entry in zip(logprobs, want_logprobs, strict=True):
            assert entry.keys() == want_entry.keys()
            diffs = [abs(entry[t] - want_entry[t]) / max(1.0, abs(want_entry[t])) for t in entry]
            worst = max(worst, *diffs)
    print(f"max relative logprob difference = {worst:.2e}")
    assert worst <= TOLERANCE


@pytest.mark.parametrize(
    ("tp", "pp"), [(2, 1), (4, 1), (1, 2), (2, 2)], ids=["tp2", "tp4", "pp2", "tp2-pp2"]
)
def test_sharded_engine_matches_single_device(tiny, single_device, tp: int, pp: int) -> None:
    engine = build_engine(tiny, tp=tp, pp=pp)
    logits = prefill_logits(engine)
    print(f"max |logit difference| = {np.abs(logits - single_device[0]).max():.2e}")
    np.testing.assert_allclose(logits, single_device[0], rtol=TOLERANCE, atol=TOLERANCE)
    assert_same(generate(engine), single_device[1])
