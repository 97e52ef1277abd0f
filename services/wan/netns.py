"""Network namespaces and bandwidth-capped veth pairs, one per emulated machine.

Stage k lives in namespace ``psw-<k>``, joined to the root namespace by the veth pair
``psw-<k>-r`` (root side, 10.77.<k>.1) and ``psw-<k>-n`` (namespace side, 10.77.<k>.2). With a
rate, both ends get a ``tc tbf`` root qdisc, so each direction is capped. Every object carries the
``psw-`` prefix and nothing else is ever touched; the fixed subnet means one emulator per machine,
which ``require_free`` enforces.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from dataclasses import dataclass

PREFIX = "psw-"


class WanError(RuntimeError):
    """The emulator cannot run here, or a command it needs failed (the message says which)."""


@dataclass(frozen=True)
class Link:
    """Where one emulated machine sits: its namespace, veth names and the two addresses."""

    index: int

    @property
    def namespace(self) -> str:
        return f"{PREFIX}{self.index}"

    @property
    def root_if(self) -> str:
        return f"{PREFIX}{self.index}-r"

    @property
    def ns_if(self) -> str:
        return f"{PREFIX}{self.index}-n"

    @property
    def root_ip(self) -> str:
        return f"10.77.{self.index}.1"

    @property
    def ns_ip(self) -> str:
        return f"10.77.{self.index}.2"

    @property
    def exec_prefix(self) -> list[str]:
        """Runs a command inside the namespace (``ip netns exec`` execs it: the pid is the command's)."""
        return ["ip", "netns", "exec", self.namespace]


def require_root(rate_limited: bool) -> None:
    if os.geteuid() != 0:
        raise WanError("the WAN emulator needs root (it creates network namespaces, veth pairs, tc qdiscs)")
    for tool in ("ip", "tc") if rate_limited else ("ip",):
        if shutil.which(tool) is None:
            raise WanError(f"the WAN emulator needs `{tool}` (iproute2), which is not on PATH")


def _run(*cmd: str) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise WanError(f"`{' '.join(cmd)}` failed: {done.stderr.strip()}")


def namespaces() -> list[str]:
    """The emulator's namespaces that exist now (``ip netns list`` filtered by the prefix)."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(PREFIX)]


def interfaces() -> list[str]:
    """The emulator's veth ends visible in the root namespace."""
    out = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, check=True).stdout
    names = [line.split(":")[1].strip().split("@")[0] for line in out.splitlines()]
    return [name for name in names if name.startswith(PREFIX)]


def orphans() -> list[str]:
    """``psw-`` namespaces no process lives in: leftovers of an emulator killed with its watchdog."""
    return [
        name
        for name in namespaces()
        if not subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True).stdout.strip()
    ]


def require_free() -> None:
    """One emulator per machine (the subnet is fixed): refuse while any ``psw-`` object exists."""
    taken = namespaces() + interfaces()
    if taken:
        raise WanError(
            f"{', '.join(taken)} already exist: another WAN emulator is up, or a leftover of one "
            "(`pipeshard wan down`; or by hand `ip link del psw-<k>-r; ip netns del psw-<k>`)"
        )


def create(link: Link, rate_mbit: float | None, burst_kb: int = 64, queue_ms: int = 200) -> None:
    """Namespace, veth pair, addresses and (with ``rate_mbit``) a tbf on both ends.

    tbf's ``latency`` bounds its queue (``rate * latency + burst`` bytes); 200 ms holds a full
    prefill frame at 100 mbit, so the cap paces large frames instead of dropping them."""
    _run("ip", "netns", "add", link.namespace)
    veth = ["type", "veth", "peer", "name", link.ns_if, "netns", link.namespace]
    _run("ip", "link", "add", link.root_if, *veth)
    _run("ip", "addr", "add", f"{link.root_ip}/24", "dev", link.root_if)
    _run("ip", "link", "set", link.root_if, "up")
    _run("ip", "-n", link.namespace, "addr", "add", f"{link.ns_ip}/24", "dev", link.ns_if)
    _run("ip", "-n", link.namespace, "link", "set", link.ns_if, "up")
    _run("ip", "-n", link.namespace, "link", "set", "lo", "up")
    if rate_mbit:
        tbf = ["root", "tbf", "rate", f"{rate_mbit:g}mbit", "burst", f"{burst_kb}kb"]
        tbf += ["latency", f"{queue_ms}ms"]
        _run("tc", "qdisc", "add", "dev", link.root_if, *tbf)
        _run("tc", "-n", link.namespace, "qdisc", "add", "dev", link.ns_if, *tbf)


