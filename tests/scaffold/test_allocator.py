"""glibc's malloc settings (pipeshard/allocator.py): applied on glibc, and trim answers."""

from __future__ import annotations

import platform

import pytest

from pipeshard import allocator


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt and malloc_trim only")
def test_arenas_are_capped_and_free_pages_trimmed_on_glibc():
    assert allocator.bound_heap()
    held = [bytearray(1 << 16) for _ in range(512)]  # 32 MiB on the heap, then freed
    del held
    assert isinstance(allocator.trim(), bool)
