"""A consumer that falls behind its stream gets the deltas that arrived meanwhile merged into
one output (serving/collector.py), and nothing is lost or reordered: joined, the merged chunks
equal the engine's own whole output (OutputAccumulator over every delta, or an offline greedy
run), logprobs one per token, through the in-process front and the engine core's client."""

from __future__ import annotations

import asyncio
import itertools
import multiprocessing
import time

import pytest

from engine.llm_engine import LLMEngine, run_to_completion
from engine.protocol import EngineStats, Health, ModelInfo
from engine.request import CompletionOutput, OutputAccumulator, RequestOutput, SamplingParams, Usage
from serving import core_wire as wire
from serving.async_engine import AsyncEngine
from serving.collector import OutputCollector, merge_outputs
from serving.core_client import EngineCoreClient

BEHIND_S = 0.05  # what the slow consumer spends (blocking its event loop) on each chunk


def _delta(step: int, index: int, *, last: bool = False) -> CompletionOutput:
    token = 10 * step + index
    return CompletionOutput(
        index,
        f"<{step}.{index}>",
        [token],
        "length" if last else None,
        None,
        [{token: -0.5 * step, token + 1: -3.0}],
    )


def _script() -> list[RequestOutput]:
    """A request with n=2 whose choices gain tokens on different steps; the first delta
    carries the prompt, the last the usage."""
    steps = [
        RequestOutput("r", [_delta(0, 0), _delta(0, 1)], False, prompt_token_ids=[1, 2]),
        RequestOutput("r", [_delta(1, 1)], False),
        RequestOutput("r", [_delta(2, 0), _delta(2, 1, last=True)], False),
        RequestOutput("r", [_delta(3, 0)], False),
    ]
    usage = Usage(2, 0, (4, 3))
    steps.append(RequestOutput("r", [_delta(4, 0, last=True)], True, usage=usage))
    return steps


def _joined(outputs: list[RequestOutput]) -> RequestOutput:
    accumulator = OutputAccumulator()
    for output in outputs:
        accumulator.add(output)
    return accumulator.output()


@pytest.mark.parametrize("cut", [(1, 3), (0, 5), (2,), (4,)])
def test_merged_chunks_join_to_the_whole_output(cut: tuple[int, ...]) -> None:
    """Deltas merged in runs (split at `cut`) join to what every delta joins to."""
    steps = _script()
    bounds = [0, *cut, len(steps)]
    chunks = []
    for start, end in itertools.pairwise(bounds):
        if start == end:
            continue
        chunks.append(merge_outputs(steps[start:end]))
    assert _joined(chunks) == _joined(steps)
    for chunk in chunks:
        for choice in chunk.outputs:
            assert choice.logprobs is not None and len(choice.logprobs) == len(choice.token_ids)


def test_a_consumer_behind_takes_what_arrived_as_one_output() -> None:
    async def main() -> list[RequestOutput]:
        collector = OutputCollector(asyncio.get_running_loop(), merge_outputs)
        steps = _script()
        for output in steps[:3]:
            collector.put(output)
        first = await collector.get()
        for output in steps[3:]:
            collector.put(output)
        collector.put(RuntimeError("after the end"))
        second = await collector.get()
        assert isinstance(first, RequestOutput) and isinstance(second, RequestOutput)
        assert isinstance(await collector.get(), RuntimeError)  # only after the outputs
        return [first, second]

    chunks = asyncio.run(main())
    assert _joined(chunks) == _joined(_script())
    assert [len(c.outputs[0].token_ids) for c in chunks] == [2, 2]
    assert chunks[0].prompt_token_ids == [1, 2] and chunks[1].finished


async def _slow_stream(stream) -> list[RequestOutput]:
    """Reads `stream` while blocking its own event loop for BEHIND_S per chunk, as a server
    busy with other streams does."""
    chunks = []
    async for output in stream:
        chunks.append(output)
        time.sleep(BEHIND_S)
    return chunks


