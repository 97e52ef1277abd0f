"""The per-chunk write deadline, against a real `pipeshard serve-openai` process before the
scripted coordinator: a stream whose reader takes no chunk (its receive buffer full, however much
the gateway's own buffers could still hold) is aborted, its generation cancelled and its stream
slot freed; with the deadline off the same reader holds the slot."""

from __future__ import annotations

import json
import socket
import time

import httpx2 as httpx
import pytest

from tests.gateway.conftest import FOREVER

pytestmark = pytest.mark.slow

STREAM = {"model": "m", "prompt": FOREVER, "stream": True, "max_tokens": 100000}
# One stream per caller, and a drain timeout that never fires here: only the chunk deadline can
# free the slot.
FLAGS = ("--max-streams-per-identity", "1", "--drain-timeout-s", "600")


def never_read_stream(address: str) -> socket.socket:
    """A streamed completion from a socket with a small receive buffer that is never read."""
    host, port = address.rsplit(":", 1)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((host, int(port)))
    body = json.dumps(STREAM).encode()
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    sock.sendall(head.encode() + body)
    return sock


def stream_status(address: str) -> int:
    """The status of a second stream from the same caller (200 once the first's slot is free)."""
    with httpx.stream("POST", f"http://{address}/v1/completions", json=STREAM, timeout=30) as reply:
        return reply.status_code


def seconds_until_served(address: str, patience_s: float) -> float | None:
    start = time.monotonic()
    while time.monotonic() - start < patience_s:
        if stream_status(address) == 200:
            return time.monotonic() - start
        time.sleep(0.3)
    return None


def test_a_reader_that_takes_no_chunk_is_closed_and_frees_its_slot(gateways, coordinator):
    servicer = coordinator[0]
    address = gateways("--chunk-deadline-s", "1", *FLAGS)
    cancelled = servicer.cancelled
    sock = never_read_stream(address)
    try:
        waited = seconds_until_served(address, 20)
    finally:
        sock.close()
    assert waited is not None and waited < 15, "the never-read stream kept its slot"
    assert servicer.cancelled > cancelled  # its generation was cancelled, not left running


def test_without_the_deadline_the_reader_keeps_its_slot(gateways):
    """The control: the same reader with --chunk-deadline-s 0 still holds the slot after 5 s
    (what the test above would see without its defence)."""
    address = gateways("--chunk-deadline-s", "0", *FLAGS)
    sock = never_read_stream(address)
    try:
        assert seconds_until_served(address, 5) is None
    finally:
        sock.close()
