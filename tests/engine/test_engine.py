"""The engine end to end on a tiny random Llama: paged incremental decode against one full
forward, batched greedy output against the naive oracle run alone, prefix caching, preemption,
seeded sampling and the compilation count."""

from __future__ import annotations

import itertools
import random

import jax
import numpy as np
import pytest

from engine import compilation, naive
from engine.batch import BatchBuilder, BatchShapes
from engine.config import CacheConfig, SchedulerConfig
from engine.kv_cache import KVCacheManager
from engine.llm_engine import LLMEngine, run_to_completion
from engine.request import FinishReason, Request, SamplingParams
from engine.scheduler import Scheduler
from engine.step import StepOptions, forward_logits
from engine.weights import open_checkpoint, resolve_model
from pallas_kernels.kv_cache_update import KVCacheSpec, init_kv_pages
from tests.conftest import PAGE
from tests.engine.tiny_model import VOCAB_SIZE, write_tiny_checkpoint


@pytest.fixture(autouse=True)
def no_leaks(request: pytest.FixtureRequest):
    """After every test that used the engine, every page is free again."""
    yield
    if "engine" in request.fixturenames:
        engine = request.getfixturevalue("engine")
        assert not engine.has_unfinished_requests()
        engine.kv_cache.check_invariants()
        assert engine.kv_cache.num_free_pages == engine.kv_cache.num_pages


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def oracle(tiny, prompt: list[int], max_tokens: int) -> list[int]:
    cfg, params, _ = tiny
    return list(naive.generate(params, cfg, prompt, naive.NaiveSampling(max_tokens=max_tokens)))


def random_prompt(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(VOCAB_SIZE) for _ in range(length)]


def generate(engine: LLMEngine, prompts: list[list[int]], params: list[SamplingParams]):
    ids = [f"req-{i}-{random.random()}" for i in range(len(prompts))]
    for request_id, prompt, p in zip(ids, prompts, params, strict=True):
        engine.add_request(request_id, prompt, p)
    return run_to_completion(engine, ids)


@pytest.fixture(scope="module")
def small_logits_model(tmp_path_factory):
    """The tiny Llama with weights of std 0.1 rather than 0.3: logits of magnitude ~2 rather
    than ~7, so that float32 rounding (a few ulps of the logits, summed in different orders by
    differently shaped matmuls) stays well inside the 1e-5 bound."""
    directory = write_tiny_checkpoint(tmp_path_factory.mktemp("small"), initializer_range=0.1)
    checkpoint = open_checkpoint(resolve_model(str(directory)))
    return checkpoint.cfg, checkpoint.load_params()


def test_incremental_paged_decode_equals_one_full_forward(small_logits_model) -> None:
    """Two requests prefilled in chunks of at most 7 tokens (so chunks straddle pages of 4),
    mixed with each other's decodes; every step's logits must equal the full forward's."""
    cfg, params = small_logits_model
    kv = KVCacheManager(64, PAGE)
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=7, max_model_len=64)
    scheduler = Scheduler(config, kv)
    shapes = BatchShapes.create(
        max_num_batched_tokens=7, max_num_seqs=4, max_model_len=64, page_size=PAGE
    )
    builder = BatchBuilder(shapes, PAGE)
    spec = KVCacheSpec(64, PAGE, cfg.num_kv_heads, cfg.head_dim)
    caches = [init_kv_pages(spec) for _ in range(cfg.num_layers)]
    run = jax.jit(forward_logits, static_argnames="options")
    rng = random.Random(0)
    requests = [
        Request(f"r{i}", random_prompt(rng, n), greedy(6), seed=0) for i, n in enumerate((13, 6))
    ]
    for r in requests:
        scheduler.add_request(r)
    recorded: dict[str, list[tuple[int, np.ndarray]]] = {r.request_id: [] for r in requests}
    while scheduler.has_unfinished():
        out = scheduler.schedule()
        batch = builder.build(out, kv, penalties=False)
        logits, caches = run(params, caches, jax.device_put(batch), options=StepOptions(cfg))
        for i, s in enumerate(out.scheduled):
            position = s.start + s.num_new_tokens - 1
            recorded[s.request.request_id].append((position, np.asarray(logits[i])))
        for r in scheduler.update_after_step(out):
            r.output_token_ids.append(int(np.argmax(recorded[r.request_id][-1][1])))
            if len(r.output_token_ids) == 6:
                scheduler.finish(r, FinishReason.LENGTH)
    for r in requests:
        full = np.asarray(naive.sequence_logits(params, np.asarray([r.all_token_ids]), cfg=cfg))[0]
        positions = [p for p, _ in recorded[r.request_id]]
        assert len(positions) > 6  # several chunks, then the decodes
        for position, step_logits in recorded[r.request_id]:
            np.testing.assert_allclose(step_logits, full[position], atol=1e-5, rtol=0)
        assert np.abs(full).max() > 1.0  # the bound is tight relative to the logits' scale


