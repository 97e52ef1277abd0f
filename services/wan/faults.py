"""Link faults the forwarder can inject on a route, and the control socket that switches them.

Without netem (absent on this kernel) a route's faults are made where its bytes pass, in the
user-space forwarder, as TCP shows them to a gRPC stream:

- ``stall``: no byte moves either way; every connection stays open and new ones are accepted and
  held too. That is what a partition (or a link losing every packet) does to a TCP stream: the
  sender's kernel retransmits into the void and the application sees silence, not an error.
- ``reset``: every connection is aborted with an RST and new ones are reset as they arrive: a
  link that drops (a NAT or firewall forgetting the flow, a peer rebooting).

Each lasts ``seconds`` (0: until ``heal``). Packet loss at a rate is made by the kernel instead
(nftables in the emulator's namespaces, netns.py): TCP turns it into retransmits and stalls, which
only real packets show. The control socket is a Unix socket taking one command a line:
``stall SECONDS [LISTEN]``, ``reset SECONDS [LISTEN]``, ``heal [LISTEN]`` (no LISTEN: every route);
it answers ``ok`` or ``error: ...``.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from pathlib import Path

FAULTS = ("stall", "reset", "heal")


class LinkFaults:
    """One route's fault state; the forwarder's pumps consult it for every chunk and connection."""

    def __init__(self) -> None:
        self.flowing = asyncio.Event()
        self.flowing.set()
        self.resetting = False
        self.connections: set[asyncio.StreamWriter] = set()
        self._timer: asyncio.TimerHandle | None = None

    def stall(self, seconds: float) -> None:
        self.heal()
        self.flowing.clear()
        self._heal_after(seconds)

    def reset(self, seconds: float) -> None:
        self.heal()
        self.resetting = True
        for writer in list(self.connections):
            abort(writer)
        self._heal_after(seconds)

    def heal(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.flowing.set()
        self.resetting = False

    def _heal_after(self, seconds: float) -> None:
        if seconds > 0:
            self._timer = asyncio.get_running_loop().call_later(seconds, self.heal)


def abort(writer: asyncio.StreamWriter) -> None:
    """Closes with an RST (SO_LINGER 0), not a FIN: the peer sees ECONNRESET, as from a dropped link."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


def apply(faults: dict[str, LinkFaults], line: str) -> str:
    """Runs one control command on the routes it names; returns the answer line."""
    words = line.split()
    if not words or words[0] not in FAULTS:
        return f"error: command must be one of {', '.join(FAULTS)}, got {line.strip()!r}"
    kind, rest = words[0], words[1:]
    seconds = 0.0
    if kind != "heal":
        try:
            seconds = float(rest.pop(0))
        except (IndexError, ValueError):
            return f"error: {kind} needs SECONDS (0: until heal), got {line.strip()!r}"
        if not seconds >= 0:
            return f"error: SECONDS must be >= 0, got {seconds:g}"
    if len(rest) > 1:
        return f"error: at most one route, got {' '.join(rest)!r}"
    targets = [faults[rest[0]]] if rest and rest[0] in faults else list(faults.values()) if not rest else []
    if not targets:
        return f"error: no route listens on {rest[0]!r} (routes: {', '.join(faults)})"
    for target in targets:
        if kind == "heal":
            target.heal()
        else:
            getattr(target, kind)(seconds)
    return "ok"


async def serve_control(path: Path, faults: dict[str, LinkFaults]) -> asyncio.Server:
    """The control socket at ``path`` over ``faults`` (listen address -> its route's faults)."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while line := await reader.readline():
            writer.write((apply(faults, line.decode(errors="replace")) + "\n").encode())
            await writer.drain()
        writer.close()

    path.unlink(missing_ok=True)
    return await asyncio.start_unix_server(handle, str(path))


def command(path: Path, line: str, timeout_s: float = 5.0) -> None:
    """Sends one command to a forwarder's control socket; raises RuntimeError on an ``error`` answer."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout_s)
        sock.connect(str(path))
        sock.sendall(line.encode() + b"\n")
        answer = sock.makefile().readline().strip()
    if answer != "ok":
        raise RuntimeError(f"forwarder at {path}: {answer or 'no answer'}")
