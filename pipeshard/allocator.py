"""glibc malloc settings for a long-running stage, so memory freed after a burst goes back to the OS.

Refused multi-MiB messages (8 MiB Forward frames, 100,000-part restore streams) left a stage's heap
with free pages malloc kept: mallinfo2 showed the bytes in use flat and the free bytes growing by
about 0.7 MiB a burst (docs/RELIABILITY.md "Hostile soak"). Every thread that allocates may also
get its own arena (up to 8 per core), each keeping free pages of its own. ``bound_heap`` caps the
arenas; ``trim`` hands free pages back (``malloc_trim``), which an idle stage does. On a C library
without these calls (musl, macOS) both do nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util

import structlog

log = structlog.get_logger(__name__)

_M_ARENA_MAX = -8  # mallopt's parameter, from glibc's malloc.h
ARENA_MAX = 2


def _glibc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
    except OSError:
        return None
    return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None


_LIBC = _glibc()


def bound_heap(arena_max: int = ARENA_MAX) -> bool:
    """Caps malloc's arenas (call before threads start); False when the C library is not glibc."""
    if _LIBC is None:
        return False
    done = bool(_LIBC.mallopt(_M_ARENA_MAX, arena_max))
    log.debug("malloc_bounded", arena_max=arena_max, applied=done)
    return done


def trim() -> bool:
    """Returns malloc's free pages to the OS; True when some were released."""
    return _LIBC is not None and bool(_LIBC.malloc_trim(0))
