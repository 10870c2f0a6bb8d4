"""Speculative decoding (n-gram), side by side in one run on one model: output tokens/s with
speculation off and on, single stream and at a concurrency of 4, on a copy-heavy workload
(edit a given source file; summarise a document quoting it) and on random prompts, with the
acceptance rate by position in the proposal.

    .venv/bin/python bench/speculative.py [--model smollm2-135m] [--num-speculative-tokens 3 5]
        [--requests 8] [--max-tokens 256] [--concurrency 1 4] [--write-results]
    .venv/bin/python bench/speculative.py --concurrency 1 2 4 8 --max-num-seqs 8 \
        --disable-by-batch-size 8      # where speculation stops paying (its default's data)
    .venv/bin/python bench/speculative.py --smoke      # a tiny random model, seconds

The engines (speculation off, and one for each k) are built first (compiled ahead: no
compilation inside a timed run); each run is a closed loop that keeps C requests in flight
until its requests are done, greedy, and reports output tokens per second over the whole run
(prefill included: each engine and server computes the prompts at the first concurrency and
finds them in its prefix cache at the next). With --llama-server, llama.cpp's own server runs
the same token ids on the GGUF, without and with its n-gram speculation. Targets (issue #22):
>= 1.8x on the copy-heavy single stream, >= 0.95x on random prompts.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any

import httpx

if __package__ in (None, ""):  # run as a script: the checkout's root holds `bench`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import baselines, common, workloads
from engine.builder import build_engine
from engine.chat_template import apply_chat_template
from engine.config import (
    CacheConfig,
    CompilationConfig,
    EngineConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from engine.llm_engine import LLMEngine
from engine.request import SamplingParams
from engine.weights import resolve_model
from serving.cli import DEFAULT_CACHE_DIR

TITLE = "Speculative decoding (bench/speculative.py)"
ROOT = Path(__file__).resolve().parents[1]
SOURCES = ["engine/kv_cache.py", "engine/output_processor.py", "engine/scheduler.py"]
DOCUMENTS = ["README.md", "engine/sampling.py"]


@dataclass
class Run:
    system: str
    workload: str
    concurrency: int
    k: int  # proposed tokens per step (0: speculation off)
    seconds: float
    output_tokens: int
    accepted: tuple[int, ...]  # accepted tokens by position in this run
    drafts: int
    # llama-server reports drafted and accepted tokens, not by position
    drafted_accepted: tuple[int, int] | None = None

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds


def copy_heavy_prompts(engine: LLMEngine, n: int, max_chars: int) -> list[list[int]]:
    """Chat prompts whose answers copy most of a given text: rewrite a source file with a
    rename, its answer's code fence already open (as an editor's "apply" request sends it), or
    summarise a document quoting its sentences. The text comes first and the instruction
    after: asked the other way round, SmolLM2-135M answered two of five prompts in its own
    words (1.07 and 1.35 tokens a step at k = 3), which measures a workload that does not copy."""
    out = []
    for i in range(n):
        if i % 2 == 0:
            text = (ROOT / SOURCES[i // 2 % len(SOURCES)]).read_text()[:max_chars]
            ask = "Rewrite the file above with every `self.` renamed to `this.`. Output it whole."
            message, answer = f"```python\n{text}\n```\n\n{ask}", "```python\n"
        else:
            text = (ROOT / DOCUMENTS[i // 2 % len(DOCUMENTS)]).read_text()[:max_chars]
            ask = "Summarise the document above, quoting its key sentences word for word."
            message, answer = f"{text}\n\n{ask}", ""
        rendered = apply_chat_template(engine.tokenizer, [{"role": "user", "content": message}])
        out.append(engine.tokenizer.encode(rendered + answer, add_special_tokens=False))
    return out


def random_prompts(engine: LLMEngine, n: int, length: int, vocab: int) -> list[list[int]]:
    requests = workloads.random_requests(engine.tokenizer, n, (length, length), (1, 1), vocab, 0)
    return [engine.tokenizer.encode(r.prompt, add_special_tokens=False) for r in requests]


def closed_loop(
    engine: LLMEngine, prompts: list[list[int]], params: SamplingParams, concurrency: int
) -> tuple[float, int]:
    queue = list(enumerate(prompts))
    tokens = 0
    start = time.perf_counter()
    while queue or engine.has_unfinished_requests():
        while queue and engine.num_unfinished_requests() < concurrency:
            i, ids = queue.pop(0)
            engine.add_request(f"bench-{time.perf_counter()}-{i}", ids, params)
        for output in engine.step():
            tokens += sum(len(c.token_ids) for c in output.outputs)
    return time.perf_counter() - start, tokens


def measure(
    engine: LLMEngine, workload: str, prompts: list[list[int]], c: int, max_tokens: int
) -> Run:
    before = engine.stats()
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    seconds, tokens = closed_loop(engine, prompts, params, c)
    after = engine.stats()
    accepted = tuple(
        a - b
        for a, b in zip(
            after.spec_decode_num_accepted_tokens_per_pos,
            before.spec_decode_num_accepted_tokens_per_pos,
            strict=True,
        )
    )
    drafts = after.spec_decode_num_drafts - before.spec_decode_num_drafts
    k = len(after.spec_decode_num_accepted_tokens_per_pos)
    return Run("xlaserve", workload, c, k, seconds, tokens, accepted, drafts)


def build(args: argparse.Namespace, speculative: SpeculativeConfig | None) -> LLMEngine:
    engine = build_engine(
        EngineConfig(
            args.model,
            cache=CacheConfig(page_size=16, num_pages=args.num_pages),
            scheduler=SchedulerConfig(
                max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens,
                max_model_len=args.max_model_len,
            ),
            compilation=CompilationConfig(
                cache_dir=DEFAULT_CACHE_DIR, warm_up="lazy" if args.smoke else "eager"
            ),
            speculative=speculative,
        )
    )  # fmt: skip
    assert isinstance(engine, LLMEngine), "one engine (no data parallelism) for this benchmark"
    return engine


def llama_server_runs(
    args: argparse.Namespace, prompt_sets: dict[str, list[list[int]]]
) -> list[Run]:
    """The same prompts (token ids) and closed loops against llama-server on the model's GGUF
    (its Q4_1 blocks: not the weights xlaserve runs here, so its outputs differ; the speed-ups
    compare), one server without and one with its n-gram speculation, a slot per request in
    flight."""
    gguf = resolve_model(args.model).path
    k = max(args.num_speculative_tokens)
    ngram = [
        "--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "3",
        "--spec-ngram-simple-size-m", str(k), "--spec-draft-n-max", str(k),
    ]  # fmt: skip
    runs = []
    for extra, spec_k in (([], 0), (ngram, k)):
        port = 8937
        command = baselines.llama_server_command(
            gguf, port, threads=2, slots=max(args.concurrency), slot_len=args.max_model_len
        )
        url = f"http://127.0.0.1:{port}"
        log = Path(tempfile.mkdtemp()) / "llama-server.log"
        with baselines.server_process([*command, *extra], url + "/health", log, timeout=300):
            for name, prompts in prompt_sets.items():
                for c in args.concurrency:
                    runs.append(_llama_closed_loop(url, name, prompts, c, spec_k, args.max_tokens))
    return runs


def _llama_closed_loop(
    url: str, workload: str, prompts: list[list[int]], c: int, k: int, max_tokens: int
) -> Run:
    def complete(ids: list[int]) -> dict[str, Any]:
        body = {"prompt": ids, "n_predict": max_tokens, "temperature": 0, "ignore_eos": True}
        response = httpx.post(url + "/completion", json=body, timeout=3600)
        response.raise_for_status()
        return response.json()

    start = time.perf_counter()
    with ThreadPoolExecutor(c) as pool:
        answers = list(pool.map(complete, prompts))
    seconds = time.perf_counter() - start
    tokens = sum(a["tokens_predicted"] for a in answers)
    drafted = sum(a["timings"].get("draft_n", 0) for a in answers)
    accepted = sum(a["timings"].get("draft_n_accepted", 0) for a in answers)
    counts = (drafted, accepted) if k else None
    return Run("llama-server Q4_1", workload, c, k, seconds, tokens, (), 0, counts)


def table(runs: list[Run]) -> list[str]:
    plain = {(r.system, r.workload, r.concurrency): r for r in runs if not r.k}
    lines = [
        "| system | workload | concurrency | speculation | output tokens | seconds | "
        "output tokens/s | speed-up | acceptance by position | mean accepted length |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        base = plain[(r.system, r.workload, r.concurrency)]
        rates = ", ".join(f"{a / max(r.drafts, 1):.2f}" for a in r.accepted) or "-"
        mean = f"{1 + sum(r.accepted) / r.drafts:.2f}" if r.drafts else "-"
        if r.drafted_accepted is not None:
            drafted, accepted = r.drafted_accepted
            rates = f"{accepted / max(drafted, 1):.2f} of {drafted} drafted (all positions)"
        spec = f"ngram k={r.k}" if r.k else "off"
        lines.append(
            f"| {r.system} | {r.workload} | {r.concurrency} | {spec} | {r.output_tokens} | "
            f"{r.seconds:.1f} | {r.tokens_per_s:.1f} | {r.tokens_per_s / base.tokens_per_s:.2f}x | "
            f"{rates} | {mean} |"
        )
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument(
        "--num-speculative-tokens", type=int, nargs="+", default=[3, 5], help="one engine each"
    )
    parser.add_argument("--prompt-lookup-min", type=int, default=2)
    parser.add_argument("--prompt-lookup-max", type=int, default=5)
    parser.add_argument("--requests", type=int, default=8, help="per run")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--max-chars", type=int, default=2400, help="of each copied text")
    parser.add_argument("--random-prompt-len", type=int, default=512)
    parser.add_argument("--max-num-batched-tokens", type=int, default=256)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--num-pages", type=int, default=1024)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--max-num-seqs", type=int, default=4)
    parser.add_argument(
        "--disable-by-batch-size",
        type=int,
        default=SpeculativeConfig.disable_by_batch_size,
        help="speculation off above this many running sequences",
    )
    parser.add_argument(
        "--llama-server",
        action="store_true",
        help="also llama.cpp's llama-server on the model's Q4_1 GGUF, without and with its "
        "n-gram speculation (ngram-simple, lookup 3 tokens, drafts of the largest k)",
    )
    parser.add_argument("--smoke", action="store_true", help="a tiny random model, few requests")
    parser.add_argument("--write-results", action="store_true")
    args = parser.parse_args()
    if args.smoke:
        from tests.engine.tiny_model import write_tiny_checkpoint

        args.model = str(write_tiny_checkpoint(Path(tempfile.mkdtemp()) / "tiny"))
        args.requests, args.max_tokens, args.max_chars, args.random_prompt_len = 2, 8, 40, 16
        args.max_num_batched_tokens, args.max_model_len, args.num_pages = 32, 256, 64
    specs = [
        SpeculativeConfig(
            "ngram",
            k,
            prompt_lookup_min=args.prompt_lookup_min,
            prompt_lookup_max=args.prompt_lookup_max,
            disable_by_batch_size=args.disable_by_batch_size,
        )
        for k in args.num_speculative_tokens
    ]
    engines = [build(args, None), *(build(args, spec) for spec in specs)]
    vocab = engines[0].model_info().vocab_size
    prompt_sets = {
        "copy-heavy": copy_heavy_prompts(engines[0], args.requests, args.max_chars),
        "random": random_prompts(engines[0], args.requests, args.random_prompt_len, vocab),
    }
    runs = [
        measure(engine, name, prompts, c, args.max_tokens)
        for name, prompts in prompt_sets.items()
        for c in args.concurrency
        for engine in engines
    ]
    if args.llama_server:
        runs += llama_server_runs(args, prompt_sets)
    compilations = sum(e.stats().compilations_after_warm_up for e in engines[1:])
    lines = [
        *common.preamble(
            ".venv/bin/python bench/speculative.py " + " ".join(sys.argv[1:]),
            {"jax": version("jax")},
        ),
        f"- workload: {args.requests} requests per run, greedy, {args.max_tokens} output tokens "
        f"each (EOS ignored); n-gram lookup {args.prompt_lookup_min}..{args.prompt_lookup_max}, "
        f"auto-off above {args.disable_by_batch_size} sequences",
        "",
        *table(runs),
        "",
        f"Targets: >= 1.8x copy-heavy single stream, >= 0.95x random; {compilations} XLA "
        "compilations after warm-up in the speculative engines (lazy in --smoke).",
    ]
    text = "\n".join(lines)
    print(text)
    if args.write_results and not args.smoke:
        common.write_section(TITLE, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
