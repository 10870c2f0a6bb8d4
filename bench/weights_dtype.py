"""Decode speed by weight dtype, and by KV-cache dtype at a long context, side by side.

    PYTHONPATH=. .venv/bin/python bench/weights_dtype.py [--model smollm2-135m] [--steps 32]
        [--long-context 1024] [--long-batch 16] [--write-results]

In one process, one engine after another: SmolLM2 with float32, bfloat16, int8 and int4 weights
(the quantized ones with float32 activations, as `xlaserve --quantization` runs them), each
timed decoding one stream after a 512-token prompt and 16 streams after 128-token prompts;
then, with float32 weights, --long-batch streams of --long-context tokens each with a float32
and an int8 KV cache. A decode rate is the median over --steps engine steps in which every
sequence decodes one token (after a few untimed ones: compilation happens there), times the
batch. Weight bytes are those of the parameter arrays on the device; KV bytes those of the
cache arrays, sized to hold exactly the timed sequences. Prompts are random token ids (fixed
seed), greedy, EOS ignored. A variant that fails is reported with its error.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import jax

from bench import common
from bench.throughput import make_prompts
from engine.builder import build_engine
from engine.config import (
    CacheConfig,
    CompilationConfig,
    EngineConfig,
    QuantizationConfig,
    SchedulerConfig,
)
from engine.protocol import Engine
from engine.request import SamplingParams
from serving.cli import DEFAULT_CACHE_DIR

TITLE = "Decode by weight and KV-cache dtype (bench/weights_dtype.py)"
PAGE_SIZE = 16
UNTIMED_STEPS = 3  # decode steps before the timed ones (the first compiles its bucket)
# (label, --dtype, --quantization)
WEIGHTS = (
    ("float32", "float32", None),
    ("bfloat16", "bfloat16", None),
    ("int8", "float32", "int8"),
    ("int4 (groups of 32)", "float32", "int4"),
)
KV_DTYPES = ("float32", "int8")


@dataclass(frozen=True)
class Workload:
    """`batch` sequences, each a `prompt_len`-token prompt then decode steps."""

    batch: int
    prompt_len: int

    def describe(self) -> str:
        return f"{self.batch} x {self.prompt_len}-token prompt"


SINGLE = Workload(1, 512)
BATCH = Workload(16, 128)


@dataclass(frozen=True)
class Rate:
    tokens_per_s: float
    step_ms: float

    def cell(self) -> str:
        return f"{self.tokens_per_s:.1f} ({self.step_ms:.1f} ms)"


def make_engine(
    model: str,
    dtype: str,
    quantization: str | None,
    workloads: tuple[Workload, ...],
    steps: int,
    kv_cache_dtype: str | None = None,
) -> tuple[Engine, float]:
    """An engine whose KV cache holds exactly the largest workload, compiled on demand, and
    the seconds it took to build (opening and loading the weights)."""
    new_tokens = 1 + UNTIMED_STEPS + steps
    max_len = max(w.prompt_len for w in workloads) + new_tokens
    pages = max(w.batch * -(-(w.prompt_len + new_tokens) // PAGE_SIZE) for w in workloads)
    config = EngineConfig(
        model,
        dtype=dtype,
        quantization=QuantizationConfig(quantization) if quantization else None,
        cache=CacheConfig(
            PAGE_SIZE, num_pages=pages, enable_prefix_caching=False, kv_cache_dtype=kv_cache_dtype
        ),
        scheduler=SchedulerConfig(
            max_num_seqs=max(w.batch for w in workloads),
            # a workload's prompts all prefill in one step: few step buckets to compile
            max_num_batched_tokens=max(w.batch * w.prompt_len for w in workloads),
            max_model_len=max_len,
        ),
        compilation=CompilationConfig(cache_dir=DEFAULT_CACHE_DIR, warm_up="lazy"),
    )
    start = time.perf_counter()
    engine = build_engine(config)
    return engine, time.perf_counter() - start


def decode_rate(engine: Engine, workload: Workload, steps: int, seed: int) -> Rate:
    """Median decode step of `workload` once every sequence has its first token."""
    prompts = make_prompts(
        workload.batch, (workload.prompt_len,) * 2, engine.model_info().vocab_size, seed=seed
    )
    params = SamplingParams(temperature=0, max_tokens=1 + UNTIMED_STEPS + steps, ignore_eos=True)
    ids = [f"{seed}-{i}" for i in range(workload.batch)]
    for request_id, prompt in zip(ids, prompts, strict=True):
        engine.add_request(request_id, prompt, params)
    generated = dict.fromkeys(ids, 0)
    times: list[float] = []
    while engine.has_unfinished_requests():
        decoding = min(generated.values()) >= 1  # every sequence is past its prompt
        start = time.perf_counter()
        outputs = engine.step()
        if decoding:
            times.append(time.perf_counter() - start)
        for output in outputs:
            generated[output.request_id] += len(output.outputs[0].token_ids)  # a delta
    timed = times[UNTIMED_STEPS:]
    assert len(timed) == steps, f"{len(times)=} decode steps, {UNTIMED_STEPS + steps} expected"
    median = statistics.median(timed)
    return Rate(workload.batch / median, median * 1e3)


def weight_row(model: str, label: str, dtype: str, quantization: str | None, steps: int) -> str:
    engine, load_s = make_engine(model, dtype, quantization, (SINGLE, BATCH), steps)
    size = engine.stats().weight_bytes / 1e6
    single = decode_rate(engine, SINGLE, steps, seed=1)
    batch = decode_rate(engine, BATCH, steps, seed=2)
    return f"| {label} | {dtype} | {size:.0f} | {load_s:.1f} | {single.cell()} | {batch.cell()} |"


def kv_row(model: str, kv_dtype: str, long: Workload, steps: int) -> str:
    engine, _ = make_engine(model, "float32", None, (long,), steps, kv_dtype)
    total = engine.stats().kv_cache_bytes
    slots = engine.stats().num_kv_pages * PAGE_SIZE
    rate = decode_rate(engine, long, steps, seed=3)
    return f"| {kv_dtype} | {total / 2**20:.0f} | {total / slots / 1e3:.1f} | {rate.cell()} |"


def run_variant(measure: Callable[[], str], label: str, columns: int) -> str:
    """The variant's table row, or a row with its error (the traceback goes to stderr)."""
    try:
        row = measure()
    except Exception as e:
        traceback.print_exc()
        row = f"| {label} | failed: `{type(e).__name__}: {e}` |" + " |" * (columns - 2)
    gc.collect()  # the variant's engine is gone: free its weights and cache before the next
    print(row, flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--steps", type=int, default=32, help="timed decode steps per rate")
    parser.add_argument("--long-context", type=int, default=1024, help="tokens per sequence")
    parser.add_argument("--long-batch", type=int, default=16)
    parser.add_argument("--write-results", action="store_true")
    args = parser.parse_args()
    long = Workload(args.long_batch, args.long_context)

    start = time.perf_counter()
    weights = [
        run_variant(partial(weight_row, args.model, label, dtype, quant, args.steps), label, 6)
        for label, dtype, quant in WEIGHTS
    ]
    kv = [
        run_variant(partial(kv_row, args.model, kv_dtype, long, args.steps), kv_dtype, 4)
        for kv_dtype in KV_DTYPES
    ]
    lines = [
        *common.preamble(
            "PYTHONPATH=. .venv/bin/python bench/weights_dtype.py " + " ".join(sys.argv[1:]),
            {"jax": jax.__version__},
        ),
        f"- model: {args.model}; decode rate = batch / median of {args.steps} decode steps "
        f"(after {UNTIMED_STEPS} untimed), each a whole `LLMEngine.step()`; greedy, EOS "
        f"ignored; page size {PAGE_SIZE}; a workload's prompts prefill in one step",
        "- weights on the device: bytes of every parameter array (int8/int4: values, scales, "
        "offsets)",
        f"- whole run: {time.perf_counter() - start:.0f} s",
        "",
        f"| weights | activations | MB on device | load s | decode tok/s, {SINGLE.describe()} "
        f"(median step) | decode tok/s, {BATCH.describe()}s (median step) |",
        "|---|---|---|---|---|---|",
        *weights,
        "",
        f"KV cache at a long context: {long.describe()}s, then decode; float32 weights. "
        "KV bytes are the cache arrays (every layer), sized for exactly these sequences.",
        "",
        "| KV cache | KV MiB | KB per token (all layers) | decode tok/s (median step) |",
        "|---|---|---|---|",
        *kv,
    ]
    text = "\n".join(lines)
    print(text)
    if args.write_results:
        common.write_section(TITLE, text)


if __name__ == "__main__":
    main()
