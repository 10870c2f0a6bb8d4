"""One request's outputs on their way from the engine loop to the coroutine that streams them
(vLLM's RequestOutputCollector): while that consumer is behind, the deltas that arrive are
merged into one pending output, so it takes several steps' tokens at once (one SSE event, one
JSON dump, one write for the client to parse) instead of one output per step.

Under load this is what keeps an API server from falling further behind the engine: the work
per stream per turn of the event loop stays one item however many steps passed. A consumer
that keeps up still gets one output per step. Merging keeps everything a consumer may join:
the text, token ids and logprobs of each choice concatenated in order (so the streamed text
equals the non-streamed text, and logprobs stay one per token), the prompt's fields of the
first delta, and `finished`, the finish and stop reasons and usage of the last.

Host code: never imports jax. `put` and `get` run on the consumer's event loop (engine threads
hand items over with `call_soon_threadsafe`).
"""

from __future__ import annotations

import asyncio
from typing import TypeVar

from engine.request import CompletionOutput, RequestOutput

T = TypeVar("T")


class OutputCollector:
    """The pending output (or error) of one request, for one consumer on `loop`."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._pending: RequestOutput | None = None
        self._error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None

    def put(self, item: RequestOutput | BaseException) -> None:
        """Adds a delta (merged into what is pending) or an error (what `get` returns once the
        pending output has been taken)."""
        if isinstance(item, BaseException):
            self._error = self._error or item
        elif self._pending is None:
            self._pending = item
        else:
            self._pending = merge_outputs(self._pending, item)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def get(self) -> RequestOutput | BaseException:
        """Everything that arrived since the last call, as one output (then the error, if one
        came); waits for something if nothing has."""
        while self._pending is None and self._error is None:
            self._waiter = self.loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        if self._pending is not None:
            output, self._pending = self._pending, None
            return output
        assert self._error is not None
        return self._error


def merge_outputs(earlier: RequestOutput, later: RequestOutput) -> RequestOutput:
    """Two consecutive deltas of one request as one: each choice's text, tokens and logprobs
    joined in order (choices in the order they first appear), the prompt's fields of the
    earlier delta, the end (finished, reasons, usage) of the later."""
    choices = {c.index: c for c in earlier.outputs}
    for choice in later.outputs:
        before = choices.get(choice.index)
        choices[choice.index] = choice if before is None else _join(before, choice)
    return RequestOutput(
        later.request_id,
        list(choices.values()),
        later.finished,
        prompt_token_ids=_first(earlier.prompt_token_ids, later.prompt_token_ids),
        prompt_logprobs=_first(earlier.prompt_logprobs, later.prompt_logprobs),
        usage=later.usage,
        arrival_time=_first(earlier.arrival_time, later.arrival_time),
        scheduled_time=_first(earlier.scheduled_time, later.scheduled_time),
    )


def _join(before: CompletionOutput, after: CompletionOutput) -> CompletionOutput:
    return CompletionOutput(
        after.index,
        before.text + after.text,
        before.token_ids + after.token_ids,
        after.finish_reason,
        after.stop_reason,
        _join_logprobs(before, after),
    )


def _join_logprobs(
    before: CompletionOutput, after: CompletionOutput
) -> list[dict[int, float]] | None:
    """One entry per token of both; a delta without logprobs may only lack tokens too."""
    if before.logprobs is None and after.logprobs is None:
        return None
    parts = []
    for delta in (before, after):
        if delta.logprobs is None and delta.token_ids:
            raise ValueError(f"choice {delta.index}: a delta with tokens lacks their logprobs")
        parts.append(delta.logprobs or [])
    return parts[0] + parts[1]


def _first(earlier: T | None, later: T | None) -> T | None:
    return earlier if earlier is not None else later
