"""Writes tiny Llama GGUF files the way llama.cpp's converter does (q/k rows permuted)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import transformers
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize

from engine.weights.gguf_file import _GLOBAL_NAMES, _LAYER_NAMES

HF_TO_GGUF = {hf: g for g, hf in _GLOBAL_NAMES.items()}
LAYER_HF_TO_GGUF = {hf: g for g, hf in _LAYER_NAMES.items()}


def tiny_llama(**overrides: object) -> torch.nn.Module:
    config = transformers.LlamaConfig(
        **{
            "vocab_size": 256,
            "hidden_size": 64,
            "intermediate_size": 96,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 128,
            "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0,
            "initializer_range": 0.3,
            **overrides,
        }
    )
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's `permute` (convert_hf_to_gguf.py) of q/k rows for its RoPE layout."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def gguf_name(hf_name: str) -> str:
    if hf_name in HF_TO_GGUF:
        return HF_TO_GGUF[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    return f"blk.{layer}.{LAYER_HF_TO_GGUF[rest]}"


def write_llama_gguf(
    path: Path,
    model: torch.nn.Module,
    qtype: GGMLQuantizationType = GGMLQuantizationType.F32,
    *,
    skip: tuple[str, ...] = (),
    override_type: dict[str, GGMLQuantizationType] | None = None,
) -> None:
    """Writes `model` as a llama GGUF; 2-D weights in `qtype`, norms in F32."""
    cfg = model.config
    writer = GGUFWriter(str(path), "llama")
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    for hf_name, tensor in model.state_dict().items():
        name = gguf_name(hf_name)
        if name in skip:
            continue
        w = tensor.float().numpy()
        if "attn_q." in name:
            w = _permute(w, cfg.num_attention_heads)
        elif "attn_k." in name:
            w = _permute(w, cfg.num_key_value_heads)
        t = (override_type or {}).get(name, qtype if w.ndim == 2 else GGMLQuantizationType.F32)
        if t == GGMLQuantizationType.F32:
            writer.add_tensor(name, np.ascontiguousarray(w))
        elif t == GGMLQuantizationType.F16:
            writer.add_tensor(name, w.astype(np.float16))
        else:
            writer.add_tensor(name, quantize(w, t), raw_shape=None, raw_dtype=t)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
