"""Rejection sampling of speculative proposals: keeps the target distribution exactly.

For each sequence s the target model scored K + 1 positions: its last known token and the
`num_drafts[s]` proposed tokens (rows past that are padding). Position j's target distribution
p_j is the one the non-speculative sampler would draw from there (engine/sampling.py's order:
logit bias, penalties over the output including the proposals before j, the token bitmask,
temperature, top-k, top-p, min-p). Proposal d_j, drawn from the draft distribution q_j (one-hot
for n-gram proposals), is accepted with probability min(1, p_j(d_j) / q_j(d_j)); at the first
rejection the emitted token is drawn from the residual norm(max(p_j - q_j, 0)); if every
proposal is accepted a bonus token is drawn from p_K. The first emitted token is then
distributed as p_0 exactly (Leviathan et al. 2023, Chen et al. 2023), and by induction every
emitted run is distributed as non-speculative sampling would give it.

Randomness: position j of sequence s uses the key `fold_in(key(seed), output_index + j)`, the
key non-speculative sampling uses for that output token: the bonus (or plain) draw is the very
draw the plain sampler makes there, the acceptance test folds in 1 and the residual draw 2.
So a seeded request whose proposals are all accepted gives the non-speculative tokens, and no
result depends on the rest of the batch. Greedy rows (temperature 0): p_j is one-hot at the
argmax, so a proposal is accepted iff it is the argmax, and the emitted token is the argmax.

Pure: jittable functions of arrays; K is static (the draft array's width).
Shapes: S sequences, K proposals per sequence, V vocabulary, N = S * (K + 1), L top logprobs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from engine import sampling
from engine.sampling import HostOrDeviceArray, SamplingTensors

ACCEPT_FOLD = 1  # folded into a position's key for its acceptance test
RESIDUAL_FOLD = 2  # ... for its residual draw


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class VerifyOutput:
    """What verification emits per sequence: the accepted proposals then one drawn token."""

    token_ids: Any  # i32[S, K+1]; -1 past num_emitted
    num_emitted: Any  # i32[S]; accepted proposals + 1
    logprobs: Any  # f32[S, K+1]; raw logprob of each emitted token (0 when not asked)
    top_ids: Any  # i32[S, K+1, L]
    top_logprobs: Any  # f32[S, K+1, L]


def expand_tensors(
    t: SamplingTensors,
    draft_ids: jax.Array,  # i32[S, K]
    *,
    apply_penalties: bool,
) -> SamplingTensors:
    """Per-position sampling rows, N = S * (K + 1): row s * (K + 1) + j is sequence s after j
    proposals, so its output index is `output_index + j` and (with penalties) its output ids
    include proposals 0..j-1."""
    num_seqs, k = draft_ids.shape
    positions = jnp.arange(k + 1, dtype=jnp.int32)  # i32[K+1]

    def rows(x: HostOrDeviceArray) -> jax.Array:
        return jnp.repeat(jnp.asarray(x), k + 1, axis=0)

    output_index = (jnp.asarray(t.output_index)[:, None] + positions).reshape(-1)
    output_ids = rows(t.output_ids)
    if apply_penalties:
        before = jnp.arange(k)[None, :] < positions[:, None]  # bool[K+1, K]
        seen = jnp.where(before[None], draft_ids[:, None, :], sampling.PAD_ID)  # i32[S, K+1, K]
        output_ids = jnp.concatenate([output_ids, seen.reshape(num_seqs * (k + 1), k)], axis=1)
    return SamplingTensors(
        temperature=rows(t.temperature),
        top_k=rows(t.top_k),
        top_p=rows(t.top_p),
        min_p=rows(t.min_p),
        repetition_penalty=rows(t.repetition_penalty),
        presence_penalty=rows(t.presence_penalty),
        frequency_penalty=rows(t.frequency_penalty),
        bias_ids=rows(t.bias_ids),
        bias_values=rows(t.bias_values),
        seeds=rows(t.seeds),
        output_index=output_index,
        prompt_ids=rows(t.prompt_ids),
        output_ids=output_ids,
    )


def target_logits(
    logits: jax.Array,  # f32[N, V]: raw model logits
    t: SamplingTensors,  # N rows (expand_tensors)
    *,
    apply_penalties: bool,
    token_bitmask: HostOrDeviceArray | None = None,  # i32[N, W]
) -> tuple[jax.Array, jax.Array]:  # f32[N, V], i32[N]
    """The truncated, temperature-scaled logits the plain sampler draws from (-inf where a
    token is cut), and each row's greedy token, computed exactly as engine/sampling.py does."""
    processed, greedy_ids = _processed(
        logits, t, apply_penalties=apply_penalties, token_bitmask=token_bitmask
    )
    return _truncated(processed, t), greedy_ids


