"""POST /v1/chat/completions: messages rendered with the model's chat template."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncGenerator, Sequence
from contextlib import aclosing
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from engine.chat_template import apply_chat_template
from engine.request import RequestOutput, SamplingParams
from engine.tokenizer import Tokenizer
from serving.openai.errors import APIError
from serving.openai.generation import (
    deltas,
    final_outputs,
    merge,
    server_sent_events,
    until_disconnected,
    usage,
)
from serving.openai.logprobs import chat_logprobs
from serving.openai.params import refuse_unsupported, sampling_params
from serving.openai.protocol import ChatCompletionRequest, ChatMessage, TextPart
from serving.openai.state import ServerState

router = APIRouter()


@router.post("/v1/chat/completions")
async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Any:
    state: ServerState = request.app.state.server
    lora_name = state.check_model(body.model)
    refuse_unsupported(body)
    _, tokenizer = state.ready()
    prompt_ids = chat_prompt_ids(tokenizer, body.messages, body.add_generation_prompt)
    requested = body.max_completion_tokens or body.max_tokens
    max_tokens = (
        requested if requested is not None else max(state.max_model_len - len(prompt_ids), 1)
    )
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    params = sampling_params(
        body, max_tokens=max_tokens, logprobs=logprobs, vocab_size=state.vocab_size
    )
    state.check_prompt(prompt_ids, params)
    state.admit(request, 1)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    stream = state.generate(request_id, prompt_ids, params, body.priority, lora_name)
    answer = _ChatAnswer(request_id, lora_name or state.served_model_name, tokenizer, params)
    if body.stream:
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        chunks = answer.stream(merge([stream]), include_usage)
        return StreamingResponse(server_sent_events(chunks), media_type="text/event-stream")
    (output,) = await until_disconnected(request, final_outputs([stream]))
    return answer.complete(output)


def chat_prompt_ids(
    tokenizer: Tokenizer, messages: Sequence[ChatMessage], add_generation_prompt: bool = True
) -> list[int]:
    rendered = [{"role": m.role, "content": _content(m, i)} for i, m in enumerate(messages)]
    text = apply_chat_template(tokenizer, rendered, add_generation_prompt=add_generation_prompt)
    # The template writes the special tokens (BOS included) itself.
    return tokenizer.encode(text, add_special_tokens=False)


def _content(message: ChatMessage, index: int) -> str:
    if message.content is None:
        return ""
    if isinstance(message.content, str):
        return message.content
    texts = []
    for part in message.content:
        if not isinstance(part, TextPart):
            raise APIError(
                400,
                f"content parts of type {part.type!r} are not supported; only 'text'",
                param=f"messages[{index}].content",
            )
        texts.append(part.text)
    return "".join(texts)


class _ChatAnswer:
    def __init__(self, request_id: str, model: str, tokenizer: Tokenizer, params: SamplingParams):
        self.request_id, self.model, self.tokenizer, self.params = (
            request_id,
            model,
            tokenizer,
            params,
        )
        self.created = int(time.time())

    def _envelope(self, kind: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.request_id,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def _logprobs(self, ids: Sequence[int], entries: Sequence[dict[int, float]] | None) -> Any:
        if entries is None or self.params.logprobs is None:
            return None
        return chat_logprobs(self.tokenizer, ids, entries, self.params.logprobs)

    def complete(self, output: RequestOutput) -> dict[str, Any]:
        choices = [
            {
                "index": seq.index,
                "message": {"role": "assistant", "content": seq.text},
                "logprobs": self._logprobs(seq.token_ids, seq.logprobs),
                "finish_reason": seq.finish_reason,
                "stop_reason": seq.stop_reason,
            }
            for seq in output.outputs
        ]
        return {**self._envelope("chat.completion", choices), "usage": usage([output])}

    async def stream(
        self, merged: AsyncGenerator[tuple[int, RequestOutput], None], include_usage: bool
    ) -> AsyncGenerator[dict[str, Any], None]:
        extra: dict[str, Any] = {"usage": None} if include_usage else {}
        final: RequestOutput | None = None
        async with aclosing(deltas(merged, self.params.n)) as changes:
            async for delta, output in changes:
                message: dict[str, Any] = {"content": delta.text}
                if delta.first:
                    message = {"role": "assistant", **message}
                choice = {
                    "index": delta.index,
                    "delta": message,
                    "logprobs": self._logprobs(delta.token_ids, delta.logprobs),
                    "finish_reason": delta.finish_reason,
                    "stop_reason": delta.stop_reason,
                }
                final = output if output.finished else final
                yield {**self._envelope("chat.completion.chunk", [choice]), **extra}
        if include_usage and final is not None:
            yield {**self._envelope("chat.completion.chunk", []), "usage": usage([final])}
