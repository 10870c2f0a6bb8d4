"""The pieces of bench/gpu/ that must be right before they reach a device: llama_bench.py's
attention oracle check and the arithmetic of its bounds (the whole script runs on CPU with
`SMALL=1 BENCH=llama bash bench/gpu/run.sh`, a few minutes: not in the test suite), and
attention.py end to end on CPU (`SMALL=1 BENCH=kernels`), whose correctness check must catch a
kernel that reads one wrong key."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from bench.gpu import attention, llama_bench
from engine.models import registry

ROOT = Path(__file__).resolve().parents[2]


def test_attention_check_passes_and_catches_a_wrong_scale(monkeypatch):
    errors = llama_bench.check_attention(llama_bench.SMALL)
    assert errors["reference"] < 1e-4
    real = llama_bench.ragged_paged_attention
    monkeypatch.setattr(
        llama_bench,
        "ragged_paged_attention",
        lambda *a, sm_scale, impl: real(*a, sm_scale=sm_scale * 1.5, impl=impl),
    )
    with pytest.raises(SystemExit, match="attention check failed"):
        llama_bench.check_attention(llama_bench.SMALL)


def test_dense_oracle_by_hand():
    # one query at position 1 over two keys: weights softmax([0, 1]) on values 0 and 1
    q = np.array([[[1.0]]])
    k = np.array([[[0.0]], [[1.0]]])
    v = np.array([[[0.0]], [[1.0]]])
    out = llama_bench.dense_attention(q, k, v, scale=1.0)
    assert out[0, 0, 0] == pytest.approx(np.e / (1 + np.e))


def test_prefill_flops_of_llama3_8b():
    # ~7.0e9 weights outside the embedding: 2 * 2048 tokens * 6.98e9 = 2.86e13, plus attention
    # 2 * 2 * 32 heads * 128 * (2048 * 2049 / 2) * 32 layers = 1.10e12, plus one logits row
    flops = llama_bench.prefill_flops(llama_bench.LLAMA3_8B, 2048)
    assert flops == pytest.approx(2.86e13 + 1.10e12, rel=0.01)


def test_random_params_have_the_loaders_layout():
    cfg = llama_bench.SMALL.replace(num_layers=1, vocab_size=64)
    params = llama_bench.random_params(cfg, scan_layers=False)
    specs = registry.family(cfg).hf_tensor_specs(cfg.replace(tie_word_embeddings=False))
    assert {spec.path[-1] for spec in specs.values()} == set(params) - {"layers"} | set(
        params["layers"][0]
    )
    assert params["layers"][0]["wq"].shape == (256, 4, 64)  # [D, Hq, head_dim]


def test_kernel_bench_runs_on_cpu_and_writes_its_table(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "SMALL": "1",
        "BENCH": "kernels",
        "OUT": str(tmp_path),
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",  # run.sh calls python3
        "JAX_PLATFORMS": "cpu",
    }
    done = subprocess.run(
        ["bash", str(ROOT / "bench" / "gpu" / "run.sh")],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = json.loads((tmp_path / "bench-gpu-kernels.json").read_text())["rows"]
    assert [r["name"] for r in rows] == [c.name for c in attention.SMALL.cases]
    assert all(r["correct"] and r["max_error"] < attention.TOLERANCE for r in rows)
    table = (tmp_path / "bench-gpu-kernels.md").read_text()
    assert "| decode tiny int8 b1 ctx64 |" in table and "| prefill tiny bf16 b1 ctx32 |" in table


def test_kernel_bench_fails_when_one_key_is_wrong() -> None:
    """The kernel under test reads V = 1000 for the last context key of sequence 0 (every head)
    instead of the cache's value: that row's output moves by ~1000 x its softmax weight (~1/64)."""
    case = attention.SMALL.cases[0]  # decode, four sequences of 64 keys, bf16 cache
    assert case.kind == "decode" and case.cache == "bf16"
    x = attention.make_inputs(case)
    real = attention.kernel_under_test()
    key = case.context - 1
    page, slot = x.page_table[0, key // attention.PAGE_SIZE], key % attention.PAGE_SIZE

    def corrupted(x: attention.Inputs, *, sm_scale: float) -> jax.Array:
        pages = x.kv_pages.at[page, slot, 1::2].set(1000.0)  # V of every kv head
        return real(dataclasses.replace(x, kv_pages=pages), sm_scale=sm_scale)

    assert attention.max_error(case, x, real) < attention.TOLERANCE
    limits = {"copy_gb_s": 1.0, "matmul_tflop_s": 1.0}
    plan = dataclasses.replace(attention.SMALL, calls=1, repeats=1)
    row = attention.measure(case, plan, corrupted, limits)
    assert not row["correct"] and row["max_error"] > 1.0
    with pytest.raises(SystemExit, match=r"correctness check failed.*decode tiny bf16 b4 ctx64"):
        attention.check_correct([row])
