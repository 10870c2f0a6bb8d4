"""The engine core in its own process, behind two API server processes (`xlaserve serve
--api-server-count 2`, one served tiny engine for the module):

- 64 concurrent streams, 16 of which hang up mid-way: the others equal a greedy batch run, and
  nothing runs or holds KV pages afterwards (the aborts crossed the process boundary);
- a burst of long streams: the admission limit (running + queued) holds across both API server
  processes, the rest answered 503;
- SIGKILL of the engine core process while 16 streams run: every stream ends (an error event,
  or a closed connection) within seconds, /health answers 503, and the server exits with status
  1 and one line; no process is left behind. Last: it ends the module's server.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.engine.tiny_model import write_tiny_checkpoint
from tests.serving.conftest import compilation_cache_dir
from tests.serving.openai_server import ROOT, Server, _wait_healthy, free_port
from tests.serving.test_openai_concurrency import _metric

RUNNING, QUEUED = 8, 56  # 64 admitted at once, across both API servers
CLIENTS, HANG_UPS, MAX_TOKENS = 64, 16, 12
LONG = 240  # tokens of a burst's stream: hundreds of steps, so none ends during the burst


@pytest.fixture(scope="module")
def server(tmp_path_factory, request) -> Iterator[Server]:
    directory = write_tiny_checkpoint(tmp_path_factory.mktemp("core") / "tiny")
    log = tmp_path_factory.mktemp("logs") / "core-server.log"
    port = free_port()
    command = [
        sys.executable, "-m", "serving.cli", "serve", "--model", str(directory),
        "--served-model-name", "tiny", "--port", str(port), "--max-num-seqs", str(RUNNING),
        "--max-num-batched-tokens", "32", "--max-model-len", "256", "--kv-cache-memory",
        "16MiB", "--max-queued-requests", str(QUEUED), "--api-server-count", "2",
        "--compilation-cache-dir", str(compilation_cache_dir(request, tmp_path_factory)),
        "--shutdown-timeout", "5",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with log.open("wb") as out:
        process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=out, stderr=out)
    server = Server(f"http://127.0.0.1:{port}", "tiny", process, log)
    try:
        _wait_healthy(server)
        yield server
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def _body(prompt: str, max_tokens: int, **extra) -> dict:
    return {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        **extra,
    }


async def _stream(client: httpx.AsyncClient, prompt: str, hang_up: bool) -> str | None:
    """A stream's text; one that hangs up asks for LONG tokens, so that an abort that did not
    reach the engine shows in the tokens generated."""
    text, events = "", 0
    body = _body(prompt, LONG if hang_up else MAX_TOKENS, stream=True)
    async with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line == "data: [DONE]":
                return text
            if line.startswith("data: "):
                event = json.loads(line.removeprefix("data: "))
                assert "error" not in event, event
                text, events = text + event["choices"][0]["text"], events + 1
                if hang_up and events == 2:
                    return None  # leaving the block closes the connection mid-stream
    raise AssertionError("stream ended without [DONE]")


def test_64_streams_with_16_hanging_up_equal_a_batch(server: Server) -> None:
    prompts = [f"Client {i} says" for i in range(CLIENTS)]
    hang_up = [i % (CLIENTS // HANG_UPS) == 0 for i in range(CLIENTS)]

    async def streams() -> list[str | None]:
        limits = httpx.Limits(max_connections=CLIENTS + 4)
        async with httpx.AsyncClient(base_url=server.url, timeout=120, limits=limits) as client:
            return await asyncio.gather(
                *(_stream(client, p, h) for p, h in zip(prompts, hang_up, strict=True))
            )

    before = _generated(server)
    streamed = asyncio.run(streams())
    _assert_idle(server)  # the hang-ups' aborts have landed: the batch finds its 64 seats free
    whole = httpx.post(f"{server.url}/v1/completions", json=_body(prompts, MAX_TOKENS), timeout=120)
    assert whole.status_code == 200, whole.text
    expected = [c["text"] for c in sorted(whole.json()["choices"], key=lambda c: c["index"])]
    assert sum(hang_up) == HANG_UPS
    for i, (got, want) in enumerate(zip(streamed, expected, strict=True)):
        assert got == (None if hang_up[i] else want), f"client {i}"
    _assert_idle(server)
    finished = 2 * CLIENTS * MAX_TOKENS  # the streams that finished, and the batch, at most
    assert _generated(server) - before < finished + HANG_UPS * LONG / 2, "hang-ups ran on"


def _generated(server: Server) -> float:
    return _metric(httpx.get(f"{server.url}/metrics").text, "generation_tokens_total")


def _assert_idle(server: Server) -> None:
    names = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")
    deadline = time.monotonic() + 10
    while True:  # the aborts land within a step, the core's status within a tenth of a second
        body = httpx.get(f"{server.url}/metrics").text
        values = {name: _metric(body, name) for name in names}
        if not any(values.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert values == dict.fromkeys(names, 0)


class Burst:
    """Long streams sent at once: each records its status, and whether it had ended (freeing
    its place) before the last status of the burst came."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.statuses: list[int] = []
        self.ended_at: list[float] = []
        self.all_answered = asyncio.Event()

    async def one(self, client: httpx.AsyncClient, i: int) -> None:
        body = _body(f"burst {i}", LONG, stream=True)
        async with client.stream("POST", "/v1/completions", json=body) as response:
            self.statuses.append(response.status_code)
            if response.status_code == 503:
                assert response.headers["retry-after"] == "1"
                assert (await response.aread()).startswith(b'{"error"')
            if len(self.statuses) == self.size:
                self.all_answered.set()
            if response.status_code == 200:
                await self._hold(response)

    async def _hold(self, response: httpx.Response) -> None:
        """Reads the stream until the whole burst has its statuses, then hangs up."""
        lines = response.aiter_lines()
        reader = asyncio.ensure_future(self._read(lines))
        answered = asyncio.ensure_future(self.all_answered.wait())
        await asyncio.wait({reader, answered}, return_when=asyncio.FIRST_COMPLETED)
        answered.cancel()
        if reader.done():
            self.ended_at.append(time.monotonic())
        reader.cancel()

    async def _read(self, lines) -> None:
        async for _ in lines:
            pass


