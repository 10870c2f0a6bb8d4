"""Paged KV cache layout (K/V interleaved per page, optional lane padding, optional int8/fp8
values with per-token-and-head scales) and its write."""

from pallas_kernels.kv_cache_update.layout import (
    KVCacheSpec,
    KVPages,
    QuantizedKVPages,
    init_kv_pages,
    quantize_kv,
    split_pages,
    write_kv,
)

__all__ = [
    "KVCacheSpec",
    "KVPages",
    "QuantizedKVPages",
    "init_kv_pages",
    "quantize_kv",
    "split_pages",
    "write_kv",
]
