"""The pure-jnp ragged paged attention reference against a dense float64 NumPy oracle.

Batches come from `ragged_cases.make_case`: unused pages, unused slots and padding query rows hold
NaN and page-table padding holds random page ids, so any stray read shows up in the result.
"""

from __future__ import annotations

import functools
import math
import re
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export
from ragged_cases import RaggedCase, dense_attention_oracle, make_case, random_lengths

from pallas_kernels.kv_cache_update import KVCacheSpec, init_kv_pages, write_kv
from pallas_kernels.ragged_paged_attention import ragged_paged_attention
from pallas_kernels.ragged_paged_attention.reference import ragged_paged_attention_reference

# float32: the reference sums in a different order (online softmax over blocks) than the float64
# oracle; with <= 256-wide dot products and <= a few hundred keys the difference is ~1e-6.
# bfloat16: inputs are identical (the oracle uses the same rounded values) and the math is f32, but
# the output is rounded to bf16 (8 significant bits: relative 2^-9) and |out| <= ~3.
TOLERANCE = {jnp.dtype(jnp.float32): 2e-5, jnp.dtype(jnp.bfloat16): 1.5e-2}


def run_reference(case: RaggedCase, **kwargs: object) -> np.ndarray:
    arrays = (case.q, case.kv_pages, case.kv_lens, case.page_table, case.cu_q_lens, case.num_seqs)
    out = ragged_paged_attention_reference(*map(jnp.asarray, arrays), **kwargs)
    assert out.shape == case.q.shape and out.dtype == case.q.dtype
    return np.asarray(out)


def assert_matches_oracle(
    case: RaggedCase, out: np.ndarray, sm_scale: float, window: int | None, cap: float | None
) -> None:
    want = case.real_rows(dense_attention_oracle(case, sm_scale, window, cap))
    got = case.real_rows(out)
    tol = TOLERANCE[jnp.dtype(case.q.dtype)]
    np.testing.assert_allclose(got, want, atol=tol, rtol=tol)


def test_hand_computed_two_keys() -> None:
    # One sequence, one head, D=2, two keys; the query is the second token (position 1).
    # q = [1, 0], k0 = [0, 0], k1 = [ln 3, 0], sm_scale = 1: scores = [0, ln 3],
    # softmax = [1, 3] / 4 = [0.25, 0.75]; v0 = [4, 0], v1 = [0, 8] -> out = [1, 6].
    # The first token (position 0) sees only k0: out = v0 = [4, 0].
    kv = np.full((3, 2, 2, 2), np.nan, np.float32)  # 3 pages of 2 slots; pages 0 and 2 unused
    kv[1, :, 0] = [[0, 0], [np.log(3), 0]]  # K of slots 0 and 1
    kv[1, :, 1] = [[4, 0], [0, 8]]  # V
    q = np.array([[[9, 9]], [[1, 0]]], np.float32)  # row 0 (position 0) q is irrelevant: one key
    out = ragged_paged_attention(
        jnp.asarray(q),
        jnp.asarray(kv),
        jnp.array([2], jnp.int32),
        jnp.array([[1]], jnp.int32),
        jnp.array([0, 2], jnp.int32),
        jnp.int32(1),
        sm_scale=1.0,
        impl="reference",
    )
    np.testing.assert_allclose(np.asarray(out)[:, 0], [[4, 0], [1, 6]], rtol=1e-6)


# (kind, (Hq, Hkv), D, page_size, dtype, sliding_window, soft_cap): a sample of the sweep that
# covers GQA ratios 1, 3, 8, head dims 64/128/256, page sizes 16/32/64, both dtypes, window, cap.
CASES = [
    ("decode", (9, 3), 64, 16, jnp.float32, None, None),
    ("prefill", (4, 4), 128, 32, jnp.float32, None, None),
    ("mixed", (16, 2), 64, 16, jnp.bfloat16, None, None),
    ("chunked", (6, 2), 256, 64, jnp.float32, 24, None),
    ("mixed", (2, 2), 128, 16, jnp.float32, None, 5.0),
    ("mixed", (8, 1), 64, 32, jnp.bfloat16, 40, 30.0),
    ("decode", (8, 1), 128, 16, jnp.bfloat16, 9, None),
    ("chunked", (9, 3), 64, 32, jnp.bfloat16, None, 20.0),
]


