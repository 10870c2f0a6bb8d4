"""Sharded engines over the built-in (named) layouts against the single-device engine (the
oracle), through the whole engine: greedy tokens identical; logits, and the logprobs the engine
returns, equal within 1e-5 (float32)."""

from __future__ import annotations

import jax
import pytest

from engine.data_parallel import DataParallelEngine
from engine.llm_engine import LLMEngine
from sharding.layout import ShardingLayout
from sharding.mesh import make_mesh, replica_meshes
from tests.sharding.conftest import (
    CACHE,
    GREEDY,
    PROMPTS,
    SCHEDULER,
    assert_same,
    assert_same_logits,
    build_engine,
    generate,
    prefill_logits,
)


@pytest.mark.parametrize(
    ("tp", "pp"), [(2, 1), (4, 1), (1, 2), (2, 2)], ids=["tp2", "tp4", "pp2", "tp2-pp2"]
)
def test_sharded_engine_matches_single_device(tiny, single_device, tp: int, pp: int) -> None:
    engine = build_engine(tiny, tp=tp, pp=pp)
    assert_same_logits(prefill_logits(engine), single_device[0])
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
