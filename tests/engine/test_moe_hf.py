"""Qwen3 and the mixtures of experts (Qwen3-MoE, Mixtral, OLMoE) against transformers (PyTorch,
CPU) on tiny random checkpoints written by `save_pretrained`: whole-sequence float32 logits, and
greedy continuations through the paged engine (chunked prefill and decode), including a model
whose first router sends every token to two experts and none to the others."""

from __future__ import annotations

import functools
import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from engine import compilation, naive
from engine.config import CacheConfig, QuantizationConfig, SchedulerConfig
from engine.errors import XlaserveError
from engine.llm_engine import LLMEngine, run_to_completion
from engine.models import moe, registry
from engine.models.layers import dense_causal_attention
from engine.models.quant import QuantizedWeight, dequantize
from engine.request import SamplingParams
from engine.tokenizer import load_tokenizer
from engine.weights import ModelFiles, load_params
from tests.engine.tiny_moe import (
    CONFIGS,
    FORCED_EXPERTS,
    MOE_FAMILIES,
    build_model,
    force_router,
    tensor_names,
    write_checkpoint,
    write_gguf,
)

FORCED = "qwen3-moe-forced"
SHARED = "qwen3-moe"  # the suite's MoE engine runs this one
MAX_TOKENS = 6
# Two sequences, 8 tokens a step: few step shapes to compile (each costs seconds).
SCHEDULER = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=8, max_model_len=64)


@pytest.fixture(scope="module", params=[*CONFIGS, FORCED])
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    name = request.param
    if name == SHARED:  # the suite's (tests/conftest.py)
        moe = request.getfixturevalue("moe")
        return name, moe.directory, moe.model
    model = build_model(name.removesuffix("-forced"))
    if name == FORCED:
        force_router(model)
    return name, write_checkpoint(model, tmp_path_factory.mktemp(name)), model


def hf_logits(model: torch.nn.Module, ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.from_numpy(ids).long()).logits.float().numpy()


def hf_greedy(model: torch.nn.Module, prompt: list[int], max_tokens: int) -> list[int]:
    """Greedy decoding by full recomputation, one token at a time."""
    ids = list(prompt)
    for _ in range(max_tokens):
        ids.append(int(hf_logits(model, np.asarray([ids]))[0, -1].argmax()))
    return ids[len(prompt) :]


def test_config_read_from_checkpoint(checkpoint) -> None:
    name, directory, model = checkpoint
    cfg, params = load_params(ModelFiles(directory, is_gguf=False), dtype="float32")
    hf = model.config
    assert cfg.qk_norm == {"mixtral": None, "olmoe": "full"}.get(name, "head")
    assert cfg.num_experts == {"qwen3": 0, "mixtral": 4}.get(name, 8)
    if cfg.num_experts:
        assert cfg.num_experts_per_tok == hf.num_experts_per_tok == 2
        assert cfg.norm_topk_prob == (name != "olmoe")
        assert params["layers"][0]["we_gate_up"].shape == (cfg.num_experts, 64, 2, 32)
        assert "w_gate" not in params["layers"][0]
    assert cfg.clip_qkv == (2.0 if name == "olmoe" else None)
    assert not cfg.attention_bias and cfg.sliding_window is None


def test_float32_logits_match_transformers(checkpoint) -> None:
    """With the platform's choice of expert path (on CPU: every expert on every token), and for
    a mixture of experts also with the pairs sorted by expert through ragged_dot (the TPU and
    GPU path)."""
    _, directory, model = checkpoint
    ids = np.random.default_rng(1).integers(0, 256, (2, 16), dtype=np.int32)
    cfg, params = load_params(ModelFiles(directory, is_gguf=False), dtype="float32")
    ours = np.asarray(naive.sequence_logits(params, jnp.asarray(ids), cfg=cfg))
    expected = hf_logits(model, ids)
    assert np.abs(expected).max() > 1.0  # the comparison is not between near-zero numbers
    np.testing.assert_allclose(ours, expected, atol=1e-4, rtol=0)
    if cfg.num_experts:
        sorted_logits = np.asarray(sorted_experts_logits(params, jnp.asarray(ids), cfg=cfg))
        np.testing.assert_allclose(sorted_logits, expected, atol=1e-4, rtol=0)


@functools.partial(jax.jit, static_argnames="cfg")
def sorted_experts_logits(params, token_ids, *, cfg):
    """naive.sequence_logits with the experts run as sorted pairs and ragged_dot."""
    positions = jnp.arange(token_ids.shape[1], dtype=jnp.int32)
    experts = functools.partial(moe.grouped_experts, impl="sorted")

    def attention(q, k, v, cache, *, sliding_window):
        out = dense_causal_attention(q, k, v, positions, sm_scale=cfg.head_dim**-0.5)
        return out, cache

    def one(ids):
        hidden, _ = registry.forward(
            params, ids, positions, None, attention, cfg=cfg, experts=experts
        )
        return registry.compute_logits(params, hidden, cfg=cfg)

    return jax.lax.map(one, token_ids)


