"""Speculative decoding in the engine (engine/speculative/) on the tiny random Llama, against
the shared plain engine as the oracle: greedy output token for token (k = 1, 3, 5; chunked
prefill, prefix caching, preemption, n > 1, logprobs, structured output, stop strings and
max_tokens inside an accepted run), seeded sampling independent of the batch, every page free at
the end and no
compilation after warm-up. The n-gram proposer against a brute-force search."""

from __future__ import annotations

import dataclasses
import json
import random
import re

import jsonschema
import numpy as np
import pytest
from llguidance import LLMatcher
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

from engine.builder import build_engine
from engine.config import (
    CacheConfig,
    CompilationConfig,
    EngineConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from engine.errors import XlaserveError
from engine.llm_engine import LLMEngine, run_to_completion
from engine.request import SamplingParams
from engine.sampling import bitmask_words
from engine.speculative import grammar, ngram
from engine.speculative.draft import NgramProposer, Proposals
from engine.speculative.engine import SpeculativeEngine
from engine.speculative.grammar import fill_along
from engine.structured.compiler import ll_tokenizer
from engine.structured.spec import StructuredOutputs
from serving import cli
from serving.openai.metrics import ServerMetrics
from tests.conftest import PAGE
from tests.engine.tiny_model import EOS_ID, VOCAB_SIZE, write_tiny_checkpoint


def brute_force_propose(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Longest n first; for each n the latest earlier occurrence followed by a token."""
    for n in range(max_n, min_n - 1, -1):
        if n >= len(tokens):
            continue
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


def test_ngram_proposals_match_a_brute_force_search():
    rng = np.random.default_rng(0)
    for _ in range(300):
        length = int(rng.integers(1, 40))
        tokens = rng.integers(0, 3, length).astype(np.int32)
        min_n = int(rng.integers(1, 4))
        max_n = min_n + int(rng.integers(0, 3))
        k = int(rng.integers(1, 6))
        got = ngram.propose(tokens, min_n=min_n, max_n=max_n, k=k).tolist()
        assert got == brute_force_propose(tokens.tolist(), min_n, max_n, k), (tokens, min_n, max_n)


def spec_engine(tiny, k: int, *, warm_up: bool, seqs: int, tokens: int, pages: int):
    cfg, params, tokenizer = tiny
    return SpeculativeEngine(
        cfg,
        params,
        tokenizer,
        speculative=SpeculativeConfig(
            "ngram", k, prompt_lookup_min=1, prompt_lookup_max=3, disable_by_batch_size=seqs
        ),
        cache_config=CacheConfig(page_size=PAGE, num_pages=pages),
        scheduler_config=SchedulerConfig(
            max_num_seqs=seqs, max_num_batched_tokens=tokens, max_model_len=96
        ),
        warm_up=warm_up,
    )


@pytest.fixture(scope="module")
def spec3(tiny):
    """k = 3, compiled ahead; 16 pages of 4 tokens, so that two long requests preempt."""
    return spec_engine(tiny, 3, warm_up=True, seqs=2, tokens=8, pages=16)


def prompts(seed: int, count: int) -> list[list[int]]:
    """Repetitive prompts of 31 tokens (a short pattern repeated), so n-gram lookup finds
    proposals; longer than a step's token budget (chunked prefill)."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        pattern = [rng.randrange(VOCAB_SIZE) for _ in range(rng.randrange(2, 6))]
        out.append([*(pattern * 15)[:30], rng.randrange(VOCAB_SIZE)])
    return out


def run(engine, prompts_: list[list[int]], params: list[SamplingParams]):
    ids = [f"r{i}-{random.random()}" for i in range(len(prompts_))]
    for request_id, prompt, p in zip(ids, prompts_, params, strict=True):
        engine.add_request(request_id, prompt, p)
    return run_to_completion(engine, ids)


def assert_idle(engine) -> None:
    assert not engine.has_unfinished_requests()
    engine.kv_cache.check_invariants()
    assert engine.kv_cache.num_free_pages == engine.kv_cache.num_pages


def greedy_mix(count: int) -> list[SamplingParams]:
    """Greedy requests whose max_tokens vary, so that many end inside an accepted run."""
    return [SamplingParams(temperature=0, max_tokens=9 + 5 * (i % 4)) for i in range(count)]


def test_greedy_equals_plain_greedy_and_compiles_nothing(spec3, engine: LLMEngine):
    batch = prompts(1, 10)
    params = greedy_mix(len(batch))
    want = run(engine, batch, params)
    before = spec3.stats()
    got = run(spec3, batch, params)
    for g, w in zip(got, want, strict=True):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert g.outputs[0].finish_reason == w.outputs[0].finish_reason
    stats = spec3.stats()
    assert stats.spec_decode_num_accepted_tokens > before.spec_decode_num_accepted_tokens
    assert stats.num_preemptions > before.num_preemptions  # 16 pages for 2 long requests
    assert stats.compilations_after_warm_up == 0
    assert stats.prefix_cache_hits > 0  # the repeated prompts' pages
    assert_idle(spec3)


@pytest.mark.parametrize("k", [1, 5])
def test_greedy_equals_plain_greedy_for_other_k(tiny, engine: LLMEngine, k: int):
    spec = spec_engine(tiny, k, warm_up=False, seqs=1, tokens=8, pages=64)
    batch = prompts(3, 4)  # the tiny model copies some of these (accepted proposals)
    params = greedy_mix(len(batch))
    want = run(engine, batch, params)
    got = run(spec, batch, params)
    assert [g.outputs[0].token_ids for g in got] == [w.outputs[0].token_ids for w in want]
    assert spec.stats().spec_decode_num_accepted_tokens > 0
    assert_idle(spec)


def test_stop_strings_n_and_logprobs_inside_accepted_runs(spec3, engine: LLMEngine):
    """Stop at a string the plain output contains mid-way; two greedy choices with logprobs."""
    batch = prompts(7, 3)
    plain = run(engine, batch, [SamplingParams(temperature=0, max_tokens=24)] * 3)
    params = []
    for out in plain:
        text = out.outputs[0].text
        stop = text[len(text) // 2 : len(text) // 2 + 2] if len(text) > 4 else ()
        params.append(SamplingParams(temperature=0, max_tokens=24, stop=stop, n=2, logprobs=2))
    want = run(engine, batch, params)
    got = run(spec3, batch, params)
    for g, w in zip(got, want, strict=True):
        for gc, wc in zip(g.outputs, w.outputs, strict=True):
            assert (gc.text, gc.token_ids, gc.finish_reason) == (
                wc.text,
                wc.token_ids,
                wc.finish_reason,
            )
            for ge, we in zip(gc.logprobs, wc.logprobs, strict=True):
                assert ge.keys() == we.keys()
                np.testing.assert_allclose(list(ge.values()), list(we.values()), atol=1e-4)
    assert_idle(spec3)


def test_seeded_sampling_is_independent_of_the_batch(spec3):
    batch = prompts(9, 4)
    params = [
        SamplingParams(temperature=0.8, top_k=20, seed=100 + i, max_tokens=16) for i in range(4)
    ]
    together = run(spec3, batch, params)
    alone = [run(spec3, [p], [sp])[0] for p, sp in zip(batch[:2], params[:2], strict=True)]
    for a, t in zip(alone, together[:2], strict=True):
        assert a.outputs[0].token_ids == t.outputs[0].token_ids
    assert_idle(spec3)


SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2]}},
    "required": ["ok", "n"],
    "additionalProperties": False,
}
REGEX = "[a-c]{3}-[0-9]{2}"
CHOICES = ("alpha", "beta", "gamma")


