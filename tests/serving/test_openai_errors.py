"""Bad requests get their documented status and OpenAI's error shape, never a 500, and leave the
server healthy. The table runs against the real server; the loading and queue-full states are
checked on the app in-process with a stand-in engine."""

from __future__ import annotations

import asyncio
import json
import time
from types import SimpleNamespace

import httpx
import pytest

from engine.errors import InvalidRequestError
from engine.protocol import ModelInfo
from engine.tokenizer import Tokenizer, load_tokenizer
from serving.admission import AdmissionLimit, ServerBusyError
from serving.async_engine import LoopHealth
from serving.openai import create_app
from tests.engine.tiny_model import write_byte_tokenizer
from tests.serving.openai_server import API_KEY

CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
USER = [{"role": "user", "content": "hi"}]


def cmpl(**fields):
    return {"model": "tiny", "prompt": "hi", "max_tokens": 4, **fields}


def chat(**fields):
    return {"model": "tiny", "messages": USER, "max_tokens": 4, **fields}


AUTHORIZED = {"Authorization": f"Bearer {API_KEY}"}
FORM = {"Content-Type": "application/x-www-form-urlencoded", **AUTHORIZED}
NO_TYPE = {"Content-Type": "", **AUTHORIZED}


# (name, path, body: dict | bytes, headers, status, param)
CASES = [
    ("prompt of wrong type", CMPL, cmpl(prompt=5), None, 400, "prompt"),
    ("max_tokens not a number", CMPL, cmpl(max_tokens="ten"), None, 400, "max_tokens"),
    ("negative max_tokens", CMPL, cmpl(max_tokens=-1), None, 400, "max_tokens"),
    ("zero max_tokens", CMPL, cmpl(max_tokens=0), None, 400, "max_tokens"),
    ("huge max_tokens", CMPL, cmpl(max_tokens=10**9), None, 400, "input_tokens"),
    ("negative temperature", CMPL, cmpl(temperature=-0.5), None, 400, "temperature"),
    ("top_p over 1", CMPL, cmpl(top_p=1.5), None, 400, "top_p"),
    ("top_p zero", CHAT, chat(top_p=0), None, 400, "top_p"),
    ("n zero", CMPL, cmpl(n=0), None, 400, "n"),
    ("n too large", CMPL, cmpl(n=1000), None, 400, "n"),
    (
        "presence_penalty out of range",
        CMPL,
        cmpl(presence_penalty=5),
        None,
        400,
        "presence_penalty",
    ),
    ("logprobs over 20", CMPL, cmpl(logprobs=50), None, 400, "logprobs"),
    ("min_tokens over max_tokens", CMPL, cmpl(min_tokens=9), None, 400, "min_tokens"),
    ("empty stop string", CMPL, cmpl(stop=[""]), None, 400, "stop"),
    ("logit_bias key not a token", CMPL, cmpl(logit_bias={"abc": 1}), None, 400, "logit_bias"),
    ("logit_bias token out of vocab", CMPL, cmpl(logit_bias={"99999": 1}), None, 400, "logit_bias"),
    ("negative stop token id", CMPL, cmpl(stop_token_ids=[-1]), None, 400, "stop_token_ids[0]"),
    ("prompt token out of vocab", CMPL, cmpl(prompt=[1, 99999]), None, 400, "prompt"),
    ("empty prompt list", CMPL, cmpl(prompt=[]), None, 400, "prompt"),
    ("prompt over the context", CMPL, cmpl(prompt="x" * 300), None, 400, "input_tokens"),
    ("empty messages", CHAT, chat(messages=[]), None, 400, "messages"),
    ("no messages", CHAT, {"model": "tiny"}, None, 400, "messages"),
    (
        "unknown role",
        CHAT,
        chat(messages=[{"role": "wizard", "content": "x"}]),
        None,
        400,
        "messages[0].role",
    ),
    (
        "image content",
        CHAT,
        chat(
            messages=[
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
            ]
        ),
        None,
        400,
        "messages[0].content",
    ),
    ("top_logprobs without logprobs", CHAT, chat(top_logprobs=2), None, 400, "top_logprobs"),
    (
        "tools",
        CHAT,
        chat(tools=[{"type": "function", "function": {"name": "f"}}]),
        None,
        400,
        "tools",
    ),
    (
        "tool_choice naming no given tool",
        CHAT,
        chat(
            tools=[{"type": "function", "function": {"name": "f"}}],
            tool_choice={"type": "function", "function": {"name": "g"}},
        ),
        None,
        400,
        "tool_choice",
    ),
    (
        "response_format of an unknown type",
        CHAT,
        chat(response_format={"type": "xml"}),
        None,
        400,
        "response_format.type",
    ),
    (
        "two structured outputs",
        CMPL,
        cmpl(guided_regex="a", guided_choice=["b"]),
        None,
        400,
        "guided_choice",
    ),
    ("JSON schema that fails", CMPL, cmpl(guided_json={"type": "nope"}), None, 400, "json"),
    (
        "regex matching nothing",
        CHAT,
        chat(structured_outputs={"regex": "[a&&b]"}),
        None,
        400,
        "regex",
    ),
    ("best_of", CMPL, cmpl(best_of=3), None, 400, "best_of"),
    ("suffix", CMPL, cmpl(suffix="!"), None, 400, "suffix"),
    ("malformed JSON", CMPL, b'{"model": "tiny", "prompt": ', None, 400, None),
    ("NaN temperature", CMPL, b'{"prompt": "a", "temperature": NaN}', None, 400, "temperature"),
    ("body not an object", CMPL, b"[1, 2]", None, 400, None),
    ("lone surrogate in prompt", CMPL, b'{"prompt": "a\\ud800"}', None, 400, "prompt"),
    (
        "lone surrogate in a message",
        CHAT,
        b'{"messages": [{"role": "user", "content": "\\udc00"}]}',
        None,
        400,
        "messages[0].content",
    ),
    ("too many stop strings", CMPL, cmpl(stop=["x"] * 17), None, 400, "stop"),
    # Booleans are not coerced (OpenAI and vLLM refuse these too).
    ("stream as a string", CMPL, cmpl(stream="yes"), None, 400, "stream"),
    ("stream as a number in chat", CHAT, chat(stream=1), None, 400, "stream"),
    ("echo as a string", CMPL, cmpl(echo="true"), None, 400, "echo"),
    (
        "include_usage as a string",
        CHAT,
        chat(stream=True, stream_options={"include_usage": "yes"}),
        None,
        400,
        "stream_options.include_usage",
    ),
    (
        "stream_options without stream",
        CMPL,
        cmpl(stream_options={"include_usage": True}),
        None,
        400,
        "stream_options",
    ),
    (
        "stream_options with stream false",
        CHAT,
        chat(stream=False, stream_options={"include_usage": True}),
        None,
        400,
        "stream_options",
    ),
    (
        "user message without content",
        CHAT,
        chat(messages=[{"role": "user"}]),
        None,
        400,
        "messages[0].content",
    ),
    (
        "system message with null content",
        CHAT,
        chat(messages=[{"role": "system", "content": None}, *USER]),
        None,
        400,
        "messages[0].content",
    ),
    ("unknown model", CMPL, cmpl(model="gpt-9"), None, 404, "model"),
    ("unknown model in chat", CHAT, chat(model="gpt-9"), None, 404, "model"),
    ("missing API key", CMPL, cmpl(), {}, 401, None),
    ("wrong API key", CHAT, chat(), {"Authorization": "Bearer nope"}, 401, None),
    ("missing API key in chat", CHAT, chat(), {}, 401, None),
    ("empty body", CMPL, b"", None, 400, None),
    # A body is JSON only when its content type says so (as FastAPI reads a body parameter).
    ("form-encoded body", CMPL, json.dumps(cmpl()).encode(), FORM, 400, None),
    ("no content type", CHAT, json.dumps(chat()).encode(), NO_TYPE, 400, None),
    ("oversized body", CMPL, cmpl(prompt="a" * (2 * 2**20)), None, 413, None),
    ("detokenize out of vocab", "/detokenize", {"tokens": [99999]}, None, 400, "tokens"),
    ("tokenize with nothing", "/tokenize", {"model": "tiny"}, None, 400, "prompt"),
]

TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError"}


@pytest.fixture(scope="module")
def http(openai_server):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(base_url=openai_server.url, headers=headers, timeout=60) as client:
        yield client


def test_table_has_enough_cases() -> None:
    assert len(CASES) >= 25


@pytest.mark.parametrize(
    ("name", "path", "body", "headers", "status", "param"), CASES, ids=[c[0] for c in CASES]
)
def test_bad_request(http, name, path, body, headers, status, param) -> None:
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    if headers is not None:
        http_headers = {"Content-Type": "application/json", **headers}
        response = httpx.post(f"{http.base_url}{path}", headers=http_headers, timeout=60, **kwargs)
    else:
        response = http.post(path, headers={"Content-Type": "application/json"}, **kwargs)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status and error["param"] == param and error["message"]
    assert error["type"] == TYPES.get(status, error["type"])


def test_context_error_uses_vllms_wording(http) -> None:
    error = http.post(CMPL, json=cmpl(prompt="x" * 300, max_tokens=10)).json()["error"]
    assert error["message"].startswith(
        "This model's maximum context length is 256 tokens. However, you requested 10 output "
        "tokens and your prompt contains 301 input tokens"
    )


def test_server_healthy_and_serving_after_the_table(http) -> None:
    for name, path, body, headers, *_ in CASES:  # the whole table again, quickly
        kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
        if headers is None and name != "oversized body":
            http.post(path, headers={"Content-Type": "application/json"}, **kwargs)
    assert http.get("/health").status_code == 200
    out = http.post(CMPL, json=cmpl(max_tokens=3, ignore_eos=True)).json()
    assert out["usage"]["completion_tokens"] == 3


