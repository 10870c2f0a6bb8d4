"""The jitted step: forward the scheduled tokens, write their K/V, sample at each sequence's
last token. Pure: everything it uses is an argument, and the KV pages are donated.

Shapes: T padded tokens, S padded sequences, P page-table width, V vocabulary, K top logprobs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax

from engine import sampling
from engine.config import ModelConfig
from engine.models import registry
from engine.models.layers import Params
from pallas_kernels.kv_cache_update import write_kv
from pallas_kernels.ragged_paged_attention import ragged_paged_attention


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class StepInput:
    """One step's ragged batch, padded to a (T, S) bucket. Padding tokens have slot -1;
    padding sequences have no tokens and kv_len 0."""

    token_ids: Any  # i32[T]
    positions: Any  # i32[T]
    slot_mapping: Any  # i32[T]; page * page_size + offset, -1 for padding
    cu_q_lens: Any  # i32[S+1]
    kv_lens: Any  # i32[S]; context length after this step
    page_table: Any  # i32[S, P]
    num_seqs: Any  # i32[]
    logits_indices: Any  # i32[S]; each sequence's last scheduled token
    sampling: sampling.SamplingTensors


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class StepOutput:
    token_ids: Any  # i32[S]
    logprobs: Any  # f32[S]
    top_ids: Any  # i32[S, K]
    top_logprobs: Any  # f32[S, K]


@dataclass(frozen=True)
class StepOptions:
    """What is static about a step besides the bucket shapes (hashable: a jit cache key)."""

    cfg: ModelConfig
    attention_impl: str | None = None  # None: by platform
    apply_penalties: bool = False
    num_top_logprobs: int = 0


def forward_logits(
    params: Params, kv_caches: Any, batch: StepInput, *, options: StepOptions
) -> tuple[jax.Array, Any]:
    """Runs the model over the batch's tokens, writing their K/V into the paged caches;
    returns the logits f32[S, V] at each sequence's last scheduled token, and the caches."""
    cfg = options.cfg
    scale = registry.family(cfg).sm_scale(cfg)

    def attention(q: jax.Array, k: jax.Array, v: jax.Array, kv_pages: jax.Array) -> Any:
        kv_pages = write_kv(kv_pages, k, v, batch.slot_mapping)
        out = ragged_paged_attention(
            q,
            kv_pages,
            batch.kv_lens,
            batch.page_table,
            batch.cu_q_lens,
            batch.num_seqs,
            sm_scale=scale,
            sliding_window=cfg.sliding_window,
            impl=options.attention_impl,
        )
        return out, kv_pages

    hidden, kv_caches = registry.forward(
        params, batch.token_ids, batch.positions, kv_caches, attention, cfg=cfg
    )
    return registry.compute_logits(params, hidden[batch.logits_indices], cfg=cfg), kv_caches


def step(
    params: Params, kv_caches: Any, batch: StepInput, *, options: StepOptions
) -> tuple[StepOutput, Any]:
    """Returns the sampled tokens of every sequence and the updated KV caches."""
    logits, kv_caches = forward_logits(params, kv_caches, batch, options=options)
    sampled = sampling.sample(
        logits,
        batch.sampling,
        apply_penalties=options.apply_penalties,
        num_top_logprobs=options.num_top_logprobs,
    )
    out = StepOutput(sampled.token_ids, sampled.logprobs, sampled.top_ids, sampled.top_logprobs)
    return out, kv_caches


jitted_step = jax.jit(step, static_argnames=("options",), donate_argnames=("kv_caches",))
