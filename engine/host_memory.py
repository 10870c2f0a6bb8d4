"""Host memory for XLA:CPU: freed blocks kept for the next step, long-lived arrays on huge pages.

XLA:CPU allocates each step's outputs and temporaries with malloc and frees them when the step
ends. glibc serves large blocks (over its mmap threshold: 128 KiB, rising to at most 32 MiB) with
fresh mmaps and unmaps them on free, so every step faulted its working set back in, page by page:
on the 2-core machine a 39 MB gather took 9.5 ms that way and 1.1 ms from reused memory, the
SmolLM2 single-stream decode step 23 ms instead of 19, and offline throughput dropped by ~12%
(bench/RESULTS.md). Raising the mmap and trim thresholds keeps freed blocks on malloc's heap, as
vLLM's CPU backend gets by preloading tcmalloc. The cost: the process's resident memory stays at
its peak instead of shrinking after a step.

The weights and the KV cache live for the whole run and are read in full every step, through
4 KiB pages unless the kernel is told otherwise (`transparent_hugepage` is usually "madvise").
`use_huge_pages` collapses them into 2 MiB pages in place (MADV_COLLAPSE, Linux 6.1): on the
2-core AMD machine, in alternating runs, a step of 128 decodes went from 479-487 to 451-459 ms
and a 512-token mixed step from 956-968 to 940 ms (the attention reads every page of the cache
and the products every weight, with fewer TLB misses).
"""

from __future__ import annotations

import ctypes
import logging
import sys
from collections.abc import Iterable

import jax

log = logging.getLogger(__name__)

# mallopt(3) parameters (malloc.h) and the values set: blocks up to 1 GiB come from the heap,
# and free memory at its top is never returned to the kernel.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD = 1 << 30
_TRIM_THRESHOLD = 2**31 - 1

_MADV_HUGEPAGE = 14
_MADV_COLLAPSE = 25
_HUGE_PAGE = 2 << 20

_applied = False


def keep_freed_memory() -> bool:
    """Tunes glibc malloc as above, once per process; False where malloc is not glibc's."""
    global _applied
    if _applied:
        return True
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    ok = mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD) == 1
    ok &= mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD) == 1
    if not ok:
        log.warning("could not raise malloc's mmap/trim thresholds; CPU steps will run slower")
    _applied = ok
    return ok


def use_huge_pages(arrays: Iterable[object]) -> int:
    """Backs the 2 MiB-aligned part of each CPU jax.Array's buffer with huge pages (other values
    are skipped); returns the bytes collapsed (0 where the kernel or the platform can't: nothing
    changes but the speed)."""
    if not sys.platform.startswith("linux"):
        return 0
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:  # not glibc (musl names it otherwise): keep the speed we have
        return 0
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    done = 0
    for array in arrays:
        if not isinstance(array, jax.Array) or array.is_deleted():
            continue
        if {d.platform for d in array.devices()} != {"cpu"}:
            continue
        for shard in array.addressable_shards:
            start = shard.data.unsafe_buffer_pointer()
            first = -(-start // _HUGE_PAGE) * _HUGE_PAGE
            last = (start + shard.data.nbytes) // _HUGE_PAGE * _HUGE_PAGE
            if last <= first:
                continue
            length = last - first
            # MADV_HUGEPAGE marks the range (collapse needs it where THP is "madvise"); the
            # collapse copies the pages in place, keeping their contents and addresses.
            if libc.madvise(first, length, _MADV_HUGEPAGE) or libc.madvise(
                first, length, _MADV_COLLAPSE
            ):  # an old kernel, THP off, or memory that is not anonymous (a mapped file)
                log.debug("no huge pages for %d bytes (errno %d)", length, ctypes.get_errno())
                continue
            done += length
    return done
