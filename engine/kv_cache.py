"""Host-side KV page allocator: free queue, page tables, refcounts and automatic prefix caching.

The device holds `num_pages` pages of `page_size` token slots each; this module only decides which
request owns which page. A request's page table lists its pages in token order: token `t` lives in
slot `t % page_size` of page `page_table[t // page_size]`.

Prefix caching: once a page is full and computed it is keyed by a chained hash of the whole prefix
up to and including it (see `hash_page`). A later request whose prompt starts with the same tokens
gets those pages back and shares them (reference counts). When no request holds a hashed page any
more it stays hashed in the free queue, so a hit can revive it until it is evicted, least recently
freed first, because pages ran short.

Free queue order: front = reused first. Freed pages that hold no cached content go to the front
(losing them costs nothing); freed hashed pages go to the back, so cached content is evicted in
LRU order. A request's pages are released tail first, so its deepest (least shareable) pages are
evicted before its first ones.

Sliding window: when every layer of the model is local (Mistral), keys behind the window of a
request's next token are never read again, so `release_behind_window` frees the pages that hold
only such keys, like `free` does for a whole request (reference counts, prefix-cache content kept
for a later hit). Their page-table entries become RELEASED; the attention kernels never read a
page-table entry of a page wholly behind the window, so its value is never used.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

GIB = 1 << 30
RELEASED = -1  # page-table entry of a page released behind the sliding window
_ROOT_HASH = b""  # the parent of a request's first page (no salt)


def hash_page(parent_hash: bytes, token_ids: Sequence[int]) -> bytes:
    """SHA-256 of the parent page's hash and this page's token ids (as little-endian int64).

    SHA-256 rather than Python's `hash`: stable across processes and runs (so hashes could be
    shared between hosts or logged), and collisions, which would silently serve another prompt's
    K/V, are not a practical concern.
    """
    return hashlib.sha256(parent_hash + np.asarray(token_ids, dtype="<i8").tobytes()).digest()


def root_hash(salt: bytes) -> bytes:
    """The parent hash of a request's first page: a salt (a LoRA adapter's identity) starts a
    chain of its own, so pages computed with one adapter are never found by another's lookup."""
    return hashlib.sha256(b"salt:" + salt).digest() if salt else _ROOT_HASH


