"""engine/speculative/rejection.py: the emitted tokens are distributed as the target's.

Two kinds of check. Exact enumeration: over a vocabulary of 8, the probability of each first
token and of each emitted pair, summed over every proposal the draft can make with the
sampler's own acceptance probabilities and residuals, equals the target distribution computed
here independently in NumPy (temperature, top-k, top-p, min-p, penalties). Statistical: the
whole sampler with its random draws, thousands of seeds, chi-square against the NumPy target
at significance 1e-4 per check (so a correct sampler fails one of the checks below with
probability under 1e-3 over the choice of seeds; the seeds are fixed, so a run is repeatable).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from engine.sampling import make_sampling_tensors, sample_jit
from engine.speculative.rejection import (
    acceptance_probs,
    draft_sample,
    expand_tensors,
    rejection_sample,
    residual_probs,
    target_logits,
    target_probs,
)

V = 8
SIGNIFICANCE = 1e-4
SETTINGS = {
    "temperature": dict(temperature=0.7),
    "top_k": dict(temperature=1.0, top_k=3),
    "top_p": dict(temperature=1.3, top_p=0.7),
    "min_p": dict(temperature=0.9, min_p=0.15),
    "all": dict(temperature=0.8, top_k=6, top_p=0.9, min_p=0.05),
    "greedy": dict(temperature=0.0),
}


def oracle(
    logits: np.ndarray, setting: dict, output: list[int] = (), freq: float = 0.0
) -> np.ndarray:
    """The target distribution of one row, from the definitions: frequency penalty over the
    output, temperature, top-k (the k largest), top-p over what top-k kept (the shortest
    most-likely prefix whose mass reaches p), min-p (prob >= min_p * max prob)."""
    x = logits.astype(np.float64).copy()
    for token in set(output):
        x[token] -= freq * list(output).count(token)
    temperature = setting.get("temperature", 1.0)
    if temperature == 0:
        return np.eye(len(x))[np.argmax(x)]
    x = x / temperature
    order = np.argsort(-x)
    keep = np.zeros(len(x), bool)
    keep[order[: setting.get("top_k", 0) or len(x)]] = True
    probs = np.where(keep, np.exp(x - x.max()), 0)
    probs /= probs.sum()
    mass = 0.0
    for token in order:
        if keep[token] and mass >= setting.get("top_p", 1.0):
            keep[token] = False
        mass += probs[token]
    probs = np.where(keep, np.exp(x - x.max()), 0)
    probs = np.where(probs >= setting.get("min_p", 0.0) * probs.max(), probs, 0)
    return probs / probs.sum()


@functools.partial(jax.jit, static_argnames="penalties")
def _probs(logits, t, drafts, *, penalties: bool):
    rows = expand_tensors(t, drafts, apply_penalties=penalties)
    truncated, greedy = target_logits(logits, rows, apply_penalties=penalties)
    return target_probs(truncated, greedy, rows.temperature)


sample = jax.jit(rejection_sample, static_argnames="apply_penalties")


def sampler_probs(logits: np.ndarray, setting: dict, drafts: np.ndarray, **extra) -> np.ndarray:
    """The sampler's target p at every position: f32[S, K+1, V] for logits [S*(K+1), V]."""
    num_seqs, k = drafts.shape
    t = make_sampling_tensors(num_seqs, **setting, **extra)
    penalties = "frequency_penalty" in extra
    probs = _probs(jnp.asarray(logits), t, jnp.asarray(drafts), penalties=penalties)
    return np.asarray(probs).reshape(num_seqs, k + 1, V)


