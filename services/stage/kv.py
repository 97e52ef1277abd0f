"""KV capture and restore on a stage, for one owner's sessions: blobs out and in, and the prefix cache.

A restore is all or nothing on this stage: the blob (or the cached prefix) is checked in full
before the session is touched, and a session that already held a sequence is replaced. Both KV
backends capture the same backend-neutral arrays (pipeshard/shard/kvblob.py), so one prefix
store and one blob format serve a stateful stage (graph state) and a paged one (block pools); a
paged stage with quantized pools captures its blocks verbatim (KvSource.blocks); a static stage
captures its slot's positions of its KV buffers. Each backend has its own access class (its
``Backend.kv`` picks it: services/stage/backends.py).

A paged stage also shares: a keep pins the sequence's full blocks in the pool under their prefix
keys, and a restore from the prefix cache references those still pinned (not copied; counted in
``pipeshard_stage_kv_restored_blocks_total``), copying from the store only the rest. Stateful
and static stages copy every restored position into the session's own cache.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Generic

from pipeshard.errors import Internal, InvalidArgument, NotFound, PipeshardError
from pipeshard.services.stage.paged_engine import PagedEngine, PagedSession
from pipeshard.services.stage.prefix_store import PrefixStore
from pipeshard.services.stage.sessions import S, SessionTable
from pipeshard.services.stage.static_engine import StaticEngine, StaticSession
from pipeshard.shard.kvblob import KvBlob, KvSource, join_parts
from pipeshard.shard.prefix_chain import BLOCK, block_chain
from pipeshard.shard.runtime import ShardSession, export_kv, import_kv


class SessionAccess(ABC, Generic[S]):
    """One backend's reach into its sessions' KV; the snapshot and restore around it are shared."""

    sessions: SessionTable[S]

    @abstractmethod
    def held(self, session: S) -> int:
        """The positions a capture may take."""

    @abstractmethod
    def blob(
        self, session: S, positions: int, token_ids: tuple[int, ...], checksum: bool, start: int = 0
    ) -> KvBlob:
        """The session's positions [start, positions) as a blob."""

    @abstractmethod
    def fresh(self, owner: str, session_id: str) -> S:
        """The session emptied for a restore (opened when absent)."""

    @abstractmethod
    def load(self, session: S, blob: KvBlob) -> None:
        """Writes a checked blob into an empty session."""

    def snapshot(
        self,
        owner: str,
        session_id: str,
        token_ids: Sequence[int],
        *,
        start: int,
        checksum: bool,
        named: bool,
    ) -> KvBlob:
        """The first len(token_ids) positions (all it holds when none are named) from ``start`` on;
        ``named``: the blob carries the token ids it holds."""
        session = self.sessions.get(owner, session_id)
        held = self.held(session)
        if len(token_ids) > held:
            raise InvalidArgument("token_ids", f"names {len(token_ids)} tokens; the session holds {held}")
        ids = tuple(token_ids)[start:] if named else ()
        return self.blob(session, len(token_ids) or held, ids, checksum, start)

    def restore(self, owner: str, session_id: str, blob: KvBlob) -> None:
        self.load(self.fresh(owner, session_id), blob)

    def kept(self, owner: str, session_id: str, scope: str, token_ids: Sequence[int]) -> None:
        """After the prefix store kept the session's tokens (a paged stage also pins them)."""

    def restore_cached(
        self,
        owner: str,
        session_id: str,
        store: PrefixStore,
        source: KvSource,
        scope: str,
        token_ids: Sequence[int],
        positions: int,
    ) -> None:
        """Loads the first ``positions`` positions of a sequence kept in ``store`` (a copy)."""
        arrays = store.get(owner, scope, token_ids, positions)
        blob = KvBlob(source, (), tuple(arrays), "", positions)
        blob.check_for(source, verify_checksum=False)  # our own memory: nothing crossed a wire
        self.restore(owner, session_id, blob)


