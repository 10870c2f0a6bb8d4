"""The GPU (Pallas Triton) ragged paged attention kernel against the float64 dense oracle.

On CPU the kernel body runs in Pallas's HLO interpret mode (`interpret=True`), which executes the
same masked loads, page-table gathers and online softmax as the GPU build; padding query rows,
unused pages and page table entries past each sequence hold NaN or foreign pages
(`ragged_cases.make_case`), so any stray read shows in the result. `jax.export` for CUDA proves the
kernel lowers to a Triton custom call on this CPU-only machine. `TestOnGpu` reruns the oracle
cases compiled (`interpret=False`) and is skipped unless a GPU is present; on the GPU machine:
`pytest tests/pallas_kernels/test_gpu_kernel.py -k OnGpu`.
"""

from __future__ import annotations

import functools
import math
import re
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export
from ragged_cases import RaggedCase, dense_attention_oracle, make_case, random_lengths

from pallas_kernels.ragged_paged_attention import gpu
from tests.pallas_kernels.gpu_lowering import cuda_lowering_error, needs_cuda_lowering

# f32: the kernel computes in f32 (IEEE dots) from the same f32 inputs the f64 oracle sees; the
# only error is f32 rounding of sums over <= ~100 keys of O(1) terms, ~1e-6 (seen: 6e-7).
F32_TOL = 1e-5
# bf16: q, K, V are bf16 in both. The kernel rounds p to bf16 before p @ V (2^-8 relative per
# weight) and rounds the output to bf16 (2^-8 of |out| <= ~3): ~0.01 at worst (seen: 0.0099).
BF16_TOL = 2e-2
# TF32 (float32_dots="tf32", GPU only): operands rounded to 10 mantissa bits, 2^-11 relative
# each; over q.k of 64..256 O(1) products and the softmax, ~1e-3 at worst.
TF32_TOL = 5e-3


class Sweep(NamedTuple):
    """One sampled configuration; block sizes None take the H100/H200 table's defaults."""

    kind: str  # ragged_cases.random_lengths kind: decode, prefill, chunked or mixed
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    sliding_window: int | None = None
    soft_cap: float | None = None
    dtype: str = "float32"
    block_rows: int | None = 16
    block_kv: int | None = 16
    num_kv_splits: int = 1

    def __str__(self) -> str:
        return "-".join(str(x) for x in self)


# Sampled, not the full product: every kind, GQA ratio (1, 3, 8), head_dim (64, 128, 256), page
# size (16, 32), window, soft cap, dtype and KV split count appears at least once. Small blocks
# (16 rows, 16 keys) make tiny cases span several query blocks per sequence and several KV steps.
CASES = [
    Sweep("decode", 2, 2, 64, 16),
    Sweep("prefill", 6, 2, 128, 32),
    Sweep("mixed", 8, 1, 64, 16, dtype="bfloat16"),
    Sweep("chunked", 3, 1, 64, 16, sliding_window=8),
    Sweep("mixed", 2, 2, 256, 32, soft_cap=5.0, dtype="bfloat16"),
    Sweep("mixed", 16, 2, 128, 32, sliding_window=12, soft_cap=5.0, block_rows=32),
    Sweep("chunked", 4, 4, 128, 16, sliding_window=5, dtype="bfloat16", block_kv=32),
    Sweep(
        "decode", 24, 3, 64, 32, sliding_window=6, dtype="bfloat16", block_rows=None, block_kv=None
    ),
    Sweep("decode", 8, 1, 64, 16, num_kv_splits=3),
    Sweep("mixed", 3, 3, 128, 32, sliding_window=9, dtype="bfloat16", num_kv_splits=2),
]


def _args(case: RaggedCase) -> tuple[jax.Array, ...]:
    arrays = (case.q, case.kv_pages, case.kv_lens, case.page_table, case.cu_q_lens, case.num_seqs)
    return tuple(jnp.asarray(x) for x in arrays)


def _check_against_oracle(sweep: Sweep, seed: int, *, interpret: bool) -> None:
    rng = np.random.default_rng(seed)
    q_lens, kv_lens = random_lengths(rng, sweep.kind, num_seqs=3, max_context=40)
    case = make_case(
        rng,
        q_lens=q_lens,
        kv_lens=kv_lens,
        num_q_heads=sweep.num_q_heads,
        num_kv_heads=sweep.num_kv_heads,
        head_dim=sweep.head_dim,
        page_size=sweep.page_size,
        dtype=jnp.dtype(sweep.dtype),
        pad_tokens=5,
        pad_seqs=1,
    )
    sm_scale = 1 / math.sqrt(sweep.head_dim)
    out = gpu.ragged_paged_attention_gpu(
        *_args(case),
        sm_scale=sm_scale,
        sliding_window=sweep.sliding_window,
        logit_soft_cap=sweep.soft_cap,
        interpret=interpret,
        block_rows=sweep.block_rows,
        block_kv=sweep.block_kv,
        num_kv_splits=sweep.num_kv_splits,
    )
    assert out.shape == case.q.shape and out.dtype == case.q.dtype
    want = dense_attention_oracle(case, sm_scale, sweep.sliding_window, sweep.soft_cap)
    tol = F32_TOL if sweep.dtype == "float32" else BF16_TOL
    np.testing.assert_allclose(case.real_rows(out), want[: case.num_tokens], atol=tol, rtol=tol)


