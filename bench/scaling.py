"""How xlaserve scales, against one `xlaserve serve` (the same flags as bench/compare.py):
output throughput and TTFT against concurrency; KV memory against context length; compilations
against the number of distinct request shapes; prefix-cache hit rate and TTFT on the
shared-prefix set. Plots go to bench/plots/*.png, tables to bench/RESULTS.md.

    python bench/scaling.py --model smollm2-135m --concurrency 1 2 4 8 16 32 64 128 \\
        --input-len 128 --output-len 32 --write-results
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import baselines, common, serve, workloads
from bench.compare import _gguf

TITLE = "Scaling (bench/scaling.py)"
PLOTS = Path(__file__).with_name("plots")
GIB = 2**30


def concurrency_sweep(
    target: serve.Target, tokenizer: Any, args: argparse.Namespace
) -> list[dict[str, Any]]:
    rows = []
    io = ((args.input_len,) * 2, (args.output_len,) * 2)
    for c in args.concurrency:
        n = max(c, args.min_prompts)
        requests = workloads.random_requests(tokenizer, n, *io, tokenizer.vocab_size, seed=c)
        result = asyncio.run(serve.benchmark(target, requests, max_concurrency=c, ignore_eos=True))
        rows.append({"concurrency": c, **{k: v for k, v in result.items() if _scalar(v)}})
        print(f"c={c}: {result['output_throughput']:.1f} tok/s, "
              f"TTFT {result['median_ttft_ms']:.0f} ms", file=sys.stderr)  # fmt: skip
    return rows


def _scalar(value: object) -> bool:
    return isinstance(value, int | float | str)


def kv_memory(gguf_cfg: Any, contexts: Sequence[int], page_size: int = 16) -> list[dict[str, Any]]:
    """Bytes the paged cache holds for one sequence of each context length: the pages the
    host allocator hands out times the bytes of one page of the device layout (all layers)."""
    from engine.config import ModelConfig
    from engine.kv_cache import KVCacheManager
    from pallas_kernels.kv_cache_update import KVCacheSpec

    llama3_8b = ModelConfig("llama", 128256, 4096, 14336, 32, 32, 8, 128, dtype="bfloat16")
    models = {
        "SmolLM2-135M float32 (CPU)": ("cpu", gguf_cfg),
        "SmolLM2-135M bfloat16 (TPU layout)": ("tpu", gguf_cfg.replace(dtype="bfloat16")),
        "Llama-3-8B shape bfloat16 (GPU)": ("gpu", llama3_8b),
    }
    rows = []
    for name, (platform, cfg) in models.items():
        spec = KVCacheSpec.for_platform(
            platform, num_pages=1, page_size=page_size, num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim, dtype=cfg.dtype,
        )  # fmt: skip
        itemsize = 4 if cfg.dtype == "float32" else 2
        page_bytes = itemsize * cfg.num_layers
        for dim in spec.shape:
            page_bytes *= dim
        for context in contexts:
            manager = KVCacheManager(-(-max(contexts) // page_size) + 1, page_size)
            manager.allocate("r", context)
            pages = manager.num_pages - manager.num_free_pages
            rows.append({"model": name, "context": context, "pages": pages,
                         "bytes": pages * page_bytes})  # fmt: skip
    return rows


async def _metrics(target: serve.Target) -> dict[str, float]:
    return await serve.scrape(target)


def compilations_vs_shapes(
    target: serve.Target, tokenizer: Any, max_shapes: int
) -> list[dict[str, Any]]:
    """Requests of ever more distinct prompt lengths (one at a time, then in a burst of mixed
    lengths); after each, the server's compilation counter and compiled-step gauge."""
    rows = []
    lengths = sorted({int(1 + (i * 997) % 700) for i in range(max_shapes)})[:max_shapes]
    for i, length in enumerate(lengths, 1):
        request = workloads.random_requests(
            tokenizer, 1, (length, length), (2, 2), tokenizer.vocab_size, seed=i
        )
        asyncio.run(serve.run_requests(target, request))
        if i in (1, 2, 4, 8, 16, 32, 64, len(lengths)):
            m = asyncio.run(_metrics(target))
            rows.append({
                "distinct_shapes": i,
                "compilations": m.get("xlaserve:compilations_total", 0.0),
                "compiled_steps": m.get("xlaserve:num_compiled_steps", 0.0),
            })  # fmt: skip
    burst = workloads.random_requests(
        tokenizer, 24, (1, 700), (1, 24), tokenizer.vocab_size, seed=99
    )
    asyncio.run(serve.run_requests(target, burst, max_concurrency=24))
    m = asyncio.run(_metrics(target))
    rows.append({
        "distinct_shapes": len(lengths) + len(burst),
        "compilations": m.get("xlaserve:compilations_total", 0.0),
        "compiled_steps": m.get("xlaserve:num_compiled_steps", 0.0),
    })  # fmt: skip
    return rows


