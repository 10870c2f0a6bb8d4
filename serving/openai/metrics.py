"""Prometheus metrics named after vLLM's (`vllm:` -> `xlaserve:`), in a registry per app.

Engine state (queue lengths, KV usage, token counters) is read when scraped; latency histograms
are observed by the HTTP layer as requests finish; start-up times are recorded as the server
reaches each stage.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from engine import compilation
from engine.protocol import Engine
from engine.request import RequestOutput
from serving.async_engine import LoopHealth

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160)
_TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


class _EngineCollector(Collector):
    """Reads the engine's counters at scrape time (plain ints and lengths: safe to read from
    the server thread while the engine thread steps)."""

    def __init__(
        self,
        engine: Callable[[], Engine | None],
        model_name: str,
        compilations: Callable[[], int],
    ):
        self._engine = engine
        self._compilations = compilations
        self._labels = {"model_name": model_name}

    def collect(self) -> Iterator[Metric]:
        engine = self._engine()
        if engine is None:
            return
        stats = engine.stats()
        gauges = [
            ("num_requests_running", "Sequences in the running batch.", stats.num_running),
            ("num_requests_waiting", "Sequences waiting to be scheduled.", stats.num_waiting),
            (
                "kv_cache_usage_perc",
                "Fraction of KV cache pages in use (0 to 1).",
                stats.kv_cache_usage,
            ),
            ("num_compiled_steps", "Compiled step variants.", stats.num_compiled_steps),
        ]
        counters = [
            ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
             stats.prefix_cache_queries),
            ("prefix_cache_hits", "Prompt tokens found in the prefix cache.",
             stats.prefix_cache_hits),
            ("prompt_tokens", "Prompt tokens received.", stats.num_prompt_tokens),
            ("generation_tokens", "Tokens generated.", stats.num_generation_tokens),
            ("num_preemptions", "Requests preempted for lack of KV pages.",
             stats.num_preemptions),
            ("compilations", "XLA compilations in the engine's process.", self._compilations()),
            ("compilations_after_warmup", "XLA compilations in this process after the engine "
             "compiled every step variant (0 while it warms up); more than 0 means a request "
             "waited for a compilation.", stats.compilations_after_warm_up),
        ]  # fmt: skip
        if stats.spec_decode_num_accepted_tokens_per_pos:
            counters += [
                ("spec_decode_num_drafts", "Speculative proposals verified.",
                 stats.spec_decode_num_drafts),
                ("spec_decode_num_draft_tokens", "Speculative tokens proposed.",
                 stats.spec_decode_num_draft_tokens),
                ("spec_decode_num_accepted_tokens", "Speculative tokens accepted.",
                 stats.spec_decode_num_accepted_tokens),
            ]  # fmt: skip
        for name, doc, value in gauges:
            yield self._family(GaugeMetricFamily, name, doc, value)
        for name, doc, value in counters:
            yield self._family(CounterMetricFamily, name, doc, value)
        if stats.spec_decode_num_accepted_tokens_per_pos:
            yield self._per_position(stats.spec_decode_num_accepted_tokens_per_pos)
        if stats.expert_tokens:
            yield self._expert_tokens(stats.expert_tokens)
        if stats.max_loras:
            yield self._lora_info(stats.running_lora_adapters, stats.waiting_lora_adapters,
                                  stats.max_loras)  # fmt: skip

    def _per_position(self, accepted: tuple[int, ...]) -> Metric:
        family = CounterMetricFamily(
            "xlaserve:spec_decode_num_accepted_tokens_per_pos",
            "Speculative tokens accepted, by position in the proposal (0 first).",
            labels=[*self._labels, "position"],
        )
        for position, count in enumerate(accepted):
            family.add_metric([*self._labels.values(), str(position)], count)
        return family

    def _lora_info(
        self,
        running: tuple[tuple[str, int], ...],
        waiting: tuple[tuple[str, int], ...],
        max_loras: int,
    ) -> Metric:
        """vLLM's `lora_requests_info`: the adapters in use as labels (comma-separated names),
        the value the time of the scrape."""
        family = GaugeMetricFamily(
            "xlaserve:lora_requests_info",
            "Running stats on LoRA requests: the adapters of running and of waiting sequences, "
            "and the adapters' device slots (--max-loras).",
            labels=[*self._labels, "max_lora", "waiting_lora_adapters", "running_lora_adapters"],
        )
        names = [",".join(name for name, _ in pairs) for pairs in (waiting, running)]
        family.add_metric([*self._labels.values(), str(max_loras), *names], time.time())
        return family

    def _expert_tokens(self, table: tuple[tuple[int, ...], ...]) -> Metric:
        family = CounterMetricFamily(
            "xlaserve:expert_tokens",
            "Tokens a mixture of experts routed to each expert of each layer (a token counts "
            "for each of its experts); --expert-token-counts.",
            labels=[*self._labels, "layer", "expert"],
        )
        for layer, row in enumerate(table):
            for expert, count in enumerate(row):
                family.add_metric([*self._labels.values(), str(layer), str(expert)], count)
        return family

    def _family(self, kind: type[Any], name: str, doc: str, value: float) -> Metric:
        family = kind(f"xlaserve:{name}", doc, labels=list(self._labels))
        family.add_metric(list(self._labels.values()), value)
        return family


class _LoopCollector(Collector):
    """The engine loop's progress, read at scrape time: with `/health`, what tells a stuck
    engine from an idle one (the age grows in both; health adds whether requests wait)."""

    def __init__(self, health: Callable[[], LoopHealth | None], model_name: str):
        self._health = health
        self._model_name = model_name

    def collect(self) -> Iterator[Metric]:
        health = self._health()
        if health is None:
            return
        family = GaugeMetricFamily(
            "xlaserve:last_step_age_seconds",
            "Seconds since the engine loop last finished a step (or compiled a bucket while "
            "idle); /health turns 503 when requests wait and this passes the step timeout.",
            labels=["model_name"],
        )
        family.add_metric([self._model_name], health.last_step_age_s)
        yield family


class _StartupCollector(Collector):
    """`xlaserve:startup_seconds{stage}`: seconds from the server's start (before the model
    loads) to each start-up stage it has reached."""

    def __init__(self, stages: Mapping[str, float], model_name: str):
        self._stages = stages
        self._model_name = model_name

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(
            "xlaserve:startup_seconds",
            "Seconds from the server's start to a start-up stage: healthy (the engine serves), "
            "first_token (the first token of any request).",
            labels=["model_name", "stage"],
        )
        for stage, seconds in list(self._stages.items()):
            family.add_metric([self._model_name, stage], seconds)
        yield family


class ServerMetrics:
    def __init__(
        self,
        engine: Callable[[], Engine | None],
        model_name: str,
        loop_health: Callable[[], LoopHealth | None] = lambda: None,
        compilations: Callable[[], int] = compilation.count,
    ):
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine, model_name, compilations))
        self.registry.register(_LoopCollector(loop_health, model_name))
        self._started = time.monotonic()
        self._startup: dict[str, float] = {}
        self.registry.register(_StartupCollector(self._startup, model_name))
        self._model = model_name

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            metric = Histogram(
                f"xlaserve:{name}", doc, ["model_name"], registry=self.registry, buckets=buckets
            )
            return metric

        self.ttft = histogram(
            "time_to_first_token_seconds", "Time to first token.", _LATENCY_BUCKETS
        )
        self.tpot = histogram(
            "time_per_output_token_seconds",
            "Time per output token after the first.",
            _TOKEN_BUCKETS,
        )
        self.e2e = histogram(
            "e2e_request_latency_seconds", "End-to-end request latency.", _LATENCY_BUCKETS
        )
        self.queue = histogram(
            "request_queue_time_seconds", "Time a request waited to be scheduled.", _LATENCY_BUCKETS
        )

    def healthy(self) -> None:
        """The server serves from now on (its engine is attached)."""
        self._startup.setdefault("healthy", time.monotonic() - self._started)

    def first_token(self, seconds: float) -> None:
        self._startup.setdefault("first_token", time.monotonic() - self._started)
        self.ttft.labels(self._model).observe(seconds)

    def finished(self, output: RequestOutput, started: float, first: float, now: float) -> None:
        """`output`: the request's last (finished) delta, which carries its usage."""
        self.e2e.labels(self._model).observe(now - started)
        tokens = max(output.usage.output_lengths) if output.usage is not None else 0
        if tokens > 1:
            self.tpot.labels(self._model).observe((now - first) / (tokens - 1))
        if output.scheduled_time is not None and output.arrival_time is not None:
            self.queue.labels(self._model).observe(output.scheduled_time - output.arrival_time)

    def render(self) -> bytes:
        return generate_latest(self.registry)
