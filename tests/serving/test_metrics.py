"""The metrics of start-up and of compilations after warm-up, read from /metrics' text."""

from __future__ import annotations

import time

import jax
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.llm_engine import LLMEngine
from engine.protocol import EngineStats
from serving.openai.metrics import ServerMetrics


def samples(metrics: ServerMetrics, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    """{labels: value} of the samples called `name` in the rendered metrics."""
    found = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for sample in family.samples:
            if sample.name == name:
                found[tuple(sorted(sample.labels.items()))] = sample.value
    return found


def test_startup_seconds_count_from_the_server_start_once_per_stage() -> None:
    metrics = ServerMetrics(lambda: None, "m")
    assert samples(metrics, "xlaserve:startup_seconds") == {}
    time.sleep(0.05)
    metrics.healthy()
    time.sleep(0.05)
    metrics.first_token(0.01)
    metrics.healthy()  # later calls change nothing
    metrics.first_token(0.01)
    got = {dict(labels)["stage"]: value for labels, value in samples(
        metrics, "xlaserve:startup_seconds").items()}  # fmt: skip
    assert got.keys() == {"healthy", "first_token"}
    assert 0.05 <= got["healthy"] < 1.0
    assert got["healthy"] + 0.05 <= got["first_token"] < 2.0


def test_compilations_after_warmup_counts_what_compiles_later(
    engine: LLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    metrics = ServerMetrics(lambda: engine, "tiny")
    name = "xlaserve:compilations_after_warmup_total"
    [before] = samples(metrics, name).values()
    jax.jit(lambda x: x * 3 + 1)(np.ones(7, np.float32))  # a program nobody compiled yet
    [after] = samples(metrics, name).values()
    assert after == before + 1
    monkeypatch.setattr(engine.runner, "compilations_at_warm_up", None)  # still warming up
    assert list(samples(metrics, name).values()) == [0]


class _FixedStats:
    """An engine that only answers `stats`, with the given snapshot."""

    def __init__(self, stats: EngineStats):
        self._stats = stats

    def stats(self) -> EngineStats:
        return self._stats


def test_expert_tokens_are_counted_per_layer_and_expert() -> None:
    """EngineStats.expert_tokens [layer][expert] -> xlaserve:expert_tokens_total{layer,
    expert}; absent when the engine does not count them (an empty table)."""
    table = ((5, 0, 7), (1, 2, 9))
    metrics = ServerMetrics(lambda: _FixedStats(EngineStats(expert_tokens=table)), "m")
    got = {
        (dict(labels)["layer"], dict(labels)["expert"]): value
        for labels, value in samples(metrics, "xlaserve:expert_tokens_total").items()
    }
    assert got == {(str(i), str(e)): n for i, row in enumerate(table) for e, n in enumerate(row)}
    off = ServerMetrics(lambda: _FixedStats(EngineStats()), "m")
    assert samples(off, "xlaserve:expert_tokens_total") == {}
    assert samples(off, "xlaserve:lora_requests_info") == {}  # LoRA off: max_loras 0
