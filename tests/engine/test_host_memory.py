"""engine.host_memory: freed blocks stay on malloc's heap (glibc only)."""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from engine import host_memory

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc")


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
            "fsmblks", "uordblks", "fordblks", "keepcost",
        )
    ]  # fmt: skip


def _mmapped_bytes(libc: ctypes.CDLL) -> int:
    libc.mallinfo2.restype = _MallInfo2
    return int(libc.mallinfo2().hblkhd)


def test_large_blocks_come_from_the_heap_and_stay_there() -> None:
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    assert host_memory.keep_freed_memory()
    assert host_memory.keep_freed_memory()  # idempotent

    size = 96 << 20  # over glibc's largest default mmap threshold (32 MiB)
    before = _mmapped_bytes(libc)
    block = libc.malloc(size)
    assert block
    mmapped = _mmapped_bytes(libc) - before
    libc.free(block)
    assert mmapped < size, "a 96 MiB block was served by mmap: the threshold did not apply"


def _huge_kib_around(address: int) -> int:
    """AnonHugePages of the mapping that holds `address` (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


def test_long_lived_arrays_move_to_huge_pages_unchanged() -> None:
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    setting = thp.read_text() if thp.exists() else "[never]"
    x = jnp.arange(6 << 20, dtype=jnp.float32)  # 24 MiB: at least 10 whole 2 MiB pages
    expected = np.arange(6 << 20, dtype=np.float32)
    collapsed = host_memory.use_huge_pages([x])
    if "[never]" in setting:
        assert collapsed == 0
    elif collapsed == 0:
        pytest.skip("this kernel has no MADV_COLLAPSE (Linux < 6.1)")
    else:
        assert collapsed >= 10 << 21
        first_whole_page = -(-x.unsafe_buffer_pointer() // (2 << 20)) * (2 << 20)
        assert _huge_kib_around(first_whole_page) >= collapsed >> 10
    np.testing.assert_array_equal(np.asarray(x), expected)
    np.testing.assert_array_equal(np.asarray(x + 1), expected + 1)  # still a live buffer
