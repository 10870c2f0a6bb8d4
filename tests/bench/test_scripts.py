"""The benchmark scripts import and parse their arguments (running them takes minutes)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "script",
    ["startup.py", "weights_dtype.py", "host_overhead.py", "structured.py", "speculative.py"],
)
def test_help(script: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / script), "--help"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=True,
    )
    assert "--write-results" in done.stdout


def test_lora_smoke() -> None:
    """bench/lora.py end to end on a tiny random model (the real run is SmolLM2's)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "lora.py"), "--smoke"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        check=True,
    )
    assert "| spread over 4 adapters |" in done.stdout
    assert "| adapter read and written into a slot first |" in done.stdout


def test_speculative_smoke() -> None:
    """bench/speculative.py end to end on a tiny random model (the real run is SmolLM2's)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "speculative.py"), "--smoke"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        check=True,
    )
    assert "| copy-heavy | 1 | ngram k=3 |" in done.stdout
    assert "| random | 4 | off |" in done.stdout


def test_host_overhead_smoke() -> None:
    """bench/host_overhead.py's offline parts, (a) and (c), at one small size (no server)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "host_overhead.py"), "--running", "4",
         "--steps", "2", "--warm-steps", "1", "--served"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        check=True,
    )  # fmt: skip
    assert "| running seqs | schedule |" in done.stdout
    assert "| running seqs | sync steps/s | async steps/s |" in done.stdout
