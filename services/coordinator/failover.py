"""Failover of running requests: a session whose replica failed continues on a healthy one.

Per hop first: when a step fails with UNAVAILABLE because a replica on the session's route died,
stopped answering or drains, and the request's standby copy holds its KV, only that stage's part
of the session moves (replicas.py routes sessions per stage): it is aborted on the dead replica,
opened on another replica of the same stage, that stage's parts of the copy are restored there,
the route's other stages cut the session back to the copy's positions (``RouteSession``: they keep
their KV, no restore, no reopen) and the stage before it forwards to the new replica; what the copy
does not hold is computed again, as below. Without a usable copy, or when the per-hop move fails,
the whole session moves, as replicas riding fixed lanes always did: its session is aborted on the
old route, a new one opens through the ring (so the scheduler's KV mirror moves the request's
reservation to it) on the least loaded healthy lane, and the session's KV comes back: from its
standby copy (kv_standby.py: captured from the old lane ahead of the failure, block by block),
else from the longest prefix of the prompt a serving lane kept in its prefix cache; what neither
holds of the prompt and the tokens generated so far but the last is prefilled again (replayed), and
the next step sends the last. The failover does only the per-request async work (abort, open,
restore) in its own task; the replay is the engine's: the request comes back under its id as
REPLAYING, its rows the replay's chunks, which ``EngineCore.schedule`` plans like a prompt's, under
the step's token budget beside other requests' rows, and then the lost step goes at once, alone.
The client's stream goes on: the lost step is sent again, so no token repeats or goes missing, and
at `exact` and `invariant` (a row's tokens independent of prompt chunking and of prefix reuse) the
output equals an undisturbed run: the session's first row after a restore always carries two
tokens or more (a two-token stage's path for every row). A ring shutting down
(:class:`ShuttingDown`) or no lane left ends the request as before.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Protocol

import structlog

from pipeshard import trace
from pipeshard.errors import PipeshardError, Unavailable
from pipeshard.metrics import FAILOVERS
from pipeshard.services.coordinator.kv_standby import KvStandby, StandbyCopy
from pipeshard.services.coordinator.replicas import ReplicaLanes
from pipeshard.services.coordinator.ring import RingLike, ShuttingDown

if TYPE_CHECKING:
    from pipeshard.services.coordinator.scheduler import ScheduledRequest

log = structlog.get_logger(__name__)


class RestoredCursor(Protocol):
    """Where a moved request's new session stands: the positions its KV holds."""

    @property
    def logical(self) -> int: ...

    def restored(self, positions: int) -> None:
        """The session starts with ``positions`` positions restored on every stage."""

    def reject(self, n: int) -> None:
        """The last ``n`` positions are dropped by the next frame, which computes them again."""


class MovableRequest(Protocol):
    """What a failover needs of a running request (generation.py's): its public moves, so this
    module depends on no generation internals and the two do not import each other."""

    @property
    def session_id(self) -> str: ...

    @property
    def prompt_ids(self) -> list[int]: ...

    @property
    def generated(self) -> list[int]: ...

    @property
    def cursor(self) -> RestoredCursor: ...

    @property
    def admission(self) -> ScheduledRequest | None:
        """The scheduler's admission, whose KV charge each new session takes over."""

    # Its standby copy: taken for the move, and the restored copy (or a new one) after it.
    standby: StandbyCopy

    def move_to(self, session_id: str) -> list[int]:
        """Starts over in a new, empty session; returns the tokens to prefill it with."""
        ...

    def expedite(self) -> None:
        """Its next decode step (the lost one) leaves at once, not after the steps in flight."""

    def replay(self, tokens: list[int], chunk: int) -> None:
        """Its new session is to be brought up to ``tokens``: the engine plans the chunks (the
        request's rows while it replays), the last one riding with the lost step."""


