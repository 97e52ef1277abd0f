"""A memory cap on one process: a child cgroup of this process's own, with a byte limit.

cgroup v1 (the ``memory`` controller mounted at /sys/fs/cgroup/memory: ``memory.limit_in_bytes``,
peak ``memory.max_usage_in_bytes``, kills in ``memory.oom_control``) or v2 (the unified hierarchy:
``memory.max``, peak ``memory.peak``, ``memory.events`` oom_kill), whichever has a memory
controller this process may write under. The cgroup is made below the caller's own cgroup, so
nothing outside its subtree is touched; the kernel counts the page cache a process maps (shard
``.bin`` files) against the limit, and reclaims it before it kills. ``close`` removes the cgroup
once its processes are gone.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass
from pathlib import Path

from pipeshard.errors import FailedPrecondition

CGROUP_ROOT = Path("/sys/fs/cgroup")


@dataclass(frozen=True)
class CgroupFiles:
    """Which file names one cgroup version uses for the limit, the peak and the kills."""

    version: int
    limit: str
    peak: str
    events: str  # where the oom_kill count is


V1 = CgroupFiles(1, "memory.limit_in_bytes", "memory.max_usage_in_bytes", "memory.oom_control")
V2 = CgroupFiles(2, "memory.max", "memory.peak", "memory.events")


def _own_cgroup(root: Path = CGROUP_ROOT) -> tuple[Path, CgroupFiles]:
    """This process's memory cgroup folder (v1 memory controller first, else v2) and its files."""
    lines = Path("/proc/self/cgroup").read_text().splitlines()
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(",") and (root / "memory").is_dir():
            return root / "memory" / path.lstrip("/"), V1
    for line in lines:
        if line.startswith("0::"):
            base = root / "unified" if (root / "unified" / "cgroup.controllers").is_file() else root
            folder = base / line[3:].lstrip("/")
            if "memory" in (base / "cgroup.controllers").read_text().split():
                return folder, V2
    raise FailedPrecondition("no writable cgroup memory controller (v1 memory or v2 memory.max) here")


class MemoryCap:
    """One cgroup with a memory limit; ``add`` moves a process (and its later threads) into it."""

    def __init__(self, name: str, limit_bytes: int, root: Path = CGROUP_ROOT):
        parent, self.files = _own_cgroup(root)
        self.path = parent / f"pipeshard-{os.getpid()}-{name}"
        self.limit_bytes = limit_bytes
        try:
            self.path.mkdir(exist_ok=True)
            (self.path / self.files.limit).write_text(str(limit_bytes))
            if self.files.version == 1 and (self.path / "memory.memsw.limit_in_bytes").exists():
                with contextlib.suppress(OSError):  # no swap here, but never let it hide the cap
                    (self.path / "memory.memsw.limit_in_bytes").write_text(str(limit_bytes))
        except OSError as exc:
            raise FailedPrecondition(f"cannot create the memory cgroup {self.path}: {exc}") from None

    def add(self, pid: int) -> None:
        (self.path / "cgroup.procs").write_text(str(pid))

    def peak_bytes(self) -> int:
        """The most memory the cgroup held (0 where the kernel does not report it)."""
        try:
            return int((self.path / self.files.peak).read_text())
        except (OSError, ValueError):
            return 0

    def oom_kills(self) -> int:
        """Processes the kernel killed for the limit (v2 ``memory.events``, v1 ``memory.oom_control``)."""
        try:
            for line in (self.path / self.files.events).read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
        except (OSError, ValueError):
            pass
        return 0

    def close(self, timeout_s: float = 10.0) -> None:
        """Remove the cgroup (after its processes exit; a busy one is left for the kernel)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.2)
