"""Backpressure under a burst, against a real `xlaserve serve --max-num-seqs 4
--max-queued-requests 4` (HTTP and gRPC on one engine): of 48 requests sent at once, 8 are
admitted (4 run, 4 wait) and complete in full; the other 40 are refused at once, HTTP with 503,
Retry-After and OpenAI's error shape, gRPC with RESOURCE_EXHAUSTED; the server is healthy
afterwards. The admitted requests are long (hundreds of steps), so that the whole burst is
answered before any of them could finish and free its place."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Iterator

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from serving.grpc.stubs import pb2, pb2_grpc
from tests.engine.tiny_model import write_tiny_checkpoint
from tests.serving.conftest import compilation_cache_dir
from tests.serving.openai_server import Server, free_port, running_server

RUNNING, QUEUED, BURST = 4, 4, 48
MAX_TOKENS = 240  # with the prompt, within --max-model-len 256


@pytest.fixture(scope="module")
def server(tmp_path_factory, request) -> Iterator[tuple[Server, int]]:
    directory = write_tiny_checkpoint(tmp_path_factory.mktemp("burst") / "tiny")
    log = tmp_path_factory.mktemp("logs") / "burst-server.log"
    grpc_port = free_port()
    limits = ["--max-num-seqs", str(RUNNING), "--max-queued-requests", str(QUEUED)]
    cache = compilation_cache_dir(request, tmp_path_factory)
    with running_server(directory, cache, log, *limits, "--grpc-port", str(grpc_port)) as s:
        yield s, grpc_port


class EngineLoad:
    """The server's own view, polled from /metrics while the burst runs: the most requests
    the engine held (running + waiting) and the most it ran at once."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.peak_held = self.peak_running = 0

    async def watch(self, client: httpx.AsyncClient, stop: asyncio.Event) -> None:
        while not stop.is_set():
            text = (await client.get(f"{self.url}/metrics")).text
            running, waiting = _metric(text, "num_requests_running"), _metric(text, "waiting")
            self.peak_held = max(self.peak_held, int(running + waiting))
            self.peak_running = max(self.peak_running, int(running))
            await asyncio.sleep(0.02)


def _metric(text: str, name: str) -> float:
    name = "num_requests_waiting" if name == "waiting" else name
    match = re.search(rf"^xlaserve:{name}\{{[^}}]*\}} (\S+)$", text, re.MULTILINE)
    assert match, name
    return float(match.group(1))


def _assert_healthy_and_serving(server: Server, grpc_port: int) -> None:
    assert httpx.get(f"{server.url}/health").status_code == 200
    with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    body = {"model": "tiny", "prompt": "after", "max_tokens": 3, "ignore_eos": True}
    response = httpx.post(f"{server.api}/completions", json=body, timeout=60)
    assert response.json()["usage"]["completion_tokens"] == 3


def test_an_http_burst_admits_running_plus_queued_and_refuses_the_rest(server) -> None:
    server, grpc_port = server
    body = {"model": "tiny", "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}

    async def main() -> tuple[list[httpx.Response], EngineLoad]:
        load, stop = EngineLoad(server.url), asyncio.Event()
        limits = httpx.Limits(max_connections=BURST + 4)
        async with httpx.AsyncClient(timeout=300, limits=limits) as client:
            watcher = asyncio.create_task(load.watch(client, stop))
            responses = await asyncio.gather(
                *(
                    client.post(f"{server.api}/completions", json={**body, "prompt": f"Burst {i}"})
                    for i in range(BURST)
                )
            )
            stop.set()
            await watcher
        return responses, load

    started = time.monotonic()
    responses, load = asyncio.run(main())
    admitted = [r for r in responses if r.status_code == 200]
    refused = [r for r in responses if r.status_code != 200]
    assert len(admitted) == RUNNING + QUEUED, [r.status_code for r in responses]
    assert load.peak_held == RUNNING + QUEUED and load.peak_running == RUNNING
    for response in admitted:
        (choice,) = response.json()["choices"]
        assert choice["finish_reason"] == "length"
        assert response.json()["usage"]["completion_tokens"] == MAX_TOKENS
    for response in refused:
        assert response.status_code == 503, response.text
        assert int(response.headers["Retry-After"]) >= 1
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["type"] == "ServiceUnavailableError" and error["code"] == 503
        assert "server busy" in error["message"]
    print(f"HTTP burst of {BURST}: answered in {time.monotonic() - started:.1f} s")
    _assert_healthy_and_serving(server, grpc_port)


def test_a_grpc_burst_admits_running_plus_queued_and_refuses_the_rest(server) -> None:
    server, grpc_port = server

    async def generate(stub: pb2_grpc.GenerationStub, i: int) -> tuple[grpc.StatusCode, int]:
        params = pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
        request = pb2.GenerateRequest(text=f"Burst {i}", sampling_params=params)
        tokens = 0
        try:
            async for message in stub.Generate(request, timeout=300):
                tokens += len(message.token_ids)
        except grpc.aio.AioRpcError as e:
            assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e
            assert "server busy" in (e.details() or "")
            return e.code(), tokens
        return grpc.StatusCode.OK, tokens

    async def main() -> tuple[list[tuple[grpc.StatusCode, int]], EngineLoad]:
        load, stop = EngineLoad(server.url), asyncio.Event()
        async with (
            grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}") as channel,
            httpx.AsyncClient(timeout=60) as client,
        ):
            watcher = asyncio.create_task(load.watch(client, stop))
            stub = pb2_grpc.GenerationStub(channel)
            results = await asyncio.gather(*(generate(stub, i) for i in range(BURST)))
            stop.set()
            await watcher
        return results, load

    results, load = asyncio.run(main())
    codes = [code for code, _ in results]
    assert codes.count(grpc.StatusCode.OK) == RUNNING + QUEUED, codes
    assert load.peak_held == RUNNING + QUEUED and load.peak_running == RUNNING
    assert codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) == BURST - RUNNING - QUEUED
    assert all(tokens == MAX_TOKENS for code, tokens in results if code == grpc.StatusCode.OK)
    _assert_healthy_and_serving(server, grpc_port)
