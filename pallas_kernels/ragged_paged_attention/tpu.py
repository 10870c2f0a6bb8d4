"""Ragged paged attention on TPU: jax's maintained Mosaic kernel, planned and guarded.

What runs:
- float32 and bfloat16 caches: `jax.experimental.pallas.ops.tpu.ragged_paged_attention`, the
  kernel the JAX team maintains for TPU serving, with block sizes tuned per chip
  (its `tuned_block_sizes`). Its cache layout is xlaserve's, unchanged: one array
  [num_pages, page_size, 2*Hkv, D] per layer with K and V interleaved on the combined-head axis
  (`pallas_kernels.kv_cache_update`), so one DMA brings a page's K and V; nothing is converted.
  It reads K and V out of VMEM with a strided load through a 32-bit view (no bf16 sublane
  pair is split), takes the whole batch (any prefill/decode mix) in one call, and supports the
  sliding window and soft cap.
- int8/fp8 caches: xlaserve's own kernel (`tpu_quantized.py`). The maintained kernel takes one
  static float `k_scale`/`v_scale` per tensor; xlaserve's quantized cache has a float32 scale per
  token slot and combined head (set from each token's absmax when it is written, so nothing
  ever needs requantizing), which it cannot apply. A per-tensor-scaled cache mode would let the
  maintained kernel serve int8/fp8 too; it needs a calibrated scale and is not built.

What this wrapper adds around the maintained kernel:
- Start-up refusals instead of failures inside Mosaic (`tpu_plan`): head counts that cannot be
  tiled, a page table too large for SMEM, blocks that cannot fit VMEM.
- An explicit VMEM plan: block sizes (jax's tuned table on a TPU, defaults elsewhere), shrunk
  until the estimate fits, and `vmem_limit_bytes` passed to Mosaic.
- Sliding window: the maintained kernel walks every KV block from key 0 and masks, so it would
  DMA the pages the engine released behind the window (page-table entry -1: a fault) and let NaN
  in a recycled page reach the softmax. The wrapper shifts each sequence's page table and length
  by the whole pages before its first query's window (`_skip_pages_behind_window`): causal and
  window masks depend only on query-key distance, which the shift keeps, and those pages are
  then neither fetched nor computed.
- Lowering without a TPU (exporting for TPU from a CPU host): jax 0.10's Mosaic lowering of
  some ops the maintained kernel uses (integer floor division lowers through `sign`, whose rule
  asks for the chip generation) calls `pltpu.get_tpu_info()`, which raises for a CPU device.
  The wrapper then describes the export target, `EXPORT_CHIP` (TPU v4: the least VMEM, the
  capacities `tpu_plan` assumes without a chip), under the host's device kind in jax's
  TPU-info registry (`_describe_export_target`), once, at trace time.
- An empty batch (num_seqs == 0) skips the kernel: the maintained kernel starts its first DMA
  (from the page table's first row) before it knows there is no work.

head_dim 64 (SmolLM2, Llama-3.2-1B): the cache is padded to 128 lanes (`KVCacheSpec.for_platform`)
and q with zeros by the dispatcher. It costs twice the KV bytes per token in HBM, DMA and VMEM;
packing K and V of one head into one 128-lane row would need a different cache layout and an own
kernel again.

Known costs, all the maintained kernel's: its grid is ("arbitrary", "arbitrary"), so one
TensorCore of a megacore chip (v4, v5p) works; a decode sequence in a bq-token query block
computes bq * G score rows of which G are real; the page table is i32[S, P] in SMEM.
vllm-project/tpu-inference's RPA v3 addresses these (a flat page table, a decode-only variant,
K/V packing for small heads) and would be the next step.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import jax
import jax.numpy as jnp
from jax import lax
from jax._src.pallas.mosaic import tpu_info
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas.ops.tpu import ragged_paged_attention as maintained

from pallas_kernels.ragged_paged_attention import tpu_plan
from pallas_kernels.ragged_paged_attention.reference import check_inputs
from pallas_kernels.ragged_paged_attention.tpu_quantized import (
    quantized_ragged_paged_attention_tpu,
)

_DTYPES = ("float32", "bfloat16")
# The chip a TPU export from a host without one is lowered for (see the module docstring).
EXPORT_CHIP = pltpu.ChipVersion.TPU_V4


def check_supported(
    q_dtype: jnp.dtype, head_dim: int, page_size: int, num_q_heads: int, num_kv_heads: int
) -> None:
    """Raises ValueError naming the combination if the TPU path cannot run it.

    Args:
      q_dtype: dtype of q and of a float cache.
      head_dim: D as the kernel sees it, after padding to lanes.
      page_size: token slots per page.
      num_q_heads: Hq.
      num_kv_heads: Hkv (the cache holds 2 * Hkv combined heads).
    """
    dtype = jnp.dtype(q_dtype)
    if dtype.name not in _DTYPES:
        raise ValueError(f"tpu: {q_dtype=} must be one of {_DTYPES}")
    if head_dim % tpu_plan.LANES:
        raise ValueError(
            f"tpu: {head_dim=} must be a multiple of {tpu_plan.LANES} (pad the cache lanes)"
        )
    sublanes = tpu_plan.SUBLANES * tpu_plan.packing(dtype)
    if page_size % sublanes:
        raise ValueError(f"tpu: {page_size=} must be a multiple of {sublanes} for {dtype.name}")
    tpu_plan.head_blocks(num_q_heads, num_kv_heads, dtype, dtype)


def _check_inputs(
    q: jax.Array,  # [T, Hq, D]
    kv_pages: jax.Array,  # [num_pages, page_size, 2*Hkv, D]
    kv_lens: jax.Array,  # i32[S]
    page_table: jax.Array,  # i32[S, P]
    cu_q_lens: jax.Array,  # i32[S+1]
    num_seqs: jax.Array,  # i32[]
    sliding_window: int | None,
    logit_soft_cap: float | None,
) -> None:
    check_inputs(q, kv_pages, kv_lens, page_table, cu_q_lens, num_seqs)
    for name, x in (("kv_lens", kv_lens), ("page_table", page_table), ("cu_q_lens", cu_q_lens)):
        if x.dtype != jnp.int32:
            raise ValueError(f"{name}.dtype={x.dtype} must be int32")
    if sliding_window is not None and sliding_window <= 0:
        raise ValueError(f"{sliding_window=} must be positive or None")
    if logit_soft_cap is not None and logit_soft_cap <= 0:
        raise ValueError(f"{logit_soft_cap=} must be positive or None")
    check_supported(q.dtype, q.shape[2], kv_pages.shape[1], q.shape[1], kv_pages.shape[2] // 2)


def _chip_info() -> pltpu.TpuInfo | None:
    """The attached TPU's description; None without one (interpret mode, export)."""
    return pltpu.get_tpu_info() if jax.default_backend() == "tpu" else None