def constrained_batch(tokenizer) -> tuple[list[list[int]], list[SamplingParams]]:
    """A JSON schema, a regex and a choice whose prompts quote answers of theirs (n-gram lookup
    proposes from them; the grammar cuts what it rejects), beside two free requests."""
    texts = ['{"ok":true,"n":2} {"ok":', "abc-12 cab-21 ab", "beta gamma alpha be"]
    specs = [
        StructuredOutputs.from_schema(SCHEMA),
        StructuredOutputs(regex=REGEX),
        StructuredOutputs(choice=CHOICES),
    ]
    batch = [tokenizer.encode(t, add_special_tokens=False) for t in texts] + prompts(5, 2)
    params = [SamplingParams(temperature=0, max_tokens=24, structured_outputs=s) for s in specs]
    return batch, params + [SamplingParams(temperature=0, max_tokens=12)] * 2


def assert_constrained(outputs) -> None:
    """The constrained outputs (the first three) parse and follow their constraints."""
    texts = [o.outputs[0].text for o in outputs[:3]]
    jsonschema.validate(json.loads(texts[0]), SCHEMA)
    assert re.fullmatch(REGEX, texts[1]), texts[1]
    assert texts[2] in CHOICES, texts[2]


def test_masks_along_a_proposal_equal_fresh_matchers(tiny):
    """valid_prefix and fill_along against matchers of their own fed each prefix: the valid
    prefix is the longest one a fresh matcher consumes, row j is the mask after j proposals
    (up to the proposal that ends the grammar), and the matcher is left where it was."""
    cfg, _, tokenizer = tiny
    spec = StructuredOutputs(choice=("ab", "abc", "bcd"))
    llt = ll_tokenizer(tokenizer, cfg.vocab_size)

    def fresh(tokens: list[int]) -> LLMatcher:
        matcher = LLMatcher(llt, spec.to_grammar(), log_level=0)
        assert matcher.consume_tokens(tokens)
        return matcher

    def mask_of(matcher: LLMatcher) -> np.ndarray:
        mask = allocate_token_bitmask(1, cfg.vocab_size)
        fill_next_token_bitmask(matcher, mask)
        return mask[0]

    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    cases = [("", "abc"), ("", "ab"), ("", "abx"), ("", "bcdd"), ("a", "bc"), ("", "x")]
    for before, text in cases:
        for drafts in (encode(text), [*encode(text), EOS_ID]):
            matcher = fresh(encode(before))
            start_mask = mask_of(matcher)
            longest = max(
                m for m in range(len(drafts) + 1) if _consumes(fresh(encode(before)), drafts[:m])
            )
            kept = grammar.valid_prefix(matcher, drafts)
            assert kept == drafts[:longest], (before, drafts)
            rows = np.full((len(drafts) + 1, bitmask_words(cfg.vocab_size)), -1, np.int32)
            fill_along(matcher, kept, rows)
            for j in range(len(kept) + 1):
                oracle = fresh(encode(before) + kept[:j])
                if oracle.is_stopped():  # proposal j - 1 ends the grammar: nothing follows it
                    break
                np.testing.assert_array_equal(rows[j], mask_of(oracle), err_msg=f"{drafts} {j}")
            np.testing.assert_array_equal(mask_of(matcher), start_mask)  # rolled back
            assert grammar.valid_prefix(matcher, drafts) == kept


