"""Channel options shared by every hop: fast reconnect, keepalive, large messages.

Keepalive is also how a hop that stalls without closing (a partition: the peer's socket stays
open, no byte comes back) is found: a ping unanswered for ``PIPESHARD_KEEPALIVE_TIMEOUT_S``
(default 5) after at most ``PIPESHARD_KEEPALIVE_S`` (default 5) of silence closes the connection,
and every call on it fails UNAVAILABLE. A stalled hop is therefore a dead hop within the sum
(10 s by default) plus the moment it takes to report (docs/RELIABILITY.md, "Link faults").
"""

from __future__ import annotations

import os

import grpc

from pipeshard.errors import InvalidArgument
from pipeshard.tls import TlsConfig

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
KEEPALIVE_S = 5.0
KEEPALIVE_TIMEOUT_S = 5.0
MIN_KEEPALIVE_S = 0.5  # servers accept pings this often (grpc_server.py's min_ping_interval_ms)


def _seconds(name: str, default: float) -> float:
    raw = os.environ.get(name, "")
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise InvalidArgument(name, f"must be a number of seconds, got {raw!r}") from None
    if not value >= MIN_KEEPALIVE_S:
        raise InvalidArgument(name, f"must be at least {MIN_KEEPALIVE_S:g} s, got {raw!r}")
    return value


def keepalive() -> tuple[float, float]:
    """(ping after this much silence, close if unanswered this long), from the environment."""
    return (
        _seconds("PIPESHARD_KEEPALIVE_S", KEEPALIVE_S),
        _seconds("PIPESHARD_KEEPALIVE_TIMEOUT_S", KEEPALIVE_TIMEOUT_S),
    )


def channel_options() -> list[tuple[str, int]]:
    every_s, timeout_s = keepalive()
    return [
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.keepalive_time_ms", int(every_s * 1000)),
        ("grpc.keepalive_timeout_ms", int(timeout_s * 1000)),
        # Any ping's ack, not only keepalive's: a keepalive waits behind a ping already in flight
        # (gRPC's BDP probe), whose own timeout is otherwise a minute.
        ("grpc.http2.ping_timeout_ms", int(timeout_s * 1000)),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        # A hop that comes back is found within a second or two, whatever the start order.
        ("grpc.initial_reconnect_backoff_ms", 200),
        ("grpc.min_reconnect_backoff_ms", 200),
        ("grpc.max_reconnect_backoff_ms", 2_000),
    ]


def open_channel(address: str, tls: TlsConfig | None = None) -> grpc.aio.Channel:
    """Plaintext, or with ``tls`` mutual TLS as the fleet member ``tls`` names."""
    options = channel_options()
    if tls is None:
        return grpc.aio.insecure_channel(address, options=options)
    return grpc.aio.secure_channel(address, tls.channel_credentials(), options=options)
