"""The engine core process: the engine and its loop, alone in a process (and a Python
interpreter, so a GIL) of their own, serving one or more API server processes over pipes
(serving/core_wire.py says what crosses).

Between steps the loop takes what the API servers sent (new requests, aborts, LoRA and grammar
calls), runs one step (or, while nothing waits, compiles a step variant not compiled yet), and
hands each API server the step's deltas of its own requests as one message; a sender thread
pickles and writes them while the loop goes on with the next step. Several times a second it
sends every API server a status: the engine's gauges, health and adapters, and how long ago a
step finished, which is how an API server tells a hung core from an idle one.

Detokenization and stop strings stay here, in the engine's output processor: a stop string ends
a sequence, and ending it where it is found frees its pages in the same step; checked in the API
server, it would cost a round trip and a step (or more) of wasted decoding per stopped sequence,
and the engine would have to hand out raw tokens. The API servers do the rest: HTTP, SSE framing
and JSON, gRPC, tokenizing prompts, and chat templates.

The process ignores SIGINT and SIGTERM (a Ctrl-C reaches the whole process group): the API
server that started it decides when it stops, by a STOP message (drain, then end) or by going
away (its pipe closes: the core aborts everything and ends).
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import queue
import signal
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any, TypeVar

from engine.config import EngineConfig
from engine.errors import XlaserveError
from engine.protocol import Engine
from engine.request import RequestOutput
from serving import core_wire as wire
from serving.async_engine import EngineDeadError

log = logging.getLogger("xlaserve.core")
T = TypeVar("T")

STATUS_INTERVAL_S = 0.1  # how often every API server hears from the core (and at least ...)
OWNER = 0  # ... the API server whose STOP ends the core: the one that started it
SHUTTING_DOWN = "server shutting down"
# A path: the core's loop runs under cProfile, its statistics written there when it ends (to
# see where a served step's host time goes; bench/host_overhead.py's served rows).
PROFILE_ENV = "XLASERVE_PROFILE_CORE"


def run_core(config: EngineConfig, conns: Sequence[Connection], verbose: bool) -> None:
    """The process's entry point: builds the engine `config` describes and serves `conns`
    (one per API server process; the first is the owner's) until stopped."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    name_process("xlaserve-core")
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    import tqdm

    from engine import compilation
    from engine.builder import build_engine
    from engine.host_gc import configure_collector

    # Progress bars lock with a thread lock: tqdm's default multiprocessing lock is a named
    # semaphore, which a core killed by a signal would leave to the resource tracker to remove
    # (with a warning on the server's stderr).
    tqdm.tqdm.set_lock(threading.RLock())

    try:
        engine = build_engine(config)
    except BaseException as e:
        for conn in conns:
            _send_quietly(conn, [(wire.FAILED, _picklable(e))])
        return
    configure_collector()
    hello = [(wire.HELLO, engine.model_info(), engine.tokenizer)]
    for conn in conns:
        _send_quietly(conn, hello)
    core = EngineCore(engine, conns, compilation.count)
    profile_to = os.environ.get(PROFILE_ENV)
    if not profile_to:
        core.run()
        return
    import cProfile

    with cProfile.Profile() as profile:
        try:
            core.run()
        finally:
            profile.dump_stats(profile_to)


class EngineCore:
    """The loop of the module's docstring over `engine`, for the API servers at `conns`."""

    def __init__(
        self, engine: Engine, conns: Sequence[Connection], compilations: Callable[[], int]
    ):
        self.engine = engine
        self._conns = dict(enumerate(conns))  # the API servers still connected
        self._owners: dict[str, int] = {}  # request id -> its API server
        self._compilations = compilations
        self._outbox: queue.SimpleQueue[tuple[Connection, tuple[Any, ...]] | None] = (
            queue.SimpleQueue()
        )
        self._sender = threading.Thread(target=self._send_loop, name="core-sender", daemon=True)
        self._warming = True
        self._stop_at: float | None = None  # the drain deadline, once STOP came
        self._slowest_step_s = 0.0
        self._last_step_end = self._last_status = time.monotonic()

    def run(self) -> None:
        self._sender.start()
        try:
            while self._conns and not self._done():
                self._take_messages(0.0 if self._busy() else STATUS_INTERVAL_S)
                self._step()
                self._send_status(due_only=True)
        except BaseException as e:
            log.exception("engine loop died")
            self._send_status(due_only=False, fatal=f"engine loop died: {e!r}")
            raise
        finally:
            self._end()

    # ---- one turn of the loop ----------------------------------------------------------------

    def _busy(self) -> bool:
        return self.engine.has_unfinished_requests() or (self._warming and self._stop_at is None)

    def _done(self) -> bool:
        if self._stop_at is None:
            return False
        return not self.engine.has_unfinished_requests() or time.monotonic() > self._stop_at

    def _take_messages(self, timeout: float) -> None:
        ready = wait(list(self._conns.values()), timeout)
        for client, conn in list(self._conns.items()):
            if conn not in ready:
                continue
            try:
                while True:
                    for message in wire.receive(conn):
                        self._handle(client, message)
                    if not conn.poll():
                        break
            except (EOFError, OSError):
                self._drop(client)

    def _step(self) -> None:
        if self.engine.has_unfinished_requests():
            self._route(self._timed(self.engine.step))
        elif self._warming and self._stop_at is None:
            self._warming = self._timed(self.engine.warm_up_step)
            if not self._warming:
                log.info("all %d step variants compiled", self.engine.stats().num_step_variants)
            self._send_status(due_only=False)  # a compilation may have taken long

    def _timed(self, work: Callable[[], T]) -> T:
        start = time.monotonic()
        result = work()
        self._last_step_end = time.monotonic()
        self._slowest_step_s = max(self._slowest_step_s, self._last_step_end - start)
        return result

    def _route(self, outputs: list[RequestOutput]) -> None:
        """Each API server gets its requests' deltas as one message."""
        batches: dict[int, list[RequestOutput | wire.CompactOutput]] = {}
        for output in outputs:
            client = self._owners.get(output.request_id)
            if output.finished:
                self._owners.pop(output.request_id, None)
            if client is not None:
                batches.setdefault(client, []).append(wire.compact(output))
        for client, batch in batches.items():
            self._post(client, (wire.OUTPUTS, batch))
        if not self.engine.has_unfinished_requests():
            self._send_status(due_only=False)  # idle now: gauges at 0 without waiting

    # ---- messages ----------------------------------------------------------------------------

    def _handle(self, client: int, message: tuple[Any, ...]) -> None:
        kind = message[0]
        if kind == wire.ADD:
            self._add(client, *message[1:])
        elif kind == wire.ABORT:
            self._owners.pop(message[1], None)
            self.engine.abort_request(message[1])
        elif kind == wire.CALL:
            self._call(client, *message[1:])
        elif kind == wire.STOP and client == OWNER:
            self._stop_at = time.monotonic() + message[1]

    def _add(self, client: int, request_id: str, *request: Any) -> None:
        if self._stop_at is not None:
            self._post(client, (wire.REFUSED, request_id, EngineDeadError(SHUTTING_DOWN)))
            return
        prompt, params, priority, lora_name = request
        try:
            self.engine.add_request(
                request_id, prompt, params, priority=priority, lora_name=lora_name
            )
        except Exception as e:
            self._post(client, (wire.REFUSED, request_id, _picklable(e)))
            return
        self._owners[request_id] = client

    def _call(self, client: int, call_id: int, method: str, args: tuple[Any, ...]) -> None:
        """LoRA changes run here, between steps; a grammar compiles on the engine's compiler
        threads and is answered when done."""

        def reply(error: BaseException | None, value: Any = None) -> None:
            sent = None if error is None else _picklable(error)
            self._post(client, (wire.REPLY, call_id, sent, value))

        if method == "compile_grammar":
            future: Future[None] = self.engine.compile_grammar(*args)
            future.add_done_callback(lambda f: reply(f.exception()))
            return
        try:
            if method == "add_lora":
                self.engine.add_lora(*args)
            elif method == "remove_lora":
                self.engine.remove_lora(*args)
            else:
                raise XlaserveError(f"the engine core has no call {method!r}")
        except Exception as e:
            reply(e)
            return
        reply(None, tuple(self.engine.list_loras()))
        self._send_status(due_only=False)  # the other API servers learn the adapters now

    def _drop(self, client: int) -> None:
        """An API server went away: its requests are aborted; without the owner, the core ends."""
        del self._conns[client]
        for request_id in [r for r, c in self._owners.items() if c == client]:
            del self._owners[request_id]
            self.engine.abort_request(request_id)
        if client == OWNER:
            self._stop_at = time.monotonic()

    # ---- sending -----------------------------------------------------------------------------

    def _post(self, client: int, message: tuple[Any, ...]) -> None:
        conn = self._conns.get(client)
        if conn is not None:
            self._outbox.put((conn, message))

    def _send_status(self, *, due_only: bool, fatal: str = "") -> None:
        now = time.monotonic()
        if due_only and now - self._last_status < STATUS_INTERVAL_S:
            return
        self._last_status = now
        health = self.engine.health()
        if fatal:
            health = type(health)(ok=False, reason=fatal, fatal=True)
        status = wire.CoreStatus(
            self.engine.stats(),
            health,
            tuple(self.engine.list_loras()),
            self._slowest_step_s,
            now - self._last_step_end,
            self._compilations(),
        )
        for client in self._conns:
            self._post(client, (wire.STATUS, status))

    def _send_loop(self) -> None:
        """Pickles and writes what the loop posted, all of one API server's pending messages
        as one write; an API server that went away is the reader's to notice."""
        while (item := self._outbox.get()) is not None:
            pending: dict[Connection, list[tuple[Any, ...]]] = {item[0]: [item[1]]}
            while True:
                try:
                    more = self._outbox.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    self._outbox.put(None)
                    break
                pending.setdefault(more[0], []).append(more[1])
            for conn, messages in pending.items():
                _send_quietly(conn, messages)

    def _end(self) -> None:
        """Aborts what is left (each stream ends with an error), closes the engine."""
        for request_id, client in list(self._owners.items()):
            self.engine.abort_request(request_id)
            self._post(client, (wire.REFUSED, request_id, EngineDeadError(SHUTTING_DOWN)))
        self._owners.clear()
        self._send_status(due_only=False)
        self._outbox.put(None)
        self._sender.join()
        self.engine.close()
        for conn in self._conns.values():
            conn.close()


def name_process(name: str) -> None:
    """What `ps` and `top` show for this process (Linux; elsewhere nothing changes)."""
    with contextlib.suppress(OSError):
        Path("/proc/self/comm").write_text(name[:15])


def _send_quietly(conn: Connection, messages: list[tuple[Any, ...]]) -> None:
    with contextlib.suppress(OSError):  # the API server has gone
        wire.send(conn, messages)


def _picklable(error: BaseException) -> BaseException:
    """`error` if it survives pickling, else an XlaserveError with its message."""
    try:
        pickle.loads(pickle.dumps(error, protocol=5))
    except Exception:
        return XlaserveError(f"{type(error).__name__}: {error}")
    return error