def destroy(names: list[str]) -> None:
    """Delete these namespaces and their veth pairs; missing ones are skipped.

    The root end is deleted first (it takes its peer along at once): a namespace's own teardown
    is asynchronous in the kernel, so its veth could otherwise linger for a moment."""
    for name in names:
        if not name.startswith(PREFIX):
            raise ValueError(f"{name!r} is not one of the WAN emulator's namespaces")
        subprocess.run(["ip", "link", "del", f"{name}-r"], capture_output=True)
        subprocess.run(["ip", "netns", "del", name], capture_output=True)


# Packet faults by the kernel (nftables in the namespace; netem is absent on this kernel). They
# touch one TCP port on the root side of the link: the emulator's NEXT_HOP_PORT is stage k's hop
# to stage k+1, so the coordinator's door to stage k (the same veth) is left alone.
FAULT_TABLE = "psw_faults"
LINK_FAULTS = ("loss", "partition", "reset")


def fault(link: Link, kind: str, port: int, percent: float = 0.0) -> None:
    """Replaces the link's fault on ``port`` (both directions) by ``kind``: ``loss`` drops each
    packet with probability ``percent``/100 (TCP retransmits: stalls of an RTO and more);
    ``partition`` drops every packet (the connection stalls without closing: no RST, no FIN
    reaches either side); ``reset`` answers the namespace's packets with an RST (a link that drops)."""
    if kind not in LINK_FAULTS:
        raise ValueError(f"kind must be one of {', '.join(LINK_FAULTS)}, got {kind!r}")
    if kind == "loss" and not 0 < percent < 100:
        raise ValueError(f"percent must be in (0, 100) for loss, got {percent:g}")
    if shutil.which("nft") is None:
        raise WanError("link faults need `nft` (nftables: `apt-get install nftables`), which is not on PATH")
    match = f"numgen random mod 10000 < {round(percent * 100)} " if kind == "loss" else ""
    verdict = "reject with tcp reset" if kind == "reset" else "drop"
    inbound = "tcp flags & rst == 0 " if kind == "reset" else match  # let our own RSTs in
    ruleset = f"""table inet {FAULT_TABLE} {{
  chain out {{ type filter hook output priority 0; policy accept;
    tcp dport {port} {match}counter {verdict}
    tcp dport {port} counter
  }}
  chain in {{ type filter hook input priority 0; policy accept;
    tcp sport {port} {inbound}counter drop
    tcp sport {port} counter
  }}
}}
"""
    heal(link)
    done = subprocess.run(
        [*link.exec_prefix, "nft", "-f", "-"], input=ruleset, capture_output=True, text=True
    )
    if done.returncode != 0:
        raise WanError(f"nft in {link.namespace} failed: {done.stderr.strip()}")


def heal(link: Link) -> None:
    """Removes the link's packet fault, if any."""
    subprocess.run([*link.exec_prefix, "nft", "delete", "table", "inet", FAULT_TABLE], capture_output=True)


def fault_counts(link: Link) -> tuple[int, int]:
    """(packets the fault dropped or reset, packets it let through) since it was set, both ways."""
    done = subprocess.run(
        [*link.exec_prefix, "nft", "-j", "list", "table", "inet", FAULT_TABLE], capture_output=True, text=True
    )
    if done.returncode != 0:
        raise WanError(f"no link fault in {link.namespace}: {done.stderr.strip()}")
    hit, passed = 0, 0
    for item in json.loads(done.stdout)["nftables"]:
        expr = item.get("rule", {}).get("expr", [])
        packets = next((e["counter"]["packets"] for e in expr if "counter" in e), 0)
        if any("drop" in e or "reject" in e for e in expr):
            hit += packets
        else:
            passed += packets
    return hit, passed
