"""A model whose every layer is local (Mistral) frees the pages behind its sliding window:
the allocator's bookkeeping, and the engine's greedy output (unchanged, against the naive
oracle) while requests that would not all fit without it run side by side."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import transformers

from engine import naive
from engine.config import CacheConfig, SchedulerConfig
from engine.kv_cache import RELEASED, KVCacheManager
from engine.llm_engine import LLMEngine
from engine.request import SamplingParams
from engine.tokenizer import load_tokenizer
from engine.weights import open_checkpoint, resolve_model
from tests.engine.tiny_model import VOCAB_SIZE, write_byte_tokenizer

PAGE, WINDOW = 4, 8


def test_release_behind_window_frees_and_keeps_prefix_cache() -> None:
    kv = KVCacheManager(16, PAGE, sliding_window=WINDOW)
    prompt = list(range(20))
    assert kv.allocate("a", 20) is not None
    kv.commit_full_pages("a", prompt, 20)
    # The next token is at position 20; it sees keys 13..20: pages 0-2 (keys 0..11) are behind.
    assert kv.release_behind_window("a", 20) == 3
    assert kv.page_table("a")[:3] == [RELEASED] * 3 and RELEASED not in kv.page_table("a")[3:]
    assert kv.num_free_pages == 16 - 2
    assert kv.release_behind_window("a", 20) == 0  # idempotent
    kv.check_invariants()
    # Their content is still cached: a request with the same prompt gets them back.
    pages, num_cached = kv.find_cached_prefix([*prompt, 99])
    assert num_cached == 20 and len(pages) == 5
    assert kv.allocate("b", 21, pages) is not None
    kv.check_invariants()
    kv.free("a")
    kv.free("b")
    kv.check_invariants()
    assert kv.num_free_pages == 16


def test_no_window_releases_nothing() -> None:
    kv = KVCacheManager(8, PAGE)
    kv.allocate("a", 20)
    assert kv.release_behind_window("a", 20) == 0


@pytest.fixture(scope="module")
def mistral(tmp_path_factory: pytest.TempPathFactory):
    directory: Path = tmp_path_factory.mktemp("mistral")
    config = transformers.MistralConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        sliding_window=WINDOW,
        initializer_range=0.3,
    )
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    write_byte_tokenizer(directory)
    checkpoint = open_checkpoint(resolve_model(str(directory)))
    assert checkpoint.cfg.uniform_sliding_window == WINDOW
    return checkpoint.cfg, checkpoint.load_params(), load_tokenizer(directory)


def test_all_local_model_frees_pages_with_unchanged_greedy_output(mistral) -> None:
    """Four requests of 60 tokens need 60 pages of 4 without freeing; the cache has 32. With
    the pages behind the window freed, none is preempted and each output is the oracle's."""
    cfg, params, tokenizer = mistral
    engine = LLMEngine(
        cfg,
        params,
        tokenizer,
        cache_config=CacheConfig(page_size=PAGE, num_pages=32),
        scheduler_config=SchedulerConfig(
            max_num_seqs=4, max_num_batched_tokens=16, max_model_len=128
        ),
        warm_up=False,
    )
    rng = random.Random(0)
    prompts = [[rng.randrange(VOCAB_SIZE) for _ in range(n)] for n in (30, 22, 35, 27)]
    greedy = [
        SamplingParams(temperature=0, max_tokens=60 - len(p), ignore_eos=True) for p in prompts
    ]
    for i, (prompt, params_i) in enumerate(zip(prompts, greedy, strict=True)):
        engine.add_request(f"r{i}", prompt, params_i)
    outputs: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    most_held = 0
    while engine.has_unfinished_requests():
        for output in engine.step():  # deltas: each holds the step's new token
            outputs[output.request_id] += output.outputs[0].token_ids
        engine.kv_cache.check_invariants()
        most_held = max(most_held, engine.kv_cache.num_pages - engine.kv_cache.num_free_pages)
    assert engine.scheduler.num_preemptions == 0
    assert most_held < 32
    for i, (prompt, p) in enumerate(zip(prompts, greedy, strict=True)):
        expected = list(
            naive.generate(params, cfg, prompt, naive.NaiveSampling(max_tokens=p.max_tokens))
        )
        assert outputs[f"r{i}"] == expected
    assert engine.kv_cache.num_free_pages == 32
