"""Quantized GGUF mixtures of experts: expert tensors stored as ggml blocks ([E, F, D] gate and
up apart, [E, D, F] down, as llama.cpp writes them) are taken as stored under `--quantization`,
gate and up joined, never widened to float and quantized again. The oracle is gguf-py: the float
load of the same file dequantizes every block with its `dequantize`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from engine import naive
from engine.config import QuantizationConfig
from engine.models.quant import QuantizedWeight, dequantize
from engine.weights import ModelFiles, load_params
from tests.engine.tiny_moe import build_model, write_gguf

EXPERT_LEAVES = ("we_gate_up", "we_down")


@pytest.mark.parametrize(
    ("name", "architecture", "types", "quantization"),
    [
        # gate, up and down take the types in turn: gate and up of one layer differ in type
        ("qwen3-moe", "qwen3moe", (Q.Q4_0, Q.Q4_1, Q.Q4_0), QuantizationConfig("int4", 128)),
        ("mixtral", "llama", (Q.Q8_0,), QuantizationConfig("int8")),
    ],
)
def test_expert_blocks_are_taken_as_stored(
    name: str, architecture: str, types: tuple[Q, ...], quantization: QuantizationConfig, tmp_path
) -> None:
    """Each expert weight is the file's blocks: groups of 32 along the contraction (not the
    configured groups a float weight would be quantized in), dequantizing to exactly gguf-py's
    values; and the model's logits over them equal those of their dequantized floats."""
    path = tmp_path / "model.gguf"
    write_gguf(path, build_model(name), architecture, expert_types=types)
    _, floats = load_params(ModelFiles(path, is_gguf=True), dtype="float32")
    cfg, params = load_params(
        ModelFiles(path, is_gguf=True), dtype="float32", quantization=quantization
    )
    for layer, float_layer in zip(params["layers"], floats["layers"], strict=True):
        for leaf in EXPERT_LEAVES:
            w = layer[leaf]
            assert isinstance(w, QuantizedWeight) and w.bits == quantization.bits, leaf
            contraction = w.shape[1]  # [E, D, 2, F] and [E, F, D] contract their axis 1
            assert w.scales.shape[1] == contraction // 32, (leaf, w.scales.shape)
            np.testing.assert_allclose(
                np.asarray(dequantize(w)), np.asarray(float_layer[leaf]), atol=1e-6, rtol=0
            )

    is_quantized = lambda w: isinstance(w, QuantizedWeight)
    dequantized = jax.tree.map(
        lambda w: dequantize(w) if is_quantized(w) else w, params, is_leaf=is_quantized
    )
    ids = jnp.asarray(np.random.default_rng(7).integers(0, 256, (2, 16), dtype=np.int32))
    got = naive.sequence_logits(params, ids, cfg=cfg)
    want = naive.sequence_logits(dequantized, ids, cfg=cfg)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-4, rtol=0)


def test_gate_and_up_of_different_bits_are_quantized_again(tmp_path) -> None:
    """Gate as Q8_0 beside up as Q4_1 cannot share one int4 weight: the joined tensor is
    quantized again from gguf-py's float values, in the configured groups."""
    path = tmp_path / "model.gguf"
    write_gguf(path, build_model("qwen3-moe"), "qwen3moe", expert_types=(Q.Q8_0, Q.Q4_1))
    _, floats = load_params(ModelFiles(path, is_gguf=True), dtype="float32")
    _, params = load_params(
        ModelFiles(path, is_gguf=True),
        dtype="float32",
        quantization=QuantizationConfig("int4", 64),
    )
    w = params["layers"][0]["we_gate_up"]
    assert isinstance(w, QuantizedWeight) and w.scales.shape[1] == w.shape[1] // 64
    want = np.asarray(floats["layers"][0]["we_gate_up"])
    step = np.abs(want).max() / 7  # int4 asymmetric groups: within one step of the range
    np.testing.assert_allclose(np.asarray(dequantize(w)), want, atol=step, rtol=0)
