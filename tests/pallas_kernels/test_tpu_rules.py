"""One test per Mosaic rule the TPU path depends on (`tpu_plan`); each fails when its rule is
broken. Pure shape arithmetic plus a few traces and TPU exports: no kernel runs.

- Head tiling: `head_blocks` must accept exactly the head counts jax's maintained kernel can
  tile (its own `get_min_heads_per_blk` is the oracle) and block them the same way, and the
  public entry point must refuse SmolLM2's 3 KV heads before Mosaic sees them.
- Page table in SMEM: a table over the budget is refused (sizes computed by hand below).
- VMEM: the plan's estimate stays under the limit it passes, the estimate covers every buffer
  the maintained kernel allocates (read from its traced pallas_call), and the limit is the one
  in the exported TPU custom call.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export
from jax.experimental.pallas.ops.tpu.ragged_paged_attention import kernel as maintained_kernel

from pallas_kernels.ragged_paged_attention import ragged_paged_attention, tpu_plan
from pallas_kernels.ragged_paged_attention.tpu import ragged_paged_attention_tpu

HEADS = [(1, 1), (2, 1), (4, 1), (9, 3), (6, 3), (12, 4), (8, 2), (32, 8), (12, 6), (16, 16)]
HEADS += [(40, 10), (64, 8), (10, 5), (24, 12), (32, 16), (28, 4), (14, 2), (64, 32)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(("num_q_heads", "num_kv_heads"), HEADS)
def test_head_tiling_agrees_with_the_maintained_kernel(
    num_q_heads: int, num_kv_heads: int, dtype: str
) -> None:
    try:
        want = maintained_kernel.get_min_heads_per_blk(
            num_q_heads, 2 * num_kv_heads, jnp.dtype(dtype), jnp.dtype(dtype)
        )
    except ValueError:
        with pytest.raises(ValueError, match="cannot be tiled by Mosaic"):
            tpu_plan.head_blocks(num_q_heads, num_kv_heads, dtype, dtype)
        return
    assert tpu_plan.head_blocks(num_q_heads, num_kv_heads, dtype, dtype) == tpu_plan.HeadBlocks(
        *want
    )


def _abstract_call(
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: object,
    *,
    seqs: int = 4,
    pages_per_seq: int = 8,
    page_size: int = 16,
    impl: str = "tpu",
) -> jax.ShapeDtypeStruct:
    """The public entry point traced (not run) on abstract arrays of these shapes."""
    args = (
        jax.ShapeDtypeStruct((32, num_q_heads, head_dim), dtype),
        jax.ShapeDtypeStruct((64, page_size, 2 * num_kv_heads, 128), dtype),
        jax.ShapeDtypeStruct((seqs,), jnp.int32),
        jax.ShapeDtypeStruct((seqs, pages_per_seq), jnp.int32),
        jax.ShapeDtypeStruct((seqs + 1,), jnp.int32),
        jax.ShapeDtypeStruct((), jnp.int32),
    )
    fn = functools.partial(ragged_paged_attention, sm_scale=0.1, impl=impl)
    return jax.eval_shape(fn, *args)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_smollm2_heads_are_refused_before_mosaic(dtype: object) -> None:
    # SmolLM2-135M: 9 query heads, 3 KV heads (6 combined: 6 f32 words, 3 bf16 words), D = 64.
    with pytest.raises(ValueError, match=r"3 KV heads \(6 combined K/V heads\).* cannot be tiled"):
        _abstract_call(9, 3, 64, dtype)
    _abstract_call(9, 3, 64, dtype, impl="reference")  # the same shapes are fine elsewhere
    _abstract_call(32, 8, 128, dtype)  # Llama-3-8B
    _abstract_call(4, 1, 128, dtype)  # Gemma 3 270M's heads (D 256 there)


def test_page_table_smem_budget() -> None:
    # 256 sequences x 512 pages: kv_lens 256 words, the table 256 x 512, cu_q_lens 257 -> 384,
    # two rows of loop state: 4 * (256 + 131072 + 384 + 256) = 527872 bytes > 1 MiB / 2.
    assert tpu_plan.smem_bytes(256, 512) == 527872
    with pytest.raises(ValueError, match=r"page table i32\[256, 512\].*SMEM"):
        tpu_plan.check_smem(256, 512, 1 << 20)
    tpu_plan.check_smem(256, 256, 1 << 20)  # 4 * (256 + 65536 + 384 + 256) = 265728 bytes
    with pytest.raises(ValueError, match="SMEM"):  # and the entry point refuses it
        _abstract_call(32, 8, 128, jnp.bfloat16, seqs=256, pages_per_seq=512)


def _shape(hq: int, hkv: int, d: int, dtype: str, tokens: int = 512, pages: int = 512):
    return tpu_plan.KernelShape(tokens, hq, hkv, d, 16, pages, dtype, dtype)


SHAPES = {
    "llama3-8b-bf16": _shape(32, 8, 128, "bfloat16"),
    "llama3-8b-f32": _shape(32, 8, 128, "float32"),
    "gemma3-bf16": _shape(4, 1, 256, "bfloat16"),
    "gqa8-d256-f32-long": _shape(64, 8, 256, "float32", tokens=4096, pages=2048),
    "decode-bucket": _shape(32, 8, 128, "bfloat16", tokens=8, pages=64),
}


@pytest.mark.parametrize("name", list(SHAPES))
@pytest.mark.parametrize("vmem", [16 << 20, 128 << 20])
def test_vmem_estimate_under_the_limit_passed(name: str, vmem: int) -> None:
    # Start from blocks far too large for 16 MiB (128 queries x 128 pages = 2048 keys).
    plan = tpu_plan.plan(SHAPES[name], start=(128, 128), vmem_capacity=vmem)
    assert plan.vmem_limit_bytes == int(vmem * 0.75)
    assert plan.vmem_estimate_bytes <= plan.vmem_limit_bytes


def test_blocks_fixed_too_large_are_refused() -> None:
    with pytest.raises(ValueError, match="VMEM"):
        tpu_plan.plan(
            SHAPES["llama3-8b-f32"], start=(64, 512), vmem_capacity=16 << 20, fixed_kv_pages=True
        )


def _pallas_calls(jaxpr: jax.extend.core.Jaxpr) -> list[jax.extend.core.JaxprEqn]:
    """The pallas_call equations of a jaxpr, looking inside jit calls."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            found.append(eqn)
        elif eqn.primitive.name in ("pjit", "jit"):
            found += _pallas_calls(eqn.params["jaxpr"].jaxpr)
    return found


