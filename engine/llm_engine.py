"""The engine loop: `LLMEngine.step()` is schedule -> run the compiled step -> record tokens ->
stop checks -> deltas (each request's output holds only what the step added: see
engine/request.py). Built by `engine.builder.build_engine`; the offline API is `engine.llm.LLM`.

Asynchronous scheduling (SchedulerConfig.async_scheduling, vLLM's async scheduling and SGLang's
overlap scheduler): step n+1 is scheduled, built and dispatched before the host reads step n's
tokens. Those stay on the device and feed step n+1 there (`engine.step.TokenCarry`); the
scheduler counts them as pending (`Request.num_pending_tokens`), and the host reads them while
step n+1 runs. A sequence that step n's token stopped (or that was aborted meanwhile) has its
token of step n+1 discarded: its pages are already free and nothing of it is handed out. A step
whose tokens the next one needs on the host (a request with a grammar, whose next bitmask
depends on them, or with penalties, which count them) is finished at once: a synchronous step.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh
from tqdm import tqdm

from engine.config import (
    CacheConfig,
    LoRAConfig,
    ModelConfig,
    SchedulerConfig,
    StructuredOutputConfig,
)
from engine.detokenizer import Detokenizers
from engine.errors import InvalidRequestError, XlaserveError
from engine.kv_cache import KVCacheManager, describe_kv_cache
from engine.lora import LoRAError, LoRARegistry
from engine.model_runner import ModelRunner
from engine.models.layers import Params
from engine.output_processor import HELD, SequenceOutput, StopDecision
from engine.protocol import Engine, EngineStats, Health, ModelInfo
from engine.request import (
    CompletionOutput,
    FinishReason,
    OutputAccumulator,
    Request,
    RequestOutput,
    RequestStatus,
    SamplingParams,
    Usage,
    validate_prompt,
    validate_token_ids,
)
from engine.sampling import SamplerOutput
from engine.scheduler import Scheduler, SchedulerOutput
from engine.step import StepOutput
from engine.structured.compiler import GrammarCompiler
from engine.structured.matchers import GrammarMatchers, GrammarState
from engine.structured.spec import StructuredOutputs
from engine.tokenizer import Tokenizer
from sharding.layout import ShardingLayout

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Parent:
    """A user's request: n sequences that share its prompt.

    Only the first sequence is scheduled at once; the others join when its prefill is done, so
    they find the prompt's pages in the prefix cache instead of computing them again.
    """

    request_id: str
    prompt_token_ids: list[int]
    children: list[Request]
    outputs: list[SequenceOutput]
    pending: list[Request] = field(default_factory=list)
    finished: set[int] = field(default_factory=set)
    announced: bool = False  # its first output (with the prompt) has been handed out
    # One sequence with neither stop strings, logprobs nor a grammar: most steps of it take
    # `_postprocess`'s fast path (`SequenceOutput.fast_delta`).
    plain: bool = False


@dataclass(frozen=True)
class _Launched:
    """A step started on the device; `before`: one started earlier, to be finished first."""

    out: SchedulerOutput
    completed: list[Request]
    pending: StepOutput
    needs_host_tokens: bool = False  # the next step needs this one's tokens on the host
    before: _Launched | None = None


@dataclass
class _Counters:
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_computed_prompt_tokens: int = 0  # prompt tokens actually run (not from the prefix cache)
    num_steps: int = 0


class LLMEngine:
    """One engine over one device or one mesh: scheduler, KV cache allocator and model runner.
    Implements `engine.protocol.Engine`; build it with `engine.builder.build_engine`."""

    def __init__(
        self,
        cfg: ModelConfig,
        params: Params,
        tokenizer: Tokenizer,
        *,
        cache_config: CacheConfig | None = None,
        scheduler_config: SchedulerConfig | None = None,
        attention_impl: str | None = None,
        warm_up: bool = True,
        mesh: Mesh | None = None,
        layout: ShardingLayout | None = None,
        lora_config: LoRAConfig | None = None,
        grammars: GrammarCompiler | None = None,
        count_expert_tokens: bool = False,
        expert_dispatch: str = "allgather",
    ):
        """`mesh`: a device mesh to shard the model over as `layout` says (`sharding.mesh`).
        `lora_config`: serve LoRA adapters (engine/lora.py) next to the base model.
        `grammars`: the structured-output compiler (data-parallel replicas share one); None:
        one of this engine's own, with the default StructuredOutputConfig.
        `count_expert_tokens`: count a mixture of experts' tokens per layer and expert
        (EngineStats.expert_tokens). `expert_dispatch`: how a mixture of experts' tokens reach
        the devices of the expert axis (`engine.config.EXPERT_DISPATCHES`)."""
        if lora_config is not None and cfg.architecture != "llama":
            raise XlaserveError(f"LoRA adapters are not supported for {cfg.architecture} models")
        if lora_config is not None and cfg.num_experts:
            raise XlaserveError("LoRA adapters are not supported for mixture-of-experts models")
        self.cfg = cfg
        self._tokenizer = tokenizer
        self.scheduler_config = (scheduler_config or SchedulerConfig()).resolve(
            cfg.max_position_embeddings
        )
        cache_config = cache_config or CacheConfig()
        self.runner = ModelRunner(
            cfg,
            params,
            cache_config,
            self.scheduler_config,
            attention_impl=attention_impl,
            eos_token_ids=tokenizer.eos_token_ids,
            mesh=mesh,
            layout=layout,
            lora_config=lora_config,
            count_expert_tokens=count_expert_tokens,
            expert_dispatch=expert_dispatch,
        )
        self.kv_cache = KVCacheManager(
            self.runner.num_pages,
            cache_config.page_size,
            enable_prefix_caching=cache_config.enable_prefix_caching,
            sliding_window=cfg.uniform_sliding_window,
        )
        log.info(
            describe_kv_cache(
                self.runner.num_pages,
                cache_config.page_size,
                self.runner.page_bytes,
                self.scheduler_config.model_len,
            )
        )
        self.scheduler = Scheduler(self.scheduler_config, self.kv_cache)
        self.loras: LoRARegistry | None = None
        self._max_loras = 0 if lora_config is None else lora_config.max_loras
        if lora_config is not None and self.runner.lora is not None:
            self.loras = LoRARegistry(lora_config, cfg, self.runner.lora.dtype)
            for name, path in lora_config.modules:
                self.loras.add(name, path)
            self.scheduler.adapter_ready = self._adapter_ready
        grammars = grammars or GrammarCompiler(tokenizer, cfg.vocab_size, StructuredOutputConfig())
        self.grammars = GrammarMatchers(grammars)
        self._detokenizers = Detokenizers(tokenizer)
        self._parents: dict[str, _Parent] = {}
        self._child_parent: dict[str, tuple[_Parent, int]] = {}
        self.counters = _Counters()
        # Tokens per layer and expert since start-up; replaced, not updated in place, so that
        # `stats` may read it from another thread.
        self._expert_tokens = np.zeros((cfg.num_layers, cfg.num_experts), np.int64)
        self._weight_bytes = _nbytes(self.runner.params)
        self._kv_cache_bytes = _nbytes(self.runner.kv_caches)
        self._failure: Health | None = None
        self._on_close: list[Callable[[], None]] = []
        # Asynchronous scheduling (a switch tests flip between steps): the step in flight.
        self.async_scheduling = self.scheduler_config.async_scheduling
        # SchedulerConfig.stream_interval, for the requests added from now on (a switch too).
        self.stream_interval = self.scheduler_config.stream_interval
        self._in_flight: _Launched | None = None
        if warm_up:
            seconds = self.runner.warm_up()
            log.info("compiled %d step variants in %.1f s", self.runner.num_compiled, seconds)

    # ---- what a server may ask (engine.protocol.Engine) ------------------------------------------

    @property
    def tokenizer(self) -> Tokenizer:
        return self._tokenizer

    def model_info(self) -> ModelInfo:
        config = self.scheduler_config
        return ModelInfo(
            architecture=self.cfg.architecture,
            vocab_size=self.cfg.vocab_size,
            max_model_len=config.model_len,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
        )

    def stats(self) -> EngineStats:
        counters = self.counters
        return EngineStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            kv_cache_usage=self.kv_cache.usage,
            num_preemptions=self.scheduler.num_preemptions,
            prefix_cache_queries=self.kv_cache.prefix_cache_queries,
            prefix_cache_hits=self.kv_cache.prefix_cache_hits,
            num_prompt_tokens=counters.num_prompt_tokens,
            num_computed_prompt_tokens=counters.num_computed_prompt_tokens,
            num_generation_tokens=counters.num_generation_tokens,
            num_steps=counters.num_steps,
            num_compiled_steps=self.runner.num_compiled,
            num_step_variants=len(self.runner.compiled.variants()),
            compilations_after_warm_up=self.runner.compilations_after_warm_up,
            num_kv_pages=self.runner.num_pages,
            weight_bytes=self._weight_bytes,
            kv_cache_bytes=self._kv_cache_bytes,
            expert_tokens=_table(self._expert_tokens) if self.runner.count_expert_tokens else (),
            running_lora_adapters=_adapter_counts(list(self.scheduler.running)),
            waiting_lora_adapters=_adapter_counts(self.scheduler.waiting),
            max_loras=self._max_loras,
        )

    def health(self) -> Health:
        return self._failure or Health()

    def fail(self, reason: str, *, fatal: bool = False) -> None:
        """Marks the engine unable to serve (called from any thread, e.g. a monitor that saw a
        process of the engine die)."""
        self._failure = Health(ok=False, reason=reason, fatal=fatal)

    def warm_up_step(self) -> bool:
        return self.runner.warm_up_one()

    def compile_grammar(self, spec: StructuredOutputs) -> Future[None]:
        return self.grammars.compiler.compile(spec)

    def on_close(self, callback: Callable[[], None]) -> None:
        self._on_close.append(callback)

    def close(self) -> None:
        """Runs the `on_close` callbacks (the builder's: its grammar compiler, multi-process
        followers). A compiler this engine made itself has idle worker threads only; they end
        with the process."""
        while self._on_close:
            self._on_close.pop()()

    # ---- requests --------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        lora_name: str | None = None,
    ) -> None:
        """Queues a request, run with the registered LoRA adapter `lora_name` if given; raises
        InvalidRequestError (with the numbers) if it can't be served."""
        if request_id in self._parents:
            raise InvalidRequestError(f"duplicate request id {request_id!r}")
        if lora_name is not None:
            self._lora_registry().path(lora_name)  # raises for an unknown adapter
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        validate_prompt(ids, self.cfg.vocab_size)
        validate_token_ids(params, self.cfg.vocab_size)
        children = [self._child(request_id, i, ids, params, priority) for i in range(params.n)]
        for child in children:
            child.lora_name = lora_name
        self._add_grammars(children, params.structured_outputs)
        try:
            self.scheduler.add_request(children[0])  # raises if the request can never fit
        except BaseException:
            for child in children:
                self.grammars.remove(child.request_id)
            raise
        outputs = [
            SequenceOutput(
                self.tokenizer,
                params,
                self.scheduler_config.model_len,
                self._detokenizers,
                self.stream_interval,
            )
            for _ in children
        ]
        parent = _Parent(
            request_id, ids, children, outputs, pending=children[1:], plain=_is_plain(params)
        )
        self._parents[request_id] = parent
        for i, child in enumerate(children):
            self._child_parent[child.request_id] = (parent, i)
        self.counters.num_prompt_tokens += len(ids)

    def _add_grammars(self, children: list[Request], spec: StructuredOutputs | None) -> None:
        """A matcher for each sequence of a constrained request (raises InvalidRequestError
        for a grammar that does not compile; a server compiled it already, off this thread)."""
        if spec is None:
            return
        for child in children:
            self.grammars.add(child.request_id, spec)

    def _child(
        self, request_id: str, index: int, ids: list[int], params: SamplingParams, priority: int
    ) -> Request:
        # Child i of a seeded request uses seed + i, so n samples differ but are reproducible;
        # any integer seed is taken modulo 2**32, the width of the device's seed array.
        user_seed = params.seed
        seed = random.getrandbits(32) if user_seed is None else (user_seed + index) % 2**32
        child_id = request_id if params.n == 1 else f"{request_id}#{index}"
        return Request(child_id, list(ids), params, seed=seed, priority=priority)

    # ---- LoRA adapters -------------------------------------------------------------------------

    def _lora_registry(self) -> LoRARegistry:
        if self.loras is None:
            raise InvalidRequestError("LoRA is not enabled (--enable-lora)", param="model")
        return self.loras

    def add_lora(self, name: str, path: str, *, restricted: bool = False) -> None:
        """Registers the PEFT adapter in directory `path` as `name`, read and checked now;
        `restricted`: its files must lie in the configured allowed directories. LoRAError
        (an InvalidRequestError) names what is wrong."""
        self._lora_registry().add(name, path, restricted=restricted)

    def remove_lora(self, name: str) -> None:
        """Unregisters an adapter; refused (LoRAError) while running requests use it."""
        registry = self._lora_registry()
        busy = {r.lora_slot for r in self.scheduler.running}
        if any(c.lora_name == name for p in self._parents.values() for c in p.children):
            raise LoRAError(f"the LoRA adapter {name!r} is in use by unfinished requests")
        registry.remove(name, busy)

    def list_loras(self) -> list[str]:
        return [] if self.loras is None else self.loras.names()

    def _adapter_ready(self, request: Request) -> bool:
        """Puts the request's adapter in a device slot if it is not in one (the scheduler asks
        before admitting it); False: every slot is held by running requests, so it waits."""
        if request.lora_name is None or self.loras is None:
            return True
        busy = {r.lora_slot for r in self.scheduler.running}
        assert self.runner.lora is not None
        acquired = self.loras.acquire(request.lora_name, busy, self.runner.lora.load)
        if acquired is None:
            return False
        request.lora_slot, request.cache_salt = acquired
        return True

    def abort_request(self, request_id: str) -> None:
        parent = self._parents.pop(request_id, None)
        if parent is None:
            return
        for child in parent.children:
            self.scheduler.abort(child.request_id)
            self._child_parent.pop(child.request_id, None)
            self.grammars.remove(child.request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self._parents)

    def num_unfinished_requests(self) -> int:
        return len(self._parents)

    # ---- the loop ----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One engine iteration; returns, for each request that made progress, what it gained
        (a delta: engine/request.py)."""
        launched = self.launch_step()
        return self.finish_step(launched) if launched is not None else []

    def launch_step(self) -> _Launched | None:
        """Schedules and starts one step on the device; returns the step(s) `finish_step` must
        finish now (None: none). Synchronously, that is this step. Asynchronously, it is the
        step before (it ran while this one was scheduled and built) and this one stays in
        flight, unless the step after it needs its tokens on the host: then both are finished
        now. Data-parallel replicas launch all their steps, then finish them."""
        previous, self._in_flight = self._in_flight, None
        launched = self._launch()
        if launched is None:
            return previous
        if self.async_scheduling and not launched.needs_host_tokens:
            self._in_flight = launched
            return previous
        return dataclasses.replace(launched, before=previous)

    def _launch(self) -> _Launched | None:
        """Schedules and dispatches one step (None: nothing to run); its sampled tokens count
        as pending until it is finished."""
        out = self.scheduler.schedule()
        return self._dispatch(out) if out.scheduled else None

    def _dispatch(self, out: SchedulerOutput) -> _Launched:
        """Dispatches the scheduled step; its sampled tokens count as pending until it is
        finished."""
        # Most steps have no request with penalties, logprobs or a grammar: one pass finds that.
        special = [p for s in out.scheduled if not (p := s.request.sampling_params).plain_step]
        options = self.runner.options(
            penalties=any(p.uses_penalties for p in special),
            logprobs=any(p.logprobs is not None for p in special),
            prompt_logprobs=any(p.prompt_logprobs is not None for p in special),
        )
        pending = self.runner.dispatch(out, self.kv_cache, options, self.grammars.filler(out))
        # While the device computes: bookkeeping that needs the schedule but not the tokens
        # (computed counts, prefix-cache hashes of the pages this step fills).
        completed = self.scheduler.update_after_step(out)
        for request in completed:
            request.num_pending_tokens += 1
        needs_host = bool(special) and any(_needs_host_tokens(r) for r in completed)
        return _Launched(out, completed, pending, needs_host)

    def finish_step(self, launched: _Launched) -> list[RequestOutput]:
        """Waits for a launched step (and the one `before` it) and hands out what it added."""
        earlier = [] if launched.before is None else self.finish_step(launched.before)
        out, completed = launched.out, launched.completed
        result = self.runner.fetch(launched.pending)
        if result.prompt is not None:
            _record_prompt_logprobs(out, result.prompt)
        self.counters.num_steps += 1
        if result.expert_counts is not None:
            self._expert_tokens = self._expert_tokens + result.expert_counts
        self.counters.num_computed_prompt_tokens += out.num_prompt_tokens
        return earlier + self._postprocess(out, completed, result)

    def _postprocess(
        self, out: SchedulerOutput, completed: list[Request], result: StepOutput
    ) -> list[RequestOutput]:
        """Records each completed request's sampled token; returns the requests' deltas, in the
        order they first progressed (a choice's delta waits while it is not `due`:
        SchedulerConfig.stream_interval). A plain sequence's token that neither stops it nor
        reaches its length (most tokens) takes a fast path: one call appends, detokenizes and
        makes its delta, as `_record_token` then `_request_output` would."""
        tokens = result.token_ids.tolist()  # one conversion, not a NumPy scalar per sequence
        rows: Sequence[int]
        if len(completed) == len(out.scheduled):  # every row counts (decodes): completed[i]'s
            rows = range(len(completed))
        else:
            row = {s.request.request_id: i for i, s in enumerate(out.scheduled)}
            rows = [row[r.request_id] for r in completed]
        progressed: dict[str, list[int]] = {}  # request id -> its choices that progressed
        deltas: list[RequestOutput | _Parent] = []  # a parent: its delta, made once all progressed
        now = time.monotonic()
        child_parent, finished = self._child_parent, RequestStatus.FINISHED
        num_fast = 0
        for request, i in zip(completed, rows, strict=True):
            request.num_pending_tokens -= 1
            if request.status is finished:  # stopped by its last token, or aborted: void
                continue
            token = tokens[i]
            parent = child_parent[request.request_id][0]
            if parent.plain:
                delta = parent.outputs[0].fast_delta(request, token)
                if delta is not None:  # recorded; None: it may stop here (the general path)
                    request.first_token_time = request.first_token_time or now
                    if delta is not HELD:
                        deltas.append(_fast_output(parent, request, delta))
                    num_fast += 1
                    continue
            k = request.sampling_params.logprobs
            entry = None if k is None else _logprob_entry(result, i, k)
            parent, index, done = self._record_token(request, token, entry, now)
            if not (done or parent.outputs[index].due(request)):
                continue
            indices = progressed.get(parent.request_id)
            if indices is None:
                progressed[parent.request_id] = [index]
                deltas.append(parent)
            else:
                indices.append(index)
        self.counters.num_generation_tokens += num_fast
        return [
            d if isinstance(d, RequestOutput) else self._request_output(d, progressed[d.request_id])
            for d in deltas
        ]

    def _record_token(
        self, request: Request, token: int, logprobs: dict[int, float] | None, now: float
    ) -> tuple[_Parent, int, bool]:
        """Appends a sampled token (and its logprobs entry) to the request: siblings join once
        the prompt is cached, stop checks, the grammar advances. Returns the request's parent,
        its index there, and whether the token finished it."""
        request.output_token_ids.append(token)
        request.first_token_time = request.first_token_time or now
        if logprobs is not None:
            request.logprobs.append(logprobs)
        parent, index = self._child_parent[request.request_id]
        if parent.pending and index == 0:  # the prompt's pages are cached: siblings join
            for sibling in parent.pending:
                self.scheduler.add_request(sibling)
            parent.pending.clear()
        decision = parent.outputs[index].append(request, token)
        if request.sampling_params.structured_outputs is not None:  # it has a grammar
            grammar = self.grammars.advance(request.request_id, token)
            if decision is None and grammar in (GrammarState.DONE, GrammarState.ERROR):
                decision = parent.outputs[index].grammar_done()
        if decision is not None:
            self._finish(parent, index, decision)
        self.counters.num_generation_tokens += 1
        return parent, index, decision is not None

    def _finish(self, parent: _Parent, index: int, decision: StopDecision) -> None:
        child = parent.children[index]
        child.stop_reason = decision.stop_reason
        self.scheduler.finish(child, decision.reason)
        self.grammars.remove(child.request_id)
        parent.finished.add(index)

    def _request_output(self, parent: _Parent, indices: list[int]) -> RequestOutput:
        """The delta of `parent`'s choices `indices` (those that gained a token this step)."""
        finished = len(parent.finished) == len(parent.children)
        outputs = [parent.outputs[i].take_delta(parent.children[i], i) for i in sorted(indices)]
        first = parent.children[0]
        announce, parent.announced = not parent.announced, True
        wants_prompt_logprobs = first.sampling_params.prompt_logprobs is not None
        if finished:
            del self._parents[parent.request_id]
            for child in parent.children:
                self._child_parent.pop(child.request_id, None)
        return RequestOutput(
            parent.request_id,
            outputs,
            finished,
            prompt_token_ids=parent.prompt_token_ids if announce else None,
            prompt_logprobs=list(first.prompt_logprobs)
            if announce and wants_prompt_logprobs
            else None,
            usage=_usage(parent) if finished else None,
            arrival_time=first.arrival_time,
            scheduled_time=first.scheduled_time,
        )


