"""xlaserve against llama.cpp's servers and Hugging Face transformers on the same GGUF, machine
and prompts, one system after the other in one command, written as one table.

    python bench/compare.py --model smollm2-135m --concurrency 1 16 64 --num-prompts 4 24 64 \\
        --input-len 512 --output-len 128 --install-baselines --write-results

llama.cpp runs twice: `llama-server`, llama.cpp's own server batching continuously over one
parallel slot per client (the strongest form, what its users deploy), and llama-cpp-python's
server, which serves one request at a time. xlaserve and both llama.cpp servers are HTTP servers
measured by bench/serve.py (streaming, random prompts, EOS ignored, greedy). transformers has
no server: it runs offline, in static batches of the concurrency, timed step by step
(bench/baselines.py). Each server's start-up (load and warm-up, for xlaserve compiling a step per
bucket unless the compilation cache has them) is timed apart.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import baselines, common, serve, workloads
from bench.workloads import BenchRequest

TITLE = "Online serving: xlaserve vs llama.cpp vs transformers (bench/compare.py)"
SYSTEMS = ("xlaserve", "llama-server", "llamacpp", "transformers")
# llama-server's slots each hold one request's prompt and output
LLAMA_SERVER_SLOT_LEN = 1024


@dataclass
class Row:
    system: str
    concurrency: int
    result: dict[str, Any]

    def cells(self) -> str:
        r = self.result
        return (
            f"| {self.system} | {self.concurrency} | {r['completed']}/{r['num_prompts']} "
            f"| {r['request_throughput']:.2f} | {r['output_throughput']:.1f} "
            f"| {r['median_ttft_ms']:,.0f} / {r['p99_ttft_ms']:,.0f} | {r['median_tpot_ms']:.1f} "
            f"| {r['median_itl_ms']:.1f} | {r['median_e2el_ms'] / 1000:.1f} |"
        )


def _gguf(model: str) -> Path:
    path = Path(model).expanduser()
    if path.is_file():
        return path
    from engine.weights import resolve_model

    return resolve_model(model).path


def _bench(target: serve.Target, requests: list[BenchRequest], concurrency: int, **kw: Any) -> Any:
    return asyncio.run(
        serve.benchmark(target, requests, max_concurrency=concurrency, ignore_eos=True, **kw)
    )


def run_server(
    system: str,
    command: list[str],
    target: serve.Target,
    by_concurrency: dict[int, list[BenchRequest]],
    args: argparse.Namespace,
    tokenizer: Any,
) -> tuple[list[Row], float]:
    """Starts one server, runs every concurrency against it (warm-ups before the first)."""
    first = next(iter(by_concurrency.values()))[0]
    io = ((first.prompt_len,) * 2, (first.output_len,) * 2)
    warmups = workloads.random_requests(
        tokenizer, args.num_warmups, *io, tokenizer.vocab_size, seed=args.seed + 1000
    )
    log = Path(args.result_dir) / f"{system}-server.log"
    rows = []
    health = target.base_url + ("/v1/models" if system == "llamacpp" else "/health")
    with (
        _running() if not command else
        baselines.server_process(command, health, log, timeout=3600)
    ) as startup:  # fmt: skip
        print(f"{system}: ready after {startup:.1f} s", file=sys.stderr)
        for i, (concurrency, requests) in enumerate(by_concurrency.items()):
            result = _bench(
                target,
                requests,
                concurrency,
                warmups=warmups if i == 0 else (),
                tokenizer=tokenizer,
                scrape_metrics=system == "xlaserve",
                progress=True,
            )
            _save(args, system, concurrency, result)
            rows.append(Row(system, concurrency, result))
            print(rows[-1].cells(), flush=True)
    return rows, startup


@contextmanager
def _running() -> Iterator[float]:
    yield 0.0


def run_transformers(
    model_file: Path,
    by_concurrency: dict[int, list[BenchRequest]],
    args: argparse.Namespace,
    tok: Any,
) -> tuple[list[Row], str]:
    model, version = baselines.load_transformers(model_file)
    rows = []
    for concurrency, requests in by_concurrency.items():
        prompts = [tok.encode(r.prompt, add_special_tokens=False) for r in requests]
        if args.num_warmups:  # one short batch: allocations and oneDNN kernels warm
            short = [BenchRequest(r.prompt, r.prompt_len, 2) for r in requests[:concurrency]]
            baselines.transformers_run(model, prompts[:concurrency], short, concurrency)
        results, duration = baselines.transformers_run(model, prompts, requests, concurrency)
        result = {
            "num_prompts": len(requests),
            "max_concurrency": concurrency,
            **serve.summarize(results, duration),
        }
        _save(args, "transformers", concurrency, result)
        rows.append(Row("transformers (offline)", concurrency, result))
        print(rows[-1].cells(), flush=True)
    return rows, version


def _save(args: argparse.Namespace, system: str, concurrency: int, result: dict[str, Any]) -> None:
    path = Path(args.result_dir) / f"{system}-c{concurrency}.json"
    path.write_text(json.dumps(result, indent=1))


def _ratio_lines(rows: list[Row]) -> list[str]:
    by = {(r.system.split()[0], r.concurrency): r.result for r in rows}
    lines = []
    checks: list[tuple[str, str, int, Callable[[dict[str, Any]], float], str, float, bool]] = [
        ("llama-server", "output tokens/s", 64, lambda r: r["output_throughput"], "at least",
         2.5, True),
        ("llama-server", "single-stream decode (1 / median TPOT)", 1,
         lambda r: 1000 / r["median_tpot_ms"], "at least", 1.0, True),
        ("llamacpp", "output tokens/s", 64, lambda r: r["output_throughput"], "at least", 2.0,
         True),
        ("llamacpp", "median TTFT", 1, lambda r: r["median_ttft_ms"], "at most", 1.0, False),
        ("llamacpp", "single-stream decode (1 / median TPOT)", 1,
         lambda r: 1000 / r["median_tpot_ms"], "at least", 0.7, True),
    ]  # fmt: skip
    for peer, name, c, value, bound, target, higher in checks:
        if ("xlaserve", c) in by and (peer, c) in by:
            ratio = value(by["xlaserve", c]) / value(by[peer, c])
            met = ratio >= target if higher else ratio <= target
            lines.append(
                f"- {name} at concurrency {c}, xlaserve / {peer}: {ratio:.2f}x "
                f"(target {bound} {target}x: {'met' if met else 'NOT met'})"
            )
    return lines


def table(rows: list[Row]) -> list[str]:
    return [
        "| system | concurrency | requests done | requests/s | output tok/s "
        "| TTFT median / p99 (ms) | TPOT median (ms) | ITL median (ms) | E2EL median (s) |",
        "|---|---|---|---|---|---|---|---|---|",
        *(r.cells() for r in rows),
    ]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m", help="alias or .gguf file")
    p.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--num-prompts", type=int, nargs="+", default=[4, 24, 64],
                   help="one per --concurrency")  # fmt: skip
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--num-warmups", type=int, default=2)
    p.add_argument("--seed", type=int, default=0,
                   help="change it when rerunning against a used server")  # fmt: skip
    p.add_argument("--threads", type=int, default=2, help="llama.cpp's --n_threads")
    p.add_argument("--xlaserve-args", default="--max-num-seqs 64 --max-num-batched-tokens 512 "
                   "--max-model-len 1024", help="extra `xlaserve serve` flags")  # fmt: skip
    p.add_argument("--install-baselines", action="store_true",
                   help="build llama-server and llama-cpp-python[server] if missing "
                   "(cached)")  # fmt: skip
    p.add_argument("--port", type=int, default=8731,
                   help="xlaserve's; llama-cpp-python's is +1, llama-server's +2")  # fmt: skip
    p.add_argument("--xlaserve-url", default=None,
                   help="measure this running xlaserve (started with --xlaserve-args)")  # fmt: skip
    p.add_argument("--result-dir", default=str(baselines.CACHE / "bench-results"))
    p.add_argument("--write-results", action="store_true")
    return p


def main(argv: Sequence[str] | None = None) -> None:
    args = parser().parse_args(argv)
    if len(args.num_prompts) != len(args.concurrency):
        raise SystemExit("--num-prompts needs one count per --concurrency")
    Path(args.result_dir).mkdir(parents=True, exist_ok=True)
    gguf = _gguf(args.model)
    tokenizer = serve.load_text_tokenizer(str(gguf))
    io = ((args.input_len,) * 2, (args.output_len,) * 2)
    by_concurrency = {
        c: workloads.random_requests(tokenizer, n, *io, tokenizer.vocab_size, seed=args.seed + c)
        for c, n in zip(args.concurrency, args.num_prompts, strict=True)
    }
    url = f"http://127.0.0.1:{args.port}"
    rows: list[Row] = []
    notes: list[str] = []
    versions: dict[str, str] = {}
    if "xlaserve" in args.systems:
        import jax

        versions["jax"] = jax.__version__
        command = [sys.executable, "-m", "serving.cli", "serve", "--model", str(gguf),
                   "--served-model-name", "bench", "--port", str(args.port),
                   *args.xlaserve_args.split()]  # fmt: skip
        target = serve.Target(args.xlaserve_url or url, "bench")
        got, startup = run_server(
            "xlaserve",
            [] if args.xlaserve_url else command,
            target,
            by_concurrency,
            args,
            tokenizer,
        )
        rows += got
        compiles = sum(
            r.result.get("server_metrics", {}).get("xlaserve:compilations_total", 0) for r in got
        )
        started = (
            f"start-up (load + compile or cache-load every bucket) {startup:.0f} s"
            if startup
            else f"already running at {args.xlaserve_url} (started apart with --xlaserve-args)"
        )
        notes.append(f"- xlaserve: {started}; compilations during the timed runs: {compiles:.0f}")
    if "llama-server" in args.systems:
        if args.install_baselines:
            baselines.install_llama_server()
        if not baselines.llama_server().exists():
            raise SystemExit("llama-server baseline missing: rerun with --install-baselines")
        versions["llama-server"] = baselines.llama_server_version()
        slots = max(args.concurrency)
        command = baselines.llama_server_command(
            gguf, args.port + 2, args.threads, slots, LLAMA_SERVER_SLOT_LEN
        )
        target = serve.Target(f"http://127.0.0.1:{args.port + 2}", "bench")
        got, startup = run_server("llama-server", command, target, by_concurrency, args, tokenizer)
        rows += got
        notes.append(
            f"- llama-server: {slots} parallel slots of {LLAMA_SERVER_SLOT_LEN} tokens, "
            f"continuous batching, {args.threads} threads; start-up (load) {startup:.0f} s"
        )
    if "llamacpp" in args.systems:
        if args.install_baselines:
            baselines.install_llamacpp()
        if not baselines.llamacpp_installed():
            raise SystemExit("llama.cpp baseline missing: rerun with --install-baselines")
        versions["llama-cpp-python"] = baselines.llamacpp_version()
        command = [str(baselines.llamacpp_python()), "-m", "llama_cpp.server",
                   "--model", str(gguf), "--n_threads", str(args.threads),
                   "--n_threads_batch", str(args.threads), "--n_ctx", "2048",
                   # its default lets each new request cut off the one running: queue them
                   "--interrupt_requests", "False",
                   "--host", "127.0.0.1", "--port", str(args.port + 1)]  # fmt: skip
        # llama-cpp-python has no ignore_eos; min_tokens = max_tokens keeps EOS out the same way
        llama_url = f"http://127.0.0.1:{args.port + 1}"
        target = serve.Target(llama_url, "bench", extra_body={"min_tokens": args.output_len})
        got, startup = run_server("llamacpp", command, target, by_concurrency, args, tokenizer)
        rows += got
        notes.append(f"- llama.cpp server start-up (load): {startup:.0f} s")
    if "transformers" in args.systems:
        got_t, version = run_transformers(gguf, by_concurrency, args, tokenizer)
        rows += got_t
        versions["transformers"] = version
    lines = [
        *common.preamble("python bench/compare.py " + shlex.join(sys.argv[1:]), versions),
        f"- model: {gguf.name}; random prompts of {args.input_len} tokens, "
        f"{args.output_len} output tokens each, greedy, EOS ignored; raw JSON in "
        f"{args.result_dir}",
        *notes,
        "",
        *table(rows),
        "",
        *_ratio_lines(rows),
    ]
    text = "\n".join(lines)
    print(text)
    if args.write_results:
        common.write_section(TITLE, text)


if __name__ == "__main__":
    main()
