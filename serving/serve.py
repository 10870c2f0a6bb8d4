"""`xlaserve serve`: the OpenAI-compatible HTTP server (and gRPC, with --grpc-port).

The HTTP server starts first, answering /health with 503 while the model loads and compiles
(in the engine core process, serving/processes.py; with --engine-in-process on a thread of the
server's own); then the engine is attached and a log line gives the address. SIGTERM or Ctrl-C
stops taking connections, lets running requests finish for --shutdown-timeout seconds, then
cancels (aborting) what is left and stops the engine loop. An engine that dies (its process
gone, or a multi-process engine's follower) turns /health to 503, and the server exits with
status 1 and one line saying why.

The API server runs on uvloop's event loop with httptools parsing HTTP (uvicorn's "standard"
set, as vLLM serves): with hundreds of streams, writing each token's event is most of its
work, and libuv's transports and httptools do in C what asyncio's selector loop and h11 do in
Python (bench/host_overhead.py's served rows measure it).
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.util
import logging
import math
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable, Coroutine, Generator
from contextlib import contextmanager
from dataclasses import dataclass
from types import FrameType
from typing import Any

import uvicorn
import uvloop

from engine.config import EngineConfig
from engine.errors import XlaserveError
from engine.host_gc import configure_collector
from serving import processes
from serving.admission import AdmissionLimit, Counter
from serving.async_engine import AsyncEngine
from serving.core_client import EngineCoreClient
from serving.engine_core import name_process
from serving.front import Front
from serving.openai import attach_engine, create_app
from serving.openai.tool_use import ChatSettings
from serving.openai.tools import chat_template

log = logging.getLogger("xlaserve.serve")
ENGINE_STOP_TIMEOUT = 5.0  # after the HTTP side drained, what the engine loop still gets
FAILED_EXIT_DELAY = 2.0  # a leader whose follower died answers /health 503 this long, then exits
FATAL_POLL_SECONDS = 0.5


@dataclass(frozen=True)
class ServeOptions:
    """The server's own settings (the engine's are its EngineConfig)."""

    host: str = "127.0.0.1"
    port: int = 8000
    grpc_port: int | None = None  # None: no gRPC server
    api_key: str | None = None
    served_model_name: str = "smollm2-135m"
    max_queued_requests: int = 1024
    max_request_bytes: int = 8 * 2**20
    shutdown_timeout: float = 30.0  # seconds running requests get on SIGTERM or Ctrl-C
    step_timeout: float | None = None  # see AsyncEngine; None: automatic
    verbose: bool = False
    chat_template: str | None = None  # a shipped template's name or a jinja file
    tool_call_parser: str | None = None  # hermes, llama3_json, pythonic; None: no tools
    engine_in_process: bool = False  # the engine on a thread here, not in a core process
    api_server_count: int = 1  # API server processes (with the engine in a core process)

    def __post_init__(self) -> None:
        if self.api_server_count < 1:
            raise ValueError(f"api_server_count must be >= 1, got {self.api_server_count}")
        if self.api_server_count > 1 and self.engine_in_process:
            raise ValueError("--api-server-count above 1 needs the engine in its own process")


def run_serve(config: EngineConfig, options: ServeOptions) -> int:
    """Serves until SIGTERM or Ctrl-C; returns the exit status. In a multi-process engine only
    process 0 serves; the others run the steps it sends until it stops."""
    log.setLevel(logging.DEBUG if options.verbose else logging.INFO)
    if options.engine_in_process or processes.multi_process_engine(config):
        return _run_in_process(config, options)
    counter = processes.shared_counter() if options.api_server_count > 1 else None
    app, admission = _app(config, options, counter)
    server = _Server(_uvicorn_config(app, options))
    sock = server.config.bind_socket() if options.api_server_count > 1 else None
    core = processes.start_core(config, options.api_server_count, options.verbose)
    others = processes.ApiServers(run_api_server, core.conns[1:], sock, (config, options, counter))

    def connect() -> Front:
        conn, timeout = core.conns[0], options.step_timeout
        return EngineCoreClient.connect(conn, process=core.process, step_timeout=timeout)

    try:
        sockets = [sock] if sock is not None else None
        return _run(_serve(options, app, server, admission, connect, others, sockets))
    finally:
        if core.process.is_alive():  # it never connected (the server stopped while loading)
            core.process.kill()
            core.process.join()


def run_api_server(
    index: int,
    conn: Any,
    sock: Any,
    config: EngineConfig,
    options: ServeOptions,
    counter: Counter | None,
) -> None:
    """An API server process beyond the first (spawned): HTTP on the shared socket, over the
    core at `conn`; SIGTERM (passed on by the first) drains it. It exits with status 1, and
    leaves the one line to the first, when the engine dies."""
    logging.basicConfig(
        level=logging.DEBUG if options.verbose else logging.WARNING,
        format=f"%(asctime)s %(levelname)s %(name)s[{index}]: %(message)s",
    )
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the first passes a Ctrl-C on as SIGTERM
    name_process(f"xlaserve-api-{index}")
    options = dataclasses.replace(options, grpc_port=None)  # gRPC: the first's alone
    app, admission = _app(config, options, counter)
    server = _Server(_uvicorn_config(app, options), signals=(signal.SIGTERM,))

    def connect() -> Front:
        return EngineCoreClient.connect(conn, step_timeout=options.step_timeout)

    serve = _serve(options, app, server, admission, connect, None, [sock], first=False)
    try:
        sys.exit(_run(serve))
    except XlaserveError:  # the engine did not load: the first API server says why
        sys.exit(1)


def _run_in_process(config: EngineConfig, options: ServeOptions) -> int:
    from engine.builder import build_engine, run_follower, start_processes

    if not start_processes(config):
        run_follower(config)
        return 0
    app, admission = _app(config, options, None)
    server = _Server(_uvicorn_config(app, options))

    def load() -> Front:
        engine = build_engine(config)
        return AsyncEngine(engine, step_timeout=options.step_timeout)

    serve = _serve(options, app, server, admission, load, None, None, exit_at_once=True)
    return _run(serve)


def _app(
    config: EngineConfig, options: ServeOptions, counter: Counter | None
) -> tuple[Any, AdmissionLimit]:
    # One limit for HTTP and gRPC (and every API server): running (every replica's) plus
    # waiting requests.
    admission = AdmissionLimit(
        config.scheduler.max_num_seqs * config.parallel.layout.num_replicas,
        options.max_queued_requests,
        counter,
    )
    app = create_app(
        None,
        options.served_model_name,
        api_key=options.api_key,
        admission=admission,
        max_body_bytes=options.max_request_bytes,
        allow_lora_updating=config.lora is not None and config.lora.allow_runtime_updating,
        chat_settings=_chat_settings(options),
    )
    return app, admission


def _run(main: Coroutine[Any, Any, int]) -> int:
    """`asyncio.run(main)` on a uvloop event loop."""
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main)


def _uvicorn_config(app: Any, options: ServeOptions) -> uvicorn.Config:
    return uvicorn.Config(
        app,
        host=options.host,
        port=options.port,
        http="httptools",
        log_level="info" if options.verbose else "warning",
        timeout_graceful_shutdown=math.ceil(options.shutdown_timeout),
        lifespan="off",
    )


def _chat_settings(options: ServeOptions) -> ChatSettings:
    try:
        template = chat_template(options.chat_template) if options.chat_template else None
        return ChatSettings(template, options.tool_call_parser)
    except (OSError, ValueError) as e:
        raise XlaserveError(f"--chat-template / --tool-call-parser: {e}") from e


async def _serve(
    options: ServeOptions,
    app: Any,
    server: _Server,
    admission: AdmissionLimit,
    load_front: Callable[[], Front],
    others: processes.ApiServers | None,
    sockets: list[socket.socket] | None,
    *,
    first: bool = True,
    exit_at_once: bool = False,
) -> int:
    """Serves HTTP (and gRPC) over the front `load_front` returns once it has loaded. A fatal
    engine error returns 1 after one line on stderr (from the first API server), or, with
    `exit_at_once` (a multi-process engine, whose exit barrier would wait for a dead peer),
    ends the process at once."""
    loop = asyncio.get_running_loop()
    loaded: dict[str, Any] = {}

    def on_loaded(async_engine: Front) -> None:
        loaded["engine"] = async_engine
        attach_engine(app, async_engine)
        loaded["watch"] = asyncio.create_task(_watch_fatal(async_engine, on_fatal))
        if options.grpc_port is not None:
            try:
                loaded["grpc"] = _start_grpc(async_engine, options, admission)
            except Exception as e:  # e.g. the port is taken
                on_failed(e)
                return
        if first:
            log.info(
                "serving %s at http://%s:%d (OpenAI API under /v1)",
                options.served_model_name,
                options.host,
                options.port,
            )

    def on_failed(error: BaseException) -> None:
        loaded["error"] = error
        server.should_exit = True

    def on_fatal(error: BaseException) -> None:
        loaded["fatal"] = True  # the engine loop may be stuck in a collective with a dead peer
        loop.call_later(FAILED_EXIT_DELAY, on_failed, error)

    def load() -> None:
        try:
            async_engine = load_front()
        except BaseException as e:
            loop.call_soon_threadsafe(on_failed, e)
        else:
            configure_collector()  # from now on the collector traverses only the requests' objects
            loop.call_soon_threadsafe(on_loaded, async_engine)

    def stop_grpc() -> None:
        if others is not None:
            others.stop()  # they drain while this one does
        handle = loaded.pop("grpc", None)
        if handle is not None:
            handle.stop(grace=options.shutdown_timeout)

    # gRPC drains while HTTP does: the signal starts its stop at once.
    server.on_exit = threading.Thread(target=stop_grpc, name="grpc-stop", daemon=True)
    threading.Thread(target=load, name="model-loader", daemon=True).start()
    await server.serve(sockets)
    if server.on_exit.ident is None:
        server.on_exit.start()
    await asyncio.to_thread(server.on_exit.join)
    if "fatal" in loaded:
        if first:
            print(f"xlaserve: error: {loaded['error']}", file=sys.stderr)
        if exit_at_once:
            _exit_now(1)
        return 1
    if others is not None:
        await asyncio.to_thread(others.join, options.shutdown_timeout + ENGINE_STOP_TIMEOUT)
    if "engine" in loaded:
        await asyncio.to_thread(loaded["engine"].shutdown, ENGINE_STOP_TIMEOUT)
    if "error" in loaded:
        raise loaded["error"]
    log.info("stopped")
    return 0


def _exit_now(status: int) -> None:
    """Ends the process at once (a multi-process engine's exit barrier would wait for a dead
    peer; see sharding.multihost.exit_now)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


