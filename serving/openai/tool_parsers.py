"""Tool calls read out of a model's text, whole or as it streams: `hermes` (`<tool_call>` JSON
`</tool_call>`), `llama3_json` (a bare JSON object with `name` and `parameters`, several joined
by `; `) and `pythonic` (a Python list of calls, `[f(a=1), g()]`).

Streaming is prefix-stable: a call's name is sent once it is known, then its arguments as they
grow, and every fragment sent is a prefix of the whole answer's arguments, so the deltas joined
equal the non-streamed calls. (For hermes and llama3_json the arguments are the raw JSON text
the model wrote; pythonic arguments are converted to JSON, so they go as one fragment once the
call is complete.)
"""

from __future__ import annotations

import ast
import json
import re
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field

PARSERS = ("hermes", "llama3_json", "pythonic")


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text of an object


@dataclass(frozen=True)
class Partial:
    """What can be told of an answer so far: content that is surely not part of a call, and
    the calls begun (a name not known yet is None; arguments so far)."""

    content: str
    calls: list[tuple[str | None, str]] = field(default_factory=list)


class ToolParser(ABC):
    @abstractmethod
    def partial(self, text: str, *, final: bool) -> Partial:
        """Reads `text` (the whole answer when `final`)."""

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """The answer's content (None when it is all calls) and its calls."""
        read = self.partial(text, final=True)
        calls = [ToolCall(name, args) for name, args in read.calls if name is not None]
        if not calls:
            return text, []
        return read.content.strip() or None, calls


def tool_parser(name: str) -> ToolParser:
    parsers: dict[str, type[ToolParser]] = {
        "hermes": HermesParser,
        "llama3_json": Llama3JsonParser,
        "pythonic": PythonicParser,
    }
    if name not in parsers:
        raise ValueError(f"unknown tool-call parser {name!r}; known: {', '.join(PARSERS)}")
    return parsers[name]()


# ---- JSON calls ------------------------------------------------------------------------------


def _json_end(text: str, start: int) -> int | None:
    """Where the JSON object or array at `start` ends (index past it), None if it has not."""
    depth, in_string, escaped = 0, False, False
    for i in range(start, len(text)):
        c = text[i]
        if in_string:
            in_string = escaped or c != '"'
            escaped = not escaped and c == "\\"
        elif c == '"':
            in_string = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


_NAME = re.compile(
    r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*'
)


def _json_call(body: str) -> tuple[str | None, str] | None:
    """A call written as `{"name": "f", "arguments": {...}}` (or `parameters`), possibly
    unfinished: (name, arguments so far); None if `body` is not shaped like one."""
    match = _NAME.match(body)
    if match is None:
        return None if _could_become_call(body) is False else (None, "")
    args_start = match.end()
    if args_start >= len(body):
        return json.loads(f'"{match.group(1)}"'), ""
    end = _json_end(body, args_start)
    return json.loads(f'"{match.group(1)}"'), body[args_start:end]


def _could_become_call(body: str) -> bool:
    stripped = body.lstrip()
    return not stripped or '{"name"'.startswith(stripped[:7].replace(" ", ""))


class HermesParser(ToolParser):
    START, END = "<tool_call>", "</tool_call>"

    def partial(self, text: str, *, final: bool) -> Partial:
        first = text.find(self.START)
        if first < 0:
            return Partial(text if final else _without_start_of(text, self.START))
        calls = []
        for chunk in text[first:].split(self.START)[1:]:
            body = chunk.split(self.END)[0]
            call = _json_call(body)
            if call is not None:
                calls.append(call)
        return Partial(text[:first], calls)


class Llama3JsonParser(ToolParser):
    SEPARATOR = "; "

    def partial(self, text: str, *, final: bool) -> Partial:
        stripped = text.lstrip().removeprefix("<|python_tag|>")
        if not stripped.startswith("{"):
            return Partial(text if final or stripped else "")
        calls, position = [], 0
        while position < len(stripped):
            call = _json_call(stripped[position:])
            if call is None:
                break
            calls.append(call)
            end = _json_end(stripped, position)
            if end is None:
                break
            position = end + len(self.SEPARATOR)
        return Partial("", calls)


