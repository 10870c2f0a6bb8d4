"""Scheduler and allocator invariants under random operation sequences (no model: sampled
tokens are made up, which is all the scheduler sees)."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from engine.config import SchedulerConfig
from engine.errors import InvalidRequestError
from engine.kv_cache import KVCacheManager
from engine.request import FinishReason, Request, SamplingParams
from engine.scheduler import Scheduler

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
        for s in out.scheduled:
            pages = self.kv.page_table(s.request.request_id)
            assert len(pages) * PAGE >= s.start + s.num_new_tokens
        for request in self.scheduler.update_after_step(out):
            request.output_token_ids.append(token)
            if len(request.output_token_ids) >= request.sampling_params.max_tokens:
                self.scheduler.finish(request, FinishReason.LENGTH)

    @invariant()
    def pages_consistent(self) -> None:
        self.kv.check_invariants()  # no page owned twice, refcounts match the page tables
        for request in self.scheduler.running:
            assert request.num_computed_tokens <= request.num_tokens

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