class StatefulAccess(SessionAccess[ShardSession]):
    """A stateful session's KV: its graph state, mask-valid positions only."""

    def __init__(self, sessions: SessionTable[ShardSession]):
        self.sessions = sessions

    def held(self, session: ShardSession) -> int:
        return session.valid_length

    def blob(
        self,
        session: ShardSession,
        positions: int,
        token_ids: tuple[int, ...],
        checksum: bool,
        start: int = 0,
    ) -> KvBlob:
        return export_kv(session, positions=positions, token_ids=token_ids, checksum=checksum, start=start)

    def fresh(self, owner: str, session_id: str) -> ShardSession:
        try:
            session = self.sessions.get(owner, session_id)
        except NotFound:
            return self.sessions.open(owner, session_id)
        session.reset()
        return session

    def load(self, session: ShardSession, blob: KvBlob) -> None:
        import_kv(session, blob, verify_checksum=False)  # the caller checked the blob


class PagedAccess(SessionAccess[PagedSession]):
    """A paged session's KV: the blocks it reserved in the shard's pools (a restore into a
    session the coordinator has not opened reserves the export's whole context for it)."""

    def __init__(self, engine: PagedEngine):
        self.engine = engine
        self.sessions = engine.sessions
        self.shard = engine.shard

    def held(self, session: PagedSession) -> int:
        return session.past_length

    def blob(
        self,
        session: PagedSession,
        positions: int,
        token_ids: tuple[int, ...],
        checksum: bool,
        start: int = 0,
    ) -> KvBlob:
        arrays = self.shard.export_kv(session.key, positions, start)
        return KvBlob.build(
            self.shard.kv_source,
            arrays,
            token_ids,
            positions=positions - start,
            checksum=checksum,
            start=start,
            last_input=self.shard.last_input(session.key, positions),
        )

    def fresh(self, owner: str, session_id: str) -> PagedSession:
        try:
            self.engine.reset(owner, session_id)
        except NotFound:
            self.engine.open(owner, session_id)
        return self.sessions.get(owner, session_id)

    def load(self, session: PagedSession, blob: KvBlob) -> None:
        self.shard.import_kv(session.key, blob.arrays, blob.positions, last_input=blob.last_input)

    def _keys(self, owner: str, scope: str, token_ids: Sequence[int]) -> list[tuple[str, str]]:
        """The pool's keys of the full blocks of ``token_ids`` (none when the pool's blocks are
        not the prefix cache's)."""
        if self.shard.block_tokens != BLOCK:
            return []
        return [(owner, b.key) for b in block_chain(scope, token_ids) if b.end - b.start == BLOCK]

    def kept(self, owner: str, session_id: str, scope: str, token_ids: Sequence[int]) -> None:
        session = self.sessions.get(owner, session_id)
        self.shard.pin(session.key, self._keys(owner, scope, token_ids))

    def restore_cached(
        self,
        owner: str,
        session_id: str,
        store: PrefixStore,
        source: KvSource,
        scope: str,
        token_ids: Sequence[int],
        positions: int,
    ) -> None:
        """Shares the prefix's pinned blocks, copies the rest from ``store`` and pins what it
        copied, so the next restore of this prefix shares it too."""
        if not 0 < positions <= len(token_ids):
            raise InvalidArgument("positions", f"must be in [1, {len(token_ids)}], got {positions}")
        keys = self._keys(owner, scope, token_ids[:positions])
        # NOT_FOUND before a session opens when the prefix was never kept (or is gone): its last
        # block is in the store whenever the prefix is.
        store.get(owner, scope, token_ids, positions, (positions - 1) // BLOCK * BLOCK)
        session = self.fresh(owner, session_id)
        shared = self.shard.share(session.key, keys)
        start = shared * BLOCK
        if start < positions:
            try:
                arrays = store.get(owner, scope, token_ids, positions, start)
                self.shard.import_kv(session.key, arrays, positions, start)
            except PipeshardError:
                self.engine.reset(owner, session_id)  # nothing half-restored stays
                raise
            self.shard.pin(session.key, keys)
        self.engine.meters.restored(shared, self.shard.blocks_for(positions) - shared)


class StaticAccess(SessionAccess[StaticSession]):
    """A static session's KV: the positions its slot holds in the shard's buffers (the stateful
    blob layout, f32 per layer; a restore into a session not opened takes a free slot)."""

    def __init__(self, engine: StaticEngine):
        self.engine = engine
        self.sessions = engine.sessions
        self.shard = engine.shard

    def held(self, session: StaticSession) -> int:
        return session.past_length

    def blob(
        self,
        session: StaticSession,
        positions: int,
        token_ids: tuple[int, ...],
        checksum: bool,
        start: int = 0,
    ) -> KvBlob:
        arrays = self.shard.export_kv(session.slot, positions, start)
        return KvBlob.build(
            self.shard.kv_source,
            arrays,
            token_ids,
            positions=positions - start,
            checksum=checksum,
            start=start,
        )

    def fresh(self, owner: str, session_id: str) -> StaticSession:
        try:
            self.engine.reset(owner, session_id)
        except NotFound:
            self.engine.open(owner, session_id)
        return self.sessions.get(owner, session_id)

    def load(self, session: StaticSession, blob: KvBlob) -> None:
        self.shard.import_kv(session.slot, blob.arrays, blob.positions)


class StageKv:
    def __init__(
        self,
        sessions: SessionTable[ShardSession] | None,
        source: KvSource,
        store: PrefixStore,
        access: StatefulAccess | PagedAccess | StaticAccess | None = None,
    ):
        """``sessions``: a stateful stage's, which its access reaches; another backend gives its
        own ``access`` (``paged``, ``static``). Neither: blobs are only checked (:meth:`check`)."""
        self.source = source
        self.store = store
        if access is None and sessions is not None:
            access = StatefulAccess(sessions)
        self._access = access

    @classmethod
    def paged(cls, engine: PagedEngine, store: PrefixStore) -> StageKv:
        return cls(None, engine.shard.kv_source, store, PagedAccess(engine))

    @classmethod
    def static(cls, engine: StaticEngine, store: PrefixStore) -> StageKv:
        return cls(None, engine.shard.kv_source, store, StaticAccess(engine))

    @property
    def access(self) -> StatefulAccess | PagedAccess | StaticAccess:
        if self._access is None:
            raise Internal("this KV service was built without sessions")
        return self._access

    @property
    def sessions(
        self,
    ) -> SessionTable[ShardSession] | SessionTable[PagedSession] | SessionTable[StaticSession]:
        return self.access.sessions

    def capture(self, owner: str, session_id: str, token_ids: Sequence[int], start: int = 0) -> KvBlob:
        """The session's valid positions (the first len(token_ids) when given) as a checked blob;
        ``start`` > 0: only those from it on (a part; token_ids required, the part's own kept)."""
        if start and not token_ids:
            raise InvalidArgument("token_ids", "must name the captured tokens when from_position is set")
        return self.access.snapshot(owner, session_id, token_ids, start=start, checksum=True, named=True)

    def keep(self, owner: str, session_id: str, scope: str, token_ids: Sequence[int]) -> tuple[int, int]:
        """Capture into the prefix cache; returns (positions, bytes newly stored)."""
        if not token_ids:
            raise InvalidArgument("token_ids", "must name the captured tokens to keep them in the cache")
        blob = self.access.snapshot(owner, session_id, token_ids, start=0, checksum=False, named=False)
        added = self.store.put(owner, scope, token_ids, blob.arrays)
        self.access.kept(owner, session_id, scope, token_ids)
        return blob.positions, added

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
        self.access.restore(owner, session_id, blob)
        return blob.positions

    def restore_cached(
        self, owner: str, session_id: str, scope: str, token_ids: Sequence[int], positions: int
    ) -> int:
        """Load the first ``positions`` positions of a sequence kept in the prefix cache."""
        self.access.restore_cached(owner, session_id, self.store, self.source, scope, token_ids, positions)
        return positions

    def dropped(self, owner: str) -> list[str]:
        """The keys of the owner's prefix cache blocks dropped since its last keep or restore
        reply, which this one carries (``evicted_blocks``)."""
        return self.store.take_dropped(owner)