@pytest.mark.parametrize("sweep", CASES, ids=str)
def test_matches_oracle_interpret(sweep: Sweep) -> None:
    _check_against_oracle(sweep, seed=CASES.index(sweep), interpret=True)


def test_hand_computed() -> None:
    # One sequence, one head, D=16, two keys, one query at position 1, sm_scale 1.
    # q = e0; k0 = 0, k1 = ln(3) e0, so scores are (0, ln 3) and softmax weights (1/4, 3/4).
    # v0 = 4 e1, v1 = 8 e2, so out = 1 e1 + 6 e2. Slots 2.. of page 0 and all of page 1 hold NaN.
    d = 16
    kv_pages = np.full((2, 16, 2, d), np.nan, np.float32)
    kv_pages[0, :2] = 0.0
    kv_pages[0, 1, 0, 0] = math.log(3.0)  # K of key 1
    kv_pages[0, 0, 1, 1] = 4.0  # V of key 0
    kv_pages[0, 1, 1, 2] = 8.0  # V of key 1
    q = np.full((2, 1, d), np.nan, np.float32)  # row 1 is padding
    q[0] = 0.0
    q[0, 0, 0] = 1.0
    out = gpu.ragged_paged_attention_gpu(
        jnp.asarray(q),
        jnp.asarray(kv_pages),
        jnp.array([2], jnp.int32),  # kv_lens
        jnp.array([[0, 1]], jnp.int32),  # page_table: page 1 is never needed
        jnp.array([0, 1], jnp.int32),  # cu_q_lens
        jnp.array(1, jnp.int32),  # num_seqs
        sm_scale=1.0,
        interpret=True,
    )
    want = np.zeros(d, np.float32)
    want[1], want[2] = 1.0, 6.0
    np.testing.assert_allclose(np.asarray(out)[0, 0], want, atol=1e-6)


def test_no_real_sequences_is_harmless() -> None:
    # num_seqs = 0: every program exits before loading anything; all rows are padding.
    rng = np.random.default_rng(7)
    case = make_case(
        rng, q_lens=[2], kv_lens=[3], num_q_heads=2, num_kv_heads=1, head_dim=64, page_size=16
    )
    *args, _ = _args(case)
    out = gpu.ragged_paged_attention_gpu(
        *args, jnp.array(0, jnp.int32), sm_scale=0.125, interpret=True
    )
    assert out.shape == case.q.shape


@pytest.mark.parametrize(
    ("dtype", "head_dim", "page_size", "hq", "hkv", "message"),
    [
        (jnp.float16, 64, 16, 4, 2, "f32 and bf16"),
        (jnp.float32, 96, 16, 4, 2, "head_dim=96"),
        (jnp.bfloat16, 8, 16, 4, 2, "head_dim=8"),
        (jnp.bfloat16, 512, 16, 4, 2, "head_dim=512"),
        (jnp.float32, 64, 0, 4, 2, "page_size=0"),
        (jnp.float32, 64, 16, 6, 4, "num_q_heads=6"),
        (jnp.float32, 64, 16, 512, 1, "GQA group 512"),
    ],
)
def test_check_supported_rejects(
    dtype: Any, head_dim: int, page_size: int, hq: int, hkv: int, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        gpu.check_supported(dtype, head_dim, page_size, hq, hkv)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize(("head_dim", "page_size", "hq", "hkv"), [(64, 16, 8, 8), (256, 5, 9, 3)])
def test_check_supported_accepts(
    dtype: Any, head_dim: int, page_size: int, hq: int, hkv: int
) -> None:
    gpu.check_supported(dtype, head_dim, page_size, hq, hkv)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"block_rows": 24}, "block_rows=24"),
        ({"block_kv": 8}, "block_kv=8"),
        ({"num_kv_splits": 0}, "num_kv_splits=0"),
        ({"sliding_window": 0}, "sliding_window=0"),
    ],
)
def test_bad_options_are_named(options: dict[str, Any], message: str) -> None:
    q = jnp.zeros((4, 4, 64), jnp.float32)
    kv_pages = jnp.zeros((2, 16, 4, 64), jnp.float32)
    metadata = (jnp.zeros(2, jnp.int32), jnp.zeros((2, 1), jnp.int32), jnp.zeros(3, jnp.int32))
    with pytest.raises(ValueError, match=message):
        gpu.ragged_paged_attention_gpu(
            q, kv_pages, *metadata, jnp.array(1, jnp.int32), sm_scale=1.0, **options
        )


