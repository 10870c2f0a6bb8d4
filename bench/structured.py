# ruff: noqa: E501  (the schema table reads better one per line)
"""Structured output's cost, side by side in one run on one engine: output throughput at a
concurrency of C with JSON schemas against the same requests unconstrained, the median time to
first token with a cached schema against unconstrained, each schema's first compilation, and
the host time spent computing token masks per step (overlapped with the forward).

    .venv/bin/python bench/structured.py [--model smollm2-135m] [--concurrency 16]
        [--num-requests 64] [--max-tokens 128] [--write-results]

Requests are chat prompts asking for JSON; each asks for one of SCHEMAS in turn, greedy. The
constrained run's requests end when their JSON does; both runs report output tokens per second
over the whole run, and time to first token from adding a request to its first token (a closed
loop keeps C requests in flight). Schemas are compiled once before the constrained run (the
server's cache), and each first-compile time is measured apart, uncached.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path

if __package__ in (None, ""):  # run as a script: the checkout's root holds `bench`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common
from engine.builder import build_engine
from engine.chat_template import apply_chat_template
from engine.config import CacheConfig, CompilationConfig, EngineConfig, SchedulerConfig
from engine.llm_engine import LLMEngine
from engine.request import SamplingParams
from engine.structured.spec import StructuredOutputs
from serving.cli import DEFAULT_CACHE_DIR, parse_bytes

TITLE = "Structured output (bench/structured.py)"
_S = {"type": "string", "maxLength": 24}
SCHEMAS: list[tuple[str, dict]] = [
    ("a person", {"type": "object", "properties": {"name": _S, "age": {"type": "integer", "minimum": 0, "maximum": 120}}, "required": ["name", "age"]}),
    ("a movie", {"type": "object", "properties": {"title": _S, "year": {"type": "integer"}, "genres": {"type": "array", "items": {"enum": ["drama", "comedy", "action", "horror"]}, "maxItems": 3}}, "required": ["title", "year", "genres"]}),
    ("a shopping list", {"type": "array", "items": {"type": "object", "properties": {"item": _S, "qty": {"type": "integer", "minimum": 1}}, "required": ["item", "qty"]}, "minItems": 1, "maxItems": 5}),
    ("an address", {"type": "object", "properties": {"street": _S, "city": _S, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}, "country": {"enum": ["US", "FR", "DE", "JP"]}}, "required": ["street", "city", "zip", "country"]}),
    ("a weather report", {"type": "object", "properties": {"city": _S, "temperature": {"type": "number", "minimum": -60, "maximum": 60}, "sky": {"enum": ["clear", "cloudy", "rain", "snow"]}}, "required": ["city", "temperature", "sky"]}),
    ("a line segment", {"$defs": {"p": {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}}, "required": ["x", "y"]}}, "type": "object", "properties": {"a": {"$ref": "#/$defs/p"}, "b": {"$ref": "#/$defs/p"}}, "required": ["a", "b"]}),
    ("a book review", {"type": "object", "properties": {"book": _S, "stars": {"enum": [1, 2, 3, 4, 5]}, "summary": {"type": "string", "maxLength": 80}}, "required": ["book", "stars", "summary"]}),
    ("an event", {"type": "object", "properties": {"name": _S, "date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"}, "online": {"type": "boolean"}}, "required": ["name", "date", "online"]}),
]  # fmt: skip


@dataclass
class Run:
    name: str
    seconds: float
    output_tokens: int
    ttfts: list[float]
    steps: int

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds

    def row(self) -> str:
        ttft = statistics.median(self.ttfts) * 1e3
        return (
            f"| {self.name} | {len(self.ttfts)} | {self.output_tokens} | {self.seconds:.1f} | "
            f"{self.tokens_per_s:.1f} | {ttft:.0f} | {self.seconds / self.steps * 1e3:.1f} |"
        )


def prompts(engine: LLMEngine, n: int) -> list[tuple[list[int], StructuredOutputs]]:
    out = []
    for i in range(n):
        what, schema = SCHEMAS[i % len(SCHEMAS)]
        messages = [{"role": "user", "content": f"Describe {what} as JSON (request {i})."}]
        text = apply_chat_template(engine.tokenizer, messages)
        ids = engine.tokenizer.encode(text, add_special_tokens=False)
        out.append((ids, StructuredOutputs.from_schema(schema)))
    return out


def closed_loop(
    engine: LLMEngine, work: list[tuple[list[int], SamplingParams]], concurrency: int, name: str
) -> Run:
    """Keeps `concurrency` requests in flight until all of `work` is done."""
    queue = list(enumerate(work))
    added: dict[str, float] = {}
    ttfts: list[float] = []
    tokens = steps = 0
    start = time.perf_counter()
    while queue or engine.has_unfinished_requests():
        while queue and engine.num_unfinished_requests() < concurrency:
            i, (ids, params) = queue.pop(0)
            engine.add_request(f"{name}-{i}", ids, params)
            added[f"{name}-{i}"] = time.perf_counter()
        steps += 1
        for output in engine.step():
            new = sum(len(c.token_ids) for c in output.outputs)
            if new and output.request_id in added:
                ttfts.append(time.perf_counter() - added.pop(output.request_id))
            tokens += new
    return Run(name, time.perf_counter() - start, tokens, ttfts, steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--kv-cache-memory", type=parse_bytes, default=parse_bytes("1GiB"))
    parser.add_argument("--max-model-len", type=int, default=None, help="default: 512 + max tokens")
    parser.add_argument("--write-results", action="store_true")
    args = parser.parse_args()

    engine = build_engine(
        EngineConfig(
            args.model,
            cache=CacheConfig(page_size=16, memory_bytes=args.kv_cache_memory),
            scheduler=SchedulerConfig(
                max_num_seqs=args.concurrency,
                max_num_batched_tokens=args.max_num_batched_tokens,
                max_model_len=args.max_model_len or 512 + args.max_tokens,
            ),
            compilation=CompilationConfig(cache_dir=DEFAULT_CACHE_DIR),  # reruns skip compiling
        )
    )
    assert isinstance(engine, LLMEngine), "one engine (no data parallelism) for this benchmark"
    work = prompts(engine, args.num_requests)
    compiler = engine.grammars.compiler
    first_compile = [compiler.grammar_seconds(spec) for _, spec in work[: len(SCHEMAS)]]
    for _, spec in work:
        engine.compile_grammar(spec).result()  # cached, as a server's would be
    free = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    runs = [closed_loop(engine, [(ids, free) for ids, _ in work], args.concurrency, "free")]
    fills_before = engine.grammars.fill_seconds, engine.grammars.num_fills
    constrained = [(ids, free.replace(structured_outputs=spec)) for ids, spec in work]
    runs.append(closed_loop(engine, constrained, args.concurrency, "json"))
    fill_s = engine.grammars.fill_seconds - fills_before[0]
    fills = engine.grammars.num_fills - fills_before[1]
    compilations = engine.stats().compilations_after_warm_up

    ratio = runs[1].tokens_per_s / runs[0].tokens_per_s
    ttft_ratio = statistics.median(runs[1].ttfts) / statistics.median(runs[0].ttfts)
    lines = [
        *common.preamble(
            ".venv/bin/python bench/structured.py " + " ".join(sys.argv[1:]),
            {"jax": version("jax"), "llguidance": version("llguidance")},
        ),
        f"- workload: {args.num_requests} chat requests for JSON ({len(SCHEMAS)} schemas in "
        f"turn), concurrency {args.concurrency}, at most {args.max_tokens} tokens, greedy",
        "",
        "| run | requests | output tokens | seconds | output tokens/s | median TTFT ms | ms/step |",
        "|---|---|---|---|---|---|---|",
        *(r.row() for r in runs),
        "",
        f"JSON-schema / unconstrained output throughput: {ratio:.2f}x (target >= 0.9x); "
        f"median TTFT with a cached schema: {ttft_ratio:.2f}x unconstrained (target <= 1.1x).",
        f"Token masks: {fill_s / max(fills, 1) * 1e3:.2f} ms of host time per constrained step "
        f"({fills} steps), computed while the device runs the forward; "
        f"{compilations} XLA compilations after warm-up.",
        "First compilation of each schema (ms, uncached; target < 50): "
        + ", ".join(f"{s * 1e3:.1f}" for s in first_compile)
        + f"; median {statistics.median(first_compile) * 1e3:.1f}.",
    ]
    text = "\n".join(lines)
    print(text)
    if args.write_results:
        common.write_section(TITLE, text)


if __name__ == "__main__":
    main()
