"""The mixture-of-experts MLP as pure functions: route each token to its top-k experts, run the
token-expert pairs through the experts as grouped matmuls, and combine the results.

Every shape is static per bucket: T tokens make T*k pairs whatever the routing, so nothing
compiles after warm-up however unbalanced the experts' loads are. Three ways to run the pairs
(`IMPLS`), picked by size and platform unless asked for:
- "sorted": the pairs sorted by expert, so each expert's rows are contiguous and one
  `jax.lax.ragged_dot` runs all experts (a grouped matmul); TPU and GPU have kernels for it.
- "gathered": each pair's expert weights gathered; with fewer pairs than experts (decode of a
  few sequences) this reads only the experts in use.
- "dense": every expert on every token, weighted by a [T, E] matrix that is zero off the chosen
  experts. XLA:CPU lowers ragged_dot as a masked product of every group with every row, k times
  this work, so on CPU this is the grouped product (bench/moe.py measures the three).

Quantized expert weights (`QuantizedWeight`, int8 or int4 along each expert's input axis) stay
integers in memory: the gathered path dequantizes only the experts it gathers, the others the
whole tensor inside the step.

Expert parallelism: `grouped_experts` computes the pairs of a contiguous range of experts (its
weights' first axis, starting at `first_expert`) and leaves the others' contributions zero, so
a shard of experts sums to its part of the output; `sharding.rules.ShardingPlan.shard_experts`
runs it per shard and sums the parts (or, with the all-to-all dispatch of sharding/experts.py,
runs it over the rows each shard received). The model itself contains no parallelism.

Shapes: T tokens, D model width, E experts (E_local on one shard), k experts per token,
F an expert's MLP width, M = T*k token-expert pairs.
"""

from __future__ import annotations

from typing import Any, Protocol

import jax
import jax.numpy as jnp

from engine.config import ModelConfig
from engine.models import layers
from engine.models.layers import Params
from engine.models.quant import QuantizedWeight, dequantize, sliced


class ExpertsFn(Protocol):
    """experts(x f[T, D], weights f32[T, k], ids i32[T, k], we_gate_up f[E, D, 2, F],
    we_down f[E, F, D]) -> f[T, D]: the weighted sum of each token's experts' outputs."""

    def __call__(
        self, x: jax.Array, weights: jax.Array, ids: jax.Array, we_gate_up: Any, we_down: Any, /
    ) -> jax.Array: ...


def route(
    x: jax.Array,  # f[T, D]
    router: jax.Array,  # f[D, E]
    *,
    top_k: int,
    normalize: bool,
) -> tuple[jax.Array, jax.Array]:
    """Each token's top-k experts i32[T, k] and their weights f32[T, k]: the softmax over all
    experts' router logits (float32), cut to the top k and, with `normalize`, rescaled to sum to
    1 (Mixtral always; Qwen3-MoE and OLMoE as their `norm_topk_prob` says)."""
    logits = layers.dense(x, router).astype(jnp.float32)  # f32[T, E]
    probs = jax.nn.softmax(logits, axis=-1)
    weights, ids = jax.lax.top_k(probs, top_k)
    if normalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, ids.astype(jnp.int32)


def moe_mlp(
    x: jax.Array,  # f[T, D]
    p: Params,
    *,
    cfg: ModelConfig,
    experts: ExpertsFn | None = None,
) -> jax.Array:
    """The MoE MLP of one layer: route, then the experts (`grouped_experts` on one device, or
    a sharded version of it). f[T, D] -> f[T, D]."""
    return routed_mlp(x, p, cfg=cfg, experts=experts)[0]


def routed_mlp(
    x: jax.Array,  # f[T, D]
    p: Params,
    *,
    cfg: ModelConfig,
    experts: ExpertsFn | None = None,
) -> tuple[jax.Array, jax.Array]:
    """`moe_mlp`'s output f[T, D] and each token's experts i32[T, k] (for load metrics)."""
    weights, ids = route(
        x, p["router"], top_k=cfg.num_experts_per_tok, normalize=cfg.norm_topk_prob
    )
    run = grouped_experts if experts is None else experts
    return run(x, weights, ids, p["we_gate_up"], p["we_down"]), ids