async def _watch_fatal(async_engine: Front, on_fatal: Callable[[BaseException], None]) -> None:
    """Calls `on_fatal` once the engine says it can never serve again (a process of a
    multi-process engine died); it is polled from here because the engine loop may be stuck."""
    while True:
        health = async_engine.engine.health()
        if health.fatal:
            on_fatal(XlaserveError(health.reason))
            return
        await asyncio.sleep(FATAL_POLL_SECONDS)


def _start_grpc(async_engine: Front, options: ServeOptions, admission: AdmissionLimit) -> Any:
    if importlib.util.find_spec("serving.grpc.server") is None:
        raise XlaserveError("--grpc-port given, but this build has no gRPC server")
    from serving.grpc.server import start_grpc_server

    assert options.grpc_port is not None
    handle = start_grpc_server(
        async_engine,
        options.grpc_port,
        options.served_model_name,
        host=options.host,
        admission=admission,
    )
    log.info("gRPC on %s:%d", options.host, handle.port)
    return handle


class _Server(uvicorn.Server):
    """uvicorn's server, minus re-raising the caught signal after its shutdown (which would
    kill the process before the engine is stopped), plus a thread started on the first
    SIGTERM or Ctrl-C."""

    on_exit: threading.Thread | None = None

    def __init__(
        self, config: uvicorn.Config, signals: tuple[int, ...] = (signal.SIGINT, signal.SIGTERM)
    ):
        super().__init__(config)
        self.signals = signals

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if not self.should_exit and self.on_exit is not None:
            # Not started here: starting a thread inside a signal handler can break threading.
            asyncio.get_running_loop().call_soon_threadsafe(self._start_on_exit)
        super().handle_exit(sig, frame)

    def _start_on_exit(self) -> None:
        if self.on_exit is not None and self.on_exit.ident is None:
            self.on_exit.start()

    @contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        original = {sig: signal.signal(sig, self.handle_exit) for sig in self.signals}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)
