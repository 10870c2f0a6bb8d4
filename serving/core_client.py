"""An API server's side of an engine core in another process (serving/engine_core.py): the same
interface as AsyncEngine (serving/front.py), so the HTTP and gRPC servers need not know where
the engine runs.

Host code: never imports jax. Two threads talk to the core over the pipe: a writer that sends
what the event loops posted (requests, aborts, calls), everything pending as one write, and a
reader that hands each step's deltas to their streams, one `call_soon_threadsafe` per event
loop and message rather than one per delta.

Health: the core sends a status several times a second between steps. The client is unhealthy
while the core process is gone (its pipe closed: fatal, the server exits), while the core says
so (`Engine.health`), and, as AsyncEngine, while it has work (a stream open or a call pending)
and has heard nothing from the core for the step timeout: `step_timeout` if given, else
`STEP_TIMEOUT_FACTOR` times the slowest step the core has timed, at least
`STEP_TIMEOUT_FLOOR_S`.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from concurrent.futures import Future
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any, TypeVar

from engine.errors import XlaserveError
from engine.protocol import EngineStats, Health, ModelInfo
from engine.request import RequestOutput, SamplingParams
from engine.structured.spec import StructuredOutputs
from engine.tokenizer import Tokenizer
from serving import core_wire as wire
from serving.async_engine import (
    STEP_TIMEOUT_FACTOR,
    STEP_TIMEOUT_FLOOR_S,
    EngineDeadError,
    LoopHealth,
)
from serving.collector import OutputCollector

log = logging.getLogger(__name__)
T = TypeVar("T")
Delta = RequestOutput | wire.CompactOutput  # an output as it crosses from the core
STOP_SLACK_S = 30.0  # what the core gets beyond its drain time to close the engine and exit


class EngineCoreClient:
    """Streams requests through an engine core process. `process`: the core's process, when
    this client started it (it is then the owner: its `shutdown` drains and stops the core);
    other API servers leave the core running when they stop."""

    def __init__(
        self,
        conn: Connection,
        info: ModelInfo,
        tokenizer: Tokenizer,
        *,
        process: BaseProcess | None = None,
        step_timeout: float | None = None,
    ):
        if step_timeout is not None and step_timeout <= 0:
            raise ValueError(f"{step_timeout=} must be positive (or None: automatic)")
        self.engine = RemoteEngine(self, info, tokenizer)
        self._conn = conn
        self._process = process
        self._step_timeout = step_timeout
        self._lock = threading.Lock()
        self._streams: dict[str, OutputCollector[Delta]] = {}
        self._calls: dict[int, Future[Any]] = {}
        self._call_ids = itertools.count()
        self._status: wire.CoreStatus | None = None
        self._heard = self._busy_since = time.monotonic()  # when the core last spoke
        self._status_at = self._heard  # when its last status came
        self._dead = ""  # why the core is gone, once it is
        self._stopping = False
        self._outbox: queue.SimpleQueue[tuple[Any, ...] | None] = queue.SimpleQueue()
        for target, name in ((self._read, "core-reader"), (self._write, "core-writer")):
            threading.Thread(target=target, name=name, daemon=True).start()

    @classmethod
    def connect(
        cls,
        conn: Connection,
        *,
        process: BaseProcess | None = None,
        step_timeout: float | None = None,
    ) -> EngineCoreClient:
        """Waits for the core to have built its engine; raises the error that stopped it (an
        XlaserveError naming the problem) if it could not."""
        try:
            (message,) = wire.receive(conn)
        except (EOFError, OSError):
            raise XlaserveError(_gone(process)) from None
        if message[0] == wire.FAILED:
            raise message[1]
        _, info, tokenizer = message
        return cls(conn, info, tokenizer, process=process, step_timeout=step_timeout)

    # ---- AsyncEngine's surface ---------------------------------------------------------------

    @property
    def is_healthy(self) -> bool:
        return self.health().ok

    def health(self) -> LoopHealth:
        now = time.monotonic()
        with self._lock:
            status, heard, busy = self._status, self._heard, bool(self._streams or self._calls)
            since, status_at = max(heard, self._busy_since), self._status_at
        slowest = status.slowest_step_s if status is not None else 0.0
        timeout = self._step_timeout or max(STEP_TIMEOUT_FLOOR_S, STEP_TIMEOUT_FACTOR * slowest)
        age = (status.last_step_age_s if status is not None else 0.0) + now - status_at
        reason = self._stop_reason(status)
        if not reason and busy and now - since > timeout:
            reason = (
                f"the engine core has sent nothing for {now - since:.1f} s while requests wait; "
                f"the step timeout is {timeout:g} s"
            )
        return LoopHealth(not reason, reason, age, timeout)

    async def generate(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        lora_name: str | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """As AsyncEngine.generate: the request's deltas; closing early aborts it."""
        if params.structured_outputs is not None:
            await asyncio.wrap_future(self.engine.compile_grammar(params.structured_outputs))
        health = self.health()
        if not health.ok:
            raise EngineDeadError(f"engine is not serving: {health.reason}")
        stream: OutputCollector[Delta] = OutputCollector(asyncio.get_running_loop(), wire.merge)
        with self._lock:
            if self._dead:
                raise EngineDeadError(f"engine is not serving: {self._dead}")
            if not (self._streams or self._calls):
                self._busy_since = time.monotonic()
            self._streams[request_id] = stream
        self._outbox.put((wire.ADD, request_id, prompt, params, priority, lora_name))
        finished = False
        try:
            while not finished:
                item = await stream.get()  # deltas merged while this was behind
                if isinstance(item, BaseException):
                    finished = True  # the core has dropped it already
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                self.abort(request_id)

    async def run(self, work: Callable[[], T]) -> T:
        """`work()` on a thread of its own: what it asks of `self.engine` (adding a LoRA
        adapter) is a call the core answers between steps."""
        return await asyncio.to_thread(work)

    def abort(self, request_id: str) -> None:
        with self._lock:
            known = self._streams.pop(request_id, None) is not None
        if known:
            self._outbox.put((wire.ABORT, request_id))

    def compilations(self) -> int:
        """XLA compilations in the core process."""
        status = self._status
        return status.compilations if status is not None else 0

    def shutdown(self, timeout: float = 30.0) -> None:
        """The owner: stops taking requests, lets the core finish running ones for up to
        `timeout` seconds (then it aborts the rest) and waits for it to exit. Others just
        leave (the core aborts what they still had running)."""
        self._stopping = True
        if self._process is not None:
            self._outbox.put((wire.STOP, timeout))
            self._process.join(timeout + STOP_SLACK_S)
            if self._process.is_alive():
                log.error("the engine core did not stop in time; killing it")
                self._process.kill()
                self._process.join()
        self._outbox.put(None)
        self._conn.close()
        self._lost("server shutting down")

    # ---- the RemoteEngine's calls ------------------------------------------------------------

    def call(self, method: str, *args: Any) -> Future[Any]:
        future: Future[Any] = Future()
        with self._lock:
            if self._dead:
                future.set_exception(EngineDeadError(self._dead))
                return future
            if not (self._streams or self._calls):
                self._busy_since = time.monotonic()
            call_id = next(self._call_ids)
            self._calls[call_id] = future
        self._outbox.put((wire.CALL, call_id, method, args))
        return future

    @property
    def status(self) -> wire.CoreStatus | None:
        return self._status

    @property
    def gone(self) -> str:
        """Why the core process is gone ("" while it runs, and once this client stopped it)."""
        return "" if self._stopping else self._dead

    # ---- the threads -------------------------------------------------------------------------

    def _stop_reason(self, status: wire.CoreStatus | None) -> str:
        if self._stopping:
            return "shutting down"
        if self._dead:
            return self._dead
        return status.health.reason if status is not None and not status.health.ok else ""

    def _write(self) -> None:
        while (message := self._outbox.get()) is not None:
            pending = [message]
            while True:
                try:
                    more = self._outbox.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    return
                pending.append(more)
            try:
                wire.send(self._conn, pending)
            except OSError:
                return  # the reader reports the core gone

    def _read(self) -> None:
        try:
            while True:
                for message in wire.receive(self._conn):
                    self._take(message)
        except (EOFError, OSError):
            self._lost(_gone(self._process))

    def _take(self, message: tuple[Any, ...]) -> None:
        kind = message[0]
        if kind == wire.OUTPUTS:
            self._deliver(message[1])
        elif kind == wire.STATUS:
            with self._lock:
                self._status, self._heard = message[1], time.monotonic()
                self._status_at = self._heard
        elif kind == wire.REFUSED:
            with self._lock:
                stream = self._streams.pop(message[1], None)
            if stream is not None:
                _call_soon(stream.loop, stream.put, message[2])
        elif kind == wire.REPLY:
            self._answer(*message[1:])

    def _deliver(self, items: list[Delta]) -> None:
        """Hands each delta, as it crossed, to its stream (which merges what waits for it)."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[OutputCollector[Delta], Delta]]] = {}
        with self._lock:
            self._heard = time.monotonic()
            for item in items:
                request_id = wire.request_id(item)
                stream = self._streams.get(request_id)
                if stream is None:
                    continue  # aborted meanwhile
                if wire.finished(item):
                    del self._streams[request_id]
                by_loop.setdefault(stream.loop, []).append((stream, item))
        for loop, deliveries in by_loop.items():
            if not _call_soon(loop, _put_all, deliveries):
                for _, item in deliveries:  # nobody is left to listen
                    self.abort(wire.request_id(item))

    def _answer(self, call_id: int, error: BaseException | None, value: Any) -> None:
        with self._lock:
            future = self._calls.pop(call_id, None)
        if future is None:
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(value)

    def _lost(self, reason: str) -> None:
        """The core is gone: every stream ends with EngineDeadError, every call fails."""
        with self._lock:
            first = not self._dead
            self._dead = self._dead or reason
            streams, self._streams = self._streams, {}
            calls, self._calls = self._calls, {}
        if first and not self._stopping:
            log.error("engine unhealthy: %s", reason)
        error = EngineDeadError(reason)
        for stream in streams.values():
            _call_soon(stream.loop, stream.put, error)
        for future in calls.values():
            future.set_exception(error)


class RemoteEngine:
    """The `Engine` protocol's read side for an engine in the core process: what the servers
    ask of `front.engine` (the tokenizer, limits, gauges, health, adapters, grammars). The
    step side belongs to the core's own loop."""

    def __init__(self, client: EngineCoreClient, info: ModelInfo, tokenizer: Tokenizer):
        self._client = client
        self._info = info
        self._tokenizer = tokenizer
        self._loras: tuple[str, ...] = ()

    @property
    def tokenizer(self) -> Tokenizer:
        return self._tokenizer

    def model_info(self) -> ModelInfo:
        return self._info

    def stats(self) -> EngineStats:
        status = self._client.status
        return status.stats if status is not None else EngineStats()

    def health(self) -> Health:
        """Fatal once the core process is gone: the server should stop."""
        if self._client.gone:
            return Health(ok=False, reason=self._client.gone, fatal=True)
        status = self._client.status
        return status.health if status is not None else Health()

    def list_loras(self) -> list[str]:
        status = self._client.status
        return list(status.loras if status is not None else self._loras)

    def add_lora(self, name: str, path: str, *, restricted: bool = False) -> None:
        self._client.call("add_lora", name, path, restricted).result()

    def remove_lora(self, name: str) -> None:
        self._client.call("remove_lora", name).result()

    def compile_grammar(self, spec: StructuredOutputs) -> Future[None]:
        return self._client.call("compile_grammar", spec)

    def has_unfinished_requests(self) -> bool:
        stats = self.stats()
        return stats.num_running + stats.num_waiting > 0

    def add_request(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("the engine core runs its own loop: use EngineCoreClient.generate")

    def abort_request(self, request_id: str) -> None:
        self._client.abort(request_id)

    def step(self) -> list[RequestOutput]:
        raise TypeError("the engine core runs its own loop: use EngineCoreClient.generate")

    def warm_up_step(self) -> bool:
        return False  # the core warms up while idle

    def close(self) -> None:
        pass  # the client's shutdown ends the core


def _put_all(deliveries: list[tuple[OutputCollector[Delta], Delta]]) -> None:
    for stream, item in deliveries:
        stream.put(item)


def _call_soon(loop: asyncio.AbstractEventLoop, callback: Callable[..., None], *args: Any) -> bool:
    try:
        loop.call_soon_threadsafe(callback, *args)
    except RuntimeError:  # that event loop has closed
        return False
    return True


def _gone(process: BaseProcess | None) -> str:
    """Why the core's pipe closed, with its exit status when this process started it."""
    if process is None:
        return "the engine core process exited"
    process.join(1.0)
    code = process.exitcode
    if code is not None and code < 0:
        return f"the engine core process was killed by signal {-code}"
    return f"the engine core process exited (status {code})"
