"""The Llama family as pure functions: Llama 2 and 3, Mistral, Qwen2/2.5, SmolLM2, Qwen3, and
the mixtures of experts Mixtral, Qwen3-MoE and OLMoE.

They differ only in configuration: llama3 RoPE scaling, a sliding window (Mistral), biases on
the q/k/v projections (Qwen2), tied embeddings (SmolLM2, small Qwen2), RMSNorm of q and k per
head (Qwen3) or over all heads (OLMoE, which may also clip q, k and v), and experts in place of
the MLP (`engine.models.moe`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from engine.config import ModelConfig, RopeScaling
from engine.errors import UnsupportedModelError
from engine.models import layers, lora, moe
from engine.models.layers import AttentionFn, Params
from engine.models.moe import ExpertsFn
from engine.models.quant import take_rows


def forward(
    params: Params,
    token_ids: jax.Array,  # i32[T]
    positions: jax.Array,  # i32[T]
    caches: Any,
    attention: AttentionFn,
    *,
    cfg: ModelConfig,
    experts: ExpertsFn | None = None,
) -> tuple[jax.Array, Any]:
    """Runs the decoder over T tokens; returns the final hidden states f[T, D] and caches.

    `attention` sees each layer's rotated q, k, v and that layer's entry of `caches`; it decides
    what the tokens attend to (a whole sequence, or a ragged batch over a paged cache).
    `experts` runs a mixture of experts' routed tokens (None: `moe.grouped_experts`, one device).
    """
    x = embed(params, token_ids, cfg=cfg)
    x, caches = decoder(params["layers"], x, positions, caches, attention, cfg=cfg, experts=experts)
    return final_norm(params, x, cfg=cfg), caches


def forward_routed(
    params: Params,
    token_ids: jax.Array,  # i32[T]
    positions: jax.Array,  # i32[T]
    caches: Any,
    attention: AttentionFn,
    *,
    cfg: ModelConfig,
    experts: ExpertsFn | None = None,
) -> tuple[jax.Array, Any, jax.Array]:
    """`forward` of a mixture of experts, also returning each layer's experts of each token
    i32[L, T, k] (for per-expert load metrics)."""
    x = embed(params, token_ids, cfg=cfg)
    x, caches, ids = _decoder(
        params["layers"], x, positions, caches, attention, cfg=cfg, experts=experts, routing=True
    )
    assert ids is not None  # a dense model has no routing (the registry refuses it)
    return final_norm(params, x, cfg=cfg), caches, ids


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
    experts: ExpertsFn | None = None,
) -> tuple[jax.Array, Any]:
    """The decoder layers (any contiguous run of them, per-layer or stacked) over x."""
    x, caches, _ = _decoder(
        layer_params, x, positions, caches, attention, cfg=cfg, experts=experts, routing=False
    )
    return x, caches


def _decoder(
    layer_params: list[Params] | Params,
    x: jax.Array,  # f[T, D]
    positions: jax.Array,  # i32[T]
    caches: Any,
    attention: AttentionFn,
    *,
    cfg: ModelConfig,
    experts: ExpertsFn | None,
    routing: bool,
) -> tuple[jax.Array, Any, jax.Array | None]:
    """`decoder`; with `routing`, also each layer's experts of each token i32[L, T, k]."""
    inv_freq = layers.rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)

    def layer(x: jax.Array, p: Params, cache: Any) -> tuple[jax.Array, Any]:
        with jax.named_scope("attention"):
            h = layers.rms_norm(x, p["attn_norm"], cfg.rms_norm_eps)
            q, k, v = lora.project_all_to_heads(h, p, ("wq", "wk", "wv"))
            if cfg.attention_bias:
                q, k, v = q + p["bq"], k + p["bk"], v + p["bv"]
            q, k, v = _normed_clipped_qkv(q, k, v, p, cfg)
            q = layers.apply_rope(q, positions, inv_freq)
            k = layers.apply_rope(k, positions, inv_freq)
            out, cache = attention(q, k, v, cache, sliding_window=cfg.sliding_window)
            x = x + lora.project_from_heads(out, p, "wo")
        with jax.named_scope("mlp"):
            h = layers.rms_norm(x, p["mlp_norm"], cfg.rms_norm_eps)
            if not cfg.num_experts:
                return x + lora.gated_mlp(h, p, jax.nn.silu), cache
            out, ids = moe.routed_mlp(h, p, cfg=cfg, experts=experts)
        # The routing rides along with the layer's cache, so a scan over layers stacks it.
        return x + out, ((cache, ids) if routing else cache)

    x, outs = layers.run_layers(layer, x, layer_params, caches)
    if not routing:
        return x, outs, None
    if isinstance(outs, list):  # per-layer params: a list of (cache, ids)
        return x, [cache for cache, _ in outs], jnp.stack([ids for _, ids in outs])
    caches, ids = outs  # stacked: the scan stacked both
    return x, caches, ids


