"""After each step, on the host: append sampled tokens, detokenize incrementally, and decide
whether each sequence stops (EOS, stop token ids, stop strings, max_tokens, context length).

Stop strings are never emitted, even when split across tokens: text that could still turn out
to be the start of a stop string is held back until it can't.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.request import FinishReason, Request, SamplingParams
from engine.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass
class StopDecision:
    reason: FinishReason
    stop_reason: int | str | None = None


class SequenceOutput:
    """One sequence's text as it grows, and its stop checks."""

    def __init__(self, tokenizer: Tokenizer, params: SamplingParams, max_model_len: int):
        self._params = params
        self._eos = frozenset(() if params.ignore_eos else tokenizer.eos_token_ids)
        self._stop_ids = frozenset(params.stop_token_ids)
        self._max_model_len = max_model_len
        self._detokenizer = IncrementalDetokenizer(
            tokenizer, skip_special_tokens=params.skip_special_tokens
        )
        self._holdback = max((len(s) for s in params.stop), default=1) - 1
        self.text = ""  # everything decoded so far, cut at a stop string
        self.emitted = 0  # how much of `text` has been handed out

    def append(self, request: Request, token: int) -> StopDecision | None:
        """Records `token` (already appended to request.output_token_ids); returns why the
        sequence stops, or None."""
        num_out = len(request.output_token_ids)
        may_stop = num_out >= self._params.min_tokens
        if may_stop and token in self._eos:
            return StopDecision(FinishReason.STOP)
        if may_stop and token in self._stop_ids:
            if self._params.include_stop_str_in_output:
                self.text += self._detokenizer.add(token)
            return StopDecision(FinishReason.STOP, token)
        searched_from = max(len(self.text) - self._holdback, 0)
        self.text += self._detokenizer.add(token)
        if may_stop and self._params.stop:
            stop = self._find_stop_string(searched_from)
            if stop is not None:
                return stop
        if num_out >= self._params.max_tokens or request.num_tokens >= self._max_model_len:
            self.text += self._detokenizer.flush()
            return StopDecision(FinishReason.LENGTH)
        return None

    def _find_stop_string(self, start: int) -> StopDecision | None:
        hits = [(i, s) for s in self._params.stop if (i := self.text.find(s, start)) >= 0]
        if not hits:
            return None
        index, stop = min(hits)
        end = index + len(stop) if self._params.include_stop_str_in_output else index
        self.text = self.text[:end]
        return StopDecision(FinishReason.STOP, stop)

    def take_delta(self, finished: bool) -> str:
        """New text to hand out; while running, the tail that may begin a stop string waits."""
        end = (
            len(self.text) if finished or not self._params.stop else len(self.text) - self._holdback
        )
        if end <= self.emitted:
            return ""
        delta = self.text[self.emitted : end]
        self.emitted = end
        return delta
