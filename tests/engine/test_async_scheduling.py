"""Asynchronous scheduling (engine/llm_engine.py) against the synchronous loop as its oracle: the
same requests give the same tokens, text, finish and stop reasons and logprobs either way, while
the asynchronous loop really keeps a step in flight as it schedules the next one.

One shared engine (tests/conftest.py) runs both modes, with a small page allocator swapped in so
that requests are preempted and recomputed."""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from engine import compilation
from engine.kv_cache import KVCacheManager
from engine.llm_engine import LLMEngine
from engine.request import OutputAccumulator, SamplingParams
from engine.scheduler import Scheduler
from tests.conftest import PAGE
from tests.engine.tiny_model import EOS_ID, VOCAB_SIZE

NUM_PAGES = 24  # 96 token slots for 8 sequences of up to 30 tokens: preemption is certain
PREFIX = [11, 22, 33, 44, 55, 66, 77, 88]  # a page-aligned prefix some prompts share
STOPS = [chr(c) for c in range(ord("a"), ord("q"))] + ["ab", "%&", "xy"]


def random_params(rng: random.Random) -> SamplingParams:
    """A random mix of what a request may ask: greedy or seeded sampling, n = 2, stop strings and
    stop ids, min_tokens, EOS made likely by a bias, logprobs, and (rarely) penalties, which
    make the asynchronous loop fall back to synchronous steps."""
    max_tokens = rng.randint(1, 16)
    sampled = rng.random() < 0.5
    return SamplingParams(
        n=2 if sampled and rng.random() < 0.3 else 1,
        temperature=0.9 if sampled else 0.0,
        top_k=rng.choice([0, 20]),
        seed=rng.randrange(1 << 20) if sampled else None,
        max_tokens=max_tokens,
        min_tokens=rng.randint(0, min(3, max_tokens)),
        stop=tuple(rng.sample(STOPS, 6)) if rng.random() < 0.4 else (),
        include_stop_str_in_output=rng.random() < 0.3,
        stop_token_ids=(rng.randrange(VOCAB_SIZE - 4),) if rng.random() < 0.2 else (),
        logit_bias={EOS_ID: 3.0} if rng.random() < 0.3 else None,
        logprobs=2 if rng.random() < 0.2 else None,
        presence_penalty=1.5 if rng.random() < 0.04 else 0.0,
    )


def random_requests(seed: int, count: int) -> list[tuple[list[int], SamplingParams]]:
    rng = random.Random(seed)
    requests = []
    for _ in range(count):
        tail = [rng.randrange(VOCAB_SIZE) for _ in range(rng.randint(1, 10))]
        prompt = PREFIX + tail if rng.random() < 0.3 else tail
        requests.append((prompt, random_params(rng)))
    return requests


@contextmanager
def small_cache(engine: LLMEngine) -> Iterator[None]:
    """The engine with a page allocator of NUM_PAGES pages (the device cache is larger; only
    these are handed out); restored afterwards. A step left in flight by an earlier test, or
    by this one, is finished first (an idle engine's step does that)."""
    engine.step()
    saved = engine.kv_cache, engine.scheduler, engine.async_scheduling
    engine.kv_cache = KVCacheManager(NUM_PAGES, PAGE)
    engine.scheduler = Scheduler(engine.scheduler_config, engine.kv_cache)
    try:
        yield
        engine.step()
    finally:
        engine.kv_cache, engine.scheduler, engine.async_scheduling = saved


class InFlight:
    """The most steps dispatched and not yet fetched at any time (1: synchronous)."""

    def __init__(self, engine: LLMEngine):
        self.now = self.most = 0
        runner = engine.runner
        run_batch, fetch = runner.run_batch, runner.fetch

        def counted_run(*args: Any, **kwargs: Any) -> Any:
            self.now += 1
            self.most = max(self.most, self.now)
            return run_batch(*args, **kwargs)

        def counted_fetch(*args: Any, **kwargs: Any) -> Any:
            self.now -= 1
            return fetch(*args, **kwargs)

        runner.run_batch, runner.fetch = counted_run, counted_fetch  # type: ignore[method-assign]
        self._runner = runner

    def close(self) -> None:
        del self._runner.run_batch, self._runner.fetch  # the class's methods again


def run(engine: LLMEngine, requests: list, aborted: set[int], *, async_on: bool) -> dict:
    """Every request's whole output (choices' token ids, text, finish and stop reasons, rounded
    logprobs); requests in `aborted` are aborted once they have streamed two tokens."""
    engine.async_scheduling = async_on
    ids = [f"{'async' if async_on else 'sync'}-{i}" for i in range(len(requests))]
    for request_id, (prompt, params) in zip(ids, requests, strict=True):
        engine.add_request(request_id, prompt, params)
    joined = {i: OutputAccumulator() for i in ids}
    streamed = dict.fromkeys(ids, 0)  # tokens handed out so far
    to_abort = {ids[i] for i in aborted}
    while engine.has_unfinished_requests():
        for output in engine.step():
            joined[output.request_id].add(output)
            streamed[output.request_id] += sum(len(c.token_ids) for c in output.outputs)
        for request_id in [i for i in to_abort if streamed[i] >= 2]:
            engine.abort_request(request_id)
            to_abort.discard(request_id)
    return {i: _summary(joined[request_id].output()) for i, request_id in enumerate(ids)}


def _summary(output: Any) -> list:
    return [
        (c.token_ids, c.text, c.finish_reason, c.stop_reason, _approx(c.logprobs))
        for c in output.outputs
    ]


def _approx(logprobs: list[dict[int, float]] | None) -> list | None:
    """Logprobs to float tolerance (a batch of another shape may round differently)."""
    if logprobs is None:
        return None
    return [{t: pytest.approx(lp, abs=1e-3) for t, lp in entry.items()} for entry in logprobs]


def _all_pages_free(engine: LLMEngine) -> None:
    engine.kv_cache.check_invariants()
    assert engine.kv_cache.num_free_pages == NUM_PAGES


@pytest.mark.parametrize("seed", [0])
def test_async_equals_sync_for_random_requests(engine: LLMEngine, seed: int) -> None:
    """128 random requests (see random_params), four of them aborted mid-flight, under a cache
    small enough to preempt: the asynchronous loop's outputs equal the synchronous loop's, every
    page is free after each, it kept two steps in flight (the synchronous one, one), and nothing
    compiled."""
    requests = random_requests(seed, 128)
    aborted = {i for i, (_, p) in enumerate(requests) if p.n == 1 and p.max_tokens > 8}
    aborted = set(sorted(aborted)[:4])
    compiled = compilation.count()
    with small_cache(engine):
        in_flight = InFlight(engine)
        try:
            sync = run(engine, requests, aborted, async_on=False)
            assert in_flight.most == 1
            assert engine.scheduler.num_preemptions > 0
            _all_pages_free(engine)
            in_flight.most = 0
            preemptions = engine.scheduler.num_preemptions
            asynchronous = run(engine, requests, aborted, async_on=True)
            assert in_flight.most == 2
            assert engine.scheduler.num_preemptions > preemptions
            _all_pages_free(engine)
        finally:
            in_flight.close()
    assert compilation.count() == compiled
    # The mix covers every way to end: length, EOS, stop strings, stop ids, and abort.
    ends = [(c[2], type(c[3])) for choices in sync.values() for c in choices]
    assert {*ends} == {("length", type(None)), ("stop", type(None)), ("stop", str)} | {
        ("stop", int),
        (None, type(None)),
    }
    for i in sorted(sync):
        assert asynchronous[i] == sync[i], f"request {i}: {requests[i][1]}"