def _consumes(matcher: LLMatcher, tokens: list[int]) -> bool:
    return all(matcher.consume_token(t) and not matcher.is_error() for t in tokens)


def test_structured_output_speculates_within_its_grammar(spec3, engine, tiny, monkeypatch):
    """Constrained greedy requests (JSON schema, regex, choice) in the same verification steps
    as free ones give the plain engine's tokens, and their proposals were verified (a mask per
    position): the grammar's masks apply at every verified position, not only the first."""
    verified: list[int] = []  # proposals of constrained rows, as masked

    def spy(matcher, drafts, bitmask):
        verified.append(len(drafts))
        return fill_along(matcher, drafts, bitmask)

    monkeypatch.setattr(grammar, "fill_along", spy)
    batch, params = constrained_batch(tiny[2])
    want = run(engine, batch, params)
    compilations = spec3.stats().compilations_after_warm_up  # the process's: other engines'
    got = run(spec3, batch, params)
    for g, w in zip(got, want, strict=True):
        assert (g.outputs[0].token_ids, g.outputs[0].finish_reason) == (
            w.outputs[0].token_ids,
            w.outputs[0].finish_reason,
        )
    assert_constrained(got)
    assert sum(verified) > 0
    assert spec3.stats().compilations_after_warm_up == compilations
    assert_idle(spec3)
    assert all(spec3.grammars.get(r.request_id) is None for r in got)