def _processed(
    logits: jax.Array,  # f32[N, V]
    t: SamplingTensors,
    *,
    apply_penalties: bool,
    token_bitmask: HostOrDeviceArray | None,
) -> tuple[jax.Array, jax.Array]:  # f32[N, V], i32[N]
    """Penalised, biased and masked logits, and each row's greedy token."""
    processed = sampling.processed_logits(logits, t, apply_penalties=apply_penalties)
    if token_bitmask is not None:
        processed = sampling.apply_token_bitmask(processed, token_bitmask)
    return processed, sampling.argmax(processed)


def _truncated(processed: jax.Array, t: SamplingTensors) -> jax.Array:  # f32[N, V]
    """Temperature, then top-k, top-p and min-p (-inf where a token is cut)."""
    is_greedy = jnp.asarray(t.temperature) == 0
    scaled = processed / jnp.where(is_greedy, 1.0, t.temperature)[:, None]
    cutoff = sampling.truncation_cutoff(scaled, t.top_k, t.top_p, t.min_p)
    return jnp.where(scaled < cutoff[:, None], -jnp.inf, scaled)


def target_probs(
    truncated: jax.Array,  # f32[N, V]
    greedy_ids: jax.Array,  # i32[N]
    temperature: HostOrDeviceArray,  # f32[N]
) -> jax.Array:  # f32[N, V]
    """p: softmax of the truncated logits; one-hot at the greedy token for greedy rows."""
    vocab = truncated.shape[-1]
    one_hot = jax.nn.one_hot(greedy_ids, vocab, dtype=jnp.float32)
    greedy = (jnp.asarray(temperature) == 0)[:, None]
    return jnp.where(greedy, one_hot, jax.nn.softmax(truncated, axis=-1))


def acceptance_probs(
    p: jax.Array,  # f32[S, K, V]: target at the proposed positions
    q: jax.Array | None,  # f32[S, K, V]: draft; None: one-hot at the proposals
    draft_ids: jax.Array,  # i32[S, K]
) -> jax.Array:  # f32[S, K]
    """min(1, p(d) / q(d)) for each proposal d."""
    p_d = jnp.take_along_axis(p, draft_ids[..., None], axis=-1)[..., 0]
    if q is None:
        return jnp.minimum(p_d, 1.0)
    q_d = jnp.take_along_axis(q, draft_ids[..., None], axis=-1)[..., 0]
    return jnp.where(p_d >= q_d, 1.0, p_d / jnp.maximum(q_d, jnp.finfo(jnp.float32).tiny))


def residual_probs(
    p: jax.Array,  # f32[S, K, V]
    q: jax.Array | None,  # f32[S, K, V]; None: one-hot at the proposals
    draft_ids: jax.Array,  # i32[S, K]
) -> jax.Array:  # f32[S, K, V]
    """norm(max(p - q, 0)), drawn from after a rejection. Where it is all zero (p = q, so a
    rejection cannot happen) it is p, so that the draw stays defined."""
    if q is None:
        q = jax.nn.one_hot(draft_ids, p.shape[-1], dtype=p.dtype)
    residual = jnp.maximum(p - q, 0.0)
    mass = jnp.sum(residual, axis=-1, keepdims=True)
    return jnp.where(mass > 0, residual / jnp.where(mass > 0, mass, 1.0), p)


def _keys(seeds: HostOrDeviceArray, output_index: HostOrDeviceArray) -> jax.Array:  # key[N]
    return jax.vmap(lambda s, i: jax.random.fold_in(jax.random.key(s), i))(seeds, output_index)


def _emit(
    draft_ids: jax.Array,  # i32[S, K]
    num_drafts: jax.Array,  # i32[S]
    accepted: jax.Array,  # bool[S, K]
    residual_ids: jax.Array,  # i32[S, K]
    bonus_ids: jax.Array,  # i32[S, K+1]
) -> tuple[jax.Array, jax.Array]:  # i32[S, K+1], i32[S]
    """The emitted run: proposals up to the first rejection, then the residual draw there, or
    the bonus draw after the last proposal."""
    num_seqs, k = draft_ids.shape
    valid = jnp.arange(k)[None, :] < num_drafts[:, None]
    num_accepted = jnp.sum(jnp.cumprod(accepted & valid, axis=1), axis=1)  # i32[S]
    rejected = num_accepted < num_drafts
    padded_residual = jnp.concatenate([residual_ids, residual_ids[:, :1]], axis=1)
    at = num_accepted[:, None]
    last = jnp.where(
        rejected,
        jnp.take_along_axis(padded_residual, at, axis=1)[:, 0],
        jnp.take_along_axis(bonus_ids, at, axis=1)[:, 0],
    )
    positions = jnp.arange(k + 1)[None, :]
    padded_drafts = jnp.concatenate([draft_ids, jnp.zeros((num_seqs, 1), jnp.int32)], axis=1)
    tokens = jnp.where(positions < at, padded_drafts, jnp.where(positions == at, last[:, None], -1))
    return tokens.astype(jnp.int32), (num_accepted + 1).astype(jnp.int32)


