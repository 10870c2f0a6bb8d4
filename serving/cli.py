"""The `xlaserve` command line: `xlaserve generate` (and, as they land, serve/bench/convert).

Errors meant for the user (a missing model, a corrupt file, a bad request) are printed as one
line and exit with status 1; argument errors exit with argparse's status 2.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Sequence

from engine.config import DTYPES
from engine.errors import XlaserveError

DEFAULT_MODEL = "smollm2-135m"
log = logging.getLogger("xlaserve")


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
    gen.set_defaults(run=_generate)
    return parser


def _add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help=f"alias ({DEFAULT_MODEL}), Hugging Face checkpoint directory, or .gguf file",
    )
    parser.add_argument("--dtype", choices=DTYPES, default="float32")


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _generate(args: argparse.Namespace) -> int:
    # Imported here so that `xlaserve --help` and argument errors answer without loading JAX.
    from engine import naive
    from engine.chat_template import render_chat
    from engine.tokenizer import IncrementalDetokenizer, load_tokenizer
    from engine.weights import open_checkpoint, resolve_model

    checkpoint = open_checkpoint(resolve_model(args.model), dtype=args.dtype)
    tokenizer = load_tokenizer(checkpoint.files.path)
    start = time.perf_counter()
    cfg, params = checkpoint.cfg, checkpoint.load_params()
    log.info("loaded %s in %.1f s", checkpoint.files.path, time.perf_counter() - start)

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

    sampling = naive.NaiveSampling(
        temperature=args.temperature, top_p=args.top_p, seed=args.seed, max_tokens=args.max_tokens
    )
    detokenizer = IncrementalDetokenizer(tokenizer)
    eos = set(tokenizer.eos_token_ids)
    for token in naive.generate(params, cfg, prompt_ids, sampling, stop_ids=tuple(eos)):
        if token not in eos:
            print(detokenizer.add(token), end="", flush=True)
    print(detokenizer.flush())
    return 0


if __name__ == "__main__":
    sys.exit(main())
