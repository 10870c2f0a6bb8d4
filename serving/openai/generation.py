"""Driving engine streams for HTTP: merging a request's prompts, per-choice deltas (the
engine's outputs are deltas already: they pass through as they are), whole answers joined from
them, server-sent events, and giving up when the client goes away."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Awaitable, Sequence
from contextlib import aclosing, suppress
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec
from fastapi import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from engine.request import CompletionOutput, OutputAccumulator, RequestOutput, Usage
from serving.openai.errors import ClientDisconnected, as_api_error, error_body

T = TypeVar("T")
_DONE = object()


async def merge(
    streams: Sequence[AsyncGenerator[T, None]],
) -> AsyncGenerator[tuple[int, T], None]:
    """Items of all `streams` as they come, tagged with the stream's index. Closing (or
    cancelling) the merge cancels every stream, which aborts its engine request.

    A lone stream (most requests) is read directly, not through a task and a queue: besides
    the hand-offs saved per item, a consumer that falls behind (a slow client) then leaves the
    engine's deltas to be merged upstream (serving/collector.py) rather than queued here one
    by one."""
    if len(streams) == 1:
        async with aclosing(streams[0]) as only:
            async for item in only:
                yield 0, item
        return
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()

    async def pump(index: int, stream: AsyncGenerator[T, None]) -> None:
        try:
            async for item in stream:
                queue.put_nowait((index, item))
        except Exception as e:
            queue.put_nowait((index, e))
        finally:
            queue.put_nowait((index, _DONE))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is _DONE:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        with suppress(asyncio.CancelledError):
            await asyncio.gather(*tasks, return_exceptions=True)


async def final_outputs(
    streams: Sequence[AsyncGenerator[RequestOutput, None]],
) -> list[RequestOutput]:
    """Each stream's deltas joined into its whole output, in the order of `streams`."""
    joined = [OutputAccumulator() for _ in streams]
    async with aclosing(merge(streams)) as merged:
        async for index, output in merged:
            joined[index].add(output)
    return [accumulator.output() for accumulator in joined]


async def until_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Awaits `work`, cancelling it (and so aborting its engine requests) if the client
    disconnects first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with suppress(asyncio.CancelledError):
                await task
    if task.cancelled():
        raise ClientDisconnected()
    return task.result()


async def _wait_for_disconnect(request: Request) -> None:
    # The body has been read; what the server sends next is the disconnect (or nothing).
    while (await request.receive())["type"] != "http.disconnect":
        pass


@dataclass(frozen=True)
class Delta:
    """What one choice gained in one engine step."""

    index: int  # the choice: prompt index * n + sequence index
    prompt_index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None
    stop_reason: int | str | None
    first: bool  # the choice's first delta


async def deltas(
    merged: AsyncGenerator[tuple[int, RequestOutput], None], n: int
) -> AsyncGenerator[tuple[Delta, RequestOutput], None]:
    """The engine's outputs (deltas already) -> one Delta per choice that gained something,
    numbered across the merged prompts."""
    seen: set[int] = set()
    async for prompt_index, output in merged:
        for seq in output.outputs:
            index = prompt_index * n + seq.index
            first = index not in seen
            seen.add(index)
            yield _delta(index, prompt_index, seq, first=first), output


def _delta(index: int, prompt_index: int, seq: CompletionOutput, *, first: bool) -> Delta:
    return Delta(
        index,
        prompt_index,
        seq.text,
        seq.token_ids,
        seq.logprobs,
        seq.finish_reason,
        seq.stop_reason,
        first=first,
    )


_JSON = msgspec.json.Encoder()  # ~10x json.dumps on a chunk: one per streamed token


async def server_sent_events(
    chunks: AsyncGenerator[dict[str, Any], None],
) -> AsyncGenerator[bytes, None]:
    """`data: {json}` events ending in `data: [DONE]`; an error after the stream began is sent
    as a `data: {"error": ...}` event (the status line has already gone out)."""
    try:
        async with aclosing(chunks):
            async for chunk in chunks:
                yield b"data: %b\n\n" % _JSON.encode(chunk)
    except Exception as e:
        error = as_api_error(e)
        yield b"data: %b\n\n" % _JSON.encode(error_body(error.status, error.message, error.param))
    yield b"data: [DONE]\n\n"


class EventStream(Response):
    """A streamed answer of server-sent events (`server_sent_events`' bytes), as Starlette's
    StreamingResponse sends it, minus its anyio task group per answer: a plain task watches
    for the client's disconnect and cancels the streaming one, whose stream, closed, aborts
    its engine requests; the answer then ends as if sent. Beyond making the events, a 26-event
    answer took 33 against 192 µs of CPU (bench/event_stream.py); with 256 clients the server
    starts one to two answers per engine step."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncGenerator[bytes, None]):
        self.events = events
        self.status_code = 200
        self.background = None
        self.init_headers()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        streaming = asyncio.current_task()
        assert streaming is not None
        sending, gone = True, False

        async def watch() -> None:
            nonlocal gone
            while (await receive())["type"] != "http.disconnect":
                pass
            if sending:  # the streaming task waits inside the try below
                gone = True
                streaming.cancel()

        watcher = asyncio.ensure_future(watch())
        try:
            async with aclosing(self.events) as events:
                start = {"type": "http.response.start", "status": 200, "headers": self.raw_headers}
                await send(start)
                async for chunk in events:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not gone:
                raise
            streaming.uncancel()
        finally:
            sending = False  # before any other await: no cancel lands past this answer
            watcher.cancel()


def usage(outputs: Sequence[RequestOutput]) -> dict[str, int]:
    """OpenAI's usage of finished outputs (whole, or a stream's last deltas)."""
    counts = [_usage_of(o) for o in outputs]
    prompt = sum(u.prompt_tokens for u in counts)
    completion = sum(u.completion_tokens for u in counts)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def _usage_of(output: RequestOutput) -> Usage:
    if output.usage is None:
        raise ValueError(f"output of {output.request_id} has no usage: it has not finished")
    return output.usage
