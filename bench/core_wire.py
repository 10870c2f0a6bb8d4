"""What one step's outputs cost to cross from the engine core process to an API server
(serving/core_wire.py), per output, for decode deltas of `--outputs` running sequences, written
as RequestOutput dataclasses or as the compact tuples the core sends: on the core's side
(compacting and pickling: what the engine's process pays), on the API server's (unpickling and
rebuilding RequestOutputs), and the round trip through the pipe.

    python bench/core_wire.py --write-results

For the round trip the receiver runs in a second process, as an API server does; a message is
timed from before pickling until the receiver has unpickled it and answered with one byte.
"""

from __future__ import annotations

import argparse
import multiprocessing
import pickle
import sys
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common
from engine.request import CompletionOutput, RequestOutput
from serving import core_wire as wire

TITLE = "Engine core to API server: one step's outputs (bench/core_wire.py)"


def step_outputs(count: int) -> list[RequestOutput]:
    """A decode step's deltas: one choice each, a token and its few characters of text."""
    return [
        RequestOutput(f"cmpl-{i:032x}-0", [CompletionOutput(0, " word", [1234 + i])], False)
        for i in range(count)
    ]


def _receive(conn: Connection) -> None:
    while True:
        data = conn.recv_bytes()
        if data == b"":
            return
        [(_, items)] = pickle.loads(data)
        _ = [wire.expand(item) for item in items]
        conn.send_bytes(b"!")


class Receiver:
    """A second process that unpickles each message and answers with one byte."""

    def __init__(self) -> None:
        spawn = multiprocessing.get_context("spawn")
        self.conn, theirs = spawn.Pipe()
        self._process = spawn.Process(target=_receive, args=(theirs,))
        self._process.start()
        theirs.close()

    def close(self) -> None:
        self.conn.send_bytes(b"")
        self._process.join()


def round_trip_us(
    receiver: Receiver, outputs: list[RequestOutput], compact: bool, repeats: int
) -> float:
    """A step's outputs as one message, there and answered, per output."""

    def once() -> None:
        items = [wire.compact(o) for o in outputs] if compact else outputs
        wire.send(receiver.conn, [(wire.OUTPUTS, items)])
        receiver.conn.recv_bytes()

    return _best(once, repeats) * 1e6 / len(outputs)


def sides_us(outputs: list[RequestOutput], compact: bool, repeats: int) -> tuple[float, float]:
    """Microseconds per output on the core's side (compacting, pickling) and on the API
    server's (unpickling, back to RequestOutput)."""
    items = [wire.compact(o) for o in outputs] if compact else outputs
    data = pickle.dumps([(wire.OUTPUTS, items)], protocol=5)

    def core() -> None:
        pickle.dumps([(wire.OUTPUTS, [wire.compact(o) for o in outputs])], protocol=5)

    def plain() -> None:
        pickle.dumps([(wire.OUTPUTS, outputs)], protocol=5)

    def api() -> None:
        [(_, got)] = pickle.loads(data)
        _ = [wire.expand(item) for item in got]

    sent = _best(core if compact else plain, repeats)
    return sent * 1e6 / len(outputs), _best(api, repeats) * 1e6 / len(outputs)


def _best(work: Callable[[], None], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        work()
        best = min(best, time.perf_counter() - start)
    return best


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--outputs", type=int, nargs="+", default=[16, 256, 1024])
    p.add_argument("--repeats", type=int, default=200, help="messages per case (the best)")
    p.add_argument("--write-results", action="store_true")
    return p


def main(argv: Sequence[str] | None = None) -> None:
    args = parser().parse_args(argv)
    lines = [
        "| outputs per step | written as | core side, us per output | API server side, us per "
        "output | round trip, us per output |",
        "|---|---|---|---|---|",
    ]
    receiver = Receiver()
    for count in args.outputs:
        outputs = step_outputs(count)
        for compact in (False, True):
            core, api = sides_us(outputs, compact, args.repeats)
            trip = round_trip_us(receiver, outputs, compact, args.repeats)
            written = "compact tuple" if compact else "RequestOutput"
            lines.append(f"| {count} | {written} | {core:.2f} | {api:.2f} | {trip:.2f} |")
    receiver.close()
    command = "python bench/core_wire.py " + " ".join(sys.argv[1:] if argv is None else argv)
    text = "\n".join(
        [
            *common.preamble(command, {"python": sys.version.split()[0]}),
            "- pickle protocol 5 over a multiprocessing Pipe to a second process and a one-byte "
            "answer back; the best of the repeats",
            "",
            *lines,
        ]
    )
    print(text)
    if args.write_results:
        common.write_section(TITLE, text)


if __name__ == "__main__":
    main()
