"""The paged KV cache layout shared by every attention backend, and the write into it.

One layer's cache is one array `kv_pages: dtype[num_pages, page_size, 2*Hkv, Dp]`:

- K and V are interleaved along the combined-head axis: `kv_pages[p, i, 2*h]` is K of kv head h and
  `kv_pages[p, i, 2*h+1]` is V of kv head h, for token slot i of page p. A page is one contiguous
  block holding both K and V of all heads for `page_size` tokens, so a kernel fetches everything a
  page contributes with one DMA (one page-table lookup, one descriptor), instead of two
  half-size copies from two arrays; the write below is likewise one scatter.
- Tokens are addressed by slot = page * page_size + offset; the engine's `slot_mapping` uses that.
- The head dim may be padded to `Dp` lanes (`KVCacheSpec.padded_head_dim`). On TPU Mosaic tiles the
  last dim in 128 lanes, so a 64-wide head would use half of every vreg and DMA anyway; the cache
  pads to a multiple of 128 and the extra lanes hold zeros (written by `write_kv`), which leaves
  q . k and p @ v unchanged once q is zero-padded too. On GPU and CPU padding would only double
  the bytes read per decode step, so there it is none (`KVCacheSpec.for_platform`).

Quantized caches ("int8", "fp8" = float8_e4m3fn) hold `QuantizedKVPages`: the values in one byte
each, in the layout above, and a float32 scale per (token slot, combined head),
`scales: f32[num_pages, page_size, 2*Hkv]`, so that K or V = values * scale. `write_kv` sets each
new token's scale from its own absmax (per token and head: no page ever needs requantizing when
a later token is larger), and the kernels dequantize what they read. One byte per element plus
4 bytes per head and token: for D=64 that is 68 bytes where bfloat16 takes 128 and float32 256.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import cpu

DTYPES = ("float32", "bfloat16", "int8", "fp8")
QUANTIZED_DTYPES = {"int8": jnp.dtype(jnp.int8), "fp8": jnp.dtype(jnp.float8_e4m3fn)}
_QMAX = {"int8": 127.0, "fp8": 448.0}  # largest magnitude each represents
TPU_LANES = 128


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class QuantizedKVPages:
    """One layer's quantized cache: K/V = values * scales[..., None]."""

    values: jax.Array  # i8|f8e4m3[num_pages, page_size, 2*Hkv, Dp]
    scales: jax.Array  # f32[num_pages, page_size, 2*Hkv]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.values.shape)


KVPages = jax.Array | QuantizedKVPages


def split_pages(kv_pages: KVPages) -> tuple[jax.Array, jax.Array | None]:
    """(values, scales) of a quantized cache; (kv_pages, None) of a float one."""
    if isinstance(kv_pages, QuantizedKVPages):
        return kv_pages.values, kv_pages.scales
    return kv_pages, None


@dataclass(frozen=True)
class KVCacheSpec:
    """Static shape of one layer's paged KV cache; hashable, so it can be a static jit argument."""

    num_pages: int
    page_size: int  # token slots per page
    num_kv_heads: int  # Hkv; the cache holds 2*Hkv combined heads (K, V interleaved)
    head_dim: int  # D of the model's K/V
    dtype: str = "float32"
    lane_multiple: int = 1  # the cache's head dim is head_dim rounded up to this

    def __post_init__(self) -> None:
        for name in ("num_pages", "page_size", "num_kv_heads", "head_dim", "lane_multiple"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")

    @classmethod
    def for_platform(
        cls,
        platform: str,
        *,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: str = "float32",
    ) -> KVCacheSpec:
        """The spec with the head-dim padding the platform's kernels want ("tpu": 128 lanes)."""
        lanes = TPU_LANES if platform == "tpu" else 1
        return cls(num_pages, page_size, num_kv_heads, head_dim, dtype, lanes)

    @property
    def padded_head_dim(self) -> int:
        """Dp, the last dim of kv_pages."""
        return -(-self.head_dim // self.lane_multiple) * self.lane_multiple

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (self.num_pages, self.page_size, 2 * self.num_kv_heads, self.padded_head_dim)

    @property
    def quantized(self) -> bool:
        return self.dtype in QUANTIZED_DTYPES

    @property
    def nbytes(self) -> int:
        """Bytes of the whole cache (values, and scales when quantized)."""
        num_pages, page_size, combined, dp = self.shape
        if self.quantized:
            return num_pages * page_size * combined * (dp + 4)
        return num_pages * page_size * combined * dp * jnp.dtype(self.dtype).itemsize

    def replace(self, **changes: int | str) -> KVCacheSpec:
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]


def init_kv_pages(spec: KVCacheSpec) -> KVPages:
    """An all-zero cache: dtype[num_pages, page_size, 2*Hkv, Dp] (and unit scales)."""
    if spec.quantized:
        values = jnp.zeros(spec.shape, QUANTIZED_DTYPES[spec.dtype])
        return QuantizedKVPages(values, jnp.ones(spec.shape[:3], jnp.float32))
    return jnp.zeros(spec.shape, jnp.dtype(spec.dtype))


def quantize_kv(x: jax.Array, dtype: jnp.dtype) -> tuple[jax.Array, jax.Array]:
    """[..., D] -> (values dtype[..., D], f32[...] scales): absmax per vector maps to the
    format's largest value (127 for int8, 448 for e4m3)."""
    qmax = _QMAX["int8" if dtype == jnp.int8 else "fp8"]
    x = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x), axis=-1)
    scale = jnp.where(amax > 0, amax / qmax, 1.0)
    scaled = x / scale[..., None]
    if dtype == jnp.int8:
        return jnp.clip(jnp.round(scaled), -127, 127).astype(jnp.int8), scale
    return jnp.clip(scaled, -qmax, qmax).astype(dtype), scale


