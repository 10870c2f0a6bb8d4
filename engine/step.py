"""The jitted step: forward the scheduled tokens, write their K/V, sample at each sequence's
last token. Pure: everything it uses is an argument, and the KV pages are donated.

The step is three functions, compiled apart so that no request mix needs a compilation after
warm-up: `forward_step` (the model, per (T, S) bucket), `sample_step` (the sampling tail, per S
bucket, with or without penalties; logprobs are a runtime branch) and `prompt_logprobs_step`
(over every token's hidden state, per T bucket, run only when a request asks). `step` is their
composition, one program (what the export tests lower for TPU and CUDA).

Shapes: T padded tokens, S padded sequences, P page-table width, V vocabulary, K top logprobs,
D hidden size.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from engine import sampling
from engine.config import ModelConfig
from engine.models import lora as lora_model
from engine.models import moe, registry
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
    lora_slots: Any = None  # i32[T]; each token's adapter slot (0: the base model, padding)
    # i32[S, W]: each sequence's allowed next tokens, packed (structured output; -1: any);
    # None in a batch with no constrained row: every token allowed.
    token_bitmask: Any = None
    # i32[T]: where a token is still on the device (asynchronous scheduling), its row among the
    # previous step's sampled tokens (`TokenCarry`); -1: token_ids holds it.
    token_src: Any = None


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class TokenCarry:
    """The previous step's sampled tokens, kept on the device, and which of this step's tokens
    they supply: how a step runs before the host has read the tokens of the one before it."""

    sampled: Any  # i32[C]; the previous step's tokens by row, padded to C = the largest S
    token_src: Any  # i32[T]; a row of `sampled`, or -1: the batch's own token id


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class StepOutput:
    token_ids: Any  # i32[S]
    logprobs: Any  # f32[S]
    top_ids: Any  # i32[S, K]
    top_logprobs: Any  # f32[S, K]
    prompt: sampling.SamplerOutput | None = None  # per token [T]; when prompt logprobs are asked
    expert_counts: Any = None  # i32[L, E]; when options.count_expert_tokens (moe.count_tokens)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class ForwardOutput:
    """What the forward hands to the sampling tail and to prompt logprobs."""

    logits: Any  # f32[S, V]; at each sequence's last scheduled token
    hidden: Any  # f[T, D]; every token's final hidden state
    expert_counts: Any = None  # i32[L, E]: tokens per layer and expert, if counted


def attention_metadata(batch: StepInput) -> AttentionMetadata:
    """What paged attention needs of a batch besides q, k, v and the cache."""
    return AttentionMetadata(
        batch.slot_mapping, batch.kv_lens, batch.page_table, batch.cu_q_lens, batch.num_seqs
    )


@dataclass(frozen=True)
class StepOptions:
    """What is static about a step besides the bucket shapes (hashable: a jit cache key)."""

    cfg: ModelConfig
    attention_impl: str | None = None  # None: by platform
    apply_penalties: bool = False
    num_top_logprobs: int = 0  # 0: no request asked for logprobs, none are computed
    num_prompt_logprobs: int | None = None  # None: no prompt logprobs
    sharding: ShardingPlan | None = None  # None: one device
    count_expert_tokens: bool = False  # a mixture of experts' tokens per layer and expert


def _forward(
    params: Params,
    kv_caches: Any,
    token_ids: jax.Array,  # i32[T]
    positions: jax.Array,  # i32[T]
    meta: AttentionMetadata,
    options: StepOptions,
    lora: lora_model.LoRAInputs | None = None,
) -> tuple[jax.Array, Any, jax.Array | None]:
    """Runs the model over the batch's tokens, writing their K/V into the paged caches;
    returns the final hidden states f[T, D], the caches and, when `options` count them, the
    tokens per layer and expert i32[L, E]."""
    cfg, plan = options.cfg, options.sharding
    if lora is not None:
        params = {**params, "layers": lora_model.attach(params["layers"], lora)}
    attend: Callable[..., Any] = functools.partial(
        paged_attention,
        sm_scale=registry.family(cfg).sm_scale(cfg),
        impl=options.attention_impl,
    )
    if plan is not None:
        attend = plan.shard_attention(attend)
    if plan is not None and plan.num_stages > 1:  # expert counts are refused with stages
        hidden, kv_caches = pipeline.forward(
            registry.family(cfg), params, kv_caches, token_ids, positions, meta,
            attend, plan=plan, cfg=cfg,
        )  # fmt: skip
        return hidden, kv_caches, None

    def attention(
        q: jax.Array, k: jax.Array, v: jax.Array, kv_pages: jax.Array, *, sliding_window: int | None
    ) -> Any:
        return attend(q, k, v, kv_pages, meta, sliding_window=sliding_window)

    experts = None
    if plan is not None and cfg.num_experts:
        experts = plan.shard_experts(moe.grouped_experts)
    if options.count_expert_tokens:
        hidden, kv_caches, ids = registry.forward_routed(
            params, token_ids, positions, kv_caches, attention, cfg=cfg, experts=experts
        )
        counts = moe.count_tokens(ids, meta.cu_q_lens[meta.num_seqs], cfg.num_experts)
        return hidden, kv_caches, counts
    hidden, kv_caches = registry.forward(
        params, token_ids, positions, kv_caches, attention, cfg=cfg, experts=experts
    )
    return hidden, kv_caches, None


def forward_step(
    params: Params,
    kv_caches: Any,
    token_ids: jax.Array,  # i32[T]
    positions: jax.Array,  # i32[T]
    meta: AttentionMetadata,
    logits_indices: jax.Array,  # i32[S]
    lora: lora_model.LoRAInputs | None = None,
    carry: TokenCarry | None = None,
    *,
    options: StepOptions,
) -> tuple[ForwardOutput, Any]:
    """The model's part of a step: the logits at each sequence's last scheduled token, every
    token's hidden state, and the updated caches. Reads nothing of the sampling parameters, so
    one compilation per (T, S) bucket serves every request mix (`options`' sampling fields are
    not read: pass them off, so that the jit cache holds one entry). `lora`: the adapter slots
    and each token's slot (engine/models/lora.py); None: no adapters. `carry`: tokens that come
    from the previous step's samples instead of `token_ids`."""
    if carry is not None:
        from_device = carry.sampled[jnp.maximum(carry.token_src, 0)]
        token_ids = jnp.where(carry.token_src >= 0, from_device, token_ids)
    hidden, kv_caches, counts = _forward(
        params, kv_caches, token_ids, positions, meta, options, lora
    )
    logits = registry.compute_logits(params, hidden[logits_indices], cfg=options.cfg)
    return ForwardOutput(logits, hidden, counts), kv_caches


