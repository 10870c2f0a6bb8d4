"""Structured output in the engine, on the tiny random Llama: token bytes against each
tokenizer's own encoding, the device bitmask against llguidance's NumPy one, a batch mixing
constrained and free requests against a host-side constrained greedy oracle (the naive model,
masked by llguidance's own matcher and NumPy helpers) and the unconstrained naive oracle,
with no compilation after warm-up; bad grammars refused for that request only."""

from __future__ import annotations

import json
import random
import re
import time
from typing import Any

import jax
import jsonschema
import numpy as np
import pytest
from llguidance import LLMatcher
from llguidance.numpy import (
    allocate_token_bitmask,
    apply_token_bitmask_inplace,
    fill_next_token_bitmask,
)

from engine import naive
from engine.config import StructuredOutputConfig
from engine.errors import InvalidRequestError
from engine.kv_cache import KVCacheManager
from engine.llm_engine import LLMEngine, run_to_completion
from engine.request import SamplingParams
from engine.sampling import apply_token_bitmask, bitmask_words
from engine.scheduler import Scheduler
from engine.structured.compiler import GrammarCompiler, ll_tokenizer
from engine.structured.spec import StructuredOutputs
from engine.tokenizer import Tokenizer, load_tokenizer
from engine.weights import resolve_model
from tests.conftest import PAGE
from tests.engine.tiny_model import EOS_ID

# Bounded schemas (every string, number and array has a limit), so a random model finishes
# each within MAX_TOKENS byte tokens.
SCHEMAS: list[dict] = [
    {"type": "boolean"},
    {"enum": ["red", "green", "blue"]},
    {"type": "integer", "minimum": 0, "maximum": 99},
    {"type": "string", "maxLength": 4},
    {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
    {"const": "fixed"},
    {"type": "string", "pattern": "^[a-c]{2,3}$"},
    {"type": "null"},
    {"enum": [1, 2, 3, "x"]},
    {"type": "integer", "minimum": -5, "maximum": 5},
    {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 1, "maxItems": 2},
    {"type": "string", "format": "date", "pattern": "^2026-0[1-9]-1[0-9]$"},
    {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"n": {"enum": [1, 2]}, "s": {"type": "string", "maxLength": 2}},
        "required": ["n"],
        "additionalProperties": False,
    },
    {
        "$defs": {"flag": {"type": "boolean"}},
        "type": "object",
        "properties": {"a": {"$ref": "#/$defs/flag"}, "b": {"$ref": "#/$defs/flag"}},
        "required": ["a", "b"],
        "additionalProperties": False,
    },
    {"anyOf": [{"type": "boolean"}, {"enum": ["yes", "no"]}]},
]
MAX_TOKENS = 40


def greedy(spec: StructuredOutputs | None = None, max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, structured_outputs=spec)


def generate(engine: LLMEngine, prompts: list[list[int]], params: list[SamplingParams]):
    ids = [f"s-{i}-{random.random()}" for i in range(len(prompts))]
    for request_id, prompt, p in zip(ids, prompts, params, strict=True):
        engine.add_request(request_id, prompt, p)
    return run_to_completion(engine, ids)


def constrained_oracle(tiny, prompt: list[int], spec: StructuredOutputs, max_tokens: int):
    """Greedy decoding by the naive model, its logits masked on the host by a matcher of
    llguidance's own (NumPy helpers), until EOS, the grammar's end or max_tokens."""
    cfg, params, tokenizer = tiny
    matcher = LLMatcher(ll_tokenizer(tokenizer, cfg.vocab_size), spec.to_grammar(), log_level=0)
    mask = allocate_token_bitmask(1, cfg.vocab_size)

    def constrain(logits: np.ndarray) -> np.ndarray:
        fill_next_token_bitmask(matcher, mask)
        masked = np.array(logits, np.float32)[None]
        apply_token_bitmask_inplace(masked, mask)
        return masked[0]

    tokens = []
    sampling = naive.NaiveSampling(max_tokens=max_tokens)
    for token in naive.generate(params, cfg, prompt, sampling, logits_processor=constrain):
        tokens.append(token)
        assert matcher.consume_token(token)
        if token == EOS_ID or matcher.is_stopped():
            break
    return tokens