def write_kv(
    kv_pages: KVPages,  # dtype[num_pages, page_size, 2*Hkv, Dp], or quantized
    k: jax.Array,  # [T, Hkv, D]
    v: jax.Array,  # [T, Hkv, D]
    slot_mapping: jax.Array,  # i32[T]; page * page_size + offset, -1 for padding tokens
) -> KVPages:
    """Scatters the new tokens' K and V into their slots; returns the updated kv_pages.

    Padding tokens (slot -1) are not written; lanes D..Dp of written slots become zero. A pure
    function: under jit with kv_pages donated, XLA performs the scatter in place (the output
    aliases the donated buffer). XLA:CPU has no bf16 scatter: a bf16 cache is scattered as its
    uint16 bits, and XLA:CPU copies that view of the whole pool in and out on every call (23 ms
    for a 50 MB pool, where a float32 one takes 0.05 ms), so on CPU a 16-bit cache is written by
    `pallas_kernels.cpu.write_kv` in place instead.
    A quantized cache gets each token's values and its per-head scales (`quantize_kv`).
    """
    if isinstance(kv_pages, QuantizedKVPages):
        return _write_quantized(kv_pages, k, v, slot_mapping)
    num_pages, page_size, combined, dp = kv_pages.shape
    tokens, num_kv_heads, head_dim = k.shape
    if v.shape != k.shape or combined != 2 * num_kv_heads or head_dim > dp:
        raise ValueError(
            f"{k.shape=} and {v.shape=} must be equal and [T, Hkv, D] with 2*Hkv and D <= Dp "
            f"of {kv_pages.shape=}"
        )
    if slot_mapping.shape != (tokens,):
        raise ValueError(f"{slot_mapping.shape=} must be ({tokens},), one slot per token")
    new = jnp.stack([k, v], axis=2).reshape(tokens, combined, head_dim)  # K0 V0 K1 V1 ...
    new = jnp.pad(new.astype(kv_pages.dtype), ((0, 0), (0, 0), (0, dp - head_dim)))
    num_slots = num_pages * page_size
    slots = jnp.where(slot_mapping >= 0, slot_mapping, num_slots)  # out of range: dropped

    def xla(kv_pages: jax.Array) -> jax.Array:
        flat = _bits(kv_pages).reshape(num_slots, combined, dp)
        flat = flat.at[slots].set(_bits(new), mode="drop")
        return lax.bitcast_convert_type(flat.reshape(kv_pages.shape), kv_pages.dtype)

    if kv_pages.dtype.itemsize != 2 or not cpu.available():
        return xla(kv_pages)
    kernel = functools.partial(cpu.write_kv, rows=new, slots=slots)
    return lax.platform_dependent(kv_pages, cpu=kernel, default=xla)


def _write_quantized(
    kv_pages: QuantizedKVPages, k: jax.Array, v: jax.Array, slot_mapping: jax.Array
) -> QuantizedKVPages:
    num_pages, page_size, combined, dp = kv_pages.values.shape
    tokens, _, head_dim = k.shape
    new = jnp.stack([k, v], axis=2).reshape(tokens, combined, head_dim)  # K0 V0 K1 V1 ...
    values, scales = quantize_kv(new, kv_pages.values.dtype)  # [T, 2*Hkv, D], f32[T, 2*Hkv]
    values = jnp.pad(values, ((0, 0), (0, 0), (0, dp - head_dim)))
    num_slots = num_pages * page_size
    slots = jnp.where(slot_mapping >= 0, slot_mapping, num_slots)  # out of range: dropped
    # Scattered as bytes: XLA:CPU has no float8 scatter.
    flat = lax.bitcast_convert_type(kv_pages.values, jnp.uint8).reshape(num_slots, combined, dp)
    flat = flat.at[slots].set(lax.bitcast_convert_type(values, jnp.uint8), mode="drop")
    flat_scales = kv_pages.scales.reshape(num_slots, combined).at[slots].set(scales, mode="drop")
    return QuantizedKVPages(
        lax.bitcast_convert_type(flat.reshape(kv_pages.values.shape), kv_pages.values.dtype),
        flat_scales.reshape(kv_pages.scales.shape),
    )


def _bits(x: jax.Array) -> jax.Array:
    """bf16 as u16 (exact), other dtypes unchanged; see write_kv for why."""
    return lax.bitcast_convert_type(x, jnp.uint16) if x.dtype == jnp.bfloat16 else x
