"""Ragged paged attention in pure jnp: the oracle the kernels are tested against, and the CPU path.

The contract is in `pallas_kernels/ragged_paged_attention/__init__.py`; the cache layout in
`pallas_kernels/kv_cache_update/layout.py`. Here q.shape[-1] == kv_pages.shape[-1].

Work is linear in the sum over sequences of (query tokens x that sequence's context):

- Decode rows (sequences with one query token) are done together, vectorised over the S sequence
  slots: a loop over KV blocks of `decode_kv_block` tokens gathers each sequence's pages of that
  block through the page table, up to the longest decode context in the batch.
- Every other sequence (prefill, chunked prefill) goes through one loop over the (sequence, query
  block of `q_block` rows) pairs of multi-token sequences only, then over the KV blocks of
  `kv_block` tokens that the query block can see (causal end, sliding-window start).

Both gather whole pages (not tokens) through the page table into a heads-major layout, so that the
einsums are batched matmuls with the batch dims leading; both use an online softmax in float32
(whatever the input dtype) and mask with `where`, never by multiplication, so NaN in unused pages,
unused tail slots, padding slots or padding q rows never reaches a real row: scores of keys past a
sequence's kv_len become -inf, and V there is zeroed before it meets its zero weight.

With a sliding window, KV blocks wholly before every row's window are skipped, and page-table
columns before a sequence's window are never indexed (a block that starts there re-reads the
window's first page instead, masked): the engine may have freed those pages and reused them.

On CPU prefer a float32 cache. XLA:CPU cannot gather bf16, so the reference gathers the cache's
bits as uint16; XLA still materialises that uint16 view once per call (one read and write of the
page pool, ~2x cheaper than the f32 copy a plain bf16 gather costs, but proportional to the pool,
not to the keys read). bf16 is fully supported; on TPU and GPU the kernels read bf16 natively.

A quantized cache (int8 or float8_e4m3fn values, `kv_scales` f32[num_pages, page_size, 2*Hkv])
is gathered as bytes with its scales and widened to f32 right after the gather.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

SUPPORTED_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
QUANTIZED_KV_DTYPES = (jnp.dtype(jnp.int8), jnp.dtype(jnp.float8_e4m3fn))

# Block sizes measured on the 2-core CPU (bench/kernels.py); KV blocks round down to whole pages.
DEFAULT_Q_BLOCK = 128  # query rows per block of a multi-token sequence
# Key tokens per block of a multi-token sequence: as many as keep the f32 score tile
# [Hq, q_block, K] near 2 MiB: 448 keys for Hq=9 (~47 GFLOP/s), 128 for Hq=32 (57 vs 28 at 512).
SCORE_BLOCK_BYTES = 2 << 20
# Decode gathers one KV block for all S sequences at once; keeping that f32 copy of K and V near
# 2 MiB (in cache) measured fastest: ~32 tokens for 32 seqs x (Hkv=3, D=64), one page for (8, 128).
# Few sequences would get huge blocks, mostly masked: one sequence at 520 keys took 3.7-4.1 ms
# over SmolLM2's 30 layers in 512-key blocks, 2.8 in 128-key ones (with engine.host_memory).
DECODE_BLOCK_BYTES = 2 << 20
DECODE_MAX_BLOCK = 128
# Heads this wide, and bf16 caches, are gathered per (page, kv head) straight into the heads-major
# layout the einsums want; narrower f32 heads as whole pages, transposed after: at D=64 the
# 256-byte slices of the first gather cost more than the transpose (32 seqs x 1,024 decode ~15-20%
# faster), at D=128 less; for bf16 widening the whole page block made decode ~10-60% slower.
HEAD_MAJOR_MIN_DIM = 128

Carry = tuple[jax.Array, jax.Array, jax.Array]  # running max, softmax denominator, accumulator


def check_supported(
    q_dtype: jnp.dtype, head_dim: int, page_size: int, num_q_heads: int, num_kv_heads: int
) -> None:
    """Raises ValueError naming the combination if the reference cannot run it."""
    if jnp.dtype(q_dtype) not in SUPPORTED_DTYPES:
        raise ValueError(f"reference: {q_dtype=} must be float32 or bfloat16")
    if head_dim <= 0 or page_size <= 0:
        raise ValueError(f"reference: {head_dim=} and {page_size=} must be positive")
    if num_kv_heads <= 0 or num_q_heads % num_kv_heads:
        raise ValueError(f"reference: {num_q_heads=} must be a multiple of {num_kv_heads=}")


def check_inputs(
    q: jax.Array,
    kv_pages: jax.Array,
    kv_lens: jax.Array,
    page_table: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    kv_scales: jax.Array | None = None,
) -> None:
    """Static (trace-time) checks of the contract's shapes and dtypes, shared by all backends."""
    if q.ndim != 3:
        raise ValueError(f"{q.shape=} must be [T, Hq, D]")
    if kv_pages.ndim != 4 or kv_pages.shape[2] % 2 or kv_pages.shape[3] != q.shape[2]:
        raise ValueError(
            f"{kv_pages.shape=} must be [num_pages, page_size, 2*Hkv, D] with D = {q.shape[2]}"
        )
    if kv_scales is not None:
        if kv_pages.dtype not in QUANTIZED_KV_DTYPES:
            raise ValueError(f"{kv_pages.dtype=} with kv_scales must be int8 or float8_e4m3fn")
        if kv_scales.shape != kv_pages.shape[:3] or kv_scales.dtype != jnp.float32:
            raise ValueError(f"{kv_scales.shape=} must be f32{kv_pages.shape[:3]}")
    elif kv_pages.dtype != q.dtype:
        raise ValueError(f"{kv_pages.dtype=} must equal {q.dtype=}")
    if q.shape[1] % (kv_pages.shape[2] // 2):
        raise ValueError(
            f"{q.shape[1]=} query heads must be a multiple of Hkv in {kv_pages.shape=}"
        )
    (num_slots,) = kv_lens.shape
    if page_table.ndim != 2 or page_table.shape[0] != num_slots:
        raise ValueError(f"{page_table.shape=} must be [S, P] with S = {kv_lens.shape[0]}")
    if cu_q_lens.shape != (num_slots + 1,):
        raise ValueError(f"{cu_q_lens.shape=} must be ({num_slots + 1},), S + 1 entries")
    if num_seqs.shape != ():
        raise ValueError(f"{num_seqs.shape=} must be (), a scalar")
    for name, x in (("kv_lens", kv_lens), ("page_table", page_table), ("cu_q_lens", cu_q_lens)):
        if not jnp.issubdtype(x.dtype, jnp.integer):
            raise ValueError(f"{name}.dtype={x.dtype} must be an integer type")


def _init_carry(stat_shape: tuple[int, ...], head_dim: int) -> Carry:
    m = jnp.full(stat_shape, -jnp.inf, jnp.float32)
    return m, jnp.zeros(stat_shape, jnp.float32), jnp.zeros((*stat_shape, head_dim), jnp.float32)


def _softmax_step(
    carry: Carry,
    scores: jax.Array,  # f32[..., K]
    allowed: jax.Array,  # bool, broadcastable to scores
    values: jax.Array,  # f32, finite everywhere (keys past kv_len hold a copy of key 0)
    pv: str,  # einsum of probabilities and values into the accumulator's shape
) -> Carry:
    """One online-softmax block: rescale the running sums and add this block's keys."""
    m, denom, acc = carry
    scores = jnp.where(allowed, scores, -jnp.inf)
    m_new = jnp.maximum(m, scores.max(axis=-1))
    m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)  # rows that have seen no key yet
    p = jnp.exp(scores - m_safe[..., None])  # 0 where masked: exp(-inf)
    alpha = jnp.exp(m - m_safe)
    denom_new = alpha * denom + p.sum(axis=-1)
    acc_new = alpha[..., None] * acc + jnp.einsum(pv, p, values)
    return m_new, denom_new, acc_new


