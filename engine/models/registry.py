"""Maps checkpoint architecture names to a model family's pure functions."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import jax

from engine.config import ModelConfig
from engine.errors import UnsupportedModelError
from engine.models import gemma3, llama
from engine.models.layers import AttentionFn, Params
from engine.models.moe import ExpertsFn


@dataclass(frozen=True)
class ModelFamily:
    """One model family: its forward pass and how to read its checkpoints."""

    name: str
    forward: Callable[..., tuple[jax.Array, Any]]
    compute_logits: Callable[..., jax.Array]
    sm_scale: Callable[[ModelConfig], float]
    config_from_hf: Callable[..., ModelConfig]
    config_from_gguf: Callable[..., ModelConfig]
    hf_tensor_specs: Callable[[ModelConfig], dict[str, llama.TensorSpec]]
    # forward = final_norm(decoder(embed(...))), in parts: pipeline stages run decoder on
    # their slice of the layers. None: the family has no parts (no pipeline parallelism).
    embed: Callable[..., jax.Array] | None = None
    decoder: Callable[..., tuple[jax.Array, Any]] | None = None
    final_norm: Callable[..., jax.Array] | None = None
    # forward, also returning each layer's experts of each token (mixtures of experts' load
    # metrics); None: the family has no mixtures of experts.
    forward_routed: Callable[..., tuple[jax.Array, Any, jax.Array]] | None = None


LLAMA = ModelFamily(
    name="llama",
    forward=llama.forward,
    compute_logits=llama.compute_logits,
    sm_scale=llama.sm_scale,
    config_from_hf=llama.config_from_hf,
    config_from_gguf=llama.config_from_gguf,
    hf_tensor_specs=llama.hf_tensor_specs,
    embed=llama.embed,
    decoder=llama.decoder,
    final_norm=llama.final_norm,
    forward_routed=llama.forward_routed,
)

GEMMA3 = ModelFamily(
    name="gemma3",
    forward=gemma3.forward,
    compute_logits=gemma3.compute_logits,
    sm_scale=gemma3.sm_scale,
    config_from_hf=gemma3.config_from_hf,
    config_from_gguf=gemma3.config_from_gguf,
    hf_tensor_specs=gemma3.hf_tensor_specs,
)

FAMILIES = {LLAMA.name: LLAMA, GEMMA3.name: GEMMA3}

# Hugging Face `architectures[0]` -> family.
HF_ARCHITECTURES: Mapping[str, ModelFamily] = {
    "LlamaForCausalLM": LLAMA,
    "MistralForCausalLM": LLAMA,
    "Qwen2ForCausalLM": LLAMA,
    "Qwen3ForCausalLM": LLAMA,
    "Qwen3MoeForCausalLM": LLAMA,
    "MixtralForCausalLM": LLAMA,
    "OlmoeForCausalLM": LLAMA,
    "Gemma3ForCausalLM": GEMMA3,
}

# GGUF `general.architecture` -> family.
GGUF_ARCHITECTURES: Mapping[str, ModelFamily] = {
    "llama": LLAMA,
    "qwen2": LLAMA,
    "qwen3": LLAMA,
    "qwen3moe": LLAMA,
    "gemma3": GEMMA3,
}


def family_for_hf(architectures: list[str] | None) -> ModelFamily:
    name = (architectures or ["<missing>"])[0]
    if name not in HF_ARCHITECTURES:
        raise UnsupportedModelError(
            f"unsupported architecture {name!r}; supported: {', '.join(sorted(HF_ARCHITECTURES))}"
        )
    return HF_ARCHITECTURES[name]


def family_for_gguf(architecture: str) -> ModelFamily:
    if architecture not in GGUF_ARCHITECTURES:
        raise UnsupportedModelError(
            f"unsupported GGUF architecture {architecture!r}; "
            f"supported: {', '.join(sorted(GGUF_ARCHITECTURES))}"
        )
    return GGUF_ARCHITECTURES[architecture]


def family(cfg: ModelConfig) -> ModelFamily:
    return FAMILIES[cfg.architecture]


def forward(
    params: Params,
    token_ids: jax.Array,
    positions: jax.Array,
    caches: Any,
    attention: AttentionFn,
    *,
    cfg: ModelConfig,
    experts: ExpertsFn | None = None,
) -> tuple[jax.Array, Any]:
    """The forward of whichever family `cfg` names; `experts` runs a mixture of experts'
    routed tokens (a sharded `moe.grouped_experts`; None: on one device)."""
    extra = {} if experts is None else {"experts": experts}
    return family(cfg).forward(params, token_ids, positions, caches, attention, cfg=cfg, **extra)


def compute_logits(params: Params, hidden: jax.Array, *, cfg: ModelConfig) -> jax.Array:
    return family(cfg).compute_logits(params, hidden, cfg=cfg)


def forward_routed(
    params: Params,
    token_ids: jax.Array,
    positions: jax.Array,
    caches: Any,
    attention: AttentionFn,
    *,
    cfg: ModelConfig,
    experts: ExpertsFn | None = None,
) -> tuple[jax.Array, Any, jax.Array]:
    """`forward`, also returning each layer's experts of each token i32[L, T, k]: for a
    mixture of experts of a family that has `forward_routed`."""
    routed = family(cfg).forward_routed
    if routed is None or not cfg.num_experts:
        raise UnsupportedModelError(f"{cfg.architecture} models have no experts to count")
    extra = {} if experts is None else {"experts": experts}
    return routed(params, token_ids, positions, caches, attention, cfg=cfg, **extra)
