"""The GGUF loader on tiny files written by the test, against transformers loading the same
file (which dequantizes with the same `gguf` package but its own name mapping and unpermute)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType as T

from engine import naive
from engine.weights import load_params, resolve_model
from tests.engine.tiny_gguf import tiny_llama, write_llama_gguf

TYPES = [T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0]


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return tiny_llama()


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_logits_match_transformers_on_same_gguf(model, qtype, tmp_path: Path) -> None:
    path = tmp_path / f"tiny-{qtype.name}.gguf"
    write_llama_gguf(path, model, qtype)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file=path.name, dtype=torch.float32
    ).eval()
    ids = np.random.default_rng(0).integers(0, 256, (2, 16), dtype=np.int32)
    with torch.no_grad():
        expected = hf(torch.from_numpy(ids).long()).logits.numpy()
    cfg, params = load_params(resolve_model(str(path)))
    got = np.asarray(naive.sequence_logits(params, ids, cfg=cfg))
    np.testing.assert_allclose(got, expected, atol=1e-4, rtol=0)


def test_quantized_weights_are_close_to_the_float_originals(model, tmp_path: Path) -> None:
    """The oracle here is the float model itself: Q8_0 keeps ~1% of each block's range."""
    path = tmp_path / "tiny-q8.gguf"
    write_llama_gguf(path, model, T.Q8_0)
    _, params = load_params(resolve_model(str(path)))
    original = model.state_dict()["model.layers.0.self_attn.q_proj.weight"].numpy()
    ours = np.asarray(params["layers"][0]["wq"]).reshape(64, 64).T  # [d, n*h] -> HF [n*h, d]
    scale = np.abs(original).max(axis=1, keepdims=True)
    assert np.all(np.abs(ours - original) <= scale / 127 + 1e-6)
