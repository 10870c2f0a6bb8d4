"""LoRA under tensor parallelism (#24): the adapters' A and B are split as their base weights
are (B of q/k/v/gate/up along heads or the MLP width, A of o/down along their inputs), and a
batch mixing the base model and adapters gives the single-device engine's greedy tokens and
logprobs, with TP = 2 (KV heads split) and TP = 4 (KV heads replicated)."""

from __future__ import annotations

import jax
import pytest

from engine.config import LoRAConfig
from engine.llm_engine import LLMEngine, run_to_completion
from sharding.layout import ShardingLayout
from sharding.mesh import make_mesh
from tests.engine.lora_adapters import SPECS, write_adapters, write_model
from tests.sharding.conftest import CACHE, GREEDY, PROMPTS, SCHEDULER, Generated, assert_same

LORA_TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def lora_setup(tiny, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-tp")
    base = write_model("llama", root / "model")  # the shapes of `tiny`: adapters fit it
    adapters = write_adapters(base, root / "adapters")
    modules = tuple((name, str(path)) for name, path in adapters.items())
    return LoRAConfig(max_loras=4, max_lora_rank=16, modules=modules)


def build(tiny, lora: LoRAConfig, tp: int) -> LLMEngine:
    cfg, params, tokenizer = tiny
    layout = ShardingLayout.named(tp=tp) if tp > 1 else None
    mesh = None if layout is None else make_mesh(layout, jax.devices()[:tp])
    return LLMEngine(
        cfg, params, tokenizer, cache_config=CACHE, scheduler_config=SCHEDULER, warm_up=False,
        mesh=mesh, layout=layout, lora_config=lora,
    )  # fmt: skip


def generate(engine: LLMEngine) -> Generated:
    names = [None, *SPECS]
    ids = [f"r{i}" for i in range(len(PROMPTS))]
    for i, (request_id, prompt) in enumerate(zip(ids, PROMPTS, strict=True)):
        engine.add_request(request_id, prompt, GREEDY, lora_name=names[i % len(names)])
    outputs = run_to_completion(engine, ids)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs or []) for o in outputs]


@pytest.fixture(scope="module")
def single(tiny, lora_setup) -> Generated:
    return generate(build(tiny, lora_setup, 1))


@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_parallel_lora_equals_single_device(tiny, lora_setup, single, tp) -> None:
    engine = build(tiny, lora_setup, tp)
    slots = engine.runner.lora
    assert slots is not None
    weights = slots.weights[0]
    # B of q split over heads (axis 2 of [slots, rank, heads, head_dim]); A of o over heads.
    assert weights["wq_lora_b"].sharding.spec[2] == "tp"
    assert weights["wo_lora_a"].sharding.spec[1] == "tp"
    assert weights["w_down_lora_a"].sharding.spec[1] == "tp"
    assert_same(generate(engine), single)
