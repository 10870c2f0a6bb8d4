"""Where a decoded token's time goes on this machine: host, dispatch, attention and the weight
products, for SmolLM2 as bench/compare.py runs it against llama-server (the GGUF's Q4_1
blocks with `--quantization int4`, 512-token prompts).

    python bench/step_breakdown.py --write-results

The host phases are timed as bench/host_overhead.py times them (its PhaseClock wraps the
engine's own methods), on the real model with synchronous scheduling, so that one step is
schedule + build + launch + wait + bookkeeping + postprocess with nothing overlapped:

- host: schedule, build, bookkeeping and postprocess (Python and NumPy);
- device step: `run_batch` and `fetch` (the inputs moved, the compiled parts dispatched and
  run, the sampled tokens read back), split by difference: the same engine is built again
  with the attention kernel replaced by a stand-in that costs nothing (zeros shaped like its
  output), and again with every weight product (`layers.dense`, `layers.dense_all`,
  `layers.unembed`: the seven projections of every layer and the output layer) replaced by
  one. What a part adds to the step is its cost; "rest" is the remainder (dispatch,
  transfers, norms, rope, KV writes, sampling).

The stand-ins keep a data dependency on their input (x * 0 added), so XLA cannot drop the work
that feeds them, and on one element of every other array they are given (the weights): jit
drops an argument that nothing uses from the call, and the step would then save the weights'
dispatch (~1.3 ms a step on SmolLM2 on CPU, its 630 quantized-weight arrays) as if it were the
products' cost. The script checks that every variant's forward is passed as many arrays. The
step with stand-ins computes garbage tokens, which a timing does not read.
"""

from __future__ import annotations

import argparse
import contextlib
import re
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from importlib.metadata import version
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax
import jax.numpy as jnp
import numpy as np

from bench import common
from bench.host_overhead import instrument
from engine import compilation
from engine.builder import build_engine
from engine.config import (
    CacheConfig,
    CompilationConfig,
    EngineConfig,
    QuantizationConfig,
    SchedulerConfig,
)
from engine.llm_engine import LLMEngine
from engine.models import attention, layers
from engine.request import SamplingParams

TITLE = "Where the time per token goes (bench/step_breakdown.py)"
VARIANTS = ("as is", "no attention", "no products")
HOST = ("schedule", "build", "bookkeeping", "postprocess")


def _costless(real: Callable[..., Any], x_arg: int = 0) -> Callable[..., Any]:
    """A stand-in for `real` that returns zeros of its outputs' shapes and dtypes, depending on
    its argument `x_arg` (times zero) so that what computes that argument still runs, and on
    one element of every other array argument so that the step is still passed them."""

    def stand_in(*args: Any, **kwargs: Any) -> Any:
        out = jax.eval_shape(lambda *a: real(*a, **kwargs), *args)
        others = [a for i, arg in enumerate(args) if i != x_arg for a in jax.tree.leaves(arg)]
        firsts = [jnp.ravel(a)[0].astype(jnp.float32) for a in others if a.size]
        dependency = (jnp.sum(args[x_arg]) + sum(firsts, jnp.float32(0))) * 0
        return jax.tree.map(lambda o: jnp.zeros(o.shape, o.dtype) + dependency.astype(o.dtype), out)

    return stand_in


@contextlib.contextmanager
def variant(name: str) -> Iterator[None]:
    """Within: engines built trace the model with `name`'s stand-ins (see the module doc)."""
    patches = {
        "as is": [],
        "no attention": [(attention, "ragged_paged_attention")],
        "no products": [(layers, "dense"), (layers, "dense_all"), (layers, "unembed")],
    }[name]
    saved = [(owner, attr, getattr(owner, attr)) for owner, attr in patches]
    for owner, attr, real in saved:
        setattr(owner, attr, _costless(real))
    jax.clear_caches()  # no compiled step of another variant may be reused
    try:
        yield
    finally:
        for owner, attr, real in saved:
            setattr(owner, attr, real)
        jax.clear_caches()


