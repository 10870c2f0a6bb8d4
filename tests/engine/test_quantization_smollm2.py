"""Quantized weights (and KV cache) on the real SmolLM2-135M against its float32 model.

The float32 model is the GGUF dequantized by gguf-py (the oracle of test_smollm2_gguf.py); the
engine's greedy continuations of it are computed once per module.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine import naive
from engine.config import CacheConfig, QuantizationConfig, SchedulerConfig
from engine.llm_engine import LLMEngine, run_to_completion
from engine.models.quant import KERNEL_MAX_ROWS, weight_bytes, with_int8_activations
from engine.request import SamplingParams
from engine.tokenizer import load_tokenizer
from engine.weights import load_params, resolve_model
from engine.weights.quantize import quantize_params
from tests.engine.real_text import TALE_OF_TWO_CITIES

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n",
    "Once upon a time, in a small village,",
    "The three laws of thermodynamics are",
    "Water boils at",
    "<|im_start|>user\nName three primary colors.<|im_end|>\n<|im_start|>assistant\n",
    "import numpy as np\n\n# compute the mean of a list\n",
    "The history of the Roman Empire",
    "My favourite recipe for pancakes is",
    "In mathematics, a prime number is",
]
NUM_TOKENS = 64


@pytest.fixture(scope="module")
def files():
    return resolve_model("smollm2-135m")


@pytest.fixture(scope="module")
def tokenizer(files):
    return load_tokenizer(files.path)


@pytest.fixture(scope="module")
def float32(files):
    return load_params(files, dtype="float32")


def make_engine(cfg, params, tokenizer, **cache: object) -> LLMEngine:
    return LLMEngine(
        cfg,
        params,
        tokenizer,
        warm_up=False,
        cache_config=CacheConfig(16, num_pages=128, **cache),  # type: ignore[arg-type]
        scheduler_config=SchedulerConfig(
            max_num_seqs=16, max_num_batched_tokens=256, max_model_len=256
        ),
    )


def greedy(cfg, params, tokenizer, **cache: object) -> list[list[int]]:
    """The engine's greedy continuations of PROMPTS, NUM_TOKENS each (EOS ignored)."""
    engine = make_engine(cfg, params, tokenizer, **cache)
    ids = [str(i) for i in range(len(PROMPTS))]
    for request_id, prompt in zip(ids, PROMPTS, strict=True):
        sampling = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)
        engine.add_request(request_id, prompt, sampling)
    return [list(out.outputs[0].token_ids) for out in run_to_completion(engine, ids)]


@pytest.fixture(scope="module")
def float32_continuations(float32, tokenizer):
    cfg, params = float32
    return greedy(cfg, params, tokenizer)


def agreement(expected: list[list[int]], got: list[list[int]]) -> tuple[int, list[int]]:
    """Prompts whose continuations are identical, and where each first differs."""
    first = [
        next((i for i, (a, b) in enumerate(zip(e, g, strict=True)) if a != b), len(e))
        for e, g in zip(expected, got, strict=True)
    ]
    return sum(f == NUM_TOKENS for f in first), first


def test_int8_weights_kl_below_001_nats(files, float32, tokenizer) -> None:
    cfg, params = float32
    _, int8 = load_params(files, quantization=QuantizationConfig("int8"))
    ids = np.asarray(tokenizer.encode(TALE_OF_TWO_CITIES)[:256], np.int32)[None]
    assert ids.shape == (1, 256)
    expected = jax.nn.log_softmax(naive.sequence_logits(params, ids, cfg=cfg))
    got = jax.nn.log_softmax(naive.sequence_logits(int8, ids, cfg=cfg))
    kl = float(jnp.mean(jnp.sum(jnp.exp(expected) * (expected - got), axis=-1)))
    f32_bytes, int8_bytes = weight_bytes(params), weight_bytes(int8)
    print(f"int8 weights: KL {kl:.5f} nats; {int8_bytes / 1e6:.1f} MB, f32 {f32_bytes / 1e6:.1f}")
    assert kl < 0.01
    assert int8_bytes < 0.3 * f32_bytes


