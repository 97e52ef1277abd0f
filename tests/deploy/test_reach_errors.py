"""A node that cannot reach its exporter or next hop says so in one line naming the fix, instead
of waiting in silence: nothing listening, a certificate made for another host."""

from __future__ import annotations

import asyncio
import socket

import pytest
import structlog

from pipeshard.errors import Unavailable
from pipeshard.reach import is_tls_failure, unreachable_hint
from pipeshard.services.transport import hop
from pipeshard.shard.pull import pull_shard


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_exporter_nobody_runs_fails_the_pull_naming_the_fix(tmp_path):
    port = _closed_port()
    with pytest.raises(Unavailable) as info:
        pull_shard(f"127.0.0.1:{port}", tmp_path / "export", 0, connect_timeout_s=3)
    message = str(info.value)
    assert f"cannot reach the exporter at 127.0.0.1:{port}: nothing listens on port {port}" in message
    assert "\n" not in message and not (tmp_path / "export").exists()


@pytest.mark.parametrize(
    ("details", "fix", "tls"),
    [
        (
            "Custom verification check failed: Hostname Verification Check failed.",
            "not made for 10.88.0.3",
            True,
        ),
        ("Ssl handshake failed: CERTIFICATE_VERIFY_FAILED", "another fleet's CA", True),
        ("failed to connect to all addresses; Connection refused", "nothing listens on port 50062", False),
        ("Deadline Exceeded", "its firewall lets port 50062 in", False),
    ],
)
def test_each_cause_is_named_with_its_fix(details, fix, tls):
    hint = unreachable_hint("next hop", "10.88.0.3:50062", details)
    assert hint.startswith("cannot reach the next hop at 10.88.0.3:50062: ") and fix in hint
    assert is_tls_failure(details) == tls


def test_an_unreachable_next_hop_is_logged_with_the_fix(monkeypatch):
    monkeypatch.setattr(hop, "UNREACHABLE_AFTER_S", 0.3)
    port = _closed_port()

    async def run() -> list[dict]:
        stream = hop.HopStream(f"127.0.0.1:{port}")
        with structlog.testing.capture_logs() as logs:
            stream.start()
            await asyncio.sleep(1.5)
            await stream.close()
        return logs

    errors = [e for e in asyncio.run(run()) if e["event"] == "next_hop_unreachable"]
    assert errors and f"nothing listens on port {port}" in errors[0]["hint"]
