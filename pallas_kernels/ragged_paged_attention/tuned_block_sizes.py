"""Block sizes of xlaserve's own TPU kernel (`tpu_quantized.py`, quantized caches), by chip, dtype,
head dim and page size. Float caches run jax's maintained kernel, with jax's measured table
(`jax.experimental.pallas.ops.tpu.ragged_paged_attention.tuned_block_sizes`; see `tpu_plan`).

A block size pair is (query tokens per query block, KV pages per KV block). The kernel keeps two KV
blocks (double buffer), one query block, one output block and float32 accumulators in VMEM, so
the KV block is sized to about 256 tokens on chips with 16 MiB of scoped VMEM (v5e) and 512 on
chips with more (v5p, v6e), with fewer tokens for 256-wide heads; the kernel shrinks them further
when many heads would overflow its VMEM budgets.

These entries are starting points derived from VMEM budgets, not yet measured on hardware; a
benchmark sweep (bench/) should overwrite them. Chips that are not listed, and CPU (interpret mode,
export), get `DEFAULT_TOKENS_PER_KV_BLOCK` / `DEFAULT_QUERIES_PER_BLOCK`, which fit every chip.
"""

from __future__ import annotations

from typing import NamedTuple


class BlockSizes(NamedTuple):
    num_queries_per_block: int
    num_kv_pages_per_block: int


# (chip generation as pltpu.ChipVersion prints it, dtype name, head_dim, page_size) -> sizes.
TUNED_BLOCK_SIZES: dict[tuple[str, str, int, int], BlockSizes] = {
    ("v5e", "bfloat16", 128, 16): BlockSizes(32, 16),
    ("v5e", "bfloat16", 128, 32): BlockSizes(32, 8),
    ("v5e", "bfloat16", 256, 16): BlockSizes(32, 8),
    ("v5e", "bfloat16", 256, 32): BlockSizes(32, 4),
    ("v5e", "float32", 128, 16): BlockSizes(32, 8),
    ("v5e", "float32", 128, 32): BlockSizes(32, 4),
    ("v5p", "bfloat16", 128, 16): BlockSizes(64, 32),
    ("v5p", "bfloat16", 128, 32): BlockSizes(64, 16),
    ("v5p", "bfloat16", 256, 16): BlockSizes(32, 16),
    ("v5p", "bfloat16", 256, 32): BlockSizes(32, 8),
    ("v6e", "bfloat16", 128, 16): BlockSizes(64, 32),
    ("v6e", "bfloat16", 128, 32): BlockSizes(64, 16),
    ("v6e", "bfloat16", 256, 16): BlockSizes(32, 16),
    ("v6e", "bfloat16", 256, 32): BlockSizes(32, 8),
}

DEFAULT_QUERIES_PER_BLOCK = 32
DEFAULT_TOKENS_PER_KV_BLOCK = 128


def get_block_sizes(chip: str | None, dtype: str, head_dim: int, page_size: int) -> BlockSizes:
    """The tuned sizes for this configuration, else the default (chip None: not a TPU)."""
    tuned = TUNED_BLOCK_SIZES.get((chip or "", dtype, head_dim, page_size))
    if tuned is not None:
        return tuned
    return BlockSizes(DEFAULT_QUERIES_PER_BLOCK, max(1, DEFAULT_TOKENS_PER_KV_BLOCK // page_size))
