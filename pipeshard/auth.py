"""Bearer-token authentication of clients (coordinator, exporter, gateway), and who a client is.

Clients send ``authorization: Bearer <token>``: the fleet token or an API key (pipeshard.keys).
:class:`AuthInterceptor` checks it in constant time and refuses anything else with
UNAUTHENTICATED before the handler runs; :meth:`Authenticator.identify` names the caller for
quotas, fair share, metrics and the prefix-cache scope. Without TLS a token or key crosses the
network in the clear, so either is only meaningful together with TLS (pipeshard.tls).
"""

from __future__ import annotations

import hmac
import os
import secrets
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path

import grpc

from pipeshard.errors import Unauthenticated
from pipeshard.identity import Identity
from pipeshard.keys import KeyRing

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


def peer_host(peer: str | None) -> str:
    """The host of a gRPC peer string: "ipv4:127.0.0.1:5432", "ipv6:[::1]:5432", "unix:..."."""
    peer = peer or "unknown"
    family, _, rest = peer.partition(":")
    host = rest.rsplit(":", 1)[0] if family in ("ipv4", "ipv6") else rest
    return host or peer


FLEET_TOKEN_IDENTITY = Identity(name="token:fleet")


class Authenticator:
    """Who a caller is, from what it presents: the one resolver of identities.

    - A listed API key (pipeshard.keys) is ``key:NAME`` with that key's weight and limits.
    - The fleet token (``--token`` / PIPESHARD_TOKEN) is one identity, ``token:fleet``.
    - Without a token or key file the service is open: a bearer token proves nothing there, so it
      is ignored (a caller inventing tokens must not become many clients) and a caller is its
      peer's host, ``peer:HOST``: every caller on one machine (a gateway's users included) is one
      identity. On such a fleet nothing tells two users on one host apart.
    - With a token or key file, TLS or not, every call must present one of them
      (:class:`AuthInterceptor`); anything else is refused before it is identified.
    """

    def __init__(self, token: str | None = None, keys: KeyRing | None = None):
        self._token = token.encode() if token else None
        self._keys = keys

    @classmethod
    def from_settings(cls, token: str | None, api_keys: Path | None) -> Authenticator:
        return cls(token, KeyRing(api_keys) if api_keys is not None else None)

    @property
    def required(self) -> bool:
        """Whether callers must present a token or key (else the service is open)."""
        return self._token is not None or self._keys is not None

    def verify(self, presented: str | None) -> Identity | None:
        """The identity a presented token or key proves, or None."""
        if not presented:
            return None
        identity = None
        if self._token is not None and hmac.compare_digest(presented.encode(), self._token):
            identity = FLEET_TOKEN_IDENTITY
        if self._keys is not None and (entry := self._keys.lookup(presented)) is not None:
            identity = entry.identity()
        return identity

    def identify(self, context) -> Identity:
        """The caller of a gRPC call (its ``invocation_metadata`` and ``peer``)."""
        if self.required:
            identity = self.verify(bearer_of(context.invocation_metadata()))
            if identity is None:  # the interceptor admits none of these; a direct call may
                raise Unauthenticated(_REFUSED)
            return identity
        return Identity(name=f"peer:{peer_host(context.peer())}")


_REFUSED = "a valid API key or fleet token is required as the bearer token (pipeshard keys, PIPESHARD_TOKEN)"


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


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Admits a call only with a token or key the authenticator verifies (health checks stay open,
    so probes need no secret). Put it after the ErrorInterceptor."""

    def __init__(self, authenticator: Authenticator):
        if not authenticator.required:
            raise ValueError("an authenticator with neither a token nor a key file admits everyone")
        self._auth = authenticator

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        method = handler_call_details.method or ""
        presented = bearer_of(handler_call_details.invocation_metadata)
        if not method.startswith(_OPEN_PREFIXES) and self._auth.verify(presented) is None:
            raise Unauthenticated(_REFUSED)
        return await continuation(handler_call_details)
