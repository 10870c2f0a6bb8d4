"""Tiny random Qwen3, Qwen3-MoE, Mixtral and OLMoE checkpoints written by transformers from
configs (2 layers, hidden 64), with the suite's byte tokenizer, for tests that compare our
forward and engine with transformers'."""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import safetensors.torch
import torch
import transformers
from gguf import GGMLQuantizationType, GGUFWriter, quants

from tests.engine.tiny_gguf import _permute, gguf_name
from tests.engine.tiny_model import EOS_ID, VOCAB_SIZE, write_byte_tokenizer

SMALL = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    initializer_range=0.3,
    bos_token_id=256,
    eos_token_id=EOS_ID,
)

CONFIGS: dict[str, Callable[..., transformers.PretrainedConfig]] = {
    "qwen3": lambda **o: transformers.Qwen3Config(**{**SMALL, "head_dim": 16, **o}),
    "qwen3-moe": lambda **o: transformers.Qwen3MoeConfig(
        **{**SMALL, "head_dim": 16, "num_experts": 8, "num_experts_per_tok": 2,
           "moe_intermediate_size": 32, "norm_topk_prob": True, **o}
    ),
    "mixtral": lambda **o: transformers.MixtralConfig(
        **{**SMALL, "intermediate_size": 32, "num_local_experts": 4, "num_experts_per_tok": 2,
           **o}
    ),
    # unnormalised top-k weights, and q, k, v clipped (at a bound the values reach)
    "olmoe": lambda **o: transformers.OlmoeConfig(
        **{**SMALL, "intermediate_size": 32, "num_experts": 8, "num_experts_per_tok": 2,
           "norm_topk_prob": False, "clip_qkv": 2.0, **o}
    ),
}  # fmt: skip
MOE_FAMILIES = ("qwen3-moe", "mixtral", "olmoe")

# The forced router of `force_router`: every token of layer 0 goes to these two experts.
FORCED_EXPERTS = (3, 5)


def build_model(name: str, **overrides: object) -> torch.nn.Module:
    """A random model with random norm weights (so that a mix-up of them shows)."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        CONFIGS[name](**overrides), attn_implementation="eager"
    )
    with torch.no_grad():
        for param_name, p in model.named_parameters():
            if param_name.endswith("norm.weight"):
                p.copy_(1.0 + 0.5 * torch.randn_like(p))
    return model.eval()


def force_router(model: torch.nn.Module) -> None:
    """Layer 0 routes every token to FORCED_EXPERTS, leaving the other experts without any:
    hidden dimension 0 is a large constant in every embedding that layer 0's attention does not
    change, its MLP norm keeps it positive, and the router reads only that dimension, with
    weights larger for the forced experts than for the rest (0)."""
    layer = model.model.layers[0]
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 10.0
        layer.self_attn.o_proj.weight[0, :] = 0.0
        layer.post_attention_layernorm.weight[0] = 1.0
        router = layer.mlp.gate.weight  # [E, D]
        router.zero_()
        router[FORCED_EXPERTS[0], 0] = 0.5
        router[FORCED_EXPERTS[1], 0] = 0.4


def write_checkpoint(model: torch.nn.Module, directory: Path, *, fused: bool = False) -> Path:
    """`save_pretrained` (per-expert tensors, as checkpoints are published) or, `fused`, the
    tensors as transformers 5 holds them in memory (experts stacked), with the byte tokenizer."""
    directory.mkdir(parents=True, exist_ok=True)
    if fused:
        model.config.save_pretrained(directory)
        tensors = {k: v.contiguous() for k, v in model.state_dict().items()}
        safetensors.torch.save_file(tensors, directory / "model.safetensors")
    else:
        model.save_pretrained(directory)
    write_byte_tokenizer(directory)
    return directory


def tensor_names(directory: Path) -> set[str]:
    """The tensor names in a checkpoint directory's safetensors files."""
    names: set[str] = set()
    for file in directory.glob("*.safetensors"):
        with open(file, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            names |= set(json.loads(f.read(size))) - {"__metadata__"}
    return names


def write_gguf(
    path: Path,
    model: torch.nn.Module,
    architecture: str,
    expert_types: Sequence[GGMLQuantizationType] = (),
) -> None:
    """`model` (Qwen3 as `qwen3`, Qwen3-MoE as `qwen3moe`, Mixtral as `llama`) as llama.cpp's
    converter writes it, in float32: all experts in one tensor per projection ([E, F, D] gate
    and up apart, [E, D, F] down), the router as `ffn_gate_inp`, q/k rows permuted under
    `llama`. `expert_types`: the experts' blocks instead, quantized by gguf-py, gate, up and
    down taking the types in turn."""
    cfg = model.config
    experts = getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", 0)
    width = getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size
    head_dim = cfg.head_dim or cfg.hidden_size // cfg.num_attention_heads
    writer = GGUFWriter(str(path), architecture)

    types = itertools.cycle(expert_types) if expert_types else None

    def add(name: str, w: np.ndarray) -> None:
        if types is None or "_exps." not in name:
            writer.add_tensor(name, np.ascontiguousarray(w))
            return
        qtype = next(types)
        writer.add_tensor(name, quants.quantize(w, qtype), raw_dtype=qtype)

    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_expert_feed_forward_length(width)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(cfg.num_experts_per_tok)
    for hf_name, tensor in model.state_dict().items():
        w = tensor.float().numpy()
        if hf_name.endswith("mlp.experts.gate_up_proj"):
            layer = hf_name.split(".")[2]
            add(f"blk.{layer}.ffn_gate_exps.weight", w[:, :width])
            add(f"blk.{layer}.ffn_up_exps.weight", w[:, width:])
            continue
        name = gguf_name(hf_name)
        if architecture == "llama" and "attn_q." in name:
            w = _permute(w, cfg.num_attention_heads)
        elif architecture == "llama" and "attn_k." in name:
            w = _permute(w, cfg.num_key_value_heads)
        add(name, w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@dataclass
class MoESetup:
    """The tiny Qwen3-MoE (transformers' model, its checkpoint) and one warmed-up engine over
    it that counts its experts' tokens, shared by the suite's MoE tests (warm-up is the slow
    part)."""

    model: torch.nn.Module
    directory: Path
    engine: Any  # LLMEngine


def moe_setup(directory: Path) -> MoESetup:
    from engine.config import CacheConfig, SchedulerConfig
    from engine.llm_engine import LLMEngine
    from engine.tokenizer import load_tokenizer
    from engine.weights import ModelFiles, load_params

    model = build_model("qwen3-moe")
    write_checkpoint(model, directory)
    cfg, params = load_params(ModelFiles(directory, is_gguf=False), dtype="float32")
    engine = LLMEngine(
        cfg,
        params,
        load_tokenizer(directory),
        cache_config=CacheConfig(page_size=4, num_pages=256),
        # Two sequences, 8 tokens a step: few step shapes to compile (each costs seconds).
        scheduler_config=SchedulerConfig(
            max_num_seqs=2, max_num_batched_tokens=8, max_model_len=64
        ),
        count_expert_tokens=True,
    )
    return MoESetup(model, directory, engine)
