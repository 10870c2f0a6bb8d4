"""The asyncio front over the tiny engine: concurrent streams, aborts when the caller goes
away, clear errors, and a dead engine loop reported instead of a hang."""

from __future__ import annotations

import asyncio
import time

import pytest

from engine import compilation, naive
from engine.config import CacheConfig, SchedulerConfig
from engine.errors import InvalidRequestError
from engine.llm_engine import LLMEngine, run_to_completion
from engine.request import OutputAccumulator, SamplingParams
from serving.async_engine import AsyncEngine, EngineDeadError
from tests.conftest import PAGE

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture
def front(engine: LLMEngine):
    front = AsyncEngine(engine)
    yield front
    front.shutdown(timeout=5)
    assert not engine.has_unfinished_requests()
    assert engine.kv_cache.num_free_pages == engine.kv_cache.num_pages


async def collect(front: AsyncEngine, request_id: str, prompt: list[int]) -> list[int]:
    joined = OutputAccumulator()
    async for output in front.generate(request_id, prompt, GREEDY):
        joined.add(output)
    assert joined.finished
    return joined.output().outputs[0].token_ids


def test_concurrent_streams_equal_offline_generation(engine: LLMEngine, front) -> None:
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9] * 20, [10, 11]]

    async def main() -> list[list[int]]:
        return await asyncio.gather(*(collect(front, f"s{i}", p) for i, p in enumerate(prompts)))

    streamed = asyncio.run(main())
    front.shutdown(timeout=5)  # the offline run below drives the engine itself
    for i, p in enumerate(prompts):
        engine.add_request(f"o{i}", p, GREEDY)
    offline = run_to_completion(engine, [f"o{i}" for i in range(len(prompts))])
    assert streamed == [o.outputs[0].token_ids for o in offline]


def test_caller_going_away_aborts_the_request(engine: LLMEngine, front) -> None:
    async def main() -> None:
        params = SamplingParams(max_tokens=200, ignore_eos=True)
        stream = front.generate("leaver", [1, 2, 3], params)
        await anext(stream)
        await stream.aclose()  # what a disconnected client's handler does
        for _ in range(100):  # the abort lands within one engine step
            if not engine.has_unfinished_requests():
                return
            await asyncio.sleep(0.01)

    asyncio.run(main())
    assert not engine.has_unfinished_requests()


def test_a_closed_caller_loop_aborts_the_request(engine: LLMEngine, front) -> None:
    """A caller whose event loop closed without closing its stream (a server thread that
    stopped) must not take the engine loop down with it."""
    loop = asyncio.new_event_loop()
    stream = front.generate("orphan", [1, 2, 3], SamplingParams(max_tokens=200, ignore_eos=True))
    loop.run_until_complete(anext(stream))
    loop.close()  # the stream stays registered: only closing the iterator would abort it
    for _ in range(500):
        if not engine.has_unfinished_requests():
            break
        time.sleep(0.01)
    assert front.is_healthy
    assert not engine.has_unfinished_requests()


def test_invalid_request_raises_at_once(front) -> None:
    async def main() -> None:
        async for _ in front.generate("bad", [], GREEDY):
            pass

    with pytest.raises(InvalidRequestError, match="at least one token"):
        asyncio.run(main())
    assert front.is_healthy


def test_dead_engine_loop_is_reported(engine: LLMEngine, monkeypatch) -> None:
    def broken_step():
        raise RuntimeError("device lost")

    monkeypatch.setattr(engine, "step", broken_step)
    front = AsyncEngine(engine)

    async def main() -> None:
        async for _ in front.generate("victim", [1, 2], GREEDY):
            pass

    with pytest.raises(EngineDeadError, match="device lost"):
        asyncio.run(asyncio.wait_for(main(), timeout=10))
    assert not front.is_healthy
    with pytest.raises(EngineDeadError):
        asyncio.run(asyncio.wait_for(main(), timeout=10))
    monkeypatch.undo()
    engine.abort_request("victim")


def test_background_warm_up_serves_at_once_then_compiles_every_bucket(tiny) -> None:
    """An engine built without warm-up answers a request right away (compiling the buckets it
    needs on the spot), compiles the rest while idle, and then compiles nothing more."""
    cfg, params, tokenizer = tiny
    cold = LLMEngine(
        cfg,
        params,
        tokenizer,
        cache_config=CacheConfig(page_size=PAGE, num_pages=64),
        scheduler_config=SchedulerConfig(
            max_num_seqs=2, max_num_batched_tokens=8, max_model_len=64
        ),
        warm_up=False,
    )
    all_buckets = cold.stats().num_step_variants
    front = AsyncEngine(cold)
    try:
        oracle = list(naive.generate(params, cfg, [1, 2, 3], naive.NaiveSampling(max_tokens=8)))
        assert asyncio.run(collect(front, "first", [1, 2, 3])) == oracle
        deadline = time.monotonic() + 120
        while cold.stats().num_compiled_steps < all_buckets and time.monotonic() < deadline:
            time.sleep(0.1)
        assert cold.stats().num_compiled_steps == all_buckets
        before = compilation.count()
        asyncio.run(collect(front, "second", [4, 5, 6, 7, 8, 9]))
        assert compilation.count() == before
    finally:
        front.shutdown(timeout=5)