class KVCacheManager:
    """Owns the mapping request -> pages; never touches the K/V arrays themselves.

    Typical use by a scheduler, per request:
        pages, num_cached = kv.find_cached_prefix(prompt)        # once, when first scheduled
        new = kv.allocate(rid, num_cached + chunk, pages)         # None: not enough pages, wait
        ... the step computes the chunk ...
        kv.commit_full_pages(rid, token_ids, num_computed)        # register now-full pages
        kv.allocate(rid, num_computed + 1)                        # each decode step
        kv.free(rid)                                              # finished, aborted or preempted
    """

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        *,
        enable_prefix_caching: bool = True,
        sliding_window: int | None = None,
    ):
        if num_pages < 1 or page_size < 1:
            raise ValueError(
                f"need num_pages >= 1 and page_size >= 1, got {num_pages=} {page_size=}"
            )
        self.num_pages = num_pages
        self.page_size = page_size
        self.enable_prefix_caching = enable_prefix_caching
        self.sliding_window = sliding_window  # set only when every layer is local
        self._refcounts = [0] * num_pages
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_pages))
        self._page_hashes: list[bytes | None] = [None] * num_pages  # content key of each page
        self._cached: dict[bytes, int] = {}  # content key -> the page that holds it
        self._tables: dict[str, list[int]] = {}  # request id -> its pages, in token order
        self._chains: dict[str, list[bytes]] = {}  # request id -> hashes of its full pages
        self.prefix_cache_queries = 0  # prompt tokens looked up
        self.prefix_cache_hits = 0  # of those, tokens found already computed

    # -- queries ------------------------------------------------------------------------------

    @property
    def num_free_pages(self) -> int:
        """Pages no request holds, including evictable ones that still hold cached content."""
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of all pages held by at least one request."""
        return 1.0 - len(self._free) / self.num_pages

    @property
    def num_cached_pages(self) -> int:
        """Pages registered in the prefix cache, in use or not."""
        return len(self._cached)

    def page_table(self, request_id: str) -> list[int]:
        """A copy of the request's pages in token order; empty for an unknown request."""
        return list(self._tables.get(request_id, ()))

    def num_pages_held(self, request_id: str) -> int:
        """How many pages the request holds (0 for an unknown request)."""
        return len(self._tables.get(request_id, ()))

    def num_pages_held_each(self, request_ids: list[str]) -> list[int]:
        """`num_pages_held` of each request, in one call (a batch's rows)."""
        tables = self._tables
        return [len(tables.get(request_id, ())) for request_id in request_ids]

    def num_committed_pages(self, request_id: str) -> int:
        """The request's leading pages registered in the prefix cache (or found there)."""
        return len(self._chains.get(request_id, ()))

    def num_pages_needed(self, request_id: str, num_tokens: int, num_cached_pages: int = 0) -> int:
        """New pages `allocate` would take to hold `num_tokens` tokens in all."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        held = len(self._tables.get(request_id, ())) + num_cached_pages
        return max(0, -(-num_tokens // self.page_size) - held)

    def can_allocate(
        self, request_id: str, num_tokens: int, cached_pages: Sequence[int] = ()
    ) -> bool:
        """Whether `allocate` with the same arguments would succeed."""
        reviving = sum(1 for p in cached_pages if self._refcounts[p] == 0)
        needed = self.num_pages_needed(request_id, num_tokens, len(cached_pages))
        return needed + reviving <= len(self._free)

    def find_cached_prefix(
        self, token_ids: Sequence[int], salt: bytes = b""
    ) -> tuple[list[int], int]:
        """The cached pages that hold the longest computed prefix of `token_ids`, and its length.

        The length is a multiple of `page_size` and at most `len(token_ids) - 1`, so at least one
        token is always left to compute and produce logits from. Counts the lookup in the stats:
        call it once per request. Pass the result to `allocate` before any other allocation, which
        could evict the pages. `salt`: as given to `commit_full_pages` (the request's adapter).
        """
        if not self.enable_prefix_caching:
            return [], 0
        pages: list[int] = []
        parent = root_hash(salt)
        for i in range((len(token_ids) - 1) // self.page_size):  # leave >= 1 token to compute
            parent = hash_page(parent, self._page_tokens(token_ids, i))
            page = self._cached.get(parent)
            if page is None:
                break
            pages.append(page)
        self.prefix_cache_queries += len(token_ids)
        self.prefix_cache_hits += len(pages) * self.page_size
        return pages, len(pages) * self.page_size

    # -- updates ------------------------------------------------------------------------------

    def allocate(
        self, request_id: str, num_tokens: int, cached_pages: Sequence[int] = ()
    ) -> list[int] | None:
        """Make the request hold pages for `num_tokens` tokens in all (context + tokens to compute).

        `cached_pages` (from `find_cached_prefix`) are taken first, on the request's first call
        only. Returns the newly allocated pages (cached ones excluded), or None, changing nothing,
        if there are not enough free pages even after evicting cached content.
        """
        table = self._tables.get(request_id)
        if (
            not cached_pages
            and table is not None
            and 0 <= num_tokens <= len(table) * self.page_size
        ):
            return []  # it holds them already: most decode steps
        held = 0 if table is None else len(table)
        if cached_pages and held:
            raise ValueError(f"request {request_id!r} already holds {held} pages")
        chain = [self._hash_of(page) for page in cached_pages]
        if not self.can_allocate(request_id, num_tokens, cached_pages):
            return None
        needed = self.num_pages_needed(request_id, num_tokens, len(cached_pages))
        for page in cached_pages:
            self._take(page)
        new_pages = [self._pop_free() for _ in range(needed)]
        self._tables.setdefault(request_id, []).extend([*cached_pages, *new_pages])
        if chain:
            self._chains[request_id] = chain
        return new_pages

    def commit_full_pages(
        self, request_id: str, token_ids: Sequence[int], num_computed_tokens: int, salt: bytes = b""
    ) -> None:
        """Register in the prefix cache the request's pages that the computed tokens now fill.

        `token_ids` is the request's whole sequence so far (prompt + output); its first
        `num_computed_tokens` have their K/V written. Pages already registered are skipped; a page
        whose content another page already holds stays unregistered (it was computed twice).
        """
        if not self.enable_prefix_caching:
            return
        table = self._tables.get(request_id, [])
        num_full = num_computed_tokens // self.page_size
        if num_computed_tokens > len(token_ids) or num_full > len(table):
            raise ValueError(
                f"{num_computed_tokens=} exceeds len(token_ids)={len(token_ids)} or the "
                f"{len(table)} pages of request {request_id!r} (page_size={self.page_size})"
            )
        chain = self._chains.get(request_id, [])
        for i in range(len(chain), num_full):
            parent = chain[-1] if chain else root_hash(salt)
            key = hash_page(parent, self._page_tokens(token_ids, i))
            chain.append(key)
            if key not in self._cached:
                self._cached[key] = table[i]
                self._page_hashes[table[i]] = key
        if chain:
            self._chains[request_id] = chain

    def free(self, request_id: str) -> None:
        """Release all the request's pages, tail first; a no-op for an unknown request."""
        self._chains.pop(request_id, None)
        for page in reversed(self._tables.pop(request_id, [])):
            if page != RELEASED:
                self._release(page)

    def shrink(self, request_id: str, num_tokens: int) -> int:
        """Gives back the request's tail pages that hold none of its first `num_tokens` tokens
        (speculative proposals that were rejected); returns how many. Those pages are past the
        computed tokens, so none is in the prefix cache."""
        table = self._tables.get(request_id, [])
        keep = -(-num_tokens // self.page_size)
        released = 0
        while len(table) > keep and len(table) > len(self._chains.get(request_id, ())):
            self._release(table.pop())
            released += 1
        return released

    def release_behind_window(self, request_id: str, num_computed_tokens: int) -> int:
        """With a sliding window, frees the request's pages that the next token (at position
        `num_computed_tokens`) and all later ones cannot see; returns how many.

        Call after `commit_full_pages`, so that their content stays in the prefix cache.
        """
        table = self._tables.get(request_id)
        if self.sliding_window is None or not table:
            return 0
        first_visible = max(num_computed_tokens - self.sliding_window + 1, 0)
        behind = min(first_visible // self.page_size, len(table))
        released = 0
        for i in range(behind):
            if table[i] != RELEASED:
                self._release(table[i])
                table[i] = RELEASED
                released += 1
        return released

    def _release(self, page: int) -> None:
        self._refcounts[page] -= 1
        if self._refcounts[page] == 0:
            self._free[page] = None
            if self._page_hashes[page] is None:
                self._free.move_to_end(page, last=False)

    def reset_prefix_cache(self) -> int:
        """Forget the cached content of every page no request holds; returns how many."""
        evicted = [p for p in self._free if self._page_hashes[p] is not None]
        for page in evicted:
            self._evict(page)
        return len(evicted)

    def _page_tokens(self, token_ids: Sequence[int], index: int) -> Sequence[int]:
        return token_ids[index * self.page_size : (index + 1) * self.page_size]

    def _hash_of(self, page: int) -> bytes:
        key = self._page_hashes[page]
        if key is None:
            raise ValueError(f"page {page} holds no cached prefix (evicted since the lookup?)")
        return key

    def _take(self, page: int) -> None:
        if self._refcounts[page] == 0:
            del self._free[page]
        self._refcounts[page] += 1

    def _pop_free(self) -> int:
        page, _ = self._free.popitem(last=False)
        self._evict(page)
        self._refcounts[page] = 1
        return page

    def _evict(self, page: int) -> None:
        key = self._page_hashes[page]
        if key is not None:
            del self._cached[key]
            self._page_hashes[page] = None

    # -- testing ------------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent (for tests)."""
        holders = [0] * self.num_pages
        for rid, table in self._tables.items():
            held = [page for page in table if page != RELEASED]
            _check(len(set(held)) == len(held), f"request {rid!r} holds a page twice: {table}")
            _check(len(self._chains.get(rid, ())) <= len(table), f"{rid!r} hashed unheld pages")
            released = len(table) - len(held)
            _check(RELEASED not in table[released:], f"{rid!r} released a page in front: {table}")
            for page in held:
                holders[page] += 1
        _check(holders == self._refcounts, f"refcounts {self._refcounts} != holders {holders}")
        for page, count in enumerate(self._refcounts):
            _check(
                (count == 0) == (page in self._free), f"page {page}: {count=}, free-queue mismatch"
            )
        for key, page in self._cached.items():
            _check(self._page_hashes[page] == key, f"cached page {page} holds another hash")
        _check(
            sum(h is not None for h in self._page_hashes) == len(self._cached), "stray page hash"
        )
        in_use = sum(count > 0 for count in self._refcounts)
        _check(in_use + len(self._free) == self.num_pages, f"{in_use=} + free != {self.num_pages}")
        hashed = [self._page_hashes[p] is not None for p in self._free]
        _check(hashed == sorted(hashed), "free queue: an unhashed page is behind a hashed one")


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(message)


def bytes_per_page(
    num_layers: int, page_size: int, num_kv_heads: int, head_dim: int, dtype_bytes: int
) -> int:
    """Device bytes one page takes: K and V for `page_size` tokens in every layer."""
    sizes = dict(num_layers=num_layers, page_size=page_size, num_kv_heads=num_kv_heads)
    sizes.update(head_dim=head_dim, dtype_bytes=dtype_bytes)
    if min(sizes.values()) < 1:
        raise ValueError(f"KV page sizes must all be positive, got {sizes}")
    return 2 * num_layers * page_size * num_kv_heads * head_dim * dtype_bytes


def pages_for_memory(budget_bytes: int, bytes_per_page: int) -> int:
    """How many whole pages fit in `budget_bytes`; at least one, else ValueError."""
    if bytes_per_page < 1 or budget_bytes < bytes_per_page:
        raise ValueError(
            f"a KV cache budget of {budget_bytes} bytes holds no page of {bytes_per_page} bytes; "
            "give the cache more memory or use a smaller page_size"
        )
    return budget_bytes // bytes_per_page


def describe_kv_cache(
    num_pages: int, page_size: int, bytes_per_page: int, max_model_len: int
) -> str:
    """One start-up log line: size of the cache and how many full-length requests fit at once."""
    pages_per_request = -(-max_model_len // page_size)
    return (
        f"KV cache: {num_pages} pages of {page_size} tokens "
        f"({num_pages * bytes_per_page / GIB:.2f} GiB), max concurrency "
        f"{num_pages // pages_per_request} at {max_model_len} tokens per request"
    )
