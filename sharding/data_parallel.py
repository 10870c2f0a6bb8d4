"""Data parallelism: several engine replicas in one process group, each on its own (pp, tp)
slice of the mesh with its own scheduler and KV cache, behind one engine interface (what
`serving` drives). A request goes to the replica with the fewest unfinished requests and stays
there; a step launches every busy replica's step before waiting for any, so they run at once.

Host code: the replicas' `LLMEngine`s own the device work.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

from jax.sharding import Mesh

from engine.config import ModelConfig
from engine.errors import InvalidRequestError
from engine.llm_engine import EngineStats, LLMEngine
from engine.models.layers import Params
from engine.request import RequestOutput, SamplingParams
from engine.tokenizer import Tokenizer


class DataParallelEngine:
    def __init__(
        self,
        cfg: ModelConfig,
        params: Params | Sequence[Params],
        tokenizer: Tokenizer,
        *,
        meshes: Sequence[Mesh],
        **engine_kwargs: Any,
    ):
        """One replica per mesh of `sharding.mesh.replica_meshes`, with `params` (placed on
        each replica's mesh) or the replica's own entry of a list; `engine_kwargs` as for
        `LLMEngine` (each replica gets the whole cache and scheduler configuration)."""
        per_replica = [params] * len(meshes) if isinstance(params, dict) else list(params)
        self.replicas = [
            LLMEngine(cfg, p, tokenizer, mesh=mesh, **engine_kwargs)
            for p, mesh in zip(per_replica, meshes, strict=True)
        ]
        first = self.replicas[0]
        self.cfg, self.tokenizer, self.scheduler_config = cfg, tokenizer, first.scheduler_config
        self.runner = first.runner  # for the compile count: every replica compiles the same
        self._owner: dict[str, LLMEngine] = {}

    def add_request(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams,
        *,
        priority: int = 0,
    ) -> None:
        if request_id in self._owner:
            raise InvalidRequestError(f"duplicate request id {request_id!r}")
        replica = min(self.replicas, key=LLMEngine.num_unfinished_requests)
        replica.add_request(request_id, prompt, params, priority=priority)
        self._owner[request_id] = replica

    def abort_request(self, request_id: str) -> None:
        replica = self._owner.pop(request_id, None)
        if replica is not None:
            replica.abort_request(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self._owner)

    def step(self) -> list[RequestOutput]:
        launched = [(r, r.launch_step()) for r in self.replicas if r.has_unfinished_requests()]
        outputs = []
        for replica, step in launched:
            if step is not None:
                outputs += replica.finish_step(step)
        for output in outputs:
            if output.finished:
                del self._owner[output.request_id]
        return outputs

    # ---- what the metrics read, summed over the replicas --------------------------------------

    @property
    def scheduler(self) -> _SchedulerTotals:
        schedulers = [r.scheduler for r in self.replicas]
        return _SchedulerTotals(
            num_running=sum(s.num_running for s in schedulers),
            num_waiting=sum(s.num_waiting for s in schedulers),
            num_preemptions=sum(s.num_preemptions for s in schedulers),
        )

    @property
    def kv_cache(self) -> _CacheTotals:
        caches = [r.kv_cache for r in self.replicas]
        return _CacheTotals(
            usage=sum(c.usage for c in caches) / len(caches),
            prefix_cache_queries=sum(c.prefix_cache_queries for c in caches),
            prefix_cache_hits=sum(c.prefix_cache_hits for c in caches),
        )

    @property
    def stats(self) -> EngineStats:
        return EngineStats(
            **{
                f.name: sum(getattr(r.stats, f.name) for r in self.replicas)
                for f in fields(EngineStats)
            }
        )


@dataclass(frozen=True)
class _SchedulerTotals:
    num_running: int
    num_waiting: int
    num_preemptions: int


@dataclass(frozen=True)
class _CacheTotals:
    usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
