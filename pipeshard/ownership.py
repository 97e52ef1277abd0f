"""Who a stage session belongs to: the coordinator that opened it, proven by a secret it presents.

Each coordinator (ring) draws a random secret and sends it as ``x-pipeshard-owner`` metadata on
every stage call and stream. A stage keys sessions and Results subscriptions by the SHA-256 of
that secret (the *owner key*), so one coordinator can neither see nor touch another's sessions,
and cannot even learn whether a session id is in use elsewhere. Frames travel the ring carrying
the owner key (``ActivationFrame.owner``): later stages see them from the previous hop, not from
the coordinator. The key is unguessable, so a frame claiming it is as good as the secret for
Forward only; control calls and subscriptions need the secret itself. In secure mode mutual TLS
additionally admits only fleet members (pipeshard.tls).
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Iterable

from pipeshard.errors import PermissionDenied

OWNER_METADATA = "x-pipeshard-owner"
MIN_SECRET_CHARS = 16


def new_secret() -> str:
    return secrets.token_hex(32)


def owner_key(secret: str) -> str:
    """The stage-side identity of whoever holds ``secret``."""
    return hashlib.sha256(secret.encode()).hexdigest()


def owner_metadata(secret: str) -> tuple[tuple[str, str], ...]:
    return ((OWNER_METADATA, secret),)


def owner_from_metadata(metadata: Iterable[tuple[str, str | bytes]] | None) -> str:
    """The owner key of a call, from its metadata; refuses a call that presents no usable secret."""
    for key, value in metadata or ():
        if key == OWNER_METADATA:
            secret = value.decode(errors="replace") if isinstance(value, bytes) else value
            if len(secret) >= MIN_SECRET_CHARS:
                return owner_key(secret)
            break
    raise PermissionDenied(
        f"stage calls must carry `{OWNER_METADATA}` metadata: the caller's secret of at least "
        f"{MIN_SECRET_CHARS} characters (a coordinator sends its own)"
    )
