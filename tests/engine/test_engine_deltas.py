"""What each engine step hands out: per choice only what is new (tokens, logprobs, text with a
possible stop string's start held back), joined back exactly into the whole answer, whose
oracles are the tokenizer's decode of the tokens, a run without stop conditions, and the
naive model's full forward. And the work is linear: a 2,000-token answer hands out each
character and token once."""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field

import jax
import numpy as np
import pytest

from engine import naive
from engine.config import CacheConfig, SchedulerConfig
from engine.llm_engine import LLMEngine
from engine.request import OutputAccumulator, RequestOutput, SamplingParams
from serving.async_engine import AsyncEngine
from serving.openai.generation import deltas, merge

PROMPT = [40, 71, 110, 32, 98, 105, 103, 33]  # byte tokens


@pytest.fixture(autouse=True)
def no_leaks(engine: LLMEngine):
    yield
    assert not engine.has_unfinished_requests()
    assert engine.kv_cache.num_free_pages == engine.kv_cache.num_pages


@dataclass
class Joined:
    """One request's deltas, as the engine handed them out, and joined per choice."""

    outputs: list[RequestOutput]
    text: dict[int, str] = field(default_factory=dict)
    token_ids: dict[int, list[int]] = field(default_factory=dict)
    logprobs: dict[int, list[dict[int, float]]] = field(default_factory=dict)
    finish: dict[int, tuple[str | None, int | str | None]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for output in self.outputs:
            for choice in output.outputs:
                assert choice.index not in self.finish, "a delta after the choice finished"
                self.text[choice.index] = self.text.get(choice.index, "") + choice.text
                self.token_ids.setdefault(choice.index, []).extend(choice.token_ids)
                self.logprobs.setdefault(choice.index, []).extend(choice.logprobs or [])
                if choice.finish_reason is not None:
                    self.finish[choice.index] = (choice.finish_reason, choice.stop_reason)


def run(engine: LLMEngine, params: SamplingParams, prompt: list[int] = PROMPT) -> Joined:
    request_id = f"deltas-{random.random()}"
    engine.add_request(request_id, prompt, params)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.request_id == request_id]
    return Joined(outputs)


def greedy(max_tokens: int = 40, **changes: object) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True).replace(**changes)


def clean_slice(text: str, start: int, length: int) -> str:
    """`length` characters of `text` from `start` on with no U+FFFD (the byte tokens of a
    random model may decode to partial characters, which are not stable stop strings)."""
    for i in range(start, len(text) - length):
        if "\ufffd" not in text[i : i + length]:
            return text[i : i + length]
    raise AssertionError(f"no clean slice of {text!r}")


def test_each_step_hands_out_only_its_new_token(tiny, engine: LLMEngine) -> None:
    """n=2 seeded sampling with logprobs: every delta has one new token and its logprob, the
    joined text is the tokenizer's decode of the joined tokens, the logprobs are the full
    forward's, and prompt and usage come once each."""
    cfg, params, tokenizer = tiny
    sampling = SamplingParams(n=2, seed=5, max_tokens=12, ignore_eos=True, logprobs=2)
    joined = run(engine, sampling)

    first, *rest = joined.outputs
    assert first.prompt_token_ids == PROMPT and all(o.prompt_token_ids is None for o in rest)
    assert [o.finished for o in joined.outputs] == [False] * len(rest) + [True]
    assert all(o.usage is None for o in joined.outputs[:-1])
    last_usage = joined.outputs[-1].usage
    assert last_usage is not None and last_usage.output_lengths == (12, 12)
    for output in joined.outputs:
        for choice in output.outputs:
            assert len(choice.token_ids) == 1 and len(choice.logprobs or []) == 1
    assert joined.finish == {0: ("length", None), 1: ("length", None)}
    assert joined.token_ids[0] != joined.token_ids[1]
    for i in (0, 1):
        ids = joined.token_ids[i]
        assert joined.text[i] == tokenizer.decode(ids)
        expected = naive.sequence_logits(params, np.asarray([PROMPT + ids]), cfg=cfg)
        rows = np.asarray(jax.nn.log_softmax(np.asarray(expected)[0], axis=-1))
        for j, (token, entry) in enumerate(zip(ids, joined.logprobs[i], strict=True)):
            assert entry[token] == pytest.approx(rows[len(PROMPT) - 1 + j, token], abs=1e-4)


@pytest.mark.parametrize("include", [False, True], ids=["cut", "included"])
@pytest.mark.parametrize("length", [1, 3, 5])
def test_stop_strings_are_never_handed_out(engine: LLMEngine, length: int, include: bool):
    """Stop strings of 1 to 5 characters (so spanning up to 5 steps) held back by exactly
    their length - 1, for n=2: the deltas join to the stopless text cut at the stop (so no
    delta ever held text past the cut)."""
    free = run(engine, greedy()).text[0]
    stop = clean_slice(free, start=6, length=length)
    cut = free.index(stop) + (len(stop) if include else 0)
    joined = run(
        engine, greedy(n=2, stop=("\u2603\u2603", stop), include_stop_str_in_output=include)
    )
    for i in (0, 1):
        assert joined.text[i] == free[:cut]
        assert joined.finish[i] == ("stop", stop)


