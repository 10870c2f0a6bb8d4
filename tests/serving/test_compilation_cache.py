"""A second start of the same model and flags with a warm persistent compilation cache compiles
nothing: each start runs in a fresh process (as `xlaserve serve` would), loads a tiny
checkpoint, compiles every step bucket, generates, and reports XLA's backend compilations."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.engine.tiny_model import write_tiny_checkpoint

START = """
import json, sys
from engine import compilation
from engine.builder import build_engine
from engine.config import CacheConfig, CompilationConfig, EngineConfig, SchedulerConfig
from engine.request import SamplingParams

model, cache_dir = sys.argv[1:]
engine = build_engine(EngineConfig(
    model,
    cache=CacheConfig(16, num_pages=32),
    scheduler=SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=32, max_model_len=128),
    compilation=CompilationConfig(cache_dir=cache_dir),
))
engine.add_request("a", "hello", SamplingParams(max_tokens=4, temperature=0.0))
while engine.has_unfinished_requests():
    engine.step()
compiled = engine.stats().num_compiled_steps
print(json.dumps({"compilations": compilation.count(), "buckets": compiled}))
"""


def start(model: Path, cache_dir: Path) -> dict[str, int]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run(
        [sys.executable, "-c", START, str(model), str(cache_dir)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=True,
    )
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def test_second_start_compiles_nothing(tmp_path: Path) -> None:
    model = write_tiny_checkpoint(tmp_path / "model")
    cache_dir = tmp_path / "xla-cache"
    cold = start(model, cache_dir)
    assert cold["buckets"] > 1 and cold["compilations"] >= cold["buckets"]
    assert any(cache_dir.iterdir())
    warm = start(model, cache_dir)
    assert warm == {"compilations": 0, "buckets": cold["buckets"]}