def drafts_for(kind: str, p: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Adversarial draft distributions against target p."""
    if kind == "equal":
        return p.copy()
    if kind == "disjoint":  # mass only where the target has none (else on its least likely)
        outside = p == 0 if (p == 0).any() else p == p.min()
        return outside / outside.sum()
    if kind == "peaked":  # sure of the target's least likely token
        q = np.full(V, 0.03 / (V - 1))
        q[np.argmin(np.where(p > 0, p, 2))] = 0.97
        return q
    if kind == "flat":
        return np.full(V, 1.0 / V)
    return rng.dirichlet(np.ones(V) * 0.5)


def first_token_distribution(p_row: np.ndarray, q: np.ndarray | None) -> np.ndarray:
    """Sum over every proposal d: q(d) * [accept: d; reject: the residual]. q None: n-gram
    proposals (one-hot), checked for every d separately (returns [V, V])."""
    drafts = np.arange(V, dtype=np.int32)[:, None]
    p = jnp.asarray(np.broadcast_to(p_row, (V, 1, V)), jnp.float32)
    qs = None if q is None else jnp.asarray(np.broadcast_to(q, (V, 1, V)), jnp.float32)
    alpha = np.asarray(acceptance_probs(p, qs, jnp.asarray(drafts)))[:, 0]  # [d]
    residual = np.asarray(residual_probs(p, qs, jnp.asarray(drafts)))[:, 0]  # [d, V]
    per_draft = alpha[:, None] * np.eye(V) + (1 - alpha)[:, None] * residual
    return per_draft if q is None else q @ per_draft


@pytest.mark.parametrize("setting", SETTINGS)
def test_target_probs_match_the_oracle(setting):
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 2, (3, V)).astype(np.float32)
    got = sampler_probs(logits, SETTINGS[setting], np.zeros((1, 2), np.int32))[0]
    want = np.stack([oracle(row, SETTINGS[setting]) for row in logits])
    np.testing.assert_allclose(got, want, atol=1e-6)


@pytest.mark.parametrize("setting", SETTINGS)
def test_first_token_is_exactly_the_target_by_enumeration(setting):
    rng = np.random.default_rng(1)
    logits = rng.normal(0, 2, V).astype(np.float32)
    p = sampler_probs(logits[None], SETTINGS[setting], np.zeros((1, 0), np.int32))[0, 0]
    want = oracle(logits, SETTINGS[setting])
    for kind in ("equal", "disjoint", "peaked", "flat", "random"):
        got = first_token_distribution(p, drafts_for(kind, want, rng))
        np.testing.assert_allclose(got, want, atol=1e-6, err_msg=kind)
    for d, got in enumerate(first_token_distribution(p, None)):  # n-gram: any one proposal
        np.testing.assert_allclose(got, want, atol=1e-6, err_msg=f"one-hot at {d}")


@pytest.mark.parametrize("setting", ["top_p", "all", "greedy"])
@pytest.mark.parametrize("kind", ["equal", "peaked", "random", "ngram"])
def test_pairs_are_exactly_the_target_by_enumeration(setting, kind):
    """Two proposals, the second position's logits depending on the first proposal and a
    frequency penalty counting it: enumerate every (d1, d2)."""
    rng = np.random.default_rng(2)
    freq = 0.8
    l0 = rng.normal(0, 2, V)
    l1 = rng.normal(0, 2, (V, V))  # l1[x1]: the logits after x1
    p0 = oracle(l0, SETTINGS[setting])
    p1 = np.stack([oracle(l1[x], SETTINGS[setting], [x], freq) for x in range(V)])
    want = p0[:, None] * p1  # P(x1, x2)
    pairs = np.array([(a, b) for a in range(V) for b in range(V)], np.int32)  # row = (d1, d2)
    logits = np.stack([np.stack([l0, l1[a], l0]) for a, _ in pairs]).reshape(-1, V)
    p = sampler_probs(logits.astype(np.float32), SETTINGS[setting], pairs, frequency_penalty=freq)
    q0 = drafts_for("random" if kind == "ngram" else kind, p0, rng)
    q1 = np.stack([drafts_for("random" if kind == "ngram" else kind, p1[a], rng) for a in range(V)])
    if kind == "ngram":  # the proposals are fixed: any (d1, d2), each on its own
        chance = np.zeros(len(pairs))
        chance[rng.integers(len(pairs))] = 1.0
        qs = None
    else:
        chance = np.array([q0[a] * q1[a, b] for a, b in pairs])
        qs = jnp.asarray(np.stack([np.stack([q0, q1[a]]) for a, _ in pairs]), jnp.float32)
    jp = jnp.asarray(p[:, :2])
    alpha = np.asarray(acceptance_probs(jp, qs, jnp.asarray(pairs)))
    residual = np.asarray(residual_probs(jp, qs, jnp.asarray(pairs)))
    got = np.zeros((V, V))
    for row, (d1, d2) in enumerate(pairs):
        a0, a1 = alpha[row]
        # rejected at once: x1 from the residual, x2 from the next (plain) step
        got += chance[row] * (1 - a0) * residual[row, 0][:, None] * p1
        got[d1, d2] += chance[row] * a0 * a1
        got[d1] += chance[row] * a0 * (1 - a1) * residual[row, 1]
    np.testing.assert_allclose(got, want, atol=1e-6)


def chi_square_p_value(observed: np.ndarray, expected_probs: np.ndarray) -> float:
    """Chi-square goodness of fit; an observation where the target has no mass fails outright."""
    observed, expected_probs = observed.ravel(), expected_probs.ravel()
    assert observed[expected_probs == 0].sum() == 0, "a token the target never emits"
    keep = expected_probs > 0
    expected = expected_probs[keep] / expected_probs[keep].sum() * observed.sum()
    return float(stats.chisquare(observed[keep], expected).pvalue)


@pytest.mark.parametrize("setting", ["top_k", "all"])
def test_sampled_runs_follow_the_target(setting):
    """End to end with random draws: 4000 seeds, K = 2, proposals drawn from a draft peaked
    where the target is flat; the second token of a run that stopped after one comes from a
    plain draw of the next position's target."""
    rng = np.random.default_rng(3)
    n, cfg = 4000, SETTINGS[setting]
    l0 = rng.normal(0, 1, V)
    l1 = rng.normal(0, 2, (V, V))
    p0 = oracle(l0, cfg)
    p1 = np.stack([oracle(l1[x], cfg) for x in range(V)])
    q0 = drafts_for("peaked", p0, rng)
    q1 = np.stack([drafts_for("random", p1[x], rng) for x in range(V)])
    d1 = np.array([rng.choice(V, p=q0) for _ in range(n)])
    d2 = np.array([rng.choice(V, p=q1[a]) for a in d1])
    drafts = np.stack([d1, d2], axis=1).astype(np.int32)
    logits = np.stack([np.stack([l0, l1[a], l0]) for a in d1]).reshape(-1, V).astype(np.float32)
    q = np.stack([np.stack([q0, q1[a]]) for a in d1]).astype(np.float32)
    t = make_sampling_tensors(n, seeds=np.arange(n, dtype=np.uint32), **cfg)
    tokens, emitted = sample(
        jnp.asarray(logits), t, jnp.asarray(drafts), jnp.full(n, 2, jnp.int32), jnp.asarray(q),
        apply_penalties=False,
    )  # fmt: skip
    tokens, emitted = np.asarray(tokens), np.asarray(emitted)
    x2 = np.where(emitted >= 2, tokens[:, 1], [rng.choice(V, p=p1[a]) for a in tokens[:, 0]])
    first = np.bincount(tokens[:, 0], minlength=V)
    pairs = np.zeros((V, V))
    np.add.at(pairs, (tokens[:, 0], x2), 1)
    assert chi_square_p_value(first, p0) > SIGNIFICANCE
    assert chi_square_p_value(pairs, p0[:, None] * p1) > SIGNIFICANCE


def test_draft_equal_to_target_gives_the_plain_tokens_whatever_the_batch():
    """A seeded sequence whose draft is the target (same distribution, proposals drawn with the
    plain sampler's keys) has every proposal accepted and emits exactly the plain sampler's
    tokens; the same row in another batch, at another index, emits the same."""
    rng = np.random.default_rng(4)
    k, num_seqs = 3, 5
    setting = dict(temperature=0.9, top_k=6, top_p=0.95)
    logits = rng.normal(0, 2, (num_seqs, k + 1, V)).astype(np.float32)
    seeds = rng.integers(0, 2**32, num_seqs, dtype=np.uint32)
    index = rng.integers(0, 50, num_seqs).astype(np.int32)
    plain = np.stack([
        np.asarray(sample_jit(
            jnp.asarray(logits[:, j]),
            make_sampling_tensors(num_seqs, seeds=seeds, output_index=index + j, **setting),
            apply_penalties=False, num_top_logprobs=0, logprobs=False,
        ).token_ids)
        for j in range(k + 1)
    ], axis=1)  # fmt: skip
    drafts = plain[:, :k].astype(np.int32)
    flat = logits.reshape(-1, V)
    q = sampler_probs(flat, setting, drafts)[:, :k]

    def run(order: np.ndarray) -> np.ndarray:
        t = make_sampling_tensors(
            len(order), seeds=seeds[order], output_index=index[order], **setting
        )
        tokens, emitted = sample(
            jnp.asarray(logits[order].reshape(-1, V)), t, jnp.asarray(drafts[order]),
            jnp.full(len(order), k, jnp.int32), jnp.asarray(q[order]), apply_penalties=False,
        )  # fmt: skip
        assert (np.asarray(emitted) == k + 1).all()
        return np.asarray(tokens)

    np.testing.assert_array_equal(run(np.arange(num_seqs)), plain)
    order = np.array([3, 1, 4, 1])
    np.testing.assert_array_equal(run(order), plain[order])


def test_greedy_accepts_the_argmax_prefix_then_emits_the_argmax():
    rng = np.random.default_rng(5)
    k, num_seqs = 4, 6
    logits = rng.normal(0, 2, (num_seqs, k + 1, V)).astype(np.float32)
    best = logits.argmax(-1)
    drafts = best[:, :k].copy()
    wrong_at = np.array([0, 1, 2, 3, 4, 4])  # 4: no proposal is wrong
    for s, j in enumerate(wrong_at):
        if j < k:
            drafts[s, j] = (best[s, j] + 1) % V
    num_drafts = np.array([4, 4, 4, 4, 4, 2], np.int32)
    t = make_sampling_tensors(num_seqs, temperature=0.0)
    tokens, emitted = sample(
        jnp.asarray(logits.reshape(-1, V)), t, jnp.asarray(drafts.astype(np.int32)),
        jnp.asarray(num_drafts), apply_penalties=False,
    )  # fmt: skip
    tokens, emitted = np.asarray(tokens), np.asarray(emitted)
    for s in range(num_seqs):
        n = min(wrong_at[s], num_drafts[s])
        assert emitted[s] == n + 1
        np.testing.assert_array_equal(tokens[s, : n + 1], best[s, : n + 1])
        assert (tokens[s, n + 1 :] == -1).all()


def test_greedy_draft_proposes_the_argmax_with_a_one_hot_q():
    # All-greedy (the fast branch) and greedy rows beside a sampled one (the full path): the
    # argmax (numpy's), and q one-hot there.
    rng = np.random.default_rng(9)
    logits = rng.normal(0, 2, (4, V)).astype(np.float32)
    best = logits.argmax(-1)
    for temperature in ([0.0] * 4, [0.0, 0.0, 0.0, 0.8]):
        t = make_sampling_tensors(4, temperature=np.array(temperature, np.float32))
        tokens, q = jax.jit(draft_sample)(jnp.asarray(logits), t)
        greedy = np.array(temperature) == 0
        np.testing.assert_array_equal(np.asarray(tokens)[greedy], best[greedy])
        np.testing.assert_array_equal(np.asarray(q)[greedy], np.eye(V)[best[greedy]])
