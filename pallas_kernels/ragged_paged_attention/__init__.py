"""Ragged paged attention: one contract, a pure-jnp reference and Pallas TPU and GPU kernels.

The contract every implementation follows:

- Sequence s < num_seqs owns query rows cu_q_lens[s]:cu_q_lens[s+1]: the last
  q_len = cu_q_lens[s+1] - cu_q_lens[s] tokens of its context of kv_lens[s] tokens, whose K/V are
  already in the cache. Its query i sits at absolute position pos = kv_lens[s] - q_len + i and sees
  keys j <= pos, and with a sliding window W only those with pos - j < W.
- Key j of sequence s lives in page page_table[s, j // page_size], slot j % page_size; the cache
  layout (K/V interleaved per combined head, optional head-dim padding) is
  `pallas_kernels.kv_cache_update`.
- scores = (q . k) * sm_scale, then cap * tanh(scores / cap) with a soft cap; softmax in float32;
  output in q's dtype. Query head n uses kv head n // (Hq // Hkv).
- Rows >= cu_q_lens[num_seqs], slots s >= num_seqs, page-table entries past a sequence's pages and
  unused pages may hold anything (NaN included); none of it may reach a real row.
- Only T, S and P are static; lengths and the prefill/decode mix are runtime arrays.

`impl=None` picks by platform: TPU -> the Mosaic TPU kernel, GPU -> the GPU kernel, CPU -> the
C++ kernel (`cpu.py`, with the reference for what it does not take).
The kernel modules are imported only when chosen, so the reference runs anywhere.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from pallas_kernels.kv_cache_update.layout import KVPages, split_pages
from pallas_kernels.ragged_paged_attention.reference import (
    check_inputs,
    ragged_paged_attention_reference,
)

IMPLS = ("reference", "cpu", "tpu", "gpu")
# impl -> (module under this package, its attention function); each module also has
# check_supported(q_dtype, head_dim, page_size, num_q_heads, num_kv_heads).
_MODULES = {
    "reference": ("reference", "ragged_paged_attention_reference"),
    "cpu": ("cpu", "ragged_paged_attention_cpu"),
    "tpu": ("tpu", "ragged_paged_attention_tpu"),
    "gpu": ("gpu", "ragged_paged_attention_gpu"),
}
_PLATFORM_IMPL = {"tpu": "tpu", "gpu": "gpu", "cuda": "gpu", "rocm": "gpu", "cpu": "cpu"}


def platform_of(x: jax.Array) -> str:
    """The platform x lives on; the default backend while tracing (a tracer has no device)."""
    if not isinstance(x, jax.Array):
        return jax.default_backend()
    try:
        devices = x.devices()
    except jax.errors.ConcretizationTypeError:
        return jax.default_backend()
    return next(iter(devices)).platform


def resolve_impl(impl: str | None, platform: str) -> str:
    """The implementation to run: `impl` if given (checked), else the platform's default."""
    if impl is None:
        if platform not in _PLATFORM_IMPL:
            raise ValueError(f"no ragged paged attention for platform {platform!r}; pass impl=")
        return _PLATFORM_IMPL[platform]
    if impl not in IMPLS:
        raise ValueError(f"unknown ragged paged attention {impl=}; choose one of {IMPLS}")
    return impl


def load_impl(impl: str) -> tuple[Callable[..., jax.Array], Callable[..., None]]:
    """(attention function, check_supported) of one implementation, imported on first use."""
    module_name, fn_name = _MODULES[impl]
    module: Any = importlib.import_module(f"{__name__}.{module_name}")
    return getattr(module, fn_name), module.check_supported


def ragged_paged_attention(
    q: jax.Array,
    kv_pages: KVPages,
    kv_lens: jax.Array,
    page_table: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    logit_soft_cap: float | None = None,
    impl: str | None = None,
) -> jax.Array:
    """Attention of ragged queries over a paged KV cache; prefill, chunked prefill and decode.

    Args:
      q: f32|bf16[T, Hq, D] queries of all sequences packed back to back, then padding rows.
      kv_pages: [num_pages, page_size, 2*Hkv, Dp] one layer's cache in q's dtype, Dp >= D
        (`pallas_kernels.kv_cache_update.KVCacheSpec`); q is zero-padded to Dp here. Or a
        `QuantizedKVPages` (int8/fp8 values and f32 scales per token slot and combined head).
      kv_lens: i32[S] context length of each sequence, including its new tokens.
      page_table: i32[S, P] page ids of each sequence's context, in order.
      cu_q_lens: i32[S+1] sequence s owns query rows cu_q_lens[s]:cu_q_lens[s+1].
      num_seqs: i32[] number of real sequences; slots s >= num_seqs are ignored.
      sm_scale: multiplies q . k (usually D ** -0.5 of the unpadded D).
      sliding_window: a query at position i sees keys j with i - j < sliding_window.
      logit_soft_cap: scores become cap * tanh(scores / cap).
      impl: "reference", "cpu", "tpu" or "gpu"; None picks by the platform of q.

    Returns:
      [T, Hq, D] in q's dtype; rows >= cu_q_lens[num_seqs] are unspecified.

    Raises:
      ValueError: an unknown impl, shapes that break the contract, or a dtype/head_dim/page_size/
        head-count combination the chosen implementation does not support.
    """
    impl = resolve_impl(impl, platform_of(q))
    kv_pages, kv_scales = split_pages(kv_pages)
    if sliding_window is not None and sliding_window <= 0:
        raise ValueError(f"{sliding_window=} must be positive or None")
    if logit_soft_cap is not None and logit_soft_cap <= 0:
        raise ValueError(f"{logit_soft_cap=} must be positive or None")
    head_dim, cache_dim = q.shape[-1], kv_pages.shape[-1]
    if cache_dim < head_dim:
        raise ValueError(f"{kv_pages.shape=} must have a head dim >= {q.shape[-1]=}")
    q_padded = (
        jnp.pad(q, ((0, 0), (0, 0), (0, cache_dim - head_dim))) if cache_dim > head_dim else q
    )
    check_inputs(q_padded, kv_pages, kv_lens, page_table, cu_q_lens, num_seqs, kv_scales)
    attention, check_supported = load_impl(impl)
    check_supported(q.dtype, cache_dim, kv_pages.shape[1], q.shape[1], kv_pages.shape[2] // 2)
    out = attention(
        q_padded,
        kv_pages,
        kv_lens,
        page_table,
        cu_q_lens,
        num_seqs,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        logit_soft_cap=logit_soft_cap,
        kv_scales=kv_scales,
    )
    return out[..., :head_dim]


__all__ = ["IMPLS", "platform_of", "ragged_paged_attention", "ragged_paged_attention_reference"]
