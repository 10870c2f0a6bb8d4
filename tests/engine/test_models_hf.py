"""Our Llama-family forward against Hugging Face transformers (PyTorch, CPU) on tiny random
checkpoints that the test writes with `save_pretrained`."""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from engine import naive
from engine.weights import ModelFiles, load_params

SMALL = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    initializer_range=0.3,
)

CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(**SMALL, rope_theta=10000.0),
    "llama3-rope-scaling": lambda: transformers.LlamaConfig(
        **SMALL,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    ),
    # A window smaller than the 16-token test sequences, so it matters.
    "mistral-sliding-window": lambda: transformers.MistralConfig(
        **SMALL, sliding_window=6, head_dim=16
    ),
    "qwen2-bias-tied": lambda: transformers.Qwen2Config(**SMALL, tie_word_embeddings=True),
    "llama-mha": lambda: transformers.LlamaConfig(**{**SMALL, "num_key_value_heads": 4}),
}


def write_checkpoint(hf_config: transformers.PretrainedConfig, directory: Path) -> torch.nn.Module:
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hf_config, attn_implementation="eager")
    with torch.no_grad():  # random norm weights and biases, so that a mix-up of them shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                p.copy_(1.0 + 0.5 * torch.randn_like(p) if "norm" in name else torch.randn_like(p))
    model.save_pretrained(directory)
    return model.eval()


@pytest.fixture(scope="module", params=list(CONFIGS))
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    directory = tmp_path_factory.mktemp(request.param)
    model = write_checkpoint(CONFIGS[request.param](), directory)
    return directory, model


def hf_logits(model: torch.nn.Module, ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.from_numpy(ids).long()).logits.float().numpy()


def test_float32_logits_match_transformers(checkpoint) -> None:
    directory, model = checkpoint
    ids = np.random.default_rng(1).integers(0, SMALL["vocab_size"], (2, 16), dtype=np.int32)
    cfg, params = load_params(ModelFiles(directory, is_gguf=False), dtype="float32")
    ours = np.asarray(naive.sequence_logits(params, jnp.asarray(ids), cfg=cfg))
    expected = hf_logits(model, ids)
    assert np.abs(expected).max() > 1.0  # the comparison is not between near-zero numbers
    np.testing.assert_allclose(ours, expected, atol=1e-4, rtol=0)


def test_bfloat16_logits_track_float32(checkpoint) -> None:
    directory, model = checkpoint
    ids = np.random.default_rng(2).integers(0, SMALL["vocab_size"], (2, 16), dtype=np.int32)
    cfg, params = load_params(ModelFiles(directory, is_gguf=False), dtype="bfloat16")
    assert params["embed"].dtype == jnp.bfloat16
    ours = np.asarray(naive.sequence_logits(params, jnp.asarray(ids), cfg=cfg))
    expected = hf_logits(model, ids)
    # The yardstick is transformers' own bfloat16 run of the same weights: rounding to 8 bits
    # of mantissa costs it some error against float32, and ours may not cost much more.
    hf_bf16_error = np.abs(hf_logits(model.to(torch.bfloat16), ids) - expected).max()
    model.float()
    our_error = np.abs(ours - expected).max()
    assert our_error < 2 * hf_bf16_error, (our_error, hf_bf16_error)
    assert (ours.argmax(-1) == expected.argmax(-1)).mean() >= 0.9
