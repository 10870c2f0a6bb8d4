"""GGUF files: metadata, and tensors dequantized to float through the `gguf` package."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

from engine.errors import ModelLoadError, UnsupportedModelError

SUPPORTED_TYPES = frozenset(
    {
        GGMLQuantizationType.F32,
        GGMLQuantizationType.F16,
        GGMLQuantizationType.BF16,
        GGMLQuantizationType.Q8_0,
        GGMLQuantizationType.Q4_0,
        GGMLQuantizationType.Q4_1,
        GGMLQuantizationType.Q5_0,
        GGMLQuantizationType.Q4_K,
        GGMLQuantizationType.Q6_K,
    }
)

# GGUF tensor names -> Hugging Face names, for the Llama family.
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
# Gemma 3 names its four norms differently (`ffn_norm` is the norm *before* the MLP there).
_GEMMA3_LAYER_NAMES = {
    **_LAYER_NAMES,
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
_ARCH_LAYER_NAMES = {"gemma3": _GEMMA3_LAYER_NAMES}
# llama.cpp's converter stores Gemma's RMSNorm weights as 1 + w (its norm multiplies by the
# weight); the model code here, like transformers, applies 1 + w, so loading subtracts the 1.
_NORMS_PLUS_ONE = frozenset({"gemma3"})
_LAYER_RE = re.compile(r"blk\.(\d+)\.(.+)")


def open_gguf(path: Path) -> GGUFReader:
    try:
        return GGUFReader(path)
    except Exception as e:  # gguf raises ValueError/IndexError/... on truncated or bad files
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ModelLoadError(f"{path}: truncated or corrupt GGUF file ({reason})") from e


def read_metadata(reader: GGUFReader) -> dict[str, Any]:
    """All key-value fields except the tokenizer arrays' bulk, as Python values."""
    return {name: field.contents() for name, field in reader.fields.items()}


def hf_name(gguf_name: str, architecture: str = "llama") -> str | None:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    layer_names = _ARCH_LAYER_NAMES.get(architecture, _LAYER_NAMES)
    match = _LAYER_RE.fullmatch(gguf_name)
    if match and match.group(2) in layer_names:
        return f"model.layers.{match.group(1)}.{layer_names[match.group(2)]}"
    return None


class GGUFSource:
    """The tensors of a GGUF file under their Hugging Face names, dequantized on demand.

    llama.cpp's converter permutes the rows of q and k weights (to interleave RoPE pairs); `get`
    undoes that so the weights are in the HF "rotate half" order the model code expects.
    """

    def __init__(
        self,
        path: Path,
        reader: GGUFReader,
        *,
        num_heads: int,
        num_kv_heads: int,
        architecture: str,
    ):
        self._path = path
        self._tensors = {}
        for tensor in reader.tensors:
            name = hf_name(tensor.name, architecture)
            if name is not None:
                self._tensors[name] = tensor
        # Only the `llama` converter permutes; `qwen2` GGUFs keep HF order (NeoX RoPE).
        permuted = architecture == "llama"
        self._heads = {"q_proj": num_heads, "k_proj": num_kv_heads} if permuted else {}
        self._norms_plus_one = architecture in _NORMS_PLUS_ONE

    def names(self) -> set[str]:
        return set(self._tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(int(d) for d in reversed(self._tensors[name].shape))

    def check_types(self, names: set[str]) -> None:
        for name in sorted(names):
            tensor = self._tensors[name]
            if tensor.tensor_type not in SUPPORTED_TYPES:
                raise UnsupportedModelError(
                    f"{self._path}: tensor {tensor.name} has unsupported quantization type "
                    f"{tensor.tensor_type.name}; supported: "
                    f"{', '.join(sorted(t.name for t in SUPPORTED_TYPES))}"
                )

    def get(self, name: str) -> np.ndarray:
        tensor = self._tensors[name]
        try:
            array = dequantize(tensor.data, tensor.tensor_type).reshape(self.shape(name))
        except (ValueError, IndexError) as e:
            raise ModelLoadError(f"{self._path}: tensor {tensor.name} is corrupt ({e})") from e
        for proj, heads in self._heads.items():
            if f".{proj}." in name:
                array = _unpermute_rows(array, heads)
        if self._norms_plus_one and name.endswith("norm.weight"):
            array = array - 1
        return array


def _unpermute_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's `permute`: per head, rows (pair, half) -> (half, pair)."""
    rows_per_half = w.shape[0] // num_heads // 2
    return w.reshape(num_heads, rows_per_half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
