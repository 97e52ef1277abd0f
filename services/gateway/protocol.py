"""uvicorn's HTTP/1.1 protocol with the timeouts a public server needs.

uvicorn offers ``timeout_keep_alive`` (an idle keep-alive connection is closed; the gateway's
``--idle-timeout-s``) and h11's ``max_incomplete_event_size`` (headers over 16 KiB are a 400), but
its keep-alive timer stops at the first byte of a request, so a connection that sends its headers
a byte at a time is kept forever, and so is a reader that stops reading a response. Here:

- headers: a request's headers must be complete ``header_timeout_s`` after the connection opened
  or its previous response ended; else the connection is closed.
- drain: asyncio pauses writes once a connection holds more unsent bytes than its buffer limit;
  when writes stay paused ``drain_timeout_s`` the connection is aborted. Its route sees a
  disconnect, so a streaming generation is cancelled and its coordinator slot freed.
- chunk deadline: every write (an SSE event of a stream) must be taken by the client, that is
  acknowledged by its TCP stack (:mod:`taken`), ``chunk_deadline_s`` after it was written; else
  the connection is aborted as for a stalled drain. Our own buffers (asyncio's and the kernel's
  send buffer, megabytes on a fast link) no longer hide a reader that stopped: only the client's
  receive buffer does, and a chunk behind a full one is not taken.
"""

from __future__ import annotations

import asyncio
import socket
from collections import deque

import structlog
from uvicorn.protocols.http.h11_impl import H11Protocol

from pipeshard.metrics import counter
from pipeshard.services.gateway.taken import TakenMeter

log = structlog.get_logger(__name__)
CLOSED = counter(
    "pipeshard_gateway_connections_closed_total",
    "HTTP connections the gateway closed on its own, by reason (header_timeout, stalled_write, "
    "chunk_deadline).",
    ("reason",),
)


class _WriteWatch:
    """A transport that tells its protocol after every write; everything else is the transport's."""

    def __init__(self, transport: asyncio.Transport, on_write):
        self._transport = transport
        self._on_write = on_write

    def write(self, data: bytes) -> None:
        self._transport.write(data)
        self._on_write()

    def __getattr__(self, name: str):
        return getattr(self._transport, name)


def guarded_protocol(
    header_timeout_s: float, drain_timeout_s: float, write_buffer_bytes: int, chunk_deadline_s: float = 0.0
):
    """The protocol class for ``uvicorn.Config(http=...)`` with these limits (0 s: no chunk deadline)."""
    check_every = min(0.5, chunk_deadline_s / 4)

    class GuardedH11Protocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None
        _drain_timer: asyncio.TimerHandle | None = None
        _chunk_timer: asyncio.TimerHandle | None = None
        _meter: TakenMeter | None = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            sock = transport.get_extra_info("socket")
            if write_buffer_bytes:
                transport.set_write_buffer_limits(high=write_buffer_bytes)
                if sock is not None:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, write_buffer_bytes)
            if chunk_deadline_s > 0:
                self._meter = TakenMeter.of(sock)
            if self._meter is not None:
                # (the end of a chunk in bytes the client will have taken, when it must have)
                self._chunks: deque[tuple[int, float]] = deque()
                self.transport = _WriteWatch(transport, self._wrote)  # type: ignore[assignment]
            self._arm_header_timer()

        def _in_request(self) -> bool:
            return self.cycle is not None and not self.cycle.response_complete

        def _arm_header_timer(self) -> None:
            self._cancel("_header_timer")
            self._header_timer = self.loop.call_later(header_timeout_s, self._header_timeout)

        def _cancel(self, name: str) -> None:
            timer = getattr(self, name)
            if timer is not None:
                timer.cancel()
                setattr(self, name, None)

        def _header_timeout(self) -> None:
            self._header_timer = None
            if not self._in_request() and not self.transport.is_closing():
                CLOSED.labels(reason="header_timeout").inc()
                log.info("closing a connection whose request headers did not arrive", client=self.client)
                self.transport.close()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self._in_request():
                self._cancel("_header_timer")

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and not self._in_request():
                self._arm_header_timer()

        def pause_writing(self) -> None:
            super().pause_writing()
            if self._drain_timer is None:
                self._drain_timer = self.loop.call_later(drain_timeout_s, self._stalled)

        def resume_writing(self) -> None:
            super().resume_writing()
            self._cancel("_drain_timer")

        def _stalled(self) -> None:
            self._drain_timer = None
            CLOSED.labels(reason="stalled_write").inc()
            log.info("aborting a connection whose reader stopped reading", client=self.client)
            self.transport.abort()

        def _wrote(self) -> None:
            assert self._meter is not None
            try:
                end = self._meter.taken() + self._meter.queued() + self.transport.get_write_buffer_size()
            except OSError:  # the connection is going; connection_lost follows
                return
            self._chunks.append((end, self.loop.time() + chunk_deadline_s))
            if self._chunk_timer is None:
                self._chunk_timer = self.loop.call_later(check_every, self._check_chunks)

        def _check_chunks(self) -> None:
            """Forgets the chunks the client took; aborts when the oldest left is past its deadline."""
            assert self._meter is not None
            self._chunk_timer = None
            try:
                taken = self._meter.taken()
            except OSError:
                return
            while self._chunks and self._chunks[0][0] <= taken:
                self._chunks.popleft()
            if not self._chunks:
                return
            if self.loop.time() >= self._chunks[0][1]:
                CLOSED.labels(reason="chunk_deadline").inc()
                log.info(
                    "aborting a connection whose reader took no chunk in time",
                    client=self.client,
                    chunk_deadline_s=chunk_deadline_s,
                )
                self._chunks.clear()
                self.transport.abort()
                return
            self._chunk_timer = self.loop.call_later(check_every, self._check_chunks)

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel("_header_timer")
            self._cancel("_drain_timer")
            self._cancel("_chunk_timer")
            super().connection_lost(exc)

    return GuardedH11Protocol
