"""Tool calling for chat completions: the grammar that enforces `tool_choice` (`required`, a
named function; `auto` once a call begins) in the format of the server's tool-call parser,
and the chat templates with tools that xlaserve ships (`--chat-template hermes` for SmolLM2,
whose own template has none; `gemma3_pythonic` for Gemma 3).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.structured.spec import StructuredOutputs
from serving.openai.errors import APIError

TEMPLATES = {
    "hermes": "hermes_chatml.jinja",
    "gemma3_pythonic": "gemma3_pythonic.jinja",
}
_TEMPLATE_DIR = Path(__file__).parent / "templates"
# Tool-call JSON is written compactly (no whitespace between its tokens), as structured output.
_COMPACT = {"x-guidance": {"whitespace_flexible": False}}


def chat_template(name_or_path: str) -> str:
    """A shipped template by name, or a jinja file's text."""
    if name_or_path in TEMPLATES:
        return (_TEMPLATE_DIR / TEMPLATES[name_or_path]).read_text()
    return Path(name_or_path).read_text()


@dataclass(frozen=True)
class Function:
    name: str
    parameters: dict[str, Any]  # a JSON schema of the arguments object


def functions(tools: list[dict[str, Any]]) -> list[Function]:
    """The request's tools (OpenAI's `{"type": "function", "function": {...}}`); a 400 naming
    the tool that is malformed."""
    found = []
    for i, tool in enumerate(tools):
        function = tool.get("function")
        if tool.get("type") != "function" or not isinstance(function, dict):
            raise APIError(400, "tools must be of type 'function' with a function object",
                           param=f"tools[{i}]")  # fmt: skip
        name, parameters = function.get("name"), function.get("parameters") or {"type": "object"}
        if not isinstance(name, str) or not name or not isinstance(parameters, dict):
            raise APIError(400, "a tool's function needs a name and a parameters object",
                           param=f"tools[{i}].function")  # fmt: skip
        found.append(Function(name, parameters))
    return found


def chosen(tool_choice: str | dict[str, Any] | None, tools: list[Function]) -> str | None:
    """`none`, `auto`, `required`, or the name of the function that must be called (the
    default: `auto` with tools, `none` without)."""
    if tool_choice is None:
        return "auto" if tools else "none"
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise APIError(400, f"tool_choice {tool_choice!r} must be none, auto, required or "
                           "a function", param="tool_choice")  # fmt: skip
        if tool_choice != "none" and not tools:
            raise APIError(400, f"tool_choice {tool_choice!r} needs tools", param="tool_choice")
        return tool_choice
    name = (tool_choice.get("function") or {}).get("name")
    if name not in {f.name for f in tools}:
        raise APIError(400, f"tool_choice names the function {name!r}, which is not in tools",
                       param="tool_choice")  # fmt: skip
    return str(name)


def tool_grammar(
    parser: str, choice: str, tools: list[Function], parallel: bool
) -> StructuredOutputs | None:
    """The constraint that `choice` puts on the answer in `parser`'s format: one or more calls
    (one when not `parallel`) for `required` or a named function; for `auto`, free text in
    which a call, once its start is written, is well-formed (pythonic: an answer that begins
    with `[` is a list of calls, as the pythonic parser reads it)."""
    if choice == "none":
        return None
    if choice == "auto" and parser == "pythonic":
        return StructuredOutputs(grammar=_pythonic_auto(tools, parallel))
    if choice == "auto":
        return _auto(parser, tools)
    if choice != "required":
        tools = [f for f in tools if f.name == choice]
    if parser == "pythonic":
        return StructuredOutputs(grammar=_pythonic_calls(tools, parallel))
    key = "arguments" if parser == "hermes" else "parameters"
    call = json.dumps({"anyOf": [_call_schema(f, key) for f in tools], **_COMPACT})
    if parser == "hermes":
        item, separator = "call", r'"\n"'
        rules = r'call: "<tool_call>\n" body "\n</tool_call>"' + "\n"
    else:
        item, separator, rules = "body", '"; "', ""
    start = f"start: {item} ({separator} {item})*" if parallel else f"start: {item}"
    return StructuredOutputs(grammar=f"{start}\n{rules}body: %json {call}\n")


def _call_schema(function: Function, key: str) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"name": {"const": function.name}, key: function.parameters},
        "required": ["name", key],
        "additionalProperties": False,
    }


def _auto(parser: str, tools: list[Function]) -> StructuredOutputs:
    if parser == "hermes":
        trigger, end = "<tool_call>", "}\n</tool_call>"
        begin = '<tool_call>\n{"name": "%s", "arguments": '
    else:
        trigger, end = '{"name": ', "}"
        begin = '{"name": "%s", "parameters": '
    structures = [
        {"begin": begin % f.name, "schema": {**f.parameters, **_COMPACT}, "end": end} for f in tools
    ]
    tag = {"type": "structural_tag", "structures": structures, "triggers": [trigger]}
    return StructuredOutputs(structural_tag=json.dumps(tag))


def _pythonic_auto(tools: list[Function], parallel: bool) -> str:
    """Lark: an answer whose first character other than whitespace is `[` (which the pythonic
    parser reads as calls) is a list of calls, with no whitespace before it; any other answer
    is free text. (Free text cannot start with `[`: the parser would take it for calls.)"""
    calls = _pythonic_calls(tools, parallel).replace("start: ", "calls: ", 1)
    return "start: calls | TEXT\n" + r"TEXT: /\s*([^\[\s][\s\S]*)?/" + "\n" + calls


def _pythonic_calls(tools: list[Function], parallel: bool) -> str:
    """Lark: `[f(a=<json>, b=<json>), ...]` with each required argument, in the schema's
    order, following its schema."""
    rules = []
    for i, f in enumerate(tools):
        properties = f.parameters.get("properties") or {}
        required = [p for p in properties if p in set(f.parameters.get("required") or [])]
        parts = []
        for j, name in enumerate(required):
            prefix = ", " if j else ""
            parts.append(f'"{prefix}{name}=" v{i}_{j}')
            schema = {**properties[name], **_COMPACT}
            rules.append(f"v{i}_{j}: %json {json.dumps(schema)}")
        body = " ".join(parts)
        rules.append(f'f{i}: "{f.name}(" {body} ")"')
    calls = " | ".join(f"f{i}" for i in range(len(tools)))
    start = 'start: "[" call (", " call)* "]"' if parallel else 'start: "[" call "]"'
    return "\n".join([start, f"call: {calls}", *rules]) + "\n"
