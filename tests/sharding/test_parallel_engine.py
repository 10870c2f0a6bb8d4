"""Sharded engines against the single-device engine (the oracle), through the whole engine:
greedy tokens identical; logits, and the logprobs the engine returns, equal within 1e-5
(float32). Tensor parallelism sums a matmul's partial products in another order, which moves
logits by a few ulps: ~2e-5 on the suite's tiny model (logits up to ~7.7), so these tests use
one with logits of magnitude ~2 (tests/sharding/conftest.py)."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from engine.data_parallel import DataParallelEngine
from engine.llm_engine import LLMEngine, run_to_completion
from engine.step import forward_logits
from sharding.layout import ShardingLayout
from sharding.mesh import make_mesh, replica_meshes
from sharding.multihost import put_replicated
from tests.sharding.conftest import CACHE, GREEDY, PROMPTS, SCHEDULER, build_engine

TOLERANCE = 1e-5


def generate(
    engine: LLMEngine | DataParallelEngine,
) -> list[tuple[list[int], list[dict[int, float]]]]:
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
            worst = max(worst, *(abs(entry[t] - want_entry[t]) for t in entry))
    print(f"max logprob difference = {worst:.2e}")
    assert worst <= TOLERANCE


@pytest.mark.parametrize(
    ("tp", "pp"), [(2, 1), (4, 1), (1, 2), (2, 2)], ids=["tp2", "tp4", "pp2", "tp2-pp2"]
)
def test_sharded_engine_matches_single_device(tiny, single_device, tp: int, pp: int) -> None:
    engine = build_engine(tiny, tp=tp, pp=pp)
    logits = prefill_logits(engine)
    print(f"max |logit difference| = {np.abs(logits - single_device[0]).max():.2e}")
    assert np.abs(single_device[0]).max() > 1.0  # the bound is tight for logits of this scale
    assert np.abs(logits - single_device[0]).max() <= TOLERANCE
    assert_same(generate(engine), single_device[1])

    if tp > 1 and pp == 1:  # (stages each hold the embedding and the output layer)
        check_bytes_per_device(engine, tp)


def check_bytes_per_device(engine: LLMEngine, shards: int) -> None:
    """Each device holds ~1/shards of the weights: what is replicated (norms; K/V projections
    when there are fewer KV heads than shards) is allowed on top."""
    leaves = jax.tree_util.tree_leaves_with_path(engine.runner.params)
    total = sum(x.nbytes for _, x in leaves)
    replicated = sum(x.nbytes for _, x in leaves if x.sharding.is_fully_replicated)
    per_device: dict[jax.Device, int] = {}
    for _, x in leaves:
        for shard in x.addressable_shards:
            per_device[shard.device] = per_device.get(shard.device, 0) + shard.data.nbytes
    print(
        f"bytes per device {sorted(set(per_device.values()))}, total {total}, "
        f"total/{shards} = {total // shards}, replicated {replicated}"
    )
    assert len(per_device) == shards
    for nbytes in per_device.values():
        assert total / shards <= nbytes <= (total - replicated) / shards + replicated
        if engine.runner.plan is not None and not engine.runner.plan.kv_replicated:
            assert nbytes <= 1.02 * total / shards


def test_data_parallel_replicas_match_single_device(tiny, single_device) -> None:
    cfg, params, tokenizer = tiny
    layout = ShardingLayout.named(dp=2)
    mesh = make_mesh(layout, jax.devices()[:2])
    replicas = [
        LLMEngine(
            cfg,
            params,
            tokenizer,
            cache_config=CACHE,
            scheduler_config=SCHEDULER,
            warm_up=False,
            mesh=replica,
            layout=layout,
        )
        for replica in replica_meshes(mesh, layout)
    ]
    engine = DataParallelEngine(replicas)
    assert_same(generate(engine), single_device[1])
    assert all(r.stats().num_steps > 0 for r in engine.replicas)  # both served requests
    assert engine.stats().num_generation_tokens == len(PROMPTS) * GREEDY.max_tokens
