"""The TPU ragged paged attention path (jax's maintained kernel behind `tpu.py`, or the own
kernel for quantized caches) in TPU interpret mode on CPU, against float64, xlaserve's reference
and jax's kernel called directly.

Interpret mode simulates TPU memory spaces, DMAs and semaphores (and detects races) but runs every
grid step through Python callbacks, so the cases are tiny and the parameter space is sampled: each
case below picks one batch kind, GQA ratio, head dim, page size, dtype and masking option, and
together they cover every value of each. Small block sizes (16 query tokens, 2 pages per KV block)
make even tiny batches span several query blocks, several KV blocks and both DMA slots.

Tolerances:
- float32: the kernel accumulates in float32 (online softmax, rescaled partial sums) while the
  oracle is float64 on the same inputs; observed errors are ~1e-6, so 1e-5 leaves headroom
  without hiding a wrong mask (which shows up at ~1e-1).
- bfloat16: the probabilities are rounded to bfloat16 before p @ v (relative 2**-8 each) and the
  output is rounded to bfloat16 (another 2**-8 of |out| <= ~3); observed ~1e-2, allowed 4e-2.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import random
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export
from jax._src.pallas.mosaic.interpret import interpret_pallas_call as tpu_interpreter
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas.ops.tpu import ragged_paged_attention as maintained
from ragged_cases import RaggedCase, dense_attention_oracle, make_case, random_lengths
from tpu_interpret import needs_tpu_interpreter, tpu_interpret_error

from pallas_kernels.ragged_paged_attention import ragged_paged_attention
from pallas_kernels.ragged_paged_attention.reference import ragged_paged_attention_reference
from pallas_kernels.ragged_paged_attention.tpu import (
    check_supported,
    maintained_inputs,
    ragged_paged_attention_tpu,
)
from pallas_kernels.ragged_paged_attention.tuned_block_sizes import (
    TUNED_BLOCK_SIZES,
    BlockSizes,
    get_block_sizes,
)

TOLERANCE = {"float32": 1e-5, "bfloat16": 4e-2}  # atol = rtol; see the module docstring
INTERPRET = pltpu.InterpretParams(detect_races=True)  # uninitialized VMEM is NaN by default


def run_kernel(case: RaggedCase, cache_head_dim: int, **kwargs: object) -> np.ndarray:
    """The kernel on a case, q zero-padded to the cache's head dim as the dispatcher does."""
    pad = cache_head_dim - case.q.shape[-1]
    q = np.pad(case.q, ((0, 0), (0, 0), (0, pad)))
    out = ragged_paged_attention_tpu(
        jnp.asarray(q),
        jnp.asarray(case.kv_pages),
        jnp.asarray(case.kv_lens),
        jnp.asarray(case.page_table),
        jnp.asarray(case.cu_q_lens),
        jnp.asarray(case.num_seqs),
        interpret=INTERPRET,
        **kwargs,
    )
    assert_no_races()
    return np.asarray(out.astype(jnp.float32))


def assert_no_races() -> None:
    races = tpu_interpreter.races  # the race detector's state after the last interpreted call
    assert races is not None and not races.races_found, "the race detector reported a data race"


