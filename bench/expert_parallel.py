"""Expert-parallel MoE step time on 8 simulated CPU devices: the allgather (psum) dispatch
against the all-to-all dispatch (sharding/experts.py) at EP 2, 4 and 8.

    .venv/bin/python bench/expert_parallel.py [--repeats 9] [--write-results]

The MoE model of bench/moe.py (4 layers, d 512, 8 experts, top 2, expert width 1024, random
float32 weights), its experts split over an `ep` mesh axis (attention replicated), one forward
step (`engine.step.forward_step`) decoding 16 sequences and prefilling 256 tokens of one; EP 1
is the single-device step. Beside each time, the bytes one device sends per MoE layer under
each dispatch, computed from the shapes (`sharding.experts.bytes_moved`, balanced routing).

The simulated devices share this machine's cores and XLA:CPU runs the all-to-all dispatch with
a padded exchange (a full capacity of T/EP*k rows to every device, and the receiving experts
over all EP*T/EP*k received rows), so these times measure the dispatch's overhead on CPU, not
what ragged_all_to_all does on TPU or GPU. Times are medians after a warm-up; never assert on
them. `--smoke` runs a toy decode step at EP 2 once (the test suite's check that the script
works).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # bench.moe imports JAX, which must start after XLA_FLAGS is set
    from bench.moe import Sizes

NUM_DEVICES = 8
TITLE = "Expert-parallel MoE step on simulated CPU devices (bench/expert_parallel.py)"
DISPATCHES = ("allgather", "all_to_all")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument(
        "--smoke", action="store_true", help="toy sizes, EP 2, decode only, one repeat"
    )
    parser.add_argument("--write-results", action="store_true", help="update bench/RESULTS.md")
    args = parser.parse_args()
    # Before JAX starts its backend (JAX itself is imported below, after this).
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={NUM_DEVICES}"
    import jax

    if __package__ in (None, ""):  # run as a script: the checkout's root holds `bench`
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from bench import common, moe

    sizes, repeats = (moe.SMOKE, 1) if args.smoke else (moe.Sizes(), args.repeats)
    sizes_ep = (2,) if args.smoke else (2, 4, 8)
    steps = [(f"decode {sizes.decode_seqs} seqs", sizes.decode_seqs, sizes.decode_seqs)]
    if not args.smoke:
        steps.append((f"prefill {sizes.prefill_tokens} tokens", sizes.prefill_tokens, 1))
    rows = []
    for name, tokens, seqs in steps:
        single = step_ms(sizes, tokens, seqs, repeats, ep=1, dispatch="allgather")
        rows.append(f"| {name} | 1 | {single:.2f} | | | |")
        for ep in sizes_ep:
            times = [step_ms(sizes, tokens, seqs, repeats, ep=ep, dispatch=d) for d in DISPATCHES]
            rows.append(row(name, ep, times, layer_bytes(sizes, tokens, ep)))
    text = "\n".join(
        [
            *common.preamble(
                "python bench/expert_parallel.py " + " ".join(sys.argv[1:]),
                {"jax": jax.__version__},
            ),
            f"- model: random MoE, {sizes.layers} layers, d {sizes.dim}, {sizes.experts} "
            f"experts, top {sizes.top_k}, expert width {sizes.expert_width}, {sizes.dtype}; "
            "experts over the `ep` mesh axis, attention replicated",
            f"- devices: {NUM_DEVICES} simulated CPU devices sharing the machine's cores; "
            "XLA:CPU runs the all-to-all dispatch padded (see the script's docstring)",
            "- KiB sent: by one device per MoE layer, from the shapes (balanced routing); "
            "all-to-all as ragged_all_to_all moves it on TPU/GPU (CPU's padded exchange in "
            "brackets)",
            "",
            "| step | EP | allgather ms | all_to_all ms | allgather KiB | all_to_all KiB |",
            "|---|---|---|---|---|---|",
            *rows,
        ]
    )
    print(text)
    if args.write_results and not args.smoke:
        common.write_section(TITLE, text)
    return 0


def row(name: str, ep: int, times: list[float], sent: dict[str, float]) -> str:
    allgather, all_to_all = times
    return (
        f"| {name} | {ep} | {allgather:.2f} | {all_to_all:.2f} | "
        f"{sent['allgather'] / 1024:.1f} | {sent['all_to_all'] / 1024:.1f} "
        f"({sent['all_to_all_padded'] / 1024:.1f}) |"
    )


def layer_bytes(sizes: Sizes, tokens: int, ep: int) -> dict[str, float]:
    import numpy as np

    from sharding.experts import bytes_moved

    return bytes_moved(tokens, sizes.dim, sizes.top_k, ep, np.dtype(sizes.dtype).itemsize)


def step_ms(sizes: Sizes, tokens: int, seqs: int, repeats: int, *, ep: int, dispatch: str) -> float:
    """Median ms of one forward step of `tokens` tokens in `seqs` sequences (a padding batch),
    the experts over `ep` devices (1: one device, no plan)."""
    import jax

    from bench import moe
    from engine.batch import BatchBuilder, BatchShapes
    from engine.scheduler import SchedulerOutput
    from engine.step import StepOptions, attention_metadata, forward_step
    from pallas_kernels.kv_cache_update import KVCacheSpec, init_kv_pages
    from sharding.layout import ShardingLayout
    from sharding.mesh import make_mesh
    from sharding.rules import ShardingPlan

    cfg = moe.model_config(sizes, moe_model=True)
    page = 16
    shapes = BatchShapes.create(max_num_batched_tokens=tokens, max_num_seqs=seqs,
                                max_model_len=512, page_size=page)  # fmt: skip
    batch = BatchBuilder(shapes, page).build_padded(
        SchedulerOutput(), None, tokens, seqs, penalties=False
    )
    spec = KVCacheSpec.for_platform(
        "cpu", num_pages=64, page_size=page, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim
    )
    params = moe.random_params(cfg)
    caches = [init_kv_pages(spec) for _ in range(cfg.num_layers)]
    plan = None
    if ep > 1:
        layout = ShardingLayout.create({"ep": ep}, {"expert": "ep"})
        mesh = make_mesh(layout, jax.devices()[:ep])
        plan = ShardingPlan.create(mesh, cfg, layout, expert_dispatch=dispatch)
        params = jax.device_put(params, plan.param_shardings(params))
        caches = [jax.device_put(c, plan.cache_sharding(c.shape)) for c in caches]
        batch = jax.device_put(batch, plan.replicated)
    else:
        batch = jax.device_put(batch)
    run = jax.jit(forward_step, static_argnames="options")
    options = StepOptions(cfg, sharding=plan)

    def once() -> object:
        out, _ = run(params, caches, batch.token_ids, batch.positions,
                     attention_metadata(batch), batch.logits_indices, options=options)  # fmt: skip
        return out.logits

    return moe.median_ms(once, repeats)


if __name__ == "__main__":
    sys.exit(main())
