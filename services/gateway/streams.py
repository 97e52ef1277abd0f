"""Open SSE streams, counted per identity and in all, so idle readers cannot block the gateway.

A streamed generation holds a coordinator slot for as long as its reader takes: a client that
never reads holds it until the buffers between them fill and the drain timeout cuts it, which on
one host with default sockets took minutes (docs/SECURITY.md). So each identity (an API key, the
fleet token, or for an open gateway the caller's host) may hold ``per_identity`` streams, and all
callers ``total``; one over is 429 at once. Non-streamed requests are not counted: with ``total``
below the coordinator's ``--max-running``, the slots above it are a reserve that a normal request
always finds free, however many streams are open.

Behind a reverse proxy every caller's host is the proxy's: ``trusted_proxies`` names the proxies
whose ``X-Forwarded-For`` (its last entry, the one the proxy added) is taken as the caller's host.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from pipeshard.auth import Authenticator
from pipeshard.services.gateway.errors import GatewayError


@dataclass
class StreamCaps:
    per_identity: int
    total: int
    _open: Counter = field(default_factory=Counter)

    def open(self, identity: str) -> None:
        """Counts a stream of ``identity``, or refuses it (429) naming the limit it meets."""
        if self._open[identity] >= self.per_identity:
            raise GatewayError(
                429,
                f"{identity} has {self._open[identity]} streams open, the most one caller may "
                "(--max-streams-per-identity); read or close one first",
                code="too_many_streams",
            )
        if sum(self._open.values()) >= self.total:
            raise GatewayError(
                429, f"the gateway has {self.total} streams open (--max-streams)", code="too_many_streams"
            )
        self._open[identity] += 1

    def close(self, identity: str) -> None:
        self._open[identity] -= 1
        if self._open[identity] <= 0:
            del self._open[identity]


def caller_identity(
    auth: Authenticator, authorization: str, peer: str, forwarded_for: str, trusted_proxies: frozenset[str]
) -> str:
    """Who a request is, as the coordinator would name it: its verified key, else its host."""
    if auth.required:
        scheme, _, key = authorization.partition(" ")
        identity = auth.verify(key.strip()) if scheme.lower() == "bearer" else None
        if identity is not None:
            return identity.name
    if peer in trusted_proxies and forwarded_for:
        return f"peer:{forwarded_for.split(',')[-1].strip()}"
    return f"peer:{peer}"


def parse_proxies(text: str) -> frozenset[str]:
    return frozenset(p.strip() for p in text.split(",") if p.strip())
