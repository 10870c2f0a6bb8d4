"""Expert parallelism: a tiny Qwen3-MoE (8 experts, top 2) with its experts split over 2, 4 and
8 devices, and over 2 with tensor parallelism 2 on top, against the single-device engine (the
oracle): greedy tokens identical, logits and logprobs within 1e-5, and each device holding its
share of the expert weights; with either expert dispatch (sharding/experts.py)."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from engine import builder
from engine.config import (
    EXPERT_DISPATCHES,
    CacheConfig,
    CompilationConfig,
    EngineConfig,
    ParallelConfig,
)
from engine.llm_engine import LLMEngine
from engine.tokenizer import load_tokenizer
from engine.weights import open_checkpoint, resolve_model
from sharding.layout import ShardingLayout
from tests.engine.test_moe_hf import assert_router_forced
from tests.engine.tiny_moe import build_model, force_router, write_checkpoint
from tests.sharding.conftest import (
    PROMPTS,
    assert_same,
    assert_same_logits,
    build_engine,
    generate,
    prefill_logits,
)

EXPERT_LEAVES = ("we_gate_up", "we_down")


@pytest.fixture(scope="module")
def tiny_moe_directory(tmp_path_factory):
    """Weights of std 0.1, as the sharding suite's tiny Llama (see its conftest). Layer 0's
    router is forced (`force_router`): every token goes to experts 3 and 5 and the other six
    get none, so that a dispatch must carry all of a step's tokens to one or two devices and
    none to the rest; layer 1 routes by its random router."""
    model = build_model("qwen3-moe", initializer_range=0.1)
    force_router(model)
    assert_router_forced(model, PROMPTS)  # (every token: any token's embedding is forced)
    return write_checkpoint(model, tmp_path_factory.mktemp("tiny-moe"))


@pytest.fixture(scope="module")
def tiny_moe(tiny_moe_directory):
    checkpoint = open_checkpoint(resolve_model(str(tiny_moe_directory)))
    return checkpoint.cfg, checkpoint.load_params(), load_tokenizer(tiny_moe_directory)


@pytest.fixture(scope="module")
def moe_single_device(tiny_moe):
    engine = build_engine(tiny_moe)
    return prefill_logits(engine), generate(engine)


def expert_layout(ep: int, tp: int) -> ShardingLayout:
    rules = {"expert": "ep"}
    if tp > 1:
        rules |= {"vocab": "tp", "heads": "tp", "kv_heads": "tp", "mlp": "tp"}
    return ShardingLayout.create({"ep": ep, "tp": tp}, rules, replicate_if_indivisible=("vocab",))


# Each engine costs ~10-20 s of compilation: the all-to-all dispatch runs through the engine at
# EP 8 (decode's 4 tokens padded to 8) and EP 2 x TP 2; test_expert_dispatch.py checks it at
# every size, forced routing included, as the function the engine calls.
LAYOUTS = [(2, 1, "allgather"), (4, 1, "allgather"), (8, 1, "allgather"), (2, 2, "allgather"),
           (8, 1, "all_to_all"), (2, 2, "all_to_all")]  # fmt: skip


@pytest.mark.parametrize(
    ("ep", "tp", "dispatch"),
    LAYOUTS,
    ids=[f"ep{ep}" + (f"-tp{tp}" if tp > 1 else "") + f"-{d}" for ep, tp, d in LAYOUTS],
)
def test_expert_parallel_engine_matches_single_device(
    tiny_moe, moe_single_device, ep, tp, dispatch
):
    engine = build_engine(tiny_moe, layout=expert_layout(ep, tp), expert_dispatch=dispatch)
    assert_same_logits(prefill_logits(engine), moe_single_device[0])
    assert_same(generate(engine), moe_single_device[1])
    check_expert_bytes(engine.runner.params, ep * tp)


def check_expert_bytes(params, shards: int) -> None:
    """Each device holds exactly 1/shards of every expert weight (experts over the expert
    axis, each expert's width over the tensor axis)."""
    for path, x in jax.tree_util.tree_leaves_with_path(params):
        if str(path[-1].key) not in EXPERT_LEAVES:
            continue
        per_device = {s.device: s.data.nbytes for s in x.addressable_shards}
        assert len(per_device) == shards
        assert set(per_device.values()) == {x.nbytes // shards}, (path, per_device, x.nbytes)
        # and the shards are distinct parts, not copies: together they rebuild the whole
        whole = np.zeros(x.shape, np.float32)
        for s in x.addressable_shards:
            whole[s.index] += np.asarray(s.data)
        np.testing.assert_array_equal(whole, np.asarray(x))


@pytest.mark.parametrize("dispatch", EXPERT_DISPATCHES)
def test_expert_dispatch_reaches_the_step(tiny_moe_directory, dispatch):
    """ParallelConfig's expert_dispatch (--expert-dispatch) is the one the compiled step uses."""
    config = EngineConfig(
        str(tiny_moe_directory),
        cache=CacheConfig(page_size=4, num_pages=16),
        parallel=ParallelConfig(expert_layout(4, 2), expert_dispatch=dispatch),  # all 8 devices
        compilation=CompilationConfig(warm_up="lazy"),
    )
    engine = builder.build_engine(config)
    assert isinstance(engine, LLMEngine)
    assert engine.runner.options().sharding.expert_dispatch == dispatch
    engine.close()