def _check_chunks(chunks: list[RequestOutput], whole: RequestOutput) -> None:
    assert max(len(c.outputs[0].token_ids) for c in chunks) > 1, "nothing was merged"
    for chunk in chunks:
        (choice,) = chunk.outputs
        assert choice.logprobs is not None and len(choice.logprobs) == len(choice.token_ids)
    assert chunks[-1].finished and not any(c.finished for c in chunks[:-1])
    streamed = _joined(chunks).outputs[0]
    assert streamed.text == whole.outputs[0].text
    assert streamed.token_ids == whole.outputs[0].token_ids
    expected = whole.outputs[0].logprobs
    assert streamed.logprobs is not None and expected is not None
    assert [sorted(e) for e in streamed.logprobs] == [sorted(e) for e in expected]
    for got, want in zip(streamed.logprobs, expected, strict=True):
        assert got == pytest.approx(want, abs=1e-4)  # the step's batch shape may differ
    assert streamed.finish_reason == whole.outputs[0].finish_reason


def test_a_slow_consumer_of_the_engine_gets_merged_chunks_equal_to_greedy(
    engine: LLMEngine,
) -> None:
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)
    prompt = [3, 1, 4, 1, 5]
    front = AsyncEngine(engine)
    try:
        chunks = asyncio.run(_slow_stream(front.generate("slow", prompt, params)))
    finally:
        front.shutdown(timeout=5)
    engine.add_request("offline", prompt, params)
    (whole,) = run_to_completion(engine, ["offline"])
    _check_chunks(chunks, whole)


def test_the_core_client_merges_for_a_slow_consumer() -> None:
    """The engine core's client, the test playing the core: one delta per message, sent
    faster than the consumer reads."""
    client_end, core = multiprocessing.Pipe()
    info = ModelInfo("LlamaForCausalLM", 256, 128, 4, 32)
    status = (wire.STATUS, wire.CoreStatus(EngineStats(), Health(), (), 0.01, 0.0, 0))
    wire.send(core, [(wire.HELLO, info, None)])
    wire.send(core, [status])
    client = EngineCoreClient.connect(client_end)
    steps = [
        RequestOutput("r", [CompletionOutput(0, f"t{i} ", [i], logprobs=[{i: -1.0 * i}])], False)
        for i in range(20)
    ]
    steps.append(
        RequestOutput(
            "r", [CompletionOutput(0, "", [], "length", None, [])], True, usage=Usage(1, 0, (20,))
        )
    )

    def play_core() -> None:
        wire.receive(core)  # the ADD
        for output in steps:
            wire.send(core, [(wire.OUTPUTS, [wire.compact(output)])])
            time.sleep(BEHIND_S / 10)

    async def main() -> list[RequestOutput]:
        stream = client.generate("r", [1], SamplingParams(max_tokens=20))
        player = asyncio.create_task(asyncio.to_thread(play_core))
        chunks = await _slow_stream(stream)
        await player
        return chunks

    try:
        chunks = asyncio.run(main())
    finally:
        client.shutdown()
        core.close()
    _check_chunks(chunks, _joined(steps))


def test_compact_deltas_merge_as_their_outputs_do() -> None:
    """A run of deltas as they cross from the engine core (plain running deltas as tuples,
    others as outputs) merges to what the same deltas as outputs merge to."""
    plain = [
        RequestOutput("r", [CompletionOutput(0, "a", [1]), CompletionOutput(1, "x", [7])], False),
        RequestOutput("r", [CompletionOutput(1, "yz", [8, 9])], False),
        RequestOutput("r", [CompletionOutput(0, "", [2])], False),
        RequestOutput("r", [CompletionOutput(0, "bc", [3]), CompletionOutput(1, "", [])], False),
    ]
    crossed = [wire.compact(o) for o in plain]
    assert all(isinstance(c, tuple) for c in crossed)
    for run in (crossed[:1], crossed, crossed[1:3]):
        expanded = [wire.expand(c) for c in run]
        assert wire.merge(run) == merge_outputs(expanded)
    usage = Usage(2, 0, (3, 3))
    end = RequestOutput("r", [CompletionOutput(0, "d", [4], "stop")], True, usage=usage)
    mixed = [*crossed, wire.compact(end)]
    assert mixed[-1] is end
    merged = wire.merge(mixed)
    assert merged == merge_outputs([*plain, end])
    assert merged.outputs[0].text == "abcd" and merged.outputs[0].token_ids == [1, 2, 3, 4]
    assert merged.outputs[1].text == "xyz" and merged.finished and merged.usage == usage