def _describe_export_target() -> None:
    """Lets Mosaic lowering on a host without a TPU (export) read `EXPORT_CHIP`'s description
    where it asks for the attached chip's; a TPU host's own description is never replaced."""
    kind = tpu_info.get_device_kind()
    if tpu_info.chip_version_from_device_kind(kind) is None:
        tpu_info.registry.setdefault(kind, lambda: pltpu.get_tpu_info_for_chip(EXPORT_CHIP, 1))


def _plan(
    q: jax.Array,
    kv_pages: jax.Array,
    page_table: jax.Array,
    num_queries_per_block: int | None,
    num_kv_pages_per_block: int | None,
) -> tpu_plan.KernelPlan:
    """Block sizes and VMEM limit for this call; raises if SMEM or VMEM cannot hold it."""
    num_tokens, num_q_heads, head_dim = q.shape
    _, page_size, combined, _ = kv_pages.shape
    num_seqs, pages_per_seq = page_table.shape
    shape = tpu_plan.KernelShape(
        num_tokens,
        num_q_heads,
        combined // 2,
        head_dim,
        page_size,
        pages_per_seq,
        q.dtype.name,
        kv_pages.dtype.name,
    )
    info = _chip_info()
    tpu_plan.check_smem(
        num_seqs,
        pages_per_seq,
        info.smem_capacity_bytes if info else tpu_plan.DEFAULT_SMEM_CAPACITY,
    )
    heads = tpu_plan.head_blocks(num_q_heads, combined // 2, q.dtype, kv_pages.dtype)
    if info is None:
        queries, pages = tpu_plan.default_block_sizes(shape)
    else:
        pages, queries = maintained.get_tuned_block_sizes(
            q.dtype,
            kv_pages.dtype,
            heads.q_heads,
            heads.combined_kv_heads // 2,
            head_dim,
            page_size,
            num_tokens,
            pages_per_seq,
        )
    return tpu_plan.plan(
        shape,
        start=(num_queries_per_block or queries, num_kv_pages_per_block or pages),
        vmem_capacity=info.vmem_capacity_bytes if info else tpu_plan.DEFAULT_VMEM_CAPACITY,
        fixed_queries=num_queries_per_block is not None,
        fixed_kv_pages=num_kv_pages_per_block is not None,
    )


def _skip_pages_behind_window(
    kv_lens: jax.Array,  # i32[S]
    page_table: jax.Array,  # i32[S, P]
    cu_q_lens: jax.Array,  # i32[S+1]
    sliding_window: int,
    page_size: int,
) -> tuple[jax.Array, jax.Array]:
    """(kv_lens, page_table) with each sequence's leading pages that no query of it can see cut
    off: the whole pages before its first query's window start (the pages the engine releases)."""
    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]  # i32[S]
    first_key = jnp.maximum(kv_lens - q_lens - sliding_window + 1, 0)  # i32[S]
    skip = first_key // page_size  # i32[S]
    width = page_table.shape[1]
    columns = jnp.minimum(skip[:, None] + jnp.arange(width, dtype=jnp.int32), width - 1)
    return kv_lens - skip * page_size, jnp.take_along_axis(page_table, columns, axis=1)