def forward_logits(
    params: Params, kv_caches: Any, batch: StepInput, *, options: StepOptions
) -> tuple[jax.Array, Any]:
    """The logits f32[S, V] at each sequence's last scheduled token, and the updated caches."""
    out, kv_caches = forward_step(
        params, kv_caches, batch.token_ids, batch.positions, attention_metadata(batch),
        batch.logits_indices, options=options,
    )  # fmt: skip
    return out.logits, kv_caches


def sample_step(
    logits: jax.Array,  # f32[S, V]
    t: sampling.SamplingTensors,
    want_logprobs: jax.Array,  # bool[]: some sequence of the batch asked for logprobs
    token_bitmask: jax.Array | None = None,  # i32[S, W]; all bits set for free rows
    *,
    apply_penalties: bool,
    num_top_logprobs: int,
) -> sampling.SamplerOutput:
    """The sampling tail: one token per sequence, among those `token_bitmask` allows, and its
    logprob with the top `num_top_logprobs` alternatives when `want_logprobs` (a runtime
    branch: zeros otherwise, and the pass over the vocabulary is skipped). Penalties are static
    because they change the shapes of `t` (the prompt and output id lists); the bitmask is an
    input, so a batch that mixes constrained and free sequences compiles nothing new."""
    sampled = sampling.sample(
        logits, t, apply_penalties=apply_penalties, num_top_logprobs=0, logprobs=False,
        token_bitmask=token_bitmask,
    )  # fmt: skip
    if num_top_logprobs == 0:
        return sampled
    num_rows = logits.shape[0]

    def without() -> sampling.SamplerOutput:
        return sampling.SamplerOutput(
            sampled.token_ids,
            jnp.zeros(num_rows, jnp.float32),
            jnp.zeros((num_rows, num_top_logprobs), jnp.int32),
            jnp.zeros((num_rows, num_top_logprobs), jnp.float32),
        )

    def with_logprobs() -> sampling.SamplerOutput:
        return sampling.gather_logprobs(logits, sampled.token_ids, num_top_logprobs)

    return jax.lax.cond(want_logprobs, with_logprobs, without)


