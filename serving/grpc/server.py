"""The gRPC server: `xlaserve.v1.Generation` over an AsyncEngine, with the standard
`grpc.health.v1` health service and server reflection.

Host code: never imports jax. Two ways to run it:
- `start_grpc_server(...)` (what `xlaserve serve` uses) runs a grpc.aio server on its own thread
  with its own event loop, and returns a handle to stop it. A blocking call from any thread,
  inside a running event loop or not; the HTTP server's loop and this one never wait for each
  other. AsyncEngine streams work from any loop (each stream remembers its own).
- `await serve_grpc(...)` starts the same server on the running loop instead (e.g. inside the
  HTTP server's lifespan); `await server.stop()` on what it returns stops it.

Status codes: a request the engine refuses (bad sampling parameters, empty prompt, prompt over
the context, ...) -> INVALID_ARGUMENT with the validation message, which names the field; a dead,
stopping or stalled engine -> UNAVAILABLE, with the reason; a server that already holds as many
requests as its admission limit allows (shared with the HTTP server: serving/admission.py) ->
RESOURCE_EXHAUSTED, with `grpc-retry-pushback-ms` in the trailing metadata. Cancelling a
Generate call closes the engine stream, which aborts the request and frees its KV pages within
one engine step. The health service reports NOT_SERVING while the engine loop is dead, stopping
or stalled (AsyncEngine.health), polled every HEALTH_POLL_S.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import cast

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from engine.errors import InvalidRequestError
from engine.request import RequestOutput
from serving.admission import RETRY_AFTER_S, AdmissionLimit, ServerBusyError
from serving.async_engine import EngineDeadError
from serving.front import Front
from serving.grpc.convert import (
    check_token_ids,
    prompt_from_proto,
    sampling_params_from_proto,
    stream_messages,
)
from serving.grpc.stubs import SERVICE_NAME, pb2, pb2_grpc

log = logging.getLogger(__name__)

HEALTH_POLL_S = 0.5  # how often the health service looks at the engine loop
HEALTH_SERVICE_NAME = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name


class GenerationService(pb2_grpc.GenerationServicer):
    def __init__(
        self,
        engine: Front,
        served_model_name: str,
        admission: AdmissionLimit | None = None,  # None: every request is admitted
    ):
        self._engine = engine
        self._tokenizer = engine.engine.tokenizer
        self._info = engine.engine.model_info()
        self._model_name = served_model_name
        self._admission = admission

    @contextlib.asynccontextmanager
    async def _admitted(self) -> AsyncIterator[None]:
        """Raises ServerBusyError when the admission limit is reached (checked and counted at
        once, nothing awaited in between); leaving the block gives the admission back."""
        if self._admission is None:
            yield
            return
        with self._admission.admit(1):
            yield

    async def Generate(
        self, request: pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> None:
        # Writes rather than yields: a cancelled call then raises CancelledError in this
        # coroutine, and `aclosing` closes the engine stream (aborting the request) at once; a
        # handler suspended at `yield` would be closed only when it is garbage collected.
        try:
            prompt = prompt_from_proto(request)
            params = sampling_params_from_proto(request.sampling_params)
            request_id = f"grpc-{uuid.uuid4().hex}"
            stream = cast(  # an async generator (annotated as its AsyncIterator interface)
                AsyncGenerator[RequestOutput, None],
                self._engine.generate(
                    request_id,
                    prompt,
                    params,
                    priority=request.priority,
                    lora_name=request.lora_name if request.HasField("lora_name") else None,
                ),
            )
            async with self._admitted(), contextlib.aclosing(stream):
                async for output in stream:  # deltas: each is sent as it is
                    for message in stream_messages(output, params):
                        await context.write(message)
        except (InvalidRequestError, EngineDeadError, ServerBusyError) as e:
            await _abort(context, e)

    async def Tokenize(
        self, request: pb2.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> pb2.TokenizeResponse:
        add_special = request.add_special_tokens if request.HasField("add_special_tokens") else True
        ids = self._tokenizer.encode(request.text, add_special_tokens=add_special)
        return pb2.TokenizeResponse(
            token_ids=ids,
            count=len(ids),
            max_model_len=self._info.max_model_len,
        )

    async def Detokenize(
        self, request: pb2.DetokenizeRequest, context: grpc.aio.ServicerContext
    ) -> pb2.DetokenizeResponse:
        skip = request.skip_special_tokens if request.HasField("skip_special_tokens") else True
        try:
            check_token_ids(request.token_ids, self._tokenizer.vocab_size, "token_ids")
        except InvalidRequestError as e:
            await _abort(context, e)
        return pb2.DetokenizeResponse(text=self._tokenizer.decode(request.token_ids, skip))

    async def GetModelInfo(
        self, request: pb2.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb2.ModelInfo:
        info = self._info
        return pb2.ModelInfo(
            model=self._model_name,
            architecture=info.architecture,
            max_model_len=info.max_model_len,
            vocab_size=info.vocab_size,
            bos_token_id=self._tokenizer.bos_token_id,
            eos_token_ids=self._tokenizer.eos_token_ids,
            has_chat_template=self._tokenizer.chat_template is not None,
            max_num_seqs=info.max_num_seqs,
        )


async def _abort(context: grpc.aio.ServicerContext, error: Exception) -> None:
    if isinstance(error, ServerBusyError):
        pushback = (("grpc-retry-pushback-ms", str(RETRY_AFTER_S * 1000)),)
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(error), pushback)
    code = (
        grpc.StatusCode.INVALID_ARGUMENT
        if isinstance(error, InvalidRequestError)
        else grpc.StatusCode.UNAVAILABLE
    )
    await context.abort(code, str(error))  # raises: the call ends here


# ---- the server on the running loop --------------------------------------------------------


@dataclass
class AioGrpcServer:
    """A started grpc.aio server and the task that keeps its health status current."""

    server: grpc.aio.Server
    port: int  # the bound port (the one asked for, or the one chosen for port 0)
    health: health.aio.HealthServicer
    _watcher: asyncio.Task[None] = field(repr=False)

    async def stop(self, grace: float | None = 5.0) -> None:
        """Stops taking calls; running ones get `grace` seconds, then are cancelled (aborting
        their requests)."""
        self._watcher.cancel()
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace)


async def serve_grpc(
    async_engine: Front,
    port: int,
    served_model_name: str,
    *,
    host: str = "127.0.0.1",
    admission: AdmissionLimit | None = None,
) -> AioGrpcServer:
    """Starts the gRPC server on the running event loop, listening on host:port. `admission`:
    the limit on requests running or waiting at once (shared with the HTTP server of the same
    engine); None admits every request."""
    # Without SO_REUSEPORT a port that is already taken fails here instead of being shared.
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    service = GenerationService(async_engine, served_model_name, admission)
    pb2_grpc.add_GenerationServicer_to_server(service, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = (SERVICE_NAME, HEALTH_SERVICE_NAME, reflection.SERVICE_NAME)
    reflection.enable_server_reflection(names, server)
    bound = server.add_insecure_port(_address(host, port))
    await server.start()
    await _set_health(health_servicer, async_engine.is_healthy)
    watcher = asyncio.create_task(_watch_health(async_engine, health_servicer))
    log.info("gRPC server (%s) listening on %s", SERVICE_NAME, _address(host, bound))
    return AioGrpcServer(server, bound, health_servicer, watcher)


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


async def _watch_health(engine: Front, servicer: health.aio.HealthServicer) -> None:
    """Keeps the health status in step with the engine loop (NOT_SERVING once it is dead)."""
    while True:
        await _set_health(servicer, engine.is_healthy)
        await asyncio.sleep(HEALTH_POLL_S)


async def _set_health(servicer: health.aio.HealthServicer, healthy: bool) -> None:
    Status = health_pb2.HealthCheckResponse
    status = Status.SERVING if healthy else Status.NOT_SERVING
    for service in ("", SERVICE_NAME):  # "" is the whole server
        await servicer.set(service, status)


# ---- the server on its own thread ----------------------------------------------------------


class GrpcServerHandle:
    """A gRPC server running on a thread of its own, with its own event loop."""

    def __init__(self) -> None:
        self._started: concurrent.futures.Future[AioGrpcServer] = concurrent.futures.Future()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop_requested: asyncio.Event | None = None
        self._grace: float | None = None
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return self._started.result().port

    def stop(self, grace: float | None = 5.0) -> None:
        """Stops taking calls, gives running ones `grace` seconds (then cancels them, which
        aborts their requests), and ends the thread."""
        if self._loop is not None and self._stop_requested is not None:
            self._grace = grace
            with contextlib.suppress(RuntimeError):  # the loop has already stopped
                self._loop.call_soon_threadsafe(self._stop_requested.set)
        if self._thread is not None:
            self._thread.join()

    def _run(self, start: Callable[[], Awaitable[AioGrpcServer]]) -> None:
        asyncio.run(self._serve(start))

    async def _serve(self, start: Callable[[], Awaitable[AioGrpcServer]]) -> None:
        self._loop, self._stop_requested = asyncio.get_running_loop(), asyncio.Event()
        try:
            server = await start()
        except BaseException as e:
            self._started.set_exception(e)
            return
        self._started.set_result(server)
        await self._stop_requested.wait()
        await server.stop(self._grace)


def start_grpc_server(
    async_engine: Front,
    port: int,
    served_model_name: str,
    *,
    host: str = "127.0.0.1",
    admission: AdmissionLimit | None = None,
) -> GrpcServerHandle:
    """Starts the gRPC server on a thread of its own; returns once it is listening (port 0
    picks a free port: see `handle.port`). Raises what binding or starting raised."""
    handle = GrpcServerHandle()

    def start() -> Awaitable[AioGrpcServer]:
        return serve_grpc(async_engine, port, served_model_name, host=host, admission=admission)

    handle._thread = threading.Thread(target=handle._run, args=(start,), name="grpc-server")
    handle._thread.daemon = True
    handle._thread.start()
    handle._started.result()  # raises what serve_grpc raised
    return handle
