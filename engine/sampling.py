"""Pure, vectorised sampling and logprobs: one jitted function for the whole batch.

Every request's parameters are rows of the arrays in `SamplingTensors`; nothing on the device
path branches per request in Python. The only static choices are whether penalties are computed
at all (`apply_penalties`), whether logprobs are computed at all (`logprobs`) and how many top
logprobs to return (`num_top_logprobs`).

Processing order, per row, in `sample`:

1. logit bias (`bias_ids`/`bias_values` added to the logits);
2. penalties, when `apply_penalties`: repetition (HF/vLLM: over prompt and output tokens, a
   positive logit is divided by the penalty, a negative one multiplied), then frequency and
   presence (OpenAI: over output tokens only,
   `logit -= frequency * count + presence * (count > 0)`);
2b. the token bitmask of structured output (`token_bitmask`), when given: tokens whose bit is
   0 get -inf, so no bias or penalty brings back a token the grammar forbids;
3. greedy rows (temperature 0) take the argmax here, whatever their other parameters;
4. temperature (greedy rows divide by 1, so they never make NaN);
5. top-k, then top-p over what top-k kept (renormalised), then min-p: all three are cut-offs
   read from one descending sort per row, and tokens below the highest cut-off are set to -inf;
6. one categorical draw per row (Gumbel-max) with the row's own key,
   `fold_in(key(seeds[s]), output_index[s])`, so a seeded request samples the same tokens
   whatever batch it is in and wherever it sits in the batch.

Logprobs follow vLLM's default ("raw" logprobs): `logprobs` and `top_logprobs` are
`log_softmax` of the logits as the model produced them, before bias, penalties, temperature and
truncation. The sampled token's logprob is read from that same distribution.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

PAD_ID = -1  # padding in bias_ids, prompt_ids, output_ids and prompt_logprobs' next_token_ids

# SamplingTensors is filled in NumPy on the host and crosses to the device in one device_put.
HostOrDeviceArray = jax.Array | np.ndarray


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class SamplingTensors:
    """Per-sequence sampling parameters of one batch; row s belongs to sequence s.

    "Off" values: temperature 1 (0 means greedy), top_k 0 or >= V, top_p 1, min_p 0,
    repetition_penalty 1, presence_penalty 0, frequency_penalty 0, bias ids -1.
    Build it with `make_sampling_tensors`, which fills every unspecified field with its off value.
    """

    temperature: HostOrDeviceArray  # f32[S]; 0 = greedy
    top_k: HostOrDeviceArray  # i32[S]
    top_p: HostOrDeviceArray  # f32[S]
    min_p: HostOrDeviceArray  # f32[S]
    repetition_penalty: HostOrDeviceArray  # f32[S]; > 0
    presence_penalty: HostOrDeviceArray  # f32[S]
    frequency_penalty: HostOrDeviceArray  # f32[S]
    bias_ids: HostOrDeviceArray  # i32[S, B]; -1 = padding
    bias_values: HostOrDeviceArray  # f32[S, B]; may be -inf (ban a token)
    seeds: HostOrDeviceArray  # u32[S]
    output_index: HostOrDeviceArray  # i32[S]; how many tokens the request has generated so far
    prompt_ids: HostOrDeviceArray  # i32[S, Lp]; -1 = padding; read only when apply_penalties
    output_ids: HostOrDeviceArray  # i32[S, Lo]; -1 = padding; read only when apply_penalties

    @classmethod
    def greedy(cls, num_seqs: int) -> SamplingTensors:
        """All rows greedy, every other parameter off."""
        return make_sampling_tensors(num_seqs, temperature=0.0)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class SamplerOutput:
    """Chosen tokens with their logprobs and the top-K alternatives, all under the raw model
    distribution (log_softmax of the unprocessed logits)."""

    token_ids: jax.Array  # i32[N]
    logprobs: jax.Array  # f32[N]
    top_ids: jax.Array  # i32[N, K]; most likely first
    top_logprobs: jax.Array  # f32[N, K]


# field -> (dtype, off value); the 1-D fields, then the padded [S, L] lists.
_ROW_FIELDS: dict[str, tuple[type[np.generic], float]] = {
    "temperature": (np.float32, 1.0),
    "top_k": (np.int32, 0),
    "top_p": (np.float32, 1.0),
    "min_p": (np.float32, 0.0),
    "repetition_penalty": (np.float32, 1.0),
    "presence_penalty": (np.float32, 0.0),
    "frequency_penalty": (np.float32, 0.0),
    "seeds": (np.uint32, 0),
    "output_index": (np.int32, 0),
}
_LIST_FIELDS: dict[str, tuple[type[np.generic], float]] = {
    "bias_ids": (np.int32, PAD_ID),
    "bias_values": (np.float32, 0.0),
    "prompt_ids": (np.int32, PAD_ID),
    "output_ids": (np.int32, PAD_ID),
}


def make_sampling_tensors(num_seqs: int, **fields: Any) -> SamplingTensors:
    """`SamplingTensors` on the default device from NumPy arrays or scalars, one transfer.

    Row fields (temperature, top_k, ...) take an array of shape [num_seqs] or a scalar that is
    broadcast; list fields (bias_ids, bias_values, prompt_ids, output_ids) take [num_seqs, L]
    arrays. Missing fields take their off value (lists: width 0). Seeds default to 0: the engine
    gives every request a seed, a random one when the user set none.
    """
    unknown = set(fields) - set(_ROW_FIELDS) - set(_LIST_FIELDS)
    if unknown:
        raise TypeError(f"unknown sampling fields {sorted(unknown)}")
    host = {
        name: np.broadcast_to(np.asarray(fields.get(name, off), dtype), (num_seqs,))
        for name, (dtype, off) in _ROW_FIELDS.items()
    }
    for name, (dtype, off) in _LIST_FIELDS.items():
        host[name] = np.asarray(fields.get(name, np.full((num_seqs, 0), off)), dtype)
        if host[name].ndim != 2 or host[name].shape[0] != num_seqs:
            raise ValueError(f"{name} has shape {host[name].shape}, expected ({num_seqs}, L)")
    if host["bias_ids"].shape != host["bias_values"].shape:
        raise ValueError(f"{host['bias_ids'].shape=} must equal {host['bias_values'].shape=}")
    return SamplingTensors(**jax.device_put(host))


def _check_shapes(logits: jax.Array, t: SamplingTensors) -> None:
    """Static checks, at trace time."""
    if logits.ndim != 2:
        raise ValueError(f"{logits.shape=} must be [S, V]")
    num_seqs = logits.shape[0]
    for name in _ROW_FIELDS:
        shape = getattr(t, name).shape
        if shape != (num_seqs,):
            raise ValueError(f"{name}.shape={shape} must be ({num_seqs},) to match {logits.shape=}")
    for name in _LIST_FIELDS:
        shape = getattr(t, name).shape
        if len(shape) != 2 or shape[0] != num_seqs:
            raise ValueError(f"{name}.shape={shape} must be ({num_seqs}, L)")


def _scatter_add(
    base: jax.Array,  # f32|i32[S, V]
    ids: HostOrDeviceArray,  # i32[S, L]; -1 = padding
    values: HostOrDeviceArray | int,  # f32|i32[S, L] or a scalar
) -> jax.Array:
    """base[s, ids[s, l]] += values[s, l], skipping padding (sent out of range and dropped;
    a -1 index would otherwise wrap round to the last token)."""
    num_seqs, vocab = base.shape
    ids = jnp.where(ids < 0, vocab, ids)
    rows = jnp.arange(num_seqs)[:, None]
    return base.at[rows, ids].add(values, mode="drop")


def token_counts(ids: HostOrDeviceArray, vocab_size: int) -> jax.Array:  # i32[S, L] -> i32[S, V]
    """How often each token appears in each row of a padded id list."""
    zeros = jnp.zeros((ids.shape[0], vocab_size), jnp.int32)
    return _scatter_add(zeros, ids, 1)


def _penalize(logits: jax.Array, t: SamplingTensors) -> jax.Array:  # f32[S, V] -> f32[S, V]
    vocab = logits.shape[-1]
    output_counts = token_counts(t.output_ids, vocab)  # i32[S, V]
    seen = (token_counts(t.prompt_ids, vocab) > 0) | (output_counts > 0)  # bool[S, V]
    rep = t.repetition_penalty[:, None]
    repeated = jnp.where(logits > 0, logits / rep, logits * rep)
    logits = jnp.where(seen, repeated, logits)
    counts = output_counts.astype(logits.dtype)
    penalty = t.frequency_penalty[:, None] * counts + t.presence_penalty[:, None] * (counts > 0)
    return logits - penalty


def processed_logits(
    logits: jax.Array,  # f32[S, V]
    t: SamplingTensors,
    *,
    apply_penalties: bool,
) -> jax.Array:  # f32[S, V]
    """Steps 1-2 of the processing order: logit bias, then (if enabled) penalties.
    Greedy rows take the argmax of this."""
    logits = _scatter_add(jnp.asarray(logits, jnp.float32), t.bias_ids, t.bias_values)
    return _penalize(logits, t) if apply_penalties else logits


def truncation_cutoff(
    scaled: jax.Array,  # f32[S, V]: temperature-scaled logits
    top_k: HostOrDeviceArray,  # i32[S]
    top_p: HostOrDeviceArray,  # f32[S]
    min_p: HostOrDeviceArray,  # f32[S]
) -> jax.Array:  # f32[S]
    """Per row, the lowest scaled logit that top-k, then top-p, then min-p all keep.

    top-k keeps the k largest; top-p keeps the smallest prefix (by descending probability, after
    top-k) whose mass reaches p, and at least one token; min-p keeps tokens with
    prob >= min_p * max_prob, i.e. logit >= max_logit + log(min_p). Tokens tied with the cut-off
    are all kept.
    """
    vocab = scaled.shape[-1]
    desc = -jnp.sort(-scaled, axis=-1)  # f32[S, V], one sort per row
    rank = jnp.arange(vocab)[None, :]  # i32[1, V]
    k = jnp.where((top_k <= 0) | (top_k >= vocab), vocab, top_k)[:, None]
    in_top_k = rank < k  # bool[S, V]
    probs = jax.nn.softmax(jnp.where(in_top_k, desc, -jnp.inf), axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    # p >= 1 keeps everything even where rounding makes the running mass reach 1 early.
    in_top_p = (mass_before < top_p[:, None]) | (top_p[:, None] >= 1) | (rank == 0)
    top_kp_cutoff = jnp.min(jnp.where(in_top_k & in_top_p, desc, jnp.inf), axis=-1)
    min_p_cutoff = desc[:, 0] + jnp.log(min_p)  # log(0) = -inf: min-p off
    return jnp.maximum(top_kp_cutoff, min_p_cutoff)


def argmax(x: jax.Array, block: int = 128) -> jax.Array:  # f32[S, V] -> i32[S]
    """The first index of each row's maximum, NaN taken as +inf (a row of broken logits still
    gives one of its NaNs), in two short passes: the maximum of each block of `block` columns,
    then the argmax inside the first block that holds the row's maximum. XLA:CPU does the
    one-pass `jnp.argmax` as a scalar loop over (value, index) pairs: 15.5 ms for 128 rows of
    SmolLM2's 49152 logits, ~1.6 ms this way. (NaN is replaced because XLA:CPU's vectorised max
    may drop it.)"""
    rows, width = x.shape
    x = jnp.where(jnp.isnan(x), jnp.inf, x)
    if width % block:
        return jnp.argmax(x, axis=-1).astype(jnp.int32)
    blocks = x.reshape(rows, width // block, block)
    first = jnp.argmax(jnp.max(blocks, axis=-1), axis=-1)  # i[S]: the block of the maximum
    inside = jnp.take_along_axis(blocks, first[:, None, None], axis=1)[:, 0]  # f32[S, block]
    return (first * block + jnp.argmax(inside, axis=-1)).astype(jnp.int32)


def bitmask_words(vocab_size: int) -> int:
    """Width W of a packed token bitmask: 32 tokens to an int32 word."""
    return -(-vocab_size // 32)


def apply_token_bitmask(
    logits: jax.Array,  # f32[S, V]
    token_bitmask: HostOrDeviceArray,  # i32[S, W]; all bits set (-1) for a free row
) -> jax.Array:  # f32[S, V]
    """-inf where a token's bit is 0. llguidance's packing: token v is bit v % 32 of word
    v // 32 (bits past V are ignored)."""
    num_rows, vocab = logits.shape
    if token_bitmask.shape != (num_rows, bitmask_words(vocab)):
        raise ValueError(f"{token_bitmask.shape=} must be ({num_rows}, {bitmask_words(vocab)})")
    shifts = jnp.arange(32, dtype=jnp.int32)  # i32[32]
    bits = (token_bitmask[:, :, None] >> shifts) & 1  # i32[S, W, 32]
    allowed = bits.reshape(num_rows, -1)[:, :vocab] != 0  # bool[S, V]
    return jnp.where(allowed, logits, -jnp.inf)


