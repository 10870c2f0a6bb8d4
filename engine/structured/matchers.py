"""The grammar state of an engine's constrained sequences: a matcher per sequence, the token
bitmasks of a batch's rows (computed on the host while the device runs the forward), and each
matcher advanced by the token its sequence sampled. Host code: never imports jax.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable

import numpy as np
from llguidance import LLExecutor, LLMatcher
from llguidance.numpy import fill_next_token_bitmask_par

from engine.scheduler import SchedulerOutput
from engine.structured.compiler import GrammarCompiler
from engine.structured.spec import StructuredOutputs

log = logging.getLogger(__name__)


class GrammarState(enum.Enum):
    RUNNING = "running"  # more tokens may follow
    DONE = "done"  # the grammar is complete and cannot be extended: the sequence stops
    ERROR = "error"  # the token broke the grammar (e.g. min_tokens banned the only way out)


class GrammarMatchers:
    """Matchers of one engine's constrained sequences, by sequence id. Called from the engine
    loop's thread only; masks of a batch's rows are computed in parallel by llguidance's
    executor (it drops the GIL)."""

    def __init__(self, compiler: GrammarCompiler):
        self.compiler = compiler
        self._matchers: dict[str, LLMatcher] = {}
        self._executor: LLExecutor | None = None
        self.fill_seconds = 0.0  # host time spent computing masks, summed
        self.num_fills = 0  # batches whose masks were computed

    def add(self, sequence_id: str, spec: StructuredOutputs) -> None:
        """Gives a sequence a matcher at the start of `spec`'s grammar (compiling it now if no
        one did). Raises InvalidRequestError for a grammar that does not compile."""
        self._matchers[sequence_id] = self.compiler.matcher(spec)

    def remove(self, sequence_id: str) -> None:
        self._matchers.pop(sequence_id, None)

    def __len__(self) -> int:
        return len(self._matchers)

    def get(self, sequence_id: str) -> LLMatcher | None:
        """The sequence's matcher (None: the sequence is free), for speculative decoding's
        proposals (engine/speculative/grammar.py), which leave it where they found it."""
        return self._matchers.get(sequence_id)

    def filler(self, out: SchedulerOutput) -> Callable[[np.ndarray], None] | None:
        """What writes the bitmask rows of `out`'s constrained sequences whose sample is kept
        (a prefill chunk's is not), or None if there are none (every row stays all ones)."""
        if not self._matchers:  # no sequence is constrained: no pass over the batch
            return None
        rows = [
            (matcher, i)
            for i, s in enumerate(out.scheduled)
            if s.completes_sequence and (matcher := self._matchers.get(s.request.request_id))
        ]
        if not rows:
            return None

        def fill(bitmask: np.ndarray) -> None:  # i32[S, W]
            start = time.perf_counter()
            fill_next_token_bitmask_par(self._executor_now(), rows, bitmask)
            self.fill_seconds += time.perf_counter() - start
            self.num_fills += 1

        return fill

    def advance(self, sequence_id: str, token: int) -> GrammarState | None:
        """Feeds a sampled token to the sequence's matcher (None: the sequence is free)."""
        matcher = self._matchers.get(sequence_id)
        if matcher is None:
            return None
        if not matcher.consume_token(token) or matcher.is_error():
            log.warning("sequence %s left its grammar: %s", sequence_id, matcher.get_error())
            return GrammarState.ERROR
        return GrammarState.DONE if matcher.is_stopped() else GrammarState.RUNNING

    def _executor_now(self) -> LLExecutor:
        if self._executor is None:
            self._executor = LLExecutor()
        return self._executor
