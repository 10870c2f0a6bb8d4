"""Paged KV cache layout (K/V interleaved per page, optional lane padding) and its write."""

from pallas_kernels.kv_cache_update.layout import KVCacheSpec, init_kv_pages, write_kv

__all__ = ["KVCacheSpec", "init_kv_pages", "write_kv"]
