"""Our Gemma 3 forward against transformers' Gemma3ForCausalLM (PyTorch, CPU) on a tiny random
checkpoint written by the test: whole-sequence logits, and prefill plus incremental decode
through the engine's paged step (chunked prefill over pages of 4, a window of 6 that the
19-token sequences outgrow)."""

from __future__ import annotations

import copy
import random
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from engine import naive
from engine.batch import BatchBuilder, BatchShapes
from engine.config import SchedulerConfig
from engine.kv_cache import KVCacheManager
from engine.models.layers import stack_layers
from engine.request import FinishReason, Request, SamplingParams
from engine.scheduler import Scheduler
from engine.step import StepOptions, forward_logits
from engine.weights import ModelFiles, load_params
from pallas_kernels.kv_cache_update import KVCacheSpec, init_kv_pages

VOCAB = 256
PAGE = 4
WINDOW = 6
LAYER_TYPES = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]


def gemma3_config() -> transformers.Gemma3TextConfig:
    return transformers.Gemma3TextConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=len(LAYER_TYPES),
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        sliding_window=WINDOW,
        layer_types=LAYER_TYPES,
        query_pre_attn_scalar=24,  # not head_dim, so that a wrong scale shows
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 50_000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
        },
        initializer_range=0.3,
    )


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    directory = tmp_path_factory.mktemp("gemma3")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        gemma3_config(), attn_implementation="eager"
    )
    assert type(model).__name__ == "Gemma3ForCausalLM"
    with torch.no_grad():  # Gemma's norms start at 0 (applied as 1 + w): make each one differ
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(0.5 * torch.randn_like(p))
    model.save_pretrained(directory)
    return directory, model.eval()


def hf_logits(model: torch.nn.Module, ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.from_numpy(ids).long()).logits.float().numpy()


def test_config_read_from_checkpoint(checkpoint) -> None:
    directory, _ = checkpoint
    cfg, _ = load_params(ModelFiles(directory, is_gguf=False))
    assert cfg.architecture == "gemma3" and cfg.sliding_window == WINDOW
    assert [cfg.layer_window(i) for i in range(4)] == [WINDOW, WINDOW, None, WINDOW]
    assert (cfg.rope_theta, cfg.local_rope_theta, cfg.query_pre_attn_scalar) == (5e4, 100.0, 24.0)
    assert cfg.uniform_sliding_window is None  # a global layer: no page is ever behind the window


def test_float32_logits_match_transformers(checkpoint) -> None:
    directory, model = checkpoint
    ids = np.random.default_rng(1).integers(0, VOCAB, (2, 16), dtype=np.int32)
    cfg, params = load_params(ModelFiles(directory, is_gguf=False), dtype="float32")
    ours = np.asarray(naive.sequence_logits(params, jnp.asarray(ids), cfg=cfg))
    expected = hf_logits(model, ids)
    assert np.abs(expected).max() > 1.0
    np.testing.assert_allclose(ours, expected, atol=1e-4, rtol=0)


def test_stacked_layers_scan_equals_unrolled(checkpoint) -> None:
    """The lax.scan path (local/global picked by lax.switch) gives the same logits."""
    directory, _ = checkpoint
    ids = np.random.default_rng(3).integers(0, VOCAB, (1, 16), dtype=np.int32)
    cfg, params = load_params(ModelFiles(directory, is_gguf=False), dtype="float32")
    unrolled = np.asarray(naive.sequence_logits(params, ids, cfg=cfg))
    stacked = {**params, "layers": stack_layers(params["layers"])}
    np.testing.assert_allclose(
        np.asarray(naive.sequence_logits(stacked, ids, cfg=cfg)), unrolled, atol=1e-5, rtol=0
    )


def test_bfloat16_logits_track_float32(checkpoint) -> None:
    directory, model = checkpoint
    ids = np.random.default_rng(2).integers(0, VOCAB, (2, 16), dtype=np.int32)
    cfg, params = load_params(ModelFiles(directory, is_gguf=False), dtype="bfloat16")
    assert params["embed"].dtype == jnp.bfloat16
    ours = np.asarray(naive.sequence_logits(params, jnp.asarray(ids), cfg=cfg))
    expected = hf_logits(model, ids)
    # A copy: rounding the shared model's weights to bfloat16 would spoil the other tests.
    hf_bf16 = copy.deepcopy(model).to(torch.bfloat16)
    hf_bf16_error = np.abs(hf_logits(hf_bf16, ids) - expected).max()
    our_error = np.abs(ours - expected).max()
    assert our_error < 2 * hf_bf16_error, (our_error, hf_bf16_error)
    assert (ours.argmax(-1) == expected.argmax(-1)).mean() >= 0.9


def test_paged_prefill_and_decode_match_transformers(checkpoint) -> None:
    """Two requests prefilled in chunks of at most 7 tokens mixed with each other's decodes;
    every step's logits equal transformers' full forward of the final sequence."""
    directory, model = checkpoint
    cfg, params = load_params(ModelFiles(directory, is_gguf=False), dtype="float32")
    kv = KVCacheManager(64, PAGE)
    scheduler = Scheduler(
        SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=7, max_model_len=64), kv
    )
    shapes = BatchShapes.create(
        max_num_batched_tokens=7, max_num_seqs=4, max_model_len=64, page_size=PAGE
    )
    builder = BatchBuilder(shapes, PAGE)
    spec = KVCacheSpec(64, PAGE, cfg.num_kv_heads, cfg.head_dim)
    caches = [init_kv_pages(spec) for _ in range(cfg.num_layers)]
    run = jax.jit(forward_logits, static_argnames="options")
    rng = random.Random(0)
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    requests = [
        Request(f"r{i}", [rng.randrange(VOCAB) for _ in range(n)], greedy, seed=0)
        for i, n in enumerate((13, 9))
    ]
    for r in requests:
        scheduler.add_request(r)
    recorded: dict[str, list[tuple[int, np.ndarray]]] = {r.request_id: [] for r in requests}
    while scheduler.has_unfinished():
        out = scheduler.schedule()
        batch = builder.build(out, kv, penalties=False)
        logits, caches = run(params, caches, jax.device_put(batch), options=StepOptions(cfg))
        for i, s in enumerate(out.scheduled):
            position = s.start + s.num_new_tokens - 1
            recorded[s.request.request_id].append((position, np.asarray(logits[i])))
        for r in scheduler.update_after_step(out):
            r.output_token_ids.append(int(np.argmax(recorded[r.request_id][-1][1])))
            if len(r.output_token_ids) == 6:
                scheduler.finish(r, FinishReason.LENGTH)
    for r in requests:
        assert len(r.all_token_ids) > 2 * WINDOW
        full = hf_logits(model, np.asarray([r.all_token_ids]))[0]
        positions = [p for p, _ in recorded[r.request_id]]
        assert len(positions) > 6  # several chunks, then the decodes
        for position, step_logits in recorded[r.request_id]:
            np.testing.assert_allclose(step_logits, full[position], atol=1e-4, rtol=0)
