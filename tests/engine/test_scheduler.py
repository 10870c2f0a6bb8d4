"""Scheduler and allocator invariants under random operation sequences, and priority
preemption in chosen cases (no model: sampled tokens are made up, which is all the scheduler
sees)."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from engine.config import SchedulerConfig
from engine.errors import InvalidRequestError
from engine.kv_cache import KVCacheManager
from engine.request import FinishReason, Request, RequestStatus, SamplingParams
from engine.scheduler import Scheduler, SchedulerOutput

PAGE = 4
CONFIG = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=48)


class SchedulerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(12, PAGE)
        self.scheduler = Scheduler(CONFIG, self.kv)
        self.added: dict[str, Request] = {}
        self.aborted: set[str] = set()
        self.counter = 0

    @rule(
        prompt=st.lists(st.integers(0, 3), min_size=1, max_size=30),
        max_tokens=st.integers(1, 20),
        priority=st.integers(0, 2),
    )
    def add(self, prompt: list[int], max_tokens: int, priority: int) -> None:
        self.counter += 1
        request = Request(
            f"r{self.counter}",
            prompt,
            SamplingParams(max_tokens=max_tokens),
            seed=0,
            priority=priority,
        )
        try:
            self.scheduler.add_request(request)
        except InvalidRequestError:
            assert len(prompt) + max_tokens > CONFIG.max_model_len or (
                -(-(len(prompt) + max_tokens) // PAGE) > self.kv.num_pages
            )
            return
        self.added[request.request_id] = request

    @precondition(lambda self: self.added)
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        request_id = data.draw(st.sampled_from(sorted(self.added)))
        if not self.added[request_id].is_finished:
            self.aborted.add(request_id)
        self.scheduler.abort(request_id)

    @rule(token=st.integers(0, 3))
    def step(self, token: int) -> None:
        out = self.scheduler.schedule()
        ids = [s.request.request_id for s in out.scheduled]
        assert len(ids) == len(set(ids)) <= CONFIG.max_num_seqs
        assert out.num_tokens <= CONFIG.max_num_batched_tokens
        assert not {s.request for s in out.scheduled} & set(out.preempted)
        self.check_no_priority_inversion(out)
        for s in out.scheduled:
            pages = self.kv.page_table(s.request.request_id)
            assert len(pages) * PAGE >= s.start + s.num_new_tokens
        for request in self.scheduler.update_after_step(out):
            request.output_token_ids.append(token)
            if len(request.output_token_ids) >= request.sampling_params.max_tokens:
                self.scheduler.finish(request, FinishReason.LENGTH)

    def check_no_priority_inversion(self, out: SchedulerOutput) -> None:
        """A step that preempted nobody and had budget left could not admit a waiting request
        only if no running request had lower priority (one would have been preempted)."""
        if out.preempted or out.num_tokens >= CONFIG.max_num_batched_tokens:
            return
        waiting = [r for r in self.added.values() if r.status is RequestStatus.WAITING]
        for request in waiting:
            for running in self.scheduler.running:
                assert request.priority >= running.priority, (request, running)

    @invariant()
    def pages_consistent(self) -> None:
        self.kv.check_invariants()  # no page owned twice, refcounts match the page tables
        for request in self.scheduler.running:
            assert request.num_computed_tokens <= request.num_tokens
        if self.scheduler._running_sorted:  # what `schedule` takes as the serving order
            order = [(r.priority, r.arrival_time) for r in self.scheduler.running]
            assert order == sorted(order)

    def teardown(self) -> None:
        for _ in range(500):
            if not self.scheduler.has_unfinished():
                break
            self.step(0)
        assert not self.scheduler.has_unfinished()  # every request finishes or was aborted
        for request_id, request in self.added.items():
            assert request.is_finished
            reason = FinishReason.ABORT if request_id in self.aborted else FinishReason.LENGTH
            assert request.finish_reason is reason
        assert self.kv.num_free_pages == self.kv.num_pages
        self.kv.check_invariants()


TestScheduler = SchedulerMachine.TestCase
TestScheduler.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


def request(request_id: str, prompt_len: int, priority: int, max_tokens: int = 8) -> Request:
    return Request(
        request_id, [1] * prompt_len, SamplingParams(max_tokens=max_tokens), seed=0,
        priority=priority,
    )  # fmt: skip


def step(scheduler: Scheduler) -> SchedulerOutput:
    """Schedules one step and records a made-up token for each sequence that completes it."""
    out = scheduler.schedule()
    for r in scheduler.update_after_step(out):
        r.output_token_ids.append(0)
    return out


def low_priority_filling_the_cache(
    config: SchedulerConfig, num_pages: int
) -> tuple[Scheduler, list[Request]]:
    """Two priority-1 requests of 13-token prompts, prefilled in two steps: 8 pages of 4 hold
    them, and their next decodes fit in the pages they hold."""
    kv = KVCacheManager(num_pages, PAGE)
    scheduler = Scheduler(config, kv)
    low = [request(f"low{i}", 13, priority=1) for i in range(2)]
    for r in low:
        scheduler.add_request(r)
    step(scheduler)
    step(scheduler)
    assert scheduler.running == low and kv.num_free_pages == num_pages - 8
    return scheduler, low


def test_a_high_priority_arrival_preempts_the_newest_lower_priority_request() -> None:
    scheduler, (old, new) = low_priority_filling_the_cache(CONFIG, num_pages=8)
    high = request("high", 4, priority=0)
    scheduler.add_request(high)
    out = step(scheduler)
    assert [s.request for s in out.scheduled] == [old, high]
    assert out.preempted == [new] and new.status is RequestStatus.PREEMPTED
    assert scheduler.num_waiting == 1 and scheduler.num_preemptions == 1
    scheduler.kv_cache.check_invariants()


def test_a_high_priority_arrival_takes_the_seat_of_a_lower_priority_request() -> None:
    config = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=16, max_model_len=48)
    scheduler, (old, new) = low_priority_filling_the_cache(config, num_pages=12)
    high = request("high", 4, priority=0)
    scheduler.add_request(high)
    out = step(scheduler)  # pages are free, seats are not
    assert [s.request for s in out.scheduled] == [old, high] and out.preempted == [new]


def test_equal_or_lower_priority_arrivals_wait() -> None:
    scheduler, low = low_priority_filling_the_cache(CONFIG, num_pages=8)
    for i, priority in enumerate((1, 2)):
        scheduler.add_request(request(f"later{i}", 4, priority=priority))
    out = step(scheduler)
    assert [s.request for s in out.scheduled] == low and not out.preempted
    assert scheduler.num_waiting == 2


def test_the_preempted_request_resumes_from_its_tokens() -> None:
    """Once the high-priority request is done, the preempted one is admitted again and
    recomputes its prompt and the tokens it had generated (but the full pages the prefix cache
    kept)."""
    scheduler, (_, new) = low_priority_filling_the_cache(CONFIG, num_pages=8)
    high = request("high", 4, priority=0, max_tokens=1)
    scheduler.add_request(high)
    step(scheduler)
    scheduler.finish(high, FinishReason.LENGTH)
    out = scheduler.schedule()
    [resumed] = [s for s in out.scheduled if s.request is new]
    assert resumed.start == 12 and resumed.start + resumed.num_new_tokens == new.num_tokens
    assert new.output_token_ids == [0]
