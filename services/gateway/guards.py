"""ASGI guards in front of the routes: the API key check, then the body limit.

Both answer before FastAPI sees the request, so an unauthenticated caller never gets a body
read, and a body over the limit is refused by its Content-Length or, when it streams, as soon as
the bytes counted pass the limit: never read into memory whole.
"""

from __future__ import annotations

import asyncio
import json

from pipeshard.auth import Authenticator
from pipeshard.services.gateway.errors import GatewayError

OPEN_PATHS = ("/health", "/", "/ui")  # the page holds no data: it asks for the key


async def answer(send, error: GatewayError, *, close: bool = False) -> None:
    """Sends ``error`` as a complete JSON response; ``close`` ends the connection after it (the
    rest of an unread body must not be parsed as the next request)."""
    body = json.dumps(error.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def _header(scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value.decode("latin-1")
    return None


class AuthGuard:
    """With a fleet token or key file, every route but /health and the page needs a verified bearer key: the
    coordinator then sees (and identifies) the same key, forwarded."""

    def __init__(self, app, authenticator: Authenticator):
        self.app = app
        self.auth = authenticator

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and self.auth.required and scope["path"] not in OPEN_PATHS:
            scheme, _, key = (_header(scope, b"authorization") or "").partition(" ")
            if scheme.lower() != "bearer" or self.auth.verify(key.strip()) is None:
                error = GatewayError(
                    401,
                    "a valid API key is required: send `Authorization: Bearer <key>` "
                    "(a key from `pipeshard keys add`, or the fleet token)",
                    code="invalid_api_key",
                )
                await answer(send, error, close=True)
                return
        await self.app(scope, receive, send)


class BodyLimit:
    """Reads a request body up to ``max_bytes`` within ``timeout_s``, then hands it on."""

    def __init__(self, app, max_bytes: int, timeout_s: float):
        self.app = app
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s

    def _too_large(self, size: str) -> GatewayError:
        return GatewayError(
            413,
            f"the request body ({size}) is over the limit of {self.max_bytes} bytes (--max-body-bytes)",
            code="request_too_large",
        )

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        declared = _header(scope, b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_bytes):
            await answer(send, self._too_large(f"{declared} bytes declared"), close=True)
            return
        chunks: list[bytes] = []
        size = 0
        try:
            async with asyncio.timeout(self.timeout_s):
                more = True
                while more:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        return
                    chunk = message.get("body", b"")
                    size += len(chunk)
                    if size > self.max_bytes:
                        await answer(send, self._too_large(f"over {size} bytes sent"), close=True)
                        return
                    chunks.append(chunk)
                    more = message.get("more_body", False)
        except TimeoutError:
            error = GatewayError(
                408, f"the request body did not arrive within {self.timeout_s:g} s", code="timeout"
            )
            await answer(send, error, close=True)
            return
        body = b"".join(chunks)
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()  # later: the disconnect the routes watch for
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)
