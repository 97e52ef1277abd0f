"""The prefix cache's blocks on disk (``--prefix-spill-dir``), so a restarted stage keeps its cache.

Every block the store keeps is also written here (write-through: a stage killed without warning
keeps what it had), one file per block: a KvSnapshot (pipeshard/shard/kvblob.py) naming the model,
export and layer range, with its sha256. A block evicted from memory is read back from its file
on a later hit. A file that fails its checks (another export, a torn or flipped byte) is deleted
and counts as missing, so the restore falls back to a cold prefill. The folder has its own byte
budget; the oldest files go first beyond it, each reported to ``on_remove`` (the store's
eviction report) with its owner's digest and block key, which its name carries.
"""

from __future__ import annotations

import hashlib
import os
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import structlog
from google.protobuf.message import DecodeError

from pipeshard.errors import InvalidArgument, PipeshardError
from pipeshard.shard.kvblob import KvBlob, KvSource, from_proto, to_proto
from pipeshard.v1 import kv_pb2

log = structlog.get_logger(__name__)

SUFFIX = ".kvblock"


def owner_digest(owner: str) -> str:
    """The owner as spill file names carry it (owner keys are secrets' hashes already; hashed
    again they make a safe file name)."""
    return hashlib.sha256(owner.encode()).hexdigest()[:32]


class PrefixSpill:
    """Blocks as files named by owner and block key, least recently written out beyond ``budget_bytes``."""

    def __init__(self, folder: Path | str, source: KvSource, budget_bytes: int):
        if budget_bytes < 0:
            raise InvalidArgument("prefix_spill_bytes", f"must be >= 0, got {budget_bytes}")
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.source = source
        self.budget_bytes = budget_bytes
        self.on_remove: Callable[[str, str], None] | None = None  # (owner digest, block key)
        files = sorted(self.folder.glob(f"*{SUFFIX}"), key=lambda p: p.stat().st_mtime)
        self._files: OrderedDict[str, int] = OrderedDict((p.name, p.stat().st_size) for p in files)
        self.nbytes = sum(self._files.values())
        self._evict()

    def __len__(self) -> int:
        return len(self._files)

    def _name(self, owner: str, key: str) -> str:
        return f"{owner_digest(owner)}-{key}{SUFFIX}"

    def holds(self, owner: str, key: str) -> bool:
        return self._name(owner, key) in self._files

    def write(self, owner: str, key: str, block: Sequence[np.ndarray], positions: int) -> None:
        name = self._name(owner, key)
        if name in self._files:
            self._files.move_to_end(name)
            return
        data = to_proto(KvBlob.build(self.source, list(block), positions=positions)).SerializeToString()
        if len(data) > self.budget_bytes:
            return
        tmp = self.folder / f".{name}.tmp"
        tmp.write_bytes(data)
        os.replace(tmp, self.folder / name)  # never a half-written block under the real name
        self._files[name] = len(data)
        self.nbytes += len(data)
        self._evict()

    def read(self, owner: str, key: str) -> tuple[np.ndarray, ...] | None:
        """The block's arrays, or None when it has no file or its file fails the checks."""
        name = self._name(owner, key)
        path = self.folder / name
        if name not in self._files:
            return None
        try:
            snapshot = kv_pb2.KvSnapshot.FromString(path.read_bytes())
            blob = from_proto(snapshot)
            blob.check_for(self.source)
        except (OSError, DecodeError, PipeshardError) as exc:
            log.warning("prefix_spill_dropped", file=name, reason=str(exc) or type(exc).__name__)
            self._remove(name)
            return None
        self._files.move_to_end(name)
        return blob.arrays

    def _remove(self, name: str) -> None:
        self.nbytes -= self._files.pop(name, 0)
        (self.folder / name).unlink(missing_ok=True)
        if self.on_remove is not None:
            digest, _, key = name.removesuffix(SUFFIX).partition("-")
            self.on_remove(digest, key)

    def _evict(self) -> None:
        while self.nbytes > self.budget_bytes and self._files:
            self._remove(next(iter(self._files)))