def rejection_sample(
    logits: jax.Array,  # f32[N, V]; row s * (K + 1) + j: sequence s, position j
    t: SamplingTensors,  # S rows
    draft_ids: jax.Array,  # i32[S, K]
    num_drafts: jax.Array,  # i32[S]; in [0, K]
    draft_probs: jax.Array | None = None,  # f32[S, K, V]; None: one-hot (n-gram proposals)
    token_bitmask: HostOrDeviceArray | None = None,  # i32[N, W]; row s * (K + 1) + j
    *,
    apply_penalties: bool,
) -> tuple[jax.Array, jax.Array]:  # i32[S, K+1], i32[S]
    """Verifies each sequence's proposals against the target logits; returns the emitted tokens
    (-1 past the end) and how many there are (>= 1). See the module docstring.

    `token_bitmask` (structured output): the tokens sequence s's grammar allows at position
    j, after its proposals before j (engine/speculative/grammar.py); all ones for free rows."""
    num_seqs, k = draft_ids.shape
    vocab = logits.shape[-1]
    rows = expand_tensors(t, draft_ids, apply_penalties=apply_penalties)
    processed, greedy_ids = _processed(
        logits, rows, apply_penalties=apply_penalties, token_bitmask=token_bitmask
    )
    is_greedy = jnp.asarray(rows.temperature) == 0
    greedy_at = greedy_ids.reshape(num_seqs, k + 1)[:, :k]

    def all_greedy() -> tuple[jax.Array, jax.Array, jax.Array]:
        # p is one-hot at the greedy token: a proposal is accepted exactly when it is that
        # token, and the residual after a rejection is that token too.
        return draft_ids == greedy_at, greedy_at, greedy_ids.reshape(num_seqs, k + 1)

    def sampled() -> tuple[jax.Array, jax.Array, jax.Array]:
        truncated = _truncated(processed, rows)
        keys = _keys(rows.seeds, rows.output_index)  # key[N]
        drawn = jax.vmap(jax.random.categorical)(keys, truncated)
        bonus_ids = jnp.where(is_greedy, greedy_ids, drawn).reshape(num_seqs, k + 1)
        p = target_probs(truncated, greedy_ids, rows.temperature)
        p = p.reshape(num_seqs, k + 1, vocab)[:, :k]
        alpha = acceptance_probs(p, draft_probs, draft_ids)
        uniform = jax.vmap(lambda key: jax.random.uniform(jax.random.fold_in(key, ACCEPT_FOLD)))(
            keys
        )
        accepted = uniform.reshape(num_seqs, k + 1)[:, :k] < alpha
        residual = residual_probs(p, draft_probs, draft_ids)
        residual_keys = jax.vmap(lambda key: jax.random.fold_in(key, RESIDUAL_FOLD))(keys)
        residual_keys = residual_keys.reshape(num_seqs, k + 1)[:, :k].reshape(-1)
        residual_ids = jax.vmap(jax.random.categorical)(
            residual_keys, jnp.log(residual.reshape(num_seqs * k, vocab))
        ).reshape(num_seqs, k)
        greedy_rows = is_greedy.reshape(num_seqs, k + 1)[:, :k]
        residual_ids = jnp.where(greedy_rows, greedy_at, residual_ids).astype(jnp.int32)
        return accepted, residual_ids, bonus_ids.astype(jnp.int32)

    # An all-greedy batch skips the sorts and draws over the vocabulary (a runtime branch, as
    # in engine/sampling.py): they cost as much as a decode step of SmolLM2 on a CPU.
    accepted, residual_ids, bonus_ids = jax.lax.cond(jnp.all(is_greedy), all_greedy, sampled)
    return _emit(draft_ids, num_drafts, accepted, residual_ids, bonus_ids)


