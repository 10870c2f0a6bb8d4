"""Keeps the memory that XLA:CPU frees in the process, for the next step to reuse.

XLA:CPU allocates each step's outputs and temporaries with malloc and frees them when the step
ends. glibc serves large blocks (over its mmap threshold: 128 KiB, rising to at most 32 MiB) with
fresh mmaps and unmaps them on free, so every step faulted its working set back in, page by page:
on the 2-core machine a 39 MB gather took 9.5 ms that way and 1.1 ms from reused memory, the
SmolLM2 single-stream decode step 23 ms instead of 19, and offline throughput dropped by ~12%
(bench/RESULTS.md). Raising the mmap and trim thresholds keeps freed blocks on malloc's heap, as
vLLM's CPU backend gets by preloading tcmalloc. The cost: the process's resident memory stays at
its peak instead of shrinking after a step.
"""

from __future__ import annotations

import ctypes
import logging
import sys

log = logging.getLogger(__name__)

# mallopt(3) parameters (malloc.h) and the values set: blocks up to 1 GiB come from the heap,
# and free memory at its top is never returned to the kernel.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD = 1 << 30
_TRIM_THRESHOLD = 2**31 - 1

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
