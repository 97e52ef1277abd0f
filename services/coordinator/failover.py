"""Failover of running requests: a session whose lane failed continues on a healthy one.

When a step fails with UNAVAILABLE (a stage of the session's lane died, stopped answering or
drains) and another lane serves, the generation is not ended: its session is aborted on the old
lane, a new one opens through the ring (so the scheduler's KV mirror moves the request's
reservation to it) on the least loaded healthy lane, the longest prefix of the prompt a serving
lane kept in its prefix cache is restored (on that lane), and the rest of the prompt and every
token generated so far but the last are prefilled (replayed); the next step sends the last. The
client's stream goes on: the lost step is sent again, so no token repeats or goes missing, and in
exact mode (a row's tokens independent of prompt chunking) the output equals an undisturbed run.
A ring shutting down (:class:`ShuttingDown`) or no lane left ends the request as before.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import structlog

from pipeshard.errors import Unavailable
from pipeshard.metrics import FAILOVERS
from pipeshard.services.coordinator.replicas import ReplicaLanes
from pipeshard.services.coordinator.ring import ShuttingDown

if TYPE_CHECKING:
    from pipeshard.services.coordinator.generation import RingLike, _Request

log = structlog.get_logger(__name__)


class Failover:
    """Moves a failed lane's running requests to healthy lanes of ``lanes``."""

    def __init__(self, lanes: ReplicaLanes):
        self._lanes = lanes

    def applies(self, error: Unavailable) -> bool:
        """Whether a request failing with ``error`` may move: a lane failed and another serves."""
        return not isinstance(error, ShuttingDown) and bool(self._lanes.live_lanes())

    async def resume(
        self,
        ring: RingLike,
        request: _Request,
        error: Unavailable,
        capacity: int,
        prefill_chunk: int,
        warm: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        """Rebuilds ``request``'s session on a healthy lane through ``ring`` (the generation's, with
        its accounting and batching); tries each lane once, then raises the last error. ``warm``
        restores what it can of the prompt from the prefix cache first (the lane that kept it)."""
        started = time.perf_counter()
        for _ in range(len(self._lanes.lanes) + 1):
            if not self.applies(error):
                raise error
            old, old_lane = request.session_id, self._lanes.lane_of(request.session_id)
            await ring.abort_session(old, f"moved to another replica: {error}")
            replay = request.move_to(uuid.uuid4().hex)
            try:
                await ring.open_session(request.session_id, capacity)
                if warm is not None:
                    await warm()
                restored = request.cursor.logical
                for frame in request.replay_frames(replay[restored:], prefill_chunk):
                    await ring.step(frame)
            except Unavailable as exc:
                error = exc
                continue
            FAILOVERS.inc()
            log.warning(
                "session_failed_over",
                old_session=old,
                session_id=request.session_id,
                from_lane=old_lane,
                to_lane=self._lanes.lane_of(request.session_id),
                restored_tokens=min(restored, len(replay)),
                replayed_tokens=max(0, len(replay) - restored),
                seconds=round(time.perf_counter() - started, 3),
                reason=str(error),
            )
            return
        raise error
