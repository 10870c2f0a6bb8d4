"""Offline throughput of xlaserve against Hugging Face transformers' batched `generate`, on the
same model, machine and prompts, in one run.

    .venv/bin/python bench/throughput.py [--num-prompts 256] [--input-len 128:512]
        [--output-len 128] [--max-num-seqs 128] [--max-num-batched-tokens 512]
        [--kv-cache-memory 4GiB] [--dtype float32|bfloat16] [--hf-batch-size 16] [--skip-hf]
        [--write-results]

Prompts are random token ids (fixed seed) with lengths drawn from --input-len; every request
generates exactly --output-len tokens (EOS ignored), greedy. Also measures single-stream decode
(one request, 512-token prompt) against the bandwidth floor: weight bytes read once per token at
the machine's measured read bandwidth. Both systems run in --dtype.

The engine's defaults here are for throughput: 128 sequences at once (vLLM's default is 256),
and a KV cache that holds all of them at full length (128 x 640 tokens of SmolLM2 are ~3.5 GiB
in float32), so that nothing is preempted; 512 tokens a step keep chunked prefill riding along
with the decodes.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path

if __package__ in (None, ""):  # run as a script: the checkout's root holds `bench`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common
from engine.builder import build_engine
from engine.config import CacheConfig, CompilationConfig, EngineConfig, SchedulerConfig
from engine.llm_engine import run_to_completion
from engine.protocol import Engine
from engine.request import SamplingParams
from engine.weights import resolve_model
from serving.cli import DEFAULT_CACHE_DIR, parse_bytes

TITLE = "Offline throughput (bench/throughput.py)"


@dataclass
class Result:
    system: str
    seconds: float
    num_requests: int
    output_tokens: int

    def row(self) -> str:
        rps, tps = self.num_requests / self.seconds, self.output_tokens / self.seconds
        return (
            f"| {self.system} | {self.num_requests} | {self.seconds:.1f} | {rps:.2f} | {tps:.1f} |"
        )


def make_prompts(n: int, lengths: tuple[int, int], vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    low = 256  # skip the first ids, where models keep their special tokens
    return [[rng.randrange(low, vocab) for _ in range(rng.randint(*lengths))] for _ in range(n)]


def run_xlaserve(engine: Engine, prompts: list[list[int]], output_len: int, dtype: str) -> Result:
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    ids = [f"bench-{i}" for i in range(len(prompts))]
    start = time.perf_counter()
    for request_id, prompt in zip(ids, prompts, strict=True):
        engine.add_request(request_id, prompt, params)
    outputs = run_to_completion(engine, ids)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return Result(f"xlaserve ({dtype})", seconds, len(prompts), tokens)


def single_stream_decode(engine: Engine, output_len: int) -> float:
    """Decode tokens/s of one request after a 512-token prompt (first token excluded)."""
    [prompt] = make_prompts(1, (512, 512), engine.model_info().vocab_size, seed=1)
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    engine.add_request("single", prompt, params)
    first = None
    while engine.has_unfinished_requests():
        for output in engine.step():
            if first is None and output.outputs[0].token_ids:
                first = time.perf_counter()
    assert first is not None
    return (output_len - 1) / (time.perf_counter() - first)


def run_transformers(
    path: str, prompts: list[list[int]], output_len: int, batch: int, dtype: str
) -> Result:
    import torch
    import transformers

    torch.set_num_threads(len(os.sched_getaffinity(0)))
    files = resolve_model(path)
    kwargs = {"gguf_file": files.path.name} if files.is_gguf else {}
    directory = files.path.parent if files.is_gguf else files.path
    model = transformers.AutoModelForCausalLM.from_pretrained(
        directory, dtype=getattr(torch, dtype), **kwargs
    ).eval()
    pad = 0
    start = time.perf_counter()
    tokens = 0
    for i in range(0, len(prompts), batch):
        group = prompts[i : i + batch]
        width = max(map(len, group))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in group])  # left padding
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group])
        with torch.no_grad():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=output_len,
                min_new_tokens=output_len,
                do_sample=False,
                pad_token_id=pad,
            )
        tokens += (out.shape[1] - width) * len(group)
    return Result(
        f"transformers {transformers.__version__} ({dtype}, batch {batch})",
        time.perf_counter() - start,
        len(prompts),
        tokens,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--input-len", default="128:512", help="fixed N or a range LOW:HIGH")
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--max-num-seqs", type=int, default=128)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--kv-cache-memory", type=parse_bytes, default=parse_bytes("4GiB"))
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--hf-batch-size", type=int, default=16)
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--write-results", action="store_true")
    args = parser.parse_args()
    low, _, high = args.input_len.partition(":")
    lengths = (int(low), int(high or low))

    engine = build_engine(
        EngineConfig(
            args.model,
            dtype=args.dtype,
            cache=CacheConfig(page_size=16, memory_bytes=args.kv_cache_memory),
            scheduler=SchedulerConfig(
                max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens,
                max_model_len=max(lengths[1], 512) + max(args.output_len, 64),
            ),
            compilation=CompilationConfig(cache_dir=DEFAULT_CACHE_DIR),  # reruns skip compiling
        )
    )
    prompts = make_prompts(args.num_prompts, lengths, engine.model_info().vocab_size)
    results = [run_xlaserve(engine, prompts, args.output_len, args.dtype)]
    preemptions = engine.stats().num_preemptions
    decode = single_stream_decode(engine, min(args.output_len, 64))
    if not args.skip_hf:
        results.append(
            run_transformers(args.model, prompts, args.output_len, args.hf_batch_size, args.dtype)
        )

    weight_bytes = engine.stats().weight_bytes
    read_gbs = common.memory_bandwidth_gbs()
    floor = read_gbs * 1e9 / weight_bytes
    lines = [
        *common.preamble(
            ".venv/bin/python bench/throughput.py " + " ".join(sys.argv[1:]),
            {"jax": version("jax")},
        ),
        f"- model: {args.model}, {args.dtype} weights ({weight_bytes / 1e6:.0f} MB)",
        f"- workload: {args.num_prompts} prompts of {args.input_len} tokens, "
        f"{args.output_len} output tokens each, greedy, EOS ignored",
        f"- xlaserve: --max-num-seqs {args.max_num_seqs}, --max-num-batched-tokens "
        f"{args.max_num_batched_tokens}, KV cache {engine.stats().num_kv_pages} pages of 16 "
        "tokens "
        f"({args.kv_cache_memory / 2**30:.1f} GiB); {preemptions} preemptions",
        "",
        "| system | requests | seconds | requests/s | output tokens/s |",
        "|---|---|---|---|---|",
        *(r.row() for r in results),
        "",
    ]
    if len(results) == 2:
        ratio = (results[0].output_tokens / results[0].seconds) / (
            results[1].output_tokens / results[1].seconds
        )
        lines.append(f"Output throughput ratio xlaserve / transformers: {ratio:.2f}x (target 3x).")
    lines.append(
        f"Single-stream decode after a 512-token prompt: {decode:.1f} tokens/s; bandwidth floor "
        f"{floor:.1f} tokens/s (weights once per token at {read_gbs:.1f} GB/s read): "
        f"{decode / floor:.0%} of it (target 60%)."
    )
    text = "\n".join(lines)
    print(text)
    if args.write_results:
        common.write_section(TITLE, text)


if __name__ == "__main__":
    main()
