"""Multi-LoRA serving on SmolLM2: throughput with requests spread over four rank-16 adapters
against the base model alone, time to first token when an adapter must first be loaded into a
slot, and the low-rank product's two implementations side by side.

    .venv/bin/python bench/lora.py [--requests 64] [--write-results]
    .venv/bin/python bench/lora.py --smoke      # a tiny random model, seconds (the test's)

Throughput: `--requests` requests (prompts of 128 tokens, 64 greedy output tokens) kept at
concurrency 16 through the engine, once all on the base model and once spread round-robin over
four adapters (random weights, PEFT format, every projection, rank 16) that sit in the four
device slots, in three alternated rounds without prefix caching; the median output tokens per
second of each and their ratio. TTFT: with the four slots held
by idle adapters, a request for a fifth adapter (which must be read and written into a slot
first) against a request for a resident one, the engine otherwise idle. Kernels: one
projection (576 -> 576) over 5 slots of rank 16, the masked dense product the engine uses
against `lax.ragged_dot` over tokens sorted by slot, at 16 and 512 tokens.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

TITLE = "Multi-LoRA serving (bench/lora.py)"
PEFT_MODULES = {
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--smoke", action="store_true", help="a tiny random model, few requests")
    parser.add_argument("--write-results", action="store_true")
    args = parser.parse_args()
    if __package__ in (None, ""):  # run as a script: the checkout's root holds `bench`
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    if args.smoke:
        args.requests, args.concurrency, args.prompt_len, args.output_len = 8, 4, 12, 4
        args.model = str(_tiny_checkpoint())
    text = run(args)
    print(text)
    if args.write_results and not args.smoke:
        from bench import common

        common.write_section(TITLE, text)
    return 0


def run(args: argparse.Namespace) -> str:
    import jax

    from bench import common
    from engine.builder import build_engine
    from engine.config import (
        CacheConfig,
        CompilationConfig,
        EngineConfig,
        LoRAConfig,
        SchedulerConfig,
    )
    from engine.weights import open_checkpoint, resolve_model

    root = Path(tempfile.mkdtemp())
    engine = build_engine(
        EngineConfig(
            args.model,
            cache=CacheConfig(
                page_size=16,
                num_pages=1024 if not args.smoke else 64,
                enable_prefix_caching=False,  # every round computes its prompts
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=args.concurrency,
                max_num_batched_tokens=256 if not args.smoke else 32,
                max_model_len=args.prompt_len + args.output_len + 16,
            ),
            compilation=CompilationConfig(warm_up="lazy" if args.smoke else "eager"),
            lora=LoRAConfig(max_loras=4, max_lora_rank=16),
        )
    )
    cfg = open_checkpoint(resolve_model(args.model)).cfg
    names = [f"adapter{i}" for i in range(7)]
    for i, name in enumerate(names):
        engine.add_lora(name, str(write_adapter(root / name, cfg, rank=16, seed=i)))
    prompts = make_prompts(args.requests, args.prompt_len, cfg.vocab_size)
    # alternated rounds, medians: the first run after warm-up is slower for either
    rounds = [
        (throughput(engine, prompts, [None], args), throughput(engine, prompts, names[:4], args))
        for _ in range(1 if args.smoke else 3)
    ]
    base, spread = (statistics.median(run) for run in zip(*rounds, strict=True))
    ttft_resident, ttft_load = ttft(engine, names, args)
    # read before the kernel timings, which compile their own functions in this process
    compilations = engine.stats().compilations_after_warm_up
    kernels = kernel_times(smoke=args.smoke)
    command = "python bench/lora.py " + " ".join(sys.argv[1:])
    lines = [
        *common.preamble(command, {"jax": jax.__version__}),
        f"- model: {args.model}; 4 device slots, adapters of rank 16 on all 7 projections",
        f"- load: {args.requests} requests, {args.prompt_len}-token prompts, "
        f"{args.output_len} greedy tokens, concurrency {args.concurrency}; "
        "median of 3 alternated rounds, prefix caching off",
        "",
        "| requests | output tokens/s | vs base |",
        "|---|---|---|",
        f"| base model only | {base:.1f} | 1.00x |",
        f"| spread over 4 adapters | {spread:.1f} | {spread / base:.2f}x |",
        "",
        "| time to first token (idle engine, median of 3) | ms |",
        "|---|---|",
        f"| adapter already in a slot | {ttft_resident * 1e3:.1f} |",
        f"| adapter read and written into a slot first | {ttft_load * 1e3:.1f} |",
        "",
        "| one projection 576->576, 5 slots of rank 16 | masked dense (ms) | ragged_dot (ms) |",
        "|---|---|---|",
        *(f"| {t} tokens | {d * 1e3:.3f} | {r * 1e3:.3f} |" for t, d, r in kernels),
        "",
        f"- engine compilations after warm-up (both runs and the adapter loads): {compilations}",
    ]
    return "\n".join(lines)


def write_adapter(directory: Path, cfg: Any, *, rank: int, seed: int) -> Path:
    """A PEFT adapter with random weights on every projection of every layer."""
    from safetensors.numpy import save_file

    directory.mkdir(parents=True, exist_ok=True)
    d, f = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    sizes = {"q_proj": (d, q), "k_proj": (d, kv), "v_proj": (d, kv), "o_proj": (q, d),
             "gate_proj": (d, f), "up_proj": (d, f), "down_proj": (f, d)}  # fmt: skip
    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(cfg.num_layers):
        for module, (n_in, n_out) in sizes.items():
            key = f"base_model.model.model.layers.{layer}.{PEFT_MODULES[module]}.{module}"
            tensors[f"{key}.lora_A.weight"] = rng.normal(0, 0.02, (rank, n_in)).astype(np.float32)
            tensors[f"{key}.lora_B.weight"] = rng.normal(0, 0.02, (n_out, rank)).astype(np.float32)
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(sizes)}
    (directory / "adapter_config.json").write_text(json.dumps(config))
    return directory


def make_prompts(n: int, length: int, vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [rng.integers(100, min(vocab, 30000), length).tolist() for _ in range(n)]


def throughput(
    engine: Any, prompts: list[list[int]], adapters: Sequence[str | None], args: Any
) -> float:
    """Output tokens per second with at most `concurrency` requests in the engine."""
    from engine.request import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    queue = list(enumerate(prompts))
    tag = "base" if adapters == [None] else "lora"
    in_flight = 0
    tokens = 0
    start = time.perf_counter()
    while queue or engine.has_unfinished_requests():
        while queue and in_flight < args.concurrency:
            i, prompt = queue.pop(0)
            engine.add_request(f"{tag}{i}", prompt, params, lora_name=adapters[i % len(adapters)])
            in_flight += 1
        for output in engine.step():
            tokens += sum(len(c.token_ids) for c in output.outputs)
            in_flight -= output.finished
    return tokens / (time.perf_counter() - start)


def ttft(engine: Any, names: list[str], args: Any) -> tuple[float, float]:
    """Median time to the first token for a resident adapter and for one to be loaded."""
    from engine.request import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    prompt = make_prompts(1, args.prompt_len, engine.model_info().vocab_size)[0]
    resident: list[float] = []
    loaded: list[float] = []
    for trial in range(3):
        # The four spread adapters are resident and idle; names[4 + trial] never was in a slot
        # (and, past the host cache's four, is read from disk again).
        for name, times in ((names[0], resident), (names[4 + trial], loaded)):
            start = time.perf_counter()
            engine.add_request(f"ttft{trial}{name}", [*prompt, trial], params, lora_name=name)
            while not engine.step():
                pass
            times.append(time.perf_counter() - start)
            while engine.has_unfinished_requests():
                engine.step()
    return statistics.median(resident), statistics.median(loaded)


def kernel_times(*, smoke: bool) -> list[tuple[int, float, float]]:
    """Seconds per call of the engine's masked dense product and of lax.ragged_dot."""
    import jax
    import jax.numpy as jnp

    from engine.models import lora

    slots, rank, width = 5, 16, 576
    rng = np.random.default_rng(0)
    a = jnp.asarray(rng.normal(size=(slots, width, rank)), jnp.float32)
    b = jnp.asarray(rng.normal(size=(slots, rank, width)), jnp.float32)

    @jax.jit
    def masked(x: jax.Array, token_slots: jax.Array) -> jax.Array:
        p = {"wq_lora_a": a, "wq_lora_b": b, lora.MASK: jax.nn.one_hot(token_slots, slots)}
        return lora.delta(x, p, "wq")

    @jax.jit
    def ragged(x: jax.Array, token_slots: jax.Array) -> jax.Array:
        order = jnp.argsort(token_slots, stable=True)
        sizes = jnp.bincount(token_slots, length=slots).astype(jnp.int32)
        u = jax.lax.ragged_dot(x[order], a, sizes)
        out = jax.lax.ragged_dot(u, b, sizes)
        return jnp.zeros_like(out).at[order].set(out)

    rows = []
    for tokens in (16, 512) if not smoke else (16,):
        x = jnp.asarray(rng.normal(size=(tokens, width)), jnp.float32)
        token_slots = jnp.asarray(rng.integers(0, slots, tokens), jnp.int32)
        np.testing.assert_allclose(
            masked(x, token_slots), ragged(x, token_slots), rtol=1e-4, atol=1e-3
        )
        rows.append((tokens, _time(masked, x, token_slots), _time(ragged, x, token_slots)))
    return rows


def _time(fn: Any, *args: Any, repeats: int = 50) -> float:
    fn(*args).block_until_ready()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(*args).block_until_ready()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _tiny_checkpoint() -> Path:
    from tests.engine.tiny_model import write_tiny_checkpoint

    return write_tiny_checkpoint(Path(tempfile.mkdtemp()) / "tiny")


if __name__ == "__main__":
    sys.exit(main())
