"""The Mosaic rules the TPU attention path obeys, as plain functions of static shapes.

jax's maintained ragged paged attention kernel (`tpu.py` calls it) leaves three things to its
caller that decide whether it compiles and runs on a chip; each is one function here, tested on
CPU against a case that breaks it:

- Head tiling (`head_blocks`): the kernel copies K/V pages with the combined-head axis (2*Hkv,
  the cache's second-minor axis) whole or in blocks, and reads K and V out of VMEM with a strided
  load through a 32-bit view. That needs 2*Hkv / packing (packing = values per 32-bit word: 1 for
  float32, 2 for bfloat16, 4 for int8/fp8) to be 1, 2, 4, 8 or a multiple of 8, a layout XLA can
  tile fully. jax raises "Not implemented" deep inside tracing otherwise; here the engine's
  start-up (warm-up compiles every bucket) refuses it with the shapes and the way out named.
  SmolLM2 (3 KV heads: 6 combined) is refused in float32 and bfloat16. Padding the cache to 4 KV
  heads would make it tile at 4/3 of the KV bytes and VMEM, and needs the engine to pass the
  model's true KV head count down (q's head count alone cannot tell a padded cache from GQA); not
  done, see the module docstring of `tpu.py`.
- Page table in SMEM (`smem_bytes`): kv_lens, the page table i32[S, P] and cu_q_lens are scalar
  prefetch operands, held in SMEM (1 MiB per core on v4..v7, 16 KiB on v2/v3) for the whole
  kernel. The estimate rounds each array's last dim up to 128 words (how Mosaic lays out a 2-D
  SMEM array, conservatively) and must stay under half of SMEM: Mosaic keeps its own scalars
  there too. Past it: fewer sequences (max_num_seqs), a shorter max_model_len, or larger pages.
- VMEM (`vmem_bytes`, `plan`): the kernel's VMEM at once -- q and output blocks (double-buffered
  by the pipeline), the KV double buffer, the float32 accumulator and row statistics, and the
  score temporaries of one KV head -- must fit the scoped VMEM limit, which is passed explicitly
  (`vmem_limit_bytes`, 3/4 of the chip's VMEM) rather than left at Mosaic's default (16 or 32 MiB
  by chip). Block sizes start from jax's tuned table on a TPU (or the defaults below elsewhere:
  CPU interpret mode and export) and are halved, KV pages first, until the estimate fits.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import DTypeLike

LANES = 128
SUBLANES = 8
# Smallest per-core VMEM and SMEM of a chip the maintained kernel runs on (v4: 16 MiB VMEM); used
# when no TPU is attached (interpret mode, export), so the plan is legal on every such chip.
DEFAULT_VMEM_CAPACITY = 16 << 20
DEFAULT_SMEM_CAPACITY = 1 << 20
VMEM_LIMIT_FRACTION = 0.75  # of the chip's VMEM, passed as vmem_limit_bytes
SMEM_FRACTION = 0.5  # of the chip's SMEM, for the scalar-prefetch operands
# Block sizes without a TPU (interpret mode, export): jax's defaults for v4, the chip with least
# VMEM, in query tokens and KV tokens (whole pages) per block.
DEFAULT_QUERIES_PER_BLOCK = 32
DEFAULT_KV_TOKENS_PER_BLOCK = 512


def packing(dtype: DTypeLike) -> int:
    """Values per 32-bit word: 1 for float32, 2 for bfloat16, 4 for int8 and float8."""
    return 4 // np.dtype(dtype).itemsize


def _fully_tiled(count: int, pack: int) -> bool:
    """Whether `count` rows of a `pack`-packed type fill whole XLA tiles (second-minor axis)."""
    if count % pack:
        return False
    words = count // pack
    return words in (1, 2, 4, 8) or words % 8 == 0


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


@dataclass(frozen=True)
class HeadBlocks:
    """Heads one grid step of the kernel covers (the kernel walks Hq / q_heads such steps)."""

    q_heads: int
    combined_kv_heads: int  # 2 * KV heads


def head_blocks(
    num_q_heads: int, num_kv_heads: int, q_dtype: DTypeLike, kv_dtype: DTypeLike
) -> HeadBlocks:
    """The head blocking of jax's kernel (`get_min_heads_per_blk`), or a ValueError naming the
    shapes that cannot be tiled and what to do instead."""
    combined = 2 * num_kv_heads
    if num_kv_heads <= 0 or num_q_heads % num_kv_heads:
        raise ValueError(f"tpu: {num_q_heads=} must be a positive multiple of {num_kv_heads=}")
    kv_pack = packing(kv_dtype)
    if not _fully_tiled(combined, kv_pack):
        raise ValueError(
            f"tpu: {num_kv_heads} KV heads ({combined} combined K/V heads) of "
            f"{np.dtype(kv_dtype).name} cannot be tiled by Mosaic: 2*Hkv / {kv_pack} values per "
            f"32-bit word must be 1, 2, 4, 8 or a multiple of 8. Run this model on CPU or GPU, "
            f"or with a cache dtype whose packing divides {combined}"
        )
    group = num_q_heads // num_kv_heads
    widest = SUBLANES * kv_pack  # one full sublane tile of combined heads
    kv_block = widest if combined % widest == 0 else combined
    if _fully_tiled(kv_block // 2 * group, packing(q_dtype)):
        return HeadBlocks(kv_block // 2 * group, kv_block)
    return HeadBlocks(num_q_heads, combined)


def smem_bytes(num_seqs: int, pages_per_seq: int) -> int:
    """SMEM of the scalar-prefetch operands: kv_lens i32[S], page table i32[S, P], cu_q_lens
    i32[S+1], two loop-state words and num_seqs, each row rounded up to 128 words."""
    rows = (
        _round_up(num_seqs, LANES)
        + _round_up(num_seqs, SUBLANES) * _round_up(pages_per_seq, LANES)
        + _round_up(num_seqs + 1, LANES)
        + 2 * LANES
    )
    return 4 * rows


def check_smem(num_seqs: int, pages_per_seq: int, smem_capacity: int) -> None:
    """Raises ValueError if the page table and lengths would not fit the SMEM budget."""
    need, budget = smem_bytes(num_seqs, pages_per_seq), int(smem_capacity * SMEM_FRACTION)
    if need > budget:
        raise ValueError(
            f"tpu: the page table i32[{num_seqs}, {pages_per_seq}] and lengths need {need} bytes "
            f"of SMEM, over the {budget} the kernel may use; lower max_num_seqs or max_model_len, "
            f"or raise page_size"
        )


@dataclass(frozen=True)
class KernelShape:
    """The static shapes a plan depends on."""

    num_tokens: int  # T
    num_q_heads: int  # Hq
    num_kv_heads: int  # Hkv
    head_dim: int  # D, a multiple of 128
    page_size: int
    pages_per_seq: int  # P
    q_dtype: str
    kv_dtype: str

    @property
    def group(self) -> int:
        return self.num_q_heads // self.num_kv_heads


def vmem_bytes(shape: KernelShape, heads: HeadBlocks, queries: int, kv_pages: int) -> int:
    """VMEM the kernel holds at once for these block sizes (a conservative estimate)."""
    q_size, kv_size = np.dtype(shape.q_dtype).itemsize, np.dtype(shape.kv_dtype).itemsize
    d, kv_tokens = shape.head_dim, kv_pages * shape.page_size
    q_heads = _round_up(heads.q_heads, SUBLANES * packing(shape.q_dtype))
    rows = _round_up(queries * shape.group, SUBLANES)  # score rows per KV head
    q_and_out = 2 * 2 * queries * q_heads * d * q_size  # both double-buffered
    kv_buffer = (
        2
        * kv_tokens
        * _round_up(heads.combined_kv_heads, SUBLANES * packing(shape.kv_dtype))
        * d
        * kv_size
    )
    accumulator = queries * _round_up(heads.q_heads, SUBLANES) * d * 4
    row_stats = 2 * (heads.combined_kv_heads // 2) * rows * LANES * 4  # m and l
    # One KV head at a time: scores, probabilities and two int32 masks [rows, kv_tokens], its
    # K and V widened to f32, and the folded q.
    temporaries = 4 * rows * kv_tokens * 4 + 2 * kv_tokens * d * 4 + rows * d * 4
    return q_and_out + kv_buffer + accumulator + row_stats + temporaries


@dataclass(frozen=True)
class KernelPlan:
    """Everything `tpu.py` passes to jax's kernel besides the arrays."""

    heads: HeadBlocks
    num_queries_per_block: int
    num_kv_pages_per_block: int
    vmem_limit_bytes: int
    vmem_estimate_bytes: int


