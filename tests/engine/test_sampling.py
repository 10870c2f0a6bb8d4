"""engine/sampling.py against independent NumPy computations."""

from __future__ import annotations

import math

import jax
import numpy as np
import pytest

from engine.sampling import (
    SamplingTensors,
    argmax,
    make_sampling_tensors,
    processed_logits,
    prompt_logprobs_jit,
    sample_jit,
)

# Tests share shapes where they can, so that sample_jit compiles fewer times.
VOCAB = 32
processed_logits_jit = jax.jit(processed_logits, static_argnames=("apply_penalties",))


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    shifted = x - x.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def reference_processed(logits: np.ndarray, fields: dict[str, np.ndarray]) -> np.ndarray:
    """Logit bias, repetition penalty over prompt+output, then OpenAI frequency/presence over
    output, written one token at a time."""
    out = logits.astype(np.float64).copy()
    for s in range(out.shape[0]):
        for tok, value in zip(fields["bias_ids"][s], fields["bias_values"][s], strict=True):
            if tok >= 0:
                out[s, tok] += value
        prompt = [tok for tok in fields["prompt_ids"][s] if tok >= 0]
        output = [tok for tok in fields["output_ids"][s] if tok >= 0]
        rep = fields["repetition_penalty"][s]
        for tok in set(prompt) | set(output):
            out[s, tok] = out[s, tok] / rep if out[s, tok] > 0 else out[s, tok] * rep
        for tok in set(output):
            count = output.count(tok)
            out[s, tok] -= fields["frequency_penalty"][s] * count + fields["presence_penalty"][s]
    return out


def padded_ids(rng: np.random.Generator, rows: int, width: int, vocab: int) -> np.ndarray:
    """Random ids with repeats, each row padded with -1 after a random length."""
    ids = rng.integers(0, vocab, size=(rows, width)).astype(np.int32)
    lengths = rng.integers(0, width + 1, size=rows)
    ids[np.arange(width)[None, :] >= lengths[:, None]] = -1
    return ids


def penalty_fields(rng: np.random.Generator, rows: int, vocab: int) -> dict[str, np.ndarray]:
    return {
        "repetition_penalty": rng.uniform(0.5, 2.0, rows).astype(np.float32),
        "presence_penalty": rng.uniform(-1.0, 1.0, rows).astype(np.float32),
        "frequency_penalty": rng.uniform(-0.5, 0.5, rows).astype(np.float32),
        "bias_ids": padded_ids(rng, rows, 3, vocab),
        "bias_values": rng.uniform(-5.0, 5.0, (rows, 3)).astype(np.float32),
        "prompt_ids": padded_ids(rng, rows, 12, vocab),
        "output_ids": padded_ids(rng, rows, 10, vocab),
    }


@pytest.mark.parametrize("width", [512, 500])  # blocks of 128, and the one-pass fallback
def test_blocked_argmax_matches_numpy_on_ties_nan_and_infinities(width: int) -> None:
    rng = np.random.default_rng(0)
    x = rng.integers(-3, 4, size=(8, width)).astype(np.float32)  # many ties
    x[1, [5, 300, 301]] = 9.0  # the maximum in two blocks: the first index wins
    x[2, [200, 450]] = np.nan  # NaN counts as +inf: the first one wins
    x[3] = -np.inf
    x[4, [130, 140]] = np.inf
    x[5, -1] = 9.0  # the last column
    x[6, [3, 260]] = [np.inf, np.nan]  # +inf before NaN (NumPy would take the NaN)
    got = np.asarray(jax.jit(argmax)(x))
    np.testing.assert_array_equal(got, np.where(np.isnan(x), np.inf, x).argmax(axis=-1))
    assert got[2] == 200 and got[6] == 3


def test_greedy_is_argmax_whatever_the_other_parameters() -> None:
    rng = np.random.default_rng(0)
    rows = 6
    logits = rng.normal(size=(rows, VOCAB)).astype(np.float32)
    t = make_sampling_tensors(
        rows,
        temperature=0.0,
        top_k=rng.integers(1, 4, rows),
        top_p=rng.uniform(0.05, 0.5, rows),
        min_p=rng.uniform(0.3, 0.9, rows),
        seeds=rng.integers(0, 2**32, rows),
        output_index=rng.integers(0, 1000, rows),
    )
    out = sample_jit(logits, t, apply_penalties=False, num_top_logprobs=0)
    np.testing.assert_array_equal(np.asarray(out.token_ids), logits.argmax(axis=-1))
    greedy = sample_jit(
        logits, SamplingTensors.greedy(rows), apply_penalties=False, num_top_logprobs=0
    )
    np.testing.assert_array_equal(np.asarray(greedy.token_ids), logits.argmax(axis=-1))
    assert greedy.top_ids.shape == (rows, 0) and greedy.top_logprobs.shape == (rows, 0)


