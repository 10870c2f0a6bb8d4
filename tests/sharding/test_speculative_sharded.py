"""Speculative decoding over a device mesh (n-gram with tensor and pipeline parallelism and
data-parallel replicas; a draft model sharded as the target is) against the single-device
engine without speculation (the oracle, tests/sharding/conftest.py): greedy tokens identical
and logprobs within the sharded tests' tolerance, with proposals accepted on the way."""

from __future__ import annotations

import jax
import pytest

from engine.builder import build_engine
from engine.config import EngineConfig, ParallelConfig, SpeculativeConfig
from engine.data_parallel import DataParallelEngine
from engine.errors import XlaserveError
from engine.speculative.engine import SpeculativeEngine
from sharding.layout import ShardingLayout
from sharding.mesh import make_mesh, replica_meshes
from tests.engine.tiny_model import write_tiny_checkpoint
from tests.sharding.conftest import CACHE, SCHEDULER, assert_same, generate

# Lookup from one token on: the prompts (runs of consecutive ids) and the tiny model's output
# repeat enough for some proposals to be accepted.
SPECULATIVE = SpeculativeConfig("ngram", 3, prompt_lookup_min=1, prompt_lookup_max=3)


def speculative_engines(tiny, layout: ShardingLayout) -> list[SpeculativeEngine]:
    cfg, params, tokenizer = tiny
    mesh = make_mesh(layout, jax.devices()[: layout.num_devices])
    return [
        SpeculativeEngine(
            cfg,
            params,
            tokenizer,
            speculative=SPECULATIVE,
            cache_config=CACHE,
            scheduler_config=SCHEDULER,
            warm_up=False,
            mesh=replica,
            layout=layout,
        )
        for replica in replica_meshes(mesh, layout)
    ]


@pytest.mark.parametrize("sizes", [{"tp": 2}, {"pp": 2}, {"dp": 2}], ids=["tp2", "pp2", "dp2"])
def test_ngram_speculation_over_a_mesh_matches_single_device(tiny, single_device, sizes) -> None:
    engines = speculative_engines(tiny, ShardingLayout.named(**sizes))
    engine = engines[0] if len(engines) == 1 else DataParallelEngine(engines)
    assert_same(generate(engine), single_device[1])
    assert engine.stats().spec_decode_num_accepted_tokens > 0  # replicas' summed
    assert all(e.kv_cache.num_free_pages == e.kv_cache.num_pages for e in engines)


def test_a_draft_model_over_a_mesh_matches_single_device(tiny, single_device) -> None:
    """The draft (here the target itself: every proposal it draws greedily is accepted) sharded
    as the target is, over TP=2; greedy equals the single-device engine without speculation."""
    cfg, params, tokenizer = tiny
    layout = ShardingLayout.named(tp=2)
    engine = SpeculativeEngine(
        cfg,
        params,
        tokenizer,
        speculative=SpeculativeConfig("draft_model", 2, model="itself"),
        draft=(cfg, params),
        cache_config=CACHE,
        scheduler_config=SCHEDULER,
        warm_up=False,
        mesh=make_mesh(layout, jax.devices()[: layout.num_devices]),
        layout=layout,
    )
    assert_same(generate(engine), single_device[1])
    stats = engine.stats()
    assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens > 0
    assert engine.kv_cache.num_free_pages == engine.kv_cache.num_pages


def test_a_draft_model_whose_heads_a_layout_cannot_split_is_refused(tmp_path) -> None:
    """The draft is sharded as the target is: a draft with one KV head under TP=2 is refused
    at build time with a message naming the draft."""
    target = str(write_tiny_checkpoint(tmp_path / "target"))
    draft = str(
        write_tiny_checkpoint(tmp_path / "draft", num_attention_heads=1, num_key_value_heads=1)
    )
    config = EngineConfig(
        target,
        parallel=ParallelConfig(ShardingLayout.named(tp=2)),
        speculative=SpeculativeConfig("draft_model", 2, model=draft),
    )
    with pytest.raises(XlaserveError, match=r"the draft model .*draft"):
        build_engine(config)