def default_block_sizes(shape: KernelShape) -> tuple[int, int]:
    """(queries, KV pages) per block without a TPU's tuned table."""
    pages = max(1, DEFAULT_KV_TOKENS_PER_BLOCK // shape.page_size)
    return DEFAULT_QUERIES_PER_BLOCK, pages


def plan(
    shape: KernelShape,
    *,
    start: tuple[int, int],
    vmem_capacity: int,
    fixed_queries: bool = False,
    fixed_kv_pages: bool = False,
) -> KernelPlan:
    """Block sizes from `start` (queries, KV pages per block), capped by T and P, halved (KV
    pages first) until the VMEM estimate fits the limit; sizes the caller fixed are not halved.

    Raises:
      ValueError: the smallest allowed blocks still exceed the limit.
    """
    heads = head_blocks(shape.num_q_heads, shape.num_kv_heads, shape.q_dtype, shape.kv_dtype)
    limit = int(vmem_capacity * VMEM_LIMIT_FRACTION)
    queries = max(1, min(start[0], shape.num_tokens))
    kv_pages = max(1, min(start[1], shape.pages_per_seq))
    while (need := vmem_bytes(shape, heads, queries, kv_pages)) > limit:
        if kv_pages > 1 and not fixed_kv_pages:
            kv_pages //= 2
        elif queries > SUBLANES and not fixed_queries:
            queries //= 2
        else:
            raise ValueError(
                f"tpu: attention blocks of {queries} queries x {kv_pages} pages of {shape} need "
                f"~{need} bytes of VMEM, over the {limit}-byte limit"
            )
    return KernelPlan(heads, queries, kv_pages, limit, need)
