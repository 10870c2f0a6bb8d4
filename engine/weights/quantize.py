"""Host-side weight quantization (NumPy, one tensor at a time) and placement on the device.

Two sources of quantized weights:
- a float tensor quantized at load: int8 symmetric per output channel (one scale per output
  element, the whole contraction axis one group), or int4 asymmetric (min/max) in groups of
  `group_size` consecutive elements of the contraction axis;
- a GGUF tensor's own blocks (`engine/weights/gguf_file.py`): Q8_0 as int8, Q4_0/Q4_1/Q4_K as
  int4, groups of 32; the integers and scales are taken as stored, never widened to a float copy
  of the tensor.

Either way the result is a `HostQuantized` in the checkpoint's orientation, put through the same
layout change as a float tensor (`TensorSpec.convert`: transposes and reshapes, applied to the
integers and to the scales alike), then packed and placed as a `QuantizedWeight`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import numpy as np

from engine.config import QuantizationConfig
from engine.models.quant import QUANTIZED_AXIS, QuantizedWeight


class HostQuantized(NamedTuple):
    """A quantized tensor on the host; integers unpacked, one per element."""

    values: np.ndarray  # i8 (bits 8) or u8 0..15 (bits 4), the tensor's shape
    scales: np.ndarray  # f32, the shape with the contraction axis divided by the group size
    offsets: np.ndarray | None  # f32 like scales, or None (symmetric)
    bits: int

    def convert(self, fn: Callable[[np.ndarray], np.ndarray]) -> HostQuantized:
        """The same layout change applied to values, scales and offsets."""
        offsets = None if self.offsets is None else fn(self.offsets)
        return HostQuantized(fn(self.values), fn(self.scales), offsets, self.bits)


def quantize_int8(w: np.ndarray, axis: int, group_size: int | None = None) -> HostQuantized:
    """Symmetric int8: one scale per output element (the whole `axis` one group), or per
    `group_size` consecutive elements of `axis`."""
    w = w.astype(np.float32)
    dim = w.shape[axis]
    group = dim if group_size is None else group_size_for(dim, group_size)
    grouped = w.reshape(*w.shape[:axis], dim // group, group, *w.shape[axis + 1 :])
    amax = np.abs(grouped).max(axis=axis + 1, keepdims=True)
    scales = np.where(amax > 0, amax / 127.0, 1.0).astype(np.float32)
    values = np.clip(np.rint(grouped / scales), -127, 127).astype(np.int8)
    return HostQuantized(values.reshape(w.shape), scales.squeeze(axis + 1), None, 8)


def group_size_for(dim: int, group_size: int) -> int:
    """`group_size` if it divides the axis, else the largest power of two dividing both (a
    576-wide axis takes groups of 64 when 128 is asked for)."""
    if dim % group_size == 0:
        return group_size
    return 1 << (math.gcd(dim, group_size).bit_length() - 1)


def quantize_int4(w: np.ndarray, axis: int, group_size: int) -> HostQuantized:
    """Asymmetric int4 over groups of `group_size` along `axis`: q = round((w - min) / scale)."""
    w = w.astype(np.float32)
    dim = w.shape[axis]
    group = group_size_for(dim, group_size)
    grouped = w.reshape(*w.shape[:axis], dim // group, group, *w.shape[axis + 1 :])
    lo = grouped.min(axis=axis + 1, keepdims=True)
    hi = grouped.max(axis=axis + 1, keepdims=True)
    scales = np.where(hi > lo, (hi - lo) / 15.0, 1.0).astype(np.float32)
    values = np.clip(np.rint((grouped - lo) / scales), 0, 15).astype(np.uint8)
    return HostQuantized(
        values.reshape(w.shape), scales.squeeze(axis + 1), lo.squeeze(axis + 1), bits=4
    )


# The embedding/output layer is int8 in groups of 32 along D under both methods, as llama.cpp's
# files keep it at Q8_0 (or Q6_K): on SmolLM2-135M, per-channel int8 of the tied embedding alone
# changed float32's greedy continuations (64 tokens) on 8 of 10 prompts, and int4 more.
EMBEDDING_LEAVES = frozenset({"embed", "lm_head"})
EMBEDDING_GROUP = 32


def quantize(w: np.ndarray, leaf: str, config: QuantizationConfig) -> HostQuantized:
    """The float weight `leaf` of the params (a key of QUANTIZED_AXIS) quantized per `config`."""
    axis = QUANTIZED_AXIS[leaf]
    if leaf in EMBEDDING_LEAVES:
        return quantize_int8(w, axis, EMBEDDING_GROUP)
    if config.method == "int8":
        return quantize_int8(w, axis)
    return quantize_int4(w, axis, config.group_size)


def pack_int4(values: np.ndarray, axis: int) -> np.ndarray:
    """u8 0..15 -> u8 with `axis` halved: element 2j in the low nibble of byte j."""
    if values.shape[axis] % 2:
        raise ValueError(f"int4 packing needs an even axis, got {values.shape=} at {axis=}")
    pairs = values.reshape(*values.shape[:axis], -1, 2, *values.shape[axis + 1 :])
    low = np.take(pairs, 0, axis=axis + 1)
    high = np.take(pairs, 1, axis=axis + 1)
    return (low | (high << 4)).astype(np.uint8)


def to_device(
    q: HostQuantized, axis: int, dtype: str, sharding: jax.sharding.Sharding | None = None
) -> QuantizedWeight:
    """Packs (int4) and places the arrays; the result dequantizes to `dtype`."""
    values = pack_int4(q.values, axis) if q.bits == 4 else q.values.astype(np.int8)

    def put(x: np.ndarray | None) -> jax.Array | None:
        return None if x is None else jax.device_put(x, sharding)

    return QuantizedWeight(
        put(values), put(q.scales.astype(np.float32)), put(q.offsets), q.bits, axis, dtype
    )


def quantize_params(params: Any, config: QuantizationConfig, dtype: str) -> Any:
    """A float params pytree with every linear weight (`QUANTIZED_AXIS`) quantized as at load
    time (through the host, one weight at a time); other leaves are kept."""

    def visit(node: Any, name: str | None) -> Any:
        if isinstance(node, dict):
            return {key: visit(child, key) for key, child in node.items()}
        if isinstance(node, list):
            return [visit(child, None) for child in node]
        if name in QUANTIZED_AXIS:
            host = quantize(np.asarray(node), name, config)
            return to_device(host, QUANTIZED_AXIS[name], dtype)
        return node

    return visit(params, None)