def _finish(carry: Carry) -> jax.Array:
    _, denom, acc = carry
    return acc / jnp.where(denom > 0, denom, 1.0)[..., None]


def _cap(scores: jax.Array, logit_soft_cap: float | None) -> jax.Array:
    if logit_soft_cap is None:
        return scores
    return logit_soft_cap * jnp.tanh(scores / logit_soft_cap)


def _window_start(pos: jax.Array, sliding_window: int | None) -> jax.Array:
    """First key position a query at `pos` may see."""
    if sliding_window is None:
        return jnp.zeros_like(pos)
    return jnp.maximum(pos - sliding_window + 1, 0)


def _gather_block(
    kv_pages: jax.Array,  # dtype[num_pages, page_size, 2*Hkv, D]
    pages: jax.Array,  # i32[..., B] page ids of one KV block, any values
    valid: jax.Array,  # bool[..., B * page_size] key < kv_len
    kv_scales: jax.Array | None,  # f32[num_pages, page_size, 2*Hkv] of a quantized cache
) -> tuple[jax.Array, jax.Array]:
    """K and V of whole pages as f32[..., Hkv, K, D] each: heads-major, so both attention einsums
    are plain batched matmuls with the batch dims leading.

    Narrow f32 heads: one gather of whole pages, then a transpose; otherwise (HEAD_MAJOR_MIN_DIM)
    one gather each for K and V of [page_size, D] slices indexed by (page, combined head).
    Slots past kv_len (the unused tail of a last page, pages past the sequence's) may hold NaN:
    V there is zeroed, because a zero weight times NaN is NaN; K there only reaches scores that
    the caller masks with `where`.
    """
    num_pages, _, combined, head_dim = kv_pages.shape
    if kv_scales is not None:
        return _gather_quantized(kv_pages, kv_scales, jnp.clip(pages, 0, num_pages - 1), valid)
    if head_dim < HEAD_MAJOR_MIN_DIM and kv_pages.dtype == jnp.float32:
        block = _bits_to_f32(_as_bits(kv_pages)[jnp.clip(pages, 0, num_pages - 1)])
        block = block.reshape(*valid.shape, combined // 2, 2, head_dim)  # f32[..., K, Hkv, 2, D]
        k, v = jnp.moveaxis(block[..., 0, :], -2, -3), jnp.moveaxis(block[..., 1, :], -2, -3)
        return k, jnp.where(valid[..., None, :, None], v, 0.0)
    page = jnp.clip(pages, 0, num_pages - 1)[..., None, :]  # i32[..., 1, B]
    head = 2 * jnp.arange(combined // 2, dtype=jnp.int32)[:, None]  # i32[Hkv, 1]; K's head
    bits = _as_bits(kv_pages)
    shape = (*valid.shape[:-1], combined // 2, valid.shape[-1], head_dim)
    k = _bits_to_f32(bits[page, :, head]).reshape(shape)  # f32[..., Hkv, K, D]
    v = _bits_to_f32(bits[page, :, head + 1]).reshape(shape)
    return k, jnp.where(valid[..., None, :, None], v, 0.0)


def _gather_quantized(
    kv_pages: jax.Array,  # i8|f8[num_pages, page_size, 2*Hkv, D]
    kv_scales: jax.Array,  # f32[num_pages, page_size, 2*Hkv]
    pages: jax.Array,  # i32[..., B], in range
    valid: jax.Array,  # bool[..., K]
) -> tuple[jax.Array, jax.Array]:
    """Whole pages as bytes (XLA:CPU gathers no float8) and their scales, widened to f32."""
    combined, head_dim = kv_pages.shape[2:]
    raw = lax.bitcast_convert_type(kv_pages, jnp.uint8)[pages]  # u8[..., B, page_size, 2Hkv, D]
    values = lax.bitcast_convert_type(raw, kv_pages.dtype).astype(jnp.float32)
    block = values * kv_scales[pages][..., None]
    block = block.reshape(*valid.shape, combined // 2, 2, head_dim)  # f32[..., K, Hkv, 2, D]
    k, v = jnp.moveaxis(block[..., 0, :], -2, -3), jnp.moveaxis(block[..., 1, :], -2, -3)
    return k, jnp.where(valid[..., None, :, None], v, 0.0)


def _as_bits(x: jax.Array) -> jax.Array:
    """bf16 as u16 (a free bitcast); other dtypes unchanged.

    XLA:CPU has no bf16 gather: it converts the gather's operand, the whole cache, to f32, and
    hoists that out of the KV loop, so every call would copy the entire page pool. Gathering the
    bits keeps the cost proportional to the keys read.
    """
    return lax.bitcast_convert_type(x, jnp.uint16) if x.dtype == jnp.bfloat16 else x


def _bits_to_f32(x: jax.Array) -> jax.Array:
    """Inverse of _as_bits, widened to f32: a bf16 is the high half of the f32 of equal value."""
    if x.dtype != jnp.uint16:
        return x.astype(jnp.float32)
    return lax.bitcast_convert_type(jnp.stack([jnp.zeros_like(x), x], -1), jnp.float32)


def _block_pages(b: jax.Array, block_pages: int, width: int) -> jax.Array:
    """Page-table columns of KV block b: i32[B]. Columns past the table repeat its last one;
    their keys are past kv_len (at most width * page_size), so they are masked anyway."""
    return jnp.minimum(b * block_pages + jnp.arange(block_pages), width - 1)


def _decode_rows(
    out: jax.Array,  # f32[T, Hq, D]
    q: jax.Array,  # [T, Hq, D]
    kv_pages: jax.Array,  # [num_pages, page_size, 2*Hkv, D]
    kv_lens: jax.Array,  # i32[S]
    page_table: jax.Array,  # i32[S, P]
    cu_q_lens: jax.Array,  # i32[S+1]
    num_seqs: jax.Array,  # i32[]
    *,
    sm_scale: float,
    sliding_window: int | None,
    logit_soft_cap: float | None,
    block_pages: int,
    kv_scales: jax.Array | None,
) -> jax.Array:
    """Attention for every sequence with exactly one query, all sequences at once."""
    tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, page_size = kv_pages.shape[2] // 2, kv_pages.shape[1]
    group, block = num_q_heads // num_kv_heads, block_pages * page_size
    num_slots = kv_lens.shape[0]
    is_decode = (jnp.arange(num_slots) < num_seqs) & (cu_q_lens[1:] - cu_q_lens[:-1] == 1)
    lens = jnp.where(is_decode, kv_lens, 0)  # i32[S]
    rows = jnp.where(is_decode, cu_q_lens[:-1], tokens)  # i32[S]; `tokens` = not a decode row
    qd = q[jnp.minimum(rows, tokens - 1)].astype(jnp.float32) * sm_scale  # f32[S, Hq, D]
    qd = jnp.where(is_decode[:, None, None], qd, 0.0).reshape(num_slots, num_kv_heads, group, -1)
    first = _window_start(lens - 1, sliding_window)  # i32[S]

    first_page = first // page_size  # i32[S]; pages before it are outside every window

    def kv_block(b: jax.Array, carry: Carry) -> Carry:
        with jax.named_scope("decode_kv_block"):
            columns = _block_pages(b, block_pages, page_table.shape[1])  # i32[B]
            columns = jnp.maximum(columns[None, :], first_page[:, None])  # i32[S, B]
            pages = jnp.take_along_axis(page_table, columns, axis=1)  # i32[S, B]
            key = b * block + jnp.arange(block)  # i32[K]
            valid = key[None, :] < lens[:, None]  # bool[S, K]
            allowed = valid & (key[None, :] >= first[:, None])
            k, v = _gather_block(kv_pages, pages, allowed, kv_scales)  # f32[S, Hkv, K, D]
            scores = _cap(jnp.einsum("shgd,shkd->shgk", qd, k), logit_soft_cap)
            return _softmax_step(carry, scores, allowed[:, None, None, :], v, "shgk,shkd->shgd")

    start = jnp.min(jnp.where(is_decode, first, jnp.iinfo(jnp.int32).max)) // block
    stop = (jnp.max(lens) + block - 1) // block
    carry = _init_carry((num_slots, num_kv_heads, group), head_dim)
    res = _finish(lax.fori_loop(jnp.minimum(start, stop), stop, kv_block, carry))
    return out.at[rows].set(res.reshape(num_slots, num_q_heads, head_dim), mode="drop")


def _prefill_rows(
    out: jax.Array,  # f32[T, Hq, D]
    q: jax.Array,  # [T, Hq, D]
    kv_pages: jax.Array,  # [num_pages, page_size, 2*Hkv, D]
    kv_lens: jax.Array,  # i32[S]
    page_table: jax.Array,  # i32[S, P]
    cu_q_lens: jax.Array,  # i32[S+1]
    num_seqs: jax.Array,  # i32[]
    *,
    sm_scale: float,
    sliding_window: int | None,
    logit_soft_cap: float | None,
    q_block: int,
    block_pages: int,
    kv_scales: jax.Array | None,
) -> jax.Array:
    """Attention for every sequence with more than one query, one query block at a time.

    One loop over the (sequence, query block) pairs of multi-token sequences only, so a batch
    of decodes costs nothing here.
    """
    tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, page_size = kv_pages.shape[2] // 2, kv_pages.shape[1]
    group, block = num_q_heads // num_kv_heads, block_pages * page_size
    num_slots = kv_lens.shape[0]
    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]  # i32[S]
    multi = (jnp.arange(num_slots) < num_seqs) & (q_lens > 1)
    num_blocks = jnp.where(multi, (q_lens + q_block - 1) // q_block, 0)  # i32[S]
    ends = jnp.cumsum(num_blocks)  # i32[S]; query blocks of sequences 0..s

    def query_block(i: jax.Array, out: jax.Array) -> jax.Array:
        s = jnp.sum(ends <= i)  # the sequence that owns the i-th query block
        start = (i - ends[s] + num_blocks[s]) * q_block  # first row within the sequence
        q_len, kv_len, table = q_lens[s], kv_lens[s], page_table[s]
        # A block near the end of q is shifted back to fit; rows of the previous block or of
        # another sequence that it then covers are left as they are.
        row = jnp.minimum(cu_q_lens[s] + start, tokens - q_block)
        local = row - cu_q_lens[s] + jnp.arange(q_block)  # i32[BQ]; row index within the sequence
        row_ok = (local >= start) & (local < q_len)
        pos = kv_len - q_len + local  # i32[BQ]; absolute positions
        qb = lax.dynamic_slice_in_dim(q, row, q_block).astype(jnp.float32) * sm_scale
        qb = jnp.where(row_ok[:, None, None], qb, 0.0).reshape(q_block, num_kv_heads, group, -1)
        qb = qb.transpose(1, 2, 0, 3)  # f32[Hkv, G, BQ, D]
        last = jnp.minimum(pos[-1], kv_len - 1)
        first = _window_start(kv_len - q_len + start, sliding_window)  # of the first real row

        def kv_block(b: jax.Array, carry: Carry) -> Carry:
            with jax.named_scope("prefill_kv_block"):
                columns = _block_pages(b, block_pages, table.shape[0])  # i32[B]
                pages = table[jnp.maximum(columns, first // page_size)]  # i32[B]
                key = b * block + jnp.arange(block)  # i32[K]
                valid = (key < kv_len) & (key >= first)
                allowed = valid[None, :] & (key[None, :] <= pos[:, None])  # bool[BQ, K]
                if sliding_window is not None:
                    allowed &= pos[:, None] - key[None, :] < sliding_window
                k, v = _gather_block(kv_pages, pages, valid, kv_scales)  # f32[Hkv, K, D]
                scores = _cap(jnp.einsum("hgqd,hkd->hgqk", qb, k), logit_soft_cap)
                return _softmax_step(carry, scores, allowed, v, "hgqk,hkd->hgqd")

        carry = _init_carry((num_kv_heads, group, q_block), head_dim)
        carry = lax.fori_loop(first // block, last // block + 1, kv_block, carry)
        res = _finish(carry).transpose(2, 0, 1, 3).reshape(q_block, num_q_heads, head_dim)
        old = lax.dynamic_slice_in_dim(out, row, q_block)
        return lax.dynamic_update_slice_in_dim(
            out, jnp.where(row_ok[:, None, None], res, old), row, 0
        )

    return lax.fori_loop(0, ends[-1], query_block, out)


def _normalized(
    kv_lens: jax.Array, page_table: jax.Array, cu_q_lens: jax.Array, num_seqs: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    num_seqs = jnp.minimum(num_seqs.astype(jnp.int32), kv_lens.shape[0])
    return (
        kv_lens.astype(jnp.int32),
        page_table.astype(jnp.int32),
        cu_q_lens.astype(jnp.int32),
        num_seqs,
    )


def _pages_per_block(tokens: int, page_size: int, width: int) -> int:
    # Whole pages, at least one, and never wider than the page table (that would add only masks).
    return min(max(1, tokens // page_size), width)


def _multi_token_rows(
    out: jax.Array,  # f32[T, Hq, D]
    q: jax.Array,
    kv_pages: jax.Array,
    kv_lens: jax.Array,
    page_table: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    *,
    sm_scale: float,
    sliding_window: int | None,
    logit_soft_cap: float | None,
    q_block: int = DEFAULT_Q_BLOCK,
    kv_block: int | None = None,
    kv_scales: jax.Array | None = None,
) -> jax.Array:
    """The rows of every sequence with more than one query (prefill, chunked prefill) written
    into `out`, other rows left as they are."""
    if kv_block is None:
        kv_block = SCORE_BLOCK_BYTES // (q.shape[1] * q_block * 4)
    kv_lens, page_table, cu_q_lens, num_seqs = _normalized(kv_lens, page_table, cu_q_lens, num_seqs)
    with jax.named_scope("prefill"):
        return _prefill_rows(
            out,
            q,
            kv_pages,
            kv_lens,
            page_table,
            cu_q_lens,
            num_seqs,
            sm_scale=sm_scale,
            sliding_window=sliding_window,
            logit_soft_cap=logit_soft_cap,
            q_block=min(q_block, q.shape[0]),
            block_pages=_pages_per_block(kv_block, kv_pages.shape[1], page_table.shape[1]),
            kv_scales=kv_scales,
        )


def _ragged_paged_attention(
    q: jax.Array,
    kv_pages: jax.Array,
    kv_lens: jax.Array,
    page_table: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    *,
    sm_scale: float,
    sliding_window: int | None,
    logit_soft_cap: float | None,
    q_block: int,
    kv_block: int | None,
    decode_kv_block: int | None,
    kv_scales: jax.Array | None,
) -> jax.Array:
    if decode_kv_block is None:
        token_bytes = kv_lens.shape[0] * kv_pages.shape[2] * kv_pages.shape[3] * 4
        decode_kv_block = min(DECODE_BLOCK_BYTES // token_bytes, DECODE_MAX_BLOCK)
    args = (q, kv_pages, *_normalized(kv_lens, page_table, cu_q_lens, num_seqs))
    out = jnp.zeros(q.shape, jnp.float32)
    with jax.named_scope("decode"):
        out = _decode_rows(
            out,
            *args,
            sm_scale=sm_scale,
            sliding_window=sliding_window,
            logit_soft_cap=logit_soft_cap,
            block_pages=_pages_per_block(decode_kv_block, kv_pages.shape[1], page_table.shape[1]),
            kv_scales=kv_scales,
        )
    out = _multi_token_rows(
        out,
        *args,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        logit_soft_cap=logit_soft_cap,
        q_block=q_block,
        kv_block=kv_block,
        kv_scales=kv_scales,
    )
    return out.astype(q.dtype)


@functools.partial(
    jax.jit,
    static_argnames=(
        "sm_scale",
        "sliding_window",
        "logit_soft_cap",
        "q_block",
        "kv_block",
        "decode_kv_block",
    ),
)
def ragged_paged_attention_reference(
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
    q_block: int = DEFAULT_Q_BLOCK,
    kv_block: int | None = None,
    decode_kv_block: int | None = None,
    kv_scales: jax.Array | None = None,
) -> jax.Array:
    """Ragged paged attention in pure jnp (any mix of prefill, chunked prefill and decode).

    Args:
      q: f32|bf16[T, Hq, D] queries of all sequences packed back to back, then padding rows.
      kv_pages: [num_pages, page_size, 2*Hkv, D], q's dtype; K/V interleaved per combined head
        (see `pallas_kernels.kv_cache_update`). D must equal q's (the public wrapper pads q).
      kv_lens: i32[S] context length of each sequence, including its new tokens.
      page_table: i32[S, P] page ids of each sequence's context, in order.
      cu_q_lens: i32[S+1] sequence s owns query rows cu_q_lens[s]:cu_q_lens[s+1], the last
        tokens of its context.
      num_seqs: i32[] number of real sequences; slots s >= num_seqs are ignored.
      sm_scale: multiplies q . k.
      sliding_window: a query at position i sees keys j with i - j < sliding_window.
      logit_soft_cap: scores become cap * tanh(scores / cap).
      q_block: query rows per block for multi-token sequences.
      kv_block: tokens per KV block for multi-token sequences (whole pages, at least one);
        None: as many as keep the f32 score tile near SCORE_BLOCK_BYTES.
      decode_kv_block: tokens per KV block for one-token sequences (whole pages, at least one);
        None: as many as keep the gathered f32 K/V of all S sequences near DECODE_BLOCK_BYTES.
      kv_scales: f32[num_pages, page_size, 2*Hkv] when kv_pages holds int8 or float8_e4m3fn
        values: K/V = kv_pages * kv_scales[..., None] (`pallas_kernels.kv_cache_update`).

    Returns:
      [T, Hq, D] in q's dtype; rows >= cu_q_lens[num_seqs] are unspecified.
    """
    check_inputs(q, kv_pages, kv_lens, page_table, cu_q_lens, num_seqs, kv_scales)
    check_supported(q.dtype, q.shape[2], kv_pages.shape[1], q.shape[1], kv_pages.shape[2] // 2)
    return _ragged_paged_attention(
        q,
        kv_pages,
        kv_lens,
        page_table,
        cu_q_lens,
        num_seqs,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        logit_soft_cap=logit_soft_cap,
        q_block=q_block,
        kv_block=kv_block,
        decode_kv_block=decode_kv_block,
        kv_scales=kv_scales,
    )


__all__ = [
    "check_inputs",
    "check_supported",
    "ragged_paged_attention_reference",
]
