"""POST /v1/chat/completions: messages rendered with the model's chat template."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncGenerator, Sequence
from contextlib import aclosing
from typing import Any

from fastapi import APIRouter, Request

from engine.chat_template import render_chat
from engine.request import RequestOutput, SamplingParams
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
from serving.openai.logprobs import chat_logprobs
from serving.openai.params import refuse_unsupported, sampling_params
from serving.openai.protocol import ChatCompletionRequest, ChatMessage, TextPart, ToolCallBody
from serving.openai.routing import json_post
from serving.openai.state import ServerState
from serving.openai.tool_use import ToolUse

router = APIRouter()


@json_post(router, "/v1/chat/completions", ChatCompletionRequest)
async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Any:
    state: ServerState = request.app.state.server
    lora_name = state.check_model(body.model)
    refuse_unsupported(body)
    _, tokenizer = state.ready()
    tools = ToolUse.of(body, state.chat)
    prompt_ids = chat_prompt_ids(
        tokenizer, body.messages, body.add_generation_prompt, state.chat.template, body.tools
    )
    requested = body.max_completion_tokens or body.max_tokens
    max_tokens = (
        requested if requested is not None else max(state.max_model_len - len(prompt_ids), 1)
    )
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    params = tools.constrain(
        sampling_params(body, max_tokens=max_tokens, logprobs=logprobs, vocab_size=state.vocab_size)
    )
    state.check_prompt(prompt_ids, params)
    await state.compile_grammar(params)
    state.admit(request, 1)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    stream = state.generate(request_id, prompt_ids, params, body.priority, lora_name)
    answer = _ChatAnswer(request_id, lora_name or state.served_model_name, tokenizer, params, tools)
    if body.stream:
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        chunks = answer.stream(merge([stream]), include_usage)
        return EventStream(server_sent_events(chunks))
    (output,) = await until_disconnected(request, final_outputs([stream]))
    return answer.complete(output)


def chat_prompt_ids(
    tokenizer: Tokenizer,
    messages: Sequence[ChatMessage],
    add_generation_prompt: bool = True,
    template: str | None = None,
    tools: list[dict[str, Any]] | None = None,
) -> list[int]:
    """The prompt of `messages` under `template` (None: the model's own), with `tools` for
    templates that list them."""
    rendered = [_message(m, i) for i, m in enumerate(messages)]
    extra = {"tools": tools} if tools else {}
    text = render_chat(
        template or tokenizer.chat_template,
        rendered,
        add_generation_prompt=add_generation_prompt,
        bos_token=tokenizer.bos_token,
        eos_token=tokenizer.eos_token,
        **extra,
    )
    # The template writes the special tokens (BOS included) itself.
    return tokenizer.encode(text, add_special_tokens=False)


def _message(message: ChatMessage, index: int) -> dict[str, Any]:
    """A message as chat templates read it: the calls of an assistant message with their
    arguments as objects (templates write them out), a tool message's call id."""
    rendered: dict[str, Any] = {"role": message.role, "content": _content(message, index)}
    if message.tool_calls:
        rendered["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.function.name, "arguments": _arguments(call, index)},
            }
            for call in message.tool_calls
        ]
    if message.tool_call_id is not None:
        rendered["tool_call_id"] = message.tool_call_id
    return rendered


def _arguments(call: ToolCallBody, index: int) -> Any:
    try:
        return json.loads(call.function.arguments)
    except json.JSONDecodeError:
        raise APIError(400, "a tool call's arguments must be JSON text",
                       param=f"messages[{index}].tool_calls") from None  # fmt: skip


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
    def __init__(
        self,
        request_id: str,
        model: str,
        tokenizer: Tokenizer,
        params: SamplingParams,
        tools: ToolUse,
    ):
        self.request_id, self.model, self.tokenizer, self.params = (
            request_id,
            model,
            tokenizer,
            params,
        )
        self.tools = tools
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
        choices = []
        for seq in output.outputs:
            message, finish_reason = self.tools.message(seq.text, seq.finish_reason)
            choices.append({
                "index": seq.index,
                "message": message,
                "logprobs": self._logprobs(seq.token_ids, seq.logprobs),
                "finish_reason": finish_reason,
                "stop_reason": seq.stop_reason,
            })  # fmt: skip
        return {**self._envelope("chat.completion", choices), "usage": usage([output])}

    async def stream(
        self, merged: AsyncGenerator[tuple[int, RequestOutput], None], include_usage: bool
    ) -> AsyncGenerator[dict[str, Any], None]:
        extra: dict[str, Any] = {"usage": None} if include_usage else {}
        final: RequestOutput | None = None
        streams = self.tools.streams()
        async with aclosing(deltas(merged, self.params.n)) as changes:
            async for delta, output in changes:
                message, finish_reason = streams.delta(delta.index, delta.text, delta.finish_reason)
                if delta.first:
                    message = {"role": "assistant", **message}
                choice = {
                    "index": delta.index,
                    "delta": message,
                    "logprobs": self._logprobs(delta.token_ids, delta.logprobs),
                    "finish_reason": finish_reason,
                    "stop_reason": delta.stop_reason,
                }
                final = output if output.finished else final
                yield {**self._envelope("chat.completion.chunk", [choice]), **extra}
        if include_usage and final is not None:
            yield {**self._envelope("chat.completion.chunk", []), "usage": usage([final])}
