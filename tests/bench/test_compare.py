"""bench/compare.py's verdicts: each ratio divides xlaserve's number by the right peer's."""

from __future__ import annotations

import http.server
import sys
import threading
from typing import Any

import pytest

from bench import baselines, compare


def _result(output_tps: float, ttft_ms: float, tpot_ms: float) -> dict[str, Any]:
    return {"output_throughput": output_tps, "median_ttft_ms": ttft_ms, "median_tpot_ms": tpot_ms}


def test_ratios_name_each_peer_and_divide_by_it() -> None:
    rows = [
        compare.Row("xlaserve", 64, _result(300.0, 0, 0)),
        compare.Row("xlaserve", 1, _result(0, 500.0, 10.0)),
        compare.Row("llama-server", 64, _result(100.0, 0, 0)),
        compare.Row("llama-server", 1, _result(0, 800.0, 8.0)),
        compare.Row("llamacpp", 64, _result(200.0, 0, 0)),
    ]
    lines = compare._ratio_lines(rows)
    assert lines == [
        "- output tokens/s at concurrency 64, xlaserve / llama-server: 3.00x "
        "(target at least 2.5x: met)",
        "- single-stream decode (1 / median TPOT) at concurrency 1, xlaserve / llama-server: "
        "0.80x (target at least 1.0x: NOT met)",
        "- output tokens/s at concurrency 64, xlaserve / llamacpp: 1.50x "
        "(target at least 2.0x: NOT met)",
    ]


def test_llama_server_runs_one_slot_per_client_with_continuous_batching(tmp_path: Any) -> None:
    command = baselines.llama_server_command(tmp_path / "m.gguf", 8733, 2, 64, 1024)

    def flag(name: str) -> str:
        return command[command.index(name) + 1]

    assert (flag("-np"), flag("-c"), flag("-t"), flag("--port")) == ("64", "65536", "2", "8733")
    assert "--cont-batching" in command


def test_a_server_is_not_started_where_another_already_answers(tmp_path: Any) -> None:
    """A server left running by an interrupted run would answer the new one's health checks,
    and be measured in its place (it was, once, and its CPU went unseen)."""
    left_over = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), http.server.BaseHTTPRequestHandler
    )
    threading.Thread(target=left_over.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{left_over.server_address[1]}/health"
    command = [sys.executable, "-c", "raise SystemExit('started')"]
    try:
        with (
            pytest.raises(RuntimeError, match="already answers at"),
            baselines.server_process(command, url, tmp_path / "log", timeout=10),
        ):
            pass
    finally:
        left_over.shutdown()
    assert not (tmp_path / "log").exists()  # nothing was started