def draft_sample(
    logits: jax.Array,  # f32[S, V]: a draft model's raw logits
    t: SamplingTensors,  # S rows; output_index: the position being proposed
) -> tuple[jax.Array, jax.Array]:  # i32[S], f32[S, V]
    """A draft model's proposal and the distribution q it was drawn from: the plain sampler's
    transforms (penalties left out: any q keeps the target exact) and its draw, with the key
    the plain sampler uses at that output index, so a draft equal to the target proposes
    exactly the tokens the target would sample. An all-greedy batch skips the truncation's sort
    and the draw (a runtime branch): its proposals are the argmax and q is one-hot there, what
    the full path gives greedy rows."""
    processed, greedy_ids = _processed(logits, t, apply_penalties=False, token_bitmask=None)
    is_greedy = jnp.asarray(t.temperature) == 0

    def all_greedy() -> tuple[jax.Array, jax.Array]:
        one_hot = jax.nn.one_hot(greedy_ids, logits.shape[-1], dtype=jnp.float32)
        return greedy_ids.astype(jnp.int32), one_hot

    def sampled() -> tuple[jax.Array, jax.Array]:
        truncated = _truncated(processed, t)
        drawn = jax.vmap(jax.random.categorical)(_keys(t.seeds, t.output_index), truncated)
        tokens = jnp.where(is_greedy, greedy_ids, drawn).astype(jnp.int32)
        return tokens, target_probs(truncated, greedy_ids, t.temperature)

    return jax.lax.cond(jnp.all(is_greedy), all_greedy, sampled)


def verify_step(
    logits: jax.Array,  # f32[N, V]
    t: SamplingTensors,  # S rows
    draft_ids: jax.Array,  # i32[S, K]
    num_drafts: jax.Array,  # i32[S]
    want_logprobs: jax.Array,  # bool[]
    token_bitmask: HostOrDeviceArray | None = None,  # i32[N, W]
    draft_probs: jax.Array | None = None,  # f32[S, K, V]; None: one-hot (n-gram)
    *,
    apply_penalties: bool,
    num_top_logprobs: int,
) -> VerifyOutput:
    """The verification tail of a speculative step: `rejection_sample`, then, when
    `want_logprobs` (a runtime branch), each emitted token's raw logprob and the top
    `num_top_logprobs` alternatives at its position."""
    num_seqs, k = draft_ids.shape
    tokens, num_emitted = rejection_sample(
        logits, t, draft_ids, num_drafts, draft_probs, token_bitmask,
        apply_penalties=apply_penalties,
    )  # fmt: skip
    width = (num_seqs, k + 1)

    def without() -> sampling.SamplerOutput:
        n = num_seqs * (k + 1)
        return sampling.SamplerOutput(
            tokens.reshape(-1),
            jnp.zeros(n, jnp.float32),
            jnp.zeros((n, num_top_logprobs), jnp.int32),
            jnp.zeros((n, num_top_logprobs), jnp.float32),
        )

    def with_logprobs() -> sampling.SamplerOutput:
        return sampling.gather_logprobs(logits, tokens.reshape(-1), num_top_logprobs)

    out = (
        without() if num_top_logprobs == 0 else jax.lax.cond(want_logprobs, with_logprobs, without)
    )
    return VerifyOutput(
        tokens,
        num_emitted,
        out.logprobs.reshape(width),
        out.top_ids.reshape(*width, num_top_logprobs),
        out.top_logprobs.reshape(*width, num_top_logprobs),
    )


jitted_verify = jax.jit(verify_step, static_argnames=("apply_penalties", "num_top_logprobs"))


def draft_sample_step(
    logits: jax.Array,  # f32[S, V]: the draft's logits for proposal j
    t: SamplingTensors,  # S rows; output_index: the first proposal's
    j: jax.Array,  # i32[]
    drafts: jax.Array,  # i32[S, K]
    probs: jax.Array,  # f32[S, K, V]
    *,
    num_fed: int,
) -> tuple[jax.Array, jax.Array, jax.Array]:  # i32[S, K], f32[S, K, V], i32[num_fed]
    """Draws proposal j (`draft_sample` at output index + j) into column j of `drafts` and
    `probs`, and returns it padded to `num_fed` tokens, to be fed to the draft's next step."""
    shifted = dataclasses.replace(t, output_index=jnp.asarray(t.output_index) + j)
    tokens, q = draft_sample(logits, shifted)
    drafts = jax.lax.dynamic_update_slice(drafts, tokens[:, None], (0, j))
    probs = jax.lax.dynamic_update_slice(probs, q[:, None].astype(probs.dtype), (0, j, 0))
    fed = jnp.zeros(num_fed, jnp.int32).at[: tokens.shape[0]].set(tokens)
    return drafts, probs, fed


jitted_draft_sample = jax.jit(
    draft_sample_step, static_argnames=("num_fed",), donate_argnames=("drafts", "probs")
)
