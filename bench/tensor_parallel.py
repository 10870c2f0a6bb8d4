"""CPU step time of a tensor-parallel engine (TP=1, 2, 4) on 8 simulated devices.

    .venv/bin/python bench/tensor_parallel.py [--repeats 20] [--write-results]

A random Llama-shaped model (float32), 8 requests of 128-token prompts: the median time of
the prefill steps (64 tokens each) and of the decode steps (8 sequences, one token each),
through the whole engine, compilation excluded. The 8 "devices" share this machine's cores,
so this measures the overhead of sharding (collectives, per-shard dispatch), not a speed-up.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

NUM_DEVICES = 8
TITLE = "Tensor-parallel step time on simulated CPU devices (bench/tensor_parallel.py)"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--write-results", action="store_true")
    args = parser.parse_args()
    # Before JAX starts its backend (JAX itself is imported below, after this).
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={NUM_DEVICES}"
    import jax

    if __package__ in (None, ""):  # run as a script: the checkout's root holds `bench`
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from bench import common

    checkpoint = write_checkpoint()
    rows = [measure(tp, args.repeats, checkpoint) for tp in (1, 2, 4)]
    table = [
        "| TP | prefill step, 64 tokens (ms) | decode step, 8 seqs (ms) | decode tokens/s |",
        "|---|---|---|---|",
        *(f"| {tp} | {p * 1e3:.1f} | {d * 1e3:.1f} | {8 / d:.0f} |" for tp, p, d in rows),
    ]
    command = "python bench/tensor_parallel.py " + " ".join(sys.argv[1:])
    text = "\n".join(
        [
            *common.preamble(command, {"jax": jax.__version__}),
            f"- model: random Llama, {describe()}, float32; 8 requests of 128-token prompts",
            f"- devices: {NUM_DEVICES} simulated CPU devices sharing the machine's cores",
            "- note: an XLA:CPU device runs a step on one thread, so on this 2-core machine "
            "TP=2 gets both cores where TP=1 uses one, and TP=4 puts 4 threads and their "
            "collectives on 2 cores; the machine is shared and noisy (see shared/BASELINES.md)",
            "",
            *table,
        ]
    )
    print(text)
    if args.write_results:
        common.write_section(TITLE, text)
    return 0


# A random Llama (HF names), written once as a checkpoint that every TP size loads.
DIMS = dict(
    vocab_size=8192, hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
    num_attention_heads=8, num_key_value_heads=4, head_dim=64, max_position_embeddings=1024,
)  # fmt: skip


def describe() -> str:
    return (
        f"{DIMS['num_hidden_layers']} layers, d={DIMS['hidden_size']}, "
        f"{DIMS['num_attention_heads']} heads / {DIMS['num_key_value_heads']} KV heads, "
        f"MLP {DIMS['intermediate_size']}, vocab {DIMS['vocab_size']}"
    )


def measure(tp: int, repeats: int, checkpoint: Path) -> tuple[int, float, float]:
    from engine.builder import build_engine
    from engine.config import (
        CacheConfig,
        CompilationConfig,
        EngineConfig,
        ParallelConfig,
        SchedulerConfig,
    )
    from engine.request import SamplingParams
    from sharding.layout import ShardingLayout

    engine = build_engine(
        EngineConfig(
            str(checkpoint),
            cache=CacheConfig(page_size=16, num_pages=256),
            scheduler=SchedulerConfig(
                max_num_seqs=8, max_num_batched_tokens=64, max_model_len=1024
            ),
            parallel=ParallelConfig(ShardingLayout.named(tp=tp)),
            compilation=CompilationConfig(warm_up="lazy"),
        )
    )
    params = SamplingParams(temperature=0, max_tokens=repeats + 3, ignore_eos=True)
    for i in range(8):
        engine.add_request(f"r{i}", [(i * 131 + j) % 8000 + 100 for j in range(128)], params)
    prefill: list[float] = []
    decode: list[float] = []
    while engine.has_unfinished_requests():
        prompt_tokens = engine.stats().num_computed_prompt_tokens
        start = time.perf_counter()
        engine.step()
        seconds = time.perf_counter() - start
        is_prefill = engine.stats().num_computed_prompt_tokens > prompt_tokens
        (prefill if is_prefill else decode).append(seconds)
    # The first step of each kind compiled its bucket.
    return tp, statistics.median(prefill[1:]), statistics.median(decode[1:])


def write_checkpoint() -> Path:
    """The random model with the tests' byte-level tokenizer (outputs past its 260 ids
    detokenize to nothing; the benchmark needs no text)."""
    import tempfile

    from tests.engine.tiny_gguf import tiny_llama
    from tests.engine.tiny_model import write_byte_tokenizer

    directory = Path(tempfile.mkdtemp())
    tiny_llama(**DIMS, initializer_range=0.02).save_pretrained(directory)
    write_byte_tokenizer(directory)
    return directory


if __name__ == "__main__":
    sys.exit(main())