def lazy_engine(directory) -> LLMEngine:
    """An engine over the checkpoint that compiles only the step shapes it runs, counting a
    mixture of experts' tokens."""
    cfg, params = load_params(ModelFiles(directory, is_gguf=False), dtype="float32")
    return LLMEngine(
        cfg,
        params,
        load_tokenizer(directory),
        cache_config=CacheConfig(page_size=4, num_pages=64),
        scheduler_config=SCHEDULER,
        warm_up=False,
        count_expert_tokens=bool(cfg.num_experts),
    )


def test_paged_engine_greedy_matches_transformers(checkpoint, request) -> None:
    """Two prompts (11 and 4 tokens) in steps of at most 8 tokens: the first prefilled in two
    chunks, the second beside its second chunk (7 tokens: a step with padding), then decodes
    of both. A mixture of experts
    counts its tokens per layer and expert (EngineStats.expert_tokens) as transformers' own
    routers choose them over the same tokens; under the forced router, layer 0's go to the
    two forced experts only."""
    name, directory, model = checkpoint
    engine = request.getfixturevalue("moe").engine if name == SHARED else lazy_engine(directory)
    cfg = engine.cfg
    counted_before = np.asarray(engine.stats().expert_tokens)
    rng = random.Random(0)
    prompts = [[rng.randrange(256) for _ in range(n)] for n in (11, 4)]
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, greedy)
    outputs = run_to_completion(engine, [f"r{i}" for i in range(len(prompts))])
    for prompt, output in zip(prompts, outputs, strict=True):
        assert output.outputs[0].token_ids == hf_greedy(model, prompt, MAX_TOKENS)
    if not cfg.num_experts:
        assert engine.stats().expert_tokens == ()
        return
    # Every token the engine ran: the prompts and each output token but the last.
    run = [p + o.outputs[0].token_ids[:-1] for p, o in zip(prompts, outputs, strict=True)]
    counts = np.asarray(engine.stats().expert_tokens) - counted_before
    np.testing.assert_array_equal(counts, hf_expert_tokens(model, run))
    if name == FORCED:
        assert_router_forced(model, prompts)
        num_tokens = sum(map(len, run))
        assert {e: n for e, n in enumerate(counts[0]) if n} == dict.fromkeys(
            FORCED_EXPERTS, num_tokens
        )


def hf_expert_tokens(model: torch.nn.Module, sequences: list[list[int]]) -> np.ndarray:
    """Tokens per layer and expert i64[L, E] as transformers' routers choose them, each
    sequence run whole (every layer's `mlp.gate` hands out its top-k expert indices)."""
    config = model.config
    num_experts = getattr(config, "num_experts", None) or config.num_local_experts
    counts = np.zeros((config.num_hidden_layers, num_experts), np.int64)

    def count(layer: int, module: torch.nn.Module, args: object, out: tuple) -> None:
        np.add.at(counts[layer], out[2].flatten().numpy(), 1)

    hooks = [
        layer.mlp.gate.register_forward_hook(functools.partial(count, i))
        for i, layer in enumerate(model.model.layers)
    ]
    try:
        for sequence in sequences:
            hf_logits(model, np.asarray([sequence]))
    finally:
        for hook in hooks:
            hook.remove()
    return counts


def assert_router_forced(model: torch.nn.Module, prompts: list[list[int]]) -> None:
    """transformers' own layer-0 router sent every token to FORCED_EXPERTS: one expert got all
    tokens and the others (but the second choice) none."""
    chosen: list[torch.Tensor] = []
    hook = model.model.layers[0].mlp.gate.register_forward_hook(
        lambda module, args, out: chosen.append(out[2])
    )
    try:
        for prompt in prompts:
            hf_logits(model, np.asarray([prompt]))
    finally:
        hook.remove()
    experts = torch.cat(chosen).flatten().tolist()
    assert set(experts) == set(FORCED_EXPERTS)
    assert experts.count(FORCED_EXPERTS[0]) == sum(len(p) for p in prompts)


