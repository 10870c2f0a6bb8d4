"""The official `openai` client, sync and async, against a real `xlaserve serve` process."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from engine.chat_template import apply_chat_template
from engine.tokenizer import load_tokenizer
from tests.serving.openai_server import API_KEY

GREEDY = {"temperature": 0, "max_tokens": 12, "extra_body": {"ignore_eos": True}}
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name a colour."},
    {"role": "assistant", "content": "Blue."},
    {"role": "user", "content": "Another."},
]


@pytest.fixture(scope="module")
def client(openai_server):
    return openai.OpenAI(base_url=openai_server.api, api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def tokenizer(openai_server):
    return load_tokenizer(_model_dir(openai_server))


def _model_dir(server):
    args = server.process.args
    return args[args.index("--model") + 1]


def test_models_lists_the_served_model(client) -> None:
    (model,) = client.models.list().data
    assert model.id == "tiny" and model.max_model_len == 256  # type: ignore[attr-defined]


def test_completion_text_and_usage(client, tokenizer) -> None:
    out = client.completions.create(model="tiny", prompt="Hello there", **GREEDY)
    (choice,) = out.choices
    assert choice.finish_reason == "length" and choice.text
    assert out.usage.prompt_tokens == len(tokenizer.encode("Hello there"))
    assert out.usage.completion_tokens == 12
    assert out.usage.total_tokens == out.usage.prompt_tokens + 12


def test_completion_stream_equals_whole(client) -> None:
    whole = client.completions.create(model="tiny", prompt="Stream me", **GREEDY)
    chunks = list(
        client.completions.create(
            model="tiny",
            prompt="Stream me",
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY,
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_token_id_prompts_and_prompt_lists(client, tokenizer) -> None:
    ids = tokenizer.encode("Hello there")
    by_ids = client.completions.create(model="tiny", prompt=ids, **GREEDY)
    by_text = client.completions.create(model="tiny", prompt="Hello there", **GREEDY)
    assert by_ids.choices[0].text == by_text.choices[0].text
    many = client.completions.create(model="tiny", prompt=["Hello there", "Other"], **GREEDY)
    assert [c.index for c in many.choices] == [0, 1]
    assert many.choices[0].text == by_text.choices[0].text
    batch = client.completions.create(model="tiny", prompt=[ids, ids], **GREEDY)
    assert {c.text for c in batch.choices} == {by_text.choices[0].text}


def test_chat_usage_counts_the_template(client, tokenizer) -> None:
    out = client.chat.completions.create(model="tiny", messages=MESSAGES, **GREEDY)
    prompt = apply_chat_template(tokenizer, MESSAGES)
    assert out.usage.prompt_tokens == len(tokenizer.encode(prompt, add_special_tokens=False))
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content and out.usage.completion_tokens == 12


def test_chat_stream_equals_whole(client) -> None:
    whole = client.chat.completions.create(model="tiny", messages=MESSAGES, **GREEDY)
    stream = client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        stream=True,
        stream_options={"include_usage": True},
        **GREEDY,
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage == whole.usage


def test_n2_seeded_sampling_is_reproducible(client) -> None:
    args = {"model": "tiny", "prompt": "Pick", "n": 2, "temperature": 1.0, "max_tokens": 10}
    args["extra_body"] = {"ignore_eos": True}
    first = client.completions.create(seed=7, **args)
    again = client.completions.create(seed=7, **args)
    other = client.completions.create(seed=8, **args)
    texts = [c.text for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1]
    assert texts == [c.text for c in again.choices]
    assert texts != [c.text for c in other.choices]
    assert first.usage.completion_tokens == 20


def test_chat_n2(client) -> None:
    out = client.chat.completions.create(
        model="tiny", messages=MESSAGES, n=2, temperature=1.0, seed=3, max_tokens=6
    )
    assert sorted(c.index for c in out.choices) == [0, 1]


def test_completion_logprobs(client) -> None:
    out = client.completions.create(model="tiny", prompt="Log", logprobs=3, **GREEDY)
    logprobs = out.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 12
    for chosen, top in zip(logprobs.token_logprobs, logprobs.top_logprobs, strict=True):
        assert 1 <= len(top) <= 3 and chosen <= 0  # byte tokens may decode alike
        assert chosen == pytest.approx(max(top.values()), abs=1e-5)  # greedy takes the top one


def test_chat_logprobs(client) -> None:
    out = client.chat.completions.create(
        model="tiny", messages=MESSAGES, logprobs=True, top_logprobs=2, **GREEDY
    )
    content = out.choices[0].logprobs.content
    assert len(content) == 12
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)


def test_stop_string_cuts_the_text(client) -> None:
    text = client.completions.create(model="tiny", prompt="Stop", **GREEDY).choices[0].text
    stop = text[4:6]
    out = client.completions.create(model="tiny", prompt="Stop", stop=[stop], **GREEDY)
    assert out.choices[0].text == text[: text.index(stop)]
    assert out.choices[0].finish_reason == "stop"


def test_async_client_chat_and_completion(openai_server) -> None:
    async def main() -> tuple[str, str, str]:
        aclient = openai.AsyncOpenAI(base_url=openai_server.api, api_key=API_KEY, max_retries=0)
        chat = await aclient.chat.completions.create(model="tiny", messages=MESSAGES, **GREEDY)
        parts = []
        stream = await aclient.completions.create(
            model="tiny", prompt="Async", stream=True, **GREEDY
        )
        async for chunk in stream:
            parts.append(chunk.choices[0].text)
        whole = await aclient.completions.create(model="tiny", prompt="Async", **GREEDY)
        await aclient.close()
        return chat.choices[0].message.content or "", "".join(parts), whole.choices[0].text

    chat, streamed, whole = asyncio.run(main())
    assert chat and streamed == whole


def test_tokenize_detokenize_round_trip(openai_server, tokenizer) -> None:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    ids = httpx.post(
        f"{openai_server.url}/tokenize", json={"prompt": "héllo"}, headers=headers
    ).json()
    assert ids["tokens"] == tokenizer.encode("héllo") and ids["count"] == len(ids["tokens"])
    text = httpx.post(
        f"{openai_server.url}/detokenize", json={"tokens": ids["tokens"]}, headers=headers
    ).json()
    assert text == {"prompt": "héllo"}


def test_metrics_are_exposed(openai_server, client) -> None:
    client.completions.create(model="tiny", prompt="Hi", **GREEDY)  # a first token, at least
    body = httpx.get(f"{openai_server.url}/metrics").text
    for name in (
        "xlaserve:num_requests_running",
        "xlaserve:num_requests_waiting",
        "xlaserve:kv_cache_usage_perc",
        "xlaserve:prefix_cache_queries_total",
        "xlaserve:prefix_cache_hits_total",
        "xlaserve:prompt_tokens_total",
        "xlaserve:generation_tokens_total",
        "xlaserve:num_preemptions_total",
        "xlaserve:compilations_total",
        "xlaserve:compilations_after_warmup_total",
        'xlaserve:startup_seconds{model_name="tiny",stage="healthy"}',
        'xlaserve:startup_seconds{model_name="tiny",stage="first_token"}',
        "xlaserve:time_to_first_token_seconds_bucket",
        "xlaserve:time_per_output_token_seconds_bucket",
        "xlaserve:e2e_request_latency_seconds_bucket",
        "xlaserve:request_queue_time_seconds_bucket",
    ):
        assert name in body, name