def test_a_burst_is_limited_across_both_api_servers(server: Server) -> None:
    burst = Burst(3 * (RUNNING + QUEUED))

    async def main() -> None:
        limits = httpx.Limits(max_connections=burst.size + 4)
        async with httpx.AsyncClient(base_url=server.url, timeout=120, limits=limits) as client:
            await asyncio.gather(*(burst.one(client, i) for i in range(burst.size)))

    asyncio.run(main())
    admitted, refused = burst.statuses.count(200), burst.statuses.count(503)
    assert admitted + refused == burst.size
    assert refused > 0 and admitted >= RUNNING + QUEUED
    # Places freed during the burst (a stream that ended) may be taken again; none else.
    assert admitted - len(burst.ended_at) <= RUNNING + QUEUED, (admitted, burst.ended_at)
    _assert_idle(server)
    assert httpx.get(f"{server.url}/health").status_code == 200


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has ended


def _named(pids: list[int], name: str) -> list[int]:
    return [p for p in pids if Path(f"/proc/{p}/comm").read_text().strip() == name]


def test_killing_the_engine_core_ends_every_stream_and_the_server(server: Server) -> None:
    children = _children(server.process.pid)
    (core,) = _named(children, "xlaserve-core")
    started = asyncio.Event()
    ended: list[tuple[str, float]] = []

    async def stream(client: httpx.AsyncClient, i: int) -> None:
        body = _body(f"kill {i}", LONG, stream=True)
        how = "closed"
        try:
            async with client.stream("POST", "/v1/completions", json=body) as response:
                assert response.status_code == 200
                async for line in response.aiter_lines():
                    started.set()
                    if line.startswith('data: {"error"'):
                        how = "error event"
        except httpx.TransportError:
            pass
        ended.append((how, time.monotonic()))

    async def main() -> float:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            streams = [asyncio.ensure_future(stream(client, i)) for i in range(16)]
            await asyncio.wait_for(started.wait(), 60)
            await asyncio.sleep(0.2)
            killed = time.monotonic()
            os.kill(core, signal.SIGKILL)
            await asyncio.gather(*streams)
            return killed

    killed = asyncio.run(main())
    assert len(ended) == 16
    assert max(t for _, t in ended) - killed < 5, ended
    assert "error event" in {how for how, _ in ended}
    _assert_unhealthy(server)
    assert server.process.wait(timeout=30) == 1
    lines = [line for line in server.log.read_text().splitlines() if "error" in line.lower()]
    final = [line for line in lines if line.startswith("xlaserve: error:")]
    assert final == ["xlaserve: error: the engine core process was killed by signal 9"], lines
    assert "Traceback" not in server.log.read_text()
    deadline = time.monotonic() + 10
    while [p for p in children if _alive(p)] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [p for p in children if _alive(p)], "a process was left behind"


def _assert_unhealthy(server: Server) -> None:
    """/health answers 503 (on whichever API server gets the connection) until the server
    exits."""
    statuses = set()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and 503 not in statuses:
        try:
            statuses.add(httpx.get(f"{server.url}/health", timeout=2).status_code)
        except httpx.TransportError:
            break
        time.sleep(0.05)
    assert 503 in statuses and 200 not in statuses, statuses