def poison_unused_page_ids(case: RaggedCase) -> RaggedCase:
    """Page-table entries past each sequence's last page, and the padding sequences' rows, become
    a page id outside the cache: interpret mode raises if the kernel ever DMAs one."""
    table = case.page_table.copy()
    num_pages, page_size = case.kv_pages.shape[:2]
    for s, kv_len in enumerate(case.context_lens):
        table[s, -(-kv_len // page_size) :] = num_pages + 1000
    table[len(case.context_lens) :] = num_pages + 1000
    return dataclasses.replace(case, page_table=table)


def assert_matches_oracle(
    case: RaggedCase, out: np.ndarray, dtype: str, **oracle_kwargs: object
) -> None:
    expected = dense_attention_oracle(case, **oracle_kwargs)
    tol = TOLERANCE[dtype]
    np.testing.assert_allclose(case.real_rows(out), case.real_rows(expected), atol=tol, rtol=tol)


class Case(NamedTuple):
    kind: str  # batch kind for ragged_cases.random_lengths
    num_seqs: int
    max_context: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int  # D of the model; the cache pads it to cache_head_dim lanes
    cache_head_dim: int
    page_size: int
    dtype: str
    sliding_window: int | None
    soft_cap: float | None


CASES = {
    "decode-gqa1-d128-p16-f32": Case("decode", 6, 70, 2, 2, 128, 128, 16, "float32", None, None),
    "prefill-gqa3-d128-p32-bf16-cap": Case(
        "prefill", 3, 24, 3, 1, 128, 128, 32, "bfloat16", None, 20.0
    ),
    "mixed-gqa8-d256-p16-f32-window": Case("mixed", 4, 60, 8, 1, 256, 256, 16, "float32", 13, None),
    "chunked-gqa1-d64pad-p16-bf16-window-cap": Case(
        "chunked", 3, 50, 2, 2, 64, 128, 16, "bfloat16", 20, 5.0
    ),
    "mixed-gqa3-d128-p32-bf16-window": Case(
        "mixed", 4, 90, 6, 2, 128, 128, 32, "bfloat16", 40, None
    ),
    "chunked-gqa8-d64pad-p32-f32-cap": Case(
        "chunked", 3, 80, 8, 1, 64, 128, 32, "float32", None, 8.0
    ),
}


def sampled_cases(count: int, seed: int) -> dict[str, Case]:
    """`count` configurations drawn at random (fixed seed) from the full sweep, on top of the
    hand-picked ones above that cover every value of every axis."""
    heads = [(2, 2), (4, 4), (3, 1), (6, 2), (8, 1), (16, 2)]  # GQA ratios 1, 3, 8
    dims = [(128, 128), (256, 256), (64, 128)]  # (model D, cache D)
    masks = [(None, None), (17, None), (None, 10.0), (33, 30.0)]  # (window, soft cap)
    sweep = list(
        itertools.product(
            ["decode", "prefill", "mixed", "chunked"],
            heads,
            dims,
            [16, 32],
            ["float32", "bfloat16"],
            masks,
        )
    )
    picked = random.Random(seed).sample(sweep, count)
    cases = {}
    for kind, (hq, hkv), (d, dc), page_size, dtype, (window, cap) in picked:
        name = f"sampled-{kind}-hq{hq}-kv{hkv}-d{d}-p{page_size}-{dtype}-w{window}-cap{cap}"
        max_context = 24 if kind == "prefill" else 80
        cases[name] = Case(kind, 3, max_context, hq, hkv, d, dc, page_size, dtype, window, cap)
    return cases


CASES |= sampled_cases(count=6, seed=2026)


@needs_tpu_interpreter()
@pytest.mark.parametrize("name", list(CASES))
def test_matches_dense_oracle(name: str) -> None:
    c = CASES[name]
    rng = np.random.default_rng(sum(map(ord, name)))
    q_lens, kv_lens = random_lengths(rng, c.kind, c.num_seqs, c.max_context)
    case = make_case(
        rng,
        q_lens=q_lens,
        kv_lens=kv_lens,
        num_q_heads=c.num_q_heads,
        num_kv_heads=c.num_kv_heads,
        head_dim=c.head_dim,
        page_size=c.page_size,
        dtype=jnp.dtype(c.dtype),
        pad_tokens=5,
        pad_seqs=1,
        pages_per_seq=max(kv_lens) // c.page_size + 2,  # table entries past the last page
        cache_head_dim=c.cache_head_dim,
    )
    case = poison_unused_page_ids(case)
    sm_scale = c.head_dim**-0.5
    out = run_kernel(
        case,
        c.cache_head_dim,
        sm_scale=sm_scale,
        sliding_window=c.sliding_window,
        logit_soft_cap=c.soft_cap,
        num_queries_per_block=16,
        num_kv_pages_per_block=2,
    )
    assert_matches_oracle(
        case, out, c.dtype, sm_scale=sm_scale, sliding_window=c.sliding_window, soft_cap=c.soft_cap
    )


class Model(NamedTuple):
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    kind: str
    sliding_window: int | None = None
    soft_cap: float | None = None


MODELS = {
    "llama3-8b-bf16-mixed": Model(32, 8, 128, "bfloat16", "mixed"),
    "llama3-8b-f32-decode-cap": Model(32, 8, 128, "float32", "decode", soft_cap=30.0),
    "gemma3-270m-bf16-window": Model(4, 1, 256, "bfloat16", "chunked", sliding_window=24),
    "gemma3-270m-f32-prefill-window-cap": Model(4, 1, 256, "float32", "prefill", 16, 20.0),
}


@needs_tpu_interpreter()
@pytest.mark.parametrize("name", list(MODELS))
def test_model_heads_match_reference_and_maintained_kernel(name: str) -> None:
    """Real models' head shapes: the TPU path equals the float64 oracle, xlaserve's reference,
    and jax's kernel called directly (page table and lengths unshifted) in interpret mode."""
    m = MODELS[name]
    rng = np.random.default_rng(sum(map(ord, name)))
    q_lens, kv_lens = random_lengths(rng, m.kind, 3, 24 if m.kind == "prefill" else 70)
    case = make_case(
        rng,
        q_lens=q_lens,
        kv_lens=kv_lens,
        num_q_heads=m.num_q_heads,
        num_kv_heads=m.num_kv_heads,
        head_dim=m.head_dim,
        page_size=16,
        dtype=jnp.dtype(m.dtype),
        pad_tokens=3,
        pad_seqs=1,
        pages_per_seq=max(kv_lens) // 16 + 2,
    )
    case = poison_unused_page_ids(case)
    options = dict(sm_scale=m.head_dim**-0.5, sliding_window=m.sliding_window)
    blocks = dict(num_queries_per_block=16, num_kv_pages_per_block=2)
    out = run_kernel(case, m.head_dim, logit_soft_cap=m.soft_cap, **options, **blocks)
    assert_matches_oracle(case, out, m.dtype, soft_cap=m.soft_cap, **options)
    arrays = [
        jnp.asarray(x)
        for x in (case.q, case.kv_pages, case.kv_lens, case.page_table, case.cu_q_lens)
    ]
    reference = ragged_paged_attention_reference(
        *arrays, jnp.asarray(case.num_seqs), logit_soft_cap=m.soft_cap, **options
    )
    tol = TOLERANCE[m.dtype]
    np.testing.assert_allclose(case.real_rows(out), case.real_rows(reference), atol=tol, rtol=tol)
    with pltpu.force_tpu_interpret_mode(INTERPRET):
        direct = maintained.ragged_paged_attention(
            *arrays, jnp.asarray(case.num_seqs).reshape(1), soft_cap=m.soft_cap, **options, **blocks
        )
    # The same kernel; with a window the shifted walk sums the same keys in other blocks.
    same = 1e-6 if m.dtype == "float32" else 8e-3
    np.testing.assert_allclose(case.real_rows(out), case.real_rows(direct), atol=same, rtol=same)


@needs_tpu_interpreter()
def test_hand_computed_decode() -> None:
    # One sequence, one head, context of 2 tokens, decoding the second (position 1).
    # q = e0, k0 = 0, k1 = ln(3) e0, sm_scale 1: scores (0, ln 3), softmax (1/4, 3/4).
    # v0 = 4 e1, v1 = 8 e2: out = 1/4 * 4 e1 + 3/4 * 8 e2 = e1 + 6 e2.
    d, page_size = 128, 16
    q = np.full((8, 1, d), np.nan, np.float32)  # rows 1.. are padding
    q[0, 0] = 0.0
    q[0, 0, 0] = 1.0
    kv_pages = np.full((3, page_size, 2, d), np.nan, np.float32)
    kv_pages[1, :2] = 0.0
    kv_pages[1, 1, 0, 0] = np.log(3.0)  # k1
    kv_pages[1, 0, 1, 1] = 4.0  # v0
    kv_pages[1, 1, 1, 2] = 8.0  # v1
    out = ragged_paged_attention_tpu(
        jnp.asarray(q),
        jnp.asarray(kv_pages),
        jnp.array([2], jnp.int32),
        jnp.array([[1, 0]], jnp.int32),
        jnp.array([0, 1], jnp.int32),
        jnp.array(1, jnp.int32),
        sm_scale=1.0,
        interpret=INTERPRET,
    )
    expected = np.zeros(d, np.float32)
    expected[1], expected[2] = 1.0, 6.0
    np.testing.assert_allclose(np.asarray(out)[0, 0], expected, atol=1e-6)


@needs_tpu_interpreter()
def test_dispatch_pads_head_dim_and_runs_the_kernel() -> None:
    """The public entry point with impl="tpu": q of head dim 64 padded to the cache's 128 lanes,
    default (tuned-table) block sizes, a mixed batch with a sliding window."""
    rng = np.random.default_rng(7)
    q_lens, kv_lens = random_lengths(rng, "mixed", 4, 60)
    case = make_case(
        rng,
        q_lens=q_lens,
        kv_lens=kv_lens,
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=64,
        page_size=16,
        pad_tokens=3,
        pad_seqs=1,
        cache_head_dim=128,
    )
    case = poison_unused_page_ids(case)
    with pltpu.force_tpu_interpret_mode(INTERPRET):
        out = ragged_paged_attention(
            jnp.asarray(case.q),
            jnp.asarray(case.kv_pages),
            jnp.asarray(case.kv_lens),
            jnp.asarray(case.page_table),
            jnp.asarray(case.cu_q_lens),
            jnp.asarray(case.num_seqs),
            sm_scale=0.125,
            sliding_window=24,
            impl="tpu",
        )
    assert_no_races()
    assert out.shape == case.q.shape
    assert_matches_oracle(case, np.asarray(out), "float32", sm_scale=0.125, sliding_window=24)


@needs_tpu_interpreter()
def test_empty_batch_runs() -> None:
    """num_seqs == 0: every row is padding (output unspecified); the kernel must not fault,
    hang or race on the garbage lengths and page ids."""
    rng = np.random.default_rng(3)
    case = make_case(
        rng,
        q_lens=[2],
        kv_lens=[5],
        num_q_heads=2,
        num_kv_heads=1,
        head_dim=128,
        page_size=16,
        pad_tokens=6,
        pad_seqs=2,
    )
    case = poison_unused_page_ids(dataclasses.replace(case, num_seqs=np.array(0, np.int32)))
    out = run_kernel(case, 128, sm_scale=1.0, num_queries_per_block=8)
    assert out.shape == case.q.shape


def test_block_size_table_falls_back_to_a_default() -> None:
    assert (
        get_block_sizes("v6e", "bfloat16", 128, 16)
        == TUNED_BLOCK_SIZES[("v6e", "bfloat16", 128, 16)]
    )
    assert get_block_sizes(None, "float32", 128, 32) == BlockSizes(32, 4)  # CPU: 128 tokens
    assert get_block_sizes("v99", "bfloat16", 128, 256) == BlockSizes(32, 1)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((jnp.float32, 64, 16, 8, 2), "head_dim=64"),
        ((jnp.bfloat16, 128, 8, 8, 2), "page_size=8"),
        ((jnp.float32, 128, 16, 6, 4), "num_q_heads=6"),
        ((jnp.int8, 128, 32, 8, 2), "q_dtype"),
        ((jnp.bfloat16, 128, 16, 9, 3), "3 KV heads"),  # SmolLM2: 6 combined heads
    ],
)
def test_check_supported_names_the_combination(args: tuple, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_supported(*args)
    check_supported(jnp.bfloat16, 128, 16, 32, 8)  # Llama-3-8B
    check_supported(jnp.bfloat16, 256, 16, 4, 1)  # Gemma 3 270M


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(cu_q_lens=jnp.zeros((2,), jnp.int32)), r"cu_q_lens.shape=\(2,\) must be \(3,\)"),
        (dict(page_table=jnp.zeros((3, 4), jnp.int32)), r"page_table.shape=\(3, 4\) must be"),
        (dict(kv_pages=jnp.zeros((4, 16, 4, 256))), r"kv_pages.shape=.* must be .* with D = 128"),
        (dict(num_seqs=jnp.zeros((1,), jnp.int32)), r"num_seqs.shape=\(1,\) must be \(\)"),
        (dict(page_table=jnp.zeros((2, 70000), jnp.int32)), r"page table i32\[2, 70000\].*SMEM"),
        (dict(sliding_window=0), "sliding_window=0 must be positive"),
    ],
)
def test_rejects_bad_inputs_with_a_message(change: dict, message: str) -> None:
    args = dict(
        q=jnp.zeros((16, 4, 128), jnp.float32),
        kv_pages=jnp.zeros((4, 16, 4, 128), jnp.float32),
        kv_lens=jnp.zeros((2,), jnp.int32),
        page_table=jnp.zeros((2, 3), jnp.int32),
        cu_q_lens=jnp.zeros((3,), jnp.int32),
        num_seqs=jnp.int32(1),
        sm_scale=1.0,
    )
    with pytest.raises(ValueError, match=message):
        ragged_paged_attention_tpu(**(args | change))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_exports_for_tpu(dtype: jnp.dtype) -> None:
    """Lowers through Pallas to Mosaic for TPU on this CPU-only machine (a Llama-like bucket)."""
    num_tokens, num_q_heads, num_kv_heads, d, page_size = 128, 16, 4, 128, 16
    num_seqs, pages_per_seq, num_pages = 8, 32, 256
    args = (
        jax.ShapeDtypeStruct((num_tokens, num_q_heads, d), dtype),
        jax.ShapeDtypeStruct((num_pages, page_size, 2 * num_kv_heads, d), dtype),
        jax.ShapeDtypeStruct((num_seqs,), jnp.int32),
        jax.ShapeDtypeStruct((num_seqs, pages_per_seq), jnp.int32),
        jax.ShapeDtypeStruct((num_seqs + 1,), jnp.int32),
        jax.ShapeDtypeStruct((), jnp.int32),
    )
    kernel = functools.partial(
        ragged_paged_attention_tpu, sm_scale=d**-0.5, sliding_window=512, logit_soft_cap=30.0
    )
    exported = export.export(jax.jit(kernel), platforms=["tpu"])(*args)
    assert exported.platforms == ("tpu",)
    assert "tpu_custom_call" in exported.mlir_module()
    assert exported.out_avals[0].shape == (num_tokens, num_q_heads, d)