@pytest.mark.parametrize("include", [False, True], ids=["cut", "included"])
def test_stop_token_ids_end_the_text(tiny, engine: LLMEngine, include: bool) -> None:
    """A stop token id: its token is the last one handed out; its text only when included."""
    tokenizer = tiny[2]
    free = run(engine, greedy()).token_ids[0]
    # A token seen first at `position`, with whole characters before and after it.
    position = next(
        p
        for p in range(3, len(free))
        if free[p] not in free[:p]
        and not tokenizer.decode(free[:p]).endswith("\ufffd")
        and not tokenizer.decode(free[: p + 1]).endswith("\ufffd")
    )
    stop_id = free[position]
    joined = run(
        engine,
        greedy(stop=("zzzz",), stop_token_ids=(stop_id,), include_stop_str_in_output=include),
    )
    assert joined.token_ids[0] == free[: position + 1]
    assert joined.text[0] == tokenizer.decode(free[: position + 1 if include else position])
    assert joined.finish[0] == ("stop", stop_id)


def test_the_accumulator_rebuilds_the_whole_output(engine: LLMEngine) -> None:
    """OutputAccumulator (what LLM.generate and non-streamed answers use) equals the deltas
    joined by hand, and takes the prompt from the first delta and usage from the last."""
    joined = run(engine, greedy(12, n=2, logprobs=1, prompt_logprobs=1, stop=("q",)))
    accumulator = OutputAccumulator()
    for output in joined.outputs:
        accumulator.add(output)
    whole = accumulator.output()
    assert whole.finished and whole.prompt_token_ids == PROMPT
    assert whole.prompt_logprobs is not None and len(whole.prompt_logprobs) == len(PROMPT)
    assert whole.usage == joined.outputs[-1].usage
    assert [c.index for c in whole.outputs] == [0, 1]
    for choice in whole.outputs:
        assert choice.text == joined.text[choice.index]
        assert choice.token_ids == joined.token_ids[choice.index]
        assert choice.logprobs == joined.logprobs[choice.index]
        assert (choice.finish_reason, choice.stop_reason) == joined.finish[choice.index]


LONG = 2000


@pytest.fixture(scope="module")
def long_engine(tiny) -> LLMEngine:
    """One sequence of up to 2,048 tokens, compiled on demand (two buckets are used)."""
    cfg, params, tokenizer = tiny
    return LLMEngine(
        cfg,
        params,
        tokenizer,
        cache_config=CacheConfig(page_size=16, num_pages=130),
        scheduler_config=SchedulerConfig(
            max_num_seqs=1, max_num_batched_tokens=16, max_model_len=2048
        ),
        warm_up=False,
    )


def test_a_long_answer_is_handed_out_once(tiny, long_engine: LLMEngine) -> None:
    """A 2,000-token streamed answer, through the asyncio front and the HTTP layer's delta
    function: the characters and tokens that cross from the engine to the server, and from
    there to the response, add up to the answer's length (linear), not to the sum of its
    prefixes (quadratic: every step handing out everything so far)."""
    tokenizer = tiny[2]
    params = greedy(LONG, stop=(" \x00\x01 ",))  # a stop string that never comes: held back

    async def stream() -> tuple[int, int, int, list[int]]:
        front = AsyncEngine(long_engine)
        handed, sent, ids = 0, 0, []
        outputs = front.generate("long", PROMPT, params)

        async def counted():
            nonlocal handed
            async for output in outputs:
                handed += sum(len(c.text) + len(c.token_ids) for c in output.outputs)
                yield output

        async for delta, _ in deltas(merge([counted()]), n=1):
            sent += len(delta.text)
            ids += delta.token_ids
        front.shutdown(timeout=5)
        return handed, sent, len(ids), ids

    handed, sent, num_ids, ids = asyncio.run(stream())
    text = tokenizer.decode(ids)
    assert num_ids == LONG and len(text) >= LONG // 4  # at most 4 bytes a character
    assert sent == len(text)
    assert handed == len(text) + LONG  # each character and token once


@pytest.fixture
def interval(engine: LLMEngine):
    """Sets the engine's stream interval for the test's requests, then puts it back."""

    def set_to(k: int) -> None:
        engine.stream_interval = k

    yield set_to
    engine.stream_interval = 1


@pytest.mark.parametrize(
    "params",
    [
        greedy(30),  # the fast path
        greedy(13, n=2, logprobs=1),  # the general path, choices together
        SamplingParams(n=2, seed=3, max_tokens=21, ignore_eos=True, stop=("q",)),  # holdback
    ],
    ids=["plain", "n2-logprobs", "seeded-stop"],
)
@pytest.mark.parametrize("k", [3, 4])
def test_a_stream_interval_gathers_tokens_into_fewer_deltas(
    engine: LLMEngine, interval, params: SamplingParams, k: int
) -> None:
    """With stream_interval k a choice's first token comes alone, then its tokens k at a time,
    then the rest with its finish; joined, the deltas equal a run that hands out every token
    (text, tokens, logprobs, finish), and the prompt and usage still come once each."""
    want = run(engine, params)
    interval(k)
    got = run(engine, params)
    assert (got.text, got.token_ids, got.finish) == (want.text, want.token_ids, want.finish)
    assert got.logprobs == want.logprobs
    assert got.outputs[0].prompt_token_ids == PROMPT
    assert all(o.prompt_token_ids is None for o in got.outputs[1:])
    assert [o.usage is not None for o in got.outputs] == [False] * (len(got.outputs) - 1) + [True]
    for index, ids in want.token_ids.items():
        sizes = [len(c.token_ids) for o in got.outputs for c in o.outputs if c.index == index]
        first, *middle, last = sizes
        assert first == 1 and middle == [k] * len(middle) and 1 <= last <= k, sizes
        assert sum(sizes) == len(ids)
    assert len(got.outputs) < len(want.outputs)
