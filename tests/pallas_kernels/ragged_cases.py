"""Random ragged paged-attention batches and a dense float64 oracle, shared by all kernel tests.

Import it as `from ragged_cases import make_case, dense_attention_oracle, ...`: `tests/` has no
`__init__.py`, so pytest puts this directory on `sys.path` for every test file in it.

A case is one call of the ragged paged attention contract (see
`pallas_kernels/ragged_paged_attention/__init__.py`), built in NumPy so that it does not depend on
the code under test:

- `q` holds the queries of `num_seqs` sequences packed back to back, then `pad_tokens` padding rows
  filled with NaN.
- Each sequence gets `ceil(kv_len / page_size)` pages drawn from a random permutation of all pages;
  its K/V are written at `kv_pages[page, slot, 2*h]` (K) and `[..., 2*h+1]` (V). Every other page,
  and the unused tail slots of a sequence's last page, hold NaN.
- `page_table` entries beyond a sequence's pages, and whole rows of the `pad_seqs` padding
  sequences, hold random *valid* page ids (so a DMA kernel never faults, but a kernel that reads
  them pulls NaN or another sequence's keys into its result).
- `kv_lens` of padding sequences are random garbage in [0, P * page_size]; `cu_q_lens` past
  `num_seqs` repeats the total token count (non-decreasing, as the engine pads it).
- With `cache_head_dim > head_dim` the cache's extra lanes are zero (as `write_kv` writes them) and
  `q` keeps `head_dim`; the public wrapper pads q, kernels called directly need a padded q.

`dense_attention_oracle` recomputes attention per sequence from the ground-truth dense K/V in
float64 (full score matrix, causal + sliding-window mask, soft cap, softmax). Only the first
`case.num_tokens` rows of any output are meaningful; compare those (`case.real_rows(out)`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt


@dataclass(frozen=True)
class RaggedCase:
    """One ragged paged attention batch plus its ground truth. Arrays are NumPy."""

    q: np.ndarray  # dtype[T, Hq, D]; rows >= num_tokens are NaN
    kv_pages: np.ndarray  # dtype[num_pages, page_size, 2*Hkv, Dc]; unused pages NaN
    kv_lens: np.ndarray  # i32[S]
    page_table: np.ndarray  # i32[S, P]
    cu_q_lens: np.ndarray  # i32[S+1]
    num_seqs: np.ndarray  # i32[]
    k_dense: tuple[np.ndarray, ...]  # per real sequence: f64[kv_len, Hkv, D] (dtype-rounded)
    v_dense: tuple[np.ndarray, ...]  # per real sequence: f64[kv_len, Hkv, D]
    q_lens: tuple[int, ...]
    context_lens: tuple[int, ...]  # kv_lens of the real sequences

    @property
    def num_tokens(self) -> int:
        """Number of real (non-padding) query rows: cu_q_lens[num_seqs]."""
        return int(self.cu_q_lens[int(self.num_seqs)])

    @property
    def head_dim(self) -> int:
        return int(self.q.shape[-1])

    def real_rows(self, out: np.ndarray) -> np.ndarray:
        """The rows of an output [T, Hq, D] that the contract defines, as float64."""
        return np.asarray(out, dtype=np.float64)[: self.num_tokens, :, : self.head_dim]


def make_case(
    rng: np.random.Generator,
    *,
    q_lens: Sequence[int],
    kv_lens: Sequence[int],
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    dtype: npt.DTypeLike = np.float32,
    pad_tokens: int = 0,
    pad_seqs: int = 0,
    pages_per_seq: int | None = None,
    spare_pages: int = 3,
    cache_head_dim: int | None = None,
) -> RaggedCase:
    """Builds a random ragged batch; see the module docstring for what padding holds.

    Args:
      rng: source of randomness (`np.random.default_rng(seed)`).
      q_lens: query tokens per real sequence (1 = decode).
      kv_lens: context length per real sequence, including its queries (kv_len >= q_len).
      num_q_heads, num_kv_heads: Hq and Hkv; Hq must be a multiple of Hkv.
      head_dim: D of q and of the dense K/V.
      page_size: token slots per page.
      dtype: np.float32 or a bfloat16 dtype (`jnp.bfloat16` / `ml_dtypes.bfloat16`).
      pad_tokens: NaN query rows appended after the real ones (T = sum(q_lens) + pad_tokens).
      pad_seqs: padding sequences appended (S = len(q_lens) + pad_seqs).
      pages_per_seq: P, the page table width; default: just enough for the longest sequence.
      spare_pages: pages nobody owns (NaN-filled) on top of those the sequences need.
      cache_head_dim: last dim of kv_pages (>= head_dim); extra lanes are zero. Default head_dim.
    """
    assert len(q_lens) == len(kv_lens) > 0, (q_lens, kv_lens)
    assert all(0 < q <= k for q, k in zip(q_lens, kv_lens, strict=True)), (q_lens, kv_lens)
    assert num_q_heads % num_kv_heads == 0, (num_q_heads, num_kv_heads)
    dtype = np.dtype(dtype)
    dc = head_dim if cache_head_dim is None else cache_head_dim
    assert dc >= head_dim, (dc, head_dim)
    pages_needed = [math.ceil(k / page_size) for k in kv_lens]
    width = max(pages_needed) if pages_per_seq is None else pages_per_seq
    assert width >= max(pages_needed), (width, pages_needed)
    num_real, num_seqs = len(q_lens), len(q_lens) + pad_seqs
    num_pages = sum(pages_needed) + spare_pages

    def rounded(shape: tuple[int, ...]) -> np.ndarray:
        return rng.standard_normal(shape).astype(np.float32).astype(dtype)

    kv_pages = np.full((num_pages, page_size, 2 * num_kv_heads, dc), np.nan, dtype)
    page_table = rng.integers(0, num_pages, (num_seqs, width), dtype=np.int32)
    order = iter(rng.permutation(num_pages))
    k_dense, v_dense = [], []
    for s, (kv_len, n_pages) in enumerate(zip(kv_lens, pages_needed, strict=True)):
        k, v = rounded((kv_len, num_kv_heads, head_dim)), rounded((kv_len, num_kv_heads, head_dim))
        for j in range(n_pages):
            page_table[s, j] = page = next(order)
            chunk = slice(j * page_size, min((j + 1) * page_size, kv_len))
            n = chunk.stop - chunk.start
            kv_pages[page, :n, 0::2] = 0
            kv_pages[page, :n, 1::2] = 0
            kv_pages[page, :n, 0::2, :head_dim] = k[chunk]
            kv_pages[page, :n, 1::2, :head_dim] = v[chunk]
        k_dense.append(k.astype(np.float64))
        v_dense.append(v.astype(np.float64))

    num_tokens = sum(q_lens)
    q = np.full((num_tokens + pad_tokens, num_q_heads, head_dim), np.nan, dtype)
    q[:num_tokens] = rounded((num_tokens, num_q_heads, head_dim))
    cu_q_lens = np.full(num_seqs + 1, num_tokens, np.int32)
    cu_q_lens[: num_real + 1] = np.concatenate([[0], np.cumsum(q_lens)])
    lens = rng.integers(0, width * page_size + 1, num_seqs, dtype=np.int32)
    lens[:num_real] = kv_lens
    return RaggedCase(
        q=q,
        kv_pages=kv_pages,
        kv_lens=lens,
        page_table=page_table,
        cu_q_lens=cu_q_lens,
        num_seqs=np.array(num_real, np.int32),
        k_dense=tuple(k_dense),
        v_dense=tuple(v_dense),
        q_lens=tuple(q_lens),
        context_lens=tuple(kv_lens),
    )


def random_lengths(
    rng: np.random.Generator, kind: str, num_seqs: int, max_context: int
) -> tuple[list[int], list[int]]:
    """(q_lens, kv_lens) for a batch of one kind.

    kind: "decode" (q_len 1), "prefill" (q_len == kv_len), "chunked" (a chunk of queries after a
    cached prefix), or "mixed" (each sequence picks one of those three at random).
    """
    q_lens, kv_lens = [], []
    for _ in range(num_seqs):
        this = rng.choice(["decode", "prefill", "chunked"]) if kind == "mixed" else kind
        kv_len = int(rng.integers(1 if this != "chunked" else 2, max_context + 1))
        if this == "decode":
            q_len = 1
        elif this == "prefill":
            q_len = kv_len
        elif this == "chunked":
            q_len = int(rng.integers(1, kv_len))  # leaves a cached prefix of >= 1 token
        else:
            raise ValueError(f"unknown kind {kind!r}")
        q_lens.append(q_len)
        kv_lens.append(kv_len)
    return q_lens, kv_lens


def dense_attention_oracle(
    case: RaggedCase,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> np.ndarray:
    """Obviously-correct attention in float64: f64[T, Hq, D], zeros in the padding rows."""
    q = np.asarray(case.q, dtype=np.float64)
    out = np.zeros(q.shape, np.float64)
    group = q.shape[1] // case.k_dense[0].shape[1]
    for s, (q_len, kv_len) in enumerate(zip(case.q_lens, case.context_lens, strict=True)):
        start = int(case.cu_q_lens[s])
        qs = q[start : start + q_len]  # f64[q_len, Hq, D]
        k = np.repeat(case.k_dense[s], group, axis=1)  # f64[kv_len, Hq, D]
        v = np.repeat(case.v_dense[s], group, axis=1)
        scores = np.einsum("qhd,khd->hqk", qs, k) * sm_scale
        if soft_cap is not None:
            scores = soft_cap * np.tanh(scores / soft_cap)
        pos = kv_len - q_len + np.arange(q_len)[:, None]  # absolute position of each query
        key = np.arange(kv_len)[None, :]
        allowed = key <= pos
        if sliding_window is not None:
            allowed &= pos - key < sliding_window
        scores = np.where(allowed[None], scores, -np.inf)
        probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
        probs /= probs.sum(axis=-1, keepdims=True)
        out[start : start + q_len] = np.einsum("hqk,khd->qhd", probs, v)
    return out