def _maintained_kernel_buffers(
    hq: int, hkv: int, d: int, dtype: object, queries: int, kv_pages: int
) -> int:
    """Bytes of every VMEM buffer jax's kernel allocates (scratch, and q/out blocks twice for
    the pipeline's double buffering), read from its traced pallas_call."""
    num_tokens, page_size, seqs, pages_per_seq = 64, 16, 4, 32
    fn = functools.partial(
        maintained_kernel.ragged_paged_attention,
        num_queries_per_block=queries,
        num_kv_pages_per_block=kv_pages,
    )
    jaxpr = jax.make_jaxpr(fn)(
        jax.ShapeDtypeStruct((num_tokens, hq, d), dtype),
        jax.ShapeDtypeStruct((64, page_size, 2 * hkv, d), dtype),
        jax.ShapeDtypeStruct((seqs,), jnp.int32),
        jax.ShapeDtypeStruct((seqs, pages_per_seq), jnp.int32),
        jax.ShapeDtypeStruct((seqs + 1,), jnp.int32),
        jax.ShapeDtypeStruct((1,), jnp.int32),
    )
    (call,) = _pallas_calls(jaxpr.jaxpr)
    mapping = call.params["grid_mapping"]
    scratch = call.params["jaxpr"].invars[-mapping.num_scratch_operands :]
    total = 0
    for var in scratch:
        aval = var.aval
        if str(aval.memory_space) == "vmem" or "VMEM" in str(aval.memory_space).upper():
            total += int(np.prod(aval.shape)) * jnp.dtype(aval.dtype).itemsize
    for block in mapping.block_mappings:  # q and the output; the cache stays in HBM ("any")
        if str(block.block_aval.memory_space) != "any":
            size = int(np.prod(block.block_aval.shape)) * jnp.dtype(block.array_aval.dtype).itemsize
            total += 2 * size
    return total


@pytest.mark.parametrize(
    ("hq", "hkv", "d", "dtype", "queries", "kv_pages"),
    [(32, 8, 128, "bfloat16", 32, 8), (4, 1, 256, "bfloat16", 16, 4), (8, 2, 128, "float32", 8, 2)],
)
def test_vmem_estimate_covers_the_maintained_kernels_buffers(
    hq: int, hkv: int, d: int, dtype: str, queries: int, kv_pages: int
) -> None:
    shape = tpu_plan.KernelShape(64, hq, hkv, d, 16, 32, dtype, dtype)
    heads = tpu_plan.head_blocks(hq, hkv, dtype, dtype)
    buffers = _maintained_kernel_buffers(hq, hkv, d, jnp.dtype(dtype), queries, kv_pages)
    assert buffers > 0
    assert tpu_plan.vmem_bytes(shape, heads, queries, kv_pages) >= buffers


def test_the_vmem_limit_reaches_the_tpu_custom_call() -> None:
    args = (
        jax.ShapeDtypeStruct((64, 32, 128), jnp.bfloat16),
        jax.ShapeDtypeStruct((256, 16, 16, 128), jnp.bfloat16),
        jax.ShapeDtypeStruct((8,), jnp.int32),
        jax.ShapeDtypeStruct((8, 32), jnp.int32),
        jax.ShapeDtypeStruct((9,), jnp.int32),
        jax.ShapeDtypeStruct((), jnp.int32),
    )
    fn = jax.jit(functools.partial(ragged_paged_attention_tpu, sm_scale=0.1))
    text = export.export(fn, platforms=["tpu"])(*args).mlir_module()
    limits = re.findall(r"size\\22: (\d+)", text) + re.findall(r'"size": (\d+)', text)
    assert limits == [str(int(tpu_plan.DEFAULT_VMEM_CAPACITY * tpu_plan.VMEM_LIMIT_FRACTION))]
