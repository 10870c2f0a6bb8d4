"""Structured output under speculation: a constrained sequence's proposals follow its grammar.

Before a verification step, a constrained sequence's proposal is cut at the first token its
grammar rejects from the sequence's state (`valid_prefix`): the target could never emit it, so
verifying it would only cost. While the device runs the forward, the host writes one token
bitmask per scored position (`draft_filler`): position j's is the grammar's mask after the
proposals before j, found by advancing the sequence's matcher through the proposal and rolling
it back, so the matcher is where it was before the step. The verification tail applies each
mask to its position's logits before rejection sampling (engine/speculative/rejection.py), so
every emitted token is one the plain constrained sampler could emit there, with the same
probability. After the step the engine feeds the matcher the emitted tokens only, as for any
sampled token (LLMEngine._record_token), which is what "roll back the rejected rest" amounts to.

Positions past a proposal that completes the grammar keep all-ones masks: the sequence finishes
at that token whenever it is accepted (its grammar is done), so nothing after it is emitted.

Host code: never imports jax.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
from llguidance import LLMatcher
from llguidance.numpy import fill_next_token_bitmask

from engine.scheduler import SchedulerOutput
from engine.structured.matchers import GrammarMatchers


def valid_prefix(matcher: LLMatcher | None, drafts: list[int]) -> list[int]:
    """The longest prefix of `drafts` the matcher accepts from its state (all of them for a
    free sequence, `matcher` None). The matcher is not changed."""
    if matcher is None or not drafts:
        return drafts
    return drafts[: matcher.validate_tokens(drafts)]


def fill_along(
    matcher: LLMatcher,
    drafts: list[int],  # a valid prefix (valid_prefix)
    bitmask: np.ndarray,  # i32[K+1, W]: row j gets position j's mask
) -> None:
    """Writes the mask of each position 0..len(drafts) (rows after a proposal that stops the
    grammar are left alone), advancing the matcher through `drafts` and rolling it back."""
    consumed = 0
    try:
        for j, token in enumerate(drafts):
            fill_next_token_bitmask(matcher, bitmask, j)
            if not matcher.consume_token(token):  # valid_prefix let it through: a bug
                raise RuntimeError(
                    f"proposed token {token} left the grammar: {matcher.get_error()}"
                )
            consumed += 1
            if matcher.is_stopped():
                return
        fill_next_token_bitmask(matcher, bitmask, len(drafts))
    finally:
        if consumed and not matcher.rollback(consumed):
            raise RuntimeError(f"grammar rollback failed: {matcher.get_error()}")


def draft_filler(
    grammars: GrammarMatchers, out: SchedulerOutput, k: int
) -> Callable[[np.ndarray], None] | None:
    """What writes the verification bitmask, i32[S * (K + 1), W] (row s * (K + 1) + j:
    sequence s at position j), for `out`'s constrained sequences whose sample is kept; None if
    there are none (every row stays all ones)."""
    rows = [
        (matcher, i, list(s.draft_token_ids))
        for i, s in enumerate(out.scheduled)
        if s.completes_sequence and (matcher := grammars.get(s.request.request_id)) is not None
    ]
    if not rows:
        return None

    def fill(bitmask: np.ndarray) -> None:
        start = time.perf_counter()
        for matcher, i, drafts in rows:
            fill_along(matcher, drafts, bitmask[i * (k + 1) : (i + 1) * (k + 1)])
        grammars.fill_seconds += time.perf_counter() - start
        grammars.num_fills += 1

    return fill
