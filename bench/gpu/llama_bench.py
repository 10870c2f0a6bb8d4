"""Device benchmark of a Llama-3-8B-shaped model with random bfloat16 weights: decode step time
against the memory-bandwidth floor, prefill TFLOP/s against a measured bf16 matmul rate, and
offline throughput (512 input / 256 output tokens at 64 and 256 concurrent sequences).

    PYTHONPATH=. python3 bench/gpu/llama_bench.py [--small] [--json FILE]

Run through bench/gpu/run.sh on the device machine (no network; installs nothing). Before timing
anything it checks the platform's ragged paged attention, and the reference, against a dense
attention computed here, with NaN in every unused cache slot. `--small` shrinks the model and
workloads so that the whole script runs on a CPU in a few minutes (how it is tested here).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import signal
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import jax
import jax.numpy as jnp
import numpy as np
import tokenizers

from bench import common
from engine import compilation
from engine.config import CacheConfig, ModelConfig, SchedulerConfig
from engine.llm_engine import LLMEngine
from engine.request import SamplingParams
from engine.tokenizer import HFTokenizer, SpecialTokens
from pallas_kernels.kv_cache_update import KVCacheSpec, init_kv_pages, write_kv
from pallas_kernels.ragged_paged_attention import ragged_paged_attention, resolve_impl

LLAMA3_8B = ModelConfig(
    architecture="llama",
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_layers=32,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    rope_theta=500000.0,
    max_position_embeddings=8192,
    dtype="bfloat16",
)
# float32: XLA:CPU computes bfloat16 by converting whole arrays (the KV cache among them) to
# float32 and back, which on a CPU measures the conversions, not the engine.
SMALL = LLAMA3_8B.replace(
    vocab_size=2048, hidden_size=256, intermediate_size=512, num_layers=2, num_heads=4,
    num_kv_heads=2, head_dim=64, dtype="float32",
)  # fmt: skip


@dataclass(frozen=True)
class Plan:
    """Workload sizes: the issue's for the device, shrunk ones with --small."""

    cfg: ModelConfig
    decode_batches: tuple[int, ...]
    context: int  # prompt tokens before decode is timed
    prefill_tokens: int
    throughput_seqs: tuple[int, ...]
    input_len: int
    output_len: int
    max_num_batched_tokens: int
    matmul_n: int
    copy_mib: int
    repeats: int
    kv_cache_bytes: int | None = None  # None: the engine's default (half the free memory)
    # Per-layer arrays and an unrolled loop, as the loaders build them: each layer's KV pages
    # are updated in place. Stacked layers under lax.scan compile one layer body per bucket
    # (much faster to compile) but write the whole stacked KV cache out every step.
    scan_layers: bool = False


FULL = Plan(LLAMA3_8B, (1, 64), 512, 2048, (64, 256), 512, 256, 2048, 8192, 2048, 10)
SMALL_PLAN = Plan(SMALL, (1, 4), 64, 128, (4, 8), 32, 16, 128, 512, 64, 3, 32 << 20)


def _median_seconds(fn: Callable[[], Any], repeats: int) -> float:
    jax.block_until_ready(fn())  # compile and warm
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def copy_bandwidth_gbs(mib: int, repeats: int) -> float:
    """Device memory copy rate, read + write bytes counted."""
    x = jnp.ones((mib << 18,), jnp.float32)
    copy = jax.jit(lambda a: a * 1.0001)
    return 2 * x.nbytes / _median_seconds(lambda: copy(x), repeats) / 1e9


def matmul_tflops(n: int, repeats: int) -> float:
    """bf16 [n, n] @ [n, n] with float32 accumulation."""
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16)
    mm = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32))
    return 2 * n**3 / _median_seconds(lambda: mm(a, b), repeats) / 1e12