def _row_keys(seeds: HostOrDeviceArray, output_index: HostOrDeviceArray) -> jax.Array:  # -> key[S]
    return jax.vmap(lambda s, i: jax.random.fold_in(jax.random.key(s), i))(seeds, output_index)


def _sample_rows(
    logits: jax.Array,  # f32[S, V]; processed, without temperature
    t: SamplingTensors,
) -> jax.Array:  # i32[S]
    """Steps 3-6: greedy argmax, or temperature, truncation and a draw with the row's key."""
    is_greedy = t.temperature == 0
    greedy_ids = argmax(logits)

    def draw() -> jax.Array:
        scaled = logits / jnp.where(is_greedy, 1.0, t.temperature)[:, None]
        cutoff = truncation_cutoff(scaled, t.top_k, t.top_p, t.min_p)
        truncated = jnp.where(scaled < cutoff[:, None], -jnp.inf, scaled)
        drawn = jax.vmap(jax.random.categorical)(_row_keys(t.seeds, t.output_index), truncated)
        return jnp.where(is_greedy, greedy_ids, drawn).astype(jnp.int32)

    # An all-greedy batch skips the per-row sort over the vocabulary (a runtime branch).
    return jax.lax.cond(jnp.all(is_greedy), lambda: greedy_ids, draw)