def release_behind_window(case: RaggedCase, window: int) -> RaggedCase:
    """What the engine does when every layer is local: pages wholly behind each sequence's first
    query's window are freed (here: NaN-filled) and their page-table entries become -1."""
    pages, table = case.kv_pages.copy(), case.page_table.copy()
    page_size = pages.shape[1]
    for s, (q_len, kv_len) in enumerate(zip(case.q_lens, case.context_lens, strict=True)):
        behind = max(kv_len - q_len - window + 1, 0) // page_size
        pages[table[s, :behind]] = np.nan
        table[s, :behind] = -1
    return dataclasses.replace(case, kv_pages=pages, page_table=table)


# Sampled (jax's reference runs eagerly, ~10 s a case): every dtype, window, soft cap, a padded
# head dim, and Llama-3-8B's and Gemma 3's heads.
WRAPPER_CASES = {
    "llama3-8b-bf16-mixed": Case("mixed", 3, 40, 32, 8, 128, 128, 16, "bfloat16", None, None),
    "gemma3-f32-decode-window-cap": Case("decode", 4, 90, 4, 1, 256, 256, 16, "float32", 16, 20.0),
    "gqa1-d64pad-p32-bf16-chunked-window": Case(
        "chunked", 3, 200, 2, 2, 64, 128, 32, "bfloat16", 20, None
    ),
}


