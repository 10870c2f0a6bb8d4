"""The Llama family as pure functions: Llama 2 and 3, Mistral, Qwen2/2.5, SmolLM2.

They differ only in configuration: llama3 RoPE scaling, a sliding window (Mistral), biases on
the q/k/v projections (Qwen2) and tied embeddings (SmolLM2, small Qwen2).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from engine.config import ModelConfig, RopeScaling
from engine.errors import UnsupportedModelError
from engine.models import layers, lora
from engine.models.layers import AttentionFn, Params
from engine.models.quant import take_rows


def forward(
    params: Params,
    token_ids: jax.Array,  # i32[T]
    positions: jax.Array,  # i32[T]
    caches: Any,
    attention: AttentionFn,
    *,
    cfg: ModelConfig,
) -> tuple[jax.Array, Any]:
    """Runs the decoder over T tokens; returns the final hidden states f[T, D] and caches.

    `attention` sees each layer's rotated q, k, v and that layer's entry of `caches`; it decides
    what the tokens attend to (a whole sequence, or a ragged batch over a paged cache).
    """
    x = embed(params, token_ids, cfg=cfg)
    x, caches = decoder(params["layers"], x, positions, caches, attention, cfg=cfg)
    return final_norm(params, x, cfg=cfg), caches


def embed(params: Params, token_ids: jax.Array, *, cfg: ModelConfig) -> jax.Array:
    """i32[T] -> f[T, D]."""
    return take_rows(params["embed"], token_ids)


def decoder(
    layer_params: list[Params] | Params,
    x: jax.Array,  # f[T, D]
    positions: jax.Array,  # i32[T]
    caches: Any,
    attention: AttentionFn,
    *,
    cfg: ModelConfig,
) -> tuple[jax.Array, Any]:
    """The decoder layers (any contiguous run of them, per-layer or stacked) over x."""
    inv_freq = layers.rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)

    def layer(x: jax.Array, p: Params, cache: Any) -> tuple[jax.Array, Any]:
        with jax.named_scope("attention"):
            h = layers.rms_norm(x, p["attn_norm"], cfg.rms_norm_eps)
            q = lora.project_to_heads(h, p, "wq")
            k = lora.project_to_heads(h, p, "wk")
            v = lora.project_to_heads(h, p, "wv")
            if cfg.attention_bias:
                q, k, v = q + p["bq"], k + p["bk"], v + p["bv"]
            q = layers.apply_rope(q, positions, inv_freq)
            k = layers.apply_rope(k, positions, inv_freq)
            out, cache = attention(q, k, v, cache, sliding_window=cfg.sliding_window)
            x = x + lora.project_from_heads(out, p, "wo")
        with jax.named_scope("mlp"):
            h = layers.rms_norm(x, p["mlp_norm"], cfg.rms_norm_eps)
            x = x + lora.gated_mlp(h, p, jax.nn.silu)
        return x, cache

    return layers.run_layers(layer, x, layer_params, caches)


def final_norm(params: Params, x: jax.Array, *, cfg: ModelConfig) -> jax.Array:
    return layers.rms_norm(x, params["final_norm"], cfg.rms_norm_eps)


def compute_logits(params: Params, hidden: jax.Array, *, cfg: ModelConfig) -> jax.Array:
    """f[T, D] -> f32[T, V]; the embedding doubles as the output layer when tied."""
    unembed = params["embed"] if cfg.tie_word_embeddings else params["lm_head"]
    return layers.unembed(hidden, unembed)


def sm_scale(cfg: ModelConfig) -> float:
    return float(cfg.head_dim) ** -0.5


# ---- configuration from checkpoints --------------------------------------------------------


def config_from_hf(hf: Mapping[str, Any], *, dtype: str) -> ModelConfig:
    """Reads a Hugging Face config.json of a Llama, Mistral or Qwen2 checkpoint."""
    num_heads = hf["num_attention_heads"]
    model_type = hf.get("model_type", "llama")
    sliding_window = hf.get("sliding_window")
    if model_type == "qwen2" and not hf.get("use_sliding_window", False):
        sliding_window = None
    return ModelConfig(
        architecture="llama",
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=hf.get("num_key_value_heads") or num_heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=_hf_rope_theta(hf),
        rope_scaling=_hf_rope_scaling(hf),
        max_position_embeddings=hf.get("max_position_embeddings", 4096),
        tie_word_embeddings=hf.get("tie_word_embeddings", False),
        attention_bias=hf.get("attention_bias", model_type == "qwen2"),
        sliding_window=sliding_window,
        dtype=dtype,
    )


def _hf_rope_params(hf: Mapping[str, Any]) -> Mapping[str, Any]:
    # transformers 5 writes `rope_parameters`; older checkpoints `rope_theta` + `rope_scaling`.
    return hf.get("rope_parameters") or hf.get("rope_scaling") or {}


def _hf_rope_theta(hf: Mapping[str, Any]) -> float:
    return float(_hf_rope_params(hf).get("rope_theta", hf.get("rope_theta", 10000.0)))


def _hf_rope_scaling(hf: Mapping[str, Any]) -> RopeScaling | None:
    rope = _hf_rope_params(hf)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "default":
        return None
    if rope_type not in ("llama3", "linear"):
        raise UnsupportedModelError(f"unsupported RoPE scaling type {rope_type!r}")
    optional = ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    return RopeScaling(
        rope_type=rope_type,
        factor=float(rope["factor"]),
        **{name: rope[name] for name in optional if name in rope},
    )


def config_from_gguf(meta: Mapping[str, Any], *, dtype: str) -> ModelConfig:
    """Reads GGUF metadata (`{arch}.block_count`, ...) of a llama/qwen2 model."""
    arch = meta["general.architecture"]

    def get(key: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{key}", default)

    hidden, num_heads = get("embedding_length"), get("attention.head_count")
    vocab = get("vocab_size") or len(meta["tokenizer.ggml.tokens"])
    scaling = None
    if get("rope.scaling.type") == "linear":
        scaling = RopeScaling(rope_type="linear", factor=float(get("rope.scaling.factor")))
    return ModelConfig(
        architecture="llama",
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=get("feed_forward_length"),
        num_layers=get("block_count"),
        num_heads=num_heads,
        num_kv_heads=get("attention.head_count_kv") or num_heads,
        head_dim=get("attention.key_length") or hidden // num_heads,
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        max_position_embeddings=get("context_length", 4096),
        tie_word_embeddings=False,  # set by the loader from the presence of output.weight
        attention_bias=arch == "qwen2",
        sliding_window=None,
        dtype=dtype,
    )


# ---- checkpoint tensor names -> parameter pytree ----------------------------------------------


@dataclass(frozen=True)
class TensorSpec:
    """Where one checkpoint tensor goes: `path` in the pytree, its shape in the checkpoint
    (HF orientation: linear weights are [out, in]) and how to convert it."""

    path: tuple[str | int, ...]
    shape: tuple[int, ...]
    convert: Callable[[np.ndarray], np.ndarray]


def _keep(w: np.ndarray) -> np.ndarray:
    return w


def hf_tensor_specs(cfg: ModelConfig) -> dict[str, TensorSpec]:
    """Every tensor a checkpoint of this config must have, by its HF name."""
    d, f, n, k, h = (
        cfg.hidden_size,
        cfg.intermediate_size,
        cfg.num_heads,
        cfg.num_kv_heads,
        cfg.head_dim,
    )

    def heads_in(num: int) -> Callable[[np.ndarray], np.ndarray]:
        # [num*h, d] -> [d, num, h]; -1, not d: the same layout change applies to group scales
        return lambda w: w.T.reshape(-1, num, h)

    specs = {
        "model.embed_tokens.weight": TensorSpec(("embed",), (cfg.vocab_size, d), _keep),
        "model.norm.weight": TensorSpec(("final_norm",), (d,), _keep),
    }
    if not cfg.tie_word_embeddings:
        specs["lm_head.weight"] = TensorSpec(("lm_head",), (cfg.vocab_size, d), _keep)
    for i in range(cfg.num_layers):
        pre = f"model.layers.{i}."
        layer: dict[str, tuple[str, tuple[int, ...], Callable[[np.ndarray], np.ndarray]]] = {
            "input_layernorm.weight": ("attn_norm", (d,), _keep),
            "post_attention_layernorm.weight": ("mlp_norm", (d,), _keep),
            "self_attn.q_proj.weight": ("wq", (n * h, d), heads_in(n)),
            "self_attn.k_proj.weight": ("wk", (k * h, d), heads_in(k)),
            "self_attn.v_proj.weight": ("wv", (k * h, d), heads_in(k)),
            "self_attn.o_proj.weight": ("wo", (d, n * h), lambda w: w.T.reshape(n, -1, d)),
            "mlp.gate_proj.weight": ("w_gate", (f, d), np.transpose),
            "mlp.up_proj.weight": ("w_up", (f, d), np.transpose),
            "mlp.down_proj.weight": ("w_down", (d, f), np.transpose),
        }
        if cfg.attention_bias:
            layer["self_attn.q_proj.bias"] = ("bq", (n * h,), lambda b: b.reshape(n, h))
            layer["self_attn.k_proj.bias"] = ("bk", (k * h,), lambda b: b.reshape(k, h))
            layer["self_attn.v_proj.bias"] = ("bv", (k * h,), lambda b: b.reshape(k, h))
        for name, (leaf, shape, convert) in layer.items():
            specs[pre + name] = TensorSpec(("layers", i, leaf), shape, convert)
    return specs
