"""Attention over the paged KV cache: the cache layout and its write, and ragged paged attention
with a pure-jnp reference (the CPU path) and Pallas kernels for TPU and GPU.

    from pallas_kernels.kv_cache_update import KVCacheSpec, init_kv_pages, write_kv
    from pallas_kernels.ragged_paged_attention import ragged_paged_attention
"""
