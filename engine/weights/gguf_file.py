"""GGUF files: metadata, and tensors dequantized to float through the `gguf` package, or taken
as their quantized blocks (Q8_0, Q4_0, Q4_1, Q4_K) without a float copy."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

from engine.errors import ModelLoadError, UnsupportedModelError
from engine.weights.quantize import HostQuantized

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

# Block types taken as they are for a quantized load of that many bits: the file's integers and
# scales become the device's. Q8_0 is kept at 8 bits under int4 too, as the file chose it (Q4
# files keep the embedding at Q8_0).
DIRECT_TYPES = {
    8: frozenset({GGMLQuantizationType.Q8_0}),
    4: frozenset(
        {
            GGMLQuantizationType.Q8_0,
            GGMLQuantizationType.Q4_0,
            GGMLQuantizationType.Q4_1,
            GGMLQuantizationType.Q4_K,
        }
    ),
}

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
    # Qwen3's QK-norm; experts (qwen3moe, and Mixtral as `llama`), all experts in one tensor
    # each: gate and up [E, F, D] (fused into HF's gate_up_proj by `weights.experts`), down
    # [E, D, F] as HF's fused down_proj, and the router [E, D].
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_exps.weight": "mlp.experts.gate_exps",
    "ffn_up_exps.weight": "mlp.experts.up_exps",
    "ffn_down_exps.weight": "mlp.experts.down_proj",
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
        return self._unpermute(name, array)

    def get_blocks(self, name: str, bits: int) -> HostQuantized | None:
        """The tensor's own quantized blocks (shaped like `get`: [out, in], or [E, out, in] for
        all experts of a layer; groups of 32 along in), if its type is one taken directly at
        `bits` (DIRECT_TYPES); else None."""
        tensor = self._tensors[name]
        if tensor.tensor_type not in DIRECT_TYPES[bits]:
            return None
        *outer, cols = self.shape(name)
        rows = math.prod(outer)
        try:
            data = np.asarray(tensor.data, np.uint8).reshape(rows, -1)
            q = decode_blocks(data, tensor.tensor_type, cols)
        except ValueError as e:
            raise ModelLoadError(f"{self._path}: tensor {tensor.name} is corrupt ({e})") from e
        q = q.convert(lambda x: x.reshape(*outer, x.shape[-1]))
        return q.convert(lambda x: self._unpermute(name, x))

    def _unpermute(self, name: str, array: np.ndarray) -> np.ndarray:
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


# ---- quantized blocks -> integers and per-32 scales (ggml's layouts) ------------------------


def decode_blocks(data: np.ndarray, qtype: GGMLQuantizationType, cols: int) -> HostQuantized:
    """u8[rows, bytes per row] of Q8_0/Q4_0/Q4_1/Q4_K blocks -> integers [rows, cols] and f32
    scales (and offsets) [rows, cols / 32], so that w = q * scale + offset is what ggml's
    dequantization computes, bit for bit (every product involved is exact in float32)."""
    rows = data.shape[0]
    if qtype == GGMLQuantizationType.Q4_K:
        return _decode_q4_k(data.reshape(rows, cols // 256, 144), rows, cols)
    size = {GGMLQuantizationType.Q8_0: 34, GGMLQuantizationType.Q4_0: 18}.get(qtype, 20)
    blocks = data.reshape(rows, cols // 32, size)
    d = _f16(blocks[..., 0:2])  # f32[rows, cols/32]
    if qtype == GGMLQuantizationType.Q8_0:
        return HostQuantized(blocks[..., 2:].view(np.int8).reshape(rows, cols), d, None, 8)
    if qtype == GGMLQuantizationType.Q4_0:  # w = d * (q - 8)
        return HostQuantized(_nibbles(blocks[..., 2:], rows, cols), d, -8 * d, 4)
    return HostQuantized(_nibbles(blocks[..., 4:], rows, cols), d, _f16(blocks[..., 2:4]), 4)


def _f16(two_bytes: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(two_bytes).view(np.float16)[..., 0].astype(np.float32)


def _nibbles(qs: np.ndarray, rows: int, cols: int) -> np.ndarray:
    """Q4_0/Q4_1 bytes [rows, blocks, 16]: byte j holds element j (low) and j + 16 (high)."""
    return np.concatenate([qs & 0xF, qs >> 4], axis=-1).reshape(rows, cols)


def _decode_q4_k(blocks: np.ndarray, rows: int, cols: int) -> HostQuantized:
    """Q4_K super-blocks of 256 (d, dmin, 12 bytes of 6-bit scales and mins, 128 bytes of
    nibbles): eight groups of 32 with w = d * sc * q - dmin * m."""
    d, dmin = _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4])  # f32[rows, supers]
    packed = blocks[..., 4:16].reshape(*blocks.shape[:2], 3, 4)
    lo, hi, mixed = packed[..., 0, :], packed[..., 1, :], packed[..., 2, :]
    sc = np.concatenate([lo & 0x3F, (mixed & 0xF) | ((lo >> 2) & 0x30)], axis=-1)
    mins = np.concatenate([hi & 0x3F, (mixed >> 4) | ((hi >> 2) & 0x30)], axis=-1)
    scales = (d[..., None] * sc.astype(np.float32)).reshape(rows, cols // 32)
    offsets = -(dmin[..., None] * mins.astype(np.float32)).reshape(rows, cols // 32)
    # 4 chunks of 32 bytes: low nibbles are group 2j, high nibbles group 2j + 1.
    qs = blocks[..., 16:].reshape(*blocks.shape[:2], 4, 1, 32)
    values = np.concatenate([qs & 0xF, qs >> 4], axis=-2).reshape(rows, cols)
    return HostQuantized(values, scales, offsets, 4)
