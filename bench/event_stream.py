"""What a streamed answer costs the API server beyond making its events: Starlette's
StreamingResponse (an anyio task group per answer, to hear the client's disconnect) against
serving.openai.generation.EventStream (one plain asyncio task), each sending `--events` ready
events to an ASGI `send` that keeps nothing, on uvloop, in alternating rounds.

    python bench/event_stream.py --write-results

Both minus the same events iterated and sent with no response around them: the CPU
microseconds the response itself adds per answer. With 256 streaming clients of 200-token
answers the server starts one to two answers per engine step (bench/host_overhead.py).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from importlib.metadata import version
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import uvloop
from starlette.responses import StreamingResponse

from bench import common
from serving.openai.generation import EventStream

TITLE = "A streamed answer's own cost in the API server (bench/event_stream.py)"
EVENT = b'data: {"id":"cmpl-0","choices":[{"index":0,"text":" eight tokens"}]}\n\n'


async def events(count: int) -> AsyncGenerator[bytes, None]:
    for _ in range(count):
        await asyncio.sleep(0)  # each event arrives on a later turn of the loop, as served
        yield EVENT


async def _keep_nothing(message: Any) -> None:
    pass


async def _never_disconnect() -> Any:
    await asyncio.Event().wait()


def answer_us(make: Callable[[int], Any] | None, count: int, answers: int) -> float:
    """CPU microseconds per answer of `answers` answers made by `make` (None: the events sent
    with no response around them)."""
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}}

    async def run() -> float:
        start = time.process_time()
        for _ in range(answers):
            if make is None:
                async for chunk in events(count):
                    await _keep_nothing(chunk)
            else:
                await make(count)(scope, _never_disconnect, _keep_nothing)
        return (time.process_time() - start) / answers * 1e6

    return uvloop.run(run())


RESPONSES: dict[str, Callable[[int], Any]] = {
    "Starlette StreamingResponse": lambda n: StreamingResponse(
        events(n), media_type="text/event-stream"
    ),
    "EventStream": lambda n: EventStream(events(n)),
}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--events", type=int, nargs="+", default=[1, 26, 201])
    p.add_argument("--answers", type=int, default=2000, help="answers per round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--write-results", action="store_true")
    return p


def main(argv: Sequence[str] | None = None) -> None:
    args = parser().parse_args(argv)
    lines = [
        "| events per answer | response | CPU us per answer beyond the events: median (range) |",
        "|---|---|---|",
    ]
    for count in args.events:
        added: dict[str, list[float]] = {name: [] for name in RESPONSES}
        for _ in range(args.rounds):
            for name, make in RESPONSES.items():
                base = answer_us(None, count, args.answers)
                added[name].append(answer_us(make, count, args.answers) - base)
        for name, values in added.items():
            lines.append(
                f"| {count} | {name} | {statistics.median(values):.1f} "
                f"({min(values):.1f}-{max(values):.1f}) |"
            )
    command = "python bench/event_stream.py " + " ".join(sys.argv[1:] if argv is None else argv)
    text = "\n".join(
        [
            *common.preamble(command, {v: version(v) for v in ("starlette", "uvloop")}),
            f"- {args.answers} answers per round, {args.rounds} rounds alternating; each "
            "round's answers minus the same events sent with no response around them (at 201 "
            "events that difference is within the spread of the two runs it subtracts)",
            "",
            *lines,
        ]
    )
    print(text)
    if args.write_results:
        common.write_section(TITLE, text)


if __name__ == "__main__":
    main()