def gather_logprobs(
    logits: jax.Array,  # f32[N, V]: raw model logits
    token_ids: jax.Array,  # i32[N]; -1 = padding, logprob 0
    num_top: int,
) -> SamplerOutput:
    """Each row's logprob of `token_ids` and its top `num_top` alternatives, under the raw
    model distribution."""
    # log_softmax(x) = x - logsumexp(x), read off only where needed: the whole [N, V] table of
    # logprobs is never written (a few ms a step at SmolLM2's 49,152 tokens).
    logits = logits.astype(jnp.float32)
    normalizer = jax.nn.logsumexp(logits, axis=-1)  # f32[N]
    safe_ids = jnp.maximum(token_ids, 0)[:, None]
    chosen = jnp.take_along_axis(logits, safe_ids, axis=-1)[:, 0] - normalizer
    chosen = jnp.where(token_ids < 0, 0.0, chosen)
    top_logits, top_ids = jax.lax.top_k(logits, num_top)
    top_logprobs = top_logits - normalizer[:, None]
    return SamplerOutput(token_ids, chosen, top_ids.astype(jnp.int32), top_logprobs)


def sample(
    logits: jax.Array,  # f32[S, V]
    t: SamplingTensors,
    *,
    apply_penalties: bool,
    num_top_logprobs: int,
    logprobs: bool = True,
    token_bitmask: HostOrDeviceArray | None = None,
) -> SamplerOutput:
    """Sample one token per row; see the module docstring for the order of processing.

    Args:
      logits: f32[S, V] next-token logits, one row per sequence (padding rows are sampled too;
        the caller ignores them).
      t: the batch's sampling parameters, rows aligned with `logits`.
      apply_penalties: static; when False, repetition/presence/frequency penalties are skipped
        entirely and `prompt_ids`/`output_ids` are never read.
      num_top_logprobs: static K >= 0, the number of top alternatives returned per row.
      logprobs: static; when False (no request in the batch asked for logprobs), the
        normalizer over the vocabulary is not computed, `logprobs` are zeros and K must be 0.
        On CPU that pass took half as long as the output layer's product (128 rows).
      token_bitmask: i32[S, W] packed allowed tokens (structured output), or None: all allowed.

    Returns:
      SamplerOutput with token_ids i32[S], logprobs f32[S], top_ids i32[S, K] and
      top_logprobs f32[S, K], the logprobs under the raw model distribution.
    """
    _check_shapes(logits, t)
    if num_top_logprobs < 0 or (num_top_logprobs and not logprobs):
        raise ValueError(f"{num_top_logprobs=} must be >= 0, and 0 without logprobs")
    logits = logits.astype(jnp.float32)
    with jax.named_scope("logits_processing"):
        processed = processed_logits(logits, t, apply_penalties=apply_penalties)
        if token_bitmask is not None:
            processed = apply_token_bitmask(processed, token_bitmask)
    with jax.named_scope("draw"):
        token_ids = _sample_rows(processed, t)
    if not logprobs:
        num_rows = logits.shape[0]
        return SamplerOutput(
            token_ids,
            jnp.zeros(num_rows, jnp.float32),
            jnp.zeros((num_rows, 0), jnp.int32),
            jnp.zeros((num_rows, 0), jnp.float32),
        )
    with jax.named_scope("logprobs"):
        return gather_logprobs(logits, token_ids, num_top_logprobs)


def prompt_logprobs(
    logits: jax.Array,  # f32[T, V]: logits at each prompt position
    next_token_ids: jax.Array,  # i32[T]: the prompt token that follows; -1 = none/padding
    *,
    num_top: int,
) -> SamplerOutput:
    """Logprob of each actual next prompt token and the top `num_top` alternatives, under the raw
    model distribution. token_ids echoes `next_token_ids`; padding rows get logprob 0."""
    if logits.ndim != 2 or next_token_ids.shape != logits.shape[:1]:
        raise ValueError(f"{logits.shape=} must be [T, V] and {next_token_ids.shape=} [T]")
    if num_top < 0:
        raise ValueError(f"{num_top=} must be >= 0")
    return gather_logprobs(logits, next_token_ids.astype(jnp.int32), num_top)


sample_jit = jax.jit(sample, static_argnames=("apply_penalties", "num_top_logprobs", "logprobs"))
prompt_logprobs_jit = jax.jit(prompt_logprobs, static_argnames=("num_top",))
