# ruff: noqa: E501  (the answers and tools read better one per line)
"""Tool calls without a server: each parser reads hand-written answers (whole and streamed in
every split), and the tool_choice grammars on the tiny random model give calls that parse and
validate against their tools' schemas (a random model follows only what the grammar forces)."""

from __future__ import annotations

import itertools
import json
import random

import jsonschema
import pytest
from llguidance import LLMatcher

from engine.llm_engine import LLMEngine, run_to_completion
from engine.request import SamplingParams
from engine.structured.compiler import ll_tokenizer
from serving.openai.tool_parsers import ToolCall, ToolCallStream, tool_parser
from serving.openai.tools import Function, tool_grammar

ANSWERS = [
    (
        "hermes",
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "n": [1, {"a": "}"}]}}\n</tool_call>\n<tool_call>\n{"name":"add","arguments":{"a":1,"b":2}}\n</tool_call>',
        "Let me check.",
        [ToolCall("get_weather", '{"city": "Paris", "n": [1, {"a": "}"}]}'), ToolCall("add", '{"a":1,"b":2}')],
    ),
    ("hermes", "No tools needed: 2 < 3.", "No tools needed: 2 < 3.", []),
    (
        "llama3_json",
        '{"name": "add", "parameters": {"a": 1, "b": "x\\"}"}}; {"name": "neg", "parameters": {}}',
        None,
        [ToolCall("add", '{"a": 1, "b": "x\\"}"}'), ToolCall("neg", "{}")],
    ),
    ("llama3_json", "Paris is the capital.", "Paris is the capital.", []),
    (
        "pythonic",
        '[get_weather(city="Paris", metric=true), add(a=1, b=[2, None], c={"k": \'v)\'})]',
        None,
        [ToolCall("get_weather", '{"city": "Paris", "metric": true}'), ToolCall("add", '{"a": 1, "b": [2, null], "c": {"k": "v)"}}')],
    ),
    ("pythonic", "[1, 2] is a list.", "[1, 2] is a list.", []),
]  # fmt: skip


@pytest.mark.parametrize(("parser", "text", "content", "calls"), ANSWERS)
def test_parsers_read_whole_answers(parser, text, content, calls) -> None:
    assert tool_parser(parser).parse(text) == (content, calls)


def join_stream(parser: str, pieces: list[str]) -> tuple[str, list[tuple[str, str]], list[dict]]:
    """Streams `pieces`; returns the content and the calls joined from the deltas (as a client
    joins them: by index, the name from the first delta, argument fragments appended)."""
    ids = itertools.count()
    stream = ToolCallStream(tool_parser(parser), lambda: f"call_{next(ids)}")
    content, calls, deltas = "", {}, []
    for i, piece in enumerate(pieces):
        text, new = stream.feed(piece, final=i == len(pieces) - 1)
        content += text
        deltas += new
        for delta in new:
            call = calls.setdefault(delta["index"], ["", ""])
            if "id" in delta:
                assert call == ["", ""] and delta["type"] == "function"
                call[0] = delta["function"]["name"]
            call[1] += delta["function"]["arguments"]
    return content, [tuple(calls[i]) for i in sorted(calls)], deltas


@pytest.mark.parametrize(("parser", "text", "content", "calls"), ANSWERS)
def test_streamed_calls_equal_whole_ones(parser, text, content, calls) -> None:
    """In one piece, char by char and in random splits: the same calls as the whole answer,
    the name before any argument, and no content once calls have begun."""
    rng = random.Random(0)
    splits = [[text], list(text)]
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(text)), min(5, len(text) - 1)))
        splits.append([text[a:b] for a, b in itertools.pairwise([0, *cuts, len(text)])])
    for pieces in splits:
        streamed_content, streamed_calls, _ = join_stream(parser, pieces)
        assert streamed_calls == [(c.name, c.arguments) for c in calls], pieces
        if not calls:
            assert streamed_content == text
        elif content is not None:
            assert streamed_content.strip() == content


FUNCTIONS = [
    Function("get_weather", {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6}, "unit": {"enum": ["c", "f"]}}, "required": ["city", "unit"], "additionalProperties": False}),
    Function("add", {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}, "b": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["a", "b"], "additionalProperties": False}),
]  # fmt: skip