class StepRecorder:
    """An engine whose steps record (tokens proposed, tokens accepted) each."""

    def __init__(self, engine: SpeculativeEngine):
        self.engine = engine
        self.history: list[tuple[int, int]] = []

    def add_request(self, *args) -> None:
        self.engine.add_request(*args)

    def has_unfinished_requests(self) -> bool:
        return self.engine.has_unfinished_requests()

    def step(self):
        before = self.engine.stats()
        outputs = self.engine.step()
        after = self.engine.stats()
        self.history.append(
            (
                after.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens,
                after.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens,
            )
        )
        return outputs


class WrongProposer(NgramProposer):
    """Proposes token 0 as far as each sequence may: rejected wherever the model does not
    emit 0 (the tiny model's greedy output here never does)."""

    def propose(self, out, rooms, kv) -> Proposals:
        return Proposals([[0] * room for room in rooms])


@pytest.mark.parametrize("reprobe", [None, 3])
def test_low_acceptance_turns_speculation_off_then_reprobes(spec3, engine, monkeypatch, reprobe):
    """A request whose proposals are all rejected stops speculating once its window is full
    (window 1): for good with acceptance_reprobe_steps None, else it sits out exactly that many
    steps and proposes again; the output is the plain engine's either way."""
    config = dataclasses.replace(
        spec3.speculative, acceptance_window=1, acceptance_reprobe_steps=reprobe
    )
    monkeypatch.setattr(spec3, "speculative", config)
    monkeypatch.setattr(spec3, "proposer", WrongProposer(config))
    batch, params = prompts(2, 1), [SamplingParams(temperature=0, max_tokens=24)]
    want = run(engine, batch, params)
    assert 0 not in want[0].outputs[0].token_ids
    recorder = StepRecorder(spec3)
    got = run(recorder, batch, params)
    assert got[0].outputs[0].token_ids == want[0].outputs[0].token_ids
    proposing = [i for i, (proposed, _) in enumerate(recorder.history) if proposed]
    assert sum(accepted for _, accepted in recorder.history) == 0
    if reprobe is None:
        assert len(proposing) == 1
    else:
        assert len(proposing) >= 3
        assert np.diff(proposing).tolist() == [reprobe + 1] * (len(proposing) - 1)
    assert_idle(spec3)


def test_abort_mid_run_frees_every_page(spec3):
    spec3.add_request("abort-me", prompts(11, 1)[0], SamplingParams(temperature=0, max_tokens=20))
    for _ in range(4):
        spec3.step()
    spec3.abort_request("abort-me")
    assert_idle(spec3)


def test_metrics_use_vllm_names(spec3):
    text = ServerMetrics(lambda: spec3, "tiny").render().decode()
    for name in (
        "spec_decode_num_drafts",
        "spec_decode_num_draft_tokens",
        "spec_decode_num_accepted_tokens",
        "spec_decode_num_accepted_tokens_per_pos",
    ):
        assert f"xlaserve:{name}" in text
    assert 'position="2"' in text


def test_speculative_config_parses_vllm_json():
    config = SpeculativeConfig.from_json(
        '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}'
    )
    assert (config.num_speculative_tokens, config.prompt_lookup_max) == (4, 3)
    with pytest.raises(ValueError, match="unknown"):
        SpeculativeConfig.from_json('{"method": "ngram", "num_speculative_tokens": 2, "x": 1}')
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        SpeculativeConfig("ngram", 2, prompt_lookup_min=4, prompt_lookup_max=3)
    flag = ["serve", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}']
    assert cli.serve_config(cli._parser().parse_args(flag)).speculative == SpeculativeConfig(
        "ngram", 2
    )
    with pytest.raises(XlaserveError, match="not valid JSON"):
        cli.serve_config(cli._parser().parse_args(["serve", "--speculative-config", "{"]))


# ---- draft_model --------------------------------------------------------------------------


