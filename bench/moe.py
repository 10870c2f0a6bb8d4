"""Mixture-of-experts benchmarks: the MoE layer's ways of running experts, and a MoE model's step
against a dense model with the same active parameters.

    PYTHONPATH=. .venv/bin/python bench/moe.py [--repeats N] [--write-results]

Layer section: one MoE MLP (8 experts, top 2, d 512, expert width 1024: routing included) at
T = 1, 16, 64 and 512 tokens, each `engine.models.moe.IMPLS` way (sorted pairs + ragged_dot,
gathered expert weights, every expert on every token) and the default choice, beside a dense
SwiGLU MLP of width 2048 (the same active parameters per token).

Step section: the whole forward step (`engine.step.forward_step`: paged attention, 4 layers,
d 512, 8 heads / 4 KV heads, vocabulary 4,096) of the MoE model and of the dense one, decoding
16 sequences (T = 16) and prefilling 256 tokens of one. The batches are the engine's padding
batches (no context in the cache), so attention costs little and the MLPs dominate: the same
for both models.

Device part (`--shape qwen3-30b-a3b --layer-only`, from bench/gpu/run.sh with MOE=1): the
layer section for one Qwen3-30B-A3B-shaped layer (128 experts, top 8, d 2048, expert width 768)
with random bfloat16 weights.

Expert parallelism (the same model over 8 simulated devices, both expert dispatches) is
bench/expert_parallel.py.

Times are medians over repeats after a warm-up call; never assert on them. `--smoke` runs
every measurement once at toy sizes (the test suite's check that the script works).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import jax
import numpy as np

from bench.common import preamble, write_section
from engine.batch import BatchBuilder, BatchShapes
from engine.config import ModelConfig
from engine.models import layers, moe, registry
from engine.scheduler import SchedulerOutput
from engine.step import StepOptions, attention_metadata, forward_step
from pallas_kernels.kv_cache_update import KVCacheSpec, init_kv_pages

TITLE = "Mixture of experts (bench/moe.py)"


@dataclass(frozen=True)
class Sizes:
    dim: int = 512
    experts: int = 8
    top_k: int = 2
    expert_width: int = 1024
    layers: int = 4
    vocab: int = 4096
    layer_tokens: tuple[int, ...] = (1, 16, 64, 512)
    decode_seqs: int = 16
    prefill_tokens: int = 256
    dtype: str = "float32"


SMOKE = Sizes(dim=64, expert_width=32, layers=1, vocab=256, layer_tokens=(16,),
              decode_seqs=4, prefill_tokens=16)  # fmt: skip
SHAPES = {
    "default": Sizes(),
    "qwen3-30b-a3b": Sizes(dim=2048, experts=128, top_k=8, expert_width=768, layers=1,
                           vocab=4096, dtype="bfloat16"),
}  # fmt: skip


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def model_config(s: Sizes, *, moe_model: bool) -> ModelConfig:
    cfg = ModelConfig("llama", s.vocab, s.dim, s.top_k * s.expert_width, s.layers, 8, 4,
                      s.dim // 8, max_position_embeddings=2048, dtype=s.dtype)  # fmt: skip
    if not moe_model:
        return cfg
    return cfg.replace(intermediate_size=s.expert_width, num_experts=s.experts,
                       num_experts_per_tok=s.top_k, norm_topk_prob=True)  # fmt: skip


def random_params(cfg: ModelConfig) -> dict:
    """Random weights of std 0.05 in the layout the loaders produce."""
    rng = np.random.default_rng(0)
    params: dict = {"layers": [{} for _ in range(cfg.num_layers)]}
    for spec in registry.family(cfg).hf_tensor_specs(cfg).values():
        host = spec.convert((0.05 * rng.standard_normal(spec.shape)).astype(np.float32))
        value = jax.numpy.asarray(host, cfg.dtype)
        *parents, leaf = spec.path
        node = params
        for key in parents:
            node = node[key]
        node[leaf] = value
    return params


def layer_rows(s: Sizes, repeats: int) -> list[str]:
    moe_cfg, dense_cfg = model_config(s, moe_model=True), model_config(s, moe_model=False)
    moe_layer = random_params(moe_cfg.replace(num_layers=1))["layers"][0]
    dense_layer = random_params(dense_cfg.replace(num_layers=1))["layers"][0]
    rng = np.random.default_rng(1)
    rows = []
    for tokens in s.layer_tokens:
        x = jax.numpy.asarray(rng.standard_normal((tokens, s.dim)), s.dtype)
        dense = jax.jit(lambda x, p: layers.gated_mlp(x, p, jax.nn.silu))
        dense_ms = median_ms(lambda: dense(x, dense_layer), repeats)  # noqa: B023
        rows.append(f"| {tokens} | dense MLP (width {s.top_k * s.expert_width}) | "
                    f"{dense_ms:.3f} | 1.00 |")  # fmt: skip
        for impl in (*moe.IMPLS, None):
            experts = functools.partial(moe.grouped_experts, impl=impl)
            run = jax.jit(lambda x, p, f=experts: moe.moe_mlp(x, p, cfg=moe_cfg, experts=f))
            ms = median_ms(lambda: run(x, moe_layer), repeats)  # noqa: B023
            rows.append(f"| {tokens} | MoE, {impl or 'default'} | {ms:.3f} | "
                        f"{ms / dense_ms:.2f} |")  # fmt: skip
    return rows


def step_ms(cfg: ModelConfig, tokens: int, seqs: int, repeats: int) -> float:
    page = 16
    shapes = BatchShapes.create(max_num_batched_tokens=tokens, max_num_seqs=seqs,
                                max_model_len=512, page_size=page)  # fmt: skip
    batch = BatchBuilder(shapes, page).build_padded(
        SchedulerOutput(), None, tokens, seqs, penalties=False
    )
    batch = jax.device_put(batch)
    spec = KVCacheSpec.for_platform(
        "cpu", num_pages=64, page_size=page, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim
    )
    params = random_params(cfg)
    caches = [init_kv_pages(spec) for _ in range(cfg.num_layers)]
    run = jax.jit(forward_step, static_argnames="options")
    options = StepOptions(cfg)

    def once() -> object:
        out, _ = run(params, caches, batch.token_ids, batch.positions,
                     attention_metadata(batch), batch.logits_indices, options=options)  # fmt: skip
        return out.logits

    return median_ms(once, repeats)


def step_rows(s: Sizes, repeats: int) -> list[str]:
    rows = []
    for name, tokens, seqs in (
        (f"decode {s.decode_seqs} seqs", s.decode_seqs, s.decode_seqs),
        (f"prefill {s.prefill_tokens} tokens", s.prefill_tokens, 1),
    ):
        dense = step_ms(model_config(s, moe_model=False), tokens, seqs, repeats)
        sparse = step_ms(model_config(s, moe_model=True), tokens, seqs, repeats)
        rows.append(f"| {name} | {dense:.2f} | {sparse:.2f} | {sparse / dense:.2f} |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--smoke", action="store_true", help="toy sizes, one repeat")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="default")
    parser.add_argument("--layer-only", action="store_true", help="skip the step section")
    parser.add_argument("--write-results", action="store_true", help="update bench/RESULTS.md")
    args = parser.parse_args()
    sizes, repeats = (SMOKE, 1) if args.smoke else (SHAPES[args.shape], args.repeats)
    lines = [
        f"MoE layer: {sizes.experts} experts, top {sizes.top_k}, d {sizes.dim}, expert width "
        f"{sizes.expert_width} (routing included), {sizes.dtype}, {jax.default_backend()}; "
        "ratio to the dense MLP.",
        "",
        "| tokens | layer | median ms | vs dense |",
        "|---|---|---|---|",
        *layer_rows(sizes, repeats),
    ]
    if not args.layer_only:
        lines += [
            "",
            f"Forward step, {sizes.layers} layers (padding batches: little attention work).",
            "",
            "| step | dense ms | MoE ms | MoE / dense |",
            "|---|---|---|---|",
            *step_rows(sizes, repeats),
        ]
    text = "\n".join(lines)
    print(text)
    if args.write_results and not args.smoke:
        command = "PYTHONPATH=. .venv/bin/python bench/moe.py " + " ".join(sys.argv[1:])
        versions = {"jax": jax.__version__}
        title = TITLE if args.shape == "default" else f"{TITLE}, {args.shape}"
        write_section(title, "\n".join([*preamble(command, versions), "", text]))


if __name__ == "__main__":
    main()
