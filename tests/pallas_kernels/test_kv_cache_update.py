"""The paged KV cache layout and `write_kv`: scatter, padding tokens, lane padding, donation."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from ragged_cases import make_case

from pallas_kernels.kv_cache_update import KVCacheSpec, init_kv_pages, write_kv


def test_spec_padding_per_platform() -> None:
    tpu = KVCacheSpec.for_platform(
        "tpu", num_pages=4, page_size=16, num_kv_heads=3, head_dim=64, dtype="bfloat16"
    )
    assert tpu.padded_head_dim == 128 and tpu.shape == (4, 16, 6, 128)
    cpu = KVCacheSpec.for_platform("cpu", num_pages=4, page_size=16, num_kv_heads=3, head_dim=64)
    assert cpu.padded_head_dim == 64
    assert KVCacheSpec(1, 16, 1, 256, lane_multiple=128).padded_head_dim == 256
    kv = init_kv_pages(tpu)
    assert kv.shape == tpu.shape and kv.dtype == jnp.bfloat16


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [("dtype", "float16", "dtype must be one of"), ("page_size", 0, "page_size must be positive")],
)
def test_spec_rejects_bad_values(field: str, value: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        KVCacheSpec(4, 16, 2, 64).replace(**{field: value})  # type: ignore[arg-type]


@pytest.mark.parametrize(("dtype", "cache_dim"), [(jnp.float32, 64), (jnp.bfloat16, 128)])
def test_write_reproduces_the_paged_layout(dtype: jnp.dtype, cache_dim: int) -> None:
    # Write every context token of a random batch, in shuffled order with padding tokens (slot -1,
    # garbage K/V) among them, into a NaN cache: the written slots must equal make_case's
    # independently built layout (K at 2h, V at 2h+1, zero lanes past D) and nothing else changes.
    rng = np.random.default_rng(0)
    case = make_case(
        rng,
        q_lens=[1, 3, 1],
        kv_lens=[20, 3, 45],
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=64,
        page_size=16,
        dtype=dtype,
        cache_head_dim=cache_dim,
    )
    page_size = case.kv_pages.shape[1]
    k, v, slots = [], [], []
    for s, kv_len in enumerate(case.context_lens):
        positions = np.arange(kv_len)
        slots.append(case.page_table[s, positions // page_size] * page_size + positions % page_size)
        k.append(case.k_dense[s])
        v.append(case.v_dense[s])
    pad = 7
    k.append(rng.standard_normal((pad, 2, 64)))
    v.append(rng.standard_normal((pad, 2, 64)))
    slots.append(np.full(pad, -1))
    order = rng.permutation(sum(len(x) for x in slots))
    k_all, v_all = np.concatenate(k)[order], np.concatenate(v)[order]
    slot_mapping = np.concatenate(slots)[order].astype(np.int32)

    cache = jnp.full(case.kv_pages.shape, jnp.nan, dtype)
    out = write_kv(
        cache, jnp.asarray(k_all, dtype), jnp.asarray(v_all, dtype), jnp.asarray(slot_mapping)
    )
    got = np.asarray(out).reshape(-1, *case.kv_pages.shape[2:])
    want = case.kv_pages.reshape(got.shape)
    written = np.zeros(len(got), bool)
    written[slot_mapping[slot_mapping >= 0]] = True
    np.testing.assert_array_equal(got[written], want[written])
    assert (got[written][..., 64:] == 0).all()  # padded lanes
    assert np.isnan(got[~written].astype(np.float32)).all()  # untouched, padding tokens skipped


def test_padding_tokens_are_not_written() -> None:
    spec = KVCacheSpec(num_pages=2, page_size=2, num_kv_heads=1, head_dim=2)
    kv = init_kv_pages(spec)
    k = jnp.array([[[1.0, 2.0]], [[9.0, 9.0]]])
    v = jnp.array([[[3.0, 4.0]], [[9.0, 9.0]]])
    out = np.asarray(write_kv(kv, k, v, jnp.array([3, -1], jnp.int32)))
    want = np.zeros(spec.shape, np.float32)
    want[1, 1] = [[1, 2], [3, 4]]  # slot 3 = page 1, offset 1; K then V
    np.testing.assert_array_equal(out, want)


def test_write_under_jit_donates_and_updates_in_place() -> None:
    spec = KVCacheSpec(num_pages=64, page_size=16, num_kv_heads=2, head_dim=64)
    write = jax.jit(write_kv, donate_argnums=0)
    kv = init_kv_pages(spec)
    k = jnp.ones((4, 2, 64))
    slots = jnp.array([0, 17, 33, -1], jnp.int32)
    hlo = write.lower(kv, k, k, slots).compile().as_text()
    assert hlo is not None and "input_output_alias" in hlo  # the output buffer is the donated input
    out = write(kv, k, k, slots)
    assert kv.is_deleted()
    assert float(out.sum()) == 3 * 2 * 2 * 64


def test_write_rejects_mismatched_shapes() -> None:
    kv = init_kv_pages(KVCacheSpec(num_pages=2, page_size=4, num_kv_heads=2, head_dim=8))
    with pytest.raises(ValueError, match="must be equal and"):
        write_kv(kv, jnp.ones((3, 1, 8)), jnp.ones((3, 1, 8)), jnp.zeros(3, jnp.int32))
    with pytest.raises(ValueError, match=r"slot_mapping\.shape"):
        write_kv(kv, jnp.ones((3, 2, 8)), jnp.ones((3, 2, 8)), jnp.zeros(2, jnp.int32))
