"""How many requests a server takes on at once: the limit that `--max-num-seqs` and
`--max-queued-requests` set, shared by the HTTP and gRPC front ends of one engine.

Host code: plain Python, thread-safe (the gRPC server runs on a thread and event loop of its
own). The check and the count are one step under a lock, taken in the handler before anything
is awaited, so a burst cannot slip past the limit between checking and counting.

What "queued" means (as vLLM's `num_requests_waiting`): a request is *admitted* from the moment
its handler accepts it until its answer has been sent, it failed, or its client went away; the
engine runs up to `max_num_seqs` of the admitted requests at once, and the others wait (queued).
So at most `max_num_seqs + max_queued_requests` requests are admitted at any time, and when the
engine runs `max_num_seqs` of them at most `max_queued_requests` wait. Every prompt of a
completions request is one engine request and counts as one. (Requests with `n` > 1 and
preempted ones take more than one running slot or give theirs up, so fewer run and more of the
admitted wait; the total still holds.)
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, Protocol

from engine.errors import InvalidRequestError, XlaserveError

RETRY_AFTER_S = 1  # what a refused client is told to wait before trying again


class ServerBusyError(XlaserveError):
    """As many requests as the limit allows are already admitted: retry later (HTTP 503 with
    Retry-After, gRPC RESOURCE_EXHAUSTED)."""


class Admission:
    """Requests admitted together; `release()` gives them back (the first call only), and so
    does leaving a `with` block."""

    def __init__(self, give_back: Callable[[], None]):
        self._give_back: Callable[[], None] | None = give_back

    def release(self) -> None:
        give_back, self._give_back = self._give_back, None
        if give_back is not None:
            give_back()

    def __enter__(self) -> Admission:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()


class Counter(Protocol):
    """A count and the lock that guards it: `multiprocessing.Value("i")` (shared by the API
    server processes of one engine: `--api-server-count`) or `LocalCounter`."""

    value: int

    def get_lock(self) -> AbstractContextManager[Any]: ...


class LocalCounter:
    """A Counter for one process."""

    def __init__(self) -> None:
        self.value = 0
        self._lock = threading.Lock()

    def get_lock(self) -> AbstractContextManager[Any]:
        return self._lock


class AdmissionLimit:
    """At most `max_running + max_queued` requests admitted at once (see the module's
    docstring); beyond it `admit` raises ServerBusyError. `counter`: where the admitted are
    counted; one shared by several processes holds the limit across all of them."""

    def __init__(self, max_running: int, max_queued: int, counter: Counter | None = None):
        if max_running < 1 or max_queued < 0:
            raise ValueError(f"need {max_running=} >= 1 and {max_queued=} >= 0")
        self.max_running = max_running
        self.max_queued = max_queued
        self._counter = counter if counter is not None else LocalCounter()

    @property
    def capacity(self) -> int:
        return self.max_running + self.max_queued

    @property
    def num_admitted(self) -> int:
        return self._counter.value

    def admit(self, num_requests: int = 1) -> Admission:
        """Counts `num_requests` in, or raises ServerBusyError if that would pass the limit;
        InvalidRequestError if it always would (more prompts than the whole limit)."""
        if num_requests > self.capacity:
            raise InvalidRequestError(
                f"{num_requests} prompts in one request; this server admits at most "
                f"{self.capacity} at once",
                param="prompt",
            )
        with self._counter.get_lock():
            admitted = self._counter.value
            if admitted + num_requests > self.capacity:
                raise ServerBusyError(
                    f"server busy: {admitted} requests are running or waiting, the limit "
                    f"is {self.max_running} running + {self.max_queued} waiting; retry in "
                    f"{RETRY_AFTER_S} s"
                )
            self._counter.value = admitted + num_requests
        return Admission(lambda: self._give_back(num_requests))

    def _give_back(self, num_requests: int) -> None:
        with self._counter.get_lock():
            self._counter.value -= num_requests
