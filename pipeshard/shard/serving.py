"""Marks an export as in use by a running fleet, so a forced re-export cannot replace it.

Every stage and coordinator holds a shared ``flock`` on the export folder itself (a directory
file descriptor; nothing is written) for as long as it runs; an export with ``force`` takes the
lock exclusively (without waiting) before it starts and refuses when it cannot. The kernel drops
a lock with its process, so a crashed fleet leaves nothing stale. Only processes on the same
machine see the lock: a fleet elsewhere serves its own pulled copy, which an export here cannot
touch anyway.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

from pipeshard.errors import FailedPrecondition


class ServingLock:
    """A shared lock on an export folder, held until :meth:`close` or process exit."""

    def __init__(self, export_dir: Path):
        self._fd = os.open(export_dir, os.O_RDONLY | os.O_DIRECTORY)
        fcntl.flock(self._fd, fcntl.LOCK_SH)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def hold_serving_lock(export_dir: Path) -> ServingLock:
    """Mark ``export_dir`` as served for the life of the returned lock (keep a reference)."""
    return ServingLock(export_dir)


@contextlib.contextmanager
def not_served(export_dir: Path) -> Iterator[None]:
    """Hold ``export_dir`` exclusively for the body; FailedPrecondition while a fleet serves it."""
    try:
        fd = os.open(export_dir, os.O_RDONLY | os.O_DIRECTORY)
    except FileNotFoundError:
        yield  # nothing there to protect
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise FailedPrecondition(
                f"export {Path(export_dir).name!r} is served by a running fleet on this machine; "
                "export under another name (out) or stop the fleet first"
            ) from None
        yield
    finally:
        os.close(fd)
