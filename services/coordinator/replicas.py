"""Replica stages as fixed lanes: several rings over the same export, one session on one lane.

A lane is one replica of every stage, chained (replica r of stage k forwards to replica r of
stage k+1, as the launcher starts them), so each lane is a whole :class:`Ring` with its own
health watch, entry stream and results subscription. :class:`LaneRing` stands where a ring
stands (``Generation``, ``PlanRing`` and the scheduler see one ring): it opens each new session
on the least loaded healthy lane and sends every later call of that session to that lane. A
lane with any stage down (dead, failing its health Watch, draining) takes no new sessions until
its watch sees every stage serve again, so a restarted replica rejoins without a coordinator
restart. Running sessions of a failed lane are moved by ``failover.Failover``.

The limit of lanes (docs/ARCHITECTURE.md): one dead replica takes its whole lane out, so a
fleet of R replicas of each stage survives R - 1 failures only when they fall in the same lane.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import structlog

from pipeshard.errors import FailedPrecondition, PipeshardError, Unavailable
from pipeshard.services.coordinator.ring import Ring
from pipeshard.v1 import activation_pb2, stage_pb2

log = structlog.get_logger(__name__)

# What replicas of one layer range must agree on: a session moved between them must see the same
# model, the same numerics and the same cache layout.
_AGREEMENT = ("model_fingerprint", "precision", "kv_backend", "kv_block_tokens", "layer_start", "layer_end")


def check_replicas_agree(
    lanes: list[list[stage_pb2.GetStageInfoResponse]], addresses: list[list[str]]
) -> None:
    """Refuses replicas of a stage that disagree with lane 0's on the export fingerprint,
    precision or KV layout, naming both processes and the field."""
    for r, infos in enumerate(lanes[1:], start=1):
        for k, (first, other) in enumerate(zip(lanes[0], infos, strict=True)):
            for name in _AGREEMENT:
                if getattr(first, name) != getattr(other, name):
                    raise FailedPrecondition(
                        f"replicas of stage {k} disagree on {name}: {addresses[0][k]} has "
                        f"{getattr(first, name)!r}, {addresses[r][k]} has {getattr(other, name)!r}"
                    )


class LaneRing:
    """Several lanes behind one ring's interface; sessions spread over the healthy ones."""

    def __init__(self, lanes: list[Ring]):
        if not lanes:
            raise ValueError("a lane ring needs at least one lane")
        self.lanes = lanes
        self._lane_of: dict[str, int] = {}  # session id -> its lane
        self.on_health: Callable[[bool], None] = lambda serving: None  # the coordinator's health
        for lane in lanes:
            lane.on_health = lambda _serving: self.on_health(self.healthy)

    @property
    def num_stages(self) -> int:
        return self.lanes[0].num_stages

    @property
    def addresses(self) -> list[str]:
        return self.lanes[0].addresses

    @property
    def healthy(self) -> bool:
        """True while some lane has every stage reachable."""
        return any(lane.healthy for lane in self.lanes)

    def live_lanes(self) -> list[int]:
        """The lanes with every stage reachable, least loaded first."""
        load = [0] * len(self.lanes)
        for lane in self._lane_of.values():
            load[lane] += 1
        return sorted((i for i, lane in enumerate(self.lanes) if lane.healthy), key=lambda i: (load[i], i))

    def lane_of(self, session_id: str) -> int:
        return self._lane_of.get(session_id, 0)

    def down_reason(self) -> str:
        """Why no lane serves: the first down stage of each lane, named with its address."""
        reasons = [lane.watch.describe(min(lane.watch.down)) for lane in self.lanes if lane.watch.down]
        return "; ".join(reasons) or "no replica lane is serving"

    async def start(self) -> None:
        for lane in self.lanes:
            await lane.start()

    async def wait_ready(self, timeout_s: float) -> None:
        await asyncio.gather(*(lane.wait_ready(timeout_s) for lane in self.lanes))

    async def stage_infos(self) -> list[stage_pb2.GetStageInfoResponse]:
        """Lane 0's answers, once every lane's replicas agree with them (``check_replicas_agree``).
        Admission counts against one lane's budgets, so any surviving lane can take every session."""
        lanes = await asyncio.gather(*(lane.stage_infos() for lane in self.lanes))
        check_replicas_agree(list(lanes), [lane.addresses for lane in self.lanes])
        return lanes[0]

    def stop_steps(self, reason: str) -> None:
        for lane in self.lanes:
            lane.stop_steps(reason)

    async def close(self) -> None:
        for lane in self.lanes:
            await lane.close()

    async def open_session(self, session_id: str, capacity: int | None = None) -> int:
        """Opens on the least loaded healthy lane; a lane that fails the open is skipped for the next."""
        error: Unavailable | None = None
        for index in self.live_lanes():
            self._lane_of[session_id] = index
            try:
                max_context = await self.lanes[index].open_session(session_id, capacity)
            except Unavailable as exc:
                self._lane_of.pop(session_id, None)
                error = exc
                continue
            except BaseException:
                self._lane_of.pop(session_id, None)
                raise
            log.debug("session_lane", session_id=session_id, lane=index)
            return max_context
        raise error or Unavailable(self.down_reason())

    async def step(self, frame: activation_pb2.ActivationFrame) -> activation_pb2.StepResult:
        return await self._lane(frame.session_id).step(frame)

    async def step_plan(self, frames: list[activation_pb2.ActivationFrame]) -> list:
        """Each lane's frames as its own plan frame, sent at once; answers in the given order."""
        groups: dict[int, list[int]] = {}
        for i, frame in enumerate(frames):
            groups.setdefault(self.lane_of(frame.session_id), []).append(i)
        answers: list = [None] * len(frames)
        results = await asyncio.gather(
            *(self.lanes[lane].step_plan([frames[i] for i in rows]) for lane, rows in groups.items()),
            return_exceptions=True,  # a failed lane fails its own rows only
        )
        for rows, lane_answers in zip(groups.values(), results, strict=True):
            if isinstance(lane_answers, BaseException):
                if not isinstance(lane_answers, PipeshardError):
                    raise lane_answers
                lane_answers = [lane_answers] * len(rows)
            for i, answer in zip(rows, lane_answers, strict=True):
                answers[i] = answer
        return answers

    def timeout_for(self, rows: int) -> float:
        return self.lanes[0].timeout_for(rows)

    async def release_session(self, session_id: str) -> None:
        lane = self._lane(session_id)
        self._lane_of.pop(session_id, None)
        await lane.release_session(session_id)

    async def abort_session(self, session_id: str, reason: str) -> None:
        lane = self._lane(session_id)
        self._lane_of.pop(session_id, None)
        await lane.abort_session(session_id, reason)

    async def keep_kv(self, session_id: str, scope: str, token_ids: list[int]) -> set[str]:
        return await self._lane(session_id).keep_kv(session_id, scope, token_ids)

    async def restore_kv(
        self, session_id: str, scope: str, token_ids: list[int], positions: int, timeout_s: float
    ) -> set[str]:
        return await self._lane(session_id).restore_kv(session_id, scope, token_ids, positions, timeout_s)

    def _lane(self, session_id: str) -> Ring:
        return self.lanes[self.lane_of(session_id)]
