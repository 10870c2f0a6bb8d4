"""An asyncio front for the engine: the engine loop runs on its own thread, each request gets
an async stream of its outputs, and a caller that goes away aborts its request.

Host code: never imports jax. Only the engine thread touches the engine: callers post
requests and aborts to its inbox, and it takes them between steps, so the asyncio loop never
waits for a step.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from engine.errors import XlaserveError
from engine.protocol import Engine
from engine.request import RequestOutput, SamplingParams

log = logging.getLogger(__name__)


class EngineDeadError(XlaserveError):
    """The engine loop stopped; nothing more can be served."""


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput | BaseException]


class AsyncEngine:
    """While no request is waiting, the engine thread compiles the engine's step buckets not
    compiled yet, one at a time (`Engine.warm_up_step`; a bucket a request needs first is
    compiled on the spot), so that a server built with background warm-up answers as soon as
    its weights are loaded."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self._warming = True
        self._cond = threading.Condition()
        self._inbox: deque[Callable[[], None]] = deque()
        self._streams: dict[str, _Stream] = {}
        self._admissions: set[asyncio.Future[None]] = set()  # generate() calls awaiting add
        self._stopping = False
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="engine-loop", daemon=True)
        self._thread.start()

    # ---- the public surface ------------------------------------------------------------------

    @property
    def is_healthy(self) -> bool:
        return (
            self.error is None
            and self._thread.is_alive()
            and not self._stopping
            and self.engine.health().ok
        )

    async def generate(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams,
        *,
        priority: int = 0,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Yields the request's outputs as they grow; the last one has `finished` set.

        Raises InvalidRequestError for a request that can't be served, and EngineDeadError if
        the engine loop is gone. Closing the iterator early (a client that went away) aborts
        the request, which frees its pages within one engine step.
        """
        loop = asyncio.get_running_loop()
        stream = _Stream(loop, asyncio.Queue())
        accepted: asyncio.Future[None] = loop.create_future()
        self._admissions.add(accepted)
        accepted.add_done_callback(self._admissions.discard)

        def add() -> None:
            try:
                self.engine.add_request(request_id, prompt, params, priority=priority)
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
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        def abort() -> None:
            self._streams.pop(request_id, None)
            self.engine.abort_request(request_id)

        self._post(abort, even_if_dead=True)

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

    def _post(self, operation: Callable[[], None], *, even_if_dead: bool = False) -> None:
        with self._cond:
            if not even_if_dead and not self.is_healthy:
                reason = "shutting down" if self._stopping else f"engine loop died: {self.error!r}"
                raise EngineDeadError(f"engine is not serving ({reason})")
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

    def _run_once(self) -> bool:
        """Takes the inbox, then runs one step (or, idle, warms one bucket up); False when it is
        time to stop."""
        with self._cond:
            while not self._inbox and not self.engine.has_unfinished_requests():
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
            self._warming = self.engine.warm_up_step()
            if not self._warming:
                log.info("all %d step buckets compiled", self.engine.stats().num_buckets)
            return True
        for output in self.engine.step():
            self._deliver(output)
        return True

    def _deliver(self, output: RequestOutput) -> None:
        stream = self._streams.get(output.request_id)
        if stream is None:
            return
        if output.finished:
            del self._streams[output.request_id]
        if not _call_soon(stream.loop, stream.queue.put_nowait, output):
            self._streams.pop(output.request_id, None)  # nobody is left to listen
            self.engine.abort_request(output.request_id)

    def _abort_all(self, error: BaseException | None = None) -> None:
        error = error or EngineDeadError("server shutting down")
        for future in list(self._admissions):
            _call_soon(future.get_loop(), _settle, future, error)
        for request_id, stream in list(self._streams.items()):
            self.engine.abort_request(request_id)
            _call_soon(stream.loop, stream.queue.put_nowait, error)
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