def test_penalties_and_bias_match_numpy_reference() -> None:
    rng = np.random.default_rng(1)
    rows, vocab = 8, 16
    # Values around +-1 so that penalties often change which token is largest.
    logits = rng.normal(size=(rows, vocab)).astype(np.float32)
    fields = penalty_fields(rng, rows, vocab)
    t = make_sampling_tensors(rows, temperature=0.0, **fields)
    expected = reference_processed(logits, fields)

    got = np.asarray(processed_logits_jit(logits, t, apply_penalties=True))
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    out = sample_jit(logits, t, apply_penalties=True, num_top_logprobs=4)
    np.testing.assert_array_equal(np.asarray(out.token_ids), expected.argmax(axis=-1))
    assert not np.array_equal(expected.argmax(axis=-1), logits.argmax(axis=-1))

    # With the static flag off, only the bias applies.
    no_penalty = dict(fields, prompt_ids=fields["prompt_ids"][:, :0])
    no_penalty["output_ids"] = fields["output_ids"][:, :0]
    bias_only = reference_processed(logits, no_penalty)
    got = np.asarray(processed_logits_jit(logits, t, apply_penalties=False))
    np.testing.assert_allclose(got, bias_only, rtol=1e-5, atol=1e-5)


def test_seeded_sample_does_not_depend_on_batch_composition() -> None:
    rng = np.random.default_rng(2)
    pool = 12
    logits = rng.normal(size=(pool, VOCAB)).astype(np.float32)
    fields = {
        "temperature": rng.uniform(0.5, 1.5, pool).astype(np.float32),
        "top_k": rng.choice([0, 10, 20], pool).astype(np.int32),
        "top_p": rng.choice([1.0, 0.9], pool).astype(np.float32),
        "seeds": rng.integers(0, 2**32, pool).astype(np.uint32),
        "output_index": rng.integers(0, 100, pool).astype(np.int32),
    }

    def tokens_of(batch: np.ndarray) -> np.ndarray:
        t = make_sampling_tensors(len(batch), **{k: v[batch] for k, v in fields.items()})
        out = sample_jit(logits[batch], t, apply_penalties=False, num_top_logprobs=0)
        return np.asarray(out.token_ids)

    # Rows 0-3 first in a batch of 6, then reversed in a batch of 8 and scattered in another
    # batch of 6, with other requests (different seeds and logits) around them.
    first = tokens_of(np.array([0, 1, 2, 3, 4, 5]))[:4]
    bigger = tokens_of(np.array([11, 3, 2, 10, 9, 1, 0, 8]))[[6, 5, 2, 1]]
    other = tokens_of(np.array([2, 7, 0, 5, 3, 1]))[[2, 5, 0, 4]]
    np.testing.assert_array_equal(bigger, first)
    np.testing.assert_array_equal(other, first)

    # The key really is per (seed, output_index): moving output_index changes the draws.
    everyone = np.arange(8)
    before = tokens_of(everyone)
    fields["output_index"] = fields["output_index"] + 1
    assert not np.array_equal(tokens_of(everyone), before)


# The statistical test: a fixed small distribution over V = 8, permuted so the sort order is not
# the token order.
BASE_PROBS = np.array([0.3, 0.2, 0.15, 0.12, 0.1, 0.08, 0.03, 0.02])[[3, 0, 6, 1, 4, 7, 2, 5]]
SETTINGS = [  # temperature, top_k, top_p, min_p
    (0.8, 0, 1.0, 0.0),  # temperature alone: all 8 tokens
    (1.0, 3, 1.0, 0.0),  # 0.3, 0.2, 0.15
    (1.0, 0, 0.75, 0.0),  # running mass 0.3, 0.5, 0.65, 0.77 -> 4 tokens
    (1.0, 0, 1.0, 0.3),  # prob >= 0.09 -> 5 tokens
    # At temperature 1.5 the sorted probs are 0.237 0.181 0.150 0.129 0.114 0.098 0.051 0.039.
    # top-k 6 renormalises the running mass to 0.261 0.460 0.625 0.766: top-p 0.74 keeps 4
    # tokens (without renormalising, 0.697 < 0.74 would keep a fifth).
    (1.5, 6, 0.74, 0.0),
    (1.5, 6, 0.9, 0.6),  # top-k and top-p keep 6; min-p (prob >= 0.142) then keeps 3
]
DRAWS_PER_SETTING = 20_000


