"""The `xlaserve` command line: `xlaserve generate`, `xlaserve serve`, `xlaserve convert`.

Errors meant for the user (a missing model, a corrupt file, a bad request) are printed as one
line and exit with status 1; argument errors exit with argparse's status 2.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from engine.config import (
    DEFAULT_MAX_MODEL_LEN,
    DTYPES,
    EXPERT_DISPATCHES,
    KV_CACHE_DTYPES,
    QUANTIZATION_METHODS,
    CacheConfig,
    CompilationConfig,
    EngineConfig,
    LoRAConfig,
    ObservabilityConfig,
    ParallelConfig,
    QuantizationConfig,
    SchedulerConfig,
    SpeculativeConfig,
    StructuredOutputConfig,
)
from engine.errors import XlaserveError
from sharding.layout import ShardingLayout

DEFAULT_MODEL = "smollm2-135m"
DEFAULT_CACHE_DIR = os.path.join(
    os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "xlaserve", "xla"
)
log = logging.getLogger("xlaserve")

if TYPE_CHECKING:
    from engine.structured.spec import StructuredOutputs
    from serving.serve import ServeOptions


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return int(args.run(args))
    except XlaserveError as e:
        print(f"xlaserve: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="xlaserve", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug details")
    commands = parser.add_subparsers(dest="command", required=True)

    gen = commands.add_parser("generate", help="generate a reply to one prompt")
    _add_model_args(gen)
    what = gen.add_mutually_exclusive_group(required=True)
    what.add_argument("--prompt", help="raw text to continue")
    what.add_argument("--chat", help="a user message, rendered with the model's chat template")
    gen.add_argument("--system", help="system message for --chat")
    gen.add_argument("--max-tokens", type=_positive_int, default=256)
    gen.add_argument(
        "--temperature", type=_non_negative_float, default=0.0, help="0 (the default) is greedy"
    )
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument(
        "--json-schema",
        type=Path,
        default=None,
        metavar="FILE",
        help="constrain the answer to JSON that validates against the schema in FILE",
    )
    gen.add_argument(
        "--max-model-len",
        type=_positive_int,
        default=None,
        help=f"prompt + answer tokens (default: min(model's, {DEFAULT_MAX_MODEL_LEN}))",
    )
    gen.set_defaults(run=_generate)
    _add_serve_parser(commands)
    _add_convert_parser(commands)
    return parser


def _add_convert_parser(commands: argparse._SubParsersAction) -> None:
    convert = commands.add_parser(
        "convert",
        help="write a model's converted (and quantized) parameters, config and tokenizer with "
        "orbax-checkpoint, for --model DIR to load without converting",
    )
    convert.add_argument("--model", required=True, help=_MODEL_HELP)
    convert.add_argument(
        "--output", required=True, help="directory to write (new, empty, or a converted one)"
    )
    convert.add_argument("--dtype", choices=DTYPES, default=None, help="default: float32")
    convert.add_argument("--quantization", choices=QUANTIZATION_METHODS, default=None)
    convert.set_defaults(run=_convert)


def _convert(args: argparse.Namespace) -> int:
    from pathlib import Path

    from engine.weights import convert

    quantization = QuantizationConfig(args.quantization) if args.quantization else None
    convert(args.model, Path(args.output), dtype=args.dtype, quantization=quantization)
    print(f"wrote {args.output}; serve it with --model {args.output}")
    return 0


def _add_serve_parser(commands: argparse._SubParsersAction) -> None:
    serve = commands.add_parser("serve", help="serve the OpenAI-compatible API (and gRPC)")
    _add_model_args(serve)
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--grpc-port", type=int, default=None, help="also serve gRPC here")
    serve.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY'")
    serve.add_argument("--served-model-name", default=None, help="model id (default: --model)")
    serve.add_argument(
        "--max-model-len",
        type=_positive_int,
        default=None,
        help=f"default: min(model's, {DEFAULT_MAX_MODEL_LEN})",
    )
    serve.add_argument("--max-num-seqs", type=_positive_int, default=64)
    serve.add_argument("--max-num-batched-tokens", type=_positive_int, default=512)
    serve.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="schedule and dispatch each engine step while the one before it runs, feeding its "
        "sampled tokens on the device (--no-async-scheduling: each step waits for the last)",
    )
    serve.add_argument(
        "--stream-interval",
        type=_positive_int,
        default=1,
        help="a stream's first token is sent at once, then its tokens in chunks of this many "
        "(and the rest when it ends); above 1, up to that many times fewer deltas and events",
    )
    serve.add_argument(
        "--kv-cache-memory",
        type=parse_bytes,
        default=None,
        help="KV cache size, e.g. 2GiB or 500MB (default: see --gpu-memory-utilization; "
        "2 GiB on CPU)",
    )
    serve.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.5,
        help="fraction of the accelerator memory left after the weights that the KV cache "
        "takes when --kv-cache-memory is not given (vLLM's flag)",
    )
    serve.add_argument(
        "--max-queued-requests",
        type=_non_negative_int,
        default=1024,
        help="requests that may wait while --max-num-seqs run (per data-parallel replica); "
        "beyond that many admitted at once, HTTP answers 503 with Retry-After and gRPC "
        "RESOURCE_EXHAUSTED",
    )
    serve.add_argument("--max-request-bytes", type=parse_bytes, default=8 * 2**20)
    serve.add_argument(
        "--step-timeout",
        type=_positive_float,
        default=None,
        help="seconds without a finished engine step, while requests wait, after which /health "
        "and the gRPC health answer unhealthy (and new requests are refused) until a step "
        "finishes (default: 10 times the slowest step or bucket compilation seen so far, at "
        "least 120)",
    )
    serve.add_argument(
        "--shutdown-timeout",
        type=_non_negative_float,
        default=30.0,
        help="seconds running requests get to finish on SIGTERM or Ctrl-C",
    )
    serve.add_argument(
        "--warm-up",
        choices=("background", "eager"),
        default="background",
        help="background: answer once the weights are loaded and compile the step variants while "
        "idle (a variant a request needs first is compiled on the spot); eager: compile them all "
        "before answering (multi-process and data-parallel engines always do)",
    )
    serve.add_argument(
        "--chat-template",
        default=None,
        help="a chat template for /v1/chat/completions instead of the model's: a jinja file, or "
        "one shipped with tools: hermes (ChatML, for SmolLM2), gemma3_pythonic (Gemma 3)",
    )
    serve.add_argument(
        "--tool-call-parser",
        choices=("hermes", "llama3_json", "pythonic"),
        default=None,
        help="how tool calls are written in the model's answers (and enforced for tool_choice "
        "required or a named function); without it, requests with tools are refused",
    )
    serve.add_argument(
        "--grammar-compile-timeout",
        type=_positive_float,
        default=10.0,
        help="seconds a structured-output request waits for its grammar (JSON schema, regex, "
        "...) to compile before it is refused with a 400",
    )
    serve.add_argument(
        "--grammar-cache-size",
        type=_positive_int,
        default=256,
        help="compiled structured-output grammars kept (least recently used dropped first)",
    )
    serve.add_argument(
        "--api-server-count",
        type=_positive_int,
        default=1,
        help="API server processes in front of the engine core process, sharing the port and "
        "the --max-queued-requests limit (gRPC is served by the first)",
    )
    serve.add_argument(
        "--engine-in-process",
        action="store_true",
        help="run the engine loop on a thread of the API server's process instead of in an "
        "engine core process of its own (multi-process engines always do)",
    )
    serve.add_argument(
        "--expert-token-counts",
        action="store_true",
        help="count a mixture of experts' tokens per layer and expert (load balance), shown "
        "as xlaserve:expert_tokens_total in /metrics",
    )
    _add_parallel_args(serve)
    _add_lora_args(serve)
    serve.set_defaults(run=_serve)


def _add_lora_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("LoRA adapters (PEFT format; see engine/lora.py)")
    group.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters")
    group.add_argument(
        "--lora-modules",
        nargs="+",
        default=[],
        metavar="NAME=PATH",
        help="adapters to register at start-up; a request picks one by its `model`",
    )
    group.add_argument(
        "--max-loras", type=_positive_int, default=4, help="adapters in device slots at once"
    )
    group.add_argument("--max-lora-rank", type=_positive_int, default=16)
    group.add_argument(
        "--max-cpu-loras",
        type=_positive_int,
        default=None,
        help="parsed adapters kept on the host (default: --max-loras)",
    )
    group.add_argument(
        "--allow-runtime-lora-updating",
        action="store_true",
        help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (behind --api-key), "
        "reading adapters only from --lora-dirs (vLLM: VLLM_ALLOW_RUNTIME_LORA_UPDATING)",
    )
    group.add_argument(
        "--lora-dirs",
        nargs="+",
        default=[],
        metavar="DIR",
        help="the only directories runtime-loaded adapters may come from",
    )


def lora_config(args: argparse.Namespace) -> LoRAConfig | None:
    """The LoRA flags as a LoRAConfig (None without --enable-lora)."""
    if not args.enable_lora:
        if args.lora_modules or args.allow_runtime_lora_updating:
            raise ValueError("--lora-modules and --allow-runtime-lora-updating need --enable-lora")
        return None
    modules = []
    for module in args.lora_modules:
        name, sep, path = module.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules takes NAME=PATH, got {module!r}")
        modules.append((name, path))
    return LoRAConfig(
        max_loras=args.max_loras,
        max_lora_rank=args.max_lora_rank,
        max_cpu_loras=args.max_cpu_loras,
        modules=tuple(modules),
        allowed_dirs=tuple(args.lora_dirs),
        allow_runtime_updating=args.allow_runtime_lora_updating,
    )


def _add_parallel_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("parallelism (see sharding/)")
    group.add_argument(
        "--data-parallel-size",
        type=_positive_int,
        default=1,
        help="engine replicas, each with its own scheduler and KV cache",
    )
    group.add_argument(
        "--tensor-parallel-size",
        type=_positive_int,
        default=1,
        help="devices that split each layer's heads, MLP and vocabulary",
    )
    group.add_argument(
        "--pipeline-parallel-size",
        type=_positive_int,
        default=1,
        help="pipeline stages that split the layers",
    )
    group.add_argument(
        "--sharding-layout",
        default=None,
        metavar="FILE",
        help="a sharding layout (.json or .yaml): mesh axes and sizes, and the logical axis -> "
        "mesh axis rules (README: Custom sharding layouts); replaces the parallel sizes",
    )
    group.add_argument(
        "--coordinator-address",
        default=None,
        help="HOST:PORT of process 0, for an engine over several processes (found "
        "automatically on Cloud TPU)",
    )
    group.add_argument(
        "--expert-dispatch",
        choices=EXPERT_DISPATCHES,
        default="allgather",
        help="how a mixture of experts' tokens reach the devices of the expert axis: "
        "'allgather' keeps every token on every device and sums the experts' parts; "
        "'all_to_all' sends each token to its experts' devices and back (sharding/experts.py)",
    )
    group.add_argument("--num-processes", type=_positive_int, default=None)
    group.add_argument("--process-id", type=_non_negative_int, default=None)


def _serve(args: argparse.Namespace) -> int:
    from serving.serve import run_serve

    try:
        options = _serve_options(args)
    except ValueError as e:
        raise XlaserveError(str(e)) from e
    return run_serve(serve_config(args), options)


def _serve_options(args: argparse.Namespace) -> ServeOptions:
    from serving.serve import ServeOptions

    return ServeOptions(
        host=args.host,
        port=args.port,
        grpc_port=args.grpc_port,
        api_key=args.api_key,
        served_model_name=args.served_model_name or args.model,
        max_queued_requests=args.max_queued_requests,
        max_request_bytes=args.max_request_bytes,
        shutdown_timeout=args.shutdown_timeout,
        step_timeout=args.step_timeout,
        verbose=args.verbose,
        chat_template=args.chat_template,
        tool_call_parser=args.tool_call_parser,
        engine_in_process=args.engine_in_process,
        api_server_count=args.api_server_count,
    )


def serve_config(args: argparse.Namespace) -> EngineConfig:
    """The engine `xlaserve serve` builds from its flags."""
    return _engine_config(
        args,
        cache=lambda: CacheConfig(
            memory_bytes=args.kv_cache_memory,
            memory_fraction=args.gpu_memory_utilization,
            kv_cache_dtype=args.kv_cache_dtype,
        ),
        scheduler=lambda: SchedulerConfig(
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=args.max_model_len,
            async_scheduling=args.async_scheduling,
            stream_interval=args.stream_interval,
        ),
        parallel=lambda: ParallelConfig(
            _layout(args),
            coordinator_address=args.coordinator_address,
            num_processes=args.num_processes,
            process_id=args.process_id,
            expert_dispatch=args.expert_dispatch,
        ),
        warm_up=args.warm_up,
        lora=lambda: lora_config(args),
        structured=StructuredOutputConfig(
            cache_size=args.grammar_cache_size, compile_timeout_s=args.grammar_compile_timeout
        ),
        observability=ObservabilityConfig(expert_token_counts=args.expert_token_counts),
    )


def generate_config(args: argparse.Namespace) -> EngineConfig:
    """One request: a small engine, compiled on demand, with a cache for one whole sequence."""
    max_model_len = args.max_model_len or DEFAULT_MAX_MODEL_LEN
    return _engine_config(
        args,
        cache=lambda: CacheConfig(
            GENERATE_PAGE_SIZE,
            num_pages=-(-max_model_len // GENERATE_PAGE_SIZE),
            kv_cache_dtype=args.kv_cache_dtype,
        ),
        scheduler=lambda: SchedulerConfig(
            max_num_seqs=1, max_num_batched_tokens=256, max_model_len=args.max_model_len
        ),
        parallel=ParallelConfig,
        warm_up="lazy",
    )


GENERATE_PAGE_SIZE = 16


def _quantization(args: argparse.Namespace) -> QuantizationConfig | None:
    if args.int8_activations and not args.quantization:
        raise ValueError("--int8-activations needs --quantization int4")
    if not args.quantization:
        return None
    return QuantizationConfig(args.quantization, int8_activations=args.int8_activations)


def _engine_config(
    args: argparse.Namespace,
    *,
    cache: Callable[[], CacheConfig],
    scheduler: Callable[[], SchedulerConfig],
    parallel: Callable[[], ParallelConfig],
    warm_up: str,
    lora: Callable[[], LoRAConfig | None] = lambda: None,
    structured: StructuredOutputConfig | None = None,
    observability: ObservabilityConfig | None = None,
) -> EngineConfig:
    """The flags as one EngineConfig; a value the config refuses is a one-line error."""
    try:
        return EngineConfig(
            model=args.model,
            dtype=args.dtype,
            quantization=_quantization(args),
            cache=cache(),
            scheduler=scheduler(),
            parallel=parallel(),
            compilation=CompilationConfig(
                cache_dir=args.compilation_cache_dir or None, warm_up=warm_up
            ),
            lora=lora(),
            structured=structured or StructuredOutputConfig(),
            speculative=SpeculativeConfig.from_json(args.speculative_config)
            if args.speculative_config
            else None,
            observability=observability or ObservabilityConfig(),
        )
    except (ValueError, OSError) as e:
        raise XlaserveError(str(e)) from e


def _layout(args: argparse.Namespace) -> ShardingLayout:
    sizes = (args.data_parallel_size, args.pipeline_parallel_size, args.tensor_parallel_size)
    if args.sharding_layout is None:
        dp, pp, tp = sizes
        return ShardingLayout.named(dp=dp, pp=pp, tp=tp)
    if sizes != (1, 1, 1):
        raise ValueError(
            "give either --sharding-layout or the --*-parallel-size flags (a layout file names "
            "its own mesh axes and sizes)"
        )
    return ShardingLayout.from_file(args.sharding_layout)


_BYTE_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_bytes(text: str) -> int:
    """'2GiB' -> 2147483648, '500MB' -> 500000000, '1e9' -> 1000000000."""
    match = re.fullmatch(r"\s*([0-9.eE+]+)\s*([A-Za-z]*)\s*", text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _BYTE_UNITS:
        raise argparse.ArgumentTypeError(f"not a size in bytes: {text!r} (e.g. 2GiB, 500MB)")
    try:
        value = int(float(match.group(1)) * _BYTE_UNITS[unit])
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size in bytes: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be positive, got {text!r}")
    return value


_MODEL_HELP = (
    f"alias ({DEFAULT_MODEL}), Hugging Face checkpoint directory, .gguf file, or a directory "
    "written by `xlaserve convert`"
)


def _add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL, help=_MODEL_HELP)
    parser.add_argument(
        "--dtype",
        choices=DTYPES,
        default=None,
        help="default: float32, or the dtype a converted directory holds",
    )
    parser.add_argument(
        "--quantization",
        choices=QUANTIZATION_METHODS,
        default=None,
        help="weight-only quantization of the linear layers (GGUF Q8_0/Q4_* blocks are taken as "
        "stored; float weights are quantized at load)",
    )
    parser.add_argument(
        "--int8-activations",
        action="store_true",
        help="with --quantization int4 on CPU: decode rows are rounded to int8 in blocks of 32 "
        "(llama.cpp's Q8_0) for integer dot products with the int4 weights and the int8 output "
        "layer",
    )
    parser.add_argument(
        "--kv-cache-dtype",
        choices=KV_CACHE_DTYPES,
        default=None,
        help="KV cache dtype (default: --dtype); int8 and fp8 (e4m3) store a scale per token "
        "and head",
    )
    parser.add_argument(
        "--compilation-cache-dir",
        default=DEFAULT_CACHE_DIR,
        help="persistent XLA compilation cache ('' to disable)",
    )
    parser.add_argument(
        "--speculative-config",
        default=None,
        help='speculative decoding, vLLM\'s JSON: {"method": "ngram", "num_speculative_tokens": '
        '3, "prompt_lookup_min": 2, "prompt_lookup_max": 5} (also disable_by_batch_size, '
        "min_acceptance_rate, acceptance_window)",
    )


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _generate(args: argparse.Namespace) -> int:
    # Imported here so that `xlaserve --help` and argument errors answer without loading JAX.
    from engine.builder import build_engine
    from engine.chat_template import render_chat
    from engine.request import SamplingParams

    engine = build_engine(generate_config(args))
    tokenizer = engine.tokenizer
    if args.chat is not None:
        messages = [{"role": "system", "content": args.system}] if args.system else []
        messages.append({"role": "user", "content": args.chat})
        text = render_chat(
            tokenizer.chat_template,
            messages,
            add_generation_prompt=True,
            bos_token=tokenizer.bos_token,
            eos_token=tokenizer.eos_token,
        )
        prompt_ids = tokenizer.encode(text, add_special_tokens=False)
    else:
        prompt_ids = tokenizer.encode(args.prompt)

    sampling = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
        max_tokens=args.max_tokens,
        structured_outputs=_json_schema(args.json_schema),
    )
    engine.add_request("cli", prompt_ids, sampling)
    while engine.has_unfinished_requests():
        for output in engine.step():  # each holds only the new text
            for choice in output.outputs:
                print(choice.text, end="", flush=True)
    print()
    return 0


def _json_schema(path: Path | None) -> StructuredOutputs | None:
    from engine.structured.spec import StructuredOutputs

    if path is None:
        return None
    try:
        return StructuredOutputs.from_schema(path.read_text())
    except OSError as e:
        raise XlaserveError(f"--json-schema: cannot read {path}: {e.strerror}") from e


if __name__ == "__main__":
    sys.exit(main())