def random_params(cfg: ModelConfig, *, scan_layers: bool, seed: int = 0) -> dict[str, Any]:
    """The loader's pytree layout (engine/weights) filled on the device: matrices normal with
    std fan_in ** -0.5, norms ones; per-layer dicts, or stacked on a leading layer axis."""
    d, f, n, k, h, v = (cfg.hidden_size, cfg.intermediate_size, cfg.num_heads,
                        cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size)  # fmt: skip
    dtype = jnp.dtype(cfg.dtype)
    keys = iter(jax.random.split(jax.random.key(seed), 4 + 16 * cfg.num_layers))
    stack = (cfg.num_layers,) if scan_layers else ()

    def matrix(shape: tuple[int, ...], fan_in: int) -> jax.Array:
        return jax.random.normal(next(keys), shape, dtype) * jnp.asarray(fan_in**-0.5, dtype)

    def layer() -> dict[str, jax.Array]:
        return {
            "attn_norm": jnp.ones((*stack, d), dtype), "mlp_norm": jnp.ones((*stack, d), dtype),
            "wq": matrix((*stack, d, n, h), d), "wk": matrix((*stack, d, k, h), d),
            "wv": matrix((*stack, d, k, h), d), "wo": matrix((*stack, n, h, d), n * h),
            "w_gate": matrix((*stack, d, f), d), "w_up": matrix((*stack, d, f), d),
            "w_down": matrix((*stack, f, d), f),
        }  # fmt: skip

    return {
        "embed": matrix((v, d), 1),
        "lm_head": matrix((v, d), d),
        "final_norm": jnp.ones((d,), dtype),
        "layers": layer() if scan_layers else [layer() for _ in range(cfg.num_layers)],
    }


def placeholder_tokenizer(vocab_size: int) -> HFTokenizer:
    """Ids <-> '<i>' words: the engine detokenizes outputs, and random weights need no text."""
    vocab = {f"<{i}>": i for i in range(vocab_size)}
    model = tokenizers.models.WordLevel(vocab, unk_token="<0>")
    return HFTokenizer(tokenizers.Tokenizer(model), SpecialTokens(eos_token_ids=()), None)


# ---- correctness first ------------------------------------------------------------------------


