"""How many more bytes this process can hold before the kernel has to take memory from someone.

The machine's available memory (MemAvailable: free memory and the page cache it can drop), and, under
a cgroup memory limit (a container, `pipeshard up --stage-memory-limit`), that limit less the cgroup's
anonymous memory (its page cache is dropped before the kernel kills): in a container MemAvailable
is the host's, so the limit is what counts there.
"""

from __future__ import annotations

from pathlib import Path

import psutil

CGROUP_ROOT = Path("/sys/fs/cgroup")
# cgroup v2's and v1's memory controller: the limit's file, memory.stat's anonymous memory key
_FILES = (("", "memory.max", "anon"), ("memory", "memory.limit_in_bytes", "total_rss"))


def _cgroup_room(root: Path) -> int | None:
    """The cgroup's limit less its anonymous memory; None when this process is under no limit."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        for controller, limit, anon in _FILES:
            if controller not in controllers.split(","):  # v2's line names none: "0::/path"
                continue
            folder = root / controller / path.lstrip("/")
            try:
                cap = (folder / limit).read_text().strip()
                rows = (row.partition(" ") for row in (folder / "memory.stat").read_text().splitlines())
                used = int({key: value for key, _, value in rows}[anon])
            except (OSError, ValueError, KeyError):
                continue
            if cap.isdigit() and int(cap) < 1 << 60:  # v1 writes "no limit" as a huge number
                return int(cap) - used
    return None


def available_bytes(root: Path = CGROUP_ROOT) -> int:
    """What this process may still allocate: MemAvailable, or its cgroup's room when smaller."""
    machine = int(psutil.virtual_memory().available)
    room = _cgroup_room(root)
    return machine if room is None else min(machine, room)
