"""The host page allocator: allocation, prefix caching, eviction order, random-operation model."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from engine.kv_cache import (
    KVCacheManager,
    bytes_per_page,
    describe_kv_cache,
    hash_page,
    pages_for_memory,
)

P = 4  # page size in the unit tests


def snapshot(kv: KVCacheManager) -> dict[str, Any]:
    return copy.deepcopy(vars(kv))


def prefill(kv: KVCacheManager, rid: str, prompt: Sequence[int]) -> tuple[list[int], int]:
    """Schedule a whole prompt as one chunk, 'compute' it and commit; returns the cache hit."""
    pages, num_cached = kv.find_cached_prefix(prompt)
    assert kv.allocate(rid, len(prompt), pages) is not None
    kv.commit_full_pages(rid, prompt, len(prompt))
    kv.check_invariants()
    return pages, num_cached


def test_allocate_grows_page_table_page_by_page() -> None:
    kv = KVCacheManager(num_pages=8, page_size=P)
    assert kv.allocate("a", 5) == [0, 1]
    assert kv.allocate("a", 8) == []  # still fits in two pages
    assert kv.allocate("a", 9) == [2]
    assert kv.allocate("b", 1) == [3]
    assert kv.page_table("a") == [0, 1, 2]
    assert kv.page_table("unknown") == []
    assert (kv.num_free_pages, kv.usage) == (4, 0.5)
    assert kv.num_pages_needed("a", 16) == 1 and kv.can_allocate("a", 28)
    assert not kv.can_allocate("a", 29)  # 8 pages = 32 slots, "b" holds one
    kv.check_invariants()


def test_exhaustion_returns_none_and_changes_nothing() -> None:
    kv = KVCacheManager(num_pages=4, page_size=P)
    prefill(kv, "a", range(12))  # 3 pages
    before = snapshot(kv)
    assert kv.allocate("b", 5) is None  # needs 2, 1 free
    assert kv.allocate("a", 20) is None  # needs 2 more
    assert vars(kv) == before
    assert kv.allocate("b", 4) == [3]


def test_exhaustion_counts_cached_pages_that_must_be_revived() -> None:
    kv = KVCacheManager(num_pages=4, page_size=P)
    prefill(kv, "a", range(12))
    kv.free("a")  # 3 cached pages at refcount 0, all 4 pages free
    pages, num_cached = kv.find_cached_prefix([*range(12), 90, 91, 92, 93, 94])
    assert num_cached == 12
    before = snapshot(kv)
    # 3 revived + 2 new = 5 > 4, though only 2 "new" pages are asked for.
    assert not kv.can_allocate("b", 17 + 3, pages)
    assert kv.allocate("b", 17 + 3, pages) is None
    assert vars(kv) == before


def test_prefix_shared_with_running_request() -> None:
    kv = KVCacheManager(num_pages=10, page_size=P)
    prompt_a = list(range(14))  # 3 full pages + 2 tokens
    prefill(kv, "a", prompt_a)
    prompt_b = [*prompt_a[:12], 50, 51, 52, 53, 54]
    pages, num_cached = kv.find_cached_prefix(prompt_b)
    assert (pages, num_cached) == (kv.page_table("a")[:3], 12)
    new = kv.allocate("b", len(prompt_b), pages)
    assert new is not None and len(new) == 2  # only tokens 12..16 are computed
    assert kv.page_table("b") == [*pages, *new]
    assert kv.num_free_pages == 10 - 4 - 2
    kv.check_invariants()  # refcount 2 on the shared pages
    kv.free("a")
    assert kv.num_free_pages == 10 - 5  # shared pages still held by "b"
    kv.check_invariants()


def test_prefix_revived_after_request_finished() -> None:
    kv = KVCacheManager(num_pages=10, page_size=P)
    prefill(kv, "a", range(14))
    cached = kv.page_table("a")[:3]
    kv.free("a")
    assert (kv.num_free_pages, kv.num_cached_pages, kv.usage) == (10, 3, 0.0)
    pages, num_cached = prefill(kv, "b", [*range(12), 7])
    assert (pages, num_cached) == (cached, 12)
    assert kv.num_free_pages == 10 - 4


def test_eviction_prefers_empty_pages_then_least_recently_freed_tail_first() -> None:
    kv = KVCacheManager(num_pages=6, page_size=2)
    prefill(kv, "a", [1, 1, 1, 1])  # pages 0, 1
    prefill(kv, "b", [2, 2, 2, 2])  # pages 2, 3
    kv.free("a")  # queue: 4 5 | 1 0 (tail first)
    kv.free("b")  # queue: 4 5 | 1 0 3 2
    assert kv.allocate("c", 6) == [4, 5, 1]
    assert kv.find_cached_prefix([1, 1, 1, 1, 9]) == ([0], 2)  # page 1 was evicted
    assert kv.find_cached_prefix([2, 2, 2, 2, 9]) == ([2, 3], 4)
    kv.check_invariants()


def test_unregistered_pages_are_reused_before_cached_ones() -> None:
    kv = KVCacheManager(num_pages=4, page_size=2)
    prefill(kv, "a", [1, 1, 1])  # page 0 full and cached, page 1 partial
    prefill(kv, "b", [2])  # page 2 partial
    kv.free("a")  # queue: 1 3 | 0 (partial page 1 to the front, cached page 0 to the back)
    kv.free("b")  # queue: 2 1 3 | 0
    assert kv.allocate("c", 6) == [2, 1, 3]
    assert kv.find_cached_prefix([1, 1, 1]) == ([0], 2)


def test_partial_last_page_is_never_shared() -> None:
    kv = KVCacheManager(num_pages=10, page_size=P)
    prompt = list(range(10))  # 2 full pages + 2 tokens
    prefill(kv, "a", prompt)
    assert kv.num_cached_pages == 2
    pages, num_cached = prefill(kv, "b", prompt)
    assert num_cached == 8 and pages == kv.page_table("a")[:2]
    assert kv.page_table("b")[2] != kv.page_table("a")[2]
    # Decoding two tokens fills "a"'s third page, which then becomes shareable.
    kv.allocate("a", 12)
    kv.commit_full_pages("a", [*prompt, 10, 11], 12)
    assert kv.num_cached_pages == 3
    assert kv.find_cached_prefix([*prompt, 10, 11, 12])[1] == 12


def test_at_least_one_token_is_left_to_compute() -> None:
    kv = KVCacheManager(num_pages=10, page_size=P)
    prefill(kv, "a", range(12))  # 3 full pages, all cached
    assert kv.find_cached_prefix(range(12))[1] == 8  # not 12: the last token needs logits
    assert kv.find_cached_prefix(range(13))[1] == 12
    assert kv.find_cached_prefix(range(1)) == ([], 0)
    assert kv.find_cached_prefix([]) == ([], 0)


def test_prefix_cache_stats_count_tokens() -> None:
    kv = KVCacheManager(num_pages=10, page_size=P)
    prefill(kv, "a", range(10))  # miss: 10 queried
    prefill(kv, "b", range(10))  # 8 hit
    kv.find_cached_prefix([5] * 6)  # miss
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (26, 8)


def test_same_prefix_computed_twice_is_registered_once() -> None:
    kv = KVCacheManager(num_pages=8, page_size=P)
    prompt = list(range(9))
    for rid in ("a", "b"):  # both looked up before either committed
        assert kv.find_cached_prefix(prompt) == ([], 0)
        kv.allocate(rid, len(prompt))
    for rid in ("a", "b"):
        kv.commit_full_pages(rid, prompt, len(prompt))
    assert kv.num_cached_pages == 2
    assert kv.find_cached_prefix(prompt)[0] == kv.page_table("a")[:2]
    kv.free("b")  # its duplicate pages hold nothing findable: reused first
    assert kv.allocate("c", 8) == [3, 4]
    kv.check_invariants()


def test_reset_prefix_cache_keeps_pages_in_use() -> None:
    kv = KVCacheManager(num_pages=8, page_size=P)
    prefill(kv, "a", range(9))
    prefill(kv, "b", range(100, 109))
    kv.free("b")
    assert kv.reset_prefix_cache() == 2
    assert kv.num_cached_pages == 2
    assert kv.find_cached_prefix(range(100, 109))[1] == 0
    assert kv.find_cached_prefix(range(9))[1] == 8
    kv.check_invariants()


def test_prefix_caching_disabled() -> None:
    kv = KVCacheManager(num_pages=8, page_size=P, enable_prefix_caching=False)
    prefill(kv, "a", range(9))
    assert kv.num_cached_pages == 0
    assert prefill(kv, "b", range(9)) == ([], 0)
    assert kv.prefix_cache_queries == 0


def test_free_is_idempotent_and_ids_can_be_reused() -> None:
    kv = KVCacheManager(num_pages=4, page_size=P)
    fresh = snapshot(kv)
    kv.free("never-seen")
    kv.allocate("a", 5)
    kv.free("a")
    kv.free("a")
    assert vars(kv) == fresh
    assert kv.allocate("a", 3) == [0]  # a new request under an old id
    kv.check_invariants()


def test_invalid_arguments_name_the_numbers() -> None:
    with pytest.raises(ValueError, match="num_pages=0"):
        KVCacheManager(num_pages=0, page_size=16)
    with pytest.raises(ValueError, match="page_size=-1"):
        KVCacheManager(num_pages=4, page_size=-1)
    kv = KVCacheManager(num_pages=4, page_size=P)
    with pytest.raises(ValueError, match="-3"):
        kv.allocate("a", -3)
    kv.allocate("a", 4)
    with pytest.raises(ValueError, match="num_computed_tokens=8"):
        kv.commit_full_pages("a", range(8), 8)  # "a" holds one page
    with pytest.raises(ValueError, match="already holds 1 pages"):
        kv.allocate("a", 8, [0])
    with pytest.raises(ValueError, match="page 2 holds no cached prefix"):
        kv.allocate("b", 8, [2])


def test_hash_page_is_chained_and_stable() -> None:
    root = hash_page(b"", [1, 2])
    assert root == hash_page(b"", (1, 2)) == hash_page(b"", list(np.array([1, 2], np.int32)))
    assert hash_page(root, [3, 4]) != hash_page(hash_page(b"", [9, 9]), [3, 4])
    assert len(root) == 32


def test_memory_sizing_and_description() -> None:
    page = bytes_per_page(num_layers=30, page_size=16, num_kv_heads=3, head_dim=64, dtype_bytes=2)
    assert page == 2 * 30 * 16 * 3 * 64 * 2 == 368_640
    assert pages_for_memory(1 << 30, page) == 2912  # 1073741824 // 368640
    # 2048 / 16 = 128 pages per request; 2912 // 128 = 22 requests.
    assert describe_kv_cache(2912, 16, page, max_model_len=2048) == (
        "KV cache: 2912 pages of 16 tokens (1.00 GiB), "
        "max concurrency 22 at 2048 tokens per request"
    )
    with pytest.raises(ValueError, match="100 bytes holds no page of 368640 bytes"):
        pages_for_memory(100, page)
    with pytest.raises(ValueError, match="'head_dim': 0"):
        bytes_per_page(30, 16, 3, 0, 2)


# A few shared "system prompts" plus a random tail, so that full pages often hit the cache.
PREFIXES = ([0] * 12, [1, 2] * 6, [2, 0, 1, 1, 0, 2, 2, 1, 0, 0, 1, 2])
PROMPTS = st.builds(
    lambda prefix, length, tail: prefix[:length] + tail,
    st.sampled_from(PREFIXES),
    st.integers(0, 12),
    st.lists(st.integers(0, 2), max_size=6),
).filter(bool)


class KVCacheMachine(RuleBasedStateMachine):
    """Random requests over a tiny alphabet (so prefixes collide) against a model of page content.

    `slots` mirrors what the device would hold: each computed token is written into its page, and
    every prefix-cache hit must return pages whose slots hold exactly the prompt's tokens.
    """

    @initialize(
        num_pages=st.integers(1, 12), page_size=st.sampled_from([1, 2, 4]), caching=st.booleans()
    )
    def start(self, num_pages: int, page_size: int, caching: bool) -> None:
        self.kv = KVCacheManager(num_pages, page_size, enable_prefix_caching=caching)
        self.tokens: dict[str, list[int]] = {}  # running request -> its sequence so far
        self.computed: dict[str, int] = {}
        self.slots: dict[int, list[int | None]] = {}
        self.next_id = 0

    def _compute(self, rid: str, upto: int) -> None:
        table, size = self.kv.page_table(rid), self.kv.page_size
        for pos in range(self.computed[rid], upto):
            page = table[pos // size]
            assert all(page not in self.kv.page_table(o) for o in self.tokens if o != rid)
            self.slots[page][pos % size] = self.tokens[rid][pos]
        self.computed[rid] = upto
        self.kv.commit_full_pages(rid, self.tokens[rid], upto)

    def _allocate(self, rid: str, num_tokens: int, cached: list[int]) -> bool:
        before = snapshot(self.kv)
        new = self.kv.allocate(rid, num_tokens, cached)
        if new is None:
            assert vars(self.kv) == before
            return False
        for page in new:
            self.slots[page] = [None] * self.kv.page_size
        return True

    def _pick(self, index: int) -> str:
        return sorted(self.tokens)[index % len(self.tokens)]

    @rule(prompt=PROMPTS, chunk=st.integers(1, 16))
    def new_request(self, prompt: list[int], chunk: int) -> None:
        pages, num_cached = self.kv.find_cached_prefix(prompt)
        size = self.kv.page_size
        assert num_cached == len(pages) * size and (num_cached < len(prompt))
        for i, page in enumerate(pages):
            assert self.slots[page] == prompt[i * size : (i + 1) * size]
        rid, self.next_id = f"r{self.next_id}", self.next_id + 1
        upto = min(len(prompt), num_cached + chunk)
        if self._allocate(rid, upto, pages):
            self.tokens[rid], self.computed[rid] = list(prompt), num_cached
            self._compute(rid, upto)

    @precondition(lambda self: self.tokens)
    @rule(index=st.integers(0, 15), chunk=st.integers(1, 8), sampled=st.integers(0, 2))
    def step(self, index: int, chunk: int, sampled: int) -> None:
        rid = self._pick(index)
        if self.computed[rid] == len(self.tokens[rid]):
            self.tokens[rid].append(sampled)  # decode: the sampled token is computed next
        upto = min(len(self.tokens[rid]), self.computed[rid] + chunk)
        if self._allocate(rid, upto, []):
            self._compute(rid, upto)
        else:
            self._finish(rid)  # preempted

    @precondition(lambda self: self.tokens)
    @rule(index=st.integers(0, 15))
    def finish(self, index: int) -> None:
        self._finish(self._pick(index))

    def _finish(self, rid: str) -> None:
        self.kv.free(rid)
        del self.tokens[rid], self.computed[rid]

    @rule()
    def free_unknown(self) -> None:
        before = snapshot(self.kv)
        self.kv.free("finished-long-ago")
        assert vars(self.kv) == before

    @rule()
    def reset_prefix_cache(self) -> None:
        self.kv.reset_prefix_cache()

    @invariant()
    def consistent(self) -> None:
        self.kv.check_invariants()
        held = {page for rid in self.tokens for page in self.kv.page_table(rid)}
        assert self.kv.num_free_pages == self.kv.num_pages - len(held)
        for rid, computed in self.computed.items():
            assert len(self.kv.page_table(rid)) * self.kv.page_size >= computed

    def teardown(self) -> None:
        if not hasattr(self, "kv"):
            return
        for rid in list(self.tokens):
            self._finish(rid)
        self.kv.check_invariants()
        assert (self.kv.num_free_pages, self.kv.usage) == (self.kv.num_pages, 0.0)


TestKVCacheMachine = KVCacheMachine.TestCase
TestKVCacheMachine.settings = settings(max_examples=100, stateful_step_count=30, deadline=None)