def test_null_stream_and_an_assistant_message_without_content_are_accepted(http) -> None:
    """What the strict checks above must not refuse (OpenAI accepts both)."""
    out = http.post(CMPL, json=cmpl(stream=None, echo=False)).json()
    assert out["object"] == "text_completion", out
    messages = [*USER, {"role": "assistant"}, {"role": "user", "content": "again"}]
    out = http.post(CHAT, json=chat(messages=messages, stream=False)).json()
    assert out["object"] == "chat.completion", out


def test_unknown_path_and_method(http) -> None:
    assert http.get("/v1/nothing").json()["error"]["code"] == 404
    response = http.get(CMPL)
    assert response.status_code == 405 and response.json()["error"]["code"] == 405


# ---- in-process: loading and a full queue --------------------------------------------------


class _StuckEngine:
    """Stands in for AsyncEngine: accepts requests and never answers them."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        info = ModelInfo("llama", 260, max_model_len=64, max_num_seqs=1, max_num_batched_tokens=8)
        self.engine = SimpleNamespace(tokenizer=tokenizer, model_info=lambda: info)

    def health(self) -> LoopHealth:
        return LoopHealth(ok=True, reason="", last_step_age_s=0.0, step_timeout_s=1.0)

    async def generate(self, request_id, prompt, params, *, priority=0, lora_name=None):
        await asyncio.Event().wait()
        yield  # pragma: no cover


@pytest.fixture(scope="module")
def byte_tokenizer(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tok")
    write_byte_tokenizer(directory)
    return load_tokenizer(directory)


def _assert_503(response: httpx.Response, words: str) -> None:
    assert response.status_code == 503, response.text
    assert int(response.headers["Retry-After"]) >= 1
    error = response.json()["error"]
    assert error["type"] == "ServiceUnavailableError" and error["code"] == 503
    assert words in error["message"], error


def test_health_and_requests_answer_503_while_loading(byte_tokenizer) -> None:
    async def main() -> None:
        app = create_app(None, "tiny")
        async with _client(app) as client:
            _assert_503(await client.get("/health"), "loading")
            _assert_503(await client.post(CMPL, json=cmpl()), "loading")

    asyncio.run(main())


def test_the_admission_limit_holds_and_every_way_out_gives_back(byte_tokenizer) -> None:
    """2 running + 1 waiting: a streamed and a whole request and a 2-prompt one fill it only
    as far as the limit; a client going away (streamed or not) gives its place back, and so
    does a stream whose body never ran."""
    limit = AdmissionLimit(max_running=2, max_queued=1)
    app = create_app(_StuckEngine(byte_tokenizer), "tiny", admission=limit)  # type: ignore[arg-type]

    async def main() -> None:
        async with _client(app) as client:
            whole = asyncio.create_task(client.post(CMPL, json=cmpl()))
            streamed = asyncio.create_task(client.post(CHAT, json=chat(stream=True)))
            await _until(lambda: limit.num_admitted == 2)
            _assert_503(await client.post(CMPL, json=cmpl(prompt=["a", "b"])), "server busy")
            assert limit.num_admitted == 2
            third = asyncio.create_task(client.post(CMPL, json=cmpl(prompt=[1, 2])))
            await _until(lambda: limit.num_admitted == 3)
            _assert_503(await client.post(CHAT, json=chat()), "server busy")
            for task in (whole, streamed, third):  # the clients go away
                task.cancel()
            await _until(lambda: limit.num_admitted == 0)
            await _send_nothing_of_a_stream(app)
            assert limit.num_admitted == 0

    asyncio.run(main())


async def _send_nothing_of_a_stream(app) -> None:
    """A streamed request whose client is gone before the response starts: the EventStream is
    returned, but its body is never iterated."""
    body = json.dumps(chat(stream=True)).encode()
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
        "scheme": "http", "path": CHAT, "raw_path": CHAT.encode(), "query_string": b"",
        "headers": [(b"content-type", b"application/json"), (b"host", b"app")],
        "server": ("app", 80), "client": ("test", 1), "root_path": "",
    }  # fmt: skip
    messages = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive():
        return messages.pop(0) if messages else await asyncio.Event().wait()

    async def send(message):
        raise OSError("the client is gone")

    with pytest.raises(BaseException):  # noqa: B017 - how the app reports a dead client varies
        await app(scope, receive, send)


async def _until(condition, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


def test_admission_counts_and_gives_back_exactly_once() -> None:
    limit = AdmissionLimit(max_running=2, max_queued=1)
    first = limit.admit(2)
    with pytest.raises(ServerBusyError, match="2 running \\+ 1 waiting"):
        limit.admit(2)
    with limit.admit(1):
        assert limit.num_admitted == 3
    assert limit.num_admitted == 2
    first.release()
    first.release()  # a second release gives nothing back
    assert limit.num_admitted == 0
    with pytest.raises(InvalidRequestError, match="at most 3"):
        limit.admit(4)  # could never be admitted: a 400, not a 503
    assert limit.num_admitted == 0


def _client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://app")


def test_error_events_are_json(http) -> None:
    # A stream that fails before it starts is a plain 400, not an event stream.
    response = http.post(CMPL, json=cmpl(stream=True, temperature=-1))
    assert response.status_code == 400 and json.loads(response.text)["error"]["param"]


def test_an_error_after_the_stream_began_is_an_event() -> None:
    from engine.errors import InvalidRequestError
    from serving.openai.generation import server_sent_events

    async def chunks():
        yield {"choices": []}
        raise InvalidRequestError("went wrong", param="prompt")

    async def main() -> list[bytes]:
        return [event async for event in server_sent_events(chunks())]

    first, error, done = asyncio.run(main())
    assert first == b'data: {"choices":[]}\n\n' and done == b"data: [DONE]\n\n"
    body = json.loads(error.removeprefix(b"data: "))
    assert body == {
        "error": {
            "message": "went wrong",
            "type": "BadRequestError",
            "param": "prompt",
            "code": 400,
        }
    }