def count_tokens(
    ids: jax.Array,  # i32[L, T, k]: each layer's experts of each token
    num_tokens: jax.Array,  # i32[]: the first num_tokens of the T are real, the rest padding
    num_experts: int,
) -> jax.Array:
    """Tokens routed to each expert of each layer, i32[L, E] (a token counts once for each of
    its k experts, so a layer's row sums to k * num_tokens); padding tokens are not counted."""
    num_layers, t, _ = ids.shape
    real = (jnp.arange(t) < num_tokens)[None, :, None]  # bool[1, T, 1]
    ids = jnp.where(real, ids, num_experts).reshape(num_layers, -1)  # padding: one past the end
    counts = jax.vmap(lambda row: jnp.bincount(row, length=num_experts + 1))(ids)
    return counts[:, :num_experts].astype(jnp.int32)


def grouped_experts(
    x: jax.Array,  # f[T, D]
    weights: jax.Array,  # f32[T, k]
    ids: jax.Array,  # i32[T, k]
    we_gate_up: Any,  # f[E_local, D, 2, F], or a QuantizedWeight of that shape
    we_down: Any,  # f[E_local, F, D], or a QuantizedWeight
    first_expert: jax.Array | int = 0,
    *,
    impl: str | None = None,
) -> jax.Array:
    """sum_j weights[t, j] * expert_{ids[t, j]}(x[t]) over the pairs whose expert is one of
    the E_local held here (first_expert ..); the other pairs contribute zero. f[T, D].

    `impl`: one of IMPLS, or None: "gathered" for fewer pairs than experts, else "sorted"
    ("dense" on CPU)."""
    num_tokens, top_k = ids.shape
    num_local = we_down.shape[0]
    local = ids.reshape(-1) - first_expert  # i32[M]
    held = (local >= 0) & (local < num_local)
    local = jnp.where(held, local, num_local)  # pairs of other shards' experts sort last
    pair_weights = jnp.where(held, weights.reshape(-1), 0.0)  # f32[M]
    if impl is None and num_tokens * top_k < num_local:
        impl = "gathered"
    if impl == "dense":
        return _dense_swiglu(x, local, pair_weights, we_gate_up, we_down)
    if impl == "gathered":
        out = _gathered_swiglu(x[jnp.arange(local.shape[0]) // top_k], local, we_gate_up, we_down)
    elif impl == "sorted":
        out = _sorted_swiglu(x, local, top_k, we_gate_up, we_down)  # f32[M, D]
    elif impl is None:

        def dense() -> jax.Array:
            return _dense_swiglu(x, local, pair_weights, we_gate_up, we_down)

        def grouped() -> jax.Array:
            return grouped_experts(
                x, weights, ids, we_gate_up, we_down, first_expert, impl="sorted"
            )

        return jax.lax.platform_dependent(cpu=dense, default=grouped)
    else:
        raise ValueError(f"impl must be one of {IMPLS} or None, got {impl!r}")
    out = jnp.where(held[:, None], out, 0.0) * pair_weights[:, None]
    return jnp.sum(out.reshape(num_tokens, top_k, -1), axis=1).astype(x.dtype)


IMPLS = ("sorted", "gathered", "dense")


def _dense_swiglu(
    x: jax.Array,  # f[T, D]
    local: jax.Array,  # i32[M]; E_local for a pair held elsewhere
    pair_weights: jax.Array,  # f32[M]; 0 for a pair held elsewhere
    we_gate_up: Any,  # f[E_local, D, 2, F] (or quantized)
    we_down: Any,  # f[E_local, F, D] (or quantized)
) -> jax.Array:
    """Every held expert on every token, combined with each token's weight for it. f[T, D]"""
    num_tokens = x.shape[0]
    num_local = we_down.shape[0]
    we_gate_up, we_down = _float(we_gate_up), _float(we_down)
    token = jnp.arange(local.shape[0]) // (local.shape[0] // num_tokens)  # i32[M]
    combine = jnp.zeros((num_tokens, num_local + 1), jnp.float32)
    combine = combine.at[token, local].add(pair_weights)[:, :num_local]  # f32[T, E_local]
    dim, width = we_down.shape[2], we_down.shape[1]
    rows = x.astype(we_gate_up.dtype)

    def expert(weights: tuple[jax.Array, jax.Array]) -> jax.Array:
        # One expert as plain 2-D products: XLA:CPU ran the batched einsum over all experts
        # ~3x slower (8 experts, d 512, 16 tokens; bench/moe.py).
        gate_up, down = weights
        h = jnp.dot(rows, gate_up.reshape(dim, 2 * width), preferred_element_type=jnp.float32)
        hidden = (jax.nn.silu(h[:, :width]) * h[:, width:]).astype(down.dtype)
        return jnp.dot(hidden, down, preferred_element_type=jnp.float32)  # f32[T, D]

    out = jax.lax.map(expert, (we_gate_up, we_down))  # f32[E_local, T, D]
    return jnp.einsum("ETD,TE->TD", out, combine).astype(x.dtype)


def _sorted_swiglu(
    x: jax.Array,  # f[T, D]
    local: jax.Array,  # i32[M]; E_local for a pair held elsewhere
    top_k: int,
    we_gate_up: Any,  # f[E_local, D, 2, F] (or quantized)
    we_down: Any,  # f[E_local, F, D] (or quantized)
) -> jax.Array:
    """Every pair's expert output f32[M, D] (in pair order), computed with the pairs sorted by
    expert so that each expert is one group of a ragged matmul."""
    num_local, dim, _, width = we_gate_up.shape
    we_gate_up, we_down = _float(we_gate_up), _float(we_down)
    order = jnp.argsort(local, stable=True)  # i32[M]: sorted position -> pair
    rows = x[order // top_k]  # f[M, D]: the tokens, grouped by expert
    group_sizes = jnp.bincount(local, length=num_local + 1)[:num_local].astype(jnp.int32)
    gate_up = jax.lax.ragged_dot(
        rows, we_gate_up.reshape(num_local, dim, 2 * width), group_sizes,
        preferred_element_type=jnp.float32,
    ).reshape(-1, 2, width)  # fmt: skip
    hidden = (jax.nn.silu(gate_up[:, 0]) * gate_up[:, 1]).astype(we_down.dtype)
    out = jax.lax.ragged_dot(hidden, we_down, group_sizes, preferred_element_type=jnp.float32)
    # Rows past the last group (pairs held elsewhere) are not computed: zero them, then unsort.
    out = jnp.where((jnp.arange(out.shape[0]) < jnp.sum(group_sizes))[:, None], out, 0.0)
    return jnp.zeros_like(out).at[order].set(out)


def _gathered_swiglu(
    rows: jax.Array,  # f[M, D]: each pair's token
    local: jax.Array,  # i32[M]; E_local for a pair held elsewhere
    we_gate_up: Any,  # f[E_local, D, 2, F] (or quantized)
    we_down: Any,  # f[E_local, F, D] (or quantized)
) -> jax.Array:
    """Every pair's expert output f32[M, D], each pair's expert weights gathered: fewer pairs
    than experts read fewer weights this way than any grouped product of all experts."""
    expert = jnp.minimum(local, we_down.shape[0] - 1)  # a held-elsewhere pair's output is dropped
    pair_gate_up, pair_down = _float(_take(we_gate_up, expert)), _float(_take(we_down, expert))
    gate_up = jnp.einsum(
        "MD,MDGF->MGF", rows.astype(pair_gate_up.dtype), pair_gate_up,
        preferred_element_type=jnp.float32,
    )  # fmt: skip
    hidden = (jax.nn.silu(gate_up[:, 0]) * gate_up[:, 1]).astype(pair_down.dtype)
    return jnp.einsum("MF,MFD->MD", hidden, pair_down, preferred_element_type=jnp.float32)


def _take(w: jax.Array | QuantizedWeight, experts: jax.Array) -> Any:
    """The weights of `experts` i32[M] ([M, ...]): of a quantized weight, its integers and
    scales (the expert axis is not its grouped axis)."""
    return jax.tree.map(lambda a: a[experts], sliced(w) if isinstance(w, QuantizedWeight) else w)


def _float(w: jax.Array | QuantizedWeight) -> jax.Array:
    return dequantize(w) if isinstance(w, QuantizedWeight) else w