class PythonicParser(ToolParser):
    def partial(self, text: str, *, final: bool) -> Partial:
        stripped = text.strip()
        if not stripped.startswith("["):
            return Partial(text if final or stripped else "")
        end = _python_list_end(stripped)
        if end is None:
            return Partial("")
        try:
            tree = ast.parse(stripped[:end], mode="eval").body
        except SyntaxError:
            return Partial(text if final else "")
        if not isinstance(tree, ast.List) or not all(_is_call(e) for e in tree.elts):
            return Partial(text if final else "")
        return Partial("", [_python_call(e) for e in tree.elts if isinstance(e, ast.Call)])


def _is_call(node: ast.expr) -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.args


def _python_call(node: ast.Call) -> tuple[str, str]:
    assert isinstance(node.func, ast.Name)
    args = {kw.arg: _python_value(kw.value) for kw in node.keywords if kw.arg is not None}
    return node.func.id, json.dumps(args, ensure_ascii=False)


_NAMED_CONSTANTS = {"true": True, "false": False, "null": None}


def _python_value(node: ast.expr) -> object:
    """A literal argument; JSON's true/false/null are read as Python's True/False/None."""
    if isinstance(node, ast.Name) and node.id in _NAMED_CONSTANTS:
        return _NAMED_CONSTANTS[node.id]
    if isinstance(node, ast.List):
        return [_python_value(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        return {
            _python_value(k): _python_value(v)
            for k, v in zip(node.keys, node.values, strict=True)
            if k is not None
        }
    return ast.literal_eval(node)


def _python_list_end(text: str) -> int | None:
    """Where the bracketed list at the start ends, skipping brackets in string literals."""
    depth, quote, escaped = 0, "", False
    for i, c in enumerate(text):
        if quote:
            quote = "" if c == quote and not escaped else quote
            escaped = not escaped and c == "\\"
        elif c in "\"'":
            quote = c
        elif c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def _without_start_of(text: str, marker: str) -> str:
    """`text` less a tail that may be the beginning of `marker` (held back while streaming)."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:size]):
            return text[:-size]
    return text


# ---- streaming -------------------------------------------------------------------------------


@dataclass
class _Sent:
    content: int = 0  # characters of content sent
    names: list[str] = field(default_factory=list)
    arguments: list[int] = field(default_factory=list)  # characters of each call's arguments


class ToolCallStream:
    """One choice's streamed answer read as it grows: what each new piece of text adds, as
    OpenAI's chat chunk `delta` fields (content, and tool_calls with index, id, type and name
    first, then argument fragments)."""

    def __init__(self, parser: ToolParser, call_id: Callable[[], str]):
        self._parser = parser
        self._text = ""
        self._sent = _Sent()
        self._call_id = call_id

    @property
    def num_calls(self) -> int:
        return len(self._sent.names)

    def feed(self, piece: str, *, final: bool = False) -> tuple[str, list[dict[str, object]]]:
        """New content, and tool-call deltas, after `piece`; `final` on the answer's end."""
        self._text += piece
        read = self._parser.partial(self._text, final=final)
        content = read.content[self._sent.content :]
        self._sent.content += len(content)
        return content, self._call_deltas(read)

    def _call_deltas(self, read: Partial) -> list[dict[str, object]]:
        deltas: list[dict[str, object]] = []
        sent = self._sent
        for index, (name, args) in enumerate(read.calls):
            if name is None:
                break
            if index == len(sent.names):
                sent.names.append(name)
                sent.arguments.append(0)
                deltas.append({
                    "index": index,
                    "id": self._call_id(),
                    "type": "function",
                    "function": {"name": name, "arguments": ""},
                })  # fmt: skip
            fragment = args[sent.arguments[index] :]
            if fragment:
                sent.arguments[index] = len(args)
                deltas.append({"index": index, "function": {"arguments": fragment}})
        return deltas
