"""Bearer-token authentication of clients (coordinator and exporter), and who a client is.

Clients send ``authorization: Bearer <token>``; :class:`TokenInterceptor` compares it in
constant time and refuses anything else with UNAUTHENTICATED before the handler runs (health
checks stay open, so probes need no secret). Without TLS the token crosses the network in the
clear, so a token is only meaningful together with TLS (pipeshard.tls).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path

import grpc

from pipeshard.errors import Unauthenticated

AUTHORIZATION = "authorization"
_OPEN_PREFIXES = ("/grpc.health.v1.Health/",)


def token_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    return ((AUTHORIZATION, f"Bearer {token}"),) if token else ()


def bearer_of(metadata: Iterable[tuple[str, str | bytes]] | None) -> str | None:
    for key, value in metadata or ():
        if key == AUTHORIZATION:
            text = value.decode(errors="replace") if isinstance(value, bytes) else value
            scheme, _, token = text.partition(" ")
            return token.strip() if scheme.lower() == "bearer" else None
    return None


def client_identity(context) -> str:
    """Who a caller is for per-client limits: its token (hashed), else its peer's host."""
    token = bearer_of(context.invocation_metadata())
    if token:
        return "token:" + hashlib.sha256(token.encode()).hexdigest()[:16]
    peer = context.peer() or "unknown"  # "ipv4:127.0.0.1:5432", "ipv6:[::1]:5432", "unix:..."
    family, _, rest = peer.partition(":")
    host = rest.rsplit(":", 1)[0] if family in ("ipv4", "ipv6") else rest
    return f"peer:{host or peer}"


def new_token() -> str:
    return secrets.token_urlsafe(32)


def load_or_create_token(path: Path) -> str:
    """The token stored at ``path`` (mode 0600), created there first if missing."""
    if path.exists():
        return path.read_text().strip()
    path.parent.mkdir(parents=True, exist_ok=True)
    token = new_token()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return token


class TokenInterceptor(grpc.aio.ServerInterceptor):
    """Admits a call only with the configured bearer token. Put it after the ErrorInterceptor."""

    def __init__(self, token: str):
        if not token:
            raise ValueError("token must not be empty")
        self._token = token.encode()

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        method = handler_call_details.method or ""
        if not method.startswith(_OPEN_PREFIXES):
            presented = bearer_of(handler_call_details.invocation_metadata)
            if presented is None or not hmac.compare_digest(presented.encode(), self._token):
                raise Unauthenticated("a valid bearer token is required (--token / PIPESHARD_TOKEN)")
        return await continuation(handler_call_details)