@pytest.mark.parametrize("name", list(WRAPPER_CASES))
def test_wrapper_inputs_through_the_maintained_reference(name: str) -> None:
    """What `tpu.py` hands jax's kernel (lengths and page table cut behind the window) gives the
    float64 oracle under jax's own pure-jnp reference of that kernel (the same semantics: causal
    and window masks, soft cap), with pages behind the window released as the engine does."""
    c = WRAPPER_CASES[name]
    rng = np.random.default_rng(sum(map(ord, name)))
    q_lens, kv_lens = random_lengths(rng, c.kind, c.num_seqs, c.max_context)
    case = make_case(
        rng,
        q_lens=q_lens,
        kv_lens=kv_lens,
        num_q_heads=c.num_q_heads,
        num_kv_heads=c.num_kv_heads,
        head_dim=c.head_dim,
        page_size=c.page_size,
        dtype=jnp.dtype(c.dtype),
        pad_tokens=5,
        pad_seqs=1,
        pages_per_seq=max(kv_lens) // c.page_size + 2,
        cache_head_dim=c.cache_head_dim,
    )
    if c.sliding_window is not None:
        released = release_behind_window(case, c.sliding_window)
        assert np.sum(released.page_table == -1) > np.sum(case.page_table == -1)
        case = released
    kv_lens_in, table, num_seqs = maintained_inputs(
        jnp.asarray(case.kv_lens),
        jnp.asarray(case.page_table),
        jnp.asarray(case.cu_q_lens),
        jnp.asarray(case.num_seqs),
        c.sliding_window,
        c.page_size,
    )
    sm_scale = c.head_dim**-0.5
    q = np.pad(case.q, ((0, 0), (0, 0), (0, c.cache_head_dim - c.head_dim)))  # as dispatched
    out = maintained.ref_ragged_paged_attention(
        jnp.asarray(q),
        jnp.asarray(case.kv_pages),
        kv_lens_in,
        table,
        jnp.asarray(case.cu_q_lens),
        num_seqs,
        sm_scale=sm_scale,
        sliding_window=c.sliding_window,
        soft_cap=c.soft_cap,
    )  # only the real rows
    assert out.shape[0] == case.num_tokens
    want = dense_attention_oracle(case, sm_scale, c.sliding_window, c.soft_cap)
    tol = TOLERANCE[c.dtype]
    np.testing.assert_allclose(case.real_rows(out), case.real_rows(want), atol=tol, rtol=tol)


def test_interpreter_probe_is_not_hiding_a_wrapper_bug() -> None:
    """The float TPU tests may skip only for the known limit of jax 0.10's interpreter."""
    error = tpu_interpret_error()
    if jax.__version_info__ < (0, 11):
        assert error is None or "ReshapeTransform" in error, error