def test_bad_shapes_are_named() -> None:
    q = jnp.zeros((4, 4, 64), jnp.float32)
    kv_pages = jnp.zeros((2, 16, 4, 64), jnp.float32)
    kv_lens, page_table = jnp.zeros(2, jnp.int32), jnp.zeros((2, 1), jnp.int32)
    cu_q_lens = jnp.zeros(2, jnp.int32)  # must be [S+1] = [3]
    with pytest.raises(ValueError, match=r"cu_q_lens.shape=\(2,\)"):
        gpu.ragged_paged_attention_gpu(
            q, kv_pages, kv_lens, page_table, cu_q_lens, jnp.array(1, jnp.int32), sm_scale=1.0
        )


def _cuda_specs(dtype: Any) -> tuple[jax.ShapeDtypeStruct, ...]:
    t, hq, hkv, d, num_pages, page_size, s, p = 64, 12, 4, 128, 32, 16, 8, 8
    return (
        jax.ShapeDtypeStruct((t, hq, d), dtype),  # q
        jax.ShapeDtypeStruct((num_pages, page_size, 2 * hkv, d), dtype),  # kv_pages
        jax.ShapeDtypeStruct((s,), jnp.int32),  # kv_lens
        jax.ShapeDtypeStruct((s, p), jnp.int32),  # page_table
        jax.ShapeDtypeStruct((s + 1,), jnp.int32),  # cu_q_lens
        jax.ShapeDtypeStruct((), jnp.int32),  # num_seqs
    )


@pytest.mark.parametrize(
    ("dtype", "options"),
    [
        (jnp.float32, {}),
        (jnp.bfloat16, {"sliding_window": 64, "logit_soft_cap": 30.0, "num_kv_splits": 4}),
    ],
)
@needs_cuda_lowering()
def test_exports_for_cuda(dtype: Any, options: dict[str, Any]) -> None:
    fn = jax.jit(functools.partial(gpu.ragged_paged_attention_gpu, sm_scale=0.1, **options))
    exported = export.export(
        fn, platforms=["cuda"], disabled_checks=list(gpu.EXPORT_DISABLED_CHECKS)
    )(*_cuda_specs(dtype))
    assert exported.platforms == ("cuda",)
    assert "__gpu$xla.gpu.triton" in exported.mlir_module()
    assert exported.out_avals[0].shape == (64, 12, 128)
    assert exported.out_avals[0].dtype == dtype


@needs_cuda_lowering()
def test_export_needs_the_disabled_check() -> None:
    fn = jax.jit(functools.partial(gpu.ragged_paged_attention_gpu, sm_scale=0.1))
    with pytest.raises(ValueError, match="custom calls"):
        export.export(fn, platforms=["cuda"])(*_cuda_specs(jnp.float32))


def test_cuda_lowering_is_tested_where_it_can_be() -> None:
    """The CUDA export tests may skip only on a jax that cannot lower Triton without a GPU (0.11
    and later); on jax 0.10, or with a GPU attached, they must run."""
    if jax.__version_info__ < (0, 11) or jax.default_backend() == "gpu":
        assert cuda_lowering_error() is None


def _decode_case(num_seqs: int, seed: int) -> RaggedCase:
    """Decodes only (T == S), Llama-3-8B's GQA ratio at a small size, contexts up to 200."""
    rng = np.random.default_rng(seed)
    return make_case(
        rng,
        q_lens=[1] * num_seqs,
        kv_lens=[int(n) for n in rng.integers(1, 200, num_seqs)],
        num_q_heads=8,
        num_kv_heads=2,
        head_dim=64,
        page_size=16,
        pages_per_seq=16,
    )


@pytest.mark.parametrize("num_seqs", [1, 64])
@pytest.mark.parametrize("num_kv_splits", [1, 4, None])
def test_decode_batches_with_and_without_split_kv(num_seqs: int, num_kv_splits: int | None) -> None:
    # Default (decode-table) block sizes; None lets the kernel choose the split count.
    case = _decode_case(num_seqs, seed=num_seqs)
    out = gpu.ragged_paged_attention_gpu(
        *_args(case), sm_scale=0.125, interpret=True, num_kv_splits=num_kv_splits
    )
    want = dense_attention_oracle(case, 0.125)[: case.num_tokens]
    np.testing.assert_allclose(case.real_rows(out), want, atol=F32_TOL, rtol=F32_TOL)


