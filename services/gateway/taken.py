"""How much of what a connection wrote its client has taken: the bytes the client's TCP stack
acknowledged (Linux ``TCP_INFO`` ``tcpi_bytes_acked``) and those still queued on our side
(``TIOCOUTQ``: unsent plus unacknowledged). A client that stops reading stops acknowledging once
its receive buffer is full, whatever our own buffers could still hold."""

from __future__ import annotations

import fcntl
import socket
import struct
import termios

_TCP_INFO_BYTES = 256
_BYTES_ACKED_OFFSET = 120  # struct tcp_info: after the u8/u32 fields and two u64 pacing rates


class TakenMeter:
    """Reads one connected TCP socket's acknowledged and queued bytes."""

    def __init__(self, sock: socket.socket):
        self._sock = sock

    @classmethod
    def of(cls, sock: socket.socket | None) -> TakenMeter | None:
        """A meter for ``sock``, or None where the kernel does not tell (not TCP, not Linux)."""
        if sock is None or not hasattr(socket, "TCP_INFO"):
            return None
        meter = cls(sock)
        try:
            meter.taken()
            meter.queued()
        except (OSError, struct.error):
            return None
        return meter

    def taken(self) -> int:
        """Bytes the client has acknowledged since the connection opened (counting its SYN)."""
        info = self._sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_BYTES)
        return struct.unpack_from("=Q", info, _BYTES_ACKED_OFFSET)[0]

    def queued(self) -> int:
        """Bytes in the kernel's send queue the client has not acknowledged yet."""
        out = fcntl.ioctl(self._sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0")
        return struct.unpack("=i", out)[0]
