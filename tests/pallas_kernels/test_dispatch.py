"""Choosing a ragged paged attention implementation: platform defaults, overrides, refusals."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from ragged_cases import RaggedCase, make_case

from pallas_kernels.ragged_paged_attention import (
    IMPLS,
    load_impl,
    ragged_paged_attention,
    resolve_impl,
)


def small_case(dtype: jnp.dtype = jnp.float32, head_dim: int = 64) -> RaggedCase:
    return make_case(
        np.random.default_rng(0),
        q_lens=[1, 3],
        kv_lens=[5, 3],
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=head_dim,
        page_size=16,
        dtype=dtype,
    )


def call(case: RaggedCase, **kwargs: object) -> jax.Array:
    arrays = (case.q, case.kv_pages, case.kv_lens, case.page_table, case.cu_q_lens, case.num_seqs)
    return ragged_paged_attention(*map(jnp.asarray, arrays), sm_scale=0.125, **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("platform", "impl"),
    [("cpu", "cpu"), ("tpu", "tpu"), ("gpu", "gpu"), ("cuda", "gpu"), ("rocm", "gpu")],
)
def test_platform_defaults(platform: str, impl: str) -> None:
    assert resolve_impl(None, platform) == impl


@pytest.mark.parametrize("impl", IMPLS)
def test_explicit_override_wins(impl: str) -> None:
    assert resolve_impl(impl, "cpu") == impl


def test_unknown_impl_and_platform_raise() -> None:
    with pytest.raises(ValueError, match="unknown ragged paged attention impl='triton'"):
        call(small_case(), impl="triton")
    with pytest.raises(ValueError, match="no ragged paged attention for platform 'metal'"):
        resolve_impl(None, "metal")


def test_cpu_default_is_the_cpu_kernel() -> None:
    # The C++ decode kernel sums in another order than the reference: equal to float32 rounding.
    case = small_case()
    np.testing.assert_allclose(
        np.asarray(call(case))[: case.num_tokens],
        np.asarray(call(case, impl="reference"))[: case.num_tokens],
        atol=1e-5,
    )


def test_default_inside_jit_uses_the_default_backend() -> None:
    case = small_case()
    arrays = (case.q, case.kv_pages, case.kv_lens, case.page_table, case.cu_q_lens, case.num_seqs)
    jitted = jax.jit(lambda *a: ragged_paged_attention(*a, sm_scale=0.125))
    out = jitted(*map(jnp.asarray, arrays))
    assert np.isfinite(np.asarray(out)[: case.num_tokens]).all()


def test_reference_refuses_unsupported_combinations() -> None:
    with pytest.raises(ValueError, match="reference: q_dtype=dtype\\('float16'\\)"):
        call(small_case(dtype=jnp.float16), impl="reference")
    case = small_case()
    q = jnp.asarray(case.q)[:, :3]  # 3 query heads over 2 kv heads
    with pytest.raises(ValueError, match="must be a multiple of Hkv"):
        ragged_paged_attention(
            q,
            jnp.asarray(case.kv_pages),
            jnp.asarray(case.kv_lens),
            jnp.asarray(case.page_table),
            jnp.asarray(case.cu_q_lens),
            jnp.asarray(case.num_seqs),
            sm_scale=1.0,
        )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"sliding_window": 0}, "sliding_window=0 must be positive"),
        ({"logit_soft_cap": -1.0}, "logit_soft_cap=-1.0 must be positive"),
    ],
)
def test_bad_options_raise(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        call(small_case(), **kwargs)


def test_cache_narrower_than_q_raises() -> None:
    case = small_case()
    with pytest.raises(ValueError, match="must have a head dim >="):
        ragged_paged_attention(
            jnp.zeros((4, 4, 128)),
            jnp.asarray(case.kv_pages),
            jnp.asarray(case.kv_lens),
            jnp.asarray(case.page_table),
            jnp.asarray(case.cu_q_lens),
            jnp.asarray(case.num_seqs),
            sm_scale=1.0,
        )


@pytest.mark.parametrize("impl", ["tpu", "gpu"])
def test_kernels_refuse_unsupported_combinations_instead_of_falling_back(impl: str) -> None:
    # float16 is outside both kernels' contract; the dispatcher must raise, not run the reference.
    load_impl(impl)  # the kernel module imports on a CPU-only machine
    with pytest.raises(ValueError, match=f"(?i){impl}"):
        call(small_case(dtype=jnp.float16), impl=impl)
