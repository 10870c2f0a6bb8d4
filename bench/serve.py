"""Online serving benchmark for any OpenAI-compatible server, modelled on `vllm bench serve` and
SGLang's `bench_serving`: flags, printed summary and JSON result follow vLLM's names.

    python bench/serve.py --base-url http://127.0.0.1:8000 --model smollm2-135m \\
        --dataset-name random --random-input-len 512 --random-output-len 128 --ignore-eos \\
        --num-prompts 64 --max-concurrency 16 --num-warmups 2 --save-result

Requests stream (`stream: true`); the client times the first text chunk (TTFT), the gaps between
chunks (ITL), per-token time after the first (TPOT) and the whole request (E2EL). Output tokens
are the server's `usage` when it sends one in the stream, else max_tokens when the request
finished for its length, else the generated text re-tokenized.
Prompts are generated offline from `--seed` (bench/workloads.py). `--scrape-metrics` reads the
server's Prometheus /metrics before and after and reports the counters' change (xlaserve and
vLLM names: prefix-cache hits, compilations, ...).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import math
import random
import sys
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `bench` and `engine` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx
import numpy as np

from bench import workloads
from bench.workloads import BenchRequest

METRICS = ("ttft", "tpot", "itl", "e2el")
TIMEOUT = httpx.Timeout(6 * 3600.0, connect=30.0)


@dataclass
class RequestResult:
    success: bool = False
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0  # seconds to the first non-empty text chunk
    latency: float = 0.0  # seconds, whole request
    itl: list[float] = field(default_factory=list)  # seconds between text chunks
    text: str = ""
    error: str = ""
    finish_reason: str | None = None


@dataclass(frozen=True)
class Target:
    """Where and how to send requests."""

    base_url: str
    model: str
    endpoint: str = "/v1/completions"
    api_key: str | None = None
    extra_body: dict[str, Any] = field(default_factory=dict)

    @property
    def chat(self) -> bool:
        return self.endpoint.endswith("/chat/completions")


def _payload(target: Target, request: BenchRequest, ignore_eos: bool) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": target.model,
        "max_tokens": request.output_len,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if ignore_eos:
        body["ignore_eos"] = True  # vLLM's extension (others: see Target.extra_body)
    if target.chat:
        body["messages"] = [{"role": "user", "content": request.prompt}]
    else:
        body["prompt"] = request.prompt
    return {**body, **target.extra_body}


def _piece(chunk: dict[str, Any]) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    return str(choice.get("text") or (choice.get("delta") or {}).get("content") or "")


async def send(
    client: httpx.AsyncClient, target: Target, request: BenchRequest, ignore_eos: bool
) -> RequestResult:
    """One streamed request, timed chunk by chunk."""
    result = RequestResult(prompt_len=request.prompt_len)
    headers = {"Authorization": f"Bearer {target.api_key}"} if target.api_key else {}
    url = target.base_url.rstrip("/") + target.endpoint
    start = last = time.perf_counter()
    pieces: list[str] = []
    try:
        body = _payload(target, request, ignore_eos)
        async with client.stream("POST", url, json=body, headers=headers) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:300]!r}"
                return result
            async for line in response.aiter_lines():
                data = line.strip().removeprefix("data:").strip()
                if not line.startswith("data:") or data == "[DONE]":
                    continue
                chunk = json.loads(data)
                if chunk.get("usage"):
                    result.output_tokens = int(chunk["usage"].get("completion_tokens") or 0)
                for choice in chunk.get("choices") or []:
                    result.finish_reason = choice.get("finish_reason") or result.finish_reason
                piece = _piece(chunk)
                if not piece:
                    continue
                now = time.perf_counter()
                if pieces:
                    result.itl.append(now - last)
                else:
                    result.ttft = now - start
                pieces.append(piece)
                last = now
        result.latency = time.perf_counter() - start
        result.text = "".join(pieces)
        result.success = bool(pieces)
        result.error = "" if pieces else "no text streamed"
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        result.error = f"{type(e).__name__}: {e}"
    return result


async def _arrivals(
    requests: Sequence[BenchRequest], rate: float, seed: int
) -> AsyncIterator[BenchRequest]:
    """Requests at Poisson arrivals of `rate` per second (all at once if infinite)."""
    rng = np.random.default_rng(seed)
    for i, request in enumerate(requests):
        if i and math.isfinite(rate):
            await asyncio.sleep(float(rng.exponential(1.0 / rate)))
        yield request


async def run_requests(
    target: Target,
    requests: Sequence[BenchRequest],
    *,
    request_rate: float = math.inf,
    max_concurrency: int | None = None,
    ignore_eos: bool = False,
    seed: int = 0,
    progress: bool = False,
) -> tuple[list[RequestResult], float]:
    """Sends every request (at most `max_concurrency` in flight); returns results in request
    order and the wall time in seconds."""
    limit = max_concurrency or len(requests) or 1
    semaphore = asyncio.Semaphore(limit)
    limits = httpx.Limits(max_connections=limit + 4, max_keepalive_connections=limit + 4)
    done = 0

    async def limited(request: BenchRequest) -> RequestResult:
        nonlocal done
        async with semaphore:
            result = await send(client, target, request, ignore_eos)
        done += 1
        if progress:
            print(f"\r{done}/{len(requests)} requests", end="", file=sys.stderr, flush=True)
        return result

    async with httpx.AsyncClient(timeout=TIMEOUT, limits=limits) as client:
        start = time.perf_counter()
        tasks = [
            asyncio.create_task(limited(r)) async for r in _arrivals(requests, request_rate, seed)
        ]
        results = list(await asyncio.gather(*tasks))
        duration = time.perf_counter() - start
    if progress:
        print(file=sys.stderr)
    return results, duration


def _stats(values: Sequence[float], prefix: str) -> dict[str, float]:
    ms = np.asarray(values, dtype=np.float64) * 1000 if len(values) else np.zeros(1)
    return {
        f"mean_{prefix}_ms": float(ms.mean()),
        f"median_{prefix}_ms": float(np.median(ms)),
        f"p99_{prefix}_ms": float(np.percentile(ms, 99)),
        f"std_{prefix}_ms": float(ms.std()),
    }


def _tpot(r: RequestResult) -> float | None:
    return (r.latency - r.ttft) / (r.output_tokens - 1) if r.output_tokens > 1 else None


def _meets(r: RequestResult, goodput: dict[str, float]) -> bool:
    measured = {"ttft": r.ttft, "tpot": _tpot(r) or 0.0, "e2el": r.latency}
    return all(measured[k] * 1000 <= limit for k, limit in goodput.items())


def summarize(
    results: Sequence[RequestResult], duration: float, goodput: dict[str, float] | None = None
) -> dict[str, Any]:
    """vLLM's metric names: throughputs over the whole run, latencies in milliseconds."""
    ok = [r for r in results if r.success]
    tpots = [t for r in ok if (t := _tpot(r)) is not None]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    summary: dict[str, Any] = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration,
        "output_throughput": total_out / duration,
        "total_token_throughput": (total_in + total_out) / duration,
    }
    if goodput:
        good = sum(_meets(r, goodput) for r in ok)
        summary |= {"goodput_targets_ms": goodput, "request_goodput": good / duration}
    summary |= _stats([r.ttft for r in ok], "ttft") | _stats(tpots, "tpot")
    summary |= _stats([x for r in ok for x in r.itl], "itl") | _stats(
        [r.latency for r in ok], "e2el"
    )
    return summary


