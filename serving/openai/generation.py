"""Driving engine streams for HTTP: merging a request's prompts, turning growing outputs into
deltas, server-sent events, and giving up when the client goes away."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Sequence
from contextlib import aclosing, suppress
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import Request

from engine.request import RequestOutput
from serving.openai.errors import ClientDisconnected, as_api_error, error_body

T = TypeVar("T")
_DONE = object()


async def merge(streams: Sequence[AsyncIterator[T]]) -> AsyncGenerator[tuple[int, T], None]:
    """Items of all `streams` as they come, tagged with the stream's index. Closing (or
    cancelling) the merge cancels every stream, which aborts its engine request."""
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[T]) -> None:
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


async def final_outputs(streams: Sequence[AsyncIterator[RequestOutput]]) -> list[RequestOutput]:
    finals: dict[int, RequestOutput] = {}
    async with aclosing(merge(streams)) as merged:
        async for index, output in merged:
            finals[index] = output
    return [finals[i] for i in range(len(streams))]


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


@dataclass
class Delta:
    """What one choice gained since the last output."""

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
    """Growing outputs (each has the full text so far) -> per-choice deltas, one per change."""
    sent: dict[int, tuple[int, int]] = {}  # choice -> (characters, tokens) already sent
    done: set[int] = set()
    async for prompt_index, output in merged:
        for seq in output.outputs:
            index = prompt_index * n + seq.index
            if index in done:
                continue
            chars, tokens = sent.get(index, (0, 0))
            text, ids = seq.text[chars:], seq.token_ids[tokens:]
            if not text and not ids and seq.finish_reason is None and index in sent:
                continue
            logprobs = seq.logprobs[tokens:] if seq.logprobs is not None else None
            delta = Delta(
                index,
                prompt_index,
                text,
                ids,
                logprobs,
                seq.finish_reason,
                seq.stop_reason,
                first=index not in sent,
            )
            sent[index] = (len(seq.text), len(seq.token_ids))
            if seq.finish_reason is not None:
                done.add(index)
            yield delta, output


async def server_sent_events(chunks: AsyncGenerator[dict[str, Any], None]) -> AsyncIterator[str]:
    """`data: {json}` events ending in `data: [DONE]`; an error after the stream began is sent
    as a `data: {"error": ...}` event (the status line has already gone out)."""
    try:
        async with aclosing(chunks):
            async for chunk in chunks:
                yield f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"
    except Exception as e:
        error = as_api_error(e)
        body = error_body(error.status, error.message, error.param)
        yield f"data: {json.dumps(body)}\n\n"
    yield "data: [DONE]\n\n"


def usage(outputs: Sequence[RequestOutput]) -> dict[str, int]:
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(seq.token_ids) for o in outputs for seq in o.outputs)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }
