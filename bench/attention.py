"""Kernel micro-benchmarks: ragged paged attention decode and prefill, against the machine's limits.

    .venv/bin/python bench/attention.py [--repeats N] [--write-results]

CPU section (always): the pure-jnp reference and the C++ kernel (the CPU production path), on
a decode batch of 32 sequences x 1,024 context and one 2,048-token prefill, for SmolLM2-like
heads (Hq=9, Hkv=3, D=64) and Llama-like heads (Hq=32, Hkv=8, D=128), one SmolLM2 sequence
decoding at 512 and 64 at 400; decodes over float32 and bfloat16 caches.
Decode reports KV bytes read per second, prefill causal FLOP/s (4 * q * ctx * Hq * D / 2);
compare with shared/BASELINES.md (~30 GB/s read, 150-230 GFLOP/s f32 on the 2-core CPU).

GPU section (only when jax.default_backend() == "gpu"): decode bandwidth as a fraction of the HBM
peak measured here with a large device copy, and prefill TFLOP/s, for impl="gpu" vs "reference".

Each workload is one jitted call site (the engine has one per layer): "compile s" is the wall
time to lower and compile it. Times are medians over repeats after a warm-up call; never assert
on them.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.ragged_paged_attention import ragged_paged_attention

RESULTS = Path(__file__).with_name("RESULTS.md")
SECTION = "## Kernels (bench/attention.py)"
HEADS = {"smollm2": (9, 3, 64), "llama": (32, 8, 128)}


@dataclass(frozen=True)
class Workload:
    name: str
    q_lens: tuple[int, ...]
    kv_lens: tuple[int, ...]
    heads: tuple[int, int, int]  # Hq, Hkv, D
    dtype: str
    page_size: int = 16

    @property
    def tokens(self) -> int:
        return sum(self.q_lens)

    def kv_bytes(self) -> int:
        """K and V bytes of every sequence's context: what a decode step must read."""
        _, hkv, d = self.heads
        return sum(self.kv_lens) * 2 * hkv * d * jnp.dtype(self.dtype).itemsize

    def flops(self) -> float:
        """Causal attention FLOPs: 2 matmuls x 2 flops x q x ctx x Hq x D, halved by the mask."""
        hq, _, d = self.heads
        return sum(4 * q * k * hq * d / 2 for q, k in zip(self.q_lens, self.kv_lens, strict=True))


