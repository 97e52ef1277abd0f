"""Replica stages as fixed lanes: several transports over the same export, one session on one lane.

A lane is one replica of every stage, chained (replica r of stage k forwards to replica r of
stage k+1, as the launcher starts them), so each lane is a whole :class:`RemoteStages` with its
own health watch, entry stream and results subscription. :class:`ReplicaLanes` is the ring's
transport (a ``StageLink``: ``Generation``, the ring's step batcher and the scheduler see one
ring, and a batched step's rows are split by lane): it opens each new session
on the least loaded healthy lane and sends every later call of that session to that lane. A
lane with any stage down (dead, failing its health Watch, draining) takes no new sessions until
its watch sees every stage serve again, so a restarted replica rejoins without a coordinator
restart. Running sessions of a failed lane are moved by ``failover.Failover``. Lanes may be
added and drained at run time (the coordinator re-reads its topology on SIGHUP): a draining lane
takes no new sessions and closes once its running ones have ended. Prefix caching stays per lane
(each lane's stages keep their own KV): a restore goes to the lane that kept the prefix, unless
that lane already runs PREFIX_SKEW sessions more than the one chosen by load.

The limit of lanes (docs/ARCHITECTURE.md): one dead replica takes its whole lane out, so a
fleet of R replicas of each stage survives R - 1 failures only when they fall in the same lane.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Callable

import structlog

from pipeshard.errors import FailedPrecondition, PipeshardError, Unavailable
from pipeshard.services.coordinator.remote_stages import RemoteStages
from pipeshard.shard.kvblob import SnapshotBytes
from pipeshard.shard.prefix_chain import block_chain
from pipeshard.v1 import activation_pb2, stage_pb2

log = structlog.get_logger(__name__)

# What replicas of one layer range must agree on: a session moved between them must see the same
# model, the same numerics and the same cache layout.
# How many more sessions than the session's own lane the lane holding its prefix may run and
# still take it: prefix hits without piling every chat onto one lane.
PREFIX_SKEW = 2
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


class KeptBlocks:
    """Which lane's stages keep each prefix block (chain key -> lane), least recently used first
    out beyond ``max_blocks``; a block a lane reports dropped is forgotten for that lane."""

    def __init__(self, max_blocks: int = 65536):
        self.max_blocks = max_blocks
        self._lanes: OrderedDict[str, RemoteStages] = OrderedDict()

    def add(self, lane: RemoteStages, keys: list[str], dropped: set[str]) -> None:
        for key in keys:
            self._lanes[key] = lane
            self._lanes.move_to_end(key)
        for key in dropped:
            if self._lanes.get(key) is lane:
                del self._lanes[key]
        while len(self._lanes) > self.max_blocks:
            self._lanes.popitem(last=False)

    def holder(self, key: str) -> RemoteStages | None:
        return self._lanes.get(key)


class ReplicaLanes:
    """Several lanes behind one transport's interface; sessions spread over the healthy ones."""

    def __init__(self, lanes: list[RemoteStages]):
        if not lanes:
            raise ValueError("a lane ring needs at least one lane")
        self.lanes: list[RemoteStages] = []
        self._lane_of: dict[str, RemoteStages] = {}  # session id -> its lane
        self._capacity: dict[str, int | None] = {}  # session id -> the capacity it opened with
        self._kept = KeptBlocks()
        self.draining: set[RemoteStages] = set()  # out of rotation, closed once their sessions end
        self._background: set[asyncio.Task] = set()
        self.on_health: Callable[[bool], None] = lambda serving: None  # the coordinator's health
        for lane in lanes:
            self._join(lane)

    def _join(self, lane: RemoteStages) -> None:
        lane.on_health = lambda _serving: self.on_health(self.healthy)
        self.lanes.append(lane)

    @property
    def num_stages(self) -> int:
        return self.lanes[0].num_stages

    @property
    def addresses(self) -> list[str]:
        return self.lanes[0].addresses

    @property
    def healthy(self) -> bool:
        """True while some lane in rotation has every stage reachable."""
        return bool(self.live_lanes())

    def live_lanes(self) -> list[RemoteStages]:
        """The lanes in rotation with every stage reachable, least loaded first."""
        load = {id(lane): 0 for lane in self.lanes}
        for lane in self._lane_of.values():
            load[id(lane)] += 1
        live = [lane for lane in self.lanes if lane.healthy and lane not in self.draining]
        return sorted(live, key=lambda lane: (load[id(lane)], self.lanes.index(lane)))

    def lane_of(self, session_id: str) -> int:
        """The index of the session's lane (for logs); -1 when it has none."""
        lane = self._lane_of.get(session_id)
        return self.lanes.index(lane) if lane in self.lanes else -1

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

    async def add_lane(self, lane: RemoteStages, timeout_s: float) -> None:
        """Starts a new lane and puts it in rotation once it answers, its health watch has heard every
        stage and hop serving (a stage may still be reconnecting to a restarted next stage) and its
        replicas agree with a serving lane's; a lane that does not is closed and the error raised."""
        try:
            await lane.start()
            await lane.wait_ready(timeout_s)
            try:
                await lane.watch.wait_serving(timeout_s)
            except TimeoutError as exc:
                raise Unavailable(f"the new lane is not serving: {exc}") from None
            reference = (self.live_lanes() or self.lanes)[0]
            infos = await asyncio.gather(reference.stage_infos(), lane.stage_infos())
            check_replicas_agree(list(infos), [reference.addresses, lane.addresses])
        except BaseException:
            await lane.close()
            raise
        self._join(lane)
        log.info("lane_added", lane=len(self.lanes) - 1, stages=lane.addresses)
        self.on_health(self.healthy)

    def drain_lane(self, lane: RemoteStages) -> None:
        """Takes ``lane`` out of rotation now and closes it once its running sessions have ended."""
        if lane in self.draining:
            return
        self.draining.add(lane)
        log.info("lane_draining", stages=lane.addresses, sessions=self._sessions_on(lane))
        task = asyncio.ensure_future(self._close_when_idle(lane))
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        self.on_health(self.healthy)

    def _sessions_on(self, lane: RemoteStages) -> int:
        return sum(1 for held in self._lane_of.values() if held is lane)

    async def _close_when_idle(self, lane: RemoteStages) -> None:
        while self._sessions_on(lane):
            await asyncio.sleep(0.2)
        self.lanes.remove(lane)
        self.draining.discard(lane)
        await lane.close()
        log.info("lane_drained", stages=lane.addresses)

    def stop_steps(self, reason: str) -> None:
        for lane in self.lanes:
            lane.stop_steps(reason)

    async def close(self) -> None:
        for task in self._background:
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        for lane in self.lanes:
            await lane.close()

    async def open_session(self, session_id: str, capacity: int | None = None) -> int:
        """Opens on the least loaded healthy lane; a lane that fails the open is skipped for the next."""
        error: Unavailable | None = None
        self._capacity[session_id] = capacity
        for lane in self.live_lanes():
            self._lane_of[session_id] = lane
            try:
                max_context = await lane.open_session(session_id, capacity)
            except Unavailable as exc:
                self._lane_of.pop(session_id, None)
                error = exc
                continue
            except BaseException:
                self._lane_of.pop(session_id, None)
                self._capacity.pop(session_id, None)
                raise
            return max_context
        self._capacity.pop(session_id, None)
        raise error or Unavailable(self.down_reason())

    async def run(self, frames: list[activation_pb2.ActivationFrame]) -> list:
        """Each lane's frames as its own step, sent at once; answers in the given order (a failed
        lane answers its own rows with its error)."""
        groups: dict[RemoteStages, list[int]] = {}
        for i, frame in enumerate(frames):
            groups.setdefault(self._lane(frame.session_id), []).append(i)
        answers: list = [None] * len(frames)
        results = await asyncio.gather(
            *(lane.run([frames[i] for i in rows]) for lane, rows in groups.items()),
            return_exceptions=True,
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
        try:
            await lane.release_session(session_id)
        finally:
            self._lane_of.pop(session_id, None)
            self._capacity.pop(session_id, None)

    async def abort_session(self, session_id: str, reason: str) -> None:
        lane = self._lane(session_id)
        try:
            await lane.abort_session(session_id, reason)
        finally:
            self._lane_of.pop(session_id, None)
            self._capacity.pop(session_id, None)

    async def keep_kv(self, session_id: str, scope: str, token_ids: list[int]) -> set[str]:
        """Keeps on the session's lane and remembers that lane holds those blocks."""
        lane = self._lane(session_id)
        dropped = await lane.keep_kv(session_id, scope, token_ids)
        self._kept.add(lane, [block.key for block in block_chain(scope, token_ids)], dropped)
        return dropped

    async def restore_kv(
        self, session_id: str, scope: str, token_ids: list[int], positions: int, timeout_s: float
    ) -> set[str]:
        """Restores on the lane that kept the prefix: a session just opened elsewhere (empty) is
        moved there first when that lane serves, so a replicated fleet keeps its prefix hits."""
        chain = block_chain(scope, token_ids)
        holder = self._kept.holder(chain[-1].key) if chain else None
        if holder is not None and holder is not self._lane(session_id) and self._may_move(session_id, holder):
            await self._move_empty(session_id, holder)
        lane = self._lane(session_id)
        dropped = await lane.restore_kv(session_id, scope, token_ids, positions, timeout_s)
        self._kept.add(lane, [], dropped)
        return dropped

    async def capture_part(self, session_id: str, token_ids: list[int], start: int) -> list[SnapshotBytes]:
        """Every stage's part [start, len(token_ids)) of the session's KV, from its lane (kv_standby.py)."""
        return await self._lane(session_id).capture_part(session_id, token_ids, start)

    async def restore_parts(
        self, session_id: str, parts: list[list[SnapshotBytes]], timeout_s: float
    ) -> None:
        """Restores each stage's consecutive parts into the session, on its lane."""
        await self._lane(session_id).restore_parts(session_id, parts, timeout_s)

    def _may_move(self, session_id: str, holder: RemoteStages) -> bool:
        """Prefix affinity within bounds: the holder serves and runs fewer than PREFIX_SKEW
        sessions more than the session's own lane (with the session counted there)."""
        if holder not in self.live_lanes():
            return False
        own = self._lane(session_id)
        return self._sessions_on(holder) < self._sessions_on(own) + PREFIX_SKEW

    async def _move_empty(self, session_id: str, lane: RemoteStages) -> None:
        """Reopens a session that holds nothing yet on ``lane`` (same id and capacity)."""
        old = self._lane(session_id)
        self._lane_of[session_id] = lane  # counted there at once: concurrent moves see the skew
        await old.abort_session(session_id, "moved to the lane holding its prefix")
        try:
            await lane.open_session(session_id, self._capacity.get(session_id))
        except BaseException:
            self._lane_of.pop(session_id, None)
            raise

    def _lane(self, session_id: str) -> RemoteStages:
        return self._lane_of.get(session_id) or self.lanes[0]
