"""The `Engine` protocol: everything a server (HTTP, gRPC) or an offline driver may ask of an
engine. `engine.builder.build_engine(config)` returns one; a single engine (`LLMEngine`) and
data-parallel replicas (`DataParallelEngine`) both implement it, and nothing outside `engine/`
reaches past it.

Threading: `add_request`, `abort_request`, `step` and `warm_up_step` are called from one thread
(the engine loop's). `stats`, `health` and `model_info` may be called from any thread: they read
plain numbers; so may `compile_grammar`, which hands the work to the engine's compiler threads.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Protocol

from engine.request import RequestOutput, SamplingParams
from engine.structured.spec import StructuredOutputs
from engine.tokenizer import Tokenizer


@dataclass(frozen=True)
class ModelInfo:
    """What clients may know about the served model and the engine's limits."""

    architecture: str
    vocab_size: int
    max_model_len: int  # prompt + output tokens of one sequence
    max_num_seqs: int  # sequences per step
    max_num_batched_tokens: int  # tokens per step


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine's gauges and counters (counters only grow)."""

    num_running: int = 0  # sequences in the running batch
    num_waiting: int = 0  # sequences waiting to be scheduled (new or preempted)
    kv_cache_usage: float = 0.0  # fraction of KV pages in use, 0 to 1
    num_preemptions: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # prompt tokens found there
    num_prompt_tokens: int = 0  # prompt tokens received
    num_computed_prompt_tokens: int = 0  # prompt tokens run (not taken from the prefix cache)
    num_generation_tokens: int = 0
    num_steps: int = 0
    num_compiled_steps: int = 0  # compiled parts of the step (engine/compiled_step.py)
    num_step_variants: int = 0  # parts a full warm-up compiles
    compilations_after_warm_up: int = 0  # XLA compilations in the process since warm-up ended
    num_kv_pages: int = 0  # pages of the KV cache (of each replica)
    weight_bytes: int = 0  # the parameters' bytes (of one replica, all shards)
    kv_cache_bytes: int = 0  # the KV cache's bytes (of one replica, all shards)
    # Speculative decoding (vLLM's names): proposals verified, tokens proposed, tokens
    # accepted, and accepted tokens by position in the proposal (empty: speculation is off).
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: tuple[int, ...] = ()
    # A mixture of experts' tokens routed to each expert, [layer][expert], since start-up (a
    # token counts for each of its k experts); empty unless counted (--expert-token-counts).
    expert_tokens: tuple[tuple[int, ...], ...] = ()
    # LoRA (vLLM's lora_requests_info): (adapter, sequences) of the running and the waiting
    # sequences that use an adapter, by name; and the adapters' device slots (0: LoRA is off).
    running_lora_adapters: tuple[tuple[str, int], ...] = ()
    waiting_lora_adapters: tuple[tuple[str, int], ...] = ()
    max_loras: int = 0


@dataclass(frozen=True)
class Health:
    """`ok` False: the engine cannot serve, for `reason`. `fatal`: it never will again (a
    process of a multi-process engine died); the server should stop."""

    ok: bool = True
    reason: str = ""
    fatal: bool = False


class Engine(Protocol):
    """An inference engine driven one step at a time."""

    @property
    def tokenizer(self) -> Tokenizer: ...

    def model_info(self) -> ModelInfo: ...

    def add_request(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        lora_name: str | None = None,
    ) -> None:
        """Queues a request (lower `priority` values are served first), run with the LoRA
        adapter registered as `lora_name` if given; raises InvalidRequestError, naming the
        problem, for one that can never be served."""
        ...

    def add_lora(self, name: str, path: str, *, restricted: bool = False) -> None:
        """Registers the PEFT adapter in directory `path` as `name`, read and checked now;
        `restricted`: only from the directories allowed at start-up. InvalidRequestError
        (engine.lora.LoRAError) names what is wrong."""
        ...

    def remove_lora(self, name: str) -> None:
        """Unregisters an adapter; InvalidRequestError if unknown or still in use."""
        ...

    def list_loras(self) -> list[str]:
        """The registered adapters' names (any thread may ask)."""
        ...

    def abort_request(self, request_id: str) -> None:
        """Drops a request (unknown ids are ignored); its pages are freed."""
        ...

    def compile_grammar(self, spec: StructuredOutputs) -> Future[None]:
        """Compiles a structured-output grammar on the engine's compiler threads (or finds it
        compiled), so that `add_request` with it need not wait. The future fails with
        InvalidRequestError naming the problem, or the compile timeout."""
        ...

    def has_unfinished_requests(self) -> bool: ...

    def step(self) -> list[RequestOutput]:
        """Runs one step; returns a delta (engine.request.RequestOutput: only what this step
        added) for each request that made progress."""
        ...

    def warm_up_step(self) -> bool:
        """Compiles one step bucket not compiled yet; False when every bucket is. A server
        calls it while idle, so that it can answer before the whole warm-up is done."""
        ...

    def stats(self) -> EngineStats: ...

    def health(self) -> Health: ...

    def close(self) -> None:
        """Releases what the engine holds outside this process (multi-process followers)."""
        ...