def sample_carry_step(
    logits: jax.Array,  # f32[S, V]
    t: sampling.SamplingTensors,
    want_logprobs: jax.Array,  # bool[]
    token_bitmask: jax.Array | None = None,  # i32[S, W]
    *,
    apply_penalties: bool,
    num_top_logprobs: int,
    carry_width: int,
) -> tuple[sampling.SamplerOutput, jax.Array]:
    """`sample_step`, and its tokens padded to i32[carry_width] for the next step's
    `TokenCarry` (one shape whatever this step's S, so the forward compiles once per bucket)."""
    sampled = sample_step(
        logits, t, want_logprobs, token_bitmask,
        apply_penalties=apply_penalties, num_top_logprobs=num_top_logprobs,
    )  # fmt: skip
    padded = jnp.zeros(carry_width, jnp.int32).at[: logits.shape[0]].set(sampled.token_ids)
    return sampled, padded


def prompt_logprobs_step(
    params: Params,
    hidden: jax.Array,  # f[T, D]
    next_token_ids: jax.Array,  # i32[T]; the prompt token after each, or -1
    *,
    cfg: ModelConfig,
    num_top: int,
) -> sampling.SamplerOutput:
    """Each prompt token's successor's logprob and the top `num_top` alternatives, from the
    forward's hidden states (per token [T]; rows without a successor get logprob 0)."""
    logits = registry.compute_logits(params, hidden, cfg=cfg)  # f32[T, V]
    return sampling.prompt_logprobs(logits, next_token_ids, num_top=num_top)


def step(
    params: Params, kv_caches: Any, batch: StepInput, *, options: StepOptions
) -> tuple[StepOutput, Any]:
    """The whole step as one function: the sampled tokens of every sequence (with logprobs and
    prompt logprobs as `options` ask) and the updated KV caches."""
    out, kv_caches = forward_step(
        params, kv_caches, batch.token_ids, batch.positions, attention_metadata(batch),
        batch.logits_indices, options=options,
    )  # fmt: skip
    sampled = sample_step(
        out.logits,
        batch.sampling,
        jnp.asarray(options.num_top_logprobs > 0),
        batch.token_bitmask,
        apply_penalties=options.apply_penalties,
        num_top_logprobs=options.num_top_logprobs,
    )
    prompt = None
    if options.num_prompt_logprobs is not None:
        prompt = prompt_logprobs_step(
            params, out.hidden, batch.next_token_ids, cfg=options.cfg,
            num_top=options.num_prompt_logprobs,
        )  # fmt: skip
    result = StepOutput(
        sampled.token_ids, sampled.logprobs, sampled.top_ids, sampled.top_logprobs, prompt,
        out.expert_counts,
    )  # fmt: skip
    return result, kv_caches


jitted_forward = jax.jit(forward_step, static_argnames=("options",), donate_argnames=("kv_caches",))
jitted_sample = jax.jit(sample_step, static_argnames=("apply_penalties", "num_top_logprobs"))
jitted_sample_carry = jax.jit(
    sample_carry_step, static_argnames=("apply_penalties", "num_top_logprobs", "carry_width")
)
jitted_prompt_logprobs = jax.jit(prompt_logprobs_step, static_argnames=("cfg", "num_top"))
