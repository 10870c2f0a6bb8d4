"""One request's outputs on their way from the engine loop to the coroutine that streams them
(vLLM's RequestOutputCollector): while that consumer is behind, the deltas that arrive wait,
and it takes them all as one merged output (one SSE event, one JSON dump, one write for the
client to parse) instead of one output per step. They are merged once, when taken: an
arriving delta costs a list append, however far behind its consumer is.

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
from collections.abc import Callable, Iterable, Sequence
from typing import Generic, TypeVar

from engine.request import CompletionOutput, RequestOutput

T = TypeVar("T")
D = TypeVar("D")  # a delta as it is delivered: a RequestOutput, or a compact form of one


class OutputCollector(Generic[D]):
    """The pending deltas (or error) of one request, for one consumer on `loop`; `merge` makes
    one output of the deltas that arrived since the consumer last took (`merge_outputs` for
    RequestOutputs; a compact wire form has its own)."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        merge: Callable[[Sequence[D]], RequestOutput],
    ):
        self.loop = loop
        self._merge = merge
        self._pending: list[D] = []
        self._error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None

    def put(self, item: D | BaseException) -> None:
        """Adds a delta or an error (what `get` returns once the pending deltas are taken)."""
        if isinstance(item, BaseException):
            self._error = self._error or item
        else:
            self._pending.append(item)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def get(self) -> RequestOutput | BaseException:
        """Everything that arrived since the last call, as one output (then the error, if one
        came); waits for something if nothing has."""
        while not self._pending and self._error is None:
            self._waiter = self.loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        if self._pending:
            pending, self._pending = self._pending, []
            return self._merge(pending)
        assert self._error is not None
        return self._error


def merge_outputs(outputs: Sequence[RequestOutput]) -> RequestOutput:
    """Consecutive deltas of one request as one: each choice's text, tokens and logprobs
    joined in order (choices in the order they first appear), the prompt's fields of the
    first delta that has them, the end (finished, reasons, usage) of the last."""
    if len(outputs) == 1:
        return outputs[0]
    runs: dict[int, list[CompletionOutput]] = {}
    for output in outputs:
        for choice in output.outputs:
            runs.setdefault(choice.index, []).append(choice)
    last = outputs[-1]
    return RequestOutput(
        last.request_id,
        [_join(run) for run in runs.values()],
        last.finished,
        prompt_token_ids=_first(o.prompt_token_ids for o in outputs),
        prompt_logprobs=_first(o.prompt_logprobs for o in outputs),
        usage=last.usage,
        arrival_time=_first(o.arrival_time for o in outputs),
        scheduled_time=_first(o.scheduled_time for o in outputs),
    )


def _join(run: list[CompletionOutput]) -> CompletionOutput:
    if len(run) == 1:
        return run[0]
    last = run[-1]
    return CompletionOutput(
        last.index,
        "".join(c.text for c in run),
        [t for c in run for t in c.token_ids],
        last.finish_reason,
        last.stop_reason,
        _join_logprobs(run),
    )


def _join_logprobs(run: list[CompletionOutput]) -> list[dict[int, float]] | None:
    """One entry per token of the run; a delta without logprobs may only lack tokens too."""
    if all(c.logprobs is None for c in run):
        return None
    joined: list[dict[int, float]] = []
    for delta in run:
        if delta.logprobs is None and delta.token_ids:
            raise ValueError(f"choice {delta.index}: a delta with tokens lacks their logprobs")
        joined += delta.logprobs or []
    return joined


def _first(values: Iterable[T | None]) -> T | None:
    return next((v for v in values if v is not None), None)
