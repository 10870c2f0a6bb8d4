"""The sharding tests need 8 (simulated) devices, fixed before JAX starts its backend:
`make test` runs them as their own pytest process with
XLA_FLAGS=--xla_force_host_platform_device_count=8. Anywhere else they skip, saying so."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from engine.config import CacheConfig, SchedulerConfig
from engine.llm_engine import LLMEngine, run_to_completion
from engine.request import SamplingParams
from engine.step import forward_logits
from engine.tokenizer import load_tokenizer
from engine.weights import open_checkpoint, resolve_model
from sharding.layout import ShardingLayout
from sharding.mesh import make_mesh
from sharding.multihost import put_replicated
from tests.engine.tiny_model import write_tiny_checkpoint

NUM_DEVICES = 8
PAGE = 4
CACHE = CacheConfig(page_size=PAGE, num_pages=128)
SCHEDULER = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=128)
# Four prompts of 16 tokens in all: one prefill step whose sequences straddle the pipeline's
# micro-batches, then decode steps (two compiled buckets per engine, to keep the tests quick).
PROMPTS = [[256, *range(40 + n, 40 + 2 * n)] for n in (2, 4, 1, 5)]
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=5)
# Tensor parallelism sums a matmul's partial products in another order, which moves logits by a
# few ulps: ~2e-5 on the suite's tiny model (logits up to ~7.7), so these tests use one with
# logits of magnitude ~2 (`tiny` below).
TOLERANCE = 1e-5


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    if jax.device_count() >= NUM_DEVICES:
        return
    reason = (
        f"needs {NUM_DEVICES} devices, found {jax.device_count()}: run with "
        f"XLA_FLAGS=--xla_force_host_platform_device_count={NUM_DEVICES} (as `make test` does)"
    )
    for item in items:
        if "tests/sharding" in str(item.fspath):
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """The tiny Llama with weights of std 0.1 (the suite's has 0.3): logits of magnitude ~2, so
    that the different summation order of sharded matmuls (a few ulps of the logits) stays
    well inside the absolute 1e-5 bound."""
    directory = write_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), initializer_range=0.1)
    checkpoint = open_checkpoint(resolve_model(str(directory)))
    return checkpoint.cfg, checkpoint.load_params(), load_tokenizer(directory)


def build_engine(
    tiny,
    *,
    dp: int = 1,
    tp: int = 1,
    pp: int = 1,
    layout: ShardingLayout | None = None,
    expert_dispatch: str = "allgather",
) -> LLMEngine:
    """Single-device without a layout or parallel sizes; else over the layout's mesh (the
    named layout of the sizes by default), a mixture of experts' tokens dispatched to the
    expert axis as `expert_dispatch` says (engine.config.EXPERT_DISPATCHES)."""
    cfg, params, tokenizer = tiny
    if layout is None and dp * tp * pp > 1:
        layout = ShardingLayout.named(dp=dp, tp=tp, pp=pp)
    mesh = None if layout is None else make_mesh(layout, jax.devices()[: layout.num_devices])
    return LLMEngine(
        cfg,
        params,
        tokenizer,
        cache_config=CACHE,
        scheduler_config=SCHEDULER,
        warm_up=False,
        mesh=mesh,
        layout=layout,
        expert_dispatch=expert_dispatch,
    )


Generated = list[tuple[list[int], list[dict[int, float]]]]


def generate(engine) -> Generated:
    """Greedy tokens and top logprobs of every prompt, through the whole engine."""
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


@pytest.fixture(scope="session")
def single_device(tiny) -> tuple[np.ndarray, Generated]:
    """The oracle: the single-device engine's prefill logits and greedy generations."""
    engine = build_engine(tiny)
    return prefill_logits(engine), generate(engine)


def assert_same_logits(logits: np.ndarray, want: np.ndarray) -> None:
    print(f"max |logit difference| = {np.abs(logits - want).max():.2e}")
    assert np.abs(want).max() > 1.0  # the bound is tight for logits of this scale
    assert np.abs(logits - want).max() <= TOLERANCE


def assert_same(got: Generated, want: Generated) -> None:
    """Identical greedy tokens; top logprobs (the same ids) within TOLERANCE."""
    worst = 0.0
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(got, want, strict=True):
        assert tokens == want_tokens
        for entry, want_entry in zip(logprobs, want_logprobs, strict=True):
            assert entry.keys() == want_entry.keys()
            worst = max(worst, *(abs(entry[t] - want_entry[t]) for t in entry))
    print(f"max logprob difference = {worst:.2e}")
    assert worst <= TOLERANCE
