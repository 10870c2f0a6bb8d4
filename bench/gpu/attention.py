"""Kernel-only device benchmark: ragged paged attention against the device's own limits.

    bash bench/gpu/run.sh                       (this, then llama_bench.py; installs nothing)
    BENCH=kernels bash bench/gpu/run.sh         (this one only)
    SMALL=1 BENCH=kernels bash bench/gpu/run.sh (shrunk, runs on a CPU: the GPU kernel in
                                                 Pallas interpret mode; tested in the suite)

Decode: batches of 1, 8, 64 and 256 sequences decoding one token at contexts of 512 to 8k, with
Llama-3-8B heads (32 query / 8 KV, D 128) and SmolLM2 heads (9 / 3, D 64), bf16 caches, and int8
and fp8 caches (per-slot scales) for Llama-3-8B. Reported: the KV bytes a step must read (K, V
and scales of every context token) over its time, as GB/s and as a fraction of the device copy
bandwidth measured in the same run (read + write bytes of a large elementwise copy).
Prefill: one sequence's chunk of 512 to 4k tokens attending causally to itself; reported as
causal attention TFLOP/s (4 * Hq * D * keys seen, summed over queries) and as a fraction of the
bf16 matmul rate measured in the same run.

Correctness: every timed call's output is compared with the pure-jnp reference on the same
inputs before it is timed; any case off by more than the dtype's tolerance makes the run exit
non-zero ("correctness check failed"), after writing the table.

Times: a warm-up call (compilation) and then the best of `repeats` batches of `calls` calls
queued back to back (one sync per batch), so launch latency does not hide the kernel. A case is
skipped, and marked so, once the time budget is spent.
"""

from __future__ import annotations

import argparse
import json
import signal
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from bench import common
from bench.gpu.llama_bench import copy_bandwidth_gbs, matmul_tflops
from pallas_kernels.kv_cache_update import QuantizedKVPages
from pallas_kernels.kv_cache_update.layout import KVPages, split_pages
from pallas_kernels.ragged_paged_attention import gpu, ragged_paged_attention

HEADS = {"llama3-8b": (32, 8, 128), "smollm2": (9, 3, 64), "tiny": (4, 2, 64)}
CACHE_DTYPES = {"bf16": jnp.bfloat16, "int8": jnp.int8, "fp8": jnp.float8_e4m3fn}
# Largest |kernel - reference| allowed on outputs of size ~1: both read the same bf16 (or
# dequantized) K/V; they differ by bf16 rounding of p before p @ V and of the output (2^-8 each).
TOLERANCE = 3e-2
PAGE_SIZE = 16
Attention = Callable[..., jax.Array]


@dataclass(frozen=True)
class Case:
    kind: str  # "decode" or "prefill"
    heads: str  # key of HEADS
    cache: str  # key of CACHE_DTYPES
    batch: int  # sequences
    context: int  # kv_len of every sequence
    q_len: int  # query tokens per sequence (1 for decode; == context for a prefill chunk)

    @property
    def name(self) -> str:
        return f"{self.kind} {self.heads} {self.cache} b{self.batch} ctx{self.context}"

    def kv_bytes(self) -> int:
        """Bytes a call must read from the cache: K and V of every context token (+ scales)."""
        _, kv_heads, head_dim = HEADS[self.heads]
        per_token = 2 * kv_heads * head_dim * jnp.dtype(CACHE_DTYPES[self.cache]).itemsize
        if self.cache != "bf16":
            per_token += 2 * kv_heads * 4  # f32 scale per slot and combined head
        return self.batch * self.context * per_token

    def flops(self) -> float:
        """Causal attention FLOPs: q.k and p @ v, 2 each per (query, key, head, lane)."""
        q_heads, _, head_dim = HEADS[self.heads]
        first = self.context - self.q_len  # keys before the chunk
        keys_seen = self.q_len * first + self.q_len * (self.q_len + 1) // 2
        return 4.0 * q_heads * head_dim * keys_seen * self.batch


@dataclass(frozen=True)
class Plan:
    cases: tuple[Case, ...]  # in order of importance: what the time budget may cut comes last
    copy_mib: int
    matmul_n: int
    calls: int  # calls queued per timed batch
    repeats: int
    budget_s: float  # stop starting new cases after this many seconds


def _decode_cases(
    heads: str, caches: tuple[str, ...], batches: tuple[int, ...], contexts: tuple[int, ...]
) -> tuple[Case, ...]:
    return tuple(
        Case("decode", heads, cache, b, c, 1) for cache in caches for b in batches for c in contexts
    )


def _prefill_cases(
    heads: str, caches: tuple[str, ...], chunks: tuple[int, ...]
) -> tuple[Case, ...]:
    return tuple(Case("prefill", heads, cache, 1, n, n) for cache in caches for n in chunks)


