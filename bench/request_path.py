"""What one request costs the API server's CPU on its way through the OpenAI app: the generation
endpoints as plain routes (`serving.openai.routing.json_post`, as served) against the same
handlers as FastAPI path operations (a body parameter, the API key as a dependency), in
alternating rounds, on uvloop.

    python bench/request_path.py --write-results

Each request goes through the whole ASGI app (middleware, routing, validation, the handler,
the answer's events) to a `send` that keeps nothing; uvicorn's HTTP parsing and the engine are
not in it: a stand-in engine answers every request at once with `--events` deltas. With 256
streaming clients of 200-token answers the server starts one to two requests per engine step
(bench/host_overhead.py); a workload of short answers starts one per answer.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from importlib.metadata import version
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import uvloop
from fastapi import APIRouter, Depends, FastAPI
from starlette.types import Message

from bench import common
from engine.protocol import ModelInfo
from engine.request import CompletionOutput, RequestOutput, Usage
from engine.tokenizer import load_tokenizer
from serving.admission import AdmissionLimit
from serving.async_engine import LoopHealth
from serving.openai import chat, completions
from serving.openai.app import create_app
from serving.openai.routing import check_api_key

TITLE = "One request's cost in the API server (bench/request_path.py)"
API_KEY = "bench-key"
REQUESTS: dict[str, tuple[str, dict[str, Any]]] = {  # name -> (path, body)
    "streamed completion": (
        "/v1/completions",
        {"model": "bench", "prompt": "Hello there", "max_tokens": 200, "stream": True},
    ),
    "completion": ("/v1/completions", {"model": "bench", "prompt": "Hello there"}),
    "streamed chat": (
        "/v1/chat/completions",
        {
            "model": "bench",
            "messages": [{"role": "user", "content": "Hello there"}],
            "max_tokens": 200,
            "stream": True,
        },
    ),
}


class _Engine:
    """What the app asks of an engine outside generation."""

    def __init__(self) -> None:
        from tests.engine.tiny_model import write_byte_tokenizer

        directory = Path(tempfile.mkdtemp())
        write_byte_tokenizer(directory)
        self.tokenizer = load_tokenizer(directory)
        self.tokenizer.chat_template = (
            "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        )

    def model_info(self) -> ModelInfo:
        return ModelInfo("llama", 512, 1024, 256, 256)

    def list_loras(self) -> list[str]:
        return []


class StandInFront:
    """A Front whose every request answers at once: `events` deltas, the last one finishing."""

    def __init__(self, events: int) -> None:
        self.engine, self.events, self.is_healthy = _Engine(), events, True

    def health(self) -> LoopHealth:
        return LoopHealth(True, "", 0.0, 60.0)

    async def generate(
        self, request_id: str, prompt: Any, params: Any, **_: Any
    ) -> AsyncGenerator[RequestOutput, None]:
        for i in range(self.events):
            await asyncio.sleep(0)  # each delta arrives on a later turn of the loop, as served
            last = i == self.events - 1
            choice = CompletionOutput(0, " some text", [72] * 8, "length" if last else None)
            usage = Usage(len(prompt), 0, (8 * self.events,)) if last else None
            yield RequestOutput(request_id, [choice], last, usage=usage)

    def abort(self, request_id: str) -> None:
        pass

    def compilations(self) -> int:
        return 0


def served_app(events: int) -> FastAPI:
    front: Any = StandInFront(events)  # a Front in what the app asks of it
    return create_app(front, "bench", api_key=API_KEY, admission=AdmissionLimit(64, 64))


def path_operations_app(events: int) -> FastAPI:
    """The served app with the generation handlers put first as FastAPI path operations."""
    app = served_app(events)
    router = APIRouter(dependencies=[Depends(check_api_key)])
    router.post("/v1/completions")(completions.create_completion)
    router.post("/v1/chat/completions")(chat.create_chat_completion)
    app.router.routes[:0] = router.routes  # the first route that matches serves
    return app


APPS: dict[str, Callable[[int], FastAPI]] = {
    "FastAPI path operation": path_operations_app,
    "json_post (served)": served_app,
}


def request_us(app: FastAPI, path: str, body: dict[str, Any], requests: int) -> float:
    """CPU microseconds per request of `requests` sent one after another."""
    raw = json.dumps(body).encode()
    headers = [
        (b"host", b"bench"),
        (b"content-type", b"application/json"),
        (b"content-length", str(len(raw)).encode()),
        (b"authorization", f"Bearer {API_KEY}".encode()),
    ]
    scope = {
        "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1", "method": "POST", "scheme": "http", "path": path,
        "raw_path": path.encode(), "query_string": b"", "root_path": "", "headers": headers,
        "client": ("127.0.0.1", 40000), "server": ("127.0.0.1", 8000),
    }  # fmt: skip

    async def one() -> None:
        read = False
        statuses = []

        async def receive() -> Message:
            nonlocal read
            if not read:
                read = True
                return {"type": "http.request", "body": raw, "more_body": False}
            await asyncio.Event().wait()  # the client never leaves
            raise AssertionError

        async def send(message: Message) -> None:
            if message["type"] == "http.response.start":
                statuses.append(message["status"])

        await app(dict(scope), receive, send)
        if statuses != [200]:
            raise RuntimeError(f"{path} answered {statuses}")

    async def run() -> float:
        for _ in range(min(requests, 100)):  # warm: first-use costs out of the timing
            await one()
        start = time.process_time()
        for _ in range(requests):
            await one()
        return (time.process_time() - start) / requests * 1e6

    return uvloop.run(run())


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--events", type=int, nargs="+", default=[1, 26], help="deltas per answer")
    p.add_argument("--requests", type=int, default=2000, help="requests per round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--write-results", action="store_true")
    return p


def main(argv: Sequence[str] | None = None) -> None:
    args = parser().parse_args(argv)
    lines = [
        "| request | events per answer | route | CPU us per request: median (range) |",
        "|---|---|---|---|",
    ]
    for name, (path, body) in REQUESTS.items():
        for count in args.events if body.get("stream") else [1]:
            apps = {label: make(count) for label, make in APPS.items()}
            measured: dict[str, list[float]] = {label: [] for label in apps}
            for _ in range(args.rounds):
                for label, app in apps.items():
                    measured[label].append(request_us(app, path, body, args.requests))
            for label, values in measured.items():
                lines.append(
                    f"| {name} | {count} | {label} | {statistics.median(values):.1f} "
                    f"({min(values):.1f}-{max(values):.1f}) |"
                )
    command = "python bench/request_path.py " + " ".join(sys.argv[1:] if argv is None else argv)
    packages = ("fastapi", "starlette", "pydantic", "uvloop")
    text = "\n".join(
        [
            *common.preamble(command, {p: version(p) for p in packages}),
            f"- {args.requests} requests per round, {args.rounds} rounds alternating; the "
            "stand-in engine answers at once, so the table is the app's own CPU",
            "",
            *lines,
        ]
    )
    print(text)
    if args.write_results:
        common.write_section(TITLE, text)


if __name__ == "__main__":
    main()
