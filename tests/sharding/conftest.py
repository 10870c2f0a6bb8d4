"""The sharding tests need 8 (simulated) devices, fixed before JAX starts its backend:
`make test` runs them as their own pytest process with
XLA_FLAGS=--xla_force_host_platform_device_count=8. Anywhere else they skip, saying so."""

from __future__ import annotations

import jax
import pytest

from engine.config import CacheConfig, SchedulerConfig
from engine.llm_engine import LLMEngine
from engine.request import SamplingParams
from engine.tokenizer import load_tokenizer
from engine.weights import open_checkpoint, resolve_model
from sharding.mesh import make_mesh
from tests.engine.tiny_model import write_tiny_checkpoint

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


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """The tiny Llama with weights of std 0.1 (the suite's has 0.3): logits of magnitude ~2, so
    that the different summation order of sharded matmuls (a few ulps of the logits) stays
    well inside the absolute 1e-5 bound."""
    directory = write_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), initializer_range=0.1)
    checkpoint = open_checkpoint(resolve_model(str(directory)))
    return checkpoint.cfg, checkpoint.load_params(), load_tokenizer(directory)


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
