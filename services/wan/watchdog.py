"""Tears a WAN fleet down when its owner dies or its time is up, whoever forgot to.

``python -m pipeshard.services.wan.watchdog RUN_DIR [--owner-pid P] [--ttl-s T]``: a benchmark killed with
SIGKILL runs no atexit hook, and a detached ``wan up`` has no owner at all; without this, stage
processes and namespaces would outlive both. It waits on a pidfd, so it wakes the moment the owner
exits (reaped or not), and sleeps otherwise.
"""

from __future__ import annotations

import argparse
import os
import select
import sys
from pathlib import Path

from pipeshard.services.wan.state import teardown


def wait(owner_pid: int | None, ttl_s: float | None) -> None:
    """Returns when the owner exits or ``ttl_s`` passes (with neither, only a signal ends it)."""
    try:
        fds = [os.pidfd_open(owner_pid)] if owner_pid is not None else []
    except ProcessLookupError:
        return
    select.select(fds, [], [], ttl_s)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipeshard.services.wan.watchdog", description=__doc__)
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--owner-pid", type=int, default=None)
    parser.add_argument("--ttl-s", type=float, default=None)
    args = parser.parse_args(argv)
    wait(args.owner_pid, args.ttl_s)
    stopped, names = teardown(args.run_dir)
    print(f"watchdog stopped {', '.join(stopped) or 'nothing'}; deleted {', '.join(names) or 'nothing'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