FULL = Plan(
    cases=_decode_cases("llama3-8b", ("bf16",), (1, 8, 64, 256), (512, 2048, 8192))
    + _prefill_cases("llama3-8b", ("bf16",), (512, 1024, 2048, 4096))
    + _decode_cases("smollm2", ("bf16",), (1, 8, 64, 256), (512, 2048, 8192))
    + _decode_cases("llama3-8b", ("int8", "fp8"), (8, 64, 256), (2048, 8192))
    + _prefill_cases("smollm2", ("bf16",), (512, 1024, 2048, 4096))
    + _prefill_cases("llama3-8b", ("int8", "fp8"), (1024, 4096)),
    copy_mib=2048,
    matmul_n=8192,
    calls=10,
    repeats=5,
    budget_s=200.0,
)
SMALL = Plan(
    cases=(
        Case("decode", "tiny", "bf16", 4, 64, 1),
        Case("decode", "tiny", "int8", 1, 64, 1),
        Case("prefill", "tiny", "bf16", 1, 32, 32),
    ),
    copy_mib=16,
    matmul_n=256,
    calls=1,
    repeats=1,
    budget_s=120.0,
)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class Inputs:
    q: jax.Array  # bf16[T, Hq, D]
    kv_pages: KVPages  # [num_pages, PAGE_SIZE, 2*Hkv, D], bf16 or quantized
    kv_lens: jax.Array  # i32[S]
    page_table: jax.Array  # i32[S, P]
    cu_q_lens: jax.Array  # i32[S+1]
    num_seqs: jax.Array  # i32[]


