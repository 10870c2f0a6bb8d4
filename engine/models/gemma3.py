"""Gemma 3 (text) as pure functions.

What sets it apart from the Llama family: local (sliding-window) layers interleaved with global
ones (five to one), each kind with its own RoPE base; RMSNorm of q and k per head; RMSNorm
weights stored as `w` and applied as `1 + w`; a norm after attention and after the MLP as well
as before; GeGLU (tanh-approximated gelu); the embedding scaled by sqrt(hidden_size); the
softmax scale from `query_pre_attn_scalar`; the output layer tied to the embedding.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from engine.config import ModelConfig, RopeScaling
from engine.errors import UnsupportedModelError
from engine.models import layers, llama
from engine.models.layers import AttentionFn, Params
from engine.models.llama import TensorSpec
from engine.models.quant import take_rows

DEFAULT_GLOBAL_THETA = 1_000_000.0
DEFAULT_LOCAL_THETA = 10_000.0
DEFAULT_SLIDING_PATTERN = 6  # every sixth layer is global


def _gelu_tanh(x: jax.Array) -> jax.Array:
    return jax.nn.gelu(x, approximate=True)


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

    Each layer hands `attention` its own window: `cfg.sliding_window` for a local layer, None
    for a global one.
    """
    eps = cfg.rms_norm_eps
    global_freq = layers.rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    local_theta = cfg.local_rope_theta or DEFAULT_LOCAL_THETA
    local_freq = layers.rope_inv_freq(cfg.head_dim, local_theta, None)

    def norm(x: jax.Array, w: jax.Array) -> jax.Array:
        return layers.rms_norm(x, w, eps, offset=1.0)

    def layer(x: jax.Array, p: Params, cache: Any, *, variant: bool) -> tuple[jax.Array, Any]:
        window = cfg.sliding_window if variant else None
        inv_freq = local_freq if variant else global_freq
        with jax.named_scope("attention"):
            h = norm(x, p["attn_norm"])
            q, k, v = layers.project_all_to_heads(h, (p["wq"], p["wk"], p["wv"]))
            q, k = norm(q, p["q_norm"]), norm(k, p["k_norm"])  # f[T, N, H], f[T, K, H]
            q = layers.apply_rope(q, positions, inv_freq)
            k = layers.apply_rope(k, positions, inv_freq)
            out, cache = attention(q, k, v, cache, sliding_window=window)
            x = x + norm(layers.project_from_heads(out, p["wo"]), p["post_attn_norm"])
        with jax.named_scope("mlp"):
            h = norm(x, p["mlp_norm"])
            x = x + norm(layers.gated_mlp(h, p, _gelu_tanh), p["post_mlp_norm"])
        return x, cache

    x = take_rows(params["embed"], token_ids)
    # As transformers does: the scale is rounded to the embedding's dtype first.
    x = x * jnp.asarray(cfg.hidden_size**0.5, x.dtype)
    x, caches = layers.run_layers(layer, x, params["layers"], caches, variants=_sliding_layers(cfg))
    return norm(x, params["final_norm"]), caches


def _sliding_layers(cfg: ModelConfig) -> tuple[bool, ...]:
    if cfg.sliding_layers is None:
        return (cfg.sliding_window is not None,) * cfg.num_layers
    return tuple(s and cfg.sliding_window is not None for s in cfg.sliding_layers)


def compute_logits(params: Params, hidden: jax.Array, *, cfg: ModelConfig) -> jax.Array:
    """f[T, D] -> f32[T, V] through the tied embedding, soft-capped if the config says so."""
    logits = layers.unembed(hidden, params["embed"])
    if cfg.final_logit_softcap is not None:
        cap = cfg.final_logit_softcap
        logits = cap * jnp.tanh(logits / cap)
    return logits


def sm_scale(cfg: ModelConfig) -> float:
    return float(cfg.query_pre_attn_scalar or cfg.head_dim) ** -0.5


# ---- configuration from checkpoints --------------------------------------------------------


def default_sliding_layers(num_layers: int, pattern: int = DEFAULT_SLIDING_PATTERN) -> tuple:
    """Local layers except every `pattern`-th (transformers' and llama.cpp's default)."""
    return tuple(bool((i + 1) % pattern) for i in range(num_layers))


