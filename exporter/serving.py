"""Marks an export as in use by a running fleet, so a forced re-export cannot replace it.

Every stage and coordinator holds a shared ``flock`` on ``.<export>.serving`` beside the export
folder for as long as it runs; an export with ``force`` takes the lock exclusively (without
waiting) before it starts and refuses when it cannot. The kernel drops a lock with its process,
so a crashed fleet leaves nothing stale. Only processes on the same machine see the lock: a fleet
elsewhere serves its own pulled copy, which an export here cannot touch anyway.
"""

from __future__ import annotations

import contextlib
import fcntl
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from pipeshard.errors import FailedPrecondition


def _lock_path(export_dir: Path) -> Path:
    export_dir = Path(export_dir).resolve()
    return export_dir.parent / f".{export_dir.name}.serving"


def hold_serving_lock(export_dir: Path) -> IO[bytes]:
    """Mark ``export_dir`` as served for the life of the returned file (keep a reference)."""
    path = _lock_path(export_dir)
    handle = path.open("ab")
    fcntl.flock(handle, fcntl.LOCK_SH)
    return handle


@contextlib.contextmanager
def not_served(export_dir: Path) -> Iterator[None]:
    """Hold ``export_dir`` exclusively for the body; FailedPrecondition while a fleet serves it."""
    path = _lock_path(export_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("ab") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise FailedPrecondition(
                f"export {Path(export_dir).name!r} is served by a running fleet on this machine; "
                "export under another name (out) or stop the fleet first"
            ) from None
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
