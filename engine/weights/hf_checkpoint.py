"""Hugging Face checkpoint directories: config.json and *.safetensors (sharded or not)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
import numpy as np
from safetensors import safe_open

from engine.errors import ModelLoadError


def read_json(path: Path) -> dict[str, Any]:
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError as e:
        raise ModelLoadError(f"{path}: file not found") from e
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{path}: invalid JSON ({e.msg} at line {e.lineno})") from e
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path}: expected a JSON object")
    return data


class SafetensorsSource:
    """Reads the tensors of a checkpoint directory one at a time, on demand.

    Only the headers are read up front; a tensor's bytes are read when `get` asks for it, so
    loading never holds more than one tensor on the host.
    """

    def __init__(self, directory: Path):
        files = sorted(directory.glob("*.safetensors"))
        if not files:
            raise ModelLoadError(f"{directory}: no *.safetensors files")
        self._file_of: dict[str, Path] = {}
        self._shape: dict[str, tuple[int, ...]] = {}
        for file in files:
            with _open(file) as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    self._file_of[name] = file
                    self._shape[name] = tuple(f.get_slice(name).get_shape())

    def names(self) -> set[str]:
        return set(self._file_of)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._shape[name]

    def get(self, name: str) -> np.ndarray:
        # framework="flax" because NumPy has no bfloat16; the array stays on the host CPU.
        with (
            jax.default_device(jax.local_devices(backend="cpu")[0]),
            _open(self._file_of[name]) as f,
        ):
            return np.asarray(f.get_tensor(name))

    def get_blocks(self, name: str, bits: int) -> None:
        """Safetensors hold float tensors: nothing to take as quantized blocks."""
        return None


def _open(file: Path) -> Any:
    try:
        return safe_open(str(file), framework="flax")
    except Exception as e:  # the library raises its own SafetensorError with a reason
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ModelLoadError(f"{file}: corrupt safetensors file ({reason})") from e