def reference_distribution(
    logits: np.ndarray, temperature: float, top_k: int, top_p: float, min_p: float
) -> np.ndarray:
    """Exact sampling distribution: temperature, top-k, top-p over the renormalised top-k
    (smallest prefix reaching p), then min-p relative to the most likely token."""
    probs = np.exp(log_softmax(logits / temperature))
    order = np.argsort(-probs, kind="stable")
    candidates = order[:top_k] if top_k > 0 else order
    total = probs[candidates].sum()
    kept, mass = [], 0.0
    for tok in candidates:
        kept.append(tok)
        mass += probs[tok] / total
        if mass >= top_p:
            break
    kept = [tok for tok in kept if probs[tok] >= min_p * probs.max()]
    out = np.zeros_like(probs)
    out[kept] = probs[kept]
    return out / out.sum()


def chi_square_critical(df: int, z: float) -> float:
    """Upper quantile of chi-square(df) by Wilson–Hilferty: (X/df)^(1/3) is roughly normal with
    mean 1 - 2/(9 df) and variance 2/(9 df), so x = df * (1 - 2/(9 df) + z sqrt(2/(9 df)))^3.
    With z = 3.719 (the normal's 1 - 1e-4 quantile): df = 7 gives
    7 * (1 - 0.03175 + 3.719 * 0.17817)^3 = 7 * 1.63088^3 = 30.36 (exact 29.88); df = 2 gives
    19.29 (exact -2 ln 1e-4 = 18.42). The approximation errs high for small df, so the false
    failure rate stays below 1e-4 per setting."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + z * math.sqrt(a)) ** 3


def test_empirical_frequencies_match_exact_distribution() -> None:
    rng = np.random.default_rng(3)
    vocab, n = len(BASE_PROBS), DRAWS_PER_SETTING
    logits = np.log(BASE_PROBS).astype(np.float32)
    columns = np.repeat(np.array(SETTINGS, dtype=np.float64), n, axis=0)  # one row per draw
    rows = len(columns)
    t = make_sampling_tensors(
        rows,
        temperature=columns[:, 0],
        top_k=columns[:, 1],
        top_p=columns[:, 2],
        min_p=columns[:, 3],
        seeds=rng.permutation(rows),
        output_index=rng.integers(0, 50, rows),
    )
    batch_logits = np.broadcast_to(logits, (rows, vocab))
    out = sample_jit(batch_logits, t, apply_penalties=False, num_top_logprobs=0)
    tokens = np.asarray(out.token_ids).reshape(len(SETTINGS), n)

    for setting, drawn in zip(SETTINGS, tokens, strict=True):
        expected = reference_distribution(logits, *setting)
        counts = np.bincount(drawn, minlength=vocab)
        allowed = expected > 0
        assert counts[~allowed].sum() == 0, f"{setting}: drew excluded tokens {counts}"
        assert allowed.sum() >= 2  # a test with one allowed token would have nothing to test
        want = n * expected[allowed]
        statistic = float(((counts[allowed] - want) ** 2 / want).sum())
        critical = chi_square_critical(int(allowed.sum()) - 1, z=3.719)
        assert statistic < critical, f"{setting}: chi2 {statistic:.1f} >= {critical:.1f}"


def test_logprobs_are_of_the_raw_distribution() -> None:
    rng = np.random.default_rng(4)
    rows, vocab, k = 8, 16, 4  # the shapes of the penalties test
    logits = rng.normal(scale=2.0, size=(rows, vocab)).astype(np.float32)
    fields = penalty_fields(rng, rows, vocab)
    t = make_sampling_tensors(
        rows,
        temperature=np.array([0.0, 0.7, 1.0, 1.3, 2.0, 0.0, 0.5, 1.0]),
        top_k=np.array([0, 5, 0, 10, 0, 3, 0, 2]),
        min_p=0.05,
        seeds=np.arange(rows),
        **fields,
    )
    out = sample_jit(logits, t, apply_penalties=True, num_top_logprobs=k)
    raw = log_softmax(logits)
    tokens = np.asarray(out.token_ids)
    np.testing.assert_allclose(out.logprobs, raw[np.arange(rows), tokens], rtol=1e-5, atol=1e-5)
    top = np.argsort(-raw, axis=-1)[:, :k]
    np.testing.assert_array_equal(out.top_ids, top)
    np.testing.assert_allclose(
        out.top_logprobs, np.take_along_axis(raw, top, -1), rtol=1e-5, atol=1e-5
    )


def test_prompt_logprobs_match_numpy() -> None:
    rng = np.random.default_rng(5)
    tokens, vocab, k = 7, 40, 3
    logits = rng.normal(scale=2.0, size=(tokens, vocab)).astype(np.float32)
    next_ids = rng.integers(0, vocab, tokens).astype(np.int32)
    next_ids[-1] = -1  # the last prompt position has no next prompt token
    out = prompt_logprobs_jit(logits, next_ids, num_top=k)
    raw = log_softmax(logits)
    want = raw[np.arange(tokens - 1), next_ids[:-1]]
    np.testing.assert_allclose(np.asarray(out.logprobs)[:-1], want, rtol=1e-5, atol=1e-5)
    assert float(out.logprobs[-1]) == 0.0
    np.testing.assert_array_equal(out.token_ids, next_ids)
    top = np.argsort(-raw, axis=-1)[:, :k]
    np.testing.assert_array_equal(out.top_ids, top)
    np.testing.assert_allclose(
        out.top_logprobs, np.take_along_axis(raw, top, -1), rtol=1e-5, atol=1e-5
    )


def test_no_nan_with_greedy_rows_and_banned_tokens() -> None:
    vocab, repeats = 16, 200
    base = np.linspace(3.0, -3.0, vocab).astype(np.float32)  # token 0 most likely
    raw = np.stack([base, base, base, base])
    raw[1, 5] = -np.inf  # a masked vocab entry in the model's own logits
    banned = np.array([[0, 1, -1], [0, 1, 2], [0, 1, 2], [0, 2, 3]], np.int32)
    settings = dict(
        temperature=np.array([0.0, 0.0, 0.7, 1.0]),
        top_k=np.array([1, 0, 2, 2]),
        top_p=np.array([0.5, 1.0, 0.3, 1.0]),
        min_p=np.array([0.0, 0.9, 0.0, 0.5]),
        repetition_penalty=np.array([1.5, 2.0, 1.0, 1.3]),
        bias_ids=banned,
        bias_values=np.where(banned >= 0, -np.inf, 0.0),
        output_ids=np.array([[0, 3], [5, 5], [0, -1], [4, 0]]),
        frequency_penalty=np.full(4, 0.5),
    )
    rows = 4 * repeats
    t = make_sampling_tensors(
        rows,
        **{k: np.repeat(v, repeats, axis=0) for k, v in settings.items()},
        seeds=np.arange(rows),
    )
    out = sample_jit(np.repeat(raw, repeats, axis=0), t, apply_penalties=True, num_top_logprobs=2)
    tokens = np.asarray(out.token_ids).reshape(4, repeats)
    for leaf in (out.logprobs, out.top_logprobs):
        assert not np.isnan(np.asarray(leaf)).any()
    assert np.isfinite(np.asarray(out.logprobs)).all()
    np.testing.assert_array_equal(tokens[0], 2)  # greedy past the banned 0 and 1
    np.testing.assert_array_equal(tokens[1], 3)  # token 5 is -inf in the raw logits anyway
    for row in (2, 3):
        assert not np.isin(tokens[row], banned[row]).any()


def test_bad_inputs_are_rejected_with_a_message() -> None:
    with pytest.raises(TypeError, match="unknown sampling fields"):
        make_sampling_tensors(2, temprature=0.5)
    t = SamplingTensors.greedy(3)
    with pytest.raises(ValueError, match="temperature"):
        sample_jit(np.zeros((2, 8), np.float32), t, apply_penalties=False, num_top_logprobs=0)


def test_without_logprobs_the_same_tokens_are_drawn() -> None:
    """logprobs=False skips the vocabulary's normalizer, not the draw: greedy and seeded rows
    pick what they pick with logprobs, and the logprobs read zero."""
    rng = np.random.default_rng(5)
    rows = 8
    logits = rng.normal(size=(rows, VOCAB)).astype(np.float32)
    t = make_sampling_tensors(
        rows,
        temperature=np.where(np.arange(rows) % 2 == 0, 0.0, 0.8),
        top_p=0.9,
        seeds=rng.integers(0, 2**32, rows),
    )
    full = sample_jit(logits, t, apply_penalties=False, num_top_logprobs=2)
    bare = sample_jit(logits, t, apply_penalties=False, num_top_logprobs=0, logprobs=False)
    np.testing.assert_array_equal(np.asarray(bare.token_ids), np.asarray(full.token_ids))
    np.testing.assert_array_equal(np.asarray(bare.logprobs), np.zeros(rows, np.float32))
    assert np.asarray(full.logprobs).min() < 0  # the oracle run did compute them
    assert bare.top_ids.shape == (rows, 0)
    with pytest.raises(ValueError, match="without logprobs"):
        sample_jit(logits, t, apply_penalties=False, num_top_logprobs=2, logprobs=False)
