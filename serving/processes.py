"""The processes of `xlaserve serve`: by default the engine core runs in a process of its own
(serving/engine_core.py) and one or more API server processes (`--api-server-count`) talk to it
over pipes, each with its own Python interpreter, so that HTTP, SSE and gRPC never take the
engine loop's GIL.

The first API server is the process that `xlaserve serve` started: it owns the core (starts it,
stops it on SIGTERM after draining) and the others (starts them, passes SIGTERM on, waits for
them). The API servers accept on one listening socket, bound by the first and inherited by the
others, so the kernel spreads connections among them; they share one admission count
(`multiprocessing.Value`), so `--max-queued-requests` holds across all of them. Processes are
spawned, not forked: the parent may hold threads, and JAX must not be forked.

An engine over several processes (multi-host: --num-processes, or a multi-host Cloud TPU) keeps
its engine in the serving process, as its followers expect: `multi_process_engine`.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

from engine.config import EngineConfig
from serving.admission import Counter
from serving.engine_core import run_core

log = logging.getLogger("xlaserve.serve")
_spawn = multiprocessing.get_context("spawn")


def multi_process_engine(config: EngineConfig) -> bool:
    """Whether `config` asks for an engine over several processes (jax.distributed), which
    then runs in the serving process itself (sharding/multihost.py finds a multi-host Cloud
    TPU the same way)."""
    parallel = config.parallel
    given = (parallel.coordinator_address, parallel.num_processes, parallel.process_id)
    return any(x is not None for x in given) or "," in os.environ.get("TPU_WORKER_HOSTNAMES", "")


def shared_counter() -> Counter:
    """An admission count that every spawned API server shares."""
    counter: Counter = _spawn.Value("i", 0)
    return counter


@dataclass(frozen=True)
class Core:
    """The engine core process and one pipe end per API server (the first is the owner's)."""

    process: BaseProcess
    conns: tuple[Connection, ...]


def start_core(config: EngineConfig, num_api_servers: int, verbose: bool) -> Core:
    """Spawns the engine core process, which builds the engine `config` describes."""
    pairs = [_spawn.Pipe() for _ in range(num_api_servers)]
    process = _spawn.Process(
        target=run_core,
        args=(config, [core_end for _, core_end in pairs], verbose),
        name="xlaserve-engine-core",
    )
    process.start()
    for _, core_end in pairs:
        core_end.close()  # so that the API servers see EOF once the core is gone
    log.info("engine core process %d started", process.pid)
    return Core(process, tuple(client_end for client_end, _ in pairs))


class ApiServers:
    """The API server processes beyond the first (none with --api-server-count 1)."""

    def __init__(
        self,
        target: Callable[..., Any],
        conns: Sequence[Connection],
        sock: socket.socket | None,
        args: tuple[Any, ...],
    ):
        self._processes = []
        for i, conn in enumerate(conns, start=1):
            process = _spawn.Process(
                target=target, args=(i, conn, sock, *args), name=f"xlaserve-api-server-{i}"
            )
            process.start()
            conn.close()
            self._processes.append(process)

    def stop(self) -> None:
        """Passes a SIGTERM (drain, then exit) on to each."""
        for process in self._processes:
            if process.is_alive() and process.pid is not None:
                os.kill(process.pid, signal.SIGTERM)

    def join(self, timeout: float) -> None:
        for process in self._processes:
            process.join(timeout)
            if process.is_alive():
                log.error("API server process %d did not stop in time; killing it", process.pid)
                process.kill()
                process.join()
