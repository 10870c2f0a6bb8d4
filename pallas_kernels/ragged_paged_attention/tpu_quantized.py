"""Ragged paged attention over an int8/fp8 cache with per-slot scales: xlaserve's own Pallas TPU
(Mosaic) kernel, kept for what jax's maintained kernel cannot do.

Why it exists: `tpu.py` sends float caches to jax's maintained kernel, which dequantizes with one
static `k_scale`/`v_scale` per tensor. xlaserve's quantized cache (`QuantizedKVPages`) holds a
float32 scale per token slot and combined head, so the scales must be fetched with the pages and
applied per key; this kernel does that. It also takes float caches, but is
not dispatched for them.

Not yet proven on a chip: it reads K and V by indexing the combined-head axis of its VMEM buffer
(`kv_buf[slot, :, 2*h, :]`), the second-minor axis; for one-byte values four combined heads share
a 32-bit sublane word, a pattern Mosaic may refuse where the maintained kernel's strided load
through a uint32 view is legal. Interpret mode checks the arithmetic only. If it fails to lower on
a TPU, the fix is that load pattern (or a per-tensor-scaled cache served by the maintained kernel).

One compiled kernel serves any mix of prefill, chunked prefill and decode: only T (query rows),
S (sequence slots) and P (pages per sequence) are static; lengths, the mix and the page table are
runtime arrays read from SMEM.

Work items and grid. The T query rows are cut into query blocks of `bq` tokens. A work item is
one (sequence, query block) pair whose rows intersect; a batch has at most T / bq + S of them. The
jitted wrapper lists them on device with a few jnp ops (`_work_items`, sorted by block, then
sequence), and the grid is one sequential axis over that static-length list; steps past the real
items do nothing. Consecutive items of one query block map to the same q/output block, so the
block stays in VMEM and each item writes only its own sequence's rows into it.

Scalar prefetch (SMEM): kv_lens i32[S], page_table i32[S, P], cu_q_lens i32[S+1], and the work
list (item_seq, item_block, num_items). num_seqs is consumed by the wrapper when it builds the
list.

Query layout. The wrapper regroups q[T, Hq, D] into [Hkv, T*G, D] (G = Hq / Hkv query heads per
kv head, row t*G + g), so for each kv head the G query heads that share it form one 2-D matrix and
GQA costs no extra KV traffic; the output is regrouped back.

KV pages stay in HBM (`pl.ANY`). An item needs keys [kv_lo, kv_hi]: up to its last query's
position (causal) and, with a sliding window, from its first query's window start; KV blocks
wholly outside that range are never fetched or computed. The range is walked in KV blocks of
`pb` pages aligned to absolute positions. A block is fetched page by page, one DMA per page
(K and V of all kv heads are interleaved in a page, so one copy brings both), only for pages that
overlap [kv_lo, kv_hi] (never past the sequence's last page), into one of two VMEM slots. While
block k is computed, block k + 1 -- or, after an item's last block, the first block of the next
item -- is in flight into the other slot; the slot in use is carried across grid steps in SMEM.

Compute. Per kv head (a static loop), K and V of the block are read out of the slot by indexing
the combined-head axis (entries 2h and 2h + 1 of every token), [pb*page_size, D] each. q @ k^T
and p @ v run in the input dtype with float32 accumulation; online softmax in float32 with the
running max, sum and numerator in VMEM scratch. Everything outside the causal/window mask, the
fetched pages or the item's rows is removed with `where` (never a multiply by 0), so NaN in unused
pages, stale slots or padding rows never reaches a real output.

Block sizes. bq (query tokens per block) and pb (pages per KV block) come from
`tuned_block_sizes`, keyed on the chip generation (`pltpu.get_tpu_info()`; CPU, export and
unlisted chips get its default), shrunk if needed so the query side and the KV double buffer each
fit a VMEM budget, and capped by T and P. Callers may pass both explicitly.

Quantized cache (int8 / float8_e4m3fn values with f32 scales per token slot and combined head):
each page's scales [page_size, 2*Hkv] follow its values by a second DMA into a scale double
buffer; K and V are widened to f32 and scaled per key right after they are read out of the
slot, and both matmuls then run in f32. Such a cache needs page_size a multiple of 32 (four
one-byte values per 32-bit sublane word).

Known costs: a decode sequence still runs a whole bq*G-row block (its other rows are masked
out), and the sequential grid uses one TensorCore of a megacore chip.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.ragged_paged_attention.reference import check_inputs
from pallas_kernels.ragged_paged_attention.tuned_block_sizes import BlockSizes, get_block_sizes

_MASK_VALUE = float(jnp.finfo(jnp.float32).min) / 2  # finite: exp(mask - mask) stays defined
_LANES = 128
_SUBLANES = 8
_DTYPES = ("float32", "bfloat16")
# VMEM for the query side (q/out blocks, accumulators) and for the KV double buffer; together
# with the score temporaries they stay well inside the smallest default scoped VMEM (16 MiB).
_QUERY_VMEM_BUDGET = 4 << 20
_KV_VMEM_BUDGET = 4 << 20


# ---------------------------------------------------------------------------------------------
# Input checks (static: shapes, dtypes and configuration, at trace time).
# ---------------------------------------------------------------------------------------------


def _packing(dtype: jnp.dtype) -> int:
    """Values per 32-bit word: 1 for float32, 2 for bfloat16."""
    return 4 // jnp.dtype(dtype).itemsize


def check_supported(
    q_dtype: jnp.dtype, head_dim: int, page_size: int, num_q_heads: int, num_kv_heads: int
) -> None:
    """Raises ValueError naming the combination if this kernel cannot run it.

    Args:
      q_dtype: dtype of q and of the KV cache.
      head_dim: D as the kernel sees it, after padding to lanes.
      page_size: token slots per page.
      num_q_heads: Hq.
      num_kv_heads: Hkv (the cache holds 2 * Hkv combined heads).
    """
    dtype = jnp.dtype(q_dtype)
    if dtype.name not in _DTYPES:
        raise ValueError(f"tpu: {q_dtype=} must be one of {_DTYPES}")
    if head_dim % _LANES:
        raise ValueError(f"tpu: {head_dim=} must be a multiple of {_LANES} (pad the cache lanes)")
    sublanes = _SUBLANES * _packing(dtype)
    if page_size % sublanes:
        raise ValueError(f"tpu: {page_size=} must be a multiple of {sublanes} for {dtype.name}")
    if num_kv_heads <= 0 or num_q_heads % num_kv_heads:
        raise ValueError(f"tpu: {num_q_heads=} must be a positive multiple of {num_kv_heads=}")


def _check_inputs(
    q: jax.Array,
    kv_pages: jax.Array,
    kv_lens: jax.Array,
    page_table: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    sliding_window: int | None,
    logit_soft_cap: float | None,
    kv_scales: jax.Array | None = None,
) -> None:
    check_inputs(q, kv_pages, kv_lens, page_table, cu_q_lens, num_seqs, kv_scales)
    if kv_scales is not None and kv_pages.shape[1] % (_SUBLANES * 4):
        raise ValueError(
            f"tpu: a quantized cache needs page_size a multiple of 32, {kv_pages.shape=}"
        )
    # Scalar prefetch puts these in SMEM as 32-bit words.
    for name, x in (("kv_lens", kv_lens), ("page_table", page_table), ("cu_q_lens", cu_q_lens)):
        if x.dtype != jnp.int32:
            raise ValueError(f"{name}.dtype={x.dtype} must be int32")
    if sliding_window is not None and sliding_window <= 0:
        raise ValueError(f"{sliding_window=} must be positive or None")
    if logit_soft_cap is not None and logit_soft_cap <= 0:
        raise ValueError(f"{logit_soft_cap=} must be positive or None")
    check_supported(q.dtype, q.shape[2], kv_pages.shape[1], q.shape[1], kv_pages.shape[2] // 2)


def _tpu_generation() -> str | None:
    """The chip generation ("v5e", "v6e", ...) of the default device, None if it is not a TPU."""
    if jax.default_backend() != "tpu":
        return None
    return str(pltpu.get_tpu_info().chip_version)


def _block_sizes(
    q: jax.Array,  # [T, Hq, D]
    kv_pages: jax.Array,  # [num_pages, page_size, 2*Hkv, D]
    pages_per_seq: int,
    num_queries_per_block: int | None,
    num_kv_pages_per_block: int | None,
) -> BlockSizes:
    """The caller's block sizes, else the tuned ones shrunk to the VMEM budgets; then fitted to
    this call (no wider than the batch, as decode buckets are small, nor than a sequence)."""
    num_tokens, num_q_heads, head_dim = q.shape
    _, page_size, num_combined_heads, _ = kv_pages.shape
    itemsize, sublanes = q.dtype.itemsize, _SUBLANES * _packing(q.dtype)
    tuned = get_block_sizes(_tpu_generation(), q.dtype.name, head_dim, page_size)
    # Per query token: q and output blocks (double-buffered), the f32 numerator, m and l.
    token_bytes = num_q_heads * (head_dim * (4 * itemsize + 4) + 2 * _LANES * 4)
    page_bytes = 2 * page_size * num_combined_heads * head_dim * itemsize  # both KV slots
    bq, pb = num_queries_per_block, num_kv_pages_per_block
    if bq is None:
        fit = _QUERY_VMEM_BUDGET // token_bytes // sublanes * sublanes
        bq = max(sublanes, min(tuned.num_queries_per_block, fit))
    if pb is None:
        pb = max(1, min(tuned.num_kv_pages_per_block, _KV_VMEM_BUDGET // page_bytes))
    if bq <= 0 or bq % sublanes:
        raise ValueError(f"{num_queries_per_block=} must be a positive multiple of {sublanes}")
    if pb <= 0:
        raise ValueError(f"{num_kv_pages_per_block=} must be positive")
    bq = min(bq, pl.cdiv(num_tokens, sublanes) * sublanes)
    return BlockSizes(bq, min(pb, pages_per_seq))


# ---------------------------------------------------------------------------------------------
# Kernel.
# ---------------------------------------------------------------------------------------------


class _Item(NamedTuple):
    """Scalars of one work item, read from SMEM; query token t sits at position t + pos_offset."""

    seq: jax.Array  # i32[] sequence slot
    block: jax.Array  # i32[] query block
    q_start: jax.Array  # i32[] first query row of the sequence
    q_end: jax.Array  # i32[] one past its last query row
    pos_offset: jax.Array  # i32[] kv_len - q_end
    kv_lo: jax.Array  # i32[] first key any of the item's queries sees
    kv_hi: jax.Array  # i32[] last key any of the item's queries sees
    first_kv_block: jax.Array  # i32[] KV block holding kv_lo
    last_kv_block: jax.Array  # i32[] KV block holding kv_hi


def _ragged_paged_attention_kernel(
    # Scalar prefetch (SMEM).
    kv_lens_ref: jax.Array,  # i32[S]
    page_table_ref: jax.Array,  # i32[S, P]
    cu_q_lens_ref: jax.Array,  # i32[S+1]
    item_seq_ref: jax.Array,  # i32[I]
    item_block_ref: jax.Array,  # i32[I]
    num_items_ref: jax.Array,  # i32[1]
    # Inputs.
    q_ref: jax.Array,  # [Hkv, bq*G, D] VMEM block of the regrouped queries
    kv_hbm_ref: jax.Array,  # [num_pages, page_size, 2*Hkv, D] in HBM
    # Quantized cache only: scales_hbm_ref f32[num_pages, page_size, 2*Hkv] (input), and after
    # the scratch below, scale_buf f32[2, pb*page_size, 2*Hkv] and scale_sems DMA[2].
    *refs: jax.Array,
    # Output: o_ref [Hkv, bq*G, D].
    # Scratch: kv_buf [2, pb*page_size, 2*Hkv, D] VMEM double buffer; sems, DMA semaphores [2],
    # one per slot; slot_ref SMEM i32[1], the slot holding the next block to compute; row
    # statistics m_ref and l_ref f32[Hkv, bq*G, 128] (running max and sum, replicated over
    # lanes: a [rows, 1] scratch is lane-padded anyway); acc_ref f32[Hkv, bq*G, D] numerator.
    sm_scale: float,
    sliding_window: int | None,
    logit_soft_cap: float | None,
    queries_per_block: int,
    heads_per_kv: int,
    quantized: bool,
) -> None:
    scales_hbm_ref: Any = None
    scale_buf: Any = None
    scale_sems: Any = None
    if quantized:
        scales_hbm_ref, *refs_list = refs
        o_ref, kv_buf, sems, slot_ref, m_ref, l_ref, acc_ref, scale_buf, scale_sems = refs_list
    else:
        o_ref, kv_buf, sems, slot_ref, m_ref, l_ref, acc_ref = refs
    num_kv_heads, rows, _ = q_ref.shape
    page_size = kv_hbm_ref.shape[1]
    kv_block_len = kv_buf.shape[1]
    pages_per_block = kv_block_len // page_size
    bq, group = queries_per_block, heads_per_kv
    i = pl.program_id(0)
    num_items = num_items_ref[0]

    def read_item(index: jax.Array) -> _Item:
        seq, block = item_seq_ref[index], item_block_ref[index]
        q_start, q_end = cu_q_lens_ref[seq], cu_q_lens_ref[seq + 1]
        pos_offset = kv_lens_ref[seq] - q_end
        first_pos = jnp.maximum(q_start, block * bq) + pos_offset
        kv_hi = jnp.minimum(q_end, (block + 1) * bq) - 1 + pos_offset
        kv_lo = jnp.int32(0)
        if sliding_window is not None:
            kv_lo = jnp.maximum(first_pos - sliding_window + 1, 0)
        # lax.div: truncating division of non-negative ints (jnp's floor division needs sign()).
        first_kv_block, last_kv_block = lax.div(kv_lo, kv_block_len), lax.div(kv_hi, kv_block_len)
        return _Item(
            seq, block, q_start, q_end, pos_offset, kv_lo, kv_hi, first_kv_block, last_kv_block
        )

    def query_tokens(item: _Item) -> jax.Array:
        """i32[bq*G, 1] query token of each row of the item's block (row t*G + g)."""
        row = lax.broadcasted_iota(jnp.int32, (rows, 1), 0)
        return item.block * bq + lax.div(row, jnp.int32(group))

    def copy_page(seq: jax.Array, page: jax.Array, p: int, slot: jax.Array, op: str) -> None:
        """Starts or waits the DMA of page `page` of sequence seq into page p of the slot."""
        copy = pltpu.make_async_copy(
            kv_hbm_ref.at[page_table_ref[seq, page]],  # [page_size, 2*Hkv, D]
            kv_buf.at[slot, pl.ds(p * page_size, page_size)],
            sems.at[slot],
        )
        copies = [copy]
        if quantized:
            copies.append(
                pltpu.make_async_copy(
                    scales_hbm_ref.at[page_table_ref[seq, page]],  # f32[page_size, 2*Hkv]
                    scale_buf.at[slot, pl.ds(p * page_size, page_size)],
                    scale_sems.at[slot],
                )
            )
        for c in copies:
            if op == "start":
                c.start()
            else:
                c.wait()

    def for_each_page_copy(item: _Item, kv_block: jax.Array, slot: jax.Array, op: str) -> None:
        """Starts or waits the copies of the pages of kv_block that overlap [kv_lo, kv_hi]."""
        for p in range(pages_per_block):
            page = kv_block * pages_per_block + p
            overlaps = (page * page_size <= item.kv_hi) & ((page + 1) * page_size > item.kv_lo)
            pl.when(overlaps)(functools.partial(copy_page, item.seq, page, p, slot, op))

    def compute_block(item: _Item, kv_block: jax.Array, slot: jax.Array) -> None:
        """One online-softmax step of every kv head over KV block kv_block, held in slot."""
        pos = query_tokens(item) + item.pos_offset  # i32[bq*G, 1]
        key = kv_block * kv_block_len + lax.broadcasted_iota(jnp.int32, (1, kv_block_len), 1)
        mask = key <= pos  # bool[bq*G, pb*page_size]
        if sliding_window is not None:
            mask &= pos - key < sliding_window
        key_col = kv_block * kv_block_len + lax.broadcasted_iota(jnp.int32, (kv_block_len, 1), 0)
        fetched = (key_col >= item.kv_lo) & (key_col <= item.kv_hi)  # bool[pb*page_size, 1]
        for h in range(num_kv_heads):
            # Plain indexing, not a reshaped or bitcast view of the slot: the TPU interpreter
            # (our CPU check) only models indexed refs.
            k = kv_buf[slot, :, 2 * h, :]  # [pb*page_size, D]
            v = kv_buf[slot, :, 2 * h + 1, :]
            q = q_ref[h]
            if quantized:  # widen, and scale each key's K and V (f32[pb*page_size, 1])
                k = k.astype(jnp.float32) * scale_buf[slot, :, pl.ds(2 * h, 1)]
                v = v.astype(jnp.float32) * scale_buf[slot, :, pl.ds(2 * h + 1, 1)]
                q = q.astype(jnp.float32)
            v = jnp.where(fetched, v, 0)  # stale slots may be NaN
            s = jnp.einsum("rd,nd->rn", q, k, preferred_element_type=jnp.float32)
            s = s * sm_scale  # f32[bq*G, pb*page_size]
            if logit_soft_cap is not None:
                s = logit_soft_cap * jnp.tanh(s / logit_soft_cap)
            s = jnp.where(mask, s, _MASK_VALUE)
            m_prev = m_ref[h][:, :1]  # f32[bq*G, 1]
            m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
            p = jnp.where(mask, jnp.exp(s - m_next), 0.0)
            alpha = jnp.exp(m_prev - m_next)
            l_next = alpha * l_ref[h][:, :1] + jnp.sum(p, axis=1, keepdims=True)
            pv = jnp.einsum("rn,nd->rd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
            acc_ref[h] = alpha * acc_ref[h] + pv
            m_ref[h] = jnp.broadcast_to(m_next, (rows, _LANES))
            l_ref[h] = jnp.broadcast_to(l_next, (rows, _LANES))

    @pl.when(i == 0)
    def _prologue() -> None:
        slot_ref[0] = 0

        @pl.when(num_items > 0)
        def _() -> None:
            first = read_item(jnp.int32(0))
            for_each_page_copy(first, first.first_kv_block, jnp.int32(0), "start")

    @pl.when(i < num_items)
    def _item() -> None:
        item = read_item(i)
        m_ref[...] = jnp.full(m_ref.shape, _MASK_VALUE, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

        def kv_step(kv_block: jax.Array, slot: jax.Array) -> jax.Array:
            next_slot = 1 - slot

            @pl.when(kv_block < item.last_kv_block)
            def _() -> None:
                for_each_page_copy(item, kv_block + 1, next_slot, "start")

            @pl.when((kv_block == item.last_kv_block) & (i + 1 < num_items))
            def _() -> None:
                following = read_item(i + 1)
                for_each_page_copy(following, following.first_kv_block, next_slot, "start")

            for_each_page_copy(item, kv_block, slot, "wait")
            compute_block(item, kv_block, slot)
            return next_slot

        slot_ref[0] = lax.fori_loop(
            item.first_kv_block, item.last_kv_block + 1, kv_step, slot_ref[0]
        )
        token = query_tokens(item)
        own_rows = (token >= item.q_start) & (token < item.q_end)  # bool[bq*G, 1]
        for h in range(num_kv_heads):
            out = acc_ref[h] / l_ref[h][:, :1]
            o_ref[h] = jnp.where(own_rows, out.astype(o_ref.dtype), o_ref[h])


# ---------------------------------------------------------------------------------------------
# Public wrapper.
# ---------------------------------------------------------------------------------------------


def _work_items(
    cu_q_lens: jax.Array,  # i32[S+1]
    num_seqs: jax.Array,  # i32[]
    queries_per_block: int,
    num_q_blocks: int,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The (sequence, query block) pairs whose rows intersect, block-major, padded to num_items.

    Returns item_seq i32[I], item_block i32[I] and the real count i32[1]; padding items repeat the
    last real one so the output block index does not move (and is not written back) for them.
    """
    num_slots = cu_q_lens.shape[0] - 1
    num_items = num_q_blocks + num_slots
    starts, ends = cu_q_lens[:-1], cu_q_lens[1:]  # i32[S]
    active = (jnp.arange(num_slots) < num_seqs) & (ends > starts)
    first_block = starts // queries_per_block
    count = jnp.where(active, (ends - 1) // queries_per_block - first_block + 1, 0)
    items_end = jnp.cumsum(count)  # i32[S]
    total = items_end[-1]
    index = jnp.minimum(jnp.arange(num_items), jnp.maximum(total - 1, 0))  # i32[I]
    seq = jnp.minimum(jnp.searchsorted(items_end, index, side="right"), num_slots - 1)
    block = first_block[seq] + index - (items_end[seq] - count[seq])
    block = jnp.clip(block, 0, num_q_blocks - 1)  # in range even with no real items
    return seq.astype(jnp.int32), block.astype(jnp.int32), total.reshape(1).astype(jnp.int32)


def _group_heads(q: jax.Array, num_kv_heads: int) -> jax.Array:
    """[T, Hq, D] -> [Hkv, T*G, D]: row t*G + g of slab h is token t, query head h*G + g."""
    num_tokens, num_q_heads, head_dim = q.shape
    group = num_q_heads // num_kv_heads
    q = q.reshape(num_tokens, num_kv_heads, group, head_dim).transpose(1, 0, 2, 3)
    return q.reshape(num_kv_heads, num_tokens * group, head_dim)


def _ungroup_heads(out: jax.Array, num_q_heads: int) -> jax.Array:
    """[Hkv, T*G, D] -> [T, Hq, D], the inverse of `_group_heads`."""
    num_kv_heads, rows, head_dim = out.shape
    group = num_q_heads // num_kv_heads
    out = out.reshape(num_kv_heads, rows // group, group, head_dim).transpose(1, 0, 2, 3)
    return out.reshape(rows // group, num_q_heads, head_dim)


def _attention_call(
    q_grouped: jax.Array,  # [Hkv, T*G, D]
    kv_pages: jax.Array,  # [num_pages, page_size, 2*Hkv, D]
    num_items: int,
    block_sizes: BlockSizes,
    group: int,
    kernel_kwargs: dict[str, Any],
    interpret: bool | pltpu.InterpretParams,
    vmem_limit_bytes: int | None,
    quantized: bool,
) -> Callable[..., jax.Array]:
    """The pallas_call: grid over work items, q/out blocks chosen by each item's query block."""
    num_kv_heads, _, head_dim = q_grouped.shape
    _, page_size, num_combined_heads, _ = kv_pages.shape
    bq, pb = block_sizes

    def q_index_map(i: jax.Array, *prefetch: jax.Array) -> tuple[jax.Array | int, ...]:
        item_block_ref = prefetch[4]
        return (0, item_block_ref[i], 0)

    q_spec = pl.BlockSpec((num_kv_heads, bq * group, head_dim), q_index_map)
    row_stats = pltpu.VMEM((num_kv_heads, bq * group, _LANES), jnp.float32)
    in_specs = [q_spec, pl.BlockSpec(memory_space=pl.ANY)]
    scratch_shapes = [
        pltpu.VMEM((2, pb * page_size, num_combined_heads, head_dim), kv_pages.dtype),
        pltpu.SemaphoreType.DMA((2,)),
        pltpu.SMEM((1,), jnp.int32),
        row_stats,  # m
        row_stats,  # l
        pltpu.VMEM((num_kv_heads, bq * group, head_dim), jnp.float32),
    ]
    if quantized:
        in_specs.append(pl.BlockSpec(memory_space=pl.ANY))
        scratch_shapes.append(pltpu.VMEM((2, pb * page_size, num_combined_heads), jnp.float32))
        scratch_shapes.append(pltpu.SemaphoreType.DMA((2,)))
    return pl.pallas_call(
        functools.partial(
            _ragged_paged_attention_kernel,
            queries_per_block=bq,
            heads_per_kv=group,
            quantized=quantized,
            **kernel_kwargs,
        ),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=6,
            grid=(num_items,),
            in_specs=in_specs,
            out_specs=q_spec,
            scratch_shapes=scratch_shapes,
        ),
        out_shape=jax.ShapeDtypeStruct(q_grouped.shape, q_grouped.dtype),
        compiler_params=pltpu.CompilerParams(
            # Sequential: the KV double buffer and the slot index carry over grid steps.
            dimension_semantics=("arbitrary",),
            vmem_limit_bytes=vmem_limit_bytes,
        ),
        interpret=interpret,
        name="ragged_paged_attention",
    )


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
def quantized_ragged_paged_attention_tpu(
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
    """Attention of ragged queries over a paged (usually quantized) KV cache on TPU, any batch mix.

    Args:
      q: f32|bf16[T, Hq, D] queries of all sequences back to back, then padding rows; D a
        multiple of 128 (the dispatcher zero-pads q to the cache's padded head dim).
      kv_pages: [num_pages, page_size, 2*Hkv, D] one layer's cache in q's dtype; combined head
        2h is K and 2h + 1 is V of kv head h (`pallas_kernels.kv_cache_update`).
      kv_lens: i32[S] context length of each sequence, its new tokens included.
      page_table: i32[S, P] page ids of each sequence's context, in order.
      cu_q_lens: i32[S+1] sequence s owns query rows cu_q_lens[s]:cu_q_lens[s+1], the last
        q_len tokens of its context.
      num_seqs: i32[] number of real sequences; slots s >= num_seqs are ignored.
      sm_scale: multiplies q . k.
      sliding_window: a query at position i sees keys j with i - j < sliding_window.
      logit_soft_cap: scores become cap * tanh(scores / cap).
      interpret: run in Pallas TPU interpret mode (CPU); True or a `pltpu.InterpretParams`.
      num_queries_per_block: query tokens per query block; default from `tuned_block_sizes`.
      num_kv_pages_per_block: pages per KV block; default from `tuned_block_sizes`.
      vmem_limit_bytes: Mosaic's scoped VMEM limit; None keeps the compiler's default.
      kv_scales: f32[num_pages, page_size, 2*Hkv] when kv_pages holds int8 or float8_e4m3fn
        values (K/V = values * scales[..., None]); page_size must then be a multiple of 32.

    Returns:
      [T, Hq, D] in q's dtype; rows >= cu_q_lens[num_seqs] are unspecified.

    Raises:
      ValueError: shapes or dtypes that break the contract, or a configuration this kernel does
        not support (see `check_supported`).
    """
    _check_inputs(
        q,
        kv_pages,
        kv_lens,
        page_table,
        cu_q_lens,
        num_seqs,
        sliding_window,
        logit_soft_cap,
        kv_scales,
    )
    num_tokens, num_q_heads, _ = q.shape
    num_kv_heads = kv_pages.shape[2] // 2
    num_slots, pages_per_seq = page_table.shape
    block_sizes = _block_sizes(
        q, kv_pages, pages_per_seq, num_queries_per_block, num_kv_pages_per_block
    )
    num_q_blocks = pl.cdiv(num_tokens, block_sizes.num_queries_per_block)
    padded_tokens = num_q_blocks * block_sizes.num_queries_per_block
    with jax.named_scope("work_items"):
        items = _work_items(
            cu_q_lens, num_seqs, block_sizes.num_queries_per_block, num_q_blocks
        )  # item_seq i32[I], item_block i32[I], num_items i32[1]
    with jax.named_scope("group_heads"):
        q_grouped = _group_heads(
            jnp.pad(q, ((0, padded_tokens - num_tokens), (0, 0), (0, 0))), num_kv_heads
        )  # [Hkv, T*G, D]
    attention = _attention_call(
        q_grouped,
        kv_pages,
        num_items=num_q_blocks + num_slots,
        block_sizes=block_sizes,
        group=num_q_heads // num_kv_heads,
        kernel_kwargs=dict(
            sm_scale=sm_scale, sliding_window=sliding_window, logit_soft_cap=logit_soft_cap
        ),
        interpret=interpret,
        vmem_limit_bytes=vmem_limit_bytes,
        quantized=kv_scales is not None,
    )
    scales = () if kv_scales is None else (kv_scales,)
    out = attention(kv_lens, page_table, cu_q_lens, *items, q_grouped, kv_pages, *scales)
    return _ungroup_heads(out, num_q_heads)[:num_tokens]