@pytest.mark.parametrize("name", MOE_FAMILIES)
def test_fused_and_per_expert_layouts_load_alike(name: str, tmp_path) -> None:
    """A checkpoint with one tensor per expert (what save_pretrained writes) and one with the
    experts fused (transformers 5's in-memory layout) load to the same parameters."""
    model = build_model(name, num_hidden_layers=1)
    per_expert = write_checkpoint(model, tmp_path / "per-expert")
    fused = write_checkpoint(model, tmp_path / "fused", fused=True)
    assert any(".experts.0." in n for n in tensor_names(per_expert))
    assert any(n.endswith(".experts.gate_up_proj") for n in tensor_names(fused))
    _, a = load_params(ModelFiles(per_expert, is_gguf=False), dtype="float32")
    _, b = load_params(ModelFiles(fused, is_gguf=False), dtype="float32")
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize(
    ("name", "architecture"), [("qwen3", "qwen3"), ("qwen3-moe", "qwen3moe"), ("mixtral", "llama")]
)
def test_gguf_matches_safetensors(name: str, architecture: str, tmp_path) -> None:
    """The same model written as llama.cpp's converter writes a GGUF loads to the config and
    logits of its safetensors checkpoint."""
    model = build_model(name)
    directory = write_checkpoint(model, tmp_path / "hf")
    write_gguf(tmp_path / "model.gguf", model, architecture)
    cfg, params = load_params(ModelFiles(directory, is_gguf=False), dtype="float32")
    gguf_cfg, gguf_params = load_params(
        ModelFiles(tmp_path / "model.gguf", is_gguf=True), dtype="float32"
    )
    for field in ("num_experts", "num_experts_per_tok", "norm_topk_prob", "qk_norm"):
        assert getattr(gguf_cfg, field) == getattr(cfg, field), field
    assert gguf_cfg.intermediate_size == cfg.intermediate_size
    ids = np.random.default_rng(4).integers(0, 256, (2, 16), dtype=np.int32)
    want = np.asarray(naive.sequence_logits(params, jnp.asarray(ids), cfg=cfg))
    got = np.asarray(naive.sequence_logits(gguf_params, jnp.asarray(ids), cfg=gguf_cfg))
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    np.testing.assert_allclose(got, hf_logits(model, ids), atol=1e-4, rtol=0)


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantized_experts_match_their_dequantized_weights(method: str, request) -> None:
    """Expert weights held as integers give the logits of the float model whose weights are
    their dequantized values, on the dense path (16 tokens a sequence) and the gathered one (3
    tokens: fewer token-expert pairs than experts), and take a fraction of the bytes."""
    directory = request.getfixturevalue("moe").directory  # the suite's Qwen3-MoE
    quantization = QuantizationConfig(method)
    cfg, params = load_params(
        ModelFiles(directory, is_gguf=False), dtype="float32", quantization=quantization
    )
    experts = params["layers"][0]["we_gate_up"]
    assert isinstance(experts, QuantizedWeight) and experts.bits == quantization.bits
    assert experts.nbytes < 0.3 * np.prod(experts.shape) * 4
    is_quantized = lambda w: isinstance(w, QuantizedWeight)
    floats = jax.tree.map(
        lambda w: dequantize(w) if is_quantized(w) else w, params, is_leaf=is_quantized
    )
    ids = np.random.default_rng(5).integers(0, 256, (2, 16), dtype=np.int32)
    for length in (16, 3):
        got = naive.sequence_logits(params, jnp.asarray(ids[:, :length]), cfg=cfg)
        want = naive.sequence_logits(floats, jnp.asarray(ids[:, :length]), cfg=cfg)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-4, rtol=0)


def test_no_compilation_after_warm_up_across_a_random_run(moe) -> None:
    """100 requests of random prompts (1 to 40 tokens), greedy and sampled, arriving in waves
    while others run, on a warmed-up MoE engine that counts its experts' tokens: however the
    tokens are routed, nothing compiles after warm-up."""
    engine = moe.engine
    generated_before = engine.stats().num_generation_tokens
    rng = random.Random(9)
    before = compilation.count()
    for wave in range(10):
        for i in range(10):
            params_i = SamplingParams(
                temperature=rng.choice([0.0, 0.8]), max_tokens=rng.randint(1, 8), seed=i
            )
            prompt = [rng.randrange(256) for _ in range(rng.randint(1, 40))]
            engine.add_request(f"w{wave}-{i}", prompt, params_i)
        for _ in range(rng.randint(1, 4)):
            engine.step()
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.stats().num_generation_tokens - generated_before > 100
    assert compilation.count() == before


def test_expert_counts_need_a_mixture_of_experts(tiny) -> None:
    cfg, params, tokenizer = tiny
    with pytest.raises(XlaserveError, match="needs a mixture-of-experts model"):
        LLMEngine(cfg, params, tokenizer, warm_up=False, count_expert_tokens=True)
