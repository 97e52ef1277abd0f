"""KV capture and restore on a stage, for one owner's sessions: blobs out and in, and the prefix cache.

A restore is all or nothing on this stage: the blob (or the cached prefix) is checked in full
before the session is touched, and a session that already held a sequence is replaced.
"""

from __future__ import annotations

from collections.abc import Sequence

from pipeshard.errors import InvalidArgument, NotFound
from pipeshard.services.stage.prefix_store import PrefixStore
from pipeshard.services.stage.sessions import SessionTable
from pipeshard.shard.kvblob import KvBlob, KvSource
from pipeshard.shard.runtime import export_kv, import_kv


class StageKv:
    def __init__(self, sessions: SessionTable, source: KvSource, store: PrefixStore):
        self.sessions = sessions
        self.source = source
        self.store = store

    def capture(self, owner: str, session_id: str, token_ids: Sequence[int]) -> KvBlob:
        """The session's valid positions (the first len(token_ids) when given) as a checked blob."""
        session = self._holding(owner, session_id, token_ids)
        return export_kv(session, positions=len(token_ids) or None, token_ids=tuple(token_ids))

    def keep(self, owner: str, session_id: str, scope: str, token_ids: Sequence[int]) -> tuple[int, int]:
        """Capture into the prefix cache; returns (positions, bytes newly stored)."""
        if not token_ids:
            raise InvalidArgument("token_ids", "must name the captured tokens to keep them in the cache")
        session = self._holding(owner, session_id, token_ids)
        blob = export_kv(session, positions=len(token_ids), checksum=False)
        return blob.positions, self.store.put(owner, scope, token_ids, blob.arrays)

    def restore(self, owner: str, session_id: str, blob: KvBlob) -> int:
        """Load a blob into the session (opened if absent, replaced if present); returns its positions."""
        blob.check_for(self.source)
        session = self._fresh(owner, session_id)
        import_kv(session, blob, verify_checksum=False)  # verified just above
        return blob.positions

    def restore_cached(
        self, owner: str, session_id: str, scope: str, token_ids: Sequence[int], positions: int
    ) -> int:
        """Load the first ``positions`` positions of a sequence kept in the prefix cache."""
        arrays = self.store.get(owner, scope, token_ids, positions)
        blob = KvBlob(self.source, (), tuple(arrays), "")
        blob.check_for(self.source, verify_checksum=False)
        session = self._fresh(owner, session_id)
        import_kv(session, blob, verify_checksum=False)  # our own memory: nothing crossed a wire
        return positions

    def _holding(self, owner: str, session_id: str, token_ids: Sequence[int]):
        session = self.sessions.get(owner, session_id)
        if len(token_ids) > session.valid_length:
            raise InvalidArgument(
                "token_ids", f"names {len(token_ids)} tokens; the session holds {session.valid_length}"
            )
        return session

    def _fresh(self, owner: str, session_id: str):
        try:
            session = self.sessions.get(owner, session_id)
        except NotFound:
            return self.sessions.open(owner, session_id)
        session.reset()
        return session