def test_batched_greedy_equals_each_request_alone(tiny, engine: LLMEngine) -> None:
    rng = random.Random(1)
    prompts = [random_prompt(rng, rng.randint(1, 40)) for _ in range(64)]
    lengths = [rng.randint(1, 12) for _ in range(64)]
    outputs = generate(engine, prompts, [greedy(n) for n in lengths])
    for prompt, n, output in zip(prompts, lengths, outputs, strict=True):
        assert output.outputs[0].token_ids == oracle(tiny, prompt, n)
        assert output.outputs[0].finish_reason == "length"


def test_prefix_cache_skips_shared_pages(tiny, engine: LLMEngine) -> None:
    rng = random.Random(2)
    shared = random_prompt(rng, 3 * PAGE)
    first, second = shared + random_prompt(rng, 5), shared + random_prompt(rng, 7)
    generate(engine, [first], [greedy(4)])
    before = engine.stats().num_computed_prompt_tokens
    [output] = generate(engine, [second], [greedy(4)])
    assert engine.stats().num_computed_prompt_tokens - before == len(second) - 3 * PAGE
    assert output.usage is not None and output.usage.cached_prompt_tokens == 3 * PAGE
    assert output.outputs[0].token_ids == oracle(tiny, second, 4)


def test_preemption_under_a_small_cache_keeps_outputs(tiny, engine: LLMEngine) -> None:
    """14 pages (56 token slots) for 8 requests of up to 6 pages each: requests are preempted
    and recomputed, and every one still gets its unconstrained greedy output."""
    saved = engine.kv_cache, engine.scheduler
    engine.kv_cache = KVCacheManager(14, PAGE)
    engine.scheduler = Scheduler(engine.scheduler_config, engine.kv_cache)
    try:
        rng = random.Random(3)
        prompts = [random_prompt(rng, rng.randint(6, 12)) for _ in range(8)]
        outputs = generate(engine, prompts, [greedy(12)] * 8)
        assert engine.scheduler.num_preemptions > 0
        for prompt, output in zip(prompts, outputs, strict=True):
            assert output.outputs[0].token_ids == oracle(tiny, prompt, 12)
        engine.kv_cache.check_invariants()
        assert engine.kv_cache.num_free_pages == 14
    finally:
        engine.kv_cache, engine.scheduler = saved


def test_a_high_priority_arrival_finishes_first_in_a_full_cache(tiny, engine: LLMEngine) -> None:
    """Two priority-1 requests of 8 + 24 tokens fit 16 pages of 4 at their full length (so they
    never preempt each other), but hold too many for a priority-0 prompt of 32 tokens once they
    are half done. That request preempts the newer of them at once, rather than waiting for one
    to finish, and finishes first; every request, preempted or not, still gets its unconstrained
    greedy output."""
    saved = engine.kv_cache, engine.scheduler
    engine.kv_cache = KVCacheManager(16, PAGE)
    engine.scheduler = Scheduler(engine.scheduler_config, engine.kv_cache)
    try:
        rng = random.Random(9)
        low = {f"low{i}": random_prompt(rng, 8) for i in range(2)}
        for request_id, prompt in low.items():
            engine.add_request(request_id, prompt, greedy(24), priority=1)
        while engine.kv_cache.num_free_pages >= 32 // PAGE:  # until the high one cannot fit
            assert not any(output.finished for output in engine.step())
        high = random_prompt(rng, 32)
        engine.add_request("high", high, greedy(4), priority=0)
        # The scheduler's requests hold each sequence's whole output, whatever step() hands out.
        requests = {request_id: engine.scheduler.get(request_id) for request_id in [*low, "high"]}
        finished_at: dict[str, int] = {}
        for step in itertools.count():
            if not engine.has_unfinished_requests():
                break
            for output in engine.step():
                if output.finished:
                    finished_at[output.request_id] = step
        outputs = {}
        for request_id, request in requests.items():
            assert request is not None
            outputs[request_id] = request.output_token_ids
        assert finished_at["high"] < min(finished_at[request_id] for request_id in low)
        assert engine.scheduler.num_preemptions > 0
        assert outputs["high"] == oracle(tiny, high, 4)
        for request_id, prompt in low.items():
            assert outputs[request_id] == oracle(tiny, prompt, 24)
        assert engine.kv_cache.num_free_pages == 16
    finally:
        engine.kv_cache, engine.scheduler = saved


def test_seeded_sampling_is_independent_of_the_batch(engine: LLMEngine) -> None:
    rng = random.Random(4)
    prompt = random_prompt(rng, 9)
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=10, ignore_eos=True)
    [alone] = generate(engine, [prompt], [params])
    others = [random_prompt(rng, rng.randint(1, 20)) for _ in range(5)]
    other_params = [SamplingParams(temperature=0.7, max_tokens=8, ignore_eos=True)] * 5
    *_, crowded = generate(engine, [*others, prompt], [*other_params, params])
    assert crowded.outputs[0].token_ids == alone.outputs[0].token_ids
    unseeded = [p.replace(seed=None) for p in [params] * 4]
    samples = generate(engine, [prompt] * 4, unseeded)
    assert len({tuple(s.outputs[0].token_ids) for s in samples}) > 1  # seeds differ when unset