class Failover:
    """Moves a failed lane's running requests to healthy lanes of ``lanes``; ``standby`` (None:
    off) keeps their KV captured ahead so a move restores it."""

    def __init__(
        self, lanes: ReplicaLanes, standby: KvStandby | None = None, restore_timeout_s: float = 30.0
    ):
        self._lanes = lanes
        self.standby = standby
        self.restore_timeout_s = restore_timeout_s

    def applies(self, error: Unavailable) -> bool:
        """Whether a request failing with ``error`` may move: a lane failed and another serves."""
        return not isinstance(error, ShuttingDown) and self._lanes.healthy

    def computed(self, request: MovableRequest, tokens: Sequence[int]) -> None:
        """Every stage holds ``tokens`` for the request's session (after a step's result): its
        standby copy follows."""
        if self.standby is not None:
            self.standby.computed(request.standby, request.session_id, tokens)

    def ended(self, request: MovableRequest) -> None:
        if self.standby is not None:
            self.standby.drop(request.standby)

    async def resume(
        self,
        ring: RingLike,
        request: MovableRequest,
        error: Unavailable,
        capacity: int,
        prefill_chunk: int,
        warm: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        """Rebuilds ``request``'s session on a healthy lane through ``ring`` (the generation's, with
        its accounting) and hands the request back with its replay to run (``request.replay``:
        the engine's rows); tries each lane once, then raises the last error. The KV comes from
        the standby copy when it holds any, else ``warm`` restores what it can of the prompt from
        the prefix cache (the lane that kept it)."""
        started = time.perf_counter()
        copy = self.standby.take(request.standby) if self.standby is not None else None
        try:
            if copy is not None and await self._move_hop(request, copy, error, prefill_chunk, started):
                copy = None  # the session's again
                return
            for _ in range(len(self._lanes.lanes) + 1):
                if not self.applies(error):
                    raise error
                old, old_lane = request.session_id, self._lanes.lane_of(request.session_id)
                await ring.abort_session(old, f"moved to another replica: {error}")
                aborted = time.perf_counter()
                replay = request.move_to(uuid.uuid4().hex)
                trace.mark("failover_begin", request.session_id, 0)
                try:
                    await ring.open_session(request.session_id, capacity, request.admission)
                    opened = time.perf_counter()
                    trace.mark("failover_opened", request.session_id, 0)
                    source, copy = await self._restore(
                        ring, request, copy, replay or request.prompt_ids, capacity
                    )
                    if not request.cursor.logical and warm is not None:
                        await warm()
                        source = "prefix_cache" if request.cursor.logical else source
                    restored = self._two_token_start(request, replay)
                    kv_ready = time.perf_counter()
                    trace.mark("failover_restored", request.session_id, 0)
                except Unavailable as exc:
                    error = exc
                    continue
                request.replay(replay[restored:], prefill_chunk)  # the engine's rows from here
                request.expedite()  # the lost step, once replayed, goes at once
                FAILOVERS.inc()
                log.warning(
                    "session_failed_over",
                    old_session=old,
                    session_id=request.session_id,
                    from_lane=old_lane,
                    to_lane=self._lanes.lane_of(request.session_id),
                    kv_from=source,
                    restored_tokens=min(restored, len(replay)) if replay else restored,
                    replayed_tokens=max(0, len(replay) - restored),
                    abort_ms=round((aborted - started) * 1000, 1),
                    open_ms=round((opened - aborted) * 1000, 1),
                    restore_ms=round((kv_ready - opened) * 1000, 1),
                    seconds=round(time.perf_counter() - started, 3),
                    reason=str(error),
                )
                return
            raise error
        finally:
            if self.standby is not None:
                self.standby.drop(copy)  # still detached: restored nowhere (None once restored)
                if not request.standby.attached:
                    request.standby = StandbyCopy()  # the new session's, from its start

    async def _move_hop(
        self,
        request: MovableRequest,
        copy: StandbyCopy,
        error: Unavailable,
        prefill_chunk: int,
        started: float,
    ) -> bool:
        """Moves only the broken stages' part of the request's session (the module's first path);
        False, with the session as it was or half moved, when it cannot (no usable copy, every
        stage broken, no replica to take a part, a call failed): the whole session moves then."""
        sid, broken = request.session_id, self._lanes.broken(request.session_id)
        if (
            self.standby is None
            or not self.applies(error)
            or not broken
            or len(broken) == self._lanes.num_stages
        ):
            return False
        replay = request.move_to(sid)  # the same session, its cursor restarted: its step ids go on
        if not copy.positions or not self._usable(request, copy, replay or request.prompt_ids):
            return False
        from_route = self._lanes.route_of(sid)
        trace.mark("failover_begin", sid, 0)
        try:
            await self._lanes.move_stages(sid, broken, f"moved to another replica of its stage: {error}")
            opened = time.perf_counter()
            positions = await self.standby.restore(copy, sid, self.restore_timeout_s, stages=broken)
            await self._lanes.reroute(sid, broken, positions)
        except (PipeshardError, TimeoutError) as exc:
            self.standby.take(copy)  # restored or not, the whole session's move takes it from here
            log.warning(
                "hop_move_failed", session_id=sid, stages=broken, reason=str(exc) or type(exc).__name__
            )
            return False
        kv_ready = time.perf_counter()
        trace.mark("failover_restored", sid, 0)
        request.cursor.restored(positions)
        request.standby = copy
        restored = self._two_token_start(request, replay)
        request.replay(replay[restored:], prefill_chunk)  # the engine's rows from here
        request.expedite()
        FAILOVERS.inc()
        log.warning(
            "session_failed_over",
            old_session=sid,
            session_id=sid,
            moved_stages=broken,
            from_route=from_route,
            to_route=self._lanes.route_of(sid),
            kv_from="standby",
            restored_tokens=min(restored, len(replay)) if replay else restored,
            replayed_tokens=max(0, len(replay) - restored),
            open_ms=round((opened - started) * 1000, 1),
            restore_ms=round((kv_ready - opened) * 1000, 1),
            seconds=round(time.perf_counter() - started, 3),
            reason=str(error),
        )
        return True

    @staticmethod
    def _usable(request: MovableRequest, copy: StandbyCopy, seen: list[int]) -> bool:
        """Whether ``copy`` holds a prefix of the positions ``seen`` that leaves something to
        compute (short of the whole prompt while still prefilling, which needs a last chunk)."""
        return copy.tokens == seen[: copy.positions] and (
            bool(request.generated) or copy.positions < len(request.prompt_ids)
        )

    @staticmethod
    def _two_token_start(request: MovableRequest, replay: list[int]) -> int:
        """The restored positions the session keeps: all but the last when its first row would
        otherwise be one token (nothing left to replay, or one prompt token left to prefill),
        so that row is a chunk of two, the path every row of a two-token (`invariant`) stage
        takes, whether or not the snapshot carried the input to re-feed."""
        restored = request.cursor.logical
        left = len(replay) + 1 if replay else len(request.prompt_ids)
        if restored and left - restored == 1:
            request.cursor.reject(1)
            restored -= 1
        return restored

    async def _restore(
        self,
        ring: RingLike,
        request: MovableRequest,
        copy: StandbyCopy | None,
        seen: list[int],
        capacity: int,
    ) -> tuple[str, StandbyCopy | None]:
        """Restores the standby copy into the request's new session when it holds a prefix of the
        positions ``seen`` (short of the whole prompt while still prefilling, which needs a last
        chunk); returns where the KV came from and the copy still to restore on a later lane (None
        once it is the new session's). A copy a stage fails to take is given up: the session is
        replaced by an empty one, and the request replays."""
        if self.standby is None or copy is None or not copy.positions:
            return "none", copy
        if not self._usable(request, copy, seen):
            return "none", copy
        try:
            positions = await self.standby.restore(copy, request.session_id, self.restore_timeout_s)
        except (PipeshardError, TimeoutError) as exc:
            if isinstance(exc, Unavailable):
                raise  # the new lane failed too: the caller tries the next with the copy kept
            reason = str(exc) or type(exc).__name__
            log.warning("standby_restore_failed", session_id=request.session_id, reason=reason)
            self.standby.drop(copy)
            await ring.abort_session(request.session_id, f"standby KV restore failed: {reason}")
            request.move_to(uuid.uuid4().hex)
            await ring.open_session(request.session_id, capacity, request.admission)
            return "none", None
        request.cursor.restored(positions)
        request.standby = copy  # it follows the new session from where it stands
        return "standby", None
