"""bench/expert_parallel.py runs end to end at toy sizes (`--smoke`: a decode step at EP 2) and
prints its table with both dispatches' times and bytes."""

from __future__ import annotations

from tests.bench.test_scripts import ROOT, run_bench


def test_expert_parallel_bench_smoke() -> None:
    out = run_bench(str(ROOT / "bench" / "expert_parallel.py"), "--smoke", timeout=300)
    assert "| step | EP | allgather ms | all_to_all ms |" in out
    rows = [line for line in out.splitlines() if line.startswith("| decode 4 seqs | 2 |")]
    assert len(rows) == 1 and rows[0].count("|") == 7, rows