def prefix_cache(
    target: serve.Target, tokenizer: Any, args: argparse.Namespace
) -> list[dict[str, Any]]:
    """The shared-prefix set against random prompts of the same lengths (no sharing)."""
    shared = workloads.shared_prefix_requests(
        tokenizer, args.gsp_groups, args.gsp_per_group, args.gsp_system_len, 32, 16, seed=7
    )
    lengths = [(r.prompt_len, r.prompt_len) for r in shared]
    unshared = [
        workloads.random_requests(tokenizer, 1, n, (16, 16), tokenizer.vocab_size, seed=500 + i)[0]
        for i, n in enumerate(lengths)
    ]
    rows = []
    for name, requests in (("shared prefix", shared), ("no shared prefix", unshared)):
        result = asyncio.run(
            serve.benchmark(target, requests, max_concurrency=4, ignore_eos=True,
                            scrape_metrics=True)
        )  # fmt: skip
        rows.append({
            "set": name,
            "requests": len(requests),
            "hit_rate": result["server_metrics"].get("prefix_cache_hit_rate", 0.0),
            "median_ttft_ms": result["median_ttft_ms"],
            "p99_ttft_ms": result["p99_ttft_ms"],
            "output_throughput": result["output_throughput"],
        })  # fmt: skip
    return rows


# ---- plots and tables -------------------------------------------------------------------------


