"""The MoE layer's pure functions against a per-token NumPy loop (the oracle): routing with and
without renormalisation, each way of running the experts (sorted + ragged_dot, gathered, dense,
and the default choice), unbalanced loads (an expert with every token, experts with none), and
shards of experts that sum to the whole."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from engine.models import moe

D, F, E, K = 16, 8, 8, 2


def swiglu(x: np.ndarray, gate_up: np.ndarray, down: np.ndarray) -> np.ndarray:
    """One expert on one token: gate_up [D, 2, F], down [F, D]."""
    g, u = x @ gate_up[:, 0], x @ gate_up[:, 1]
    return (g / (1 + np.exp(-g)) * u) @ down


def oracle(x, weights, ids, gate_up, down, first=0):
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = ids[t, j] - first
            if 0 <= e < down.shape[0]:
                out[t] += weights[t, j] * swiglu(x[t], gate_up[e], down[e])
    return out


def random_case(tokens: int, seed: int, ids=None):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(tokens, D)).astype(np.float32)
    gate_up = rng.normal(size=(E, D, 2, F)).astype(np.float32) * 0.3
    down = rng.normal(size=(E, F, D)).astype(np.float32) * 0.3
    if ids is None:
        ids = np.stack([rng.permutation(E)[:K] for _ in range(tokens)]).astype(np.int32)
    weights = rng.uniform(0.1, 1.0, size=ids.shape).astype(np.float32)
    return x, weights, ids, gate_up, down


IMPLS = [*moe.IMPLS, None]


def run(*case, first: int = 0, impl: str | None) -> np.ndarray:
    fn = jax.jit(moe.grouped_experts, static_argnames="impl")
    return np.asarray(fn(*case, first, impl=impl))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("tokens", [1, 4, 13])
def test_grouped_experts_match_the_loop(tokens: int, impl: str | None) -> None:
    """Fewer pairs (T*k) than experts and more: the default gathers for the former."""
    case = random_case(tokens, seed=tokens)
    np.testing.assert_allclose(run(*case, impl=impl), oracle(*case), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("impl", IMPLS)
def test_unbalanced_load_one_expert_takes_every_token(impl: str | None) -> None:
    ids = np.stack([np.full(12, 6), np.arange(12) % 2]).T.astype(np.int32)  # experts 6, 0, 1
    case = random_case(12, seed=7, ids=ids)
    np.testing.assert_allclose(run(*case, impl=impl), oracle(*case), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("shards", [2, 8])
@pytest.mark.parametrize("tokens", [1, 9])
def test_shards_of_experts_sum_to_the_whole(shards: int, tokens: int, impl: str | None) -> None:
    x, weights, ids, gate_up, down = random_case(tokens, seed=shards)
    local = E // shards
    parts = []
    for s in range(shards):
        cut = slice(s * local, (s + 1) * local)
        part = run(x, weights, ids, gate_up[cut], down[cut], first=s * local, impl=impl)
        np.testing.assert_allclose(
            np.asarray(part), oracle(x, weights, ids, gate_up[cut], down[cut], s * local),
            atol=1e-5, rtol=1e-5,
        )  # fmt: skip
        parts.append(np.asarray(part))
    np.testing.assert_allclose(sum(parts), oracle(x, weights, ids, gate_up, down), atol=1e-5)


@pytest.mark.parametrize("normalize", [True, False])
def test_route_picks_the_top_k_of_the_softmax(normalize: bool) -> None:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(5, D)).astype(np.float32)
    router = rng.normal(size=(D, E)).astype(np.float32)
    weights, ids = moe.route(x, router, top_k=K, normalize=normalize)
    logits = x.astype(np.float64) @ router
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    want_ids = np.argsort(-probs, axis=-1)[:, :K]
    want = np.take_along_axis(probs, want_ids, axis=-1)
    if normalize:
        want /= want.sum(-1, keepdims=True)
    np.testing.assert_array_equal(np.asarray(ids), want_ids)
    np.testing.assert_allclose(np.asarray(weights), want, rtol=1e-5)
