"""64 concurrent streaming clients, a quarter of which hang up mid-stream: the others get the
same text as a non-streaming greedy run, and afterwards nothing runs and the KV cache is free."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time

import httpx

from tests.serving.openai_server import API_KEY

CLIENTS, MAX_TOKENS = 64, 12
# What a client that hangs up asks for: far more than it waits for, so its request is still
# running when it goes. With MAX_TOKENS, a client that fell behind could be handed the whole
# answer in one merged event and see [DONE] before its second event (a CI failure of e58efbc).
HANG_UP_MAX_TOKENS = 200  # of the server's 256-token context
HEADERS = {"Authorization": f"Bearer {API_KEY}"}


def _body(prompt: str, **extra) -> dict:
    return {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        **extra,
    }


async def _stream(client: httpx.AsyncClient, prompt: str, hang_up: bool) -> str | None:
    text, events = "", 0
    body = _body(prompt, stream=True, **({"max_tokens": HANG_UP_MAX_TOKENS} if hang_up else {}))
    async with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                return text
            event = json.loads(line.removeprefix("data: "))
            assert "error" not in event, event
            text += event["choices"][0]["text"]
            events += 1
            if hang_up and events == 2:
                return None  # leaving the block closes the connection mid-stream
    raise AssertionError("stream ended without [DONE]")


def _metric(body: str, name: str) -> float:
    match = re.search(rf"^xlaserve:{name}\{{[^}}]*\}} (\S+)$", body, re.MULTILINE)
    assert match, name
    return float(match.group(1))


def test_64_streams_with_a_quarter_hanging_up(openai_server) -> None:
    prompts = [f"Client {i} says" for i in range(CLIENTS)]
    hang_up = [i % 4 == 0 for i in range(CLIENTS)]

    async def main() -> tuple[list[str | None], list[str]]:
        limits = httpx.Limits(max_connections=CLIENTS + 4)
        async with httpx.AsyncClient(
            base_url=openai_server.url, headers=HEADERS, timeout=120, limits=limits
        ) as client:
            streamed = await asyncio.gather(
                *(_stream(client, p, h) for p, h in zip(prompts, hang_up, strict=True))
            )
            whole = await client.post("/v1/completions", json=_body(prompts))  # one batch
            texts = [c["text"] for c in sorted(whole.json()["choices"], key=lambda c: c["index"])]
        return streamed, texts

    streamed, expected = asyncio.run(main())
    for i, (got, want) in enumerate(zip(streamed, expected, strict=True)):
        if hang_up[i]:
            assert got is None
        else:
            assert got == want, f"client {i}"

    deadline = time.monotonic() + 10
    while True:  # aborts land within an engine step; allow a few
        body = httpx.get(f"{openai_server.url}/metrics").text
        idle = (
            _metric(body, "num_requests_running") == 0
            and _metric(body, "num_requests_waiting") == 0
        )
        if (idle and _metric(body, "kv_cache_usage_perc") == 0) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert _metric(body, "num_requests_running") == 0
    assert _metric(body, "num_requests_waiting") == 0
    assert _metric(body, "kv_cache_usage_perc") == 0
    assert httpx.get(f"{openai_server.url}/health").status_code == 200


def test_hanging_up_aborts_the_request(openai_server) -> None:
    """A client that goes away, streaming or not, stops its generation early."""
    n, max_tokens = 16, 240  # 3840 tokens: seconds of decoding, even on a fast machine
    body = _body("Long", max_tokens=max_tokens, n=n)

    def generated() -> float:
        return _metric(httpx.get(f"{openai_server.url}/metrics").text, "generation_tokens_total")

    async def hang_up(stream: bool, before: float) -> None:
        async with httpx.AsyncClient(base_url=openai_server.url, headers=HEADERS) as client:
            if stream:
                async with client.stream(
                    "POST", "/v1/completions", json={**body, "stream": True}
                ) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: "):
                            break
                return
            # Not streamed: it hangs up once its sequences decode (a fixed timeout would let a
            # fast machine finish half of them first).
            post = asyncio.ensure_future(client.post("/v1/completions", json=body))
            while not post.done():
                metrics = (await client.get("/metrics")).text
                if _metric(metrics, "generation_tokens_total") > before:
                    break
                await asyncio.sleep(0.01)
            post.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await post

    for stream in (True, False):
        before = generated()
        asyncio.run(hang_up(stream, before))
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            metrics = httpx.get(f"{openai_server.url}/metrics").text
            if _metric(metrics, "num_requests_running") == 0:
                break
            time.sleep(0.05)
        assert _metric(metrics, "num_requests_running") == 0
        assert _metric(metrics, "kv_cache_usage_perc") == 0
        assert generated() - before < n * max_tokens / 2, f"stream={stream}: it ran on"
