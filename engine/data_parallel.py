"""Data parallelism: several engine replicas in one process, each on its own slice of the mesh
with its own scheduler and KV cache, behind the one `Engine` protocol. A request goes to the
replica with the fewest unfinished requests and stays there; a step launches every busy
replica's step before waiting for any, so that they run at once.

Host code: the replicas' `LLMEngine`s own the device work.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from concurrent.futures import Future

from engine.errors import InvalidRequestError
from engine.llm_engine import LLMEngine
from engine.protocol import EngineStats, Health, ModelInfo
from engine.request import RequestOutput, SamplingParams
from engine.structured.spec import StructuredOutputs
from engine.tokenizer import Tokenizer


def _merged(
    counts: Iterable[tuple[tuple[str, int], ...]],
) -> tuple[tuple[str, int], ...]:
    """(name, count) pairs summed by name over the replicas."""
    total: Counter[str] = Counter()
    for pairs in counts:
        total.update(dict(pairs))
    return tuple(sorted(total.items()))


class DataParallelEngine:
    """Implements `engine.protocol.Engine` over `replicas` (built alike, warmed up)."""

    def __init__(self, replicas: Sequence[LLMEngine]):
        if not replicas:
            raise ValueError("a data-parallel engine needs at least one replica")
        self.replicas = list(replicas)
        self._owner: dict[str, LLMEngine] = {}

    @property
    def tokenizer(self) -> Tokenizer:
        return self.replicas[0].tokenizer

    def model_info(self) -> ModelInfo:
        return self.replicas[0].model_info()

    def add_request(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        lora_name: str | None = None,
    ) -> None:
        if request_id in self._owner:
            raise InvalidRequestError(f"duplicate request id {request_id!r}")
        replica = min(self.replicas, key=LLMEngine.num_unfinished_requests)
        replica.add_request(request_id, prompt, params, priority=priority, lora_name=lora_name)
        self._owner[request_id] = replica

    # LoRA over replicas is refused at build time (engine.builder): the replicas have none.
    def add_lora(self, name: str, path: str, *, restricted: bool = False) -> None:
        self.replicas[0].add_lora(name, path, restricted=restricted)

    def remove_lora(self, name: str) -> None:
        self.replicas[0].remove_lora(name)

    def list_loras(self) -> list[str]:
        return []

    def compile_grammar(self, spec: StructuredOutputs) -> Future[None]:
        return self.replicas[0].compile_grammar(spec)  # the replicas share one compiler

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

    def warm_up_step(self) -> bool:
        return any([r.warm_up_step() for r in self.replicas])

    def stats(self) -> EngineStats:
        """Counters summed over the replicas; KV usage averaged (each has the same cache)."""
        each = [r.stats() for r in self.replicas]
        first = each[0]
        return EngineStats(
            num_running=sum(s.num_running for s in each),
            num_waiting=sum(s.num_waiting for s in each),
            kv_cache_usage=sum(s.kv_cache_usage for s in each) / len(each),
            num_preemptions=sum(s.num_preemptions for s in each),
            prefix_cache_queries=sum(s.prefix_cache_queries for s in each),
            prefix_cache_hits=sum(s.prefix_cache_hits for s in each),
            num_prompt_tokens=sum(s.num_prompt_tokens for s in each),
            num_computed_prompt_tokens=sum(s.num_computed_prompt_tokens for s in each),
            num_generation_tokens=sum(s.num_generation_tokens for s in each),
            num_steps=sum(s.num_steps for s in each),
            num_compiled_steps=first.num_compiled_steps,  # every replica compiles the same
            num_step_variants=first.num_step_variants,
            # One process-wide count: since the last replica finished warming up.
            compilations_after_warm_up=min(s.compilations_after_warm_up for s in each),
            num_kv_pages=first.num_kv_pages,
            weight_bytes=first.weight_bytes,
            kv_cache_bytes=first.kv_cache_bytes,
            running_lora_adapters=_merged(s.running_lora_adapters for s in each),
            waiting_lora_adapters=_merged(s.waiting_lora_adapters for s in each),
            max_loras=first.max_loras,
            expert_tokens=tuple(
                tuple(map(sum, zip(*rows, strict=True)))
                for rows in zip(*(s.expert_tokens for s in each), strict=True)
            ),
            spec_decode_num_drafts=sum(s.spec_decode_num_drafts for s in each),
            spec_decode_num_draft_tokens=sum(s.spec_decode_num_draft_tokens for s in each),
            spec_decode_num_accepted_tokens=sum(s.spec_decode_num_accepted_tokens for s in each),
            spec_decode_num_accepted_tokens_per_pos=tuple(
                map(
                    sum,
                    zip(*(s.spec_decode_num_accepted_tokens_per_pos for s in each), strict=True),
                )
            ),
        )

    def health(self) -> Health:
        return next((h for r in self.replicas if not (h := r.health()).ok), Health())

    def close(self) -> None:
        for replica in self.replicas:
            replica.close()
