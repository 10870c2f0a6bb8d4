"""bench/moe.py runs end to end at toy sizes (`--smoke`) and prints both of its tables."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_moe_bench_smoke() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "moe.py"), "--smoke"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=True,
    )
    assert "| 16 | MoE, sorted |" in done.stdout
    assert "| decode 4 seqs |" in done.stdout