def make_inputs(case: Case, seed: int = 0) -> Inputs:
    """Random queries and cache for a case, built on the device; pages shuffled over the pool."""
    q_heads, kv_heads, head_dim = HEADS[case.heads]
    pages_per_seq = -(-case.context // PAGE_SIZE)
    num_pages = case.batch * pages_per_seq
    kq, kk, ks, kp = jax.random.split(jax.random.key(seed), 4)
    shape = (num_pages, PAGE_SIZE, 2 * kv_heads, head_dim)
    values = jax.random.normal(kk, shape, jnp.float32)
    kv_pages: KVPages
    if case.cache == "bf16":
        kv_pages = values.astype(jnp.bfloat16)
    else:
        qmax = 127.0 if case.cache == "int8" else 448.0
        stored = (
            jnp.clip(jnp.round(values * qmax / 4), -qmax, qmax)
            if case.cache == "int8"
            else (jnp.clip(values * qmax / 4, -qmax, qmax))
        )
        scales = jax.random.uniform(ks, shape[:3], jnp.float32, 2.0, 6.0) / qmax
        kv_pages = QuantizedKVPages(stored.astype(CACHE_DTYPES[case.cache]), scales)
    tokens = case.batch * case.q_len
    table = jax.random.permutation(kp, num_pages).astype(jnp.int32)
    return Inputs(
        q=jax.random.normal(kq, (tokens, q_heads, head_dim), jnp.bfloat16),
        kv_pages=kv_pages,
        kv_lens=jnp.full((case.batch,), case.context, jnp.int32),
        page_table=table.reshape(case.batch, pages_per_seq),
        cu_q_lens=jnp.arange(case.batch + 1, dtype=jnp.int32) * case.q_len,
        num_seqs=jnp.array(case.batch, jnp.int32),
    )


def kernel_under_test() -> Attention:
    """The GPU kernel: compiled on a GPU (through the dispatcher), Pallas interpret mode
    elsewhere (the same kernel body, so SMALL=1 on a CPU checks it too)."""
    if jax.default_backend() == "gpu":
        return jax.jit(lambda x, *, sm_scale: _call(x, sm_scale, "gpu"), static_argnames="sm_scale")

    def interpreted(x: Inputs, *, sm_scale: float) -> jax.Array:
        values, scales = split_pages(x.kv_pages)
        return gpu.ragged_paged_attention_gpu(
            x.q,
            values,
            x.kv_lens,
            x.page_table,
            x.cu_q_lens,
            x.num_seqs,
            sm_scale=sm_scale,
            kv_scales=scales,
            interpret=True,
        )

    return jax.jit(interpreted, static_argnames="sm_scale")


def _call(x: Inputs, sm_scale: float, impl: str) -> jax.Array:
    return ragged_paged_attention(
        x.q,
        x.kv_pages,
        x.kv_lens,
        x.page_table,
        x.cu_q_lens,
        x.num_seqs,
        sm_scale=sm_scale,
        impl=impl,
    )


_reference = jax.jit(
    lambda x, *, sm_scale: _call(x, sm_scale, "reference"), static_argnames="sm_scale"
)


def max_error(case: Case, x: Inputs, attention: Attention) -> float:
    """Largest |kernel - reference| over the case's output."""
    scale = HEADS[case.heads][2] ** -0.5
    got = attention(x, sm_scale=scale).astype(jnp.float32)
    want = _reference(x, sm_scale=scale).astype(jnp.float32)
    return float(jnp.max(jnp.abs(got - want)))


def best_seconds(fn: Callable[[], Any], calls: int, repeats: int) -> float:
    """Per-call time: the best of `repeats` batches of `calls` queued calls, after a warm-up."""
    jax.block_until_ready(fn())
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        outs = [fn() for _ in range(calls)]
        jax.block_until_ready(outs)
        best = min(best, (time.perf_counter() - start) / calls)
    return best


def measure(
    case: Case, plan: Plan, attention: Attention, limits: dict[str, float]
) -> dict[str, Any]:
    """One row: correctness first, then time, bandwidth or FLOP rate, and fractions of limits."""
    x = make_inputs(case)
    scale = HEADS[case.heads][2] ** -0.5
    row: dict[str, Any] = asdict(case) | {
        "name": case.name,
        "max_error": max_error(case, x, attention),
    }
    row["correct"] = row["max_error"] <= TOLERANCE
    seconds = best_seconds(lambda: attention(x, sm_scale=scale), plan.calls, plan.repeats)
    row["us"] = seconds * 1e6
    row["gb_s"] = case.kv_bytes() / seconds / 1e9
    row["tflop_s"] = case.flops() / seconds / 1e12
    row["of_copy"] = row["gb_s"] / limits["copy_gb_s"]
    row["of_matmul"] = row["tflop_s"] / limits["matmul_tflop_s"]
    return row


def run(
    plan: Plan, attention: Attention, report: Callable[[str, Any], None]
) -> list[dict[str, Any]]:
    """Device limits, then every case until the budget is spent; returns the rows."""
    start = time.perf_counter()
    limits = {
        "copy_gb_s": copy_bandwidth_gbs(plan.copy_mib, plan.repeats),
        "matmul_tflop_s": matmul_tflops(plan.matmul_n, plan.repeats),
    }
    report("limits", limits)
    rows: list[dict[str, Any]] = []
    for case in plan.cases:
        if time.perf_counter() - start > plan.budget_s:
            rows.append(asdict(case) | {"name": case.name, "skipped": "time budget spent"})
            continue
        rows.append(measure(case, plan, attention, limits))
        report("rows", rows)
    return rows


def table(rows: list[dict[str, Any]], limits: dict[str, float]) -> str:
    lines = [
        f"Device copy bandwidth {limits['copy_gb_s']:,.0f} GB/s (read + write), bf16 matmul "
        f"{limits['matmul_tflop_s']:,.1f} TFLOP/s.",
        "",
        "| case | max err | us/call | KV GB/s | of copy | TFLOP/s | of matmul |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "skipped" in r:
            lines.append(f"| {r['name']} | skipped: {r['skipped']} | | | | | |")
            continue
        flag = "" if r["correct"] else " WRONG"
        lines.append(
            f"| {r['name']} | {r['max_error']:.1e}{flag} | {r['us']:,.1f} | {r['gb_s']:,.1f} | "
            f"{r['of_copy']:.0%} | {r['tflop_s']:,.2f} | {r['of_matmul']:.0%} |"
        )
    return "\n".join(lines)


def check_correct(rows: list[dict[str, Any]]) -> None:
    """Exits non-zero naming the cases whose output differed from the reference."""
    wrong = [r["name"] for r in rows if r.get("correct") is False]
    if wrong:
        raise SystemExit(f"correctness check failed (max error > {TOLERANCE}): {', '.join(wrong)}")


def _interrupted(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}: stopped before the end")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--small", action="store_true", help="tiny cases (CPU: interpret mode)")
    parser.add_argument("--json", default=None, help="also write the results here")
    parser.add_argument("--markdown", default=None, help="write the RESULTS.md section here")
    parser.add_argument("--write-results", action="store_true", help="into bench/RESULTS.md")
    args = parser.parse_args(argv)
    plan = SMALL if args.small else FULL
    results: dict[str, Any] = {"device": str(jax.devices()[0].device_kind), "jax": jax.__version__}
    print(f"device: {results['device']} ({jax.default_backend()}), jax {jax.__version__}")

    def report(name: str, value: Any) -> None:
        results[name] = value
        if args.json:  # kept current, so a run cut short still leaves what it measured
            Path(args.json).write_text(json.dumps(results, indent=1, default=str))

    signal.signal(signal.SIGTERM, _interrupted)  # run.sh's timeout: still print the table
    try:
        run(plan, kernel_under_test(), report)
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        command = ("SMALL=1 " if args.small else "") + "BENCH=kernels bash bench/gpu/run.sh"
        lines = common.preamble(command, {"jax": jax.__version__, "device": results["device"]})
        rows = results.get("rows", [])
        text = (
            "\n".join([*lines, "", table(rows, results["limits"])]) if "limits" in results else ""
        )
        print(f"\n{text}", flush=True)
        if args.markdown:
            Path(args.markdown).write_text(text + "\n")
        if args.write_results:
            title = "Attention kernels, --small on CPU" if args.small else "Attention kernels"
            common.write_section(f"{title} (bench/gpu/attention.py)", text)
    check_correct(results["rows"])


if __name__ == "__main__":
    main()
