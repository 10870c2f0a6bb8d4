"""Bad model input through the real CLI: one line that names the problem, exit status 1,
no traceback."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import safetensors.torch
from gguf import GGMLQuantizationType as T

from tests.engine.tiny_gguf import tiny_llama, write_llama_gguf

ROOT = Path(__file__).resolve().parents[2]


def hf_dir(tmp: Path) -> Path:
    tiny_llama().save_pretrained(tmp / "hf")
    return tmp / "hf"


def missing_path(tmp: Path) -> str:
    return str(tmp / "no-such-model")


def corrupt_safetensors_header(tmp: Path) -> str:
    directory = hf_dir(tmp)
    (directory / "model.safetensors").write_bytes(b"\x20\x00\x00\x00\x00\x00\x00\x00{not json")
    return str(directory)


def truncated_gguf(tmp: Path) -> str:
    path = tmp / "tiny.gguf"
    write_llama_gguf(path, tiny_llama())
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    return str(path)


def unsupported_architecture(tmp: Path) -> str:
    directory = hf_dir(tmp)
    config = json.loads((directory / "config.json").read_text())
    config["architectures"] = ["GPTNeoXForCausalLM"]
    (directory / "config.json").write_text(json.dumps(config))
    return str(directory)


def unsupported_quantization(tmp: Path) -> str:
    path = tmp / "tiny.gguf"
    write_llama_gguf(path, tiny_llama(), override_type={"blk.1.ffn_up.weight": T.Q5_1})
    return str(path)


def missing_tensor(tmp: Path) -> str:
    directory = hf_dir(tmp)
    state = safetensors.torch.load_file(directory / "model.safetensors")
    del state["model.layers.1.mlp.up_proj.weight"]
    safetensors.torch.save_file(state, directory / "model.safetensors")
    return str(directory)


CASES: dict[str, tuple[Callable[[Path], str], list[str]]] = {
    "missing path": (missing_path, ["no-such-model", "not found"]),
    "corrupt safetensors header": (corrupt_safetensors_header, ["model.safetensors", "corrupt"]),
    "truncated gguf": (truncated_gguf, ["tiny.gguf", "truncated or corrupt GGUF"]),
    "unsupported architecture": (unsupported_architecture, ["GPTNeoXForCausalLM"]),
    "unsupported quantization": (unsupported_quantization, ["blk.1.ffn_up.weight", "Q5_1"]),
    "missing tensor": (missing_tensor, ["missing tensor model.layers.1.mlp.up_proj.weight"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_model_gives_one_line_error(case: str, tmp_path: Path) -> None:
    make, expected = CASES[case]
    model = make(tmp_path)
    result = subprocess.run(
        [sys.executable, "-m", "serving.cli", "generate", "--model", model, "--prompt", "hi"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("xlaserve: error: ")
    for fragment in expected:
        assert fragment in lines[0]


def test_bad_argument_is_a_usage_error() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "serving.cli", "generate", "--prompt", "hi", "--max-tokens", "0"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "--max-tokens: must be >= 1" in result.stderr
