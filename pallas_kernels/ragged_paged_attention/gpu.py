"""Ragged paged attention for NVIDIA GPUs: a Pallas kernel on the Triton backend.

Backend: Triton (`jax.experimental.pallas.triton`), not Mosaic GPU, because
- it lowers unchanged on jax 0.10.x and 0.11.x. jax 0.11 marks the Pallas Triton backend
  deprecated (a DeprecationWarning when a kernel is lowered) but keeps it; the Mosaic GPU API is
  still changing between those releases (its changelog lists breaking changes to `pl.kernel`,
  transforms and copy barriers),
- it runs in Pallas's HLO interpret mode on a CPU (`interpret=True`), so the CPU suite checks
  this very kernel body against the float64 oracle, NaN-filled padding included (Mosaic GPU's
  interpreter is private in jax 0.10: not exported by `jax.experimental.pallas.mosaic_gpu`),
- a paged KV walk is a gather, and Triton addresses memory with per-element pointers: one masked
  load fetches `block_kv` keys spread over any number of pages of any size. Mosaic GPU works in
  whole-tile TMA copies to shared memory and 64-row warpgroup matmuls, a better fit for big
  prefill tiles on Hopper (the likely successor here once its API settles) than for decode rows,
- the Triton compiler targets sm_90 (H100/H200) itself, choosing its matmul instructions.
The cost: `jax.export` refuses to serialize a Triton custom call unless the caller disables that
safety check (`EXPORT_DISABLED_CHECKS`); a `jax.jit` on a GPU needs nothing.

Design
- Grid `(T // block_q + S, Hkv, num_kv_splits)`; a program owns `block_q` query tokens of one
  sequence times all `G = Hq // Hkv` query heads of one KV head, so each K/V tile it loads
  serves the whole group. Its tile has `block_rows` rows: row r is token r // G of the block and
  query head r % G of the group (`block_q = block_rows // G`). A decode uses G rows of a tile.
- Axis 0 enumerates query blocks, ragged: sequence s owns the ids from `cu_q_lens[s] // block_q + s`
  up to the next sequence's first id. That is always >= ceil(q_len / block_q) ids, and the last
  sequence's end `cu_q_lens[num_seqs] // block_q + num_seqs <= T // block_q + S`, so the grid
  depends only on T and S (one compilation for any prefill/decode mix). A program finds its
  sequence by binary search over `cu_q_lens`; programs past their sequence's last token, or
  past `num_seqs`, do nothing. Neighbouring ids are neighbouring query blocks, which read the
  same sequence's K/V, so repeated K/V reads tend to hit L2.
- The KV loop runs over blocks of `block_kv` keys from the first key any row of the tile may see
  (0, or the sliding window's start) to the tile's last query position: a dynamic trip count
  that skips whole blocks outside the window or past the causal end. Each key's page comes from the
  page table, so a block may span pages and page_size needs no relation to block_kv.
- Online softmax in f32 (running max m, sum l, accumulator acc); q.k in f32 from q.dtype
  operands, p cast to the cache dtype for p @ V (flash-attention practice for bf16). bf16
  operands run on tensor cores. float32 operands: Pallas' default precision on GPU is TF32 (10
  mantissa bits, ~1e-3 relative error per product), so the dots ask for it explicitly:
  `float32_dots="ieee"` (the default) is exact float32 FMA on the CUDA cores, "tf32" uses tensor
  cores at TF32's error (its tolerance in the tests: 5e-3 instead of 1e-5).
- Tiles sized to the rows they serve: a decode bucket (T <= S: at most one query token per
  sequence on average) gets 16-row query tiles (`DECODE_BLOCK_SIZES`; at G = 4 that is 4 decode
  rows, not the 16 of a 64-row prefill tile of which 60 would be masked) and deeper
  pipelining of the KV loop, which is all a decode does; other buckets get `BLOCK_SIZES`.
- Split-KV ("flash decoding", `num_kv_splits > 1`): axis 2 cuts each tile's key blocks into
  contiguous ranges; each program writes its normalized partial output and log-sum-exp in f32
  and `_merge_splits` combines them. It gives a batch of few long decodes more programs than
  `num_seqs * Hkv`; with one split the kernel writes the output directly. `num_kv_splits=None`
  (the default) picks the count with `choose_num_kv_splits` from the bucket's shape and the
  device's SM count (132 on an H200, assumed when exporting without a GPU).
- Quantized cache (int8 / float8_e4m3fn values, f32 scales per token slot and combined head):
  each K/V tile is loaded as bytes with its keys' scales (one more masked load of `block_kv`
  floats) and widened to q's dtype before the dots.
- Nothing outside a sequence reaches a real row: loads past kv_len or past the sequence's query
  rows are masked (the GPU never touches that memory) with a zero fill, and scores outside the
  causal/window mask are replaced with `where`, so NaN in unused pages, padding rows or page
  table entries past a sequence's pages never meets a real output.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import export, lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.ragged_paged_attention.reference import check_inputs

SUPPORTED_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
MIN_DOT_DIM = 16  # Triton's tl.dot needs every matmul dim >= 16
MAX_HEAD_DIM = 256  # a 64 x D f32 accumulator per program must fit registers
MAX_BLOCK_ROWS = 256  # rows of one program's query tile; caps the GQA group size
# Finite, so a row that has seen only masked keys keeps a finite max: no inf - inf = NaN.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)
# What `jax.export` must be told to serialize this kernel (Triton custom calls are not stable).
EXPORT_DISABLED_CHECKS = (export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton"),)
# float32_dots -> the dot precision: IEEE float32, or TF32 on tensor cores (Pallas' GPU default).
FLOAT32_DOTS = {"ieee": lax.Precision.HIGHEST, "tf32": lax.Precision.DEFAULT}
H200_SMS = 132  # streaming multiprocessors of an H200 (and H100 SXM); used without a GPU
MAX_KV_SPLITS = 16
# A split should walk at least this many KV blocks: fewer, and the partial outputs it writes and
# the merge cost more than the parallelism buys.
MIN_KV_BLOCKS_PER_SPLIT = 4


class BlockSizes(NamedTuple):
    """Work of one program and its launch parameters (see the module docstring)."""

    block_rows: int  # query rows: tokens x query heads of one KV group; power of two >= 16
    block_kv: int  # keys per inner-loop step; power of two >= 16
    num_warps: int
    num_stages: int  # Triton software-pipelining depth of the KV loop


# Starting points for H100/H200 (sm_90) by head_dim, from register and shared-memory budgets, not
# yet measured (a bench/ sweep should overwrite them): a 64-row query tile and 64 keys per step
# on 4 warps; at D=256 the 64 x 256 f32 accumulator needs 8 warps, and 32 keys per step keep the
# K/V tiles of 2 pipeline stages in shared memory.
BLOCK_SIZES: dict[int, BlockSizes] = {
    16: BlockSizes(block_rows=64, block_kv=64, num_warps=4, num_stages=2),
    32: BlockSizes(block_rows=64, block_kv=64, num_warps=4, num_stages=2),
    64: BlockSizes(block_rows=64, block_kv=64, num_warps=4, num_stages=2),
    128: BlockSizes(block_rows=64, block_kv=64, num_warps=4, num_stages=2),
    256: BlockSizes(block_rows=64, block_kv=32, num_warps=8, num_stages=2),
}
# Decode buckets: 16-row query tiles (one token's G heads, G <= 16; larger groups round up) and a
# third pipeline stage for the KV loads, the whole of a decode's work. Shared memory per stage at
# D = 128: K and V tiles of 64 keys, 32 KiB in bf16 (64 KiB in f32), three stages within the
# 227 KiB an sm_90 block may use. Starting points, not yet measured (bench/gpu/kernels.py).
DECODE_BLOCK_SIZES: dict[int, BlockSizes] = {
    16: BlockSizes(block_rows=16, block_kv=64, num_warps=4, num_stages=3),
    32: BlockSizes(block_rows=16, block_kv=64, num_warps=4, num_stages=3),
    64: BlockSizes(block_rows=16, block_kv=64, num_warps=4, num_stages=3),
    128: BlockSizes(block_rows=16, block_kv=64, num_warps=4, num_stages=3),
    256: BlockSizes(block_rows=16, block_kv=32, num_warps=4, num_stages=3),
}


def _is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def check_supported(
    q_dtype: jnp.dtype | type,
    head_dim: int,
    page_size: int,
    num_q_heads: int,
    num_kv_heads: int,
) -> None:
    """Raises ValueError naming the combination this kernel cannot run; returns None if it can."""
    if jnp.dtype(q_dtype) not in SUPPORTED_DTYPES:
        raise ValueError(f"GPU ragged paged attention supports f32 and bf16, not {q_dtype=}")
    if not _is_power_of_two(head_dim) or not MIN_DOT_DIM <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(
            f"GPU ragged paged attention (Triton) needs head_dim a power of two in "
            f"[{MIN_DOT_DIM}, {MAX_HEAD_DIM}], got {head_dim=}"
        )
    if page_size < 1:
        raise ValueError(f"{page_size=} must be positive")
    if num_kv_heads < 1 or num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads=} must be a positive multiple of {num_kv_heads=}")
    if num_q_heads // num_kv_heads > MAX_BLOCK_ROWS:
        raise ValueError(
            f"GQA group {num_q_heads // num_kv_heads} (= {num_q_heads=} // {num_kv_heads=}) "
            f"exceeds the {MAX_BLOCK_ROWS} query rows of one GPU program"
        )


def _check_inputs(
    q: jax.Array,  # [T, Hq, D]
    kv_pages: jax.Array,  # [num_pages, page_size, 2*Hkv, D]
    kv_lens: jax.Array,  # i32[S]
    page_table: jax.Array,  # i32[S, P]
    cu_q_lens: jax.Array,  # i32[S+1]
    num_seqs: jax.Array,  # i32[]
    kv_scales: jax.Array | None,  # f32[num_pages, page_size, 2*Hkv] of a quantized cache
) -> None:
    """Static (trace-time) checks of the arrays: the contract's shapes (shared with the
    reference), then what this kernel adds (int32 metadata, supported sizes)."""
    check_inputs(q, kv_pages, kv_lens, page_table, cu_q_lens, num_seqs, kv_scales)
    check_supported(q.dtype, q.shape[-1], kv_pages.shape[1], q.shape[1], kv_pages.shape[2] // 2)
    metadata = {"kv_lens": kv_lens, "page_table": page_table, "cu_q_lens": cu_q_lens}
    for name, x in {**metadata, "num_seqs": num_seqs}.items():
        if x.dtype != jnp.int32:
            raise ValueError(f"{name}.dtype={x.dtype} must be int32")


def _check_options(
    group: int,
    sliding_window: int | None,
    logit_soft_cap: float | None,
    sizes: BlockSizes,
    num_kv_splits: int,
    float32_dots: str,
) -> None:
    """Static checks of the keyword options and block sizes."""
    if float32_dots not in FLOAT32_DOTS:
        raise ValueError(f"{float32_dots=} must be one of {tuple(FLOAT32_DOTS)}")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"{sliding_window=} must be None or >= 1")
    if logit_soft_cap is not None and not logit_soft_cap > 0:
        raise ValueError(f"{logit_soft_cap=} must be None or > 0")
    for name, size in (("block_rows", sizes.block_rows), ("block_kv", sizes.block_kv)):
        if not _is_power_of_two(size) or size < MIN_DOT_DIM:
            raise ValueError(f"{name}={size} must be a power of two >= {MIN_DOT_DIM}")
    if not group <= sizes.block_rows <= MAX_BLOCK_ROWS:
        raise ValueError(
            f"block_rows={sizes.block_rows} must hold one token's {group} query heads and be "
            f"<= {MAX_BLOCK_ROWS}"
        )
    if num_kv_splits < 1:
        raise ValueError(f"{num_kv_splits=} must be >= 1")


def _find_sequence(
    cu_q_lens_ref: jax.Ref,  # i32[S+1]
    num_seqs: jax.Array,  # i32[]
    q_block: jax.Array,  # i32[]: this program's id along the query-block axis
    block_q: int,
) -> jax.Array:
    """The last sequence s < num_seqs whose first query block id, cu_q_lens[s] // block_q + s,
    is <= q_block (binary search; first ids are non-decreasing in s)."""
    num_steps = (cu_q_lens_ref.shape[0] - 1).bit_length()  # >= log2(S): halves [0, S) to one

    def halve(_: int, bounds: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        lo, hi = bounds
        mid = lax.div(lo + hi + 1, 2)
        starts_before = lax.div(cu_q_lens_ref[mid], block_q) + mid <= q_block
        return jnp.where(starts_before, mid, lo), jnp.where(starts_before, hi, mid - 1)

    lo, _ = lax.fori_loop(0, num_steps, halve, (jnp.int32(0), num_seqs - 1))
    return lo


def _attention_kernel(
    kv_lens_ref: jax.Ref,  # i32[S]
    page_table_ref: jax.Ref,  # i32[S, P]
    cu_q_lens_ref: jax.Ref,  # i32[S+1]
    num_seqs_ref: jax.Ref,  # i32[1]
    q_ref: jax.Ref,  # [T, Hq, D]
    kv_pages_ref: jax.Ref,  # [num_pages, page_size, 2*Hkv, D]
    *refs: jax.Ref,
    # refs: with a quantized cache first its scales f32[num_pages, page_size, 2*Hkv]; then
    # o_ref [splits, T, Hq, D] (q.dtype if splits == 1, else f32 partial outputs) and, with
    # splits > 1 only, lse_ref f32[splits, T, Hq], the log-sum-exp of each split.
    quantized: bool,
    sm_scale: float,
    sliding_window: int | None,
    logit_soft_cap: float | None,
    group: int,
    block_rows: int,
    block_kv: int,
    num_kv_splits: int,
    precision: lax.Precision,
) -> None:
    """One program: `block_q` query tokens x all G query heads of one KV head, over the keys of
    its KV split (all keys the tile may see when num_kv_splits == 1)."""
    scales_ref = refs[0] if quantized else None
    o_ref, *lse_ref = refs[1:] if quantized else refs
    q_block, kv_head, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    page_size, head_dim = kv_pages_ref.shape[1], kv_pages_ref.shape[3]
    block_q = block_rows // group
    num_seqs = num_seqs_ref[0]
    seq = _find_sequence(cu_q_lens_ref, num_seqs, q_block, block_q)
    q_start, q_end = cu_q_lens_ref[seq], cu_q_lens_ref[seq + 1]
    kv_len = kv_lens_ref[seq]
    first_block = lax.div(q_start, block_q) + seq
    first_token = q_start + (q_block - first_block) * block_q
    # Absolute position of query token t of this sequence: kv_len - q_len + (t - q_start).
    pos_offset = kv_len - (q_end - q_start) - q_start

    @pl.when((seq < num_seqs) & (first_token < q_end))
    def _() -> None:
        rows = jnp.arange(block_rows, dtype=jnp.int32)  # i32[M]
        token = first_token + lax.div(rows, group)  # i32[M]
        head = kv_head * group + lax.rem(rows, group)  # i32[M]
        row_ok = (rows < block_q * group) & (token < q_end)  # bool[M]
        lanes = jnp.arange(head_dim, dtype=jnp.int32)  # i32[D]
        q_at = q_ref.at[token[:, None], head[:, None], lanes[None, :]]
        q = plgpu.load(q_at, mask=row_ok[:, None], other=0.0)  # [M, D]
        q_pos = token + pos_offset  # i32[M]

        last_pos = jnp.minimum(first_token + block_q, q_end) - 1 + pos_offset
        first_key: jax.Array | int = 0  # first key any row of the tile may see
        if sliding_window is not None:
            first_key = jnp.maximum(first_token + pos_offset - sliding_window + 1, 0)

        def kv_step(
            kv_block: jax.Array, carry: tuple[jax.Array, jax.Array, jax.Array]
        ) -> tuple[jax.Array, jax.Array, jax.Array]:
            m_prev, l_prev, acc_prev = carry  # f32[M], f32[M], f32[M, D]
            key = kv_block * block_kv + jnp.arange(block_kv, dtype=jnp.int32)  # i32[K]
            # Keys before the tile's window start are never loaded, nor their page-table
            # entries (the engine may have freed pages behind the window).
            key_ok = (key < kv_len) & (key >= first_key)  # bool[K]
            page_at = page_table_ref.at[seq, lax.div(key, page_size)]
            page = plgpu.load(page_at, mask=key_ok, other=0)  # i32[K]
            slot = lax.rem(key, page_size)  # i32[K]
            k_at = kv_pages_ref.at[page[:, None], slot[:, None], 2 * kv_head, lanes[None, :]]
            v_at = kv_pages_ref.at[page[:, None], slot[:, None], 2 * kv_head + 1, lanes[None, :]]
            k = plgpu.load(k_at, mask=key_ok[:, None], other=0)  # [K, D]
            v = plgpu.load(v_at, mask=key_ok[:, None], other=0)  # [K, D]
            if scales_ref is not None:  # widen the bytes and scale each key's K and V
                k_scale = plgpu.load(scales_ref.at[page, slot, 2 * kv_head], mask=key_ok, other=0)
                v_scale = plgpu.load(
                    scales_ref.at[page, slot, 2 * kv_head + 1], mask=key_ok, other=0
                )
                k = (k.astype(jnp.float32) * k_scale[:, None]).astype(q.dtype)
                v = (v.astype(jnp.float32) * v_scale[:, None]).astype(q.dtype)

            scores = plgpu.dot(q, k, trans_b=True, precision=precision) * sm_scale  # f32[M, K]
            if logit_soft_cap is not None:
                scores = logit_soft_cap * jnp.tanh(scores / logit_soft_cap)
            visible = key_ok[None, :] & (key[None, :] <= q_pos[:, None])  # bool[M, K]
            if sliding_window is not None:
                visible &= q_pos[:, None] - key[None, :] < sliding_window
            scores = jnp.where(visible, scores, MASK_VALUE)

            m_next = jnp.maximum(m_prev, scores.max(axis=1))  # f32[M]
            rescale = jnp.exp(m_prev - m_next)  # f32[M]
            p = jnp.where(visible, jnp.exp(scores - m_next[:, None]), 0.0)  # f32[M, K]
            l_next = rescale * l_prev + p.sum(axis=1)
            pv = plgpu.dot(p.astype(v.dtype), v, precision=precision)  # f32[M, D]
            acc_next = rescale[:, None] * acc_prev + pv
            return m_next, l_next, acc_next

        init = (
            jnp.full((block_rows,), MASK_VALUE, jnp.float32),
            jnp.zeros((block_rows,), jnp.float32),
            jnp.zeros((block_rows, head_dim), jnp.float32),
        )
        blocks_lo = lax.div(first_key, block_kv)
        blocks_hi = lax.div(last_pos, block_kv) + 1
        per_split = lax.div(blocks_hi - blocks_lo + num_kv_splits - 1, num_kv_splits)
        split_lo = blocks_lo + split * per_split
        split_hi = jnp.minimum(split_lo + per_split, blocks_hi)  # may be empty: no iterations
        m, l_sum, acc = lax.fori_loop(split_lo, split_hi, kv_step, init)
        # Every real row sees its own key, so l_sum > 0 once all splits are merged; a row that saw
        # no key in this split (or a masked row) gets out = 0 and, with splits, lse = MASK_VALUE.
        seen = l_sum > 0  # bool[M]
        out = acc / jnp.where(seen, l_sum, 1.0)[:, None]  # f32[M, D]
        o_at = o_ref.at[split, token[:, None], head[:, None], lanes[None, :]]
        plgpu.store(o_at, out.astype(o_ref.dtype), mask=row_ok[:, None])
        if lse_ref:
            lse = jnp.where(seen, m + jnp.log(jnp.where(seen, l_sum, 1.0)), MASK_VALUE)
            plgpu.store(lse_ref[0].at[split, token, head], lse, mask=row_ok)


def choose_block_sizes(
    head_dim: int, group: int, decode: bool, **overrides: int | None
) -> BlockSizes:
    """The table's sizes for head_dim (the decode table for a decode bucket) with the caller's
    overrides; the default query tile grows to a power of two that holds one token's `group`
    query heads."""
    table = (DECODE_BLOCK_SIZES if decode else BLOCK_SIZES)[head_dim]
    table = table._replace(block_rows=max(table.block_rows, 1 << (group - 1).bit_length()))
    return table._replace(**{k: v for k, v in overrides.items() if v is not None})


def choose_num_kv_splits(*, num_programs: int, max_kv_len: int, block_kv: int, num_sms: int) -> int:
    """How many KV splits a grid of `num_programs` busy programs (query tiles x KV heads) gets.

    Each split multiplies the programs; the time of a launch goes as its waves over the SMs
    divided by the splits, ceil(num_programs * s / num_sms) / s. The count is the smallest s
    that minimizes it, at most MAX_KV_SPLITS and at most one per MIN_KV_BLOCKS_PER_SPLIT blocks
    of `block_kv` keys of the longest context (`max_kv_len`). A grid that already fills the SMs
    gets 1 (no partial outputs to merge).
    """
    if num_programs >= num_sms:
        return 1
    by_length = max(1, max_kv_len // (MIN_KV_BLOCKS_PER_SPLIT * block_kv))
    candidates = range(1, min(MAX_KV_SPLITS, by_length) + 1)
    return min(candidates, key=lambda s: (-(-num_programs * s // num_sms) / s, s))


def busy_query_tiles(num_tokens: int, num_slots: int, block_q: int) -> int:
    """Query tiles that can hold real rows: one per sequence slot and per block_q tokens, but
    never more than there are tokens."""
    return min(num_tokens, num_tokens // block_q + num_slots)


def _num_sms() -> int:
    """Streaming multiprocessors of the GPU, or of an H200 when tracing without one (export)."""
    if jax.default_backend() != "gpu":
        return H200_SMS
    return int(jax.local_devices()[0].core_count)


def _merge_splits(
    parts: jax.Array,  # f32[splits, T, Hq, D]: each split's softmax-normalized output
    lse: jax.Array,  # f32[splits, T, Hq]: each split's log-sum-exp, MASK_VALUE if it saw no key
) -> jax.Array:  # f32[T, Hq, D]
    """Combines the KV splits of each row: softmax over all keys = splits weighted by exp(lse)."""
    weight = jnp.exp(lse - lse.max(axis=0))  # f32[splits, T, Hq]; 0 for a split with no key
    merged = (weight[..., None] * parts).sum(axis=0)  # elementwise: no TF32 dot on a GPU
    return merged / weight.sum(axis=0)[..., None]


@functools.partial(
    jax.jit,
    static_argnames=(
        "sm_scale",
        "sliding_window",
        "logit_soft_cap",
        "interpret",
        "block_rows",
        "block_kv",
        "num_warps",
        "num_stages",
        "num_kv_splits",
        "float32_dots",
    ),
)
def ragged_paged_attention_gpu(
    q: jax.Array,  # f32|bf16[T, Hq, D]
    kv_pages: jax.Array,  # f32|bf16[num_pages, page_size, 2*Hkv, D]
    kv_lens: jax.Array,  # i32[S]
    page_table: jax.Array,  # i32[S, P]
    cu_q_lens: jax.Array,  # i32[S+1]
    num_seqs: jax.Array,  # i32[]
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    logit_soft_cap: float | None = None,
    interpret: bool = False,
    block_rows: int | None = None,
    block_kv: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    num_kv_splits: int | None = None,
    kv_scales: jax.Array | None = None,
    float32_dots: str = "ieee",
) -> jax.Array:  # q.dtype[T, Hq, D]
    """Causal attention of ragged query rows over a paged KV cache, on a GPU (Pallas Triton).

    Args:
      q: f32|bf16[T, Hq, D] queries of all sequences packed back to back; rows at and past
        cu_q_lens[num_seqs] are padding (their output is unspecified).
      kv_pages: [num_pages, page_size, 2*Hkv, D] one layer's cache, q's dtype: kv_pages[p, i, 2*h]
        is K and kv_pages[p, i, 2*h+1] is V of kv head h for token slot i of page p.
      kv_lens: i32[S] context length of each sequence, including its new queries (whose K/V are
        already in the cache).
      page_table: i32[S, P] pages of each sequence in order; key j is at page
        page_table[s, j // page_size], slot j % page_size. Entries past a sequence's pages are
        never read.
      cu_q_lens: i32[S+1] sequence s owns query rows cu_q_lens[s]:cu_q_lens[s+1], the last q_len
        tokens of its context; non-decreasing.
      num_seqs: i32[] how many of the S sequences are real.
      sm_scale: multiplies q.k before the soft cap.
      sliding_window: W; query at position pos sees keys j with pos - W < j <= pos. None: all
        keys j <= pos.
      logit_soft_cap: c; scores become c * tanh(scores / c). None: no cap.
      interpret: run the kernel body in Pallas's HLO interpreter (any backend, e.g. CPU tests).
      block_rows: query rows (tokens x query heads of one KV group) per program; a power of
        two >= 16 and >= the group. None: `BLOCK_SIZES[D]` (`DECODE_BLOCK_SIZES[D]` when
        T <= S), raised to hold one token's group.
      block_kv: keys per inner-loop step; a power of two >= 16. None: from the same table.
      num_warps, num_stages: Triton launch parameters. None: from the same table.
      num_kv_splits: split each query tile's keys into this many contiguous ranges, one program
        each, merged after the kernel (split-KV "flash decoding"): more programs for a batch of
        few long decodes, at the cost of f32 partial outputs [splits, T, Hq, D] in memory.
        None: `choose_num_kv_splits` for this shape and the device's SM count.
      kv_scales: f32[num_pages, page_size, 2*Hkv] when kv_pages holds int8 or float8_e4m3fn
        values: K/V = values * scales[..., None].
      float32_dots: "ieee" (exact float32 products) or "tf32" (tensor cores, TF32 rounding of
        the operands) for float32 q and cache; bf16 and quantized caches are unaffected.

    Returns:
      q.dtype[T, Hq, D]: softmax(q.k * sm_scale, causal + window masked) @ v per query head;
      query head n uses kv head n // (Hq // Hkv).
    """
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, num_slots = kv_pages.shape[2] // 2, kv_lens.shape[0]
    _check_inputs(q, kv_pages, kv_lens, page_table, cu_q_lens, num_seqs, kv_scales)
    group = num_q_heads // num_kv_heads
    sizes = choose_block_sizes(
        head_dim,
        group,
        num_tokens <= num_slots,
        block_rows=block_rows,
        block_kv=block_kv,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    splits = 1 if num_kv_splits is None else num_kv_splits
    _check_options(group, sliding_window, logit_soft_cap, sizes, splits, float32_dots)
    block_q = sizes.block_rows // group  # query tokens per program
    if num_kv_splits is None:
        num_kv_splits = choose_num_kv_splits(
            num_programs=busy_query_tiles(num_tokens, num_slots, block_q) * num_kv_heads,
            max_kv_len=page_table.shape[1] * kv_pages.shape[1],
            block_kv=sizes.block_kv,
            num_sms=_num_sms(),
        )
    kernel = functools.partial(
        _attention_kernel,
        quantized=kv_scales is not None,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        logit_soft_cap=logit_soft_cap,
        group=group,
        block_rows=sizes.block_rows,
        block_kv=sizes.block_kv,
        num_kv_splits=num_kv_splits,
        precision=FLOAT32_DOTS[float32_dots],
    )
    splits = num_kv_splits
    out_shape = [jax.ShapeDtypeStruct((splits, *q.shape), q.dtype if splits == 1 else jnp.float32)]
    if splits > 1:
        out_shape.append(jax.ShapeDtypeStruct((splits, num_tokens, num_q_heads), jnp.float32))
    outs = pl.pallas_call(
        kernel,
        grid=(num_tokens // block_q + num_slots, num_kv_heads, splits),
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(
            num_warps=sizes.num_warps, num_stages=sizes.num_stages
        ),
        interpret=interpret,
        name="ragged_paged_attention_gpu",
    )(
        kv_lens,
        page_table,
        cu_q_lens,
        num_seqs.reshape(1),
        q,
        kv_pages,
        *(() if kv_scales is None else (kv_scales,)),
    )
    if splits == 1:
        return outs[0][0]
    return _merge_splits(*outs).astype(q.dtype)
