"""Quantized layers stacked on CPU (`engine.model_runner._stacks_layers`): the forward is passed
one array per kind of weight instead of one per layer, each layer's kernel reads its slice of
the stacks in place, and the engine's results, with and without a LoRA adapter, equal those of
the per-layer params."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from bench.step_breakdown import forward_arrays
from engine import model_runner
from engine.config import CacheConfig, LoRAConfig, QuantizationConfig, SchedulerConfig
from engine.llm_engine import LLMEngine, run_to_completion
from engine.models.quant import QuantizedWeight
from engine.request import SamplingParams
from engine.tokenizer import load_tokenizer
from engine.weights import load_params, resolve_model
from pallas_kernels import cpu
from tests.engine.lora_adapters import SPECS, write_adapter, write_model

PROMPTS = [[1 + i, 7, 42 + i, 9] * (i + 1) for i in range(4)]
ADAPTER = "all-r8-rs"  # every projection adapted: the stacked adapter slots are read per layer


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    # Widths the int8-activation kernel takes (gate and up in one call), 3 layers, an adapter.
    directory = tmp_path_factory.mktemp("tiny")
    base = write_model(
        "llama", directory, hidden_size=128, intermediate_size=128, num_hidden_layers=3
    )
    adapter = write_adapter(base, SPECS[ADAPTER], tmp_path_factory.mktemp(ADAPTER))
    config = QuantizationConfig("int4", int8_activations=True)
    cfg, params = load_params(resolve_model(str(directory)), quantization=config)
    return cfg, params, load_tokenizer(directory), str(adapter)


def run(cfg, params, tokenizer, adapter: str) -> tuple[LLMEngine, list]:
    engine = LLMEngine(
        cfg,
        params,
        tokenizer,
        warm_up=False,
        cache_config=CacheConfig(4, num_pages=64),
        scheduler_config=SchedulerConfig(
            max_num_seqs=4, max_num_batched_tokens=32, max_model_len=128
        ),
        lora_config=LoRAConfig(max_loras=1, max_lora_rank=8),
    )
    engine.add_lora(ADAPTER, adapter)
    ids = [str(i) for i in range(len(PROMPTS))]
    for i, (request_id, prompt) in enumerate(zip(ids, PROMPTS, strict=True)):
        sampling = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)
        engine.add_request(request_id, prompt, sampling, lora_name=ADAPTER if i % 2 else None)
    outputs = [out.outputs[0] for out in run_to_completion(engine, ids)]
    return engine, [(out.token_ids, out.logprobs) for out in outputs]


@pytest.mark.skipif(not cpu.available(), reason="the CPU kernels could not be built")
def test_stacked_layers_equal_per_layer_ones(quantized, monkeypatch) -> None:
    cfg, params, tokenizer, adapter = quantized
    stacked, got = run(cfg, params, tokenizer, adapter)
    monkeypatch.setattr(model_runner, "_stacks_layers", lambda cfg, params: False)
    per_layer, want = run(cfg, params, tokenizer, adapter)

    layers = stacked.runner.params["layers"]
    assert isinstance(layers, dict) and isinstance(per_layer.runner.params["layers"], list)
    assert isinstance(layers["wq"], QuantizedWeight)
    assert layers["wq"].values.shape[0] == cfg.num_layers
    # Every layer but one fewer arrays for jit to pass: its weights, scales, offsets and norms,
    # and its adapter slots (A and B of each of the 7 projections).
    per_layer_leaves = len(jax.tree.leaves(params["layers"][0])) + 2 * 7
    saved = forward_arrays(per_layer) - forward_arrays(stacked)
    assert saved == (cfg.num_layers - 1) * per_layer_leaves

    for (got_ids, got_logprobs), (want_ids, want_logprobs) in zip(got, want, strict=True):
        assert got_ids == want_ids
        for g, w in zip(got_logprobs, want_logprobs, strict=True):
            assert g.keys() == w.keys()
            np.testing.assert_allclose(list(g.values()), list(w.values()), rtol=0, atol=1e-6)


def test_float_weights_stay_per_layer(tiny) -> None:
    # XLA's products would copy each layer's slice out of a stack: float layers are not stacked.
    cfg, params, _ = tiny
    assert not model_runner._stacks_layers(cfg, params)