def dense_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float) -> np.ndarray:
    """Causal attention of the last q_len positions over k, v (float64): the independent oracle.
    q f[Q, Hq, D], k/v f[L, Hkv, D] -> f[Q, Hq, D]."""
    q_len, hq, _ = q.shape
    length, hkv, _ = k.shape
    k, v = np.repeat(k, hq // hkv, axis=1), np.repeat(v, hq // hkv, axis=1)
    scores = np.einsum("qhd,khd->hqk", q, k) * scale
    positions = np.arange(length - q_len, length)[:, None]
    scores = np.where(np.arange(length)[None, :] <= positions, scores, -np.inf)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    return np.einsum("hqk,khd->qhd", weights, v)


def check_attention(cfg: ModelConfig, page_size: int = 16) -> dict[str, float]:
    """A ragged batch (a prefill, a chunked prefill, decodes) over a NaN-filled paged cache:
    the platform's implementation and the reference against `dense_attention`."""
    rng = np.random.default_rng(0)
    hq, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    kv_lens, q_lens = [37, 300, 129, 1], [37, 44, 1, 1]  # prefill, chunk, decode, decode
    pages_per_seq = -(-max(kv_lens) // page_size)
    num_pages = len(kv_lens) * pages_per_seq + 3
    order = rng.permutation(num_pages)  # pages scattered, unused ones left NaN
    table = order[: len(kv_lens) * pages_per_seq].reshape(len(kv_lens), pages_per_seq)
    ks = [rng.standard_normal((n, hkv, d)) for n in kv_lens]
    vs = [rng.standard_normal((n, hkv, d)) for n in kv_lens]
    qs = [rng.standard_normal((n, hq, d)) for n in q_lens]
    slots = np.concatenate(
        [table[s, np.arange(n) // page_size] * page_size + np.arange(n) % page_size
         for s, n in enumerate(kv_lens)]
    )  # fmt: skip
    spec = KVCacheSpec.for_platform(
        jax.default_backend(), num_pages=num_pages, page_size=page_size, num_kv_heads=hkv,
        head_dim=d, dtype=cfg.dtype,
    )  # fmt: skip
    dtype = jnp.dtype(cfg.dtype)
    empty = init_kv_pages(spec)
    assert isinstance(empty, jax.Array)  # a float cache
    written = write_kv(
        jnp.full_like(empty, jnp.nan),
        jnp.asarray(np.concatenate(ks), dtype),
        jnp.asarray(np.concatenate(vs), dtype),
        jnp.asarray(slots, jnp.int32),
    )
    args = (
        jnp.asarray(np.concatenate(qs), dtype), written, jnp.asarray(kv_lens, jnp.int32),
        jnp.asarray(table, jnp.int32), jnp.asarray(np.cumsum([0, *q_lens]), jnp.int32),
        jnp.asarray(len(kv_lens), jnp.int32),
    )  # fmt: skip
    scale = d**-0.5
    # the oracle sees the K/V/Q as rounded to the model's dtype
    as_dtype = lambda x: np.asarray(jnp.asarray(x, dtype), np.float64)
    expected = np.concatenate(
        [dense_attention(as_dtype(q), as_dtype(k), as_dtype(v), scale)
         for q, k, v in zip(qs, ks, vs, strict=True)]
    )  # fmt: skip
    errors = {}
    for impl in sorted({"reference", resolve_impl(None, jax.default_backend())}):
        out = ragged_paged_attention(*args, sm_scale=scale, impl=impl)
        got = np.asarray(out.astype(jnp.float32), np.float64)[: sum(q_lens)]
        error = float(np.max(np.abs(got - expected)))
        if not np.isfinite(got).all() or error > (0.05 if dtype == jnp.bfloat16 else 1e-3):
            raise SystemExit(f"attention check failed: {impl} max abs error {error:.3g}")
        errors[impl] = error
    return errors


# ---- timed measurements -----------------------------------------------------------------------


def weight_bytes(params: dict[str, Any]) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(params))


def kv_bytes_per_token(cfg: ModelConfig) -> int:
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * jnp.dtype(cfg.dtype).itemsize


def make_engine(plan: Plan, params: dict[str, Any]) -> LLMEngine:
    cfg = plan.cfg
    max_model_len = max(
        plan.prefill_tokens + 1, plan.input_len + plan.output_len, plan.context + 64
    )
    return LLMEngine(
        cfg,
        params,
        placeholder_tokenizer(cfg.vocab_size),
        warm_up=False,  # compiled on first use: only the buckets these workloads reach
        cache_config=CacheConfig(page_size=16, memory_bytes=plan.kv_cache_bytes),
        scheduler_config=SchedulerConfig(
            max_num_seqs=max(plan.throughput_seqs),
            max_num_batched_tokens=plan.max_num_batched_tokens,
            max_model_len=max_model_len,
        ),
    )


class Prompts:
    """Distinct random prompts (so the prefix cache never hits)."""

    def __init__(self, vocab_size: int):
        self._rng = np.random.default_rng(1)
        self._vocab = vocab_size
        self._n = 0

    def add(self, engine: LLMEngine, count: int, length: int, max_tokens: int) -> list[str]:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        ids = []
        for _ in range(count):
            self._n += 1
            ids.append(f"r{self._n}")
            prompt = self._rng.integers(0, self._vocab, length).tolist()
            engine.add_request(ids[-1], prompt, params)
        return ids


def decode_step_seconds(engine: LLMEngine, prompts: Prompts, batch: int, plan: Plan) -> float:
    """Median wall time of a decode-only step of `batch` sequences after `plan.context`-token
    prompts; the first decode steps (which compile the bucket) are left out."""
    skip = 3
    ids = set(prompts.add(engine, batch, plan.context, skip + plan.repeats + 2))
    started: set[str] = set()
    times = []
    while engine.has_unfinished_requests():
        decoding = started >= ids
        start = time.perf_counter()
        outputs = engine.step()
        if decoding:
            times.append(time.perf_counter() - start)
        started |= {o.request_id for o in outputs if o.outputs[0].token_ids}
    return statistics.median(times[skip : skip + plan.repeats])


def prefill_seconds(engine: LLMEngine, prompts: Prompts, plan: Plan) -> float:
    """Median time of a `plan.prefill_tokens`-token prompt's prefill (one step) to its token."""
    times = []
    for _ in range(1 + min(plan.repeats, 5)):  # the first compiles
        prompts.add(engine, 1, plan.prefill_tokens, 1)
        start = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def prefill_flops(cfg: ModelConfig, tokens: int) -> float:
    """Matmul FLOPs of a prefill: 2 per weight per token (no embedding lookup, logits for the
    last token only) and causal attention (QK^T and PV over half the square)."""
    d, f, n, k, h = (cfg.hidden_size, cfg.intermediate_size, cfg.num_heads,
                     cfg.num_kv_heads, cfg.head_dim)  # fmt: skip
    per_layer = d * (n + 2 * k) * h + n * h * d + 3 * d * f
    linear = 2 * tokens * per_layer * cfg.num_layers + 2 * cfg.vocab_size * d
    attention = 2 * 2 * n * h * (tokens * (tokens + 1) / 2) * cfg.num_layers
    return linear + attention


def offline_throughput(
    engine: LLMEngine, prompts: Prompts, seqs: int, plan: Plan
) -> dict[str, float]:
    """`seqs` requests of input_len / output_len at once, after an untimed pass of the same
    prefill (so its buckets are compiled); compilations in the timed pass are counted."""
    prefill_steps = -(-seqs * plan.input_len // plan.max_num_batched_tokens)
    prompts.add(engine, seqs, plan.input_len, prefill_steps + 4)
    while engine.has_unfinished_requests():
        engine.step()
    compiled = compilation.count()
    start = time.perf_counter()
    prompts.add(engine, seqs, plan.input_len, plan.output_len)
    while engine.has_unfinished_requests():
        engine.step()
    seconds = time.perf_counter() - start
    out_tokens = seqs * plan.output_len
    return {
        "seqs": seqs,
        "seconds": seconds,
        "output_tok_s": out_tokens / seconds,
        "total_tok_s": (out_tokens + seqs * plan.input_len) / seconds,
        "compilations": compilation.count() - compiled,
    }


def run(plan: Plan, report: Callable[[str, Any], None]) -> None:
    cfg = plan.cfg
    report("attention_max_abs_error", check_attention(cfg))
    bandwidth = copy_bandwidth_gbs(plan.copy_mib, plan.repeats)
    report("copy_bandwidth_gbs", bandwidth)
    report("bf16_matmul_tflops", matmul_tflops(plan.matmul_n, plan.repeats))
    params = random_params(cfg, scan_layers=plan.scan_layers)
    weights = weight_bytes(params)
    report("weight_bytes", weights)
    engine = make_engine(plan, params)
    prompts = Prompts(cfg.vocab_size)
    read_per_step = weights - params["embed"].nbytes  # the embedding: a row per token
    for batch in plan.decode_batches:
        seconds = decode_step_seconds(engine, prompts, batch, plan)
        kv = batch * (plan.context + 4) * kv_bytes_per_token(cfg)
        floor = (read_per_step + kv) / (bandwidth * 1e9)
        report(f"decode_b{batch}", {"step_s": seconds, "floor_s": floor, "kv_bytes": kv})
    seconds = prefill_seconds(engine, prompts, plan)
    flops = prefill_flops(cfg, plan.prefill_tokens)
    report("prefill", {"tokens": plan.prefill_tokens, "seconds": seconds, "flops": flops})
    for seqs in plan.throughput_seqs:
        report(f"throughput_c{seqs}", offline_throughput(engine, prompts, seqs, plan))


def table(plan: Plan, r: dict[str, Any]) -> str:
    cfg = plan.cfg
    lines = [
        f"model: {cfg.num_layers} layers, d={cfg.hidden_size}, {cfg.num_heads}/"
        f"{cfg.num_kv_heads} heads, vocab {cfg.vocab_size}, {cfg.dtype}, random weights "
        f"({r.get('weight_bytes', 0) / 1e9:.2f} GB), layers "
        f"{'stacked (lax.scan)' if plan.scan_layers else 'unrolled'}",
        "",
        "| measurement | result | bound | of bound |",
        "|---|---|---|---|",
    ]
    errors = r.get("attention_max_abs_error", {})
    lines += [f"| attention vs dense oracle: {k} | max abs error {v:.2g} | | ok |"
              for k, v in errors.items()]  # fmt: skip
    bw, mm = r.get("copy_bandwidth_gbs"), r.get("bf16_matmul_tflops")
    if bw is not None:
        lines.append(f"| memory copy (read + write) | {bw:,.4g} GB/s | | |")
    if mm is not None:
        lines.append(f"| bf16 matmul {plan.matmul_n}^3 | {mm:,.4g} TFLOP/s | | |")
    for batch in plan.decode_batches:
        d = r.get(f"decode_b{batch}")
        if d:
            lines.append(
                f"| decode step, batch {batch}, context {plan.context} | "
                f"{d['step_s'] * 1e3:.2f} ms ({batch / d['step_s']:,.0f} tok/s) | "
                f"floor {d['floor_s'] * 1e3:.2f} ms (weights + {d['kv_bytes'] / 1e9:.2f} GB KV) | "
                f"{d['floor_s'] / d['step_s']:.0%} |"
            )
    p = r.get("prefill")
    if p and mm:
        tflops = p["flops"] / p["seconds"] / 1e12
        lines.append(
            f"| prefill {p['tokens']} tokens | {p['seconds'] * 1e3:.1f} ms, {tflops:.4g} "
            f"TFLOP/s | matmul {mm:.4g} TFLOP/s | {tflops / mm:.0%} |"
        )
    for seqs in plan.throughput_seqs:
        t = r.get(f"throughput_c{seqs}")
        if t:
            lines.append(
                f"| offline {plan.input_len} in / {plan.output_len} out, {seqs} seqs | "
                f"{t['output_tok_s']:,.0f} output tok/s ({t['total_tok_s']:,.0f} total), "
                f"{t['seconds']:.1f} s, {t['compilations']} compilations while timed | | |"
            )
    return "\n".join(lines)


def _interrupted(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}: stopped before the end")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--small", action="store_true", help="shrunk model and workloads")
    parser.add_argument("--json", default=None, help="also write the results here")
    parser.add_argument("--scan-layers", action="store_true", help="stacked layers, lax.scan")
    parser.add_argument("--markdown", default=None, help="write the RESULTS.md section here")
    parser.add_argument("--write-results", action="store_true", help="into bench/RESULTS.md")
    args = parser.parse_args()
    plan = SMALL_PLAN if args.small else FULL
    if args.scan_layers:
        plan = dataclasses.replace(plan, scan_layers=True)
    compilation.install()
    results: dict[str, Any] = {
        "device": str(jax.devices()[0].device_kind),
        "platform": jax.default_backend(),
        "versions": {"jax": jax.__version__},
        "plan": {k: v for k, v in asdict(plan).items() if k != "cfg"},
    }
    print(f"device: {results['device']} ({results['platform']}), jax {jax.__version__}")

    def report(name: str, value: Any) -> None:
        results[name] = value
        print(f"{name}: {value}", flush=True)
        if args.json:  # kept current, so a run cut short still leaves what it measured
            Path(args.json).write_text(json.dumps(results, indent=1, default=str))

    start = time.perf_counter()
    signal.signal(signal.SIGTERM, _interrupted)  # run.sh's timeout: still print the table
    try:
        run(plan, report)
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        wall = time.perf_counter() - start
        command = "bash bench/gpu/run.sh" if not args.small else "SMALL=1 bash bench/gpu/run.sh"
        lines = common.preamble(command, results["versions"] | {"device": results["device"]})
        text = "\n".join([*lines, f"- wall time: {wall:.0f} s", "", table(plan, results)])
        print(f"\n{text}")
        if args.markdown:
            Path(args.markdown).write_text(text + "\n")
        if args.write_results:
            title = "Device benchmark, --small on CPU" if args.small else "Device benchmark"
            common.write_section(f"{title} (bench/gpu/run.sh)", text)


if __name__ == "__main__":
    main()
