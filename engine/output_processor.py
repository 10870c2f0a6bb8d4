"""After each step, on the host: append sampled tokens, detokenize incrementally, decide
whether each sequence stops (EOS, stop token ids, stop strings, max_tokens, context length),
and hand out what is new.

Stop strings are never emitted, even when split across tokens: text that could still turn out
to be the start of a stop string is held back until it can't. Only that unsent tail is kept
(the stop-string search never needs more), so each step's work is independent of how long the
sequence already is.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.detokenizer import Detokenizers
from engine.request import CompletionOutput, FinishReason, Request, SamplingParams
from engine.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass
class StopDecision:
    reason: FinishReason
    stop_reason: int | str | None = None


# `SequenceOutput.fast_delta`'s answer for a token it recorded whose delta is not due yet.
HELD = CompletionOutput(0, "", [])


class SequenceOutput:
    """One sequence's stop checks, and what of it has not been handed out yet."""

    # Touched for every running sequence every step: slots, not an instance dict.
    __slots__ = (
        "_detokenizer",
        "_eos",
        "_holdback",
        "_interval",
        "_max_model_len",
        "_num_sent_tokens",
        "_params",
        "_stop_ids",
        "_stopping",
        "_unsent",
        "_wants_logprobs",
    )

    def __init__(
        self,
        tokenizer: Tokenizer,
        params: SamplingParams,
        max_model_len: int,
        detokenizers: Detokenizers | None = None,
        stream_interval: int = 1,
    ):
        """`detokenizers`: the engine's, which share what they learn of each token's text
        (None: a detokenizer of this sequence's own). `stream_interval`: see `due`."""
        self._params = params
        self._interval = stream_interval
        self._eos = frozenset(() if params.ignore_eos else tokenizer.eos_token_ids)
        self._stop_ids = frozenset(params.stop_token_ids)
        self._stopping = self._eos | self._stop_ids  # ids that stop it once min_tokens is reached
        self._max_model_len = max_model_len
        skip = params.skip_special_tokens
        self._detokenizer = (
            IncrementalDetokenizer(tokenizer, skip_special_tokens=skip)
            if detokenizers is None
            else detokenizers.new(skip_special_tokens=skip)
        )
        self._holdback = max((len(s) for s in params.stop), default=1) - 1
        # Decoded text not handed out yet (cut at a stop string): at most the held-back tail
        # plus what the last step decoded.
        self._unsent = ""
        self._num_sent_tokens = 0
        self._wants_logprobs = params.logprobs is not None

    def append(self, request: Request, token: int) -> StopDecision | None:
        """Records `token` (already appended to request.output_token_ids); returns why the
        sequence stops, or None."""
        params = self._params
        num_out = len(request.output_token_ids)
        may_stop = num_out >= params.min_tokens
        if may_stop and token in self._stopping:
            if token in self._eos:
                return StopDecision(FinishReason.STOP)
            if params.include_stop_str_in_output:
                self._unsent += self._detokenizer.add(token)
            return StopDecision(FinishReason.STOP, token)
        if params.stop:
            # A stop string ending in the new text starts at most `holdback` characters before
            # it, which have not been handed out (take_delta keeps them).
            searched_from = max(len(self._unsent) - self._holdback, 0)
            self._unsent += self._detokenizer.add(token)
            if may_stop and (stop := self._find_stop_string(searched_from)) is not None:
                return stop
        else:
            self._unsent += self._detokenizer.add(token)
        if (
            num_out >= params.max_tokens
            or num_out + len(request.prompt_token_ids) >= self._max_model_len
        ):
            self._unsent += self._detokenizer.flush()
            return StopDecision(FinishReason.LENGTH)
        return None

    def due(self, request: Request) -> bool:
        """Whether the sequence hands out what it gained this step: its first token at once,
        then each time `stream_interval` tokens have gathered unsent (SGLang's
        --stream-interval; 1: every token). A sequence that finished always does (the caller's
        check)."""
        sent = self._num_sent_tokens
        return not sent or len(request.output_token_ids) - sent >= self._interval

    def fast_delta(self, request: Request, token: int) -> CompletionOutput | None:
        """For the only sequence of a request without stop strings or logprobs: `token`
        appended to request.output_token_ids, then `append` and, when `due`,
        `take_delta(request, 0)` in one (HELD when not due), for a token that neither may stop
        the sequence nor reaches its length (most tokens). None for any other token, with
        nothing recorded: the caller takes the general path."""
        ids = request.output_token_ids
        num_out = len(ids) + 1
        if (
            token in self._stopping
            or num_out >= self._params.max_tokens
            or num_out + len(request.prompt_token_ids) >= self._max_model_len
        ):
            return None
        ids.append(token)
        start = self._num_sent_tokens
        if start and num_out - start < self._interval:
            self._unsent += self._detokenizer.add(token)
            return HELD
        text, self._unsent = self._unsent + self._detokenizer.add(token), ""
        self._num_sent_tokens = num_out
        return CompletionOutput(0, text, ids[start:])

    def grammar_done(self) -> StopDecision:
        """The sequence's grammar (structured output) is complete: it stops, as at EOS."""
        self._unsent += self._detokenizer.flush()
        return StopDecision(FinishReason.STOP)

    def _find_stop_string(self, start: int) -> StopDecision | None:
        hits = [(i, s) for s in self._params.stop if (i := self._unsent.find(s, start)) >= 0]
        if not hits:
            return None
        index, stop = min(hits)
        end = index + len(stop) if self._params.include_stop_str_in_output else index
        self._unsent = self._unsent[:end]
        return StopDecision(FinishReason.STOP, stop)

    def take_delta(self, request: Request, index: int) -> CompletionOutput:
        """What `request` (choice `index`) gained since the last call: its new token ids and
        logprobs, and its new text except, while it runs, a tail that may begin a stop string
        (once finished, all the rest); the finish reason once finished."""
        reason = request.finish_reason
        text = self._take_text(reason is not None)
        start, self._num_sent_tokens = self._num_sent_tokens, len(request.output_token_ids)
        return CompletionOutput(
            index,
            text,
            request.output_token_ids[start:],
            None if reason is None else reason.value,
            request.stop_reason,
            request.logprobs[start:] if self._wants_logprobs else None,
        )

    def _take_text(self, finished: bool) -> str:
        if finished or not self._params.stop:  # nothing held back
            text, self._unsent = self._unsent, ""
            return text
        end = max(len(self._unsent) - self._holdback, 0)
        text, self._unsent = self._unsent[:end], self._unsent[end:]
        return text
