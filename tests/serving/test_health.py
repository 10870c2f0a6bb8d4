"""Honest health: a step that hangs while a request waits turns `/health` to 503 and the gRPC
health to NOT_SERVING within the step timeout, with the reason (body, log line), and both come
back when the step finishes; an idle engine stays healthy for longer than the timeout.

In-process, over the shared tiny engine: the HTTP app through httpx's ASGI transport, the gRPC
server on 127.0.0.1; the step is made to hang with the runner's `before_step` hook."""

from __future__ import annotations

import asyncio
import logging
import re
import threading
import time
from collections.abc import Iterator

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine.llm_engine import LLMEngine
from serving.async_engine import AsyncEngine
from serving.grpc.server import HEALTH_POLL_S, start_grpc_server
from serving.openai import create_app

STEP_TIMEOUT = 1.5
SLACK = 2.0  # for the gRPC health poll and a loaded machine
Status = health_pb2.HealthCheckResponse
BODY = {"prompt": "Hello", "max_tokens": 6, "temperature": 0, "ignore_eos": True}


class Servers:
    def __init__(self, front: AsyncEngine) -> None:
        self.app = create_app(front, "tiny")
        self.grpc = start_grpc_server(front, 0, "tiny", host="127.0.0.1")
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.grpc.port}")
        self.health = health_pb2_grpc.HealthStub(self.channel)

    def http(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(transport=httpx.ASGITransport(app=self.app), base_url="http://t")

    def grpc_status(self) -> int:
        return self.health.Check(health_pb2.HealthCheckRequest(), timeout=10).status

    def close(self) -> None:
        self.channel.close()
        self.grpc.stop(grace=1)


@pytest.fixture
def servers(engine: LLMEngine) -> Iterator[Servers]:
    front = AsyncEngine(engine, step_timeout=STEP_TIMEOUT)
    servers = Servers(front)
    yield servers
    servers.close()
    front.shutdown(timeout=5)
    assert not engine.has_unfinished_requests()


@pytest.fixture
def steps_run(engine: LLMEngine) -> Iterator[threading.Event]:
    """While the event is clear, a step hangs (in the runner's hook, called before each step)."""
    steps_run = threading.Event()
    steps_run.set()
    engine.runner.before_step = lambda batch, options: steps_run.wait()
    yield steps_run
    steps_run.set()
    engine.runner.before_step = None


def _age(metrics: str) -> float:
    match = re.search(r"^xlaserve:last_step_age_seconds\{[^}]*\} (\S+)$", metrics, re.MULTILINE)
    assert match, metrics
    return float(match.group(1))


def test_a_hung_step_turns_health_unhealthy_then_a_finished_step_brings_it_back(
    servers: Servers, steps_run: threading.Event, caplog
) -> None:
    caplog.set_level(logging.INFO, logger="serving.async_engine")

    async def main() -> None:
        async with servers.http() as client:
            assert (await client.get("/health")).status_code == 200
            assert servers.grpc_status() == Status.SERVING
            steps_run.clear()
            started = time.monotonic()
            request = asyncio.create_task(client.post("/v1/completions", json=BODY))
            grpc_down = http_down = None
            while grpc_down is None or http_down is None:
                assert time.monotonic() - started < STEP_TIMEOUT + SLACK, "still healthy"
                health = await client.get("/health")
                if http_down is None and health.status_code == 503:
                    http_down, reason = time.monotonic() - started, health
                if grpc_down is None and servers.grpc_status() == Status.NOT_SERVING:
                    grpc_down = time.monotonic() - started
                await asyncio.sleep(0.05)
            assert http_down >= STEP_TIMEOUT and grpc_down >= STEP_TIMEOUT  # not before it
            assert reason.headers["Retry-After"]
            message = reason.json()["error"]["message"]
            assert "no engine step has finished" in message
            assert "the step timeout is 1.5 s" in message
            assert _age((await client.get("/metrics")).text) > STEP_TIMEOUT
            refused = await client.post("/v1/completions", json=BODY)
            assert refused.status_code == 503 and "no engine step" in refused.text
            assert not request.done()

            steps_run.set()  # the step finishes: health comes back, the request completes
            answer = (await asyncio.wait_for(request, timeout=60)).json()
            assert answer["usage"]["completion_tokens"] == BODY["max_tokens"]
            assert (await client.get("/health")).status_code == 200
            assert _age((await client.get("/metrics")).text) < STEP_TIMEOUT
        deadline = time.monotonic() + HEALTH_POLL_S + SLACK
        while servers.grpc_status() != Status.SERVING:
            assert time.monotonic() < deadline, "gRPC health did not come back"
            time.sleep(0.05)

    asyncio.run(main())
    logged = [r.getMessage() for r in caplog.records if r.name == "serving.async_engine"]
    assert any(m.startswith("engine unhealthy: no engine step has finished") for m in logged)
    assert any(m.startswith("engine healthy again") for m in logged)


def test_an_idle_engine_stays_healthy_past_the_step_timeout(
    servers: Servers, steps_run: threading.Event
) -> None:
    """Idle longer than the timeout: healthy. Then a request whose step hangs: the stall is
    counted from the request's arrival, not from the last step before the idle time."""

    async def main() -> None:
        async with servers.http() as client:
            done = await client.post("/v1/completions", json=BODY)  # busy once, then idle
            assert done.status_code == 200
            idle_since = time.monotonic()
            while time.monotonic() - idle_since < 2 * STEP_TIMEOUT + HEALTH_POLL_S:
                assert (await client.get("/health")).status_code == 200
                assert servers.grpc_status() == Status.SERVING
                await asyncio.sleep(0.1)
            assert _age((await client.get("/metrics")).text) > 2 * STEP_TIMEOUT
            steps_run.clear()
            request = asyncio.create_task(client.post("/v1/completions", json=BODY))
            await asyncio.sleep(STEP_TIMEOUT / 3)
            assert (await client.get("/health")).status_code == 200
            steps_run.set()
            assert (await asyncio.wait_for(request, timeout=60)).status_code == 200

    asyncio.run(main())