def _is_plain(params: SamplingParams) -> bool:
    """Whether a request's outputs may take `_postprocess`'s fast path: one sequence, and
    nothing but its tokens and text to hand out (no stop string holds text back)."""
    return (
        params.n == 1
        and not params.stop
        and params.logprobs is None
        and params.prompt_logprobs is None
        and params.structured_outputs is None
    )


def _fast_output(parent: _Parent, request: Request, delta: CompletionOutput) -> RequestOutput:
    """A plain request's delta for a token that did not finish it (`_request_output`'s, made
    without its general cases)."""
    announce, parent.announced = not parent.announced, True
    return RequestOutput(
        parent.request_id,
        [delta],
        False,
        parent.prompt_token_ids if announce else None,
        None,
        None,
        request.arrival_time,
        request.scheduled_time,
    )


def _needs_host_tokens(request: Request) -> bool:
    """Whether the request's next step needs its last token on the host: its grammar's next
    bitmask, or its penalties' counts, depend on it."""
    params = request.sampling_params
    return params.structured_outputs is not None or params.uses_penalties


def _adapter_counts(requests: list[Request]) -> tuple[tuple[str, int], ...]:
    """(adapter, how many of `requests` use it), by name."""
    counts = Counter(r.lora_name for r in requests if r.lora_name is not None)
    return tuple(sorted(counts.items()))


