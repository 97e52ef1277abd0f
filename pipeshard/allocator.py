"""glibc malloc settings for a long-running stage, so memory freed after a burst goes back to the OS.

Without them a stage's resident memory crept up under the hostile soak while the memory malloc had
handed out stayed flat (measured with mallinfo2: docs/RELIABILITY.md "Hostile soak"). Two glibc
habits cause it: every thread that allocates may get its own arena (up to 8 per core), each keeping
its own free pages; and after a large block is freed, glibc raises its mmap threshold to that size,
so later multi-MiB buffers (a refused 8 MiB frame, a snapshot being joined) come from an arena's
heap and leave holes there instead of being unmapped on free. ``bound_heap`` caps the arenas and
pins the threshold; ``trim`` hands free pages back (``malloc_trim``), cheap enough for an idle
stage. On a C library without these calls (musl, macOS) both do nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util

import structlog

log = structlog.get_logger(__name__)

# mallopt parameters, from glibc's malloc.h.
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8

ARENA_MAX = 2
MMAP_THRESHOLD = 256 << 10  # a pinned value also turns glibc's dynamic threshold off


def _glibc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
    except OSError:
        return None
    return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None


_LIBC = _glibc()


def bound_heap(arena_max: int = ARENA_MAX, mmap_threshold: int = MMAP_THRESHOLD) -> bool:
    """Caps malloc's arenas and pins its mmap threshold (call before threads start); False when the
    C library is not glibc."""
    if _LIBC is None:
        return False
    done = bool(_LIBC.mallopt(_M_ARENA_MAX, arena_max)) and bool(
        _LIBC.mallopt(_M_MMAP_THRESHOLD, mmap_threshold)
    )
    log.debug("malloc_bounded", arena_max=arena_max, mmap_threshold=mmap_threshold, applied=done)
    return done


def trim() -> bool:
    """Returns malloc's free pages to the OS; True when some were released."""
    return _LIBC is not None and bool(_LIBC.malloc_trim(0))