def build(model: Path, running: int, args: argparse.Namespace) -> LLMEngine:
    context = args.prompt_len + _max_tokens(args, running)
    engine = build_engine(
        EngineConfig(
            str(model),
            dtype=args.dtype,
            quantization=QuantizationConfig(
                args.quantization, int8_activations=args.int8_activations
            )
            if args.quantization
            else None,
            cache=CacheConfig(
                num_pages=running * (-(-context // 16) + 1) + 16,
                enable_prefix_caching=False,
                kv_cache_dtype=args.kv_cache_dtype,
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=running,
                max_num_batched_tokens=PREFILL_CHUNK,
                max_model_len=context + 16,
            ),
            compilation=CompilationConfig(warm_up="lazy"),
        )
    )
    assert isinstance(engine, LLMEngine)
    engine.async_scheduling = False
    return engine


PREFILL_CHUNK = 512  # max_num_batched_tokens


def _max_tokens(args: argparse.Namespace, running: int) -> int:
    """What each sequence generates: a token a step while the others' prompts are prefilled
    (a sequence whose prefill ends first decodes meanwhile), the warm-up steps and every timed
    window, with room, so that all `running` sequences decode through every window."""
    prefill_steps = -(-running * args.prompt_len // PREFILL_CHUNK)
    return prefill_steps + args.warm_steps + args.steps * args.repeats + 4


def measure(engine: LLMEngine, running: int, args: argparse.Namespace) -> dict[str, float]:
    """Milliseconds per decode step in each phase with `running` sequences decoding after
    prompts of args.prompt_len random tokens; median of args.repeats windows of args.steps."""
    clock = instrument(engine)
    rng = np.random.default_rng(0)
    vocab = engine.model_info().vocab_size
    params = SamplingParams(temperature=0, max_tokens=_max_tokens(args, running), ignore_eos=True)
    for i in range(running):
        prompt = rng.integers(4, vocab - 4, args.prompt_len).tolist()
        engine.add_request(f"r{running}-{i}", prompt, params)
    prefilled = engine.stats().num_computed_prompt_tokens + running * args.prompt_len
    while engine.stats().num_computed_prompt_tokens < prefilled:  # the counter spans sizes
        engine.step()
    for _ in range(args.warm_steps):
        engine.step()
    windows = []
    compiled = compilation.count()
    for _ in range(args.repeats):
        clock.reset()
        start = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        window = {p: s * 1e3 / args.steps for p, s in clock.seconds.items()}
        window["step"] = (time.perf_counter() - start) * 1e3 / args.steps
        windows.append(window)
    if compilation.count() != compiled:
        raise SystemExit(f"a timed window compiled ({running} sequences): raise --warm-steps")
    result = {k: statistics.median(w.get(k, 0.0) for w in windows) for k in windows[0]}
    result["arrays"] = forward_arrays(engine)
    engine.close()
    return result


def forward_arrays(engine: LLMEngine) -> int:
    """How many arrays the compiled forward is passed: the parameters of its HLO entry (jit
    leaves out the arguments that nothing in it uses). Every bucket's forward takes the same
    arrays, so the first one is read (compiled now if the run did not need it)."""
    compiled = engine.runner.compiled
    forward = next(v for v in compiled.variants() if v.kind == "forward")
    hlo = compiled.get(forward).as_text()
    entry = hlo[hlo.index("\nENTRY ") :]
    return len(re.findall(r" parameter\(\d+\)", entry[: entry.index("\n}")]))


def breakdown(steps: dict[str, dict[str, float]], running: int) -> str:
    """One table row: the as-is step's host phases, and its device step split by difference.
    On CPU, `run_batch` runs the smaller computations before it returns, so the device step
    is launch + wait together."""
    full = steps["as is"]
    host = sum(full.get(p, 0.0) for p in HOST)
    device = full.get("launch", 0.0) + full.get("wait", 0.0)
    attn = full["step"] - steps["no attention"]["step"]
    products = full["step"] - steps["no products"]["step"]
    parts = [host, device, attn, products, device - attn - products]
    shares = " | ".join(f"{v:.2f} ({v / full['step']:.0%})" for v in parts)
    return f"| {running} | {full['step']:.2f} | {full['step'] / running:.2f} | {shares} |"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m", help="alias or .gguf file")
    p.add_argument("--quantization", default="int4", help="'' for the model's own dtype")
    p.add_argument(
        "--int8-activations", action="store_true", help="as the server's flag (int4 on CPU)"
    )
    p.add_argument("--dtype", default=None, help="as the server's flag (None: float32)")
    p.add_argument("--kv-cache-dtype", default=None, help="as the server's flag")
    p.add_argument("--running", type=int, nargs="+", default=[1, 64])
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--steps", type=int, default=16, help="decode steps per timed window")
    p.add_argument("--repeats", type=int, default=3, help="timed windows (the median is kept)")
    p.add_argument("--warm-steps", type=int, default=4)
    p.add_argument("--write-results", action="store_true")
    p.add_argument("--smoke", action="store_true", help="a tiny random model, a few steps")
    return p


def main(argv: Sequence[str] | None = None) -> None:
    args = parser().parse_args(argv)
    if args.smoke:
        from bench.host_overhead import write_checkpoint

        model = write_checkpoint()
        args.running, args.prompt_len, args.steps, args.repeats = [1], 8, 2, 1
    else:
        from bench.compare import _gguf

        model = _gguf(args.model)
    measured: dict[int, dict[str, dict[str, float]]] = {n: {} for n in args.running}
    for name in VARIANTS:
        with variant(name):
            for n in args.running:
                measured[n][name] = measure(build(model, n, args), n, args)
                m = measured[n][name]
                print(f"{name}, {n} running: {m['step']:.2f} ms a step, {m['arrays']} arrays")
    for n, steps in measured.items():
        if len({m["arrays"] for m in steps.values()}) > 1:
            raise SystemExit(
                f"the variants' forwards are passed different arrays ({n} running): "
                f"{ {name: m['arrays'] for name, m in steps.items()} }"
            )
    lines = common.preamble(
        "python bench/step_breakdown.py " + " ".join(sys.argv[1:]),
        {"jax": version("jax")},
    )
    lines += [
        f"- model: {model.name}, quantization {args.quantization or 'none'}"
        f"{' with int8 activations' if args.int8_activations else ''}, "
        f"dtype {args.dtype or 'float32'}, kv cache {args.kv_cache_dtype or 'default'}; "
        f"{args.prompt_len}-token random prompts, greedy decode, synchronous scheduling; "
        f"median of {args.repeats} windows of {args.steps} steps",
        "- ms per step, and its share: host = schedule + build + bookkeeping + postprocess; "
        "device step = inputs moved, compiled parts dispatched and run, tokens read back; of "
        "it, attention and weight products = what each adds to the step (the step again with "
        "a stand-in that costs nothing); rest = dispatch, transfers, norms, rope, KV writes, "
        "sampling",
        "",
        "| running | ms a step | ms a token | host | device step | of it: attention "
        "| weight products | rest |",
        "|---|---|---|---|---|---|---|---|",
    ]
    lines += [breakdown(measured[n], n) for n in args.running]
    text = "\n".join(lines)
    print(text)
    if args.write_results:
        common.write_section(TITLE, text)


if __name__ == "__main__":
    main()