def test_int4_weights_greedy_agreement(float32, tokenizer, float32_continuations) -> None:
    cfg, params = float32
    int4 = quantize_params(params, QuantizationConfig("int4"), cfg.dtype)  # load-time path
    agreed, first = agreement(float32_continuations, greedy(cfg, int4, tokenizer))
    int4_bytes = weight_bytes(int4)
    print(f"int4 weights: {agreed}/10 agree (first differences {first}); {int4_bytes / 1e6:.1f} MB")
    assert agreed >= 8
    assert int4_bytes < 0.25 * weight_bytes(params)


def test_int4_weights_with_int8_activations(float32, tokenizer) -> None:
    # The rows rounded to int8 (llama.cpp's Q8_0) meet the int4 weights and the int8 output
    # layer: next-token KL from the float model over 64 tokens (a prefill the kernel takes;
    # the int4 weights alone are this GGUF's own Q4_1 blocks again, KL ~1e-8). A lone request
    # is not compared with a batch: their greedy continuations parted after 2-48 tokens
    # (measured with every step on the kernel, whose rows are independent bit for bit), as a
    # last-bit difference elsewhere in the step moves a rounding by a whole step where float
    # activations absorb it.
    cfg, params = float32
    marked = with_int8_activations(quantize_params(params, QuantizationConfig("int4"), cfg.dtype))
    ids = np.asarray(tokenizer.encode(TALE_OF_TWO_CITIES)[:KERNEL_MAX_ROWS], np.int32)[None]
    expected = jax.nn.log_softmax(naive.sequence_logits(params, ids, cfg=cfg))
    got = jax.nn.log_softmax(naive.sequence_logits(marked, ids, cfg=cfg))
    kl = float(jnp.mean(jnp.sum(jnp.exp(expected) * (expected - got), axis=-1)))
    top1 = float(jnp.mean(jnp.argmax(expected, -1) == jnp.argmax(got, -1)))
    print(f"int4 weights, int8 activations: KL {kl:.5f} nats, top-1 agreement {top1:.2f}")
    assert 1e-5 < kl < 0.01
    assert top1 >= 0.9


def forced_top1(cfg, params, tokenizer, sequences, **cache: object) -> np.ndarray:
    """The engine's most likely next token after every position of each sequence, teacher-forced
    (one prefill per sequence, read off its prompt logprobs): i32[num_positions], concatenated."""
    engine = make_engine(cfg, params, tokenizer, **cache)
    ids = [str(i) for i in range(len(sequences))]
    sampling = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1)
    for request_id, sequence in zip(ids, sequences, strict=True):
        engine.add_request(request_id, sequence, sampling)
    outputs = run_to_completion(engine, ids)
    return np.asarray(
        [max(e, key=e.__getitem__) for out in outputs for e in out.prompt_logprobs[1:]]
    )


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "int8", "fp8"])
def test_quantized_kv_cache_next_token_agreement(
    float32, tokenizer, float32_continuations, kv_dtype: str
) -> None:
    """Teacher-forced next-token agreement with the float32 cache over the prompts and their
    float32 continuations (708 positions). Free-running greedy continuations are too brittle to
    compare: one flipped near-tie changes the rest, and which ties flip depends on the CPU's
    summation order (fp8 kept 3/10 whole continuations on one machine, 1/10 on another)."""
    cfg, params = float32
    sequences = [
        tokenizer.encode(prompt) + continuation
        for prompt, continuation in zip(PROMPTS, float32_continuations, strict=True)
    ]
    expected = forced_top1(cfg, params, tokenizer, sequences)
    got = forced_top1(cfg, params, tokenizer, sequences, kv_cache_dtype=kv_dtype)
    agreed = float(np.mean(got == expected))
    print(f"{kv_dtype} KV cache: next token agrees at {agreed:.1%} of {expected.size} positions")
    # Measured on 708 positions: int8 99.2% (6 flips), fp8 97.6% (17); a flip is a near-tie
    # that the quantization error tips over. The bounds allow ~3x the flips measured.
    # bfloat16 (on CPU: the C++ kernels' write and attention over a bfloat16 cache) keeps 8
    # mantissa bits where int8 keeps ~7.
    assert agreed >= (0.93 if kv_dtype == "fp8" else 0.97)