@pytest.mark.parametrize("parser", ["hermes", "llama3_json", "pythonic"])
@pytest.mark.parametrize("choice", ["required", "add"])
def test_tool_choice_grammars_give_valid_calls(engine: LLMEngine, parser, choice) -> None:
    """Random-model answers under each parser's grammar (sampled, 4 seeds, parallel calls
    allowed): they end, parse into calls of the right functions, and validate."""
    spec = tool_grammar(parser, choice, FUNCTIONS, parallel=False)
    ids = [f"tools-{parser}-{choice}-{seed}" for seed in range(4)]
    for seed, request_id in enumerate(ids):
        params = SamplingParams(temperature=1.0, seed=seed, max_tokens=200, structured_outputs=spec)
        engine.add_request(request_id, [72, 105, 33], params)
    schemas = {f.name: f.parameters for f in FUNCTIONS}
    for output in run_to_completion(engine, ids):
        text = output.outputs[0].text
        assert output.outputs[0].finish_reason == "stop", text
        _, calls = tool_parser(parser).parse(text)
        assert calls, text
        for call in calls:
            assert choice == "required" or call.name == choice
            jsonschema.validate(json.loads(call.arguments), schemas[call.name])


# ---- pythonic `auto` -------------------------------------------------------------------------

# (answer, whether the auto grammar takes it): free text, or calls from the first character on.
PYTHONIC_AUTO = [
    ("Paris is nice.", True),
    ("", True),
    ("  hello [x]", True),
    ("[add(a=1, b=2)]", True),
    ('[get_weather(city="Rome", unit="c"), add(a=3, b=4)]', True),
    ("[1, 2] is a list.", False),  # the parser would read it as calls: not free text
    (" [add(a=1, b=2)]", False),  # calls start at the first character
    ("[add(a=1)]", False),  # a required argument missing
    ("[add(a=100, b=2)]", False),  # out of the schema's range
    ("[mul(a=1, b=2)]", False),  # not a tool
]


def grammar_takes(tiny, spec, text: str) -> bool:
    """Whether llguidance's own matcher of `spec` takes `text` whole and may end there."""
    cfg, _, tokenizer = tiny
    matcher = LLMatcher(ll_tokenizer(tokenizer, cfg.vocab_size), spec.to_grammar(), log_level=0)
    tokens = tokenizer.encode(text, add_special_tokens=False)
    taken = all(matcher.consume_token(t) for t in tokens) and not matcher.is_error()
    return taken and matcher.is_accepting()


@pytest.mark.parametrize(("text", "taken"), PYTHONIC_AUTO)
def test_pythonic_auto_grammar_agrees_with_the_parser(tiny, text: str, taken: bool) -> None:
    """tool_choice auto in pythonic format: an answer the grammar takes is either free text
    (the parser finds no calls) or well-formed calls from its first character (the parser
    finds them, and they validate); what the parser would misread is refused."""
    spec = tool_grammar("pythonic", "auto", FUNCTIONS, parallel=True)
    assert grammar_takes(tiny, spec, text) == taken
    if not taken:
        return
    _, calls = tool_parser("pythonic").parse(text)
    assert bool(calls) == text.startswith("[")
    schemas = {f.name: f.parameters for f in FUNCTIONS}
    for call in calls:
        jsonschema.validate(json.loads(call.arguments), schemas[call.name])


def test_pythonic_auto_calls_are_well_formed(engine: LLMEngine) -> None:
    """Random-model answers under the pythonic auto grammar, pushed to begin a call (a logit
    bias on `[`): every one parses into calls that validate; unpushed ones are free text."""
    spec = tool_grammar("pythonic", "auto", FUNCTIONS, parallel=False)
    bracket = ord("[")  # the tiny tokenizer's byte tokens
    pushed = [f"auto-pushed-{seed}" for seed in range(3)]
    free = [f"auto-free-{seed}" for seed in range(2)]
    for seed, request_id in enumerate(pushed + free):
        bias = {bracket: 30.0} if request_id in pushed else None
        params = SamplingParams(temperature=1.0, seed=seed, max_tokens=60, logit_bias=bias,
                                structured_outputs=spec)  # fmt: skip
        engine.add_request(request_id, [72, 105, 33], params)
    schemas = {f.name: f.parameters for f in FUNCTIONS}
    outputs = run_to_completion(engine, pushed + free)
    for request_id, output in zip(pushed + free, outputs, strict=True):
        text = output.outputs[0].text
        _, calls = tool_parser("pythonic").parse(text)
        if request_id in free:
            assert not text.lstrip().startswith("[") or calls, text
            continue
        assert output.outputs[0].finish_reason == "stop" and calls, text
        for call in calls:
            jsonschema.validate(json.loads(call.arguments), schemas[call.name])