def _table(counts: np.ndarray) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(row) for row in counts.tolist())


def _nbytes(tree: Any) -> int:
    return sum(int(x.nbytes) for x in jax.tree.leaves(tree))


def _usage(parent: _Parent) -> Usage:
    return Usage(
        prompt_tokens=len(parent.prompt_token_ids),
        cached_prompt_tokens=parent.children[0].num_cached_tokens,
        output_lengths=tuple(len(c.output_token_ids) for c in parent.children),
    )


def _record_prompt_logprobs(out: SchedulerOutput, prompt: SamplerOutput) -> None:
    """Each scheduled prompt token's successor: its logprob and the top-k (vLLM's shape: the
    first prompt token has None). Positions seen before (after a preemption) are skipped."""
    offset = 0
    for s in out.scheduled:
        request, k = s.request, s.request.sampling_params.prompt_logprobs
        if k is not None:
            entries = request.prompt_logprobs
            if not entries:
                entries.append(None)
            for j in range(s.num_new_tokens):
                if s.start + j + 1 == len(entries) < len(request.prompt_token_ids):
                    entries.append(_logprob_entry(prompt, offset + j, k))
        offset += s.num_new_tokens


def _logprob_entry(result: StepOutput | SamplerOutput, row: int, k: int) -> dict[int, float]:
    """{token: logprob} of the chosen token and the top k at `row`."""
    entry = {
        int(t): float(lp)
        for t, lp in zip(result.top_ids[row, :k], result.top_logprobs[row, :k], strict=True)
    }
    entry[int(result.token_ids[row])] = float(result.logprobs[row])
    return entry


def run_to_completion(
    engine: Engine, request_ids: list[str], *, use_tqdm: bool = False
) -> list[RequestOutput]:
    """Steps `engine` until it is idle; returns the whole outputs of `request_ids`, in order."""
    joined = {i: OutputAccumulator() for i in request_ids}
    with tqdm(total=len(request_ids), disable=not use_tqdm, desc="generating") as bar:
        while engine.has_unfinished_requests():
            for output in engine.step():
                accumulator = joined.get(output.request_id)
                if accumulator is not None:
                    accumulator.add(output)
                bar.update(output.finished)
    return [joined[i].output() for i in request_ids]


__all__ = ["FinishReason", "LLMEngine", "SamplingParams", "run_to_completion"]
