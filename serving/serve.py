"""`xlaserve serve`: the OpenAI-compatible HTTP server (and gRPC, with --grpc-port).

The HTTP server starts first, answering /health with 503 while the model loads and compiles on
a thread of its own; then the engine is attached and a log line gives the address. SIGTERM or
Ctrl-C stops taking connections, lets running requests finish for --shutdown-timeout seconds,
then cancels (aborting) what is left and stops the engine loop.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import logging
import signal
import sys
import threading
import time
from collections.abc import Generator
from contextlib import contextmanager
from types import FrameType
from typing import Any

import jax
import uvicorn

from engine.errors import XlaserveError
from engine.tokenizer import Tokenizer
from serving.admission import AdmissionLimit
from serving.async_engine import AsyncEngine
from serving.openai import attach_engine, create_app
from sharding import multihost

log = logging.getLogger("xlaserve.serve")
ENGINE_STOP_TIMEOUT = 5.0  # after the HTTP side drained, what the engine loop still gets
FAILED_EXIT_DELAY = 2.0  # a leader whose follower died answers /health 503 this long, then exits


def run_serve(args: argparse.Namespace) -> int:
    """Serves until SIGTERM or Ctrl-C; returns the exit status. In a multi-process engine only
    process 0 serves; the others run the steps it sends until it stops."""
    log.setLevel(logging.DEBUG if args.verbose else logging.INFO)
    distributed = multihost.initialize(
        args.coordinator_address, args.num_processes, args.process_id
    )
    if distributed and not multihost.is_leader():
        return _follow(args)
    name = args.served_model_name or args.model
    # One limit for HTTP and gRPC: running (every replica's) plus waiting requests.
    admission = AdmissionLimit(
        args.max_num_seqs * args.data_parallel_size, args.max_queued_requests
    )
    app = create_app(
        None,
        None,
        name,
        api_key=args.api_key,
        admission=admission,
        max_body_bytes=args.max_request_bytes,
    )
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level="info" if args.verbose else "warning",
        timeout_graceful_shutdown=args.shutdown_timeout,
        lifespan="off",
    )
    server = _Server(config)
    return asyncio.run(_serve(args, app, server, name, admission))


async def _serve(
    args: argparse.Namespace, app: Any, server: _Server, name: str, admission: AdmissionLimit
) -> int:
    loop = asyncio.get_running_loop()
    loaded: dict[str, Any] = {}

    def on_loaded(async_engine: AsyncEngine, tokenizer: Tokenizer) -> None:
        loaded["engine"] = async_engine
        attach_engine(app, async_engine, tokenizer)
        if jax_process_count() > 1:
            _watch_followers(async_engine, loop, on_follower_dead)
        if args.grpc_port is not None:
            try:
                loaded["grpc"] = _start_grpc(async_engine, tokenizer, args, name, admission)
            except Exception as e:  # e.g. the port is taken
                on_failed(e)
                return
        log.info("serving %s at http://%s:%d (OpenAI API under /v1)", name, args.host, args.port)

    def on_failed(error: BaseException) -> None:
        loaded["error"] = error
        server.should_exit = True

    def on_follower_dead(error: BaseException) -> None:
        loaded["follower_dead"] = True  # the engine loop may be stuck in a collective with it
        loop.call_later(FAILED_EXIT_DELAY, on_failed, error)

    def load() -> None:
        try:
            result = load_engine(args)
            if jax_process_count() > 1:
                loaded["leader"] = _lead(result[0])
        except BaseException as e:
            loop.call_soon_threadsafe(on_failed, e)
        else:
            loop.call_soon_threadsafe(on_loaded, *result)

    def stop_grpc() -> None:
        handle = loaded.pop("grpc", None)
        if handle is not None:
            handle.stop(grace=args.shutdown_timeout)

    # gRPC drains while HTTP does: the signal starts its stop at once.
    server.on_exit = threading.Thread(target=stop_grpc, name="grpc-stop", daemon=True)
    threading.Thread(target=load, name="model-loader", daemon=True).start()
    await server.serve()
    if server.on_exit.ident is None:
        server.on_exit.start()
    await asyncio.to_thread(server.on_exit.join)
    if "follower_dead" in loaded:
        print(f"xlaserve: error: {loaded['error']}", file=sys.stderr)
        multihost.exit_now(1)
    if "engine" in loaded:
        await asyncio.to_thread(loaded["engine"].shutdown, ENGINE_STOP_TIMEOUT)
    if "leader" in loaded:
        loaded["leader"].stop()
    if "error" in loaded:
        raise loaded["error"]
    log.info("stopped")
    return 0


def load_engine(args: argparse.Namespace) -> tuple[AsyncEngine, Tokenizer]:
    """Loads the model (sharded over the parallel sizes' mesh) and compiles the engine's
    steps, with progress bars, or while idle (`--warm-up background`, one engine in one
    process: followers and replicas must hold every step before the first one runs)."""
    background = (
        getattr(args, "warm_up", "eager") == "background"
        and args.data_parallel_size == 1
        and jax.process_count() == 1
    )
    engine, tokenizer = _load(args, warm_up=not background)
    async_engine = AsyncEngine(engine, warm_up_when_idle=background, step_timeout=args.step_timeout)
    return async_engine, tokenizer


def _load(args: argparse.Namespace, *, warm_up: bool) -> tuple[Any, Tokenizer]:
    from engine import compilation
    from engine.config import CacheConfig, SchedulerConfig
    from engine.tokenizer import load_tokenizer
    from engine.weights import open_checkpoint, resolve_model
    from serving.cli import enable_compilation_cache

    enable_compilation_cache(args.compilation_cache_dir)
    start = time.perf_counter()
    checkpoint = open_checkpoint(resolve_model(args.model), dtype=args.dtype)
    tokenizer = load_tokenizer(checkpoint.files.path)
    opened = time.perf_counter()
    log.info("start-up: opened %s and its tokenizer in %.1f s", args.model, opened - start)
    max_model_len = args.max_model_len or min(checkpoint.cfg.max_position_embeddings, 4096)
    try:
        scheduler_config = SchedulerConfig(
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=max_model_len,
        )
        cache_config = CacheConfig(
            memory_bytes=args.kv_cache_memory,
            memory_fraction=args.gpu_memory_utilization,
            kv_cache_dtype=args.kv_cache_dtype,
        )
    except ValueError as e:
        raise XlaserveError(str(e)) from e
    engine = _build_engine(
        args,
        checkpoint,
        tokenizer,
        cache_config=cache_config,
        scheduler_config=scheduler_config,
        warm_up=warm_up,
    )
    log.info(
        "start-up: weights loaded and %d step buckets ready in %.1f s%s (%d XLA compilations so "
        "far; a warm compilation cache makes that 0); %.1f s in all",
        engine.runner.num_compiled if hasattr(engine, "runner") else 0,
        time.perf_counter() - opened,
        "" if warm_up else ", the others compile while idle",
        compilation.count(),
        time.perf_counter() - start,
    )
    return engine, tokenizer


def _build_engine(
    args: argparse.Namespace, checkpoint: Any, tokenizer: Tokenizer, **kwargs: Any
) -> Any:
    """An LLMEngine over the (pp, tp) mesh, or --data-parallel-size replicas of one."""

    from engine.llm_engine import LLMEngine
    from serving.cli import quantization_config
    from sharding.data_parallel import DataParallelEngine
    from sharding.mesh import make_mesh, replica_meshes
    from sharding.rules import ShardingPlan

    dp, tp, pp = args.data_parallel_size, args.tensor_parallel_size, args.pipeline_parallel_size
    if dp * tp * pp == 1 and jax.process_count() == 1:
        params = checkpoint.load_params(quantization=quantization_config(args), progress=True)
        return LLMEngine(checkpoint.cfg, params, tokenizer, **kwargs)
    devices = jax.devices()[: dp * tp * pp] if jax.process_count() == 1 else None
    meshes = replica_meshes(make_mesh(dp=dp, tp=tp, pp=pp, devices=devices))
    if dp > 1:
        if jax.process_count() > 1:
            raise XlaserveError("data parallelism across processes: run one server per replica")
        params = [checkpoint.load_params(ShardingPlan.create(m, checkpoint.cfg)) for m in meshes]
        return DataParallelEngine(checkpoint.cfg, params, tokenizer, meshes=meshes, **kwargs)
    plan = ShardingPlan.create(meshes[0], checkpoint.cfg)
    params = checkpoint.load_params(plan, quantization_config(args))
    engine = LLMEngine(checkpoint.cfg, params, tokenizer, mesh=meshes[0], **kwargs)
    return engine


def jax_process_count() -> int:
    return jax.process_count()


def _follow(args: argparse.Namespace) -> int:
    """A follower process: builds the same engine as the leader, then runs its steps."""
    multihost.start_heartbeat()
    engine, _ = _load(args, warm_up=True)
    log.info("process %d following process 0", args.process_id)
    multihost.follow(engine.runner)
    return 0


def _lead(async_engine: AsyncEngine) -> Any:
    """Process 0 of a multi-process engine: each step goes to the followers first."""
    leader = multihost.Leader()
    async_engine.engine.runner.before_step = leader.send
    leader.wait_for_followers()
    return leader


def _watch_followers(
    async_engine: AsyncEngine, loop: asyncio.AbstractEventLoop, on_dead: Any
) -> None:
    def dead(process_id: int) -> None:
        error = XlaserveError(f"process {process_id} of the engine stopped responding")
        log.error("%s; stopping", error)
        async_engine.fail(error)
        loop.call_soon_threadsafe(on_dead, error)

    multihost.monitor_followers(dead)


def _start_grpc(
    async_engine: AsyncEngine,
    tokenizer: Tokenizer,
    args: argparse.Namespace,
    name: str,
    admission: AdmissionLimit,
) -> Any:
    if importlib.util.find_spec("serving.grpc.server") is None:
        raise XlaserveError("--grpc-port given, but this build has no gRPC server")
    from serving.grpc.server import start_grpc_server

    handle = start_grpc_server(
        async_engine, tokenizer, args.grpc_port, name, host=args.host, admission=admission
    )
    log.info("gRPC on %s:%d", args.host, handle.port)
    return handle


class _Server(uvicorn.Server):
    """uvicorn's server, minus re-raising the caught signal after its shutdown (which would
    kill the process before the engine is stopped), plus a thread started on the first
    SIGTERM or Ctrl-C."""

    on_exit: threading.Thread | None = None

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
        signals = (signal.SIGINT, signal.SIGTERM)
        original = {sig: signal.signal(sig, self.handle_exit) for sig in signals}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)
