"""Shared fixtures: a tiny random Llama checkpoint and one engine over it (compiling an engine's
buckets is the slow part, so the session shares one)."""

from __future__ import annotations

import gc
from pathlib import Path

import jax
import pytest

from engine.config import CacheConfig, SchedulerConfig
from engine.llm_engine import LLMEngine
from engine.tokenizer import load_tokenizer
from engine.weights import open_checkpoint, resolve_model
from tests.engine.tiny_model import write_tiny_checkpoint

PAGE = 4  # small pages, so that short sequences cross many page boundaries


@pytest.fixture(autouse=True, scope="module")
def release_compiled_programs(request):
    """Frees, after each test module, the compiled programs only JAX's caches still hold.

    JAX's caches keep the executables they compiled after the engine that asked for them is gone,
    and each XLA:CPU executable holds memory maps of its own: the tiny engine's 32 step variants
    hold 5,112, still there once the engine is deleted, 33 after `jax.clear_caches()`. Over the
    whole suite in one process they reached the kernel's limit (vm.max_map_count, 65,530): the
    next compile failed to map its code, and the exception raised for that crashed in the
    unwinder. Engines that tests still hold keep their own executables; what a later module
    needs again is compiled again. Past half the limit it fails here, naming the module, rather
    than as a crash in some later compile."""
    yield
    gc.collect()
    jax.clear_caches()
    maps_file, limit_file = Path("/proc/self/maps"), Path("/proc/sys/vm/max_map_count")
    if maps_file.exists() and limit_file.exists():  # Linux
        maps, limit = len(maps_file.read_text().splitlines()), int(limit_file.read_text())
        assert maps < limit // 2, (
            f"{maps} memory maps after {request.module.__name__} (the limit is {limit}): "
            "engines that tests keep hold too many compiled programs"
        )


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def tiny(tiny_dir):
    checkpoint = open_checkpoint(resolve_model(str(tiny_dir)))
    return checkpoint.cfg, checkpoint.load_params(), load_tokenizer(tiny_dir)


@pytest.fixture(scope="session")
def engine(tiny) -> LLMEngine:
    cfg, params, tokenizer = tiny
    return LLMEngine(
        cfg,
        params,
        tokenizer,
        cache_config=CacheConfig(page_size=PAGE, num_pages=512),
        scheduler_config=SchedulerConfig(
            max_num_seqs=8, max_num_batched_tokens=32, max_model_len=256
        ),
    )


@pytest.fixture(scope="session")
def lora(tmp_path_factory):
    """The LoRA tests' tiny Llama, peft adapters and warmed-up engine (lora_adapters.py)."""
    from tests.engine.lora_adapters import lora_setup

    return lora_setup(tmp_path_factory.mktemp("lora"))


@pytest.fixture(scope="session")
def moe(tmp_path_factory):
    """The MoE tests' tiny Qwen3-MoE and warmed-up engine (tiny_moe.py)."""
    from tests.engine.tiny_moe import moe_setup

    return moe_setup(tmp_path_factory.mktemp("qwen3-moe"))