def maintained_inputs(
    kv_lens: jax.Array,  # i32[S]
    page_table: jax.Array,  # i32[S, P]
    cu_q_lens: jax.Array,  # i32[S+1]
    num_seqs: jax.Array,  # i32[]
    sliding_window: int | None,
    page_size: int,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(kv_lens, page_table, num_seqs i32[1]) as the maintained kernel is called with them: pages
    behind each sequence's window cut off (`_skip_pages_behind_window`), num_seqs at most S."""
    if sliding_window is not None:
        kv_lens, page_table = _skip_pages_behind_window(
            kv_lens, page_table, cu_q_lens, sliding_window, page_size
        )
    num_seqs = jnp.minimum(num_seqs, kv_lens.shape[0]).astype(jnp.int32)
    return kv_lens, page_table, num_seqs.reshape(1)


@contextlib.contextmanager
def _interpret_mode(interpret: bool | pltpu.InterpretParams) -> Iterator[None]:
    """TPU interpret mode (CPU) for the pallas_calls traced inside, if asked for."""
    if interpret is False:
        yield
        return
    params = pltpu.InterpretParams() if interpret is True else interpret
    with pltpu.force_tpu_interpret_mode(params):
        yield


@functools.partial(
    jax.jit,
    static_argnames=(
        "sm_scale",
        "sliding_window",
        "logit_soft_cap",
        "interpret",
        "num_queries_per_block",
        "num_kv_pages_per_block",
        "vmem_limit_bytes",
    ),
)
def ragged_paged_attention_tpu(
    q: jax.Array,  # f32|bf16[T, Hq, D]
    kv_pages: jax.Array,  # [num_pages, page_size, 2*Hkv, D]
    kv_lens: jax.Array,  # i32[S]
    page_table: jax.Array,  # i32[S, P]
    cu_q_lens: jax.Array,  # i32[S+1]
    num_seqs: jax.Array,  # i32[]
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    logit_soft_cap: float | None = None,
    interpret: bool | pltpu.InterpretParams = False,
    num_queries_per_block: int | None = None,
    num_kv_pages_per_block: int | None = None,
    vmem_limit_bytes: int | None = None,
    kv_scales: jax.Array | None = None,
) -> jax.Array:
    """Attention of ragged queries over a paged KV cache on TPU; prefill, chunked prefill, decode.

    Args:
      q: f32|bf16[T, Hq, D] queries of all sequences back to back, then padding rows; D a
        multiple of 128 (the dispatcher zero-pads q to the cache's padded head dim).
      kv_pages: [num_pages, page_size, 2*Hkv, D] one layer's cache in q's dtype; combined head
        2h is K and 2h + 1 is V of kv head h (`pallas_kernels.kv_cache_update`). With kv_scales:
        int8 or float8_e4m3fn values.
      kv_lens: i32[S] context length of each sequence, its new tokens included.
      page_table: i32[S, P] page ids of each sequence's context, in order.
      cu_q_lens: i32[S+1] sequence s owns query rows cu_q_lens[s]:cu_q_lens[s+1], the last
        q_len tokens of its context.
      num_seqs: i32[] number of real sequences; slots s >= num_seqs are ignored.
      sm_scale: multiplies q . k.
      sliding_window: a query at position i sees keys j with i - j < sliding_window.
      logit_soft_cap: scores become cap * tanh(scores / cap).
      interpret: run in Pallas TPU interpret mode (CPU); True or a `pltpu.InterpretParams`.
      num_queries_per_block: query tokens per block; None: jax's tuned table on a TPU, else
        `tpu_plan.DEFAULT_QUERIES_PER_BLOCK`, shrunk to fit VMEM.
      num_kv_pages_per_block: pages per KV block; None as above.
      vmem_limit_bytes: Mosaic's scoped VMEM limit; None: the plan's (3/4 of the chip's VMEM).
      kv_scales: f32[num_pages, page_size, 2*Hkv] of an int8/fp8 cache (K/V = values *
        scales[..., None]); served by `tpu_quantized` (see the module docstring).

    Returns:
      [T, Hq, D] in q's dtype; rows >= cu_q_lens[num_seqs] are unspecified.

    Raises:
      ValueError: shapes or dtypes that break the contract, or a configuration the chip cannot
        hold (head tiling, SMEM, VMEM; see `tpu_plan`).
    """
    if kv_scales is not None:
        return quantized_ragged_paged_attention_tpu(
            q,
            kv_pages,
            kv_lens,
            page_table,
            cu_q_lens,
            num_seqs,
            sm_scale=sm_scale,
            sliding_window=sliding_window,
            logit_soft_cap=logit_soft_cap,
            interpret=interpret,
            num_queries_per_block=num_queries_per_block,
            num_kv_pages_per_block=num_kv_pages_per_block,
            vmem_limit_bytes=vmem_limit_bytes,
            kv_scales=kv_scales,
        )
    _check_inputs(
        q, kv_pages, kv_lens, page_table, cu_q_lens, num_seqs, sliding_window, logit_soft_cap
    )
    plan = _plan(q, kv_pages, page_table, num_queries_per_block, num_kv_pages_per_block)
    if _chip_info() is None:
        _describe_export_target()
    kv_lens, page_table, num_seqs = maintained_inputs(
        kv_lens, page_table, cu_q_lens, num_seqs, sliding_window, kv_pages.shape[1]
    )

    def attend() -> jax.Array:
        with _interpret_mode(interpret):
            return maintained.ragged_paged_attention(
                q,
                kv_pages,
                kv_lens,
                page_table,
                cu_q_lens,
                num_seqs,
                sm_scale=sm_scale,
                sliding_window=sliding_window,
                soft_cap=logit_soft_cap,
                num_kv_pages_per_block=plan.num_kv_pages_per_block,
                num_queries_per_block=plan.num_queries_per_block,
                vmem_limit_bytes=vmem_limit_bytes or plan.vmem_limit_bytes,
            )

    return lax.cond(num_seqs[0] > 0, attend, lambda: jnp.zeros_like(q))
