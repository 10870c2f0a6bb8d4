"""Ragged paged attention on CPU: the C++ decode kernel (`pallas_kernels.cpu`) for sequences
with one query row, the reference for the multi-token ones.

The reference's batched decode spends most of its time in XLA:CPU gathers and transposes; the
kernel walks each sequence's pages in place (one layer of a 64-sequence decode at 400 keys:
9.9 ms in the reference, 4.9 ms in the kernel, on the 2-core machine; bench/RESULTS.md).
Combinations the kernel does not take (a bf16 or quantized cache, head_dim not a multiple of 16
or over 256, more than 8 query heads per kv head), or a machine where it could not be built,
run the reference.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import cpu
from pallas_kernels.ragged_paged_attention import reference
from pallas_kernels.ragged_paged_attention.reference import check_supported

MAX_HEAD_DIM, MAX_GROUP = 256, 8


def kernel_supports(q: jax.Array, kv_pages: jax.Array, kv_scales: jax.Array | None) -> bool:
    head_dim, group = q.shape[2], q.shape[1] // (kv_pages.shape[2] // 2)
    return (
        kv_scales is None
        and q.dtype == kv_pages.dtype == jnp.float32
        and head_dim % 16 == 0
        and head_dim <= MAX_HEAD_DIM
        and group <= MAX_GROUP
        and cpu.available()
    )


def ragged_paged_attention_cpu(
    q: jax.Array,
    kv_pages: jax.Array,
    kv_lens: jax.Array,
    page_table: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    logit_soft_cap: float | None = None,
    kv_scales: jax.Array | None = None,
) -> jax.Array:
    """The contract of `pallas_kernels.ragged_paged_attention`, on CPU."""
    args = (q, kv_pages, kv_lens, page_table, cu_q_lens, num_seqs)
    if not kernel_supports(q, kv_pages, kv_scales):
        return reference.ragged_paged_attention_reference(
            *args,
            sm_scale=sm_scale,
            sliding_window=sliding_window,
            logit_soft_cap=logit_soft_cap,
            kv_scales=kv_scales,
        )
    with jax.named_scope("decode"):
        out = cpu.decode_attention(
            *args, sm_scale=sm_scale, sliding_window=sliding_window, logit_soft_cap=logit_soft_cap
        )
    return reference.multi_token_rows(
        out, *args, sm_scale=sm_scale, sliding_window=sliding_window, logit_soft_cap=logit_soft_cap
    )


__all__ = ["check_supported", "ragged_paged_attention_cpu"]
