"""Naive generation: the whole sequence is recomputed for every new token.

No KV cache, no batching tricks: slow, but simple enough to trust. It is the oracle the paged
engine is tested against.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from engine.config import ModelConfig
from engine.errors import InvalidRequestError
from engine.models import registry
from engine.models.layers import AttentionFn, Params, dense_causal_attention

_LENGTH_BUCKET = 64  # sequences are padded to a multiple of this: one compile per bucket


def _whole_sequence_attention(positions: jax.Array, cfg: ModelConfig) -> AttentionFn:
    scale = registry.family(cfg).sm_scale(cfg)

    def attention(
        q: jax.Array, k: jax.Array, v: jax.Array, cache: None, *, sliding_window: int | None
    ) -> tuple[jax.Array, None]:
        out = dense_causal_attention(
            q, k, v, positions, sm_scale=scale, sliding_window=sliding_window
        )
        return out, cache

    return attention


@functools.partial(jax.jit, static_argnames=("cfg",))
def sequence_logits(params: Params, token_ids: jax.Array, *, cfg: ModelConfig) -> jax.Array:
    """Logits f32[B, L, V] of a batch of whole sequences i32[B, L] (each starts at position 0)."""
    positions = jnp.arange(token_ids.shape[1], dtype=jnp.int32)
    family = registry.family(cfg)

    attention = _whole_sequence_attention(positions, cfg)

    def one(ids: jax.Array) -> jax.Array:
        hidden, _ = family.forward(params, ids, positions, None, attention, cfg=cfg)
        return family.compute_logits(params, hidden, cfg=cfg)

    # lax.map, not vmap: jax has no batching rule for every primitive a model uses (ragged_dot
    # batched along a non-leading axis, in the MoE layer)
    return jax.lax.map(one, token_ids)


@functools.partial(jax.jit, static_argnames=("cfg",))
def _next_token_logits(
    params: Params, token_ids: jax.Array, length: jax.Array, *, cfg: ModelConfig
) -> jax.Array:
    """f32[V]: logits after the first `length` of token_ids i32[L] (the rest is padding that
    causal masking keeps out of view)."""
    positions = jnp.arange(token_ids.shape[0], dtype=jnp.int32)
    family = registry.family(cfg)

    attention = _whole_sequence_attention(positions, cfg)
    hidden, _ = family.forward(params, token_ids, positions, None, attention, cfg=cfg)
    last = jax.lax.dynamic_slice_in_dim(hidden, length - 1, 1)
    return family.compute_logits(params, last, cfg=cfg)[0]


@dataclass(frozen=True)
class NaiveSampling:
    """Greedy when temperature is 0; otherwise temperature then nucleus (top-p) sampling."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    max_tokens: int = 16

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise InvalidRequestError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be >= 1, got {self.max_tokens}")


def sample(logits: np.ndarray, params: NaiveSampling, rng: np.random.Generator) -> int:
    if params.temperature == 0:
        return int(np.argmax(logits))
    z = logits.astype(np.float64) / params.temperature
    probs = np.exp(z - z.max())
    probs /= probs.sum()
    order = np.argsort(-probs, kind="stable")
    # Keep the smallest prefix whose mass reaches top_p (always at least the top token).
    keep = np.cumsum(probs[order]) - probs[order] < params.top_p
    kept = order[keep]
    return int(rng.choice(kept, p=probs[kept] / probs[kept].sum()))


def generate(
    params: Params,
    cfg: ModelConfig,
    prompt_ids: Sequence[int],
    sampling: NaiveSampling,
    *,
    stop_ids: Sequence[int] = (),
    logits_processor: Callable[[np.ndarray], np.ndarray] | None = None,
) -> Iterator[int]:
    """Yields new token ids one by one until max_tokens or a stop id (which is yielded).
    `logits_processor` changes each step's logits f32[V] before sampling (a host-side
    constraint, e.g. a grammar's mask)."""
    if not prompt_ids:
        raise InvalidRequestError("prompt must contain at least one token")
    total = len(prompt_ids) + sampling.max_tokens
    if total > cfg.max_position_embeddings:
        raise InvalidRequestError(
            f"prompt ({len(prompt_ids)} tokens) + max_tokens ({sampling.max_tokens}) exceeds the "
            f"model's context of {cfg.max_position_embeddings} tokens"
        )
    buffer = np.zeros(-(-total // _LENGTH_BUCKET) * _LENGTH_BUCKET, np.int32)
    buffer[: len(prompt_ids)] = prompt_ids
    rng = np.random.default_rng(sampling.seed)
    for length in range(len(prompt_ids), total):
        logits = np.asarray(_next_token_logits(params, buffer, np.int32(length), cfg=cfg))
        if logits_processor is not None:
            logits = logits_processor(logits)
        token = sample(logits, sampling, rng)
        buffer[length] = token
        yield token
        if token in stop_ids:
            return
