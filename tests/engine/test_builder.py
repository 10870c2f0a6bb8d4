"""`EngineConfig` and `build_engine`: one hashable value describes an engine, and the offline API
and the CLI build theirs through `build_engine` from the flags they were given."""

from __future__ import annotations

import dataclasses

import pytest

import engine.builder
from engine import naive
from engine.config import (
    CacheConfig,
    CompilationConfig,
    EngineConfig,
    ParallelConfig,
    QuantizationConfig,
    SchedulerConfig,
)
from engine.llm import LLM
from engine.llm_engine import LLMEngine, run_to_completion
from engine.protocol import Engine
from engine.request import SamplingParams
from serving import cli
from sharding.layout import ShardingLayout
from tests.conftest import PAGE

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPTS = ["Hello, world", "The quick brown fox"]


@pytest.fixture
def built(monkeypatch: pytest.MonkeyPatch) -> list[EngineConfig]:
    """Every config `build_engine` is called with, whoever calls it."""
    configs: list[EngineConfig] = []
    real = engine.builder.build_engine

    def spy(config: EngineConfig) -> Engine:
        configs.append(config)
        return real(config)

    monkeypatch.setattr(engine.builder, "build_engine", spy)
    monkeypatch.setattr("engine.llm.build_engine", spy)
    return configs


def small(model: str) -> EngineConfig:
    return EngineConfig(
        model,
        cache=CacheConfig(page_size=PAGE, num_pages=64),
        scheduler=SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=16, max_model_len=64),
        compilation=CompilationConfig(warm_up="lazy"),
    )


def test_engine_config_is_a_hashable_value() -> None:
    a = EngineConfig("m", quantization=QuantizationConfig("int8"))
    b = EngineConfig("m", quantization=QuantizationConfig("int8"))
    assert a == b and hash(a) == hash(b)
    assert a != a.replace(scheduler=SchedulerConfig(max_num_seqs=8))
    assert hash(a.replace(parallel=ParallelConfig(ShardingLayout.named(tp=2)))) != hash(a)
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.model = "other"  # type: ignore[misc]


def test_config_values_are_checked_on_creation() -> None:
    with pytest.raises(ValueError, match="warm_up must be one of"):
        CompilationConfig(warm_up="sometimes")
    with pytest.raises(ValueError, match="go together"):
        ParallelConfig(coordinator_address="127.0.0.1:1234")
    with pytest.raises(ValueError, match="dtype must be one of"):
        EngineConfig(dtype="float16")


def test_a_built_engine_answers_like_one_assembled_by_hand(tiny_dir, tiny, built) -> None:
    """The oracle: an LLMEngine put together from the same parameters by hand."""
    cfg, params, tokenizer = tiny
    config = small(str(tiny_dir))
    by_hand = LLMEngine(
        cfg,
        params,
        tokenizer,
        cache_config=config.cache,
        scheduler_config=config.scheduler,
        warm_up=False,
    )
    for i, prompt in enumerate(PROMPTS):
        by_hand.add_request(str(i), prompt, GREEDY)
    expected = [o.outputs[0].token_ids for o in run_to_completion(by_hand, ["0", "1"])]

    llm = LLM(config=config)
    assert built == [config]
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    assert got == expected
    info = llm.engine.model_info()
    assert (info.vocab_size, info.max_model_len, info.max_num_seqs) == (cfg.vocab_size, 64, 2)
    assert llm.engine.stats().num_generation_tokens == len(PROMPTS) * GREEDY.max_tokens
    assert llm.engine.health().ok


def test_xlaserve_generate_builds_its_engine_from_its_flags(tiny_dir, tiny, built, capsys) -> None:
    status = cli.main(
        ["generate", "--model", str(tiny_dir), "--prompt", "Hello", "--max-tokens", "3",
         "--max-model-len", "64", "--compilation-cache-dir", ""]
    )  # fmt: skip
    assert status == 0
    [config] = built
    assert config == EngineConfig(
        str(tiny_dir),
        cache=CacheConfig(16, num_pages=4),
        scheduler=SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=256, max_model_len=64),
        compilation=CompilationConfig(warm_up="lazy"),
    )
    # The oracle: full-recompute greedy decoding of the prompt, stopping at EOS as the CLI does.
    cfg, params, tokenizer = tiny
    eos = tokenizer.eos_token_ids
    ids = list(
        naive.generate(
            params, cfg, tokenizer.encode("Hello"), naive.NaiveSampling(max_tokens=3), stop_ids=eos
        )
    )
    expected = tokenizer.decode([t for t in ids if t not in eos])
    assert capsys.readouterr().out == expected + "\n"


def test_serve_flags_become_one_engine_config(tmp_path) -> None:
    layout = tmp_path / "layout.json"
    layout.write_text(
        '{"mesh": {"x": 2, "y": 4}, "rules": {"mlp": "x", "heads": "y", "kv_heads": "y"}}'
    )
    args = cli._parser().parse_args(
        ["serve", "--model", "m", "--dtype", "bfloat16", "--quantization", "int4",
         "--kv-cache-memory", "1GiB", "--kv-cache-dtype", "int8", "--max-num-seqs", "8",
         "--max-num-batched-tokens", "64", "--max-model-len", "512", "--warm-up", "eager",
         "--compilation-cache-dir", "/c", "--sharding-layout", str(layout)]
    )  # fmt: skip
    assert cli.serve_config(args) == EngineConfig(
        "m",
        dtype="bfloat16",
        quantization=QuantizationConfig("int4"),
        cache=CacheConfig(memory_bytes=2**30, kv_cache_dtype="int8"),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=512),
        parallel=ParallelConfig(ShardingLayout.from_file(layout)),
        compilation=CompilationConfig(cache_dir="/c", warm_up="eager"),
    )
    named = cli._parser().parse_args(["serve", "--tensor-parallel-size", "2"])
    assert cli.serve_config(named).parallel.layout == ShardingLayout.named(tp=2)


def test_int8_activations_flag_needs_int4_weights() -> None:
    args = cli._parser().parse_args(["serve", "--quantization", "int4", "--int8-activations"])
    assert cli.serve_config(args).quantization == QuantizationConfig("int4", int8_activations=True)
    for flags, problem in (
        (["--int8-activations"], "--int8-activations needs --quantization int4"),
        (["--quantization", "int8", "--int8-activations"], "int8 activations need int4 weights"),
    ):
        with pytest.raises(cli.XlaserveError, match=problem):
            cli.serve_config(cli._parser().parse_args(["serve", *flags]))


def test_a_layout_file_and_parallel_sizes_do_not_mix(tmp_path) -> None:
    args = cli._parser().parse_args(
        ["serve", "--sharding-layout", str(tmp_path / "l.json"), "--tensor-parallel-size", "2"]
    )
    with pytest.raises(cli.XlaserveError, match="either --sharding-layout or"):
        cli.serve_config(args)
