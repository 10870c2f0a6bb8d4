"""`build_engine(config)`: the one way to put an engine together, used by the offline `LLM`,
`xlaserve generate`, `xlaserve serve` (HTTP and gRPC) and the benchmarks.

It opens the checkpoint and its tokenizer, lays the devices out as the config's sharding layout
says, loads the parameters onto them, and returns an `Engine`: one `LLMEngine`, or data-parallel
replicas of it. In an engine over several processes (TPU pods, multi-GPU hosts), process 0 gets
the engine and every other process calls `run_follower`, which runs the steps process 0 sends.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable

import jax

from engine import compilation
from engine.config import EngineConfig
from engine.data_parallel import DataParallelEngine
from engine.errors import XlaserveError
from engine.llm_engine import LLMEngine
from engine.protocol import Engine
from engine.speculative.engine import SpeculativeEngine
from engine.structured.compiler import GrammarCompiler
from engine.tokenizer import Tokenizer, load_tokenizer
from engine.weights import Checkpoint, open_checkpoint, resolve_model
from sharding import multihost
from sharding.layout import ShardingLayout
from sharding.mesh import make_mesh, replica_meshes
from sharding.rules import ShardingPlan, check_layout

log = logging.getLogger(__name__)


def start_processes(config: EngineConfig) -> bool:
    """Joins the other processes of a multi-process engine (jax.distributed; found
    automatically on a multi-host Cloud TPU). True in the process that leads: the one that
    builds the engine and serves; the others call `run_follower`. Call before anything else
    touches JAX's devices."""
    parallel = config.parallel
    multihost.initialize(parallel.coordinator_address, parallel.num_processes, parallel.process_id)
    return multihost.is_leader()


def build_engine(config: EngineConfig) -> Engine:
    """Builds (and, unless `config.compilation.warm_up` says otherwise, compiles) the engine
    `config` describes. Raises XlaserveError, with one line naming the problem, for a model or
    configuration that cannot be served."""
    engine = _build(config)
    if jax.process_count() > 1:
        assert isinstance(engine, LLMEngine)  # no data parallelism across processes
        _lead(engine)
    return engine


def run_follower(config: EngineConfig) -> None:
    """A follower process: builds the same engine as the leader, then runs every step the
    leader sends until it stops."""
    multihost.start_heartbeat()
    engine = _build(config)
    assert isinstance(engine, LLMEngine)
    log.info("process %d following process 0", jax.process_index())
    multihost.follow(engine.runner)


def _build(config: EngineConfig) -> LLMEngine | DataParallelEngine:
    compilation.install()
    compilation.enable_persistent_cache(config.compilation.cache_dir)
    start = time.perf_counter()
    checkpoint = open_checkpoint(resolve_model(config.model), dtype=config.dtype)
    tokenizer = load_tokenizer(checkpoint.files.path)
    log.info("start-up: opened %s and its tokenizer in %.1f s", config.model, _since(start))
    engine = _engines(config, checkpoint, tokenizer)
    stats = engine.stats()
    log.info(
        "start-up: engine ready in %.1f s, %d of %d step variants compiled (%d XLA compilations "
        "so far; a warm compilation cache makes that 0)",
        _since(start),
        stats.num_compiled_steps,
        stats.num_step_variants,
        compilation.count(),
    )
    return engine


def _engines(
    config: EngineConfig, checkpoint: Checkpoint, tokenizer: Tokenizer
) -> LLMEngine | DataParallelEngine:
    layout = config.parallel.layout
    multi = jax.process_count() > 1
    # Replicas and followers must hold every step before the first one runs.
    warm_up = config.compilation.warm_up == "eager" or multi or layout.num_replicas > 1
    if config.speculative is not None and multi:
        raise XlaserveError(
            "speculative decoding over several processes is not supported yet (the followers "
            "replay the plain step only)"
        )
    grammars = GrammarCompiler(tokenizer, checkpoint.cfg.vocab_size, config.structured)
    grammars.prepare()
    engine = functools.partial(
        _engine_class(config),
        checkpoint.cfg,
        tokenizer=tokenizer,
        grammars=grammars,
        cache_config=config.cache,
        scheduler_config=config.scheduler,
        attention_impl=config.compilation.attention_impl,
        warm_up=warm_up,
        lora_config=config.lora,
        count_expert_tokens=config.observability.expert_token_counts,
        expert_dispatch=config.parallel.expert_dispatch,
    )
    if config.lora is not None and (multi or layout.num_replicas > 1):
        raise XlaserveError("LoRA adapters over several processes or replicas are not supported")
    if layout.num_devices == 1 and not multi:
        single = engine(checkpoint.load_params(quantization=config.quantization, progress=True))
        single.on_close(grammars.close)  # the compiler is the builder's: it closes it
        return single
    check_layout(layout, checkpoint.cfg)  # before any weight is read
    meshes = replica_meshes(make_mesh(layout, _devices(layout)), layout)
    if len(meshes) > 1 and multi:
        raise XlaserveError("data parallelism across processes: run one server per replica")
    replicas = []
    for mesh in meshes:
        plan = ShardingPlan.create(
            mesh, checkpoint.cfg, layout, expert_dispatch=config.parallel.expert_dispatch
        )
        params = checkpoint.load_params(plan, config.quantization)
        replicas.append(engine(params, mesh=mesh, layout=layout))
    replicas[0].on_close(grammars.close)  # shared by the replicas; DataParallelEngine closes all
    return replicas[0] if len(replicas) == 1 else DataParallelEngine(replicas)


def _engine_class(config: EngineConfig) -> Callable[..., LLMEngine]:
    """LLMEngine, or with speculative decoding a SpeculativeEngine given its config and, for
    method draft_model, the draft model's config and weights (read now)."""
    spec = config.speculative
    if spec is None:
        return LLMEngine
    if spec.model is None:
        return functools.partial(SpeculativeEngine, speculative=spec)
    draft = open_checkpoint(resolve_model(spec.model), dtype=config.dtype)
    if config.parallel.layout.num_devices > 1:  # it is sharded as the target is
        try:
            check_layout(config.parallel.layout, draft.cfg)
        except XlaserveError as e:
            raise XlaserveError(f"the draft model {spec.model!r}: {e}") from e
    return functools.partial(
        SpeculativeEngine, speculative=spec, draft=(draft.cfg, draft.load_params())
    )


def _devices(layout: ShardingLayout) -> list[jax.Device] | None:
    """The devices a layout's mesh spans. A named layout (the parallel-size flags) takes the
    first devices it needs, as vLLM's sizes do; any other layout describes the whole mesh, so
    its axis sizes must multiply to the number of devices (None: all of them, every process's)."""
    if jax.process_count() > 1 or layout != _named_twin(layout):
        return None
    return jax.devices()[: layout.num_devices]


def _named_twin(layout: ShardingLayout) -> ShardingLayout | None:
    if layout.axis_names != ("dp", "pp", "tp"):
        return None
    dp, pp, tp = layout.shape
    return ShardingLayout.named(dp=dp, pp=pp, tp=tp)


def _lead(engine: LLMEngine) -> None:
    """Process 0 of a multi-process engine: each step goes to the followers first, and a
    follower that stops responding fails the engine for good."""
    leader = multihost.Leader()
    engine.runner.before_step = leader.send
    leader.wait_for_followers()
    engine.on_close(leader.stop)

    def dead(process_id: int) -> None:
        reason = f"process {process_id} of the engine stopped responding"
        log.error("%s; the engine cannot go on", reason)
        engine.fail(reason, fatal=True)

    multihost.monitor_followers(dead)


def _since(start: float) -> float:
    return time.perf_counter() - start
