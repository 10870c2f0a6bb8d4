"""Shared fixtures: a tiny random Llama checkpoint and one engine over it (compiling an engine's
buckets is the slow part, so the session shares one)."""

from __future__ import annotations

import pytest

from engine.config import CacheConfig, SchedulerConfig
from engine.llm_engine import LLMEngine
from engine.tokenizer import load_tokenizer
from engine.weights import open_checkpoint, resolve_model
from tests.engine.tiny_model import write_tiny_checkpoint

PAGE = 4  # small pages, so that short sequences cross many page boundaries


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