def make_inputs(w: Workload, seed: int = 0) -> tuple[jax.Array, ...]:
    """Random q and cache with each sequence's pages scattered over the pool."""
    rng = np.random.default_rng(seed)
    hq, hkv, d = w.heads
    pages = [-(-k // w.page_size) for k in w.kv_lens]
    width, num_pages = max(pages), sum(pages)
    order = rng.permutation(num_pages).astype(np.int32)
    table = np.zeros((len(pages), width), np.int32)
    used = 0
    for s, n in enumerate(pages):
        table[s, :n] = order[used : used + n]
        used += n
    dtype = jnp.dtype(w.dtype)
    q = jnp.asarray(rng.standard_normal((w.tokens, hq, d)), dtype)
    kv = jnp.asarray(rng.standard_normal((num_pages, w.page_size, 2 * hkv, d)), dtype)
    cu = np.concatenate([[0], np.cumsum(w.q_lens)]).astype(np.int32)
    lens = np.asarray(w.kv_lens, np.int32)
    return (q, kv, jnp.asarray(lens), jnp.asarray(table), jnp.asarray(cu), jnp.int32(len(pages)))


@dataclass(frozen=True)
class Timing:
    seconds: float  # median wall time of one call
    cores: float  # process CPU time / wall time over the repeats: how many cores were busy
    compile_seconds: float = float("nan")  # wall time to lower and compile one call site


def measure(fn: Callable[[], jax.Array], repeats: int) -> Timing:
    jax.block_until_ready(fn())  # warm up
    times = []
    cpu_start, wall_start = time.process_time(), time.perf_counter()
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    cores = (time.process_time() - cpu_start) / (time.perf_counter() - wall_start)
    return Timing(statistics.median(times), cores)


def time_attention(w: Workload, impl: str, repeats: int) -> Timing:
    """One jitted call site, as the engine has one per layer: its compile time, then its runs."""
    args = make_inputs(w)
    call = jax.jit(
        functools.partial(ragged_paged_attention, sm_scale=w.heads[2] ** -0.5, impl=impl)
    )
    start = time.perf_counter()
    compiled = call.lower(*args).compile()
    compile_seconds = time.perf_counter() - start
    timing = measure(lambda: compiled(*args), repeats)
    return dataclasses.replace(timing, compile_seconds=compile_seconds)


def row(w: Workload, impl: str, timing: Timing, peak_gbs: float | None = None) -> str:
    seconds = timing.seconds
    decode = max(w.q_lens) == 1
    rate = w.kv_bytes() / seconds / 1e9 if decode else w.flops() / seconds / 1e9
    unit = "GB/s" if decode else "GFLOP/s"
    if not decode and rate >= 1000:
        rate, unit = rate / 1000, "TFLOP/s"
    frac = f" ({rate / peak_gbs:.0%} of peak)" if decode and peak_gbs else ""
    return (
        f"| {w.name} | {w.heads} | {w.dtype} | {impl} | {seconds * 1e3:.2f} | "
        f"{w.tokens / seconds:,.0f} | {rate:,.1f} {unit}{frac} | {timing.cores:.1f} | "
        f"{timing.compile_seconds:.2f} |"
    )


HEADER = (
    "| workload | (Hq, Hkv, D) | dtype | impl | median ms | tokens/s | achieved | cores busy "
    "| compile s |\n"
    "|---|---|---|---|---|---|---|---|---|"
)


def cpu_workloads() -> list[Workload]:
    # One sequence at a typical chat depth: the per-call overhead of a batch-1 decode step.
    smollm2 = HEADS["smollm2"]
    out = []
    for dtype in ("float32", "bfloat16"):
        out.append(Workload("decode 1x512 (smollm2)", (1,), (512,), smollm2, dtype))
        out.append(Workload("decode 64x400 (smollm2)", (1,) * 64, (400,) * 64, smollm2, dtype))
    for model, heads in HEADS.items():
        for dtype in ("float32", "bfloat16"):
            out.append(Workload(f"decode 32x1024 ({model})", (1,) * 32, (1024,) * 32, heads, dtype))
        out.append(Workload(f"prefill 2048 ({model})", (2048,), (2048,), heads, "float32"))
    return out


def cpu_section(repeats: int) -> list[str]:
    """The reference and the C++ kernel ("cpu", float32 and bfloat16 caches) for every
    workload."""
    return [
        row(w, impl, time_attention(w, impl, repeats), None)
        for w in cpu_workloads()
        for impl in ("reference", "cpu")
    ]


def hbm_peak_gbs(repeats: int, gib: int = 2) -> float:
    """Device copy bandwidth (read + write counted) of a `gib` GiB buffer."""
    x = jnp.ones((gib * 256, 1024, 1024), jnp.float32)
    copy = jax.jit(lambda a: a + 1.0)
    return 2 * x.nbytes / measure(lambda: copy(x), repeats).seconds / 1e9


def gpu_workloads() -> list[Workload]:
    heads = HEADS["llama"]
    return [
        Workload("decode 128x4096", (1,) * 128, (4096,) * 128, heads, "bfloat16"),
        Workload("prefill 8192", (8192,), (8192,), heads, "bfloat16"),
    ]


def gpu_section(
    repeats: int, workloads: list[Workload], impls: tuple[str, ...] = ("gpu", "reference")
) -> list[str]:
    peak = hbm_peak_gbs(repeats)
    lines = [f"HBM copy peak: {peak:,.0f} GB/s (read + write of 2 GiB)", "", HEADER]
    for w in workloads:
        lines += [row(w, impl, time_attention(w, impl, repeats), peak) for impl in impls]
    return lines


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        names = [
            ln.split(":", 1)[1].strip()
            for ln in cpuinfo.read_text().splitlines()
            if ln.startswith("model name")
        ]
        cpu = f"{names[0]} x {len(names)}" if names else cpu
    return f"{cpu}; {len(os.sched_getaffinity(0))} usable cores; {jax.devices()[0].device_kind}"


def commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        )
        dirty = subprocess.run(["git", "status", "--porcelain"], capture_output=True, text=True)
        return out.stdout.strip() + (" (uncommitted changes)" if dirty.stdout.strip() else "")
    except (subprocess.CalledProcessError, FileNotFoundError):
        return "uncommitted"


def report(repeats: int) -> str:
    lines = [
        SECTION,
        "",
        f"- date: {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC",
        f"- git commit: {commit()}",
        f"- machine: {machine()}",
        f"- versions: python {platform.python_version()}, jax {jax.__version__}, "
        f"backend {jax.default_backend()}",
        f"- command: `.venv/bin/python bench/attention.py {' '.join(sys.argv[1:])}`",
        "- limits (shared/BASELINES.md): ~30 GB/s streaming read with 2 threads (14-16 GB/s on"
        " one core), 150-230 GFLOP/s f32 matmul with 2 threads",
        "- cores busy: process CPU time / wall time; other workers share these 2 cores",
        "- compile s: wall time to lower and compile the workload's one jitted call site",
        "",
        HEADER,
        *cpu_section(repeats),
    ]
    if jax.default_backend() == "gpu":
        lines += ["", "### GPU", "", *gpu_section(repeats, gpu_workloads())]
    return "\n".join(lines) + "\n"


def write_results(text: str) -> None:
    """Replaces this benchmark's section of bench/RESULTS.md, keeping the others."""
    old = RESULTS.read_text() if RESULTS.exists() else "# xlaserve benchmark results\n\n"
    head, _, rest = old.partition(SECTION)
    tail = rest[rest.find("\n## ") + 1 :] if "\n## " in rest else ""
    RESULTS.write_text(head.rstrip("\n") + "\n\n" + text + ("\n" + tail if tail else ""))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--write-results", action="store_true", help=f"update {RESULTS}")
    args = parser.parse_args()
    text = report(args.repeats)
    print(text)
    if args.write_results:
        write_results(text)


if __name__ == "__main__":
    main()