def free_oracle(tiny, prompt: list[int], max_tokens: int) -> list[int]:
    cfg, params, _ = tiny
    sampling = naive.NaiveSampling(max_tokens=max_tokens)
    return list(naive.generate(params, cfg, prompt, sampling, stop_ids=[EOS_ID]))


# ---- token bytes ---------------------------------------------------------------------------


TEXTS = ["Hello, world!", " leading space\tand tab\n", "naïve café — 東京 🎉", '{"a": [1, 2]}']


@pytest.fixture(scope="module")
def real_tokenizers() -> dict[str, Tokenizer]:
    return {
        name: load_tokenizer(resolve_model(name).path) for name in ("smollm2-135m", "gemma3-270m")
    }


@pytest.mark.parametrize("name", ["smollm2-135m", "gemma3-270m", "tiny"])
def test_token_bytes_spell_what_the_tokenizer_encodes(name, real_tokenizers, tiny) -> None:
    """The bytes of the ids a text encodes to are the text's UTF-8 (SentencePiece's leading
    dummy-prefix space aside): byte-level BPE (SmolLM2), SentencePiece with byte fallback
    (Gemma 3 GGUF) and the tiny byte tokenizer."""
    tokenizer = tiny[2] if name == "tiny" else real_tokenizers[name]
    spelled = tokenizer.token_bytes()
    assert len(spelled) == tokenizer.vocab_size
    for text in TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        joined = b"".join(spelled[i] for i in ids)
        assert joined in (text.encode(), b" " + text.encode()), (text, joined)
    eos = tokenizer.eos_token_ids[0]
    assert spelled[eos] == tokenizer.convert_ids_to_tokens([eos])[0].encode()


# ---- the device bitmask ----------------------------------------------------------------------


def test_device_bitmask_equals_llguidance_numpy() -> None:
    """apply_token_bitmask (jitted) masks exactly what llguidance's NumPy helper masks,
    bits past the vocabulary ignored."""
    rng = np.random.default_rng(0)
    vocab = 70  # 3 words, the last one partly past the vocabulary
    logits = rng.normal(size=(5, vocab)).astype(np.float32)
    mask = rng.integers(-(2**31), 2**31, size=(5, bitmask_words(vocab)), dtype=np.int64)
    mask = mask.astype(np.int32)
    mask[0] = -1  # a free row
    expected = logits.copy()
    apply_token_bitmask_inplace(expected, mask)
    got = np.asarray(jax.jit(apply_token_bitmask)(logits, mask))
    np.testing.assert_array_equal(got, expected)


# ---- the engine ------------------------------------------------------------------------------


