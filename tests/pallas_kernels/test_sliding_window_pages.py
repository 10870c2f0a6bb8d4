"""Pages wholly behind a sequence's sliding window are never read, by any implementation.

The engine frees such pages when every layer is local, so another request may own them (or they
may hold anything). Here they are filled with NaN, in every backend's check; for the TPU kernel
their page-table entries also become an id outside the cache, which interpret mode refuses to DMA.
The output must still equal the reference on the untouched batch and the dense float64 oracle.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from ragged_cases import RaggedCase, dense_attention_oracle, make_case
from tpu_interpret import needs_tpu_interpreter

from pallas_kernels.ragged_paged_attention.reference import ragged_paged_attention_reference

WINDOW, PAGE, HEAD_DIM = 20, 16, 128
# (q_len, kv_len): decodes far past the window, a chunk after a long prefix, a prefill, and a
# short decode that has no page behind its window.
SEQUENCES = [(1, 90), (10, 75), (24, 24), (1, 17), (1, 64)]


def behind_window(case: RaggedCase) -> dict[int, list[int]]:
    """Sequence -> page-table columns whose keys no query row of it may see."""
    out = {}
    for s, (q_len, kv_len) in enumerate(zip(case.q_lens, case.context_lens, strict=True)):
        first_key = max(kv_len - q_len - WINDOW + 1, 0)  # window start of its first query
        out[s] = list(range(first_key // PAGE))  # pages whose last key is before it
    return out


@pytest.fixture(scope="module")
def cases() -> tuple[RaggedCase, RaggedCase, RaggedCase]:
    """(the batch, the batch with pages behind the window NaN-filled, and the same with those
    page-table entries pointing outside the cache)."""
    rng = np.random.default_rng(7)
    q_lens, kv_lens = zip(*SEQUENCES, strict=True)
    case = make_case(
        rng,
        q_lens=q_lens,
        kv_lens=kv_lens,
        num_q_heads=4,
        num_kv_heads=1,
        head_dim=HEAD_DIM,
        page_size=PAGE,
        pad_tokens=3,
        pad_seqs=1,
    )
    kv_pages, table = case.kv_pages.copy(), case.page_table.copy()
    skipped = behind_window(case)
    assert sum(map(len, skipped.values())) >= 8  # the test has pages to skip
    for s, columns in skipped.items():
        kv_pages[table[s, columns]] = np.nan
    nan_filled = dataclasses.replace(case, kv_pages=kv_pages)
    for s, columns in skipped.items():
        table[s, columns] = kv_pages.shape[0]  # no such page
    return case, nan_filled, dataclasses.replace(nan_filled, page_table=table)


def arrays(case: RaggedCase) -> list[jnp.ndarray]:
    fields = (case.q, case.kv_pages, case.kv_lens, case.page_table, case.cu_q_lens, case.num_seqs)
    return [jnp.asarray(x) for x in fields]


def check(case: RaggedCase, clean: RaggedCase, out: jnp.ndarray) -> None:
    scale = HEAD_DIM**-0.5
    want = ragged_paged_attention_reference(*arrays(clean), sm_scale=scale, sliding_window=WINDOW)
    got = case.real_rows(np.asarray(out))
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, case.real_rows(np.asarray(want)), atol=2e-5, rtol=2e-5)
    oracle = case.real_rows(dense_attention_oracle(clean, scale, WINDOW))
    np.testing.assert_allclose(got, oracle, atol=2e-5, rtol=2e-5)


def test_reference_skips_pages_behind_the_window(cases) -> None:
    clean, nan_filled, _ = cases
    scale = HEAD_DIM**-0.5
    for blocks in (dict(kv_block=2 * PAGE, decode_kv_block=PAGE), {}):  # small, and default
        out = ragged_paged_attention_reference(
            *arrays(nan_filled), sm_scale=scale, sliding_window=WINDOW, q_block=8, **blocks
        )
        check(nan_filled, clean, out)


def test_gpu_kernel_skips_pages_behind_the_window(cases) -> None:
    from pallas_kernels.ragged_paged_attention.gpu import ragged_paged_attention_gpu

    clean, nan_filled, _ = cases
    out = ragged_paged_attention_gpu(
        *arrays(nan_filled), sm_scale=HEAD_DIM**-0.5, sliding_window=WINDOW, interpret=True
    )
    check(nan_filled, clean, out)


@needs_tpu_interpreter()
def test_tpu_kernel_never_fetches_pages_behind_the_window(cases) -> None:
    from jax.experimental.pallas import tpu as pltpu

    from pallas_kernels.ragged_paged_attention.tpu import ragged_paged_attention_tpu

    clean, _, poisoned = cases
    out = ragged_paged_attention_tpu(
        *arrays(poisoned),
        sm_scale=HEAD_DIM**-0.5,
        sliding_window=WINDOW,
        interpret=pltpu.InterpretParams(),
        num_queries_per_block=8,
        num_kv_pages_per_block=2,
    )
    check(poisoned, clean, out)
