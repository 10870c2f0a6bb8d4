"""The jitted step: forward the scheduled tokens, write their K/V, sample at each sequence's
last token. Pure: everything it uses is an argument, and the KV pages are donated.

Shapes: T padded tokens, S padded sequences, P page-table width, V vocabulary, K top logprobs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax

from engine import sampling
from engine.config import ModelConfig
from engine.models import registry
from engine.models.attention import AttentionMetadata, paged_attention
from engine.models.layers import Params
from sharding import pipeline
from sharding.rules import ShardingPlan


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
    next_token_ids: Any  # i32[T]; for prompt logprobs: the prompt token after each, or -1
    sampling: sampling.SamplingTensors


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class StepOutput:
    token_ids: Any  # i32[S]
    logprobs: Any  # f32[S]
    top_ids: Any  # i32[S, K]
    top_logprobs: Any  # f32[S, K]
    prompt: sampling.SamplerOutput | None = None  # per token [T]; when prompt logprobs are asked


@dataclass(frozen=True)
class StepOptions:
    """What is static about a step besides the bucket shapes (hashable: a jit cache key)."""

    cfg: ModelConfig
    attention_impl: str | None = None  # None: by platform
    apply_penalties: bool = False
    num_top_logprobs: int = 0  # 0: no request asked for logprobs, none are computed
    num_prompt_logprobs: int | None = None  # None: no prompt logprobs
    sharding: ShardingPlan | None = None  # None: one device


def _forward(
    params: Params, kv_caches: Any, batch: StepInput, options: StepOptions
) -> tuple[jax.Array, Any]:
    """Runs the model over the batch's tokens, writing their K/V into the paged caches;
    returns the final hidden states f[T, D] and the caches."""
    cfg, plan = options.cfg, options.sharding
    attend: Callable[..., Any] = functools.partial(
        paged_attention,
        sm_scale=registry.family(cfg).sm_scale(cfg),
        impl=options.attention_impl,
    )
    if plan is not None:
        attend = plan.shard_attention(attend)
    meta = AttentionMetadata(
        batch.slot_mapping, batch.kv_lens, batch.page_table, batch.cu_q_lens, batch.num_seqs
    )
    if plan is not None and plan.num_stages > 1:
        return pipeline.forward(
            registry.family(cfg), params, kv_caches, batch.token_ids, batch.positions, meta,
            attend, plan=plan, cfg=cfg,
        )  # fmt: skip

    def attention(
        q: jax.Array, k: jax.Array, v: jax.Array, kv_pages: jax.Array, *, sliding_window: int | None
    ) -> Any:
        return attend(q, k, v, kv_pages, meta, sliding_window=sliding_window)

    return registry.forward(params, batch.token_ids, batch.positions, kv_caches, attention, cfg=cfg)


def forward_logits(
    params: Params, kv_caches: Any, batch: StepInput, *, options: StepOptions
) -> tuple[jax.Array, Any]:
    """The logits f32[S, V] at each sequence's last scheduled token, and the updated caches."""
    hidden, kv_caches = _forward(params, kv_caches, batch, options)
    logits = registry.compute_logits(params, hidden[batch.logits_indices], cfg=options.cfg)
    return logits, kv_caches


def step(
    params: Params, kv_caches: Any, batch: StepInput, *, options: StepOptions
) -> tuple[StepOutput, Any]:
    """Returns the sampled tokens of every sequence and the updated KV caches."""
    hidden, kv_caches = _forward(params, kv_caches, batch, options)
    logits = registry.compute_logits(params, hidden[batch.logits_indices], cfg=options.cfg)
    sampled = sampling.sample(
        logits,
        batch.sampling,
        apply_penalties=options.apply_penalties,
        num_top_logprobs=options.num_top_logprobs,
        logprobs=options.num_top_logprobs > 0,  # some request asked for them (MAX_LOGPROBS)
    )
    prompt = None
    if options.num_prompt_logprobs is not None:
        all_logits = registry.compute_logits(params, hidden, cfg=options.cfg)  # f32[T, V]
        prompt = sampling.prompt_logprobs(
            all_logits, batch.next_token_ids, num_top=options.num_prompt_logprobs
        )
    out = StepOutput(
        sampled.token_ids, sampled.logprobs, sampled.top_ids, sampled.top_logprobs, prompt
    )
    return out, kv_caches


jitted_step = jax.jit(step, static_argnames=("options",), donate_argnames=("kv_caches",))
