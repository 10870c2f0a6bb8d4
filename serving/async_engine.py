"""An asyncio front for the engine: the engine loop runs on its own thread, each request gets
an async stream of its outputs, and a caller that goes away aborts its request.

Host code: never imports jax. Only the engine thread touches the engine: callers post
requests and aborts to its inbox, and it takes them between steps, so the asyncio loop never
waits for a step.

Health: besides a dead or stopping loop, a loop that has work (a request running or waiting, or
an operation in its inbox) and has not finished a step for the step timeout is unhealthy, and
refuses new requests, until a step finishes again (a step that hung and then finishes brings
health back). The timeout is `step_timeout` seconds if given, else `STEP_TIMEOUT_FACTOR` times
the slowest step or idle bucket compilation the loop has timed so far (a step that compiles a
bucket on the spot counts), and never less than `STEP_TIMEOUT_FLOOR_S`. A watchdog thread looks
every `WATCHDOG_INTERVAL_S` and logs a stall, with its reason, as it begins and as it ends.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from engine.errors import XlaserveError
from engine.protocol import Engine
from engine.request import RequestOutput, SamplingParams
from serving.collector import OutputCollector, merge_outputs

log = logging.getLogger(__name__)
T = TypeVar("T")

STEP_TIMEOUT_FACTOR = 10  # the automatic step timeout: this times the slowest step timed ...
STEP_TIMEOUT_FLOOR_S = 120.0  # ... and at least this (a first step may compile a bucket)
WATCHDOG_INTERVAL_S = 0.5


class EngineDeadError(XlaserveError):
    """The engine loop stopped or is not making progress; it takes no new requests."""


@dataclass(frozen=True)
class LoopHealth:
    """Whether the engine loop serves (`ok`), and if not why (`reason`, one line)."""

    ok: bool
    reason: str  # "" when ok
    last_step_age_s: float  # since the loop last finished a step (or started, before any)
    step_timeout_s: float  # how long a step may take while there is work


class AsyncEngine:
    """While no request is waiting, the engine thread compiles the engine's step variants not
    compiled yet, one at a time (`Engine.warm_up_step`; a bucket a request needs first is
    compiled on the spot), so that a server built with background warm-up answers as soon as
    its weights are loaded. `step_timeout`: seconds a step may take while there is work before
    the loop reports unhealthy (None: automatic; see Health in the module's docstring)."""

    def __init__(self, engine: Engine, *, step_timeout: float | None = None):
        if step_timeout is not None and step_timeout <= 0:
            raise ValueError(f"{step_timeout=} must be positive (or None: automatic)")
        self.engine = engine
        self._warming = True
        self._step_timeout = step_timeout
        self._cond = threading.Condition()
        # Progress, written by the engine thread (and `_post`) under `_cond`:
        self._last_step_end = time.monotonic()  # when the last step (or compilation) finished
        self._work_since: float | None = None  # when the loop last went from idle to busy
        self._slowest_step_s = 0.0
        self._stalled = False  # as last logged
        self._inbox: deque[Callable[[], None]] = deque()
        self._streams: dict[str, OutputCollector] = {}
        self._admissions: set[asyncio.Future[None]] = set()  # generate() calls awaiting add
        self._stopping = False
        self.error: BaseException | None = None
        self._stopped = threading.Event()  # the loop has ended (so does the watchdog)
        self._thread = threading.Thread(target=self._loop, name="engine-loop", daemon=True)
        self._thread.start()
        watchdog = threading.Thread(target=self._watch, name="engine-watchdog", daemon=True)
        watchdog.start()

    # ---- the public surface ------------------------------------------------------------------

    @property
    def is_healthy(self) -> bool:
        return self.health().ok

    def health(self) -> LoopHealth:
        """The loop's health now; any thread may ask (it reads a few numbers under a lock)."""
        now = time.monotonic()
        with self._cond:
            last, since, slowest = self._last_step_end, self._work_since, self._slowest_step_s
        timeout = self._step_timeout or max(STEP_TIMEOUT_FLOOR_S, STEP_TIMEOUT_FACTOR * slowest)
        stalled = ""
        if since is not None and now - max(last, since) > timeout:
            stalled = (
                f"no engine step has finished for {now - max(last, since):.1f} s while requests "
                f"wait; the step timeout is {timeout:g} s"
            )
        self._log_stall(stalled)
        reason = self._stop_reason() or stalled
        return LoopHealth(not reason, reason, now - last, timeout)

    async def generate(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        lora_name: str | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Yields the request's deltas (what each step added); the last has `finished` set.

        Raises InvalidRequestError for a request that can't be served (a structured-output
        grammar that does not compile in time among them: it compiles on the engine's compiler
        threads while this waits, never on the engine loop), and EngineDeadError if the engine
        loop is gone. Closing the iterator early (a client that went away) aborts
        the request, which frees its pages within one engine step.
        """
        if params.structured_outputs is not None:
            await asyncio.wrap_future(self.engine.compile_grammar(params.structured_outputs))
        loop = asyncio.get_running_loop()
        stream: OutputCollector[RequestOutput] = OutputCollector(loop, merge_outputs)
        accepted: asyncio.Future[None] = loop.create_future()
        self._admissions.add(accepted)
        accepted.add_done_callback(self._admissions.discard)

        def add() -> None:
            try:
                self.engine.add_request(
                    request_id, prompt, params, priority=priority, lora_name=lora_name
                )
            except BaseException as e:
                _call_soon(loop, _settle, accepted, e)
                return
            if _call_soon(loop, _settle, accepted, None):
                self._streams[request_id] = stream
            else:  # the caller's event loop closed meanwhile
                self.engine.abort_request(request_id)

        self._post(add)
        await accepted
        finished = False
        try:
            while not finished:
                item = await stream.get()  # deltas merged while this was behind
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                self.abort(request_id)

    async def run(self, work: Callable[[], T]) -> T:
        """The result of `work()` run on the engine thread between steps (what changes the
        engine's state, e.g. loading a LoRA adapter); its exception is raised here."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[T] = loop.create_future()

        def call() -> None:
            try:
                result = work()
            except BaseException as e:
                _call_soon(loop, _settle, done, e)
                return
            _call_soon(loop, _set_result, done, result)

        self._post(call)
        return await done

    def abort(self, request_id: str) -> None:
        def abort() -> None:
            self._streams.pop(request_id, None)
            self.engine.abort_request(request_id)

        self._post(abort, even_if_dead=True)

    def compilations(self) -> int:
        """XLA compilations in this process (the engine's)."""
        from engine import compilation

        return compilation.count()

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stops taking requests, lets running ones finish for up to `timeout` seconds, then
        aborts the rest and stops the loop."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join(timeout)
        if self._thread.is_alive():
            with self._cond:
                self._inbox.append(self._abort_all)
                self._cond.notify()
            self._thread.join()
        self.engine.close()

    # ---- the engine thread -------------------------------------------------------------------

    def _stop_reason(self) -> str:
        if self._stopping:
            return "shutting down"
        if self.error is not None:
            return f"engine loop died: {self.error!r}"
        if not self._thread.is_alive():
            return "engine loop stopped"
        return self.engine.health().reason

    def _log_stall(self, stalled: str) -> None:
        """Logs a stall as it begins (with its reason) and ends; a dead loop logs its own end."""
        with self._cond:
            changed = bool(stalled) != self._stalled
            self._stalled = bool(stalled)
        if changed and stalled:
            log.error("engine unhealthy: %s", stalled)
        elif changed:
            log.warning("engine healthy again: a step finished")

    def _watch(self) -> None:
        while not self._stopped.wait(WATCHDOG_INTERVAL_S):
            self.health()

    def _post(self, operation: Callable[[], None], *, even_if_dead: bool = False) -> None:
        with self._cond:  # a re-entrant lock: `health` takes it too
            health = self.health()
            if not even_if_dead and not health.ok:
                raise EngineDeadError(f"engine is not serving: {health.reason}")
            if self._work_since is None:
                self._work_since = time.monotonic()
            self._inbox.append(operation)
            self._cond.notify()

    def _loop(self) -> None:
        try:
            while self._run_once():
                pass
        except BaseException as e:  # the loop must never die silently
            log.exception("engine loop died")
            self.error = e
            self._abort_all(EngineDeadError(f"engine loop died: {e!r}"))
        finally:
            self._stopped.set()

    def _run_once(self) -> bool:
        """Takes the inbox, then runs one step (or, idle, warms one bucket up); False when it is
        time to stop."""
        with self._cond:
            while not self._inbox and not self.engine.has_unfinished_requests():
                self._work_since = None  # idle: nothing waits for a step
                if self._stopping:
                    return False
                if self._warming:
                    break
                self._cond.wait()
            operations = list(self._inbox)
            self._inbox.clear()
        for operation in operations:
            operation()
        if not operations and not self.engine.has_unfinished_requests():
            self._warming = self._timed(self.engine.warm_up_step)
            if not self._warming:
                log.info("all %d step variants compiled", self.engine.stats().num_step_variants)
            return True
        for output in self._timed(self.engine.step):
            self._deliver(output)
        return True

    def _timed(self, step: Callable[[], T]) -> T:
        """Runs a step (or a bucket's compilation), recording when it finished and how long it
        took, for `health`."""
        start = time.monotonic()
        result = step()
        end = time.monotonic()
        with self._cond:
            self._last_step_end = end
            self._slowest_step_s = max(self._slowest_step_s, end - start)
        return result

    def _deliver(self, output: RequestOutput) -> None:
        stream = self._streams.get(output.request_id)
        if stream is None:
            return
        if output.finished:
            del self._streams[output.request_id]
        if not _call_soon(stream.loop, stream.put, output):
            self._streams.pop(output.request_id, None)  # nobody is left to listen
            self.engine.abort_request(output.request_id)

    def _abort_all(self, error: BaseException | None = None) -> None:
        error = error or EngineDeadError("server shutting down")
        for future in list(self._admissions):
            _call_soon(future.get_loop(), _settle, future, error)
        for request_id, stream in list(self._streams.items()):
            self.engine.abort_request(request_id)
            _call_soon(stream.loop, stream.put, error)
        self._streams.clear()


def _call_soon(loop: asyncio.AbstractEventLoop, callback: Callable[..., None], *args: Any) -> bool:
    """Schedules `callback` on a caller's loop; False if that loop is closed (a caller that
    went away without closing its stream, e.g. a server thread that stopped)."""
    try:
        loop.call_soon_threadsafe(callback, *args)
    except RuntimeError:
        return False
    return True


def _settle(future: asyncio.Future[None], error: BaseException | None) -> None:
    if future.done():
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)


def _set_result(future: asyncio.Future[Any], result: Any) -> None:
    if not future.done():
        future.set_result(result)
