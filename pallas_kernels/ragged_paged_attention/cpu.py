"""Ragged paged attention on CPU: the C++ kernel (`pallas_kernels.cpu`) for every row, decode
and prefill alike.

The reference spends most of its time in XLA:CPU gathers, transposes and masks; the kernel walks
each row's pages in place. Measured on the 2-core AVX2 machine (SmolLM2 shapes, 30 layers):
64 decodes at ~330 keys 336 ms in the reference, 106 ms in the kernel; bench/RESULTS.md.
The kernel reads a float32 or bfloat16 cache (widened to float32 as it is read; every sum is
float32). Combinations it does not take (a quantized cache, a head_dim other than 64, 128 or
256, more than 8 query heads per kv head), or a machine where it could not be built, run the
reference.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import cpu
from pallas_kernels.ragged_paged_attention import reference
from pallas_kernels.ragged_paged_attention.reference import check_supported

HEAD_DIMS, MAX_GROUP = (64, 128, 256), 8  # the kernel is compiled for these


def kernel_supports(q: jax.Array, kv_pages: jax.Array, kv_scales: jax.Array | None) -> bool:
    head_dim, group = q.shape[2], q.shape[1] // (kv_pages.shape[2] // 2)
    return (
        kv_scales is None
        and kv_pages.dtype in (jnp.float32, jnp.bfloat16)
        and jnp.issubdtype(q.dtype, jnp.floating)
        and head_dim in HEAD_DIMS
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
    return cpu.ragged_attention(
        *args, sm_scale=sm_scale, sliding_window=sliding_window, logit_soft_cap=logit_soft_cap
    )


__all__ = ["check_supported", "ragged_paged_attention_cpu"]
