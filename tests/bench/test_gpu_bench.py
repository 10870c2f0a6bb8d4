"""The pieces of bench/gpu/llama_bench.py that must be right before it reaches a device: the
attention oracle check it runs first, and the arithmetic of its bounds. (The whole script runs
on CPU with `SMALL=1 bash bench/gpu/run.sh`, a few minutes: not in the test suite.)"""

from __future__ import annotations

import numpy as np
import pytest

from bench.gpu import llama_bench
from engine.models import registry


def test_attention_check_passes_and_catches_a_wrong_scale(monkeypatch):
    errors = llama_bench.check_attention(llama_bench.SMALL)
    assert errors["reference"] < 1e-4
    real = llama_bench.ragged_paged_attention
    monkeypatch.setattr(
        llama_bench,
        "ragged_paged_attention",
        lambda *a, sm_scale, impl: real(*a, sm_scale=sm_scale * 1.5, impl=impl),
    )
    with pytest.raises(SystemExit, match="attention check failed"):
        llama_bench.check_attention(llama_bench.SMALL)


def test_dense_oracle_by_hand():
    # one query at position 1 over two keys: weights softmax([0, 1]) on values 0 and 1
    q = np.array([[[1.0]]])
    k = np.array([[[0.0]], [[1.0]]])
    v = np.array([[[0.0]], [[1.0]]])
    out = llama_bench.dense_attention(q, k, v, scale=1.0)
    assert out[0, 0, 0] == pytest.approx(np.e / (1 + np.e))


def test_prefill_flops_of_llama3_8b():
    # ~7.0e9 weights outside the embedding: 2 * 2048 tokens * 6.98e9 = 2.86e13, plus attention
    # 2 * 2 * 32 heads * 128 * (2048 * 2049 / 2) * 32 layers = 1.10e12, plus one logits row
    flops = llama_bench.prefill_flops(llama_bench.LLAMA3_8B, 2048)
    assert flops == pytest.approx(2.86e13 + 1.10e12, rel=0.01)


def test_random_params_have_the_loaders_layout():
    cfg = llama_bench.SMALL.replace(num_layers=1, vocab_size=64)
    params = llama_bench.random_params(cfg, scan_layers=False)
    specs = registry.family(cfg).hf_tensor_specs(cfg.replace(tie_word_embeddings=False))
    assert {spec.path[-1] for spec in specs.values()} == set(params) - {"layers"} | set(
        params["layers"][0]
    )
    assert params["layers"][0]["wq"].shape == (256, 4, 64)  # [D, Hq, head_dim]
