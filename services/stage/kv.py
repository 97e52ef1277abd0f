"""KV capture and restore on a stage, for one owner's sessions: blobs out and in, and the prefix cache.

A restore is all or nothing on this stage: the blob (or the cached prefix) is checked in full
before the session is touched, and a session that already held a sequence is replaced. Both KV
backends capture the same backend-neutral arrays (pipeshard/shard/kvblob.py), so one prefix
store and one blob format serve a stateful stage (graph state) and a paged one (block pools); a
paged stage with quantized pools captures its blocks verbatim (KvSource.blocks); a static stage
captures its slot's positions of its KV buffers.
"""

from __future__ import annotations

from collections.abc import Sequence

from pipeshard.errors import InvalidArgument, NotFound
from pipeshard.services.stage.paged_engine import PagedEngine
from pipeshard.services.stage.prefix_store import PrefixStore
from pipeshard.services.stage.sessions import SessionTable
from pipeshard.services.stage.static_engine import StaticEngine
from pipeshard.shard.kvblob import KvBlob, KvSource, join_parts
from pipeshard.shard.runtime import export_kv, import_kv
from pipeshard.shard.static import StaticShard


class StatefulAccess:
    """A stateful session's KV: its graph state, mask-valid positions only."""

    def __init__(self, sessions: SessionTable):
        self.sessions = sessions

    def held(self, session) -> int:
        return session.valid_length

    def blob(
        self, session, positions: int, token_ids: tuple[int, ...], checksum: bool, start: int = 0
    ) -> KvBlob:
        return export_kv(session, positions=positions, token_ids=token_ids, checksum=checksum, start=start)

    def fresh(self, owner: str, session_id: str):
        try:
            session = self.sessions.get(owner, session_id)
        except NotFound:
            return self.sessions.open(owner, session_id)
        session.reset()
        return session

    def load(self, session, blob: KvBlob) -> None:
        import_kv(session, blob, verify_checksum=False)  # the caller checked the blob


class PagedAccess:
    """A paged session's KV: the blocks it reserved in the shard's pools (a restore into a
    session the coordinator has not opened reserves the export's whole context for it); or a
    static session's: the positions its slot holds in the shard's buffers (the stateful blob
    layout, f32 per layer; a restore into a session not opened takes a free slot)."""

    def __init__(self, engine: PagedEngine | StaticEngine):
        self.engine = engine
        self.sessions = engine.sessions
        self.shard = engine.shard

    def held(self, session) -> int:
        return session.past_length

    def blob(
        self, session, positions: int, token_ids: tuple[int, ...], checksum: bool, start: int = 0
    ) -> KvBlob:
        shard = self.shard  # the shard knows a static session by its slot, a paged one by its key
        if isinstance(shard, StaticShard):
            arrays = shard.export_kv(session.slot, positions, start)
        else:
            arrays = shard.export_kv(session.key, positions, start)
        return KvBlob.build(
            self.shard.kv_source,
            arrays,
            token_ids,
            positions=positions - start,
            checksum=checksum,
            start=start,
        )

    def fresh(self, owner: str, session_id: str):
        try:
            self.engine.reset(owner, session_id)
        except NotFound:
            self.engine.open(owner, session_id)
        return self.sessions.get(owner, session_id)

    def load(self, session, blob: KvBlob) -> None:
        shard = self.shard
        if isinstance(shard, StaticShard):
            shard.import_kv(session.slot, blob.arrays, blob.positions)
        else:
            shard.import_kv(session.key, blob.arrays, blob.positions)


class StageKv:
    def __init__(
        self,
        sessions: SessionTable,
        source: KvSource,
        store: PrefixStore,
        access: StatefulAccess | PagedAccess | None = None,
    ):
        self.sessions = sessions
        self.source = source
        self.store = store
        self.access = access or StatefulAccess(sessions)

    @classmethod
    def paged(cls, engine: PagedEngine, store: PrefixStore) -> StageKv:
        return cls(engine.sessions, engine.shard.kv_source, store, PagedAccess(engine))

    @classmethod
    def static(cls, engine: StaticEngine, store: PrefixStore) -> StageKv:
        return cls(engine.sessions, engine.shard.kv_source, store, PagedAccess(engine))

    def capture(self, owner: str, session_id: str, token_ids: Sequence[int], start: int = 0) -> KvBlob:
        """The session's valid positions (the first len(token_ids) when given) as a checked blob;
        ``start`` > 0: only those from it on (a part; token_ids required, the part's own kept)."""
        if start and not token_ids:
            raise InvalidArgument("token_ids", "must name the captured tokens when from_position is set")
        session = self._holding(owner, session_id, token_ids)
        positions = len(token_ids) or self.access.held(session)
        return self.access.blob(session, positions, tuple(token_ids)[start:], checksum=True, start=start)

    def keep(self, owner: str, session_id: str, scope: str, token_ids: Sequence[int]) -> tuple[int, int]:
        """Capture into the prefix cache; returns (positions, bytes newly stored)."""
        if not token_ids:
            raise InvalidArgument("token_ids", "must name the captured tokens to keep them in the cache")
        session = self._holding(owner, session_id, token_ids)
        blob = self.access.blob(session, len(token_ids), (), checksum=False)
        return blob.positions, self.store.put(owner, scope, token_ids, blob.arrays)

    def check(self, blob: KvBlob) -> None:
        """Refuses a blob this stage cannot restore (another model or layout, damaged, a part);
        touches nothing, so it may run off the event loop."""
        if blob.start:
            raise InvalidArgument(
                "snapshot.start_position",
                f"is {blob.start}: a part restores only joined to the parts before it",
            )
        blob.check_for(self.source)

    def check_parts(self, parts: list[KvBlob]) -> KvBlob:
        """The whole cache consecutive parts make (one part: itself), refused as :meth:`check`
        refuses; each part's checksum is verified, the joined whole is not hashed again."""
        if len(parts) == 1:
            self.check(parts[0])
            return parts[0]
        for part in parts:
            part.verify_checksum()
        blob = join_parts(parts, checksum=False)
        blob.check_for(self.source, verify_checksum=False)
        return blob

    def restore(self, owner: str, session_id: str, blob: KvBlob, *, checked: bool = False) -> int:
        """Load a blob into the session (opened if absent, replaced if present); returns its
        positions. ``checked``: the caller ran :meth:`check` on it."""
        if not checked:
            self.check(blob)
        self.access.load(self.access.fresh(owner, session_id), blob)
        return blob.positions

    def restore_cached(
        self, owner: str, session_id: str, scope: str, token_ids: Sequence[int], positions: int
    ) -> int:
        """Load the first ``positions`` positions of a sequence kept in the prefix cache."""
        arrays = self.store.get(owner, scope, token_ids, positions)
        blob = KvBlob(self.source, (), tuple(arrays), "", positions)
        blob.check_for(self.source, verify_checksum=False)  # our own memory: nothing crossed a wire
        self.access.load(self.access.fresh(owner, session_id), blob)
        return positions

    def dropped(self, owner: str) -> list[str]:
        """The keys of the owner's prefix cache blocks dropped since its last keep or restore
        reply, which this one carries (``evicted_blocks``)."""
        return self.store.take_dropped(owner)

    def _holding(self, owner: str, session_id: str, token_ids: Sequence[int]):
        session = self.sessions.get(owner, session_id)
        held = self.access.held(session)
        if len(token_ids) > held:
            raise InvalidArgument("token_ids", f"names {len(token_ids)} tokens; the session holds {held}")
        return session