@pytest.mark.parametrize(
    ("num_programs", "max_kv_len", "splits"),
    [
        # Llama-3-8B decode (8 KV heads, 4 query heads each: a 16-row tile holds 4 tokens), 64
        # keys per block, 8k context on an H200's 132 SMs:
        (1 * 8, 8192, 16),  # batch 1: 8 programs; 16 splits make 128 <= 132: one wave, 1/16
        (8 * 8, 8192, 2),  # batch 8: 64 programs; x2 = 128 (one wave, 1/2); x3 = 192 (2/3)
        (64 * 8, 8192, 1),  # batch 64: 512 programs already fill the SMs
        (1 * 8, 512, 2),  # batch 1 at 512 keys: 8 blocks, at most 2 splits of 4 blocks
        (1 * 3, 8192, 16),  # SmolLM2 (3 KV heads), batch 1: 48 programs, still one wave
    ],
)
def test_split_count_for_an_h200(num_programs: int, max_kv_len: int, splits: int) -> None:
    got = gpu.choose_num_kv_splits(
        num_programs=num_programs, max_kv_len=max_kv_len, block_kv=64, num_sms=gpu.H200_SMS
    )
    assert got == splits


def test_decode_buckets_get_16_row_tiles() -> None:
    # Llama-3-8B's group of 4 query heads per KV head: 4 decode tokens per 16-row tile.
    assert gpu.choose_block_sizes(128, 4, decode=True).block_rows == 16
    assert gpu.choose_block_sizes(128, 4, decode=False).block_rows == 64
    assert gpu.choose_block_sizes(128, 32, decode=True).block_rows == 32  # a group of 32 heads
    assert gpu.busy_query_tiles(num_tokens=64, num_slots=64, block_q=4) == 64  # decode bucket


@pytest.mark.parametrize(("mode", "precision"), [("ieee", "HIGHEST"), ("tf32", "DEFAULT")])
def test_float32_dots_ask_for_their_precision(mode: str, precision: str) -> None:
    """Both dots of the kernel body carry the precision Triton lowers to IEEE or TF32 (Pallas'
    GPU default is TF32, which interpret mode on a CPU does not show)."""
    fn = functools.partial(gpu.ragged_paged_attention_gpu, sm_scale=0.1, float32_dots=mode)
    text = str(jax.make_jaxpr(fn)(*_cuda_specs(jnp.float32)))
    dots = re.findall(r"dot_general\[.*?precision=(\(.*?\)|None)", text, re.S)
    assert dots == [f"(Precision.{precision}, Precision.{precision})"] * 2, dots


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU (compiled Triton kernel)")
class TestOnGpu:
    """The oracle cases compiled for the GPU (interpret=False); run on the GPU machine."""

    @pytest.mark.parametrize("sweep", CASES, ids=str)
    def test_matches_oracle_compiled(self, sweep: Sweep) -> None:
        _check_against_oracle(sweep, seed=CASES.index(sweep), interpret=False)

    def test_tf32_mode_within_its_tolerance(self) -> None:
        case = _decode_case(16, seed=3)
        out = gpu.ragged_paged_attention_gpu(*_args(case), sm_scale=0.125, float32_dots="tf32")
        want = dense_attention_oracle(case, 0.125)[: case.num_tokens]
        np.testing.assert_allclose(case.real_rows(out), want, atol=TF32_TOL, rtol=TF32_TOL)

    @pytest.mark.parametrize("num_kv_splits", [1, 4, None])
    def test_serving_sized_batch(self, num_kv_splits: int | None) -> None:
        # Default block sizes on a Llama-like shape: 24 decodes, 2 chunked prefills and one full
        # prefill over contexts up to 3000 tokens; too slow for interpret mode on a CPU.
        rng = np.random.default_rng(11)
        q_lens = [1] * 24 + [300, 77, 512]
        kv_lens = [int(n) for n in rng.integers(1, 3000, 24)] + [2100, 900, 512]
        case = make_case(
            rng,
            q_lens=q_lens,
            kv_lens=kv_lens,
            num_q_heads=32,
            num_kv_heads=8,
            head_dim=128,
            page_size=16,
            dtype=jnp.bfloat16,
            pad_tokens=13,
            pad_seqs=5,
        )
        out = gpu.ragged_paged_attention_gpu(
            *_args(case), sm_scale=128**-0.5, num_kv_splits=num_kv_splits
        )
        want = dense_attention_oracle(case, 128**-0.5)[: case.num_tokens]
        np.testing.assert_allclose(case.real_rows(out), want, atol=BF16_TOL, rtol=BF16_TOL)
