"""engine.host_memory: freed blocks stay on malloc's heap (glibc only)."""

from __future__ import annotations

import ctypes
import sys

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
