"""One chat request's tool use: the grammar its `tool_choice` adds to the sampling parameters,
and its answer (whole or streamed) read for tool calls by the server's parser."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from engine.request import SamplingParams
from serving.openai.errors import APIError
from serving.openai.protocol import ChatCompletionRequest
from serving.openai.tool_parsers import ToolCall, ToolCallStream, ToolParser, tool_parser
from serving.openai.tools import chosen, functions, tool_grammar


@dataclass(frozen=True)
class ChatSettings:
    """The server's chat settings: a template that replaces the model's (`--chat-template`),
    and the tool-call parser (`--tool-call-parser`; None: requests with tools are refused)."""

    template: str | None = None
    tool_call_parser: str | None = None

    def __post_init__(self) -> None:
        if self.tool_call_parser is not None:
            tool_parser(self.tool_call_parser)  # raises for an unknown name


@dataclass(frozen=True)
class ToolUse:
    """`parser` None: the request calls no tools (none given, or tool_choice none)."""

    parser: ToolParser | None = None
    parser_name: str = ""
    choice: str = "none"
    grammar: Any = None  # StructuredOutputs | None
    parallel: bool = True

    @classmethod
    def of(cls, body: ChatCompletionRequest, settings: ChatSettings) -> ToolUse:
        tools = functions(body.tools or [])
        choice = chosen(body.tool_choice, tools)
        if choice in (None, "none"):
            return cls()
        name = settings.tool_call_parser
        if name is None:
            raise APIError(400, "tool calling needs a server started with --tool-call-parser",
                           param="tools")  # fmt: skip
        grammar = tool_grammar(name, choice, tools, body.parallel_tool_calls)
        return cls(tool_parser(name), name, choice, grammar, body.parallel_tool_calls)

    def constrain(self, params: SamplingParams) -> SamplingParams:
        """`params` with the tool grammar (a 400 if the request asks for another format too:
        required and named calls are the format)."""
        if self.grammar is None:
            return params
        if params.structured_outputs is not None and self.choice != "auto":
            message = f"tool_choice {self.choice!r} cannot be combined with another format"
            raise APIError(400, message, param="tool_choice")
        if params.structured_outputs is not None:
            return params  # auto: the requested format wins; calls are still parsed
        return params.replace(structured_outputs=self.grammar)

    def calls(self, text: str) -> tuple[str | None, list[ToolCall]]:
        assert self.parser is not None
        content, calls = self.parser.parse(text)
        return content, calls if self.parallel else calls[:1]

    def message(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """The assistant message of a whole answer, and its finish reason (`tool_calls` when
        it made calls)."""
        if self.parser is None:
            return {"role": "assistant", "content": text}, finish_reason
        content, calls = self.calls(text)
        if not calls:
            return {"role": "assistant", "content": text}, finish_reason
        message = {
            "role": "assistant",
            "content": content,
            "tool_calls": [
                {
                    "id": _call_id(),
                    "type": "function",
                    "function": {"name": c.name, "arguments": c.arguments},
                }
                for c in calls
            ],
        }
        return message, "tool_calls"

    def streams(self) -> ChoiceStreams:
        return ChoiceStreams(self)


@dataclass
class ChoiceStreams:
    """Each streamed choice's tool-call reader."""

    tools: ToolUse
    _streams: dict[int, ToolCallStream] = field(default_factory=dict)

    def delta(
        self, index: int, text: str, finish_reason: str | None
    ) -> tuple[dict[str, Any], str | None]:
        """The chunk `delta` of choice `index` for its new `text`, and its finish reason."""
        parser = self.tools.parser
        if parser is None:
            return {"content": text}, finish_reason
        stream = self._streams.setdefault(index, ToolCallStream(parser, _call_id))
        content, calls = stream.feed(text, final=finish_reason is not None)
        if not self.tools.parallel:
            calls = [c for c in calls if c["index"] == 0]
        delta: dict[str, Any] = {"content": content}
        if calls:
            delta["tool_calls"] = calls
        if finish_reason is not None and stream.num_calls:
            finish_reason = "tool_calls"
        return delta, finish_reason


def _call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex[:24]}"