def plot_all(sweep: list[dict], kv: list[dict], comp: list[dict], prefix: list[dict]) -> list[str]:
    """Writes the PNGs; returns their names (relative to bench/)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    PLOTS.mkdir(exist_ok=True)
    names = []

    def save(fig: Any, name: str) -> None:
        fig.tight_layout()
        fig.savefig(PLOTS / name, dpi=80)
        plt.close(fig)
        names.append(f"plots/{name}")

    fig, ax = plt.subplots(1, 2, figsize=(9, 3.5))
    cs = [r["concurrency"] for r in sweep]
    ax[0].plot(cs, [r["output_throughput"] for r in sweep], "o-")
    ax[0].set(xscale="log", xlabel="concurrency", ylabel="output tokens/s", title="Throughput")
    ax[1].plot(cs, [r["median_ttft_ms"] for r in sweep], "o-", label="median")
    ax[1].plot(cs, [r["p99_ttft_ms"] for r in sweep], "s--", label="p99")
    ax[1].set(xscale="log", yscale="log", xlabel="concurrency", ylabel="TTFT (ms)", title="TTFT")
    ax[1].legend()
    save(fig, "concurrency.png")

    fig, ax = plt.subplots(figsize=(5, 3.5))
    for model in dict.fromkeys(r["model"] for r in kv):
        rows = [r for r in kv if r["model"] == model]
        ax.plot([r["context"] for r in rows], [r["bytes"] / 2**20 for r in rows], "o-", label=model)
    ax.set(xscale="log", yscale="log", xlabel="context length (tokens)",
           ylabel="KV cache per sequence (MiB)", title="KV memory")  # fmt: skip
    ax.legend(fontsize=7)
    save(fig, "kv_memory.png")

    fig, ax = plt.subplots(figsize=(5, 3.5))
    xs = [r["distinct_shapes"] for r in comp]
    ax.plot(xs, [r["compilations"] for r in comp], "o-", label="XLA compilations (process)")
    ax.plot(xs, [r["compiled_steps"] for r in comp], "s--", label="compiled step buckets")
    ax.set(xlabel="distinct request shapes served", ylabel="count", title="Compilations")
    ax.legend(fontsize=7)
    save(fig, "compilations.png")

    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.bar([r["set"] for r in prefix], [r["median_ttft_ms"] for r in prefix])
    for i, r in enumerate(prefix):
        ax.text(i, r["median_ttft_ms"], f"hit rate {r['hit_rate']:.0%}", ha="center", va="bottom")
    ax.set(ylabel="median TTFT (ms)", title="Prefix cache")
    save(fig, "prefix_cache.png")
    return names


def tables(sweep: list[dict], kv: list[dict], comp: list[dict], prefix: list[dict]) -> list[str]:
    lines = ["| concurrency | requests | requests/s | output tok/s | TTFT median / p99 (ms) "
             "| TPOT median (ms) |", "|---|---|---|---|---|---|"]  # fmt: skip
    lines += [f"| {r['concurrency']} | {r['completed']} | {r['request_throughput']:.2f} "
              f"| {r['output_throughput']:.1f} | {r['median_ttft_ms']:,.0f} / "
              f"{r['p99_ttft_ms']:,.0f} | {r['median_tpot_ms']:.1f} |" for r in sweep]  # fmt: skip
    lines += ["", "| model | context | pages of 16 | KV bytes per sequence |", "|---|---|---|---|"]
    lines += [f"| {r['model']} | {r['context']} | {r['pages']} | {r['bytes'] / 2**20:,.2f} MiB |"
              for r in kv]  # fmt: skip
    lines += ["", "| distinct request shapes | XLA compilations in the server process "
              "| compiled step buckets |", "|---|---|---|"]  # fmt: skip
    lines += [f"| {r['distinct_shapes']} | {r['compilations']:.0f} | {r['compiled_steps']:.0f} |"
              for r in comp]  # fmt: skip
    lines += ["", "| prompt set | requests | prefix-cache hit rate | TTFT median / p99 (ms) "
              "| output tok/s |", "|---|---|---|---|---|"]  # fmt: skip
    lines += [f"| {r['set']} | {r['requests']} | {r['hit_rate']:.0%} | "
              f"{r['median_ttft_ms']:,.0f} / {r['p99_ttft_ms']:,.0f} | "
              f"{r['output_throughput']:.1f} |" for r in prefix]  # fmt: skip
    return lines


@contextmanager
def _nothing() -> Iterator[float]:
    yield 0.0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m", help="alias or .gguf file")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128])
    p.add_argument("--min-prompts", type=int, default=4, help="prompts per concurrency, at least")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--contexts", type=int, nargs="+", default=[128, 256, 512, 1024, 2048, 4096])
    p.add_argument("--max-shapes", type=int, default=32)
    p.add_argument("--gsp-groups", type=int, default=4)
    p.add_argument("--gsp-per-group", type=int, default=6)
    p.add_argument("--gsp-system-len", type=int, default=512)
    p.add_argument("--xlaserve-args", default="--max-num-seqs 64 --max-num-batched-tokens 512 "
                   "--max-model-len 1024", help="extra `xlaserve serve` flags")  # fmt: skip
    p.add_argument("--port", type=int, default=8732)
    p.add_argument("--base-url", default=None,
                   help="measure this running server instead of starting one")  # fmt: skip
    p.add_argument("--write-results", action="store_true")
    return p


def main(argv: Sequence[str] | None = None) -> None:
    args = parser().parse_args(argv)
    import jax

    from engine.weights import open_checkpoint, resolve_model

    gguf = _gguf(args.model)
    cfg = open_checkpoint(resolve_model(str(gguf))).cfg
    tokenizer = serve.load_text_tokenizer(str(gguf))
    url = args.base_url or f"http://127.0.0.1:{args.port}"
    target = serve.Target(url, "bench")
    command = [sys.executable, "-m", "serving.cli", "serve", "--model", str(gguf),
               "--served-model-name", "bench", "--port", str(args.port),
               *args.xlaserve_args.split()]  # fmt: skip
    log = baselines.CACHE / "scaling-server.log"
    with (
        _nothing() if args.base_url else
        baselines.server_process(command, url + "/health", log, timeout=3600)
    ) as startup:  # fmt: skip
        comp = compilations_vs_shapes(target, tokenizer, args.max_shapes)
        prefix = prefix_cache(target, tokenizer, args)
        sweep = concurrency_sweep(target, tokenizer, args)
    kv = kv_memory(cfg, args.contexts)
    names = plot_all(sweep, kv, comp, prefix)
    lines = [
        *common.preamble(
            "python bench/scaling.py " + " ".join(sys.argv[1:]), {"jax": jax.__version__}
        ),
        f"- server: `xlaserve serve --model {gguf.name} {args.xlaserve_args}`"
        + (
            f", started in {startup:.0f} s (load + compile or cache-load every bucket)"
            if startup
            else ", already running"
        ),
        f"- concurrency sweep: random prompts of {args.input_len} tokens, {args.output_len} "
        f"output tokens, EOS ignored, max(concurrency, {args.min_prompts}) requests per point; "
        "beyond --max-num-seqs requests queue in the server",
        "- KV memory: pages the host allocator gives one sequence x bytes of one page in the "
        "platform's device layout (all layers)",
        "- compilations: one request at a time of ever more distinct prompt lengths (2 output "
        "tokens), then a burst of 24 mixed requests at once; the counter counts backend "
        "compilations (persistent-cache loads are not compilations)",
        f"- prefix cache: {args.gsp_groups} groups x {args.gsp_per_group} requests sharing a "
        f"{args.gsp_system_len}-token system prompt (+ ~32-token question, 16 output tokens), "
        "concurrency 4, against random prompts of the same lengths",
        "",
        *tables(sweep, kv, comp, prefix),
        "",
        *(f"![{Path(n).stem}]({n})" for n in names),
    ]
    text = "\n".join(lines)
    print(text)
    if args.write_results:
        common.write_section(TITLE, text)


if __name__ == "__main__":
    main()