def test_n_sequences_share_the_prompt(engine: LLMEngine) -> None:
    rng = random.Random(5)
    prompt = random_prompt(rng, 3 * PAGE + 1)
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=6, ignore_eos=True)
    before = engine.stats().num_computed_prompt_tokens
    [output] = generate(engine, [prompt], [params])
    assert [o.index for o in output.outputs] == [0, 1, 2]
    assert len({tuple(o.token_ids) for o in output.outputs}) > 1
    # The first sequence computes the prompt; the others find its full pages in the cache.
    assert engine.stats().num_computed_prompt_tokens - before < 3 * len(prompt)


def test_no_compilation_after_warm_up(engine: LLMEngine) -> None:
    rng = random.Random(6)
    before = compilation.count()
    pending = []
    for wave in range(10):
        for i in range(20):
            p = SamplingParams(
                temperature=rng.choice([0.0, 0.8]),
                top_k=rng.choice([0, 5]),
                max_tokens=rng.randint(1, 10),
                ignore_eos=rng.random() < 0.5,
                seed=i,
            )
            request_id = f"wave{wave}-{i}"
            engine.add_request(request_id, random_prompt(rng, rng.randint(1, 60)), p)
            pending.append(request_id)
        for _ in range(rng.randint(1, 5)):
            engine.step()
    while engine.has_unfinished_requests():
        engine.step()
    assert compilation.count() == before


def featured(penalties: bool, logprobs: bool, prompt_logprobs: bool) -> SamplingParams:
    """A greedy request that asks for the given features."""
    return SamplingParams(
        temperature=0,
        max_tokens=5,
        ignore_eos=True,
        repetition_penalty=1.5 if penalties else 1.0,
        logprobs=2 if logprobs else None,
        prompt_logprobs=3 if prompt_logprobs else None,
    )


def test_no_compilation_for_any_mix_of_features(tiny, engine: LLMEngine) -> None:
    """Penalties, logprobs and prompt logprobs, each of the 8 combinations in a batch with a
    greedy and a sampled plain request, compile nothing after warm-up; the plain greedy
    request still gives the oracle's tokens and every feature its output."""
    rng = random.Random(8)
    sampled = SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=6, ignore_eos=True)
    before = compilation.count()
    plain_outputs = []
    for features in itertools.product([False, True], repeat=3):
        prompts = [random_prompt(rng, rng.randint(3, 20)) for _ in range(3)]
        plain, special, _ = generate(engine, prompts, [greedy(4), featured(*features), sampled])
        plain_outputs.append((prompts[0], plain.outputs[0].token_ids))
        logprobs = special.outputs[0].logprobs
        assert (logprobs is not None and len(logprobs) == 5) == features[1]
        prompt_logprobs = special.prompt_logprobs
        assert (prompt_logprobs is not None and len(prompt_logprobs) == len(prompts[1])) == (
            features[2]
        )
    assert compilation.count() == before
    for prompt, tokens in plain_outputs:  # the oracle compiles: checked after the count
        assert tokens == oracle(tiny, prompt, 4)


def test_bfloat16_model_on_cpu_keeps_a_float32_cache(tiny) -> None:
    """A bfloat16 model's engine on CPU writes K/V into a float32 cache (CacheConfig.dtype);
    its logits stay within bfloat16 rounding of the float32 model's, prefill and decode."""
    cfg, params, tokenizer = tiny
    bf16_cfg = cfg.replace(dtype="bfloat16")
    bf16_params = jax.tree.map(lambda x: x.astype(jax.numpy.bfloat16), params)
    bf16_engine = LLMEngine(
        bf16_cfg,
        bf16_params,
        tokenizer,
        cache_config=CacheConfig(page_size=PAGE, num_pages=32),
        scheduler_config=SchedulerConfig(
            max_num_seqs=2, max_num_batched_tokens=16, max_model_len=64
        ),
    )
    assert bf16_engine.runner.kv_caches[0].dtype == np.float32
    prompt = random_prompt(random.Random(7), 11)
    params_lp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=0)
    [output] = generate(bf16_engine, [prompt], [params_lp])
    tokens = output.outputs[0].token_ids
    ids = np.asarray([prompt + tokens])
    exact = jax.nn.log_softmax(naive.sequence_logits(params, ids, cfg=cfg)[0], axis=-1)
    # The yardstick: the naive forward of the same bfloat16 weights, all in bfloat16.
    dense_bf16 = naive.sequence_logits(bf16_params, ids, cfg=bf16_cfg)[0].astype(np.float32)
    rows = np.arange(len(prompt) - 1, ids.shape[1] - 1)
    yardstick = np.abs(jax.nn.log_softmax(dense_bf16, axis=-1) - exact)[rows].max()
    for i, (token, entry) in enumerate(zip(tokens, output.outputs[0].logprobs, strict=True)):
        assert abs(entry[token] - exact[rows[i], token]) <= 2 * yardstick
