"""The gateway's caps on open streams: per identity and in all, and who an identity is."""

from __future__ import annotations

import pytest

from pipeshard.auth import Authenticator
from pipeshard.services.gateway.errors import GatewayError
from pipeshard.services.gateway.streams import StreamCaps, caller_identity, parse_proxies


def test_streams_are_capped_per_identity_and_in_all():
    caps = StreamCaps(per_identity=2, total=3)
    caps.open("peer:a")
    caps.open("peer:a")
    with pytest.raises(GatewayError, match="max-streams-per-identity") as info:
        caps.open("peer:a")
    assert info.value.status == 429
    caps.open("peer:b")
    with pytest.raises(GatewayError, match="--max-streams"):
        caps.open("peer:c")
    caps.close("peer:a")
    caps.open("peer:c")  # a closed stream frees its place


def test_a_forwarded_host_counts_only_behind_a_trusted_proxy():
    open_fleet = Authenticator.from_settings(None, None)
    proxies = parse_proxies("10.0.0.5, 10.0.0.6")
    assert caller_identity(open_fleet, "", "10.0.0.5", "1.2.3.4, 5.6.7.8", proxies) == "peer:5.6.7.8"
    assert caller_identity(open_fleet, "", "9.9.9.9", "5.6.7.8", proxies) == "peer:9.9.9.9"
    # An open fleet ignores bearer tokens: inventing one does not make a caller many.
    assert caller_identity(open_fleet, "Bearer made-up", "9.9.9.9", "", proxies) == "peer:9.9.9.9"
    secured = Authenticator.from_settings("fleet-token", None)
    assert caller_identity(secured, "Bearer fleet-token", "9.9.9.9", "", proxies) == "token:fleet"
