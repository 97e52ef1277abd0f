"""Network namespaces as the machines of a multi-host deployment (names ``psd-*``, 10.88.0.x).

A switch namespace holds a bridge every host's veth joins: bridged frames then meet that
namespace's own (empty) firewall, not the root's (Docker's FORWARD policy drops them). The root
namespace joins the bridge too (10.88.0.1), as the user's laptop, so a test's client dials the
hosts directly. Each host runs its commands in its own working folder.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

PREFIX = "psd-"
SWITCH = f"{PREFIX}net"
BRIDGE = f"{PREFIX}br"
ROOT_IP = "10.88.0.1"


@dataclass(frozen=True)
class Host:
    """One emulated machine: its namespace, address and working folder."""

    name: str
    ip: str
    folder: Path

    @property
    def namespace(self) -> str:
        return f"{PREFIX}{self.name}"

    def prefix(self) -> list[str]:
        """Run a command on this host, in its folder (both exec: the pid stays the command's)."""
        return ["ip", "netns", "exec", self.namespace, "env", "-C", str(self.folder)]


def _run(*cmd: str) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {done.stderr.strip()}")


def missing() -> str | None:
    """Why hosts cannot be made here (None when they can)."""
    import os

    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "iproute2 (`ip`) is not installed"
    if subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.count(SWITCH):
        return f"namespace {SWITCH} exists (a run still going, or left over: `ip netns del {SWITCH}`)"
    return None


def _veth(namespace: str | None, tag: str, ip: str) -> None:
    """A veth from ``namespace`` (None: root) into the switch's bridge, with address ``ip``."""
    outer, inner = f"{PREFIX}{tag}-b", f"{PREFIX}{tag}-h"
    _run("ip", "link", "add", inner, "type", "veth", "peer", "name", outer, "netns", SWITCH)
    _run("ip", "-n", SWITCH, "link", "set", outer, "master", BRIDGE, "up")
    ns = ["-n", namespace] if namespace else []
    if namespace:
        _run("ip", "link", "set", inner, "netns", namespace)
        _run("ip", *ns, "link", "set", "lo", "up")
    _run("ip", *ns, "addr", "add", f"{ip}/24", "dev", inner)
    _run("ip", *ns, "link", "set", inner, "up")


def create(hosts: list[Host]) -> None:
    _run("ip", "netns", "add", SWITCH)
    _run("ip", "-n", SWITCH, "link", "add", BRIDGE, "type", "bridge")
    _run("ip", "-n", SWITCH, "link", "set", BRIDGE, "up")
    _veth(None, "root", ROOT_IP)
    for host in hosts:
        host.folder.mkdir(parents=True, exist_ok=True)
        _run("ip", "netns", "add", host.namespace)
        _veth(host.namespace, host.name, host.ip)


def destroy(hosts: list[Host]) -> None:
    subprocess.run(["ip", "link", "del", f"{PREFIX}root-h"], capture_output=True)
    for namespace in [h.namespace for h in hosts] + [SWITCH]:
        subprocess.run(["ip", "netns", "del", namespace], capture_output=True)
