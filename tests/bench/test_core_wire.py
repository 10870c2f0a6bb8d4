"""bench/core_wire.py runs (a few messages) and prints its table."""

from __future__ import annotations

from bench import core_wire


def test_core_wire_smoke(capsys) -> None:
    core_wire.main(["--outputs", "4", "--repeats", "3"])
    table = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 4 |")]
    assert len(table) == 2  # RequestOutput and compact