def parse_prometheus(text: str) -> dict[str, float]:
    """`name{labels} value` lines -> {name: value}, summed over label sets."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_labels, _, value = line.rpartition(" ")
        name = name_labels.split("{", 1)[0]
        try:
            values[name] = values.get(name, 0.0) + float(value)
        except ValueError:
            continue
    return values


async def scrape(target: Target) -> dict[str, float]:
    async with httpx.AsyncClient(timeout=30) as client:
        response = await client.get(target.base_url.rstrip("/") + "/metrics")
    return parse_prometheus(response.text) if response.status_code == 200 else {}


def metrics_change(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """How the server's counters (`*_total`) moved during the run, and the prefix-cache hit
    rate over the run where the server counts prefix-cache queries (xlaserve, vLLM)."""
    change = {
        name: after[name] - before.get(name, 0.0)
        for name in after
        if name.split(":", 1)[0] in ("xlaserve", "vllm") and name.endswith("_total")
    }
    for prefix in ("xlaserve", "vllm"):
        queries = change.get(f"{prefix}:prefix_cache_queries_total")
        if queries:
            hits = change.get(f"{prefix}:prefix_cache_hits_total", 0.0)
            change["prefix_cache_hit_rate"] = hits / queries
    return change


async def benchmark(
    target: Target,
    requests: Sequence[BenchRequest],
    *,
    request_rate: float = math.inf,
    max_concurrency: int | None = None,
    warmups: Sequence[BenchRequest] = (),
    ignore_eos: bool = False,
    goodput: dict[str, float] | None = None,
    scrape_metrics: bool = False,
    tokenizer: workloads.TextTokenizer | None = None,
    seed: int = 0,
    progress: bool = False,
) -> dict[str, Any]:
    """`warmups` (untimed; prompts of their own, so that no cache has seen the timed ones),
    then the timed run; returns the JSON result."""
    warm_start = time.perf_counter()
    if warmups:
        await run_requests(target, warmups, max_concurrency=max_concurrency, ignore_eos=ignore_eos)
    warmup_seconds = time.perf_counter() - warm_start
    before = await scrape(target) if scrape_metrics else {}
    results, duration = await run_requests(
        target,
        requests,
        request_rate=request_rate,
        max_concurrency=max_concurrency,
        ignore_eos=ignore_eos,
        seed=seed,
        progress=progress,
    )
    for r, request in zip(results, requests, strict=True):  # servers that send no usage
        if r.success and not r.output_tokens:
            if r.finish_reason == "length":
                r.output_tokens = request.output_len
            elif tokenizer is not None:
                r.output_tokens = len(tokenizer.encode(r.text, add_special_tokens=False))
    result: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y%m%d-%H%M%S"),
        "base_url": target.base_url,
        "endpoint": target.endpoint,
        "model_id": target.model,
        "num_prompts": len(requests),
        "request_rate": request_rate if math.isfinite(request_rate) else "inf",
        "max_concurrency": max_concurrency,
        "num_warmups": len(warmups),
        "warmup_seconds": warmup_seconds,
        **summarize(results, duration, goodput),
    }
    if scrape_metrics:
        result["server_metrics"] = metrics_change(before, await scrape(target))
    result |= {
        "input_lens": [r.prompt_len for r in results],
        "output_lens": [r.output_tokens for r in results],
        "ttfts": [r.ttft for r in results],
        "itls": [r.itl for r in results],
        "generated_texts": [r.text for r in results],
        "errors": [r.error for r in results],
    }
    return result


def print_summary(result: dict[str, Any]) -> None:
    rows = [
        ("Successful requests", result["completed"], "d"),
        ("Failed requests", result["failed"], "d"),
        ("Maximum request concurrency", result["max_concurrency"] or "inf", ""),
        ("Benchmark duration (s)", result["duration"], ".2f"),
        ("Total input tokens", result["total_input_tokens"], "d"),
        ("Total generated tokens", result["total_output_tokens"], "d"),
        ("Request throughput (req/s)", result["request_throughput"], ".2f"),
        ("Output token throughput (tok/s)", result["output_throughput"], ".2f"),
        ("Total token throughput (tok/s)", result["total_token_throughput"], ".2f"),
    ]
    if "request_goodput" in result:
        rows.append(("Request goodput (req/s)", result["request_goodput"], ".2f"))
    lines = [f"{' Serving Benchmark Result ':=^60}"]
    lines += [f"{name + ':':<44}{value:>16{spec}}" for name, value, spec in rows]
    for metric in METRICS:
        lines.append(f"{' ' + metric.upper() + ' ':-^60}")
        for stat in ("mean", "median", "p99"):
            key = f"{stat}_{metric}_ms"
            lines.append(f"{stat.capitalize() + ' ' + metric.upper() + ' (ms):':<44}"
                         f"{result[key]:>16.2f}")  # fmt: skip
    for name, value in result.get("server_metrics", {}).items():
        lines.append(f"{name + ':':<44}{value:>16.4g}")
    lines.append("=" * 60)
    print("\n".join(lines))


def load_text_tokenizer(name: str) -> Any:
    """A tokenizer from a .gguf file, an HF checkpoint directory or a model alias."""
    from engine.tokenizer import load_tokenizer

    path = Path(name).expanduser()
    if not path.exists():
        from engine.weights import resolve_model  # imports JAX: only for aliases

        path = resolve_model(name).path
    return load_tokenizer(path)


def make_requests(
    args: argparse.Namespace, tokenizer: Any, num_prompts: int, seed: int
) -> list[BenchRequest]:
    if args.dataset_name == "random":
        return workloads.random_requests(
            tokenizer,
            num_prompts,
            workloads.parse_range(args.random_input_len),
            workloads.parse_range(args.random_output_len),
            tokenizer.vocab_size,
            seed,
        )
    if args.dataset_name == "sharegpt":
        return workloads.sharegpt_requests(
            tokenizer, num_prompts, args.sharegpt_max_input, args.sharegpt_max_output, seed
        )
    return workloads.shared_prefix_requests(
        tokenizer,
        args.gsp_num_groups,
        args.gsp_prompts_per_group,
        args.gsp_system_prompt_len,
        args.gsp_question_len,
        args.gsp_output_len,
        seed,
    )[:num_prompts]


def parse_goodput(items: Sequence[str]) -> dict[str, float]:
    """['ttft:500', 'tpot:50'] -> {'ttft': 500.0, 'tpot': 50.0} (milliseconds)."""
    targets = {}
    for item in items:
        key, _, value = item.partition(":")
        if key not in ("ttft", "tpot", "e2el") or not value:
            raise argparse.ArgumentTypeError(f"goodput target must be ttft|tpot|e2el:MS: {item!r}")
        targets[key] = float(value)
    return targets


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Benchmark an OpenAI-compatible server's online serving throughput and "
        "latency (flags follow `vllm bench serve`).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    server = p.add_argument_group("server")
    server.add_argument("--base-url", default=None, help="e.g. http://127.0.0.1:8000")
    server.add_argument("--host", default="127.0.0.1")
    server.add_argument("--port", type=int, default=8000)
    server.add_argument("--endpoint", default="/v1/completions",
                        help="/v1/completions or /v1/chat/completions")  # fmt: skip
    server.add_argument("--model", required=True, help="model name sent in requests")
    server.add_argument("--tokenizer", default=None,
                        help=".gguf, HF directory or alias; None: --model")  # fmt: skip
    server.add_argument("--api-key", default=None)
    data = p.add_argument_group("dataset")
    data.add_argument("--dataset-name", choices=("random", "sharegpt", "shared-prefix"),
                      default="random")  # fmt: skip
    data.add_argument("--num-prompts", type=int, default=100,
                      help="(shared-prefix: groups x prompts per group, at most this)")  # fmt: skip
    data.add_argument("--seed", type=int, default=0)
    data.add_argument("--random-input-len", default="512", help="N or LOW:HIGH tokens")
    data.add_argument("--random-output-len", default="128", help="N or LOW:HIGH tokens")
    data.add_argument("--sharegpt-max-input", type=int, default=1024)
    data.add_argument("--sharegpt-max-output", type=int, default=512)
    data.add_argument("--gsp-num-groups", type=int, default=4)
    data.add_argument("--gsp-prompts-per-group", type=int, default=16)
    data.add_argument("--gsp-system-prompt-len", type=int, default=1024)
    data.add_argument("--gsp-question-len", type=int, default=64)
    data.add_argument("--gsp-output-len", type=int, default=64)
    load = p.add_argument_group("load")
    load.add_argument("--request-rate", type=float, default=math.inf,
                      help="Poisson arrivals per second; inf sends all at once")  # fmt: skip
    load.add_argument("--max-concurrency", type=int, default=None)
    load.add_argument("--num-warmups", type=int, default=0, help="untimed requests first")
    load.add_argument("--ignore-eos", action="store_true")
    load.add_argument("--goodput", nargs="+", default=[], metavar="KEY:MS",
                      help="SLOs for goodput, e.g. ttft:500 tpot:50 e2el:10000")  # fmt: skip
    load.add_argument("--scrape-metrics", action="store_true",
                      help="report the change of the server's /metrics counters")  # fmt: skip
    out = p.add_argument_group("output")
    out.add_argument("--save-result", action="store_true")
    out.add_argument("--result-dir", default=".")
    out.add_argument("--result-filename", default=None)
    out.add_argument("--label", default="xlaserve")
    out.add_argument("--disable-progress", action="store_true")
    return p


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parser().parse_args(argv)
    base_url = args.base_url or f"http://{args.host}:{args.port}"
    tokenizer = load_text_tokenizer(args.tokenizer or args.model)
    random.seed(args.seed)
    requests = make_requests(args, tokenizer, args.num_prompts, args.seed)
    warmups = make_requests(args, tokenizer, args.num_warmups, args.seed + 1)[: args.num_warmups]
    target = Target(base_url, args.model, args.endpoint, args.api_key)
    result = asyncio.run(
        benchmark(
            target,
            requests,
            request_rate=args.request_rate,
            max_concurrency=args.max_concurrency,
            warmups=warmups,
            ignore_eos=args.ignore_eos,
            goodput=parse_goodput(args.goodput),
            scrape_metrics=args.scrape_metrics,
            tokenizer=tokenizer,
            seed=args.seed,
            progress=not args.disable_progress,
        )
    )
    result |= {"label": args.label, "dataset_name": args.dataset_name, "command": sys.argv}
    print_summary(result)
    if args.save_result:
        concurrency = args.max_concurrency or "inf"
        name = args.result_filename or (
            f"{args.label}-{args.dataset_name}-c{concurrency}-{result['date']}.json"
        )
        path = Path(args.result_dir) / name
        path.write_text(json.dumps(result, indent=1))
        print(f"result written to {path}")
    return result


if __name__ == "__main__":
    main()
