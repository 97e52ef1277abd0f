"""Running sessions' KV captured ahead of a failure, so a failover restores it instead of replaying it.

A replica that dies takes its sessions' KV with it, and replaying a session's context on
another lane costs a prefill of all of it (bench-failover: about 9 s for 8 users at 1,024 tokens
on this machine). So while a session runs on a replica lane, the coordinator copies its KV from
every stage of that lane in the background, a part at a time (``CaptureKvRequest.from_position``:
the whole blocks completed since the last part), and holds the parts in this process as the
serialized bytes they arrived in: it never decodes, joins or re-encodes them (each such pass over
a long session's KV cost the failover time on a loaded machine, and the copies' upkeep cost decode
work). A failover streams each stage's parts back as they are into the new session on a healthy
lane (``RestoreKvStreamRequest.next_part``), and the stage joins them (``kvblob.join_parts``);
only what the copy does not hold yet (less than a block, plus a part still being captured) is
replayed. Parts are taken only of positions every stage has computed (the generation
reports them after each step's result), one capture per session at a time; a capture that fails
only leaves the copy shorter. Copies count against ``max_bytes`` (``--standby-kv-bytes``): past
it no session gets further parts, and their failovers replay the rest.

Each running request holds its own copy (a field of the request, not a table here keyed by session
id), so the copy stays the request's when a failover gives it a new session.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import structlog

from pipeshard.errors import PipeshardError
from pipeshard.metrics import STANDBY_KV_BYTES
from pipeshard.services.coordinator.replicas import ReplicaLanes
from pipeshard.shard.kvblob import SnapshotBytes

log = structlog.get_logger(__name__)

# Positions per part on stages that report no block size (stateful): a capture per this many tokens.
DEFAULT_PART_TOKENS = 32


@dataclass(eq=False)
class StandbyCopy:
    """One request's KV as captured so far from its session: the token ids of its positions and,
    per part, one serialized snapshot per stage. ``attached``: it follows the request's session
    (False once a failover took it, until it is restored into the new one)."""

    tokens: list[int] = field(default_factory=list)
    parts: list[list[SnapshotBytes]] = field(default_factory=list)
    nbytes: int = 0
    capturing: asyncio.Task | None = None
    attached: bool = True

    @property
    def positions(self) -> int:
        return len(self.tokens)


class KvStandby:
    """Captures and restores the standby copies of the requests running on ``lanes`` (each
    request holds its own copy) and counts their bytes."""

    def __init__(self, lanes: ReplicaLanes, block_tokens: int, max_bytes: int):
        self._lanes = lanes
        self.block_tokens = block_tokens or DEFAULT_PART_TOKENS
        self.max_bytes = max_bytes
        self.nbytes = 0
        STANDBY_KV_BYTES.set_function(lambda: self.nbytes)

    def computed(self, copy: StandbyCopy, session_id: str, tokens: Sequence[int]) -> None:
        """Every stage of the session's lane holds ``tokens`` (its positions so far): captures
        into ``copy`` in the background the whole blocks it lacks, unless a capture is under way."""
        end = len(tokens) // self.block_tokens * self.block_tokens
        busy = copy.capturing is not None or not copy.attached
        if busy or end <= copy.positions or self.nbytes >= self.max_bytes:
            return
        copy.capturing = asyncio.ensure_future(self._capture(session_id, copy, list(tokens[:end])))

    async def _capture(self, session_id: str, copy: StandbyCopy, tokens: list[int]) -> None:
        try:
            part = await self._lanes.capture_part(session_id, tokens, copy.positions)
        except PipeshardError as exc:  # the session ended or its lane failed: the copy stays as it is
            log.debug("standby_capture_failed", session_id=session_id, reason=str(exc))
            return
        finally:
            copy.capturing = None
        if not copy.attached:
            return  # dropped (ended) or taken (failing over) meanwhile
        size = sum(blob.nbytes for blob in part)
        copy.parts.append(part)
        copy.tokens = tokens
        copy.nbytes += size
        self.nbytes += size

    def take(self, copy: StandbyCopy) -> StandbyCopy:
        """Detaches a request's copy (its capture stopped): a failover restores it elsewhere."""
        copy.attached = False
        if copy.capturing is not None:
            copy.capturing.cancel()
            copy.capturing = None
        return copy

    def drop(self, copy: StandbyCopy | None) -> None:
        """A copy restored nowhere, or its request ended: its bytes no longer count."""
        if copy is not None:
            self.take(copy)
            self.nbytes -= copy.nbytes
            copy.nbytes, copy.parts, copy.tokens = 0, [], []

    async def restore(
        self, copy: StandbyCopy, session_id: str, timeout_s: float, stages: list[int] | None = None
    ) -> int:
        """Restores ``copy`` into ``session_id`` (open, empty, on a healthy lane) on every stage,
        or only on ``stages`` (a per-hop failover: the session's other stages kept theirs), where it
        follows that session from then on; returns the positions restored. Raises when a stage
        fails it (the session then holds who knows what: the caller replaces it)."""
        started = time.perf_counter()
        per_stage = [[part[k] for part in copy.parts] for k in range(len(copy.parts[0]))]
        await asyncio.wait_for(
            self._lanes.restore_parts(session_id, per_stage, timeout_s, stages=stages), timeout_s
        )
        copy.attached = True
        log.info(
            "standby_restored",
            session_id=session_id,
            positions=copy.positions,
            parts=len(copy.parts),
            stages=stages if stages is not None else "all",
            nbytes=sum(
                blob.nbytes
                for part in copy.parts
                for k, blob in enumerate(part)
                if stages is None or k in stages
            ),
            load_ms=round((time.perf_counter() - started) * 1000, 1),
        )
        return copy.positions
