"""The sharding tests need 8 (simulated) devices, fixed before JAX starts its backend:
`make test` runs them as their own pytest process with
XLA_FLAGS=--xla_force_host_platform_device_count=8. Anywhere else they skip, saying so."""

from __future__ import annotations

import jax
import pytest

from engine.config import CacheConfig, SchedulerConfig
from engine.llm_engine import LLMEngine
from engine.request import SamplingParams
from sharding.mesh import make_mesh

NUM_DEVICES = 8
PAGE = 4
CACHE = CacheConfig(page_size=PAGE, num_pages=128)
SCHEDULER = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=128)
# Four prompts of 16 tokens in all: one prefill step whose sequences straddle the pipeline's
# micro-batches, then decode steps (two compiled buckets per engine, to keep the tests quick).
PROMPTS = [[256, *range(40 + n, 40 + 2 * n)] for n in (2, 4, 1, 5)]
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=5)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    if jax.device_count() >= NUM_DEVICES:
        return
    reason = (
        f"needs {NUM_DEVICES} devices, found {jax.device_count()}: run with "
        f"XLA_FLAGS=--xla_force_host_platform_device_count={NUM_DEVICES} (as `make test` does)"
    )
    for item in items:
        if "tests/sharding" in str(item.fspath):
            item.add_marker(pytest.mark.skip(reason=reason))


def build_engine(tiny, *, dp: int = 1, tp: int = 1, pp: int = 1) -> LLMEngine:
    cfg, params, tokenizer = tiny
    devices = jax.devices()[: dp * tp * pp]
    mesh = make_mesh(dp=dp, tp=tp, pp=pp, devices=devices) if len(devices) > 1 else None
    return LLMEngine(
        cfg,
        params,
        tokenizer,
        cache_config=CACHE,
        scheduler_config=SCHEDULER,
        warm_up=False,
        mesh=mesh,
    )