def test_a_draft_equal_to_the_target_gives_the_plain_seeded_tokens(tiny, engine: LLMEngine):
    """The target as its own draft: proposals are drawn with the plain sampler's keys, so
    every one is accepted and seeded sampling gives exactly the plain engine's tokens."""
    cfg, params, tokenizer = tiny
    spec = SpeculativeEngine(
        cfg,
        params,
        tokenizer,
        speculative=SpeculativeConfig("draft_model", 3, model="itself"),
        draft=(cfg, params),
        cache_config=CacheConfig(page_size=PAGE, num_pages=64),
        scheduler_config=SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=8),
        warm_up=False,
    )
    batch = prompts(13, 3)
    params_ = [
        SamplingParams(temperature=0.9, top_k=40, seed=7 + i, max_tokens=14) for i in range(3)
    ]
    want = run(engine, batch, params_)
    got = run(spec, batch, params_)
    assert [g.outputs[0].token_ids for g in got] == [w.outputs[0].token_ids for w in want]
    stats = spec.stats()
    assert stats.spec_decode_num_draft_tokens > 0
    assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens
    assert_idle(spec)


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    """A 1-layer random draft with the tiny model's tokenizer."""
    return write_tiny_checkpoint(tmp_path_factory.mktemp("draft"), num_hidden_layers=1)


@pytest.mark.parametrize("k", [1, 3, 5])
def test_draft_model_greedy_equals_plain_greedy(
    tiny, tiny_dir, draft_dir, engine: LLMEngine, k: int
):
    """Built from an EngineConfig as a server builds it (compiled lazily)."""
    spec = build_engine(
        EngineConfig(
            str(tiny_dir),
            cache=CacheConfig(page_size=PAGE, num_pages=64),
            scheduler=SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=8, max_model_len=96),
            compilation=CompilationConfig(warm_up="lazy"),
            speculative=SpeculativeConfig("draft_model", k, model=str(draft_dir)),
        )
    )
    assert isinstance(spec, SpeculativeEngine)
    batch = prompts(20 + k, 3)
    params = greedy_mix(len(batch))
    if k == 3:  # constrained requests too: the draft's proposals cut where the grammar rejects
        constrained, constraints = constrained_batch(tiny[2])
        batch, params = constrained[:3] + batch, constraints[:3] + params
    want = run(engine, batch, params)
    got = run(spec, batch, params)
    assert [g.outputs[0].token_ids for g in got] == [w.outputs[0].token_ids for w in want]
    if k == 3:
        assert_constrained(got)
    assert spec.stats().spec_decode_num_draft_tokens > 0
    assert_idle(spec)
    spec.close()


def test_a_stream_interval_gathers_accepted_runs(spec3, engine: LLMEngine):
    """stream_interval 4 with speculation, whose steps add up to k + 1 tokens: after the
    first token, a choice's deltas hold at least 4 tokens each but the last, and they join to
    the plain engine's answer."""
    batch = prompts(11, 2)
    params = [SamplingParams(temperature=0, max_tokens=30, n=2, logprobs=1)] * 2
    want = run(engine, batch, params)
    spec3.stream_interval = 4
    try:
        ids = [f"interval{i}-{random.random()}" for i in range(len(batch))]
        for request_id, prompt, p in zip(ids, batch, params, strict=True):
            spec3.add_request(request_id, prompt, p)
        deltas: dict[str, list] = {request_id: [] for request_id in ids}
        while spec3.has_unfinished_requests():
            for output in spec3.step():
                deltas[output.request_id].append(output)
    finally:
        spec3.stream_interval = 1
    for request_id, whole in zip(ids, want, strict=True):
        for choice in whole.outputs:
            mine = [c for o in deltas[request_id] for c in o.outputs if c.index == choice.index]
            assert [t for c in mine for t in c.token_ids] == choice.token_ids
            assert "".join(c.text for c in mine) == choice.text
            first, *middle, last = [len(c.token_ids) for c in mine]
            assert first == 1 and all(size >= 4 for size in middle), (first, middle, last)
            assert last >= 1 and mine[-1].finish_reason == choice.finish_reason
    assert_idle(spec3)