def config_from_hf(hf: Mapping[str, Any], *, dtype: str) -> ModelConfig:
    """Reads a Hugging Face config.json of a `Gemma3ForCausalLM` (gemma3_text) checkpoint."""
    for flag in ("attn_logit_softcapping", "use_bidirectional_attention"):
        if hf.get(flag):
            raise UnsupportedModelError(f"Gemma 3 with {flag}={hf[flag]!r} is not supported")
    if hf.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
        raise UnsupportedModelError(f"Gemma 3 activation {hf['hidden_activation']!r}")
    num_layers = hf["num_hidden_layers"]
    layer_types = hf.get("layer_types")
    if layer_types is None:
        sliding = default_sliding_layers(num_layers, hf.get("sliding_window_pattern", 6))
    else:
        sliding = tuple(kind == "sliding_attention" for kind in layer_types)
    rope = hf.get("rope_parameters") or {}
    full, local = rope.get("full_attention") or {}, rope.get("sliding_attention") or {}
    scaling = llama._hf_rope_scaling({"rope_scaling": full or hf.get("rope_scaling") or {}})
    return ModelConfig(
        architecture="gemma3",
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_layers=num_layers,
        num_heads=hf["num_attention_heads"],
        num_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
        head_dim=hf.get("head_dim", 256),
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=float(full.get("rope_theta", hf.get("rope_theta", DEFAULT_GLOBAL_THETA))),
        rope_scaling=scaling,
        max_position_embeddings=hf.get("max_position_embeddings", 131072),
        tie_word_embeddings=True,
        sliding_window=hf.get("sliding_window"),
        dtype=dtype,
        sliding_layers=sliding,
        local_rope_theta=float(
            local.get("rope_theta", hf.get("rope_local_base_freq", DEFAULT_LOCAL_THETA))
        ),
        query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar", 256)),
        final_logit_softcap=hf.get("final_logit_softcapping"),
    )


def config_from_gguf(meta: Mapping[str, Any], *, dtype: str) -> ModelConfig:
    """Reads GGUF metadata of a `gemma3` model. What the file does not say (the local/global
    pattern, the local RoPE base) is fixed for Gemma 3, as llama.cpp and transformers assume."""

    def get(key: str, default: Any = None) -> Any:
        return meta.get(f"gemma3.{key}", default)

    hidden, num_heads, num_layers = (
        get("embedding_length"),
        get("attention.head_count"),
        get("block_count"),
    )
    head_dim = get("attention.key_length") or hidden // num_heads
    scaling = None
    if get("rope.scaling.type") == "linear":
        scaling = RopeScaling(rope_type="linear", factor=float(get("rope.scaling.factor")))
    return ModelConfig(
        architecture="gemma3",
        vocab_size=get("vocab_size") or len(meta["tokenizer.ggml.tokens"]),
        hidden_size=hidden,
        intermediate_size=get("feed_forward_length"),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=get("attention.head_count_kv") or num_heads,
        head_dim=head_dim,
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(get("rope.freq_base", DEFAULT_GLOBAL_THETA)),
        rope_scaling=scaling,
        max_position_embeddings=get("context_length", 131072),
        tie_word_embeddings=True,
        sliding_window=get("attention.sliding_window"),
        dtype=dtype,
        sliding_layers=default_sliding_layers(num_layers),
        local_rope_theta=DEFAULT_LOCAL_THETA,
        query_pre_attn_scalar=float(head_dim),
    )


# ---- checkpoint tensor names -> parameter pytree ----------------------------------------------


def _keep(w: np.ndarray) -> np.ndarray:
    return w


def hf_tensor_specs(cfg: ModelConfig) -> dict[str, TensorSpec]:
    """Every tensor a Gemma 3 checkpoint must have, by its HF name."""
    d, f, n, k, h = (
        cfg.hidden_size,
        cfg.intermediate_size,
        cfg.num_heads,
        cfg.num_kv_heads,
        cfg.head_dim,
    )

    def heads_in(num: int) -> Callable[[np.ndarray], np.ndarray]:
        return lambda w: w.T.reshape(d, num, h)  # [num*h, d] -> [d, num, h]

    specs = {
        "model.embed_tokens.weight": TensorSpec(("embed",), (cfg.vocab_size, d), _keep),
        "model.norm.weight": TensorSpec(("final_norm",), (d,), _keep),
    }
    for i in range(cfg.num_layers):
        layer: dict[str, tuple[str, tuple[int, ...], Callable[[np.ndarray], np.ndarray]]] = {
            "input_layernorm.weight": ("attn_norm", (d,), _keep),
            "post_attention_layernorm.weight": ("post_attn_norm", (d,), _keep),
            "pre_feedforward_layernorm.weight": ("mlp_norm", (d,), _keep),
            "post_feedforward_layernorm.weight": ("post_mlp_norm", (d,), _keep),
            "self_attn.q_norm.weight": ("q_norm", (h,), _keep),
            "self_attn.k_norm.weight": ("k_norm", (h,), _keep),
            "self_attn.q_proj.weight": ("wq", (n * h, d), heads_in(n)),
            "self_attn.k_proj.weight": ("wk", (k * h, d), heads_in(k)),
            "self_attn.v_proj.weight": ("wv", (k * h, d), heads_in(k)),
            "self_attn.o_proj.weight": ("wo", (d, n * h), lambda w: w.T.reshape(n, h, d)),
            "mlp.gate_proj.weight": ("w_gate", (f, d), np.transpose),
            "mlp.up_proj.weight": ("w_up", (f, d), np.transpose),
            "mlp.down_proj.weight": ("w_down", (d, f), np.transpose),
        }
        for name, (leaf, shape, convert) in layer.items():
            specs[f"model.layers.{i}.{name}"] = TensorSpec(("layers", i, leaf), shape, convert)
    return specs
