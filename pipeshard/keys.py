"""API keys: one per user or application, stored as hashes in the fleet's key file.

A key is 32 random bytes (URL-safe base64), so one unsalted SHA-256 is enough to make the file
useless to a reader: nothing shorter than the key itself guesses it. The file is JSON, mode 0600,
replaced atomically (write a temporary file beside it, then rename), so a running coordinator or
gateway never reads half a file. :class:`KeyRing` re-reads it whenever it changes on disk, which
is how ``pipeshard keys revoke`` takes effect on a running fleet.
"""

from __future__ import annotations

import fcntl
import hashlib
import hmac
import json
import os
import re
import secrets
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import structlog

from pipeshard import paths
from pipeshard.errors import InvalidArgument, NotFound
from pipeshard.identity import Identity

log = structlog.get_logger(__name__)
KEY_FILE = "api-keys"
KEY_PREFIX = "psk-"  # recognisable in logs and secret scanners; the rest is 32 random bytes
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.@-]{0,63}$")


def default_key_file() -> Path:
    """``PIPESHARD_API_KEYS``, else ``api-keys`` beside the fleet's certificates."""
    env = os.environ.get("PIPESHARD_API_KEYS")
    return Path(env) if env else paths.certs_dir() / KEY_FILE


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


@dataclass(frozen=True)
class KeyEntry:
    """One key as stored: its name and settings, and the hash of the key (never the key)."""

    name: str
    sha256: str
    weight: float = 1.0
    max_running: int | None = None
    max_queued: int | None = None
    created: float = 0.0  # seconds since the epoch

    def identity(self) -> Identity:
        return Identity(
            name=f"key:{self.name}",
            weight=self.weight,
            max_running=self.max_running,
            max_queued=self.max_queued,
        )


def check_settings(name: str, weight: float, max_running: int | None, max_queued: int | None) -> None:
    if not _NAME.match(name):
        raise InvalidArgument(
            "name", f"must be 1-64 letters, digits or _ . @ - (starting with a letter or digit), got {name!r}"
        )
    if not (weight > 0 and weight < float("inf")):
        raise InvalidArgument("weight", f"must be a positive number, got {weight}")
    for label, value in (("max_running", max_running), ("max_queued", max_queued)):
        if value is not None and value < 0:
            raise InvalidArgument(label, f"must be 0 or more, got {value}")


def read_entries(path: Path) -> list[KeyEntry]:
    """The entries of the key file at ``path`` ([] when it does not exist)."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    try:
        rows = json.loads(text)["keys"]
        return [KeyEntry(**row) for row in rows]
    except (ValueError, KeyError, TypeError) as exc:
        raise InvalidArgument("api_keys", f"{path} is not a pipeshard key file: {exc}") from None


def _write_entries(path: Path, entries: list[KeyEntry]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps({"keys": [asdict(e) for e in entries]}, indent=1) + "\n"
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")  # mode 0600
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Serialises changes to the key file (two `keys add` at once must not lose one)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path.parent / f".{path.name}.lock", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def add_key(
    path: Path,
    name: str,
    *,
    weight: float = 1.0,
    max_running: int | None = None,
    max_queued: int | None = None,
) -> str:
    """Stores a new key's hash under ``name`` and returns the key (shown once, never stored)."""
    check_settings(name, weight, max_running, max_queued)
    with _locked(path):
        entries = read_entries(path)
        if any(e.name == name for e in entries):
            raise InvalidArgument("name", f"{name!r} already exists in {path} (revoke it first)")
        key = KEY_PREFIX + secrets.token_urlsafe(32)
        entry = KeyEntry(name, digest(key), float(weight), max_running, max_queued, round(time.time(), 3))
        _write_entries(path, [*entries, entry])
    return key


def revoke_key(path: Path, name: str) -> None:
    with _locked(path):
        entries = read_entries(path)
        kept = [e for e in entries if e.name != name]
        if len(kept) == len(entries):
            known = ", ".join(e.name for e in entries) or "none"
            raise NotFound(f"`name`: no key named {name!r} in {path} (keys: {known})")
        _write_entries(path, kept)


class KeyRing:
    """The keys of a key file, re-read when the file changes (checked at most every ``recheck_s``)."""

    def __init__(self, path: Path, recheck_s: float = 0.5):
        self.path = Path(path)
        self._recheck_s = recheck_s
        self._checked = float("-inf")
        self._stamp: tuple[int, int, int] | None = None
        self._entries: list[KeyEntry] = []

    def _refresh(self) -> None:
        now = time.monotonic()
        if now - self._checked < self._recheck_s:
            return
        self._checked = now
        try:
            st = self.path.stat()
            stamp = (st.st_ino, st.st_mtime_ns, st.st_size)
        except FileNotFoundError:
            stamp = None
        if stamp == self._stamp:
            return
        try:
            self._entries = read_entries(self.path) if stamp is not None else []
        except InvalidArgument as exc:
            # A broken file keeps the last good keys rather than locking every user out.
            log.error("key file unreadable; keeping the keys read before", error=str(exc))
        self._stamp = stamp

    def lookup(self, key: str) -> KeyEntry | None:
        """The entry whose hash matches ``key``; every entry is compared, in constant time."""
        self._refresh()
        presented = digest(key).encode()
        found = None
        for entry in self._entries:
            if hmac.compare_digest(presented, entry.sha256.encode()):
                found = entry
        return found
