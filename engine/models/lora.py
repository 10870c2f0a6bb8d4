"""LoRA adapters inside a batch: each token's projections gain its adapter's low-rank product.

Adapters live in device slots. For each adapted projection `name` of a layer (`wq`, `wk`, `wv`,
`wo`, `w_gate`, `w_up`, `w_down`) the layer's params hold, next to the base weight,
`{name}_lora_a` f[G, In..., R] and `{name}_lora_b` f[G, R, Out...]: G = max_loras + 1 slots,
R = max_lora_rank (smaller adapters are zero-padded), the adapter's scaling folded into B, slot
0 all zeros (the base model). A's input axes and B's output axes are the base weight's, so a
sharding layout splits them as it splits the base weight (sharding/rules.py). Each token's slot
reaches the layers as a one-hot row `lora_mask` f[T, G], attached per step by `attach`.

The product (`delta`): x @ A for all G slots at once, as one matmul of width G*R; the rows are
masked to each token's slot; then one matmul against B flattened to [G*R, Out]. That costs
G*R*(In + Out) multiply-adds per token whichever slots the batch uses, and no sort or gather.
`lax.ragged_dot` over tokens sorted by slot does the same work on XLA:CPU (its fallback masks
the tokens per group, expanding x to [G, T, In]); bench/lora.py --kernels measures both.

Shapes: T tokens, G slots, R rank, In / Out the projection's flattened input / output widths.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from engine.models import layers
from engine.models.layers import Params

TARGETS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
MASK = "lora_mask"


def a_name(target: str) -> str:
    return f"{target}_lora_a"


def b_name(target: str) -> str:
    return f"{target}_lora_b"


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class LoRAInputs:
    """What a step needs for adapters: the slots' weights and each token's slot."""

    weights: Any  # per layer {a_name(t): f[G, In..., R], b_name(t): f[G, R, Out...]}, or stacked
    slots: Any  # i32[T]; 0 (the base model) for padding


def attach(layer_params: list[Params] | Params, lora: LoRAInputs) -> list[Params] | Params:
    """The layers' params with their adapter weights and the tokens' slot mask added, for the
    projections below (per-layer list, or stacked with a leading layer axis)."""
    weights = lora.weights
    if isinstance(layer_params, list):
        num_slots = weights[0][a_name("wq")].shape[0]
        mask = jax.nn.one_hot(lora.slots, num_slots, dtype=jnp.float32)  # f32[T, G]
        return [{**p, **w, MASK: mask} for p, w in zip(layer_params, weights, strict=True)]
    num_layers, num_slots = weights[a_name("wq")].shape[:2]
    mask = jax.nn.one_hot(lora.slots, num_slots, dtype=jnp.float32)
    return {**layer_params, **weights, MASK: jnp.broadcast_to(mask, (num_layers, *mask.shape))}


def delta(x: jax.Array, p: Params, target: str) -> jax.Array:
    """f[T, In] -> f[T, Out]: each token's adapter product (scaling included) for `target`."""
    a, b = p[a_name(target)], p[b_name(target)]
    num_slots, rank = a.shape[0], a.shape[-1]
    a = a.reshape(num_slots, -1, rank)  # [G, In, R]
    u = jnp.einsum("TI,GIR->TGR", x.astype(a.dtype), a, preferred_element_type=jnp.float32)
    u = u * p[MASK][:, :, None]  # only the token's own slot
    b = b.reshape(num_slots, rank, -1)  # [G, R, Out]
    out = jnp.einsum("TGR,GRO->TO", u.astype(b.dtype), b, preferred_element_type=jnp.float32)
    return out.astype(x.dtype)


def _adapted(p: Params, target: str) -> bool:
    return a_name(target) in p


def project_all_to_heads(x: jax.Array, p: Params, targets: Sequence[str]) -> list[jax.Array]:
    """`layers.project_all_to_heads` with the adapters' products (q, k and v)."""
    outs = layers.project_all_to_heads(x, [p[target] for target in targets])
    return [
        out + delta(x, p, target).reshape(out.shape) if _adapted(p, target) else out
        for out, target in zip(outs, targets, strict=True)
    ]


def project_from_heads(x: jax.Array, p: Params, target: str) -> jax.Array:
    """`layers.project_from_heads` with the adapters' products: f[T, N, H] -> f[T, D]."""
    out = layers.project_from_heads(x, p[target])
    if not _adapted(p, target):
        return out
    return out + delta(x.reshape(x.shape[0], -1), p, target)


def dense(x: jax.Array, p: Params, target: str) -> jax.Array:
    """`layers.dense` with the adapters' products: f[T, In] -> f[T, Out]."""
    return _plus_delta(layers.dense(x, p[target]), x, p, target)


def _plus_delta(out: jax.Array, x: jax.Array, p: Params, target: str) -> jax.Array:
    return out + delta(x, p, target) if _adapted(p, target) else out


def gated_mlp(x: jax.Array, p: Params, activation: Callable[[jax.Array], jax.Array]) -> jax.Array:
    """`layers.gated_mlp` with the adapters' products on gate, up and down."""
    gate, up = layers.dense_all(x, (p["w_gate"], p["w_up"]))
    gate, up = _plus_delta(gate, x, p, "w_gate"), _plus_delta(up, x, p, "w_up")
    return dense(activation(gate) * up, p, "w_down")
