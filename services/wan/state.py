"""What a WAN fleet leaves in its run folder, and the teardown any process can do from it.

``pids`` (the launcher's: forwarder, stages, coordinator), ``namespaces`` (written before any is
created, so a half-built fleet is found too) and ``watchdog`` (its pid). ``pipeshard wan down``
and the watchdog tear down from these files; the owning process uses its own handles instead.
"""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path

from pipeshard.services.launcher import stop_recorded
from pipeshard.services.wan import netns

NAMESPACES = "namespaces"
WATCHDOG = "watchdog"


def recorded_namespaces(run_dir: Path) -> list[str]:
    path = run_dir / NAMESPACES
    return path.read_text().split() if path.exists() else []


def forget(run_dir: Path) -> None:
    for name in ("pids", NAMESPACES, WATCHDOG):
        (run_dir / name).unlink(missing_ok=True)


def teardown(run_dir: Path) -> tuple[list[str], list[str]]:
    """Stop the recorded processes and delete the recorded namespaces; returns (processes, namespaces).

    A record none of whose processes still runs is stale: its namespace names (one subnet per
    machine) may be another fleet's by now, so only those no process lives in are deleted."""
    watchdog = run_dir / WATCHDOG
    pid = int(watchdog.read_text()) if watchdog.exists() else None
    if pid is not None and pid != os.getpid():  # the watchdog itself may be the one tearing down
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    stopped = stop_recorded(run_dir)
    names = recorded_namespaces(run_dir)
    if not stopped:
        orphans = set(netns.orphans())
        names = [name for name in names if name in orphans]
    netns.destroy(names)
    forget(run_dir)
    return stopped, names
