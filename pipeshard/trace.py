"""Opt-in step timeline: where one decode step's time goes across the fleet's processes.

With ``PIPESHARD_TRACE_DIR`` set, every process appends one line per event to
``DIR/<process>-<pid>.tsv``: the clock, the process, the event and the (session id, step id) of the
frame it concerns (a plan frame's first row). The clock is ``CLOCK_MONOTONIC``, one clock for every
process of a machine, so lines from different processes join by step into one timeline
(bench/latency.py). Lines are buffered and written when the process exits or the buffer holds
``FLUSH_EVERY`` events (so a long traced run does not grow without bound); unset, ``mark`` costs a
global lookup and a branch.
"""

from __future__ import annotations

import atexit
import os
import time
from pathlib import Path

_DIR = os.environ.get("PIPESHARD_TRACE_DIR", "")
_process = f"pid{os.getpid()}"
_events: list[tuple[int, str, str, int]] = []
FLUSH_EVERY = 65536


def enabled() -> bool:
    return bool(_DIR)


def name_process(name: str) -> None:
    """The name this process's lines carry (``coordinator``, ``stage0``, ...)."""
    global _process
    _process = name.replace(" ", "")


def mark(event: str, session_id: str, step_id: int) -> None:
    """Records ``event`` of step (session_id, step_id) now, when tracing is on."""
    if _DIR:
        _events.append((time.monotonic_ns(), event, session_id, step_id))
        if len(_events) >= FLUSH_EVERY:
            flush()


def flush() -> None:
    """Writes the buffered lines (at exit; a benchmark reads them after stopping the fleet)."""
    if not _DIR or not _events:
        return
    lines = "".join(f"{t}\t{_process}\t{e}\t{s}\t{k}\n" for t, e, s, k in _events)
    _events.clear()
    folder = Path(_DIR)
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / f"{_process}-{os.getpid()}.tsv", "a") as out:
        out.write(lines)


atexit.register(flush)
