"""bench/expert_parallel.py runs end to end at toy sizes (`--smoke`: a decode step at EP 2) and
prints its table with both dispatches' times and bytes."""

from __future__ import annotations

from tests.bench.test_scripts import ROOT, run_bench


def test_expert_parallel_bench_smoke() -> None:
    out = run_bench(str(ROOT / "bench" / "expert_parallel.py"), "--smoke", timeout=300)
    assert "| step | EP | allgather ms | all_to_all ms |" in out
    rows = [line for line in out.splitlines() if line.startswith("| decode 4 seqs | 2 |")]
    assert len(rows) == 1 and rows[0].count("|") == 7, rows


def test_bytes_moved_by_hand() -> None:
    """16 tokens, d 512 float32 (2,048-byte rows), top 2, EP 8: each device holds 2 tokens,
    4 pairs. allgather: a ring all-reduce sends 2 * 7/8 * 16 rows = 28 rows; all_to_all: 7/8 of
    the 4 pairs out and back (7 rows) and the device's 2 rows to 7 others (14 rows); padded:
    4 rows to each of 7 devices, both ways (56 rows), and the same 14."""
    from sharding.experts import bytes_moved

    row = 512 * 4
    sent = bytes_moved(16, 512, 2, 8, 4)
    assert sent == {
        "allgather": 28 * row,
        "all_to_all": 21 * row,
        "all_to_all_padded": 70 * row,
    }