def test_batch_mixing_constrained_and_free_rows(engine: LLMEngine, tiny) -> None:
    """32 requests at once, half constrained by 16 different schemas: each constrained one
    gets the host-masked naive oracle's tokens and validates, each free one the naive
    unconstrained greedy tokens; nothing compiles after warm-up."""
    rng = random.Random(21)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(2, 12))] for _ in range(32)]
    specs = [StructuredOutputs.from_schema(s) for s in SCHEMAS]
    params = [greedy(specs[i // 2] if i % 2 == 0 else None) for i in range(32)]
    for spec in specs:  # compiled off the engine loop, as a server does
        engine.compile_grammar(spec).result()
    compilations = engine.stats().compilations_after_warm_up
    outputs = generate(engine, prompts, params)
    assert engine.stats().compilations_after_warm_up == compilations  # none during the batch
    for i, (prompt, output) in enumerate(zip(prompts, outputs, strict=True)):
        choice = output.outputs[0]
        if i % 2:
            assert choice.token_ids == free_oracle(tiny, prompt, MAX_TOKENS), i
            continue
        schema = SCHEMAS[i // 2]
        assert choice.token_ids == constrained_oracle(tiny, prompt, specs[i // 2], MAX_TOKENS)
        assert choice.finish_reason == "stop", (schema, choice.text)
        jsonschema.validate(json.loads(choice.text), schema)


def test_regex_choice_and_grammar_constrain_the_output(engine: LLMEngine, tiny) -> None:
    words = ("alpha", "beta", "gamma")
    sums = 'start: "(" NUM ("+" NUM)* ")"\nNUM: /[1-9]/'
    cases = [
        (StructuredOutputs(regex=r"[0-9]{3}-[a-z]{2}"), lambda t: re.fullmatch(r"\d{3}-\w\w", t)),
        (StructuredOutputs(choice=words), lambda t: t in words),
        (StructuredOutputs(grammar=sums), lambda t: re.fullmatch(r"\([1-9](\+[1-9])*\)", t)),
        (StructuredOutputs(json_object=True), lambda t: isinstance(json.loads(t), dict)),
    ]
    prompts = [[65 + i, 66, 67] for i in range(len(cases))]
    outputs = generate(engine, prompts, [greedy(spec, 24) for spec, _ in cases])
    for (spec, check), prompt, output in zip(cases, prompts, outputs, strict=True):
        choice = output.outputs[0]
        assert choice.token_ids == constrained_oracle(tiny, prompt, spec, 24), spec
        if choice.finish_reason == "stop":
            assert check(choice.text), (spec, choice.text)


def test_n_choices_each_follow_the_grammar(engine: LLMEngine) -> None:
    spec = StructuredOutputs(choice=("yes", "no", "maybe"))
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=8, structured_outputs=spec)
    (output,) = generate(engine, [[70, 71]], [params])
    assert [c.text in ("yes", "no", "maybe") for c in output.outputs] == [True] * 3


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        (
            StructuredOutputs(json='{"type": "object", "properties": {"a": {"type": "nope"}}}'),
            "json",
        ),
        (StructuredOutputs(json="{not json"), "not valid JSON"),
        (StructuredOutputs(regex="[a-z"), "regular expression"),
        (StructuredOutputs(regex=r"[a&&b]"), "matches no output"),
        (StructuredOutputs(grammar="start: undefined_rule"), "grammar"),
    ],
)
def test_bad_grammar_refuses_that_request_only(engine: LLMEngine, tiny, spec, words) -> None:
    """The bad request is refused with a message naming the problem; a free request added
    around it finishes with the oracle's tokens."""
    engine.add_request("free-before", [1, 2, 3], greedy(max_tokens=6))
    with pytest.raises(InvalidRequestError, match=re.escape(words)) as refused:
        engine.add_request("bad", [4, 5], greedy(spec))
    assert refused.value.param == spec.kind
    outputs = run_to_completion(engine, ["free-before"])
    assert outputs[0].outputs[0].token_ids == free_oracle(tiny, [1, 2, 3], 6)


def test_compile_timeout_fails_the_request_not_the_compiler(tiny, monkeypatch) -> None:
    """A grammar slower to compile than the timeout fails its future with the timeout named;
    the same compiler then compiles a small grammar at once. (The slow grammar is made slow
    on purpose: how long a real one takes depends on the machine.)"""
    cfg, _, tokenizer = tiny
    compiler = GrammarCompiler(
        tokenizer, cfg.vocab_size, StructuredOutputConfig(compile_timeout_s=0.05)
    )
    compiler.compile(StructuredOutputs(regex="a")).result()  # llguidance's tokenizer built
    slow = StructuredOutputs(regex="slow")
    compile_now = compiler._compile

    def slow_compile(spec: StructuredOutputs, ll_tokenizer: Any) -> Any:
        if spec == slow:
            time.sleep(0.5)
        return compile_now(spec, ll_tokenizer)

    monkeypatch.setattr(compiler, "_compile", slow_compile)
    start = time.perf_counter()
    with pytest.raises(InvalidRequestError, match=r"did not compile within 0\.05 s"):
        compiler.compile(slow).result()
    assert time.perf_counter() - start < 0.4
    compiler.compile(StructuredOutputs(choice=("x",))).result(timeout=1.0)
    compiler.close()


# ---- interplay: logprobs, preemption ---------------------------------------------------------


def test_logprobs_of_constrained_requests_are_the_models(engine: LLMEngine, tiny) -> None:
    """A constrained request asking for logprobs, beside a free one: the constrained oracle's
    tokens, and for each token its logprob and the top 3 under the model's own (raw, unmasked)
    distribution, as for a free request: log_softmax of the naive model's logits over the
    prompt and the tokens before it."""
    cfg, params, _ = tiny
    spec = StructuredOutputs.from_schema(SCHEMAS[14])
    prompts = [[33, 34, 35, 36], [50, 51]]
    asks = [
        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, structured_outputs=spec, logprobs=3),
        SamplingParams(temperature=0, max_tokens=6, logprobs=3),
    ]
    outputs = generate(engine, prompts, asks)
    constrained = outputs[0].outputs[0]
    assert constrained.token_ids == constrained_oracle(tiny, prompts[0], spec, MAX_TOKENS)
    jsonschema.validate(json.loads(constrained.text), SCHEMAS[14])
    for prompt, output in zip(prompts, outputs, strict=True):
        choice = output.outputs[0]
        ids = np.asarray([prompt + choice.token_ids])
        logits = np.asarray(naive.sequence_logits(params, ids, cfg=cfg), np.float64)[0]
        shifted = logits - logits.max(-1, keepdims=True)
        logprobs = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
        assert choice.logprobs is not None and len(choice.logprobs) == len(choice.token_ids)
        for j, (token, entry) in enumerate(zip(choice.token_ids, choice.logprobs, strict=True)):
            row = logprobs[len(prompt) - 1 + j]
            top = np.argsort(-row)[:3]
            assert set(entry) == {token, *top.tolist()}, (j, entry)
            for t, lp in entry.items():
                assert abs(lp - row[t]) < 1e-4, (j, t, lp, row[t])


def test_preempted_constrained_requests_resume_in_their_grammar(engine: LLMEngine, tiny) -> None:
    """14 pages (56 token slots) for 8 requests: the free ones (priority 0) push the
    constrained ones (priority 1, the first victims) out of the cache mid-answer; each resumes
    from its tokens with its grammar state kept, and gets the constrained oracle's tokens (the
    request alone) and validates; the free ones get their free oracle's."""
    saved = engine.kv_cache, engine.scheduler
    engine.kv_cache = KVCacheManager(14, PAGE)
    engine.scheduler = Scheduler(engine.scheduler_config, engine.kv_cache)
    try:
        rng = random.Random(5)
        schemas = [SCHEMAS[i] for i in (4, 12, 13, 14)]
        specs = [StructuredOutputs.from_schema(s) for s in schemas]
        prompts = [[rng.randrange(256) for _ in range(rng.randint(6, 10))] for _ in range(8)]
        ids = [f"pre-{i}" for i in range(8)]
        for i, (request_id, prompt) in enumerate(zip(ids, prompts, strict=True)):
            spec = specs[i // 2] if i % 2 else None
            engine.add_request(request_id, prompt, greedy(spec), priority=1 if spec else 0)
        requests = {request_id: engine.scheduler.get(request_id) for request_id in ids}
        mid_answer = set()  # constrained requests preempted after some output
        outputs: dict[str, list[int]] = {}
        texts: dict[str, str] = {}
        while engine.has_unfinished_requests():
            before = {r: (q.num_preemptions, len(q.output_token_ids)) for r, q in requests.items()}
            for output in engine.step():
                outputs.setdefault(output.request_id, []).extend(output.outputs[0].token_ids)
                texts[output.request_id] = texts.get(output.request_id, "") + output.outputs[0].text
            for request_id, (preemptions, produced) in before.items():
                if requests[request_id].num_preemptions > preemptions and produced:
                    mid_answer.add(request_id)
        assert mid_answer & set(ids[1::2]), "no constrained request was preempted mid-answer"
        for i, (request_id, prompt) in enumerate(zip(ids, prompts, strict=True)):
            if i % 2 == 0:
                assert outputs[request_id] == free_oracle(tiny, prompt, MAX_TOKENS), request_id
                continue
            want = constrained_oracle(tiny, prompt, specs[i // 2], MAX_TOKENS)
            assert outputs[request_id] == want, request_id
            jsonschema.validate(json.loads(texts[request_id]), schemas[i // 2])
        engine.kv_cache.check_invariants()
        assert engine.kv_cache.num_free_pages == 14
    finally:
        engine.kv_cache, engine.scheduler = saved


def test_constrained_requests_with_prefix_cache_stop_strings_and_seeds(
    engine: LLMEngine, tiny
) -> None:
    """Grammars beside the other features: a constrained request whose prompt's pages come
    from the prefix cache gets the constrained oracle's tokens again; a stop string inside a
    constrained answer cuts it there; a seeded, sampled constrained request gives the same
    valid answer alone and in a crowded batch."""
    spec = StructuredOutputs.from_schema(SCHEMAS[14])
    prompt = [40 + i for i in range(3 * PAGE + 2)]
    want = constrained_oracle(tiny, prompt, spec, MAX_TOKENS)
    first, again = (generate(engine, [prompt], [greedy(spec)])[0] for _ in range(2))
    assert first.outputs[0].token_ids == again.outputs[0].token_ids == want
    assert again.usage is not None and again.usage.cached_prompt_tokens == 3 * PAGE

    text = first.outputs[0].text
    stop = text[5:7]  # inside the JSON object
    cut = text[: text.index(stop)]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, stop=[stop],
                            structured_outputs=spec)  # fmt: skip
    [stopped] = generate(engine, [prompt], [params])
    assert (stopped.outputs[0].text, stopped.outputs[0].finish_reason) == (cut, "stop")

    pattern = StructuredOutputs(regex="[a-c]{3}-[0-9]{2}")
    seeded = SamplingParams(temperature=1.0, seed=7, max_tokens=MAX_TOKENS,
                            structured_outputs=pattern)  # fmt: skip
    [alone] = generate(engine, [[7, 8, 9]], [seeded])
    others = [list(range(i, i + 5)) for i in range(60, 64)]
    *_, crowded = generate(engine, [*others, [7, 8, 9]], [greedy(spec)] * 4 + [seeded])
    assert crowded.outputs[0].token_ids == alone.outputs[0].token_ids
    assert re.fullmatch(r"[a-c]{3}-[0-9]{2}", alone.outputs[0].text), alone.outputs[0].text


def test_generate_cli_json_schema(tiny_dir, tiny, tmp_path, capsys) -> None:
    """`xlaserve generate --json-schema FILE` prints the constrained oracle's answer, which
    validates; a schema that does not compile is a one-line error."""
    from serving import cli

    _, _, tokenizer = tiny
    schema = SCHEMAS[13]
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(schema))
    argv = ["generate", "--model", str(tiny_dir), "--prompt", "Hi", "--max-tokens", "40",
            "--compilation-cache-dir", "", "--json-schema", str(path)]  # fmt: skip
    assert cli.main(argv) == 0
    spec = StructuredOutputs.from_schema(schema)
    want = constrained_oracle(tiny, tokenizer.encode("Hi"), spec, 40)
    printed = capsys.readouterr().out
    assert printed == tokenizer.decode(want) + "\n"
    jsonschema.validate(json.loads(printed), schema)
    path.write_text('{"type": "nope"}')
    assert cli.main(argv) == 1
    assert "JSON schema" in capsys.readouterr().err
