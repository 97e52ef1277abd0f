"""One copy of a stage's weights in its memory: the pages of its memory-mapped weight files leave
the process once the CPU plugin has copied them into its own layout.

OpenVINO maps a model's ``.bin`` (ENABLE_MMAP) and the CPU plugin repacks the weights of every
MatMul into an anonymous buffer of its own on the first inferences of the compiled model; the
compiled model keeps the mapping (its constant nodes point into it), so every page the repack
read stays in the process's RSS: a serving stage held its weights twice (bench-scale: RssAnon
1.46 GiB beside RssFile 1.31 GiB on an 8B-shaped stage of 1.25 GiB of ``.bin``).
``MADV_DONTNEED`` on a read-only shared file mapping only unmaps its pages from this process:
they stay in the page cache (shared, reclaimable), and a later read of one (an embedding row
the plugin reads in place) faults it back in from there, so the model computes exactly as
before. ``WeightPages`` does it on a thread while the stage compiles and warms up, so the peak
never holds both copies, and once more at the end.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

import structlog

log = structlog.get_logger(__name__)

MADV_DONTNEED = 4
# IR weights, and the compiled-model cache's blobs (which the plugin maps on import and repacks
# from on the first inferences just the same).
WEIGHT_SUFFIXES = (".bin", ".blob")
# How often the thread returns pages while the plugin repacks: what it reads in between stays.
RELEASE_INTERVAL_S = 0.05


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.madvise.restype = ctypes.c_int
    return libc


def _roots(folders: Sequence[Path | str]) -> list[str]:
    return [os.path.realpath(folder) for folder in folders]


def _is_weights(fields: list[str], roots: list[str]) -> bool:
    """A /proc maps header split in six: a read-only mapping of a weight file under one of ``roots``."""
    if len(fields) != 6 or "w" in fields[1] or not fields[5].endswith(WEIGHT_SUFFIXES):
        return False
    return any(os.path.commonpath([fields[5], root]) == root for root in roots)


def weight_mappings(folders: Sequence[Path | str], pid: int | str = "self") -> list[tuple[int, int]]:
    """[start, end) of every read-only mapping of a weight file inside ``folders`` in ``pid``."""
    roots = _roots(folders)
    ranges = []
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if _is_weights(fields, roots):
            start, end = (int(x, 16) for x in fields[0].split("-"))
            ranges.append((start, end))
    return ranges


def resident_weight_bytes(folders: Sequence[Path | str], pid: int | str = "self") -> int:
    """Bytes of the weight files in ``folders`` resident in ``pid``'s mappings (their part of its RSS)."""
    roots = _roots(folders)
    total, counting = 0, False
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if fields and "-" in fields[0] and len(fields) >= 5:  # a mapping's header line
            counting = _is_weights(fields, roots)
        elif counting and fields[0] == "Rss:":
            total += int(fields[1]) * 1024
    return total


class WeightPages:
    """While entered, a thread returns the pages of the mapped weight files inside ``folders``
    every ``interval_s``; on exit once more (module doc). Without /proc or madvise: a no-op."""

    def __init__(self, folders: Sequence[Path | str], interval_s: float = RELEASE_INTERVAL_S):
        self.folders = list(folders)
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._libc: ctypes.CDLL | None = None

    def release(self) -> None:
        """Unmap every resident page of the weight files from this process (page cache keeps them)."""
        if self._libc is None:
            return
        for start, end in weight_mappings(self.folders):
            if self._libc.madvise(start, end - start, MADV_DONTNEED) != 0:
                log.warning("weight_pages_kept", errno=ctypes.get_errno())
                return

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.release()

    def __enter__(self) -> WeightPages:
        try:
            self._libc = _libc()
            weight_mappings(self.folders)
        except (OSError, AttributeError) as exc:
            log.info("weight_pages_off", reason=f"{type(exc).__name__}: {exc}")
            self._libc = None
            return self
        self._thread = threading.Thread(target=self._run, name="weight-pages", daemon=True)
        self._thread.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.release()
        if self._libc is not None:
            log.info("weight_pages_released", resident_bytes=resident_weight_bytes(self.folders))
