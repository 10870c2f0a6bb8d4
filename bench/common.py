"""What every benchmark records: the machine, its measured memory bandwidth and Python speed,
the commit and versions; and how it writes its section of bench/RESULTS.md."""

from __future__ import annotations

import datetime
import os
import platform
import statistics
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

RESULTS = Path(__file__).with_name("RESULTS.md")


def cpu_name() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def memory_bandwidth_gbs(mib: int = 1024, repeats: int = 5) -> float:
    """Streaming read bandwidth with one thread per core (NumPy's sum releases the GIL), the
    median of `repeats` passes over `mib` MiB: what a memory-bound decode step can hope for."""
    threads = len(os.sched_getaffinity(0))
    chunks = np.array_split(np.ones(mib << 18, np.float32), threads)
    times = []
    with ThreadPoolExecutor(threads) as pool:
        for _ in range(repeats):
            start = time.perf_counter()
            list(pool.map(np.sum, chunks))
            times.append(time.perf_counter() - start)
    return (mib << 20) / statistics.median(times) / 1e9


def python_loop_ms(additions: int = 1_000_000, repeats: int = 5) -> float:
    """Milliseconds for one thread to add `additions` integers in a plain Python loop, the
    median of `repeats`: how fast this machine runs the interpreter now, which the host's
    costs (scheduling, detokenization, HTTP) follow as a decode step follows the memory read.
    (On these VMs it has drifted by up to 4x within a day.)"""
    times = []
    for _ in range(repeats):
        start, total = time.perf_counter(), 0
        for i in range(additions):
            total += i
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def commit() -> str:
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain"], capture_output=True, text=True)
        return head + (" (uncommitted changes)" if dirty.stdout.strip() else "")
    except (subprocess.CalledProcessError, FileNotFoundError):
        return "unknown"


def preamble(command: str, versions: dict[str, str]) -> list[str]:
    cores = len(os.sched_getaffinity(0))
    listed = ", ".join(f"{k} {v}" for k, v in versions.items())
    return [
        f"- date: {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC",
        f"- commit: {commit()}",
        f"- machine: {cpu_name()}, {cores} cores, memory read {memory_bandwidth_gbs():.1f} GB/s, "
        f"a plain-Python loop of 1M additions {python_loop_ms():.0f} ms",
        f"- versions: python {platform.python_version()}, {listed}",
        f"- command: `{command}`",
    ]


def write_section(title: str, text: str) -> None:
    """Replaces the `## {title}` section of bench/RESULTS.md (or appends it), keeping others."""
    heading = f"## {title}"
    old = RESULTS.read_text() if RESULTS.exists() else "# xlaserve benchmark results\n"
    head, found, rest = old.partition(heading)
    tail = rest[rest.find("\n## ") + 1 :] if found and "\n## " in rest else ""
    body = f"{heading}\n\n{text.strip()}\n"
    RESULTS.write_text(head.rstrip("\n") + "\n\n" + body + ("\n" + tail if tail else ""))
