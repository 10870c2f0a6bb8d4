"""Continuous batching: which tokens of which requests the next step computes.

Every step gets a token budget. Running requests are served first (a decode is one token, a
prompt still being prefilled takes what the budget leaves: chunked prefill, so long prompts
never stall decodes), then waiting requests are admitted by priority and arrival. When the KV
cache runs out of pages, the running request with the lowest priority (then the newest) is
preempted: its pages are freed and it waits to be recomputed later, helped by the prefix cache.
A waiting request that finds no free pages or no free seat preempts running requests of lower
priority the same way (vLLM's priority scheduling), so a high-priority arrival never waits for
low-priority work to finish.

Host code: plain Python, never imports jax.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.config import SchedulerConfig
from engine.errors import InvalidRequestError
from engine.kv_cache import KVCacheManager
from engine.request import FinishReason, Request, RequestStatus, context_length_error


@dataclass(slots=True)
class ScheduledRequest:
    """`num_new_tokens` of `request`, starting at token `start`, go into this step. (Not
    frozen: one is made for every running sequence every step, and a frozen dataclass's
    `__init__` costs several times a plain one's; nothing changes one once made.)"""

    request: Request
    start: int
    num_new_tokens: int
    # Speculative proposals scored after the request's last known token (engine/speculative/):
    # the last `len(draft_token_ids)` of the new tokens; not counted as computed by this step.
    draft_token_ids: tuple[int, ...] = ()

    @property
    def completes_sequence(self) -> bool:
        """Whether this step reaches the request's last token (one still pending on the device
        counts; proposals do not), so its sample is kept."""
        return self.num_known_tokens == self.request.num_tokens_with_pending

    @property
    def num_known_tokens(self) -> int:
        """The tokens computed up to the end of this step, proposals excluded."""
        return self.start + self.num_new_tokens - len(self.draft_token_ids)

    @property
    def token_ids(self) -> list[int]:
        """The tokens this step feeds to the model that the host knows (a pending one is not
        among them), then the proposals."""
        tokens = self.request.all_token_ids[self.start : self.num_known_tokens]
        return tokens + list(self.draft_token_ids)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    num_prompt_tokens: int = 0  # prompt tokens the step computes (set by update_after_step)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache: KVCacheManager):
        self.config = config
        self.kv_cache = kv_cache
        self.running: list[Request] = []  # kept in serving order: priority, then arrival
        self._running_sorted = True
        self._waiting: list[tuple[int, float, int, Request]] = []  # heap
        self._order = itertools.count()
        self._requests: dict[str, Request] = {}
        self.num_preemptions = 0
        # Asked before a waiting request is admitted: whether its LoRA adapter is in a device
        # slot (put there if one is free); a request whose adapter must wait is passed over.
        self.adapter_ready: Callable[[Request], bool] = lambda request: True

    # ---- admission and removal -------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queues a request, or rejects it with the numbers if it could never fit."""
        prompt_len, max_tokens = len(request.prompt_token_ids), request.sampling_params.max_tokens
        if prompt_len + max_tokens > self.config.model_len:
            raise InvalidRequestError(
                context_length_error(self.config.model_len, prompt_len, max_tokens),
                param="input_tokens",
            )
        pages = -(-(prompt_len + max_tokens) // self.kv_cache.page_size)
        if pages > self.kv_cache.num_pages:
            raise InvalidRequestError(
                f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) needs {pages} KV cache "
                f"pages but the whole cache has {self.kv_cache.num_pages} pages of "
                f"{self.kv_cache.page_size} tokens",
                param="max_tokens",
            )
        if request.request_id in self._requests:
            raise InvalidRequestError(f"duplicate request id {request.request_id!r}")
        self._requests[request.request_id] = request
        self._push_waiting(request)

    def finish(self, request: Request, reason: FinishReason) -> None:
        """Ends a request (stopped, at its length, or aborted) and frees its pages."""
        if request.is_finished:
            return
        if request in self.running:
            self.running.remove(request)
        elif request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            self._waiting = [e for e in self._waiting if e[3] is not request]
            heapq.heapify(self._waiting)
        request.status, request.finish_reason = RequestStatus.FINISHED, reason
        self.kv_cache.free(request.request_id)
        del self._requests[request.request_id]

    def abort(self, request_id: str) -> Request | None:
        request = self._requests.get(request_id)
        if request is not None:
            self.finish(request, FinishReason.ABORT)
        return request

    # ---- the per-step decision ---------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        if not self._running_sorted:  # removals keep the order; admissions may not
            self.running.sort(key=_serving_order)
            self._running_sorted = True
        budget = self._schedule_running(out, budget)
        if not out.preempted:  # pages are short: admit nobody new this step
            self._schedule_waiting(out, budget)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        # Once per running sequence per step: properties read through locals.
        running, scheduled, allocate = self.running, out.scheduled, self.kv_cache.allocate
        model_len = self.config.model_len
        i = 0
        while i < len(running) and budget > 0:
            request = running[i]
            pending = request.num_pending_tokens
            num_out = len(request.output_token_ids)
            known = len(request.prompt_token_ids) + num_out
            # Its pending token is surely its last (max_tokens or the context length): the step
            # after it would be discarded. (Inline: every sequence, every asynchronous step.)
            if pending and (
                num_out + pending >= request.sampling_params.max_tokens
                or known + pending >= model_len
            ):
                i += 1
                continue
            computed = request.num_computed_tokens
            num_new = min(known + pending - computed, budget)
            while allocate(request.request_id, computed + num_new) is None:
                victim = running.pop()  # lowest priority, newest
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is request:
                    return budget
            scheduled.append(ScheduledRequest(request, computed, num_new))
            budget -= num_new
            i += 1
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        passed_over: list[tuple[int, float, int, Request]] = []  # waiting for an adapter slot
        try:
            self._admit_waiting(out, budget, passed_over)
        finally:
            for entry in passed_over:
                heapq.heappush(self._waiting, entry)

    def _admit_waiting(
        self, out: SchedulerOutput, budget: int, passed_over: list[tuple[int, float, int, Request]]
    ) -> None:
        while self._waiting and budget > 0:
            request = self._waiting[0][3]
            if request in out.preempted or request.num_pending_tokens:  # preempted this step
                return  # (its last token not read yet): it waits for the next
            if not self.adapter_ready(request):  # the requests behind it may go first
                passed_over.append(heapq.heappop(self._waiting))
                continue
            cached_pages: list[int] = []
            num_cached = 0
            if request.sampling_params.prompt_logprobs is None:  # those need every position
                cached_pages, num_cached = self.kv_cache.find_cached_prefix(
                    request.all_token_ids, request.cache_salt
                )
            num_new = min(request.num_tokens - num_cached, budget)
            while not self._admits(request, num_cached + num_new, cached_pages):
                victim = self._lower_priority_victim(request)
                if victim is None:
                    return
                budget += self._preempt_scheduled(victim, out)
            heapq.heappop(self._waiting)
            if request.status is RequestStatus.WAITING:
                request.num_cached_tokens = num_cached
                request.scheduled_time = time.monotonic()
            request.num_computed_tokens = num_cached
            request.status = RequestStatus.RUNNING
            running = self.running
            if running and _serving_order(request) < _serving_order(running[-1]):
                self._running_sorted = False  # (most newcomers go last: the order holds)
            running.append(request)
            out.scheduled.append(ScheduledRequest(request, num_cached, num_new))
            budget -= num_new

    def _admits(self, request: Request, num_tokens: int, cached_pages: list[int]) -> bool:
        """Gives the request a seat and pages for `num_tokens` tokens, if both are free."""
        if len(self.running) >= self.config.max_num_seqs:
            return False
        return self.kv_cache.allocate(request.request_id, num_tokens, cached_pages) is not None

    def _lower_priority_victim(self, request: Request) -> Request | None:
        """The running request that `request` may preempt: the lowest-priority one (then the
        newest), if its priority is lower than the request's."""
        victim = max(self.running, key=_serving_order, default=None)
        return victim if victim is not None and victim.priority > request.priority else None

    def _preempt_scheduled(self, victim: Request, out: SchedulerOutput) -> int:
        """Preempts a running request, taking it out of this step if it was in it; returns the
        tokens that gives back to the step's budget."""
        self.running.remove(victim)
        self._preempt(victim)
        out.preempted.append(victim)
        scheduled = [s for s in out.scheduled if s.request is victim]
        for s in scheduled:
            out.scheduled.remove(s)
        return sum(s.num_new_tokens for s in scheduled)

    def _preempt(self, request: Request) -> None:
        self.kv_cache.free(request.request_id)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._push_waiting(request)

    def _push_waiting(self, request: Request) -> None:
        entry = (request.priority, request.arrival_time, next(self._order), request)
        heapq.heappush(self._waiting, entry)

    # ---- after the step ----------------------------------------------------------------------

    def update_after_step(self, out: SchedulerOutput) -> list[Request]:
        """Records the computed tokens; returns the requests whose sampled token counts (their
        step reached the last known token; a prefill chunk short of it samples nothing)."""
        completed = []
        kv = self.kv_cache
        windowed = kv.sliding_window is not None
        # Once per scheduled sequence per step: `ScheduledRequest.num_known_tokens` inline.
        caching, page_size, committed = (
            kv.enable_prefix_caching,
            kv.page_size,
            kv.num_committed_pages,
        )
        num_prompt_tokens = 0
        for s in out.scheduled:
            request = s.request
            computed = s.start + s.num_new_tokens - len(s.draft_token_ids)
            request.num_computed_tokens = computed
            prompt_len = len(request.prompt_token_ids)
            if s.start < prompt_len:
                num_prompt_tokens += min(s.start + s.num_new_tokens, prompt_len) - s.start
            num_tokens = prompt_len + len(request.output_token_ids)
            # A page holding a pending token is hashed by a later step, once the host knows it.
            known = min(computed, num_tokens)
            # Only when it fills a page not in the prefix cache yet, join prompt and output to
            # hash it.
            if caching and known // page_size > committed(request.request_id):
                kv.commit_full_pages(
                    request.request_id, request.all_token_ids, known, request.cache_salt
                )
            if windowed:
                kv.release_behind_window(request.request_id, computed)
            if computed == num_tokens + request.num_pending_tokens:  # s.completes_sequence
                completed.append(request)
        out.num_prompt_tokens = num_prompt_tokens
        return completed

    # ---- state -------------------------------------------------------------------------------

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def waiting(self) -> list[Request]:
        """The waiting requests (a copy, in no particular order)."""
        return [entry[-1] for entry in list(self._waiting)]

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    def get(self, request_id: str) -> Request | None:
        return self._requests.get(request_id)


def _serving_order(request: Request) -> tuple[int, float]:
    return (request.priority, request.arrival_time)
