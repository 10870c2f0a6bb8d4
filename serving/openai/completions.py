"""POST /v1/completions: one or more prompts (text or token ids), n choices each."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncGenerator, Sequence
from contextlib import aclosing
from typing import Any

from fastapi import APIRouter, Request

from engine.request import CompletionOutput, RequestOutput, SamplingParams
from engine.tokenizer import Tokenizer
from serving.openai.errors import APIError
from serving.openai.generation import (
    EventStream,
    deltas,
    final_outputs,
    merge,
    server_sent_events,
    until_disconnected,
    usage,
)
from serving.openai.logprobs import completion_logprobs
from serving.openai.params import refuse_unsupported, sampling_params
from serving.openai.protocol import MAX_PROMPTS, CompletionRequest
from serving.openai.routing import json_post
from serving.openai.state import ServerState

router = APIRouter()


@json_post(router, "/v1/completions", CompletionRequest)
async def create_completion(body: CompletionRequest, request: Request) -> Any:
    state: ServerState = request.app.state.server
    lora_name = state.check_model(body.model)
    refuse_unsupported(body)
    _, tokenizer = state.ready()
    prompts = _prompts(body.prompt, tokenizer)
    params = sampling_params(
        body, max_tokens=_max_tokens(body), logprobs=body.logprobs, vocab_size=state.vocab_size
    )
    for ids in prompts:
        state.check_prompt(ids, params)
    await state.compile_grammar(params)
    state.admit(request, len(prompts))
    request_id = f"cmpl-{uuid.uuid4().hex}"
    streams = [
        state.generate(f"{request_id}-{i}", ids, params, body.priority, lora_name)
        for i, ids in enumerate(prompts)
    ]
    echo = [tokenizer.decode(ids) for ids in prompts] if body.echo else None
    answer = _Answer(request_id, lora_name or state.served_model_name, tokenizer, params, echo)
    if body.stream:
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        chunks = answer.stream(merge(streams), include_usage)
        return EventStream(server_sent_events(chunks))
    outputs = await until_disconnected(request, final_outputs(streams))
    return answer.complete(outputs)


def _prompts(
    prompt: str | list[str] | list[int] | list[list[int]], tok: Tokenizer
) -> list[list[int]]:
    if isinstance(prompt, str):
        return [tok.encode(prompt)]
    if not prompt:
        raise APIError(400, "prompt must not be empty", param="prompt")
    if len(prompt) > MAX_PROMPTS:
        raise APIError(400, f"at most {MAX_PROMPTS} prompts per request", param="prompt")
    if isinstance(prompt[0], int):
        return [[int(t) for t in prompt]]
    return [tok.encode(p) if isinstance(p, str) else list(p) for p in prompt]


def _max_tokens(body: CompletionRequest) -> int:
    if body.max_tokens is None:
        return 16
    return body.max_tokens


class _Answer:
    """Formats a completion's outputs, whole or as stream chunks."""

    def __init__(
        self,
        request_id: str,
        model: str,
        tokenizer: Tokenizer,
        params: SamplingParams,
        echo: list[str] | None,
    ):
        self.request_id, self.model, self.tokenizer = request_id, model, tokenizer
        self.params, self.echo = params, echo
        self.created = int(time.time())

    def _envelope(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.request_id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def _logprobs(
        self, ids: Sequence[int], entries: Sequence[dict[int, float]] | None, offset: int
    ) -> Any:
        if entries is None or self.params.logprobs is None:
            return None
        return completion_logprobs(self.tokenizer, ids, entries, self.params.logprobs, offset)

    def complete(self, outputs: list[RequestOutput]) -> dict[str, Any]:
        choices = [
            self._choice(i * self.params.n + seq.index, i, seq)
            for i, output in enumerate(outputs)
            for seq in output.outputs
        ]
        return {**self._envelope(choices), "usage": usage(outputs)}

    def _choice(self, index: int, prompt_index: int, seq: CompletionOutput) -> dict[str, Any]:
        prefix = self.echo[prompt_index] if self.echo else ""
        return {
            "index": index,
            "text": prefix + seq.text,
            "logprobs": self._logprobs(seq.token_ids, seq.logprobs, len(prefix)),
            "finish_reason": seq.finish_reason,
            "stop_reason": seq.stop_reason,
        }

    async def stream(
        self, merged: AsyncGenerator[tuple[int, RequestOutput], None], include_usage: bool
    ) -> AsyncGenerator[dict[str, Any], None]:
        finals: dict[int, RequestOutput] = {}
        sent_chars: dict[int, int] = {}
        async with aclosing(deltas(merged, self.params.n)) as changes:
            async for delta, output in changes:
                prefix = self.echo[delta.prompt_index] if self.echo and delta.first else ""
                offset = sent_chars.get(delta.index, 0) + len(prefix)
                choice = {
                    "index": delta.index,
                    "text": prefix + delta.text,
                    "logprobs": self._logprobs(delta.token_ids, delta.logprobs, offset),
                    "finish_reason": delta.finish_reason,
                    "stop_reason": delta.stop_reason,
                }
                sent_chars[delta.index] = offset + len(delta.text)
                if output.finished:
                    finals[delta.prompt_index] = output
                yield {**self._envelope([choice]), **({"usage": None} if include_usage else {})}
        if include_usage:
            yield {**self._envelope([]), "usage": usage(list(finals.values()))}
