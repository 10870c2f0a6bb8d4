"""`xlaserve convert`: orbax round trips are exact, and a converted directory serves like its
source."""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import pytest

from engine.config import CacheConfig, QuantizationConfig, SchedulerConfig
from engine.errors import XlaserveError
from engine.llm_engine import LLMEngine, run_to_completion
from engine.models.quant import QuantizedWeight
from engine.request import SamplingParams
from engine.tokenizer import load_tokenizer
from engine.weights import convert, open_checkpoint, resolve_model
from serving.cli import main
from tests.engine.tiny_model import write_tiny_checkpoint

CASES = [("float32", None), ("bfloat16", None), ("float32", "int8"), ("float32", "int4")]


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("src"))


def assert_bit_equal(got: object, want: object) -> None:
    """Same tree (QuantizedWeight statics included), dtypes, shapes and bytes."""
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert (x.dtype, x.shape) == (y.dtype, y.shape)
        assert np.array_equal(np.asarray(x).view(np.uint8), np.asarray(y).view(np.uint8))


def quantization(method: str | None) -> QuantizationConfig | None:
    return None if method is None else QuantizationConfig(method)


@pytest.mark.parametrize(("dtype", "method"), CASES, ids=[c[1] or c[0] for c in CASES])
def test_round_trip_is_bit_exact(source: Path, tmp_path: Path, dtype: str, method) -> None:
    cfg, params = convert(
        str(source), tmp_path / "out", dtype=dtype, quantization=quantization(method)
    )
    checkpoint = open_checkpoint(resolve_model(str(tmp_path / "out")))
    assert checkpoint.cfg == cfg and cfg.dtype == dtype
    restored = checkpoint.load_params()
    assert_bit_equal(restored, params)
    wq = restored["layers"][0]["wq"]
    assert isinstance(wq, QuantizedWeight) == (method is not None)
    leaf = jax.tree.leaves(restored)[0]
    assert leaf.sharding.device_set == {jax.local_devices()[0]}


def greedy(model: str, dtype: str | None = None, method: str | None = None) -> list[int]:
    checkpoint = open_checkpoint(resolve_model(model), dtype=dtype)
    engine = LLMEngine(
        checkpoint.cfg,
        checkpoint.load_params(quantization=quantization(method)),
        load_tokenizer(checkpoint.files.path),
        cache_config=CacheConfig(page_size=4, num_pages=64),
        scheduler_config=SchedulerConfig(
            max_num_seqs=1, max_num_batched_tokens=16, max_model_len=64
        ),
        warm_up=False,
    )
    engine.add_request("r", [256, 40, 41, 42, 43], SamplingParams(temperature=0, max_tokens=6))
    outputs = run_to_completion(engine, ["r"])
    return list(outputs[0].outputs[0].token_ids)


@pytest.mark.parametrize("method", ["int4"])  # float: the CLI test below
def test_converted_directory_generates_like_its_source(
    source: Path, tmp_path: Path, method
) -> None:
    convert(str(source), tmp_path / "out", quantization=quantization(method))
    assert greedy(str(tmp_path / "out")) == greedy(str(source), method=method)
    # The tokenizer and chat template came along.
    original, copied = load_tokenizer(source), load_tokenizer(tmp_path / "out")
    assert copied.chat_template == original.chat_template is not None
    assert copied.encode("hi <|user|>x") == original.encode("hi <|user|>x")


def test_a_dtype_asked_at_load_casts_float_leaves(source: Path, tmp_path: Path) -> None:
    _, params = convert(str(source), tmp_path / "out", dtype="bfloat16")
    checkpoint = open_checkpoint(resolve_model(str(tmp_path / "out")), dtype="float32")
    assert checkpoint.cfg.dtype == "float32"
    widened = jax.tree.map(lambda x: x.astype("float32"), params)
    assert_bit_equal(checkpoint.load_params(), widened)


def test_a_different_quantization_needs_the_source(source: Path, tmp_path: Path) -> None:
    convert(str(source), tmp_path / "out", quantization=QuantizationConfig("int8"))
    checkpoint = open_checkpoint(resolve_model(str(tmp_path / "out")))
    with pytest.raises(XlaserveError, match="converted with int8; --quantization int4"):
        checkpoint.load_params(quantization=QuantizationConfig("int4"))


def test_cli_convert_then_generate(
    source: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    args = ["--prompt", "ab", "--max-tokens", "4", "--compilation-cache-dir", ""]
    assert (
        main(["convert", "--model", str(source), "--output", str(out), "--dtype", "float32"]) == 0
    )
    assert f"wrote {out}" in capsys.readouterr().out
    assert main(["generate", "--model", str(out), *args]) == 0
    assert len(capsys.readouterr().out) > 1  # four tokens of a random model, then a newline


def test_cli_convert_refuses_a_foreign_directory(
    source: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    assert main(["convert", "--model", str(source), "--output", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("xlaserve: error: --output ") and "not a converted checkpoint" in err
    assert err.count("\n") == 1
    assert (tmp_path / "notes.txt").read_text() == "mine"