def _normed_clipped_qkv(
    q: jax.Array,  # f[T, N, H]
    k: jax.Array,  # f[T, K, H]
    v: jax.Array,  # f[T, K, H]
    p: Params,
    cfg: ModelConfig,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """QK-norm (Qwen3 per head, OLMoE over all heads at once), then clipping (OLMoE)."""
    eps = cfg.rms_norm_eps
    if cfg.qk_norm == "head":
        q, k = layers.rms_norm(q, p["q_norm"], eps), layers.rms_norm(k, p["k_norm"], eps)
    elif cfg.qk_norm == "full":
        q = layers.rms_norm(q.reshape(q.shape[0], -1), p["q_norm"], eps).reshape(q.shape)
        k = layers.rms_norm(k.reshape(k.shape[0], -1), p["k_norm"], eps).reshape(k.shape)
    if cfg.clip_qkv is not None:
        c = cfg.clip_qkv
        q, k, v = jnp.clip(q, -c, c), jnp.clip(k, -c, c), jnp.clip(v, -c, c)
    return q, k, v


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
    """Reads a Hugging Face config.json of a Llama, Mistral, Qwen2/3, Mixtral, Qwen3-MoE or
    OLMoE checkpoint."""
    num_heads = hf["num_attention_heads"]
    model_type = hf.get("model_type", "llama")
    sliding_window = hf.get("sliding_window")
    if model_type in QWEN_TYPES and not hf.get("use_sliding_window", False):
        sliding_window = None
    cfg = ModelConfig(
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
        qk_norm=QK_NORM.get(model_type),
        clip_qkv=hf.get("clip_qkv"),
    )
    return cfg.replace(**_hf_experts(hf, model_type)) if model_type in MOE_TYPES else cfg


QWEN_TYPES = ("qwen2", "qwen3", "qwen3_moe")  # a sliding window only with use_sliding_window
QK_NORM = {"qwen3": "head", "qwen3_moe": "head", "olmoe": "full"}
MOE_TYPES = ("mixtral", "qwen3_moe", "olmoe")


def _hf_experts(hf: Mapping[str, Any], model_type: str) -> dict[str, Any]:
    """The ModelConfig fields of a mixture of experts; the MLP width becomes an expert's."""
    if hf.get("mlp_only_layers") or hf.get("decoder_sparse_step", 1) != 1:
        raise UnsupportedModelError(
            "mixtures of experts with dense MLP layers between the sparse ones "
            f"(mlp_only_layers={hf.get('mlp_only_layers')}, "
            f"decoder_sparse_step={hf.get('decoder_sparse_step')}) are not supported"
        )
    # transformers 5 writes Qwen3-MoE's `num_experts` as `num_local_experts`, Mixtral's name
    num_experts = hf.get("num_experts") or hf["num_local_experts"]
    if model_type == "mixtral":
        return dict(
            num_experts=num_experts,
            num_experts_per_tok=hf["num_experts_per_tok"],
            norm_topk_prob=True,
        )
    return dict(
        num_experts=num_experts,
        num_experts_per_tok=hf["num_experts_per_tok"],
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
        intermediate_size=hf.get("moe_intermediate_size") or hf["intermediate_size"],
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
    """Reads GGUF metadata (`{arch}.block_count`, ...) of a llama/qwen2/qwen3/qwen3moe model
    (Mixtral is `llama` with `expert_count`)."""
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
        qk_norm="head" if arch in ("qwen3", "qwen3moe") else None,
    ).replace(**_gguf_experts(get))


def _gguf_experts(get: Callable[..., Any]) -> dict[str, Any]:
    """The experts' fields; llama.cpp renormalises the top-k weights of qwen3moe and Mixtral
    unless the file says otherwise (`expert_weights_norm`)."""
    if not get("expert_count"):
        return {}
    return dict(
        num_experts=get("expert_count"),
        num_experts_per_tok=get("expert_used_count"),
        norm_topk_prob=bool(get("expert_weights_norm", True)),
        intermediate_size=get("expert_feed_forward_length") or get("feed_forward_length"),
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


LayerSpecs = dict[str, tuple[str, tuple[int, ...], Callable[[np.ndarray], np.ndarray]]]


def _mlp_specs(cfg: ModelConfig) -> LayerSpecs:
    d, f = cfg.hidden_size, cfg.intermediate_size
    return {
        "mlp.gate_proj.weight": ("w_gate", (f, d), np.transpose),
        "mlp.up_proj.weight": ("w_up", (f, d), np.transpose),
        "mlp.down_proj.weight": ("w_down", (d, f), np.transpose),
    }


def _expert_specs(cfg: ModelConfig) -> LayerSpecs:
    """The experts as transformers 5 holds them, fused (a checkpoint's per-expert tensors are
    stacked into these names by `engine.weights.experts`): the router [E, D] and, per expert,
    gate and up stacked [E, 2F, D] and down [E, D, F]."""
    d, f, e = cfg.hidden_size, cfg.intermediate_size, cfg.num_experts
    return {
        "mlp.gate.weight": ("router", (e, d), np.transpose),
        # [E, 2F, D] (gate rows, then up rows) -> [E, D, 2, F]; blocks' scales [E, 2F, D/32] alike
        "mlp.experts.gate_up_proj": (
            "we_gate_up", (e, 2 * f, d), lambda w: w.reshape(e, 2, f, -1).transpose(0, 3, 1, 2),
        ),
        "mlp.experts.down_proj": ("we_down", (e, d, f), lambda w: w.transpose(0, 2, 1)),
    }  # fmt: skip


def _qk_norm_specs(cfg: ModelConfig) -> LayerSpecs:
    if cfg.qk_norm is None:
        return {}
    full = cfg.qk_norm == "full"
    q_width = cfg.num_heads * cfg.head_dim if full else cfg.head_dim
    k_width = cfg.num_kv_heads * cfg.head_dim if full else cfg.head_dim
    return {
        "self_attn.q_norm.weight": ("q_norm", (q_width,), _keep),
        "self_attn.k_norm.weight": ("k_norm", (k_width,), _keep),
    }


def hf_tensor_specs(cfg: ModelConfig) -> dict[str, TensorSpec]:
    """Every tensor a checkpoint of this config must have, by its HF name."""
    d, n, k, h = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim

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
            **(_expert_specs(cfg) if cfg.num_experts else _mlp_specs(cfg)),
            **_qk_norm_specs(cfg),
        }
        if cfg.attention_bias:
            layer["self_attn.q_proj.bias"] = ("bq", (n * h,), lambda b: b.reshape(n, h))
            layer["self_attn.k_proj.bias"] = ("bk", (k * h,), lambda b: b.reshape(k, h))
            layer["self_attn.v_proj.bias"] = ("bv", (k * h,), lambda b: b.reshape(k, h))
        for name, (leaf, shape, convert) in layer.items():
            specs[pre + name] = TensorSpec(("layers", i, leaf), shape, convert)
    return specs
