"""int8 and fp8 (e4m3) KV caches: the write, the bytes, and every attention backend (reference,
TPU and GPU kernels in interpret mode) against float64 attention over the float cache.

Two oracles per case:
- the float cache's attention (float64, `dense_attention_oracle`): the quantized cache must stay
  within its format's error: per (token, head) absmax scaling leaves a relative error of at most
  1/254 per int8 element, 1/16 per e4m3 element; on these batches the largest output error is
  observed at 0.012-0.021 (int8) and 0.074-0.096 (fp8) on outputs of size ~1, allowed 0.03 and
  0.15;
- the same attention over the dequantized cache (float64): each backend must reproduce it to
  float32 accuracy (1e-5), so a wrongly applied scale shows even where the format hides it.
Unused pages hold NaN scales, so a stray read of an unused page poisons a real row.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export
from jax.experimental.pallas import tpu as pltpu
from ragged_cases import RaggedCase, dense_attention_oracle, make_case, random_lengths

from pallas_kernels.kv_cache_update import (
    KVCacheSpec,
    QuantizedKVPages,
    init_kv_pages,
    quantize_kv,
    write_kv,
)
from pallas_kernels.ragged_paged_attention import gpu, ragged_paged_attention
from pallas_kernels.ragged_paged_attention.tpu import ragged_paged_attention_tpu
from tests.pallas_kernels.gpu_lowering import needs_cuda_lowering

DTYPES = {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn}
FORMAT_TOLERANCE = {"int8": 3e-2, "fp8": 0.15}
SM_SCALE = 0.125


def quantized_case(case: RaggedCase, kv_dtype: str) -> tuple[QuantizedKVPages, RaggedCase]:
    """The case's cache quantized per (slot, combined head), unused slots with NaN scales, and
    the case with its dense K/V replaced by the dequantized values (the second oracle)."""
    pages = jnp.asarray(case.kv_pages)
    finite = jnp.isfinite(pages).all(axis=-1)  # bool[num_pages, page_size, 2*Hkv]
    values, scales = quantize_kv(jnp.where(finite[..., None], pages, 0.0), DTYPES[kv_dtype])
    scales = jnp.where(finite, scales, jnp.nan)
    dequantized = np.asarray(values.astype(jnp.float32) * scales[..., None], np.float64)
    k_dense, v_dense = [], []
    page_size = pages.shape[1]
    for s, kv_len in enumerate(case.context_lens):
        slots = [(case.page_table[s, j // page_size], j % page_size) for j in range(kv_len)]
        kv = np.stack([dequantized[p, i] for p, i in slots])  # f64[kv_len, 2*Hkv, D]
        k_dense.append(kv[:, 0::2, : case.head_dim])
        v_dense.append(kv[:, 1::2, : case.head_dim])
    deq = dataclasses.replace(case, k_dense=tuple(k_dense), v_dense=tuple(v_dense))
    return QuantizedKVPages(values, scales), deq


def run(impl: str, case: RaggedCase, cache: QuantizedKVPages) -> np.ndarray:
    q = jnp.asarray(case.q)
    metadata = tuple(
        jnp.asarray(x) for x in (case.kv_lens, case.page_table, case.cu_q_lens, case.num_seqs)
    )
    if impl == "reference":
        out = ragged_paged_attention(q, cache, *metadata, sm_scale=SM_SCALE, impl="reference")
    elif impl == "tpu":
        out = ragged_paged_attention_tpu(
            q,
            cache.values,
            *metadata,
            sm_scale=SM_SCALE,
            kv_scales=cache.scales,
            interpret=pltpu.InterpretParams(detect_races=True),
            num_queries_per_block=16,
            num_kv_pages_per_block=2,
        )
    else:
        out = gpu.ragged_paged_attention_gpu(
            q, cache.values, *metadata, sm_scale=SM_SCALE, kv_scales=cache.scales, interpret=True
        )
    return case.real_rows(np.asarray(out.astype(jnp.float32)))


CASES = [  # (impl, kv dtype, batch kind, head dim): every impl, dtype and kind at least once
    ("reference", "int8", "mixed", 64),
    ("reference", "fp8", "mixed", 64),
    ("reference", "int8", "decode", 128),
    ("tpu", "int8", "mixed", 128),
    ("tpu", "fp8", "decode", 128),
    ("gpu", "int8", "mixed", 64),
    ("gpu", "fp8", "prefill", 32),
]


@pytest.mark.parametrize(("impl", "kv_dtype", "kind", "head_dim"), CASES, ids=str)
def test_quantized_cache_attention(impl: str, kv_dtype: str, kind: str, head_dim: int) -> None:
    rng = np.random.default_rng(CASES.index((impl, kv_dtype, kind, head_dim)))
    q_lens, kv_lens = random_lengths(rng, kind, num_seqs=3, max_context=80)
    case = make_case(
        rng,
        q_lens=q_lens,
        kv_lens=kv_lens,
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=head_dim,
        page_size=32,
        pad_tokens=3,
        pad_seqs=1,
    )
    cache, dequantized_case = quantized_case(case, kv_dtype)
    got = run(impl, case, cache)
    float_cache = case.real_rows(dense_attention_oracle(case, SM_SCALE))
    np.testing.assert_allclose(got, float_cache, atol=FORMAT_TOLERANCE[kv_dtype], rtol=0)
    exact = case.real_rows(dense_attention_oracle(dequantized_case, SM_SCALE))
    np.testing.assert_allclose(got, exact, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_write_kv_quantizes_each_token_and_head(kv_dtype: str) -> None:
    spec = KVCacheSpec(num_pages=4, page_size=8, num_kv_heads=2, head_dim=16, dtype=kv_dtype)
    k, v = np.random.default_rng(0).normal(size=(2, 5, 2, 16)).astype(np.float32) * 3
    slots = jnp.array([0, 9, 31, -1, 17])  # one padding token
    pages = jax.jit(write_kv)(init_kv_pages(spec), jnp.asarray(k), jnp.asarray(v), slots)
    assert isinstance(pages, QuantizedKVPages) and pages.values.dtype == DTYPES[kv_dtype]
    flat = pages.values.astype(jnp.float32) * pages.scales[..., None]
    flat = np.asarray(flat).reshape(32, 4, 16)
    step = {"int8": 1 / 254, "fp8": 1 / 16}[kv_dtype]  # relative to each vector's absmax
    for t, slot in enumerate([0, 9, 31, None, 17]):
        if slot is None:
            continue
        for h in range(2):
            for got, want in ((flat[slot, 2 * h], k[t, h]), (flat[slot, 2 * h + 1], v[t, h])):
                assert np.abs(got - want).max() <= step * np.abs(want).max() * 1.001
    untouched = np.setdiff1d(np.arange(32), [0, 9, 31, 17])
    assert np.all(flat[untouched] == 0)


def test_int8_cache_halves_the_bytes() -> None:
    shape = dict(num_pages=64, page_size=16, num_kv_heads=3, head_dim=64)  # SmolLM2's heads
    nbytes = {}
    for dtype in ("float32", "bfloat16", "int8", "fp8"):
        spec = KVCacheSpec(**shape, dtype=dtype)
        arrays = jax.tree.leaves(init_kv_pages(spec))
        nbytes[dtype] = sum(x.nbytes for x in arrays)
        assert nbytes[dtype] == spec.nbytes
    # One byte per element plus a 4-byte scale per 64: 68 / 128 of bfloat16.
    assert nbytes["int8"] == nbytes["fp8"] <= 0.54 * nbytes["bfloat16"]
    assert nbytes["int8"] <= 0.27 * nbytes["float32"]


def _export_specs() -> tuple[jax.ShapeDtypeStruct, ...]:
    t, hq, hkv, d, page_size, s, p, num_pages = 64, 8, 2, 128, 32, 4, 8, 64
    q = jax.ShapeDtypeStruct((t, hq, d), jnp.bfloat16)
    pages = jax.ShapeDtypeStruct((num_pages, page_size, 2 * hkv, d), jnp.int8)
    scales = jax.ShapeDtypeStruct((num_pages, page_size, 2 * hkv), jnp.float32)
    meta = (
        jax.ShapeDtypeStruct((s,), jnp.int32),
        jax.ShapeDtypeStruct((s, p), jnp.int32),
        jax.ShapeDtypeStruct((s + 1,), jnp.int32),
        jax.ShapeDtypeStruct((), jnp.int32),
    )
    return (q, pages, scales, *meta)


def test_quantized_kernel_exports_for_tpu() -> None:
    def tpu_fn(q, pages, scales, *meta):
        return ragged_paged_attention_tpu(q, pages, *meta, sm_scale=0.1, kv_scales=scales)

    tpu = export.export(jax.jit(tpu_fn), platforms=["tpu"])(*_export_specs())
    assert "tpu_custom_call" in tpu.mlir_module()
    assert tpu.out_avals[0].shape == (64, 8, 128)


@needs_cuda_lowering()
def test_quantized_kernel_exports_for_cuda() -> None:
    def gpu_fn(q, pages, scales, *meta):
        return gpu.ragged_paged_attention_gpu(q, pages, *meta, sm_scale=0.1, kv_scales=scales)

    cuda = export.export(
        jax.jit(gpu_fn), platforms=["cuda"], disabled_checks=list(gpu.EXPORT_DISABLED_CHECKS)
    )(*_export_specs())
    assert "__gpu$xla.gpu.triton" in cuda.mlir_module()
    assert cuda.out_avals[0].shape == (64, 8, 128)