@pytest.mark.parametrize(
    ("kind", "heads", "head_dim", "page_size", "dtype", "window", "cap"), CASES
)
def test_matches_dense_oracle(
    kind: str,
    heads: tuple[int, int],
    head_dim: int,
    page_size: int,
    dtype: jnp.dtype,
    window: int | None,
    cap: float | None,
) -> None:
    rng = np.random.default_rng(zlib.crc32(repr((kind, heads, head_dim, page_size)).encode()))
    q_lens, kv_lens = random_lengths(rng, kind, num_seqs=5, max_context=150)
    case = make_case(
        rng,
        q_lens=q_lens,
        kv_lens=kv_lens,
        num_q_heads=heads[0],
        num_kv_heads=heads[1],
        head_dim=head_dim,
        page_size=page_size,
        dtype=dtype,
        pad_tokens=5,
        pad_seqs=2,
        pages_per_seq=-(-max(kv_lens) // page_size) + 2,
    )
    scale = head_dim**-0.5
    # Small blocks, so that sequences span several query blocks and KV blocks.
    out = run_reference(
        case,
        sm_scale=scale,
        sliding_window=window,
        logit_soft_cap=cap,
        q_block=16,
        kv_block=2 * page_size,
        decode_kv_block=page_size,
    )
    assert_matches_oracle(case, out, scale, window, cap)


def test_random_mixes_in_one_bucket() -> None:
    # Fixed T, S, P and pool size (one compilation); what varies is only runtime data: how many
    # sequences, which are decodes, prefills or chunks, their lengths and their page placement.
    rng = np.random.default_rng(2024)
    tokens, seqs, width, page_size = 96, 6, 8, 16
    for _ in range(12):
        num_seqs = int(rng.integers(1, seqs + 1))
        q_lens, kv_lens = random_lengths(rng, "mixed", num_seqs, max_context=width * page_size)
        while sum(q_lens) > tokens:  # keep the batch inside the token bucket
            q_lens, kv_lens = q_lens[:-1], kv_lens[:-1]
        needed = sum(-(-k // page_size) for k in kv_lens)
        case = make_case(
            rng,
            q_lens=q_lens,
            kv_lens=kv_lens,
            num_q_heads=6,
            num_kv_heads=2,
            head_dim=64,
            page_size=page_size,
            pad_tokens=tokens - sum(q_lens),
            pad_seqs=seqs - len(q_lens),
            pages_per_seq=width,
            spare_pages=seqs * width - needed,
        )
        out = run_reference(case, sm_scale=0.125, q_block=32, kv_block=32)
        assert_matches_oracle(case, out, 0.125, None, None)


def test_default_blocks_and_padded_cache_lanes() -> None:
    # The public wrapper pads q from D=64 to the cache's 128 lanes and slices the output back.
    rng = np.random.default_rng(7)
    q_lens, kv_lens = [1, 37, 1, 200], [300, 60, 5, 200]
    case = make_case(
        rng,
        q_lens=q_lens,
        kv_lens=kv_lens,
        num_q_heads=9,
        num_kv_heads=3,
        head_dim=64,
        page_size=16,
        pad_tokens=3,
        pad_seqs=1,
        cache_head_dim=128,
    )
    arrays = (case.q, case.kv_pages, case.kv_lens, case.page_table, case.cu_q_lens, case.num_seqs)
    out = ragged_paged_attention(*map(jnp.asarray, arrays), sm_scale=0.125, impl="reference")
    assert out.shape == case.q.shape
    assert_matches_oracle(case, np.asarray(out), 0.125, None, None)


@pytest.mark.parametrize(
    ("q_lens", "kv_lens"), [([1, 20, 19], [33, 20, 50]), ([1, 30, 9], [33, 30, 9])]
)
def test_query_blocks_that_overhang_the_last_row(q_lens: list[int], kv_lens: list[int]) -> None:
    # No padding rows: T = 40 with 16-row query blocks, so the last sequence's last block
    # overhangs T and is shifted back to rows 24..39. With q_lens [1, 20, 19] it then covers rows
    # 24..36 that its own first block did; with [1, 30, 9] it covers sequence 1's rows 24..30.
    # Either way those rows must keep their values.
    case = make_case(
        np.random.default_rng(5),
        q_lens=q_lens,
        kv_lens=kv_lens,
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=64,
        page_size=16,
    )
    out = run_reference(case, sm_scale=0.125, q_block=16, kv_block=16)
    assert_matches_oracle(case, out, 0.125, None, None)


def test_num_seqs_zero_and_all_padding() -> None:
    rng = np.random.default_rng(3)
    case = make_case(
        rng, q_lens=[4], kv_lens=[9], num_q_heads=2, num_kv_heads=1, head_dim=64, page_size=16
    )
    arrays = (case.q, case.kv_pages, case.kv_lens, case.page_table, case.cu_q_lens)
    out = ragged_paged_attention_reference(
        *map(jnp.asarray, arrays), jnp.int32(0), sm_scale=1.0
    )  # nothing to do: must not fail (rows are unspecified)
    assert out.shape == case.q.shape


def test_sequence_result_does_not_depend_on_batch() -> None:
    # A sequence alone and the same sequence among others (decode and prefill) agree exactly
    # up to float reassociation: the batch only changes which loop handles whom.
    rng = np.random.default_rng(11)
    spec = dict(num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=16)
    alone = make_case(rng, q_lens=[20], kv_lens=[50], **spec)
    out_alone = alone.real_rows(run_reference(alone, sm_scale=0.1))
    mixed = make_case(rng, q_lens=[1, 20, 1], kv_lens=[70, 50, 3], **spec)
    mixed = _replace_sequence(mixed, alone, index=1)
    out_mixed = mixed.real_rows(run_reference(mixed, sm_scale=0.1))
    np.testing.assert_allclose(out_mixed[1:21], out_alone, atol=1e-6, rtol=1e-6)


def _replace_sequence(batch: RaggedCase, single: RaggedCase, index: int) -> RaggedCase:
    """batch with sequence `index`'s queries and K/V replaced by `single`'s only sequence."""
    q = batch.q.copy()
    start = int(batch.cu_q_lens[index])
    q[start : start + single.q_lens[0]] = single.q[: single.q_lens[0]]
    kv = batch.kv_pages.copy()
    k, v = single.k_dense[0], single.v_dense[0]
    page_size = kv.shape[1]
    for j in range(single.context_lens[0]):
        page = batch.page_table[index, j // page_size]
        kv[page, j % page_size, 0::2] = k[j]
        kv[page, j % page_size, 1::2] = v[j]
    return RaggedCase(
        q=q,
        kv_pages=kv,
        kv_lens=batch.kv_lens,
        page_table=batch.page_table,
        cu_q_lens=batch.cu_q_lens,
        num_seqs=batch.num_seqs,
        k_dense=(*batch.k_dense[:index], k, *batch.k_dense[index + 1 :]),
        v_dense=(*batch.v_dense[:index], v, *batch.v_dense[index + 1 :]),
        q_lens=batch.q_lens,
        context_lens=batch.context_lens,
    )


def _attention_layer(
    params: dict[str, jax.Array],
    x: jax.Array,  # f32[T, E]
    kv_pages: jax.Array,  # f32[num_pages, page_size, 2*Hkv, D]
    slot_mapping: jax.Array,  # i32[T]
    kv_lens: jax.Array,  # i32[S]
    page_table: jax.Array,  # i32[S, P]
    cu_q_lens: jax.Array,  # i32[S+1]
    num_seqs: jax.Array,  # i32[]
    *,
    num_q_heads: int,
    num_kv_heads: int,
) -> tuple[jax.Array, jax.Array]:
    tokens = x.shape[0]
    q = (x @ params["wq"]).reshape(tokens, num_q_heads, -1)
    k = (x @ params["wk"]).reshape(tokens, num_kv_heads, -1)
    v = (x @ params["wv"]).reshape(tokens, num_kv_heads, -1)
    kv_pages = write_kv(kv_pages, k, v, slot_mapping)
    attn = ragged_paged_attention(
        q, kv_pages, kv_lens, page_table, cu_q_lens, num_seqs, sm_scale=0.125, impl="reference"
    )
    return attn.reshape(tokens, -1) @ params["wo"], kv_pages


def test_export_attention_layer_for_cpu() -> None:
    # q/k/v projections + write_kv + attention, exported and run from the export: a prefill
    # of 5 tokens for sequence 0 and one decode token for sequence 1 (3 tokens already cached).
    hq, hkv, d, e = 4, 2, 64, 32
    spec = KVCacheSpec(num_pages=8, page_size=4, num_kv_heads=hkv, head_dim=d)
    rng = np.random.default_rng(0)
    params = {
        name: jnp.asarray(rng.standard_normal(shape) * 0.2, jnp.float32)
        for name, shape in {
            "wq": (e, hq * d),
            "wk": (e, hkv * d),
            "wv": (e, hkv * d),
            "wo": (hq * d, e),
        }.items()
    }
    layer = jax.jit(
        functools.partial(_attention_layer, num_q_heads=hq, num_kv_heads=hkv), donate_argnums=2
    )
    args = (
        jnp.asarray(rng.standard_normal((8, e)), jnp.float32),  # 6 real tokens, 2 padding
        init_kv_pages(spec),
        jnp.array([4, 5, 6, 7, 8, 15, -1, -1], jnp.int32),  # seq 0: pages 1, 2; seq 1: page 3
        jnp.array([5, 4, 0], jnp.int32),
        jnp.array([[1, 2], [3, 0], [0, 0]], jnp.int32),
        jnp.array([0, 5, 6, 6], jnp.int32),
        jnp.int32(2),
    )
    exported = export.export(layer, platforms=["cpu"])(
        params, *(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args)
    )
    assert "stablehlo" in exported.mlir_module()  # (serialize() would also need `flatbuffers`)
    want_out, want_kv = layer(params, *(jnp.array(a) for a in args))
    got_out, got_kv = exported.call(params, *args)
    np.testing.assert_allclose(np.asarray(got_out), np.asarray(want_out), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(got_kv), np.asarray(want_kv))
    assert np.isfinite(np.asarray(got_out)[:6]).all()


def _largest_f32_array(page_table_width: int, num_pages: int, dtype: jnp.dtype) -> int:
    """Element count of the largest f32 array in the compiled reference."""
    page_size, tokens, seqs = 16, 32, 8
    shapes = (
        jax.ShapeDtypeStruct((tokens, 4, 64), dtype),
        jax.ShapeDtypeStruct((num_pages, page_size, 4, 64), dtype),
        jax.ShapeDtypeStruct((seqs,), jnp.int32),
        jax.ShapeDtypeStruct((seqs, page_table_width), jnp.int32),
        jax.ShapeDtypeStruct((seqs + 1,), jnp.int32),
        jax.ShapeDtypeStruct((), jnp.int32),
    )
    hlo = ragged_paged_attention_reference.lower(*shapes, sm_scale=1.0).compile().as_text()
    assert hlo is not None
    dims = re.findall(r"f32\[([\d,]*)\]", hlo)
    return max(math.prod(int(d) for d in shape.split(",") if d) for shape in dims)


def test_work_does_not_grow_with_page_table_width() -> None:
    # Only kv_lens bound the loops: widening the page table (max model length 1k -> 64k tokens)
    # must not create any bigger intermediate (no [S, P * page_size] score or gathered K/V).
    assert _largest_f32_array(64, 4, jnp.float32) == _largest_f32_array(4096, 4, jnp.float32)


def test_bf16_cache_is_not_widened_whole() -> None:
    # XLA:CPU upcasts a bf16 gather's operand to f32 and hoists that out of the loop: a copy of
    # the whole page pool per call. The reference gathers the bits instead; guard against it.
    assert _largest_f32_array(64, 4, jnp.bfloat16) == _largest_f32_array(64, 4096, jnp.bfloat16)
