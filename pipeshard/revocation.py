"""Revoked fleet certificates: a denylist of serial numbers every stage checks on every call.

``pipeshard certs revoke NAME`` appends the serials of NAME's certificates to ``revoked`` in the
certificates folder and in every host bundle under it; a service reads ``revoked`` from its own
``--tls-dir`` and re-reads it when it changes (checked at most every 0.5 s), so a revocation
needs no restart once the file is on the host. A stage refuses a caller (the coordinator, the
previous stage) whose certificate is listed, and a puller refuses an exporter whose certificate
is; fleet CA and certificates stay as they are (a CRL would need every TLS stack to fetch it).
"""

from __future__ import annotations

import datetime
import functools
import threading
import time
from pathlib import Path

import structlog

from pipeshard.errors import NotFound, PermissionDenied

log = structlog.get_logger(__name__)

REVOKED_FILE = "revoked"


@functools.lru_cache(maxsize=256)
def certificate_serial(pem: bytes) -> int:
    from cryptography import x509

    return x509.load_pem_x509_certificate(pem).serial_number


def read_serials(path: Path) -> frozenset[int]:
    """The serials of a denylist: one hexadecimal serial a line, ``#`` starting a comment."""
    serials = set()
    for line in Path(path).read_text().splitlines():
        text = line.split("#", 1)[0].strip()
        if text:
            serials.add(int(text, 16))
    return frozenset(serials)


class Denylist:
    """The serials of one ``revoked`` file, re-read when it changes (at most every ``recheck_s``)."""

    def __init__(self, path: Path, recheck_s: float = 0.5):
        self.path = Path(path)
        self._recheck_s = recheck_s
        self._checked = float("-inf")
        self._stamp: tuple[int, int, int] | None = None
        self._serials: frozenset[int] = frozenset()
        self._lock = threading.Lock()

    def serials(self) -> frozenset[int]:
        with self._lock:
            now = time.monotonic()
            if now - self._checked >= self._recheck_s:
                self._checked = now
                self._reload()
            return self._serials

    def _reload(self) -> None:
        try:
            st = self.path.stat()
            stamp: tuple[int, int, int] | None = (st.st_ino, st.st_mtime_ns, st.st_size)
        except FileNotFoundError:
            stamp = None
        if stamp == self._stamp:
            return
        try:
            self._serials = read_serials(self.path) if stamp is not None else frozenset()
        except (OSError, ValueError) as exc:
            # A broken list keeps the serials read before rather than readmitting them.
            log.error("revocation list unreadable; keeping the one read before", error=str(exc))
        self._stamp = stamp

    def check(self, pem: bytes, who: str) -> None:
        """Refuses (PermissionDenied) a certificate whose serial is listed."""
        if certificate_serial(pem) in self.serials():
            raise PermissionDenied(f"{who}'s certificate is revoked (`pipeshard certs revoke`)")


# The denylist of this process's --tls-dir, set when a stage starts serving TLS.
_active: dict[str, Denylist] = {}


def watch(tls_dir: Path) -> Denylist:
    """Makes ``tls_dir``'s ``revoked`` the list :func:`check_peer` holds callers against."""
    denylist = _active["fleet"] = Denylist(Path(tls_dir) / REVOKED_FILE)
    return denylist


def check_peer(pem: bytes, who: str = "the caller") -> None:
    denylist = _active.get("fleet")
    if denylist is not None:
        denylist.check(pem, who)


def revoke(folder: Path, name: str) -> list[tuple[Path, int]]:
    """Lists the serial of every certificate called ``name`` in ``folder`` and its host bundles
    in ``folder``'s ``revoked`` and in every bundle's, and removes those certificates and keys
    (so `pipeshard certs` issues new ones); returns the certificates revoked."""
    folder = Path(folder)
    found = [(p, certificate_serial(p.read_bytes())) for p in _certificates(folder, name)]
    if not found:
        raise NotFound(f"`name`: no certificate {name}.pem in {folder} or its host bundles")
    stamp = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    lines = "".join(f"{serial:x}  # {path.relative_to(folder)} revoked {stamp}\n" for path, serial in found)
    for target in [folder, *sorted(p for p in (folder / "hosts").glob("*") if p.is_dir())]:
        path = target / REVOKED_FILE
        old = path.read_text() if path.is_file() else ""
        tmp = path.with_suffix(".tmp")
        tmp.write_text(old + lines)
        tmp.replace(path)  # atomic: a service never reads half a list
    for path, _ in found:
        path.unlink()
        path.with_suffix(".key").unlink(missing_ok=True)
    return found


def _certificates(folder: Path, name: str) -> list[Path]:
    candidates = [folder / f"{name}.pem", *sorted((folder / "hosts").glob(f"*/{name}.pem"))]
    return [p for p in candidates if p.is_file()]
