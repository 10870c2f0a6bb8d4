"""Attention over the paged KV cache, as a step hands it to the model's layers: the batch's
metadata and the function that writes the new K/V into the cache and then attends. Pure.

Shapes: T tokens, S sequences, P page-table width, N query heads, K KV heads, H head dim.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax

from pallas_kernels.kv_cache_update import KVPages, write_kv
from pallas_kernels.ragged_paged_attention import ragged_paged_attention


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class AttentionMetadata:
    """What paged attention needs besides q, k, v and the cache (a step's batch, or one
    pipeline micro-batch of it)."""

    slot_mapping: Any  # i32[T]
    kv_lens: Any  # i32[S]
    page_table: Any  # i32[S, P]
    cu_q_lens: Any  # i32[S+1]
    num_seqs: Any  # i32[]


def paged_attention(
    q: jax.Array,  # f[T, N, H]
    k: jax.Array,  # f[T, K, H]
    v: jax.Array,  # f[T, K, H]
    kv_pages: KVPages,  # one layer's cache, float or quantized
    meta: AttentionMetadata,
    *,
    sm_scale: float,
    sliding_window: int | None,
    impl: str | None,
) -> tuple[jax.Array, KVPages]:
    """Writes the tokens' K/V into the cache, then attends over it: (f[T, N, H], kv_pages).
    A float cache may be wider than the model (CacheConfig.kv_cache_dtype); q is cast to it."""
    kv_pages = write_kv(kv_pages, k, v, meta.slot_mapping)
    cache_dtype = kv_pages.dtype if isinstance(kv_pages, jax.Array) else q.dtype
    out = ragged_paged_attention(
        q.astype(cache_dtype),
        kv_pages,
        meta.kv_lens,
        meta.page_table,
        meta.cu_q_lens,
        meta.num_seqs,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        impl=impl,
    )
    return out.astype(q.dtype), kv_pages
