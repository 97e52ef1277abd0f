"""Replica stages: several processes per stage, and each session routed over one of each.

A lane is one replica of every stage, chained as the launcher starts them (replica r of stage k
forwards first to replica r of stage k+1), so each lane is a whole :class:`RemoteStages` with its
own health watch, entry stream and results subscription; every lane shares the coordinator's one
owner secret and one table of pending steps. :class:`ReplicaLanes` is the ring's transport (a
``StageLink``: ``Generation``, the ring's step batcher and the scheduler see one ring, and a batched
step's rows are split by entry lane). Each session has a **route**, the replica of each stage it
lives on: a new session opens on the least loaded healthy lane (the route r, r, ..., r, whose calls
are the lane's own), or, when no lane has every stage up, across lanes over the live replicas of
each stage that can forward to each other (a stage lists the replicas of the next it forwards to in
GetStageInfo's ``next_hops``; a session's frames go to the one OpenSession's ``next_hop`` names).
When a replica dies only the sessions routed through it are failed, and ``failover.Failover`` moves
only that stage's part of each (``broken``, ``move_stages``, ``reroute``): the other stages keep
their sessions. A link between two replicas that is down (``StageWatch.hops_down``) blocks the
routes over it only: the part after it moves. Lanes may be added and drained at run time (the
coordinator re-reads its topology on SIGHUP): a draining lane's replicas take no new session parts
and it closes once no route uses it. Prefix caching stays per lane (each lane's stages keep their
own KV): a restore goes to the lane that kept the prefix, unless that lane already runs PREFIX_SKEW
sessions more than the one chosen by load.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import OrderedDict
from collections.abc import Callable, Iterator

import structlog

from pipeshard.errors import FailedPrecondition, PipeshardError, Unavailable
from pipeshard.services.coordinator.remote_stages import RemoteStages
from pipeshard.services.coordinator.ring import PLAIN, SessionTerms
from pipeshard.shard.kvblob import SnapshotBytes
from pipeshard.shard.prefix_chain import block_chain
from pipeshard.v1 import activation_pb2, stage_pb2

log = structlog.get_logger(__name__)

# How many more sessions than the session's own lane the lane holding its prefix may run and
# still take it: prefix hits without piling every chat onto one lane.
PREFIX_SKEW = 2
# Routes across lanes a new session tries (after the live lanes) before its open fails.
CROSSING_TRIES = 2
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


Route = tuple[RemoteStages, ...]  # the replica of each stage a session lives on, named by its lane


class ReplicaLanes:
    """Several lanes behind one transport's interface; sessions routed over their live replicas."""

    def __init__(self, lanes: list[RemoteStages]):
        if not lanes:
            raise ValueError("a lane ring needs at least one lane")
        self.lanes: list[RemoteStages] = []
        self._route: dict[str, Route] = {}  # session id -> its route
        self._terms: dict[str, SessionTerms] = {}  # session id -> what it opened with
        # (stage k, its replica's lane) -> {lane of stage k+1: that replica's index among its next hops}
        self._hops: dict[tuple[int, RemoteStages], dict[RemoteStages, int]] = {}
        self._kept = KeptBlocks()
        self.draining: set[RemoteStages] = set()  # out of rotation, closed once no route uses them
        self._background: set[asyncio.Task] = set()
        self.on_health: Callable[[bool], None] = lambda serving: None  # the coordinator's health
        for lane in lanes:
            self._join(lane)

    def _join(self, lane: RemoteStages) -> None:
        lane.on_health = lambda _serving: self._changed(lane)
        # A replica lost fails the pending steps of the sessions routed through it, not its lane's.
        lane.routes_through = lambda session_id, k: self._passes(session_id, k, lane)
        # A link between two replicas broken or healed changes which routes exist.
        lane.watch.on_hop_change = lambda _index, _hop, _up, _reason: self.on_health(self.healthy)
        self.lanes.append(lane)

    def _changed(self, lane: RemoteStages) -> None:
        """A replica of ``lane`` went or came back: the coordinator's health follows, and what the
        lane's stages forward to is asked again (a replica restarted with other next hops)."""
        self.on_health(self.healthy)
        self._in_background(self._relearn(lane))

    async def _relearn(self, lane: RemoteStages) -> None:
        up = [k for k in range(self.num_stages - 1) if k not in lane.watch.down]
        try:
            infos = await lane.stage_infos(stages=up)
        except PipeshardError:
            return  # down again: asked when it is back
        for k, info in zip(up, infos, strict=True):
            self._learn_stage(lane, k, info)

    def _passes(self, session_id: str, k: int, lane: RemoteStages) -> bool:
        route = self._route.get(session_id)
        return route is None or route[k] is lane

    @property
    def num_stages(self) -> int:
        return self.lanes[0].num_stages

    @property
    def addresses(self) -> list[str]:
        return self.lanes[0].addresses

    @property
    def healthy(self) -> bool:
        """True while a new session has a route: every stage has a live replica its neighbours reach."""
        return bool(self.live_lanes()) or next(self._crossing(), None) is not None

    def live_lanes(self) -> list[RemoteStages]:
        """The lanes in rotation with every stage reachable, least loaded first."""
        live = [lane for lane in self.lanes if lane.healthy and lane not in self.draining]
        return sorted(live, key=lambda lane: (self._sessions_on(lane), self.lanes.index(lane)))

    def _live(self, k: int, lane: RemoteStages) -> bool:
        """Whether ``lane``'s replica of stage ``k`` may take session parts (reachable itself: which
        replicas of the stage before reach it is each hop's question, ``_forwards``)."""
        return k not in lane.watch.unreachable and lane not in self.draining

    def _load(self, k: int, lane: RemoteStages) -> int:
        return sum(1 for route in self._route.values() if route[k] is lane)

    def hops_of(self, k: int, lane: RemoteStages) -> dict[RemoteStages, int]:
        """Where ``lane``'s replica of stage ``k`` forwards: each reachable lane's replica of stage
        k + 1 and its next-hop index. Its own lane's always (the first next hop: what lanes ride)."""
        return self._hops.get((k, lane)) or {lane: 0}

    def _forwards(self, k: int, lane: RemoteStages) -> dict[RemoteStages, int]:
        """``hops_of`` less the hops that are down (a partitioned link blocks the routes over it
        only: the replicas on either side stay usable on other routes)."""
        down = lane.watch.hops_down
        return {other: j for other, j in self.hops_of(k, lane).items() if (k, j) not in down}

    def _learn_hops(self, lane: RemoteStages, infos: list[stage_pb2.GetStageInfoResponse]) -> None:
        """Which replicas of the next stage each of ``lane``'s stages forwards to, from the addresses
        its GetStageInfo lists (``next_hops``) matched against the lanes' addresses."""
        for k, info in enumerate(infos[:-1]):
            self._learn_stage(lane, k, info)

    def _learn_stage(self, lane: RemoteStages, k: int, info: stage_pb2.GetStageInfoResponse) -> None:
        hops = {lane: 0}
        for index, address in enumerate(info.next_hops):
            for other in self.lanes:
                if other.addresses[k + 1] == address:
                    hops[other] = index
        self._hops[(k, lane)] = hops

    def _crossing(self) -> Iterator[Route]:
        """Routes across lanes over each stage's live replicas, least loaded first at each stage,
        each replica able to forward to the next (lanes excluded: ``live_lanes`` has them)."""
        n = self.num_stages

        def extend(route: Route) -> Iterator[Route]:
            if len(route) == n:
                if any(lane is not route[0] for lane in route):
                    yield route
                return
            k = len(route)
            reachable = self._forwards(k - 1, route[-1]) if k else None
            options = [
                lane
                for lane in self.lanes
                if self._live(k, lane) and (reachable is None or lane in reachable)
            ]
            for lane in sorted(options, key=lambda lane: (self._load(k, lane), self.lanes.index(lane))):
                yield from extend((*route, lane))

        return extend(())

    def lane_of(self, session_id: str) -> int:
        """The index of the lane the session enters at (for logs); -1 when it has none."""
        route = self._route.get(session_id)
        return self.lanes.index(route[0]) if route and route[0] in self.lanes else -1

    def route_of(self, session_id: str) -> list[int]:
        """The lane index of each stage's replica of the session (for logs); [] when it has none."""
        return [
            self.lanes.index(lane) if lane in self.lanes else -1 for lane in self._route.get(session_id, ())
        ]

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
        """Lane 0's answers, once every lane's replicas agree with them (``check_replicas_agree``);
        each stage's ``next_hops`` say which replicas routes may chain. Admission counts against
        one lane's budgets, so any surviving replica of a stage can take every session's part."""
        lanes = await asyncio.gather(*(lane.stage_infos() for lane in self.lanes))
        check_replicas_agree(list(lanes), [lane.addresses for lane in self.lanes])
        for lane, infos in zip(self.lanes, lanes, strict=True):
            self._learn_hops(lane, infos)
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
        self._learn_hops(lane, infos[1])
        log.info("lane_added", lane=len(self.lanes) - 1, stages=lane.addresses)
        self.on_health(self.healthy)

    def drain_lane(self, lane: RemoteStages) -> None:
        """Takes ``lane`` out of rotation now and closes it once no route uses it."""
        if lane in self.draining:
            return
        self.draining.add(lane)
        log.info("lane_draining", stages=lane.addresses, sessions=self._sessions_on(lane))
        self._in_background(self._close_when_idle(lane))
        self.on_health(self.healthy)

    def _in_background(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _sessions_on(self, lane: RemoteStages) -> int:
        """The sessions whose route uses any of ``lane``'s replicas."""
        return sum(1 for route in self._route.values() if any(held is lane for held in route))

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

    def _next_hop(self, route: Route, k: int) -> int | None:
        """Stage ``k``'s next-hop index for ``route`` (None for the final stage)."""
        return None if k + 1 == len(route) else self.hops_of(k, route[k])[route[k + 1]]

    @staticmethod
    def _lane_route(route: Route) -> RemoteStages | None:
        """The lane ``route`` rides whole, if it is one (its calls are the lane's own)."""
        return route[0] if all(lane is route[0] for lane in route) else None

    async def open_session(self, session_id: str, terms: SessionTerms = PLAIN) -> int:
        """Opens on the least loaded healthy lane, else across lanes; a route that fails the open
        is skipped for the next."""
        error: Unavailable | None = None
        self._terms[session_id] = terms
        lanes = [(lane,) * self.num_stages for lane in self.live_lanes()]
        for route in [*lanes, *itertools.islice(self._crossing(), CROSSING_TRIES)]:
            self._route[session_id] = route
            try:
                return await self._open_on(route, session_id, terms)
            except Unavailable as exc:
                self._route.pop(session_id, None)
                error = exc
                continue
            except BaseException:
                self._route.pop(session_id, None)
                self._terms.pop(session_id, None)
                raise
        self._terms.pop(session_id, None)
        raise error or Unavailable(self.down_reason())

    async def _open_on(self, route: Route, session_id: str, terms: SessionTerms) -> int:
        lane = self._lane_route(route)
        if lane is not None:
            return await lane.open_session(session_id, terms)
        return await self._open_parts(route, session_id, terms, list(range(len(route))))

    async def _open_parts(self, route: Route, session_id: str, terms: SessionTerms, stages: list[int]) -> int:
        """Opens the session on ``stages`` of ``route``, each forwarding to the route's next
        replica; all or nothing (what opened is released when another fails)."""
        results = await asyncio.gather(
            *(route[k].open_stage(k, session_id, terms, self._next_hop(route, k)) for k in stages),
            return_exceptions=True,
        )
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            opened = [k for k, r in zip(stages, results, strict=True) if not isinstance(r, BaseException)]
            self._in_background(self._release_parts(route, session_id, opened))
            raise failed[0]
        return min(r for r in results if not isinstance(r, BaseException))

    async def _release_parts(self, route: Route, session_id: str, stages: list[int]) -> None:
        await asyncio.gather(*(route[k].release_session(session_id, stages=[k]) for k in stages))

    async def run(self, frames: list[activation_pb2.ActivationFrame]) -> list:
        """Each entry lane's frames as its own step, sent at once; answers in the given order (a
        row whose route has a replica down answers with its error at once)."""
        groups: dict[RemoteStages, list[int]] = {}
        answers: list = [None] * len(frames)
        for i, frame in enumerate(frames):
            route = self._route_or_lane(frame.session_id)
            blocked = self._blocked(route)
            if blocked is not None:
                answers[i] = Unavailable(blocked)
            else:
                groups.setdefault(route[0], []).append(i)
        results = await asyncio.gather(
            *(lane.run([frames[i] for i in rows], checked=False) for lane, rows in groups.items()),
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

    def _blocked(self, route: Route) -> str | None:
        """Why ``route`` cannot step now (a replica on it unreachable, or the hop it uses between
        two of them down), or None. A replica down itself is named first: a dead stage also
        breaks the hop into it."""
        for k, lane in enumerate(route):
            if k in lane.watch.unreachable:
                return lane.watch.describe_own(k)
        for k, lane in enumerate(route):
            why = lane.watch.route_blocked(k, self._next_hop(route, k))
            if why is not None:
                return why
        return None

    def timeout_for(self, rows: int) -> float:
        return self.lanes[0].timeout_for(rows)

    async def release_session(self, session_id: str) -> None:
        route = self._route_or_lane(session_id)
        try:
            lane = self._lane_route(route)
            if lane is not None:
                await lane.release_session(session_id)
            else:
                await self._release_parts(route, session_id, list(range(len(route))))
        finally:
            self._route.pop(session_id, None)
            self._terms.pop(session_id, None)

    async def abort_session(self, session_id: str, reason: str) -> None:
        route = self._route_or_lane(session_id)
        try:
            await self._abort_on(route, session_id, reason)
        finally:
            self._route.pop(session_id, None)
            self._terms.pop(session_id, None)

    async def _abort_on(
        self, route: Route, session_id: str, reason: str, stages: list[int] | None = None
    ) -> None:
        lane = self._lane_route(route)
        if lane is not None and stages is None:
            await lane.abort_session(session_id, reason)
            return
        stages = list(range(len(route))) if stages is None else stages
        await asyncio.gather(*(route[k].abort_session(session_id, reason, stages=[k]) for k in stages))

    async def keep_kv(self, session_id: str, scope: str, token_ids: list[int]) -> set[str]:
        """Keeps on the session's replicas; remembers the lane holding those blocks when the
        session rides one (a route across lanes keeps them where it is, unindexed)."""
        route = self._route_or_lane(session_id)
        lane = self._lane_route(route)
        if lane is not None:
            dropped = await lane.keep_kv(session_id, scope, token_ids)
            self._kept.add(lane, [block.key for block in block_chain(scope, token_ids)], dropped)
            return dropped
        answers = await asyncio.gather(
            *(held.keep_kv(session_id, scope, token_ids, stages=[k]) for k, held in enumerate(route))
        )
        dropped = set().union(*answers)
        for held in set(route):
            self._kept.add(held, [], dropped)
        return dropped

    async def restore_kv(
        self, session_id: str, scope: str, token_ids: list[int], positions: int, timeout_s: float
    ) -> set[str]:
        """Restores on the lane that kept the prefix: a session just opened elsewhere (empty) is
        moved there first when that lane serves, so a replicated fleet keeps its prefix hits."""
        chain = block_chain(scope, token_ids)
        holder = self._kept.holder(chain[-1].key) if chain else None
        own = self._lane_route(self._route_or_lane(session_id))
        if holder is not None and holder is not own and self._may_move(session_id, holder):
            await self._move_empty(session_id, holder)
        route = self._route_or_lane(session_id)
        lane = self._lane_route(route)
        if lane is not None:
            dropped = await lane.restore_kv(session_id, scope, token_ids, positions, timeout_s)
        else:
            answers = await asyncio.gather(
                *(
                    held.restore_kv(session_id, scope, token_ids, positions, timeout_s, stages=[k])
                    for k, held in enumerate(route)
                )
            )
            dropped = set().union(*answers)
        for held in set(route):
            self._kept.add(held, [], dropped)
        return dropped

    async def capture_part(self, session_id: str, token_ids: list[int], start: int) -> list[SnapshotBytes]:
        """Every stage's part [start, len(token_ids)) of the session's KV, from its replicas
        (kv_standby.py)."""
        route = self._route_or_lane(session_id)
        lane = self._lane_route(route)
        if lane is not None:
            return await lane.capture_part(session_id, token_ids, start)
        return list(
            await asyncio.gather(
                *(held.capture_stage(k, session_id, token_ids, start) for k, held in enumerate(route))
            )
        )

    async def restore_parts(
        self,
        session_id: str,
        parts: list[list[SnapshotBytes]],
        timeout_s: float,
        stages: list[int] | None = None,
    ) -> None:
        """Restores each stage's consecutive parts into the session on its replica: every
        stage's, or only ``stages``' (a per-hop failover's)."""
        route = self._route_or_lane(session_id)
        lane = self._lane_route(route)
        if lane is not None and stages is None:
            await lane.restore_parts(session_id, parts, timeout_s)
            return
        stages = list(range(len(route))) if stages is None else stages
        results = await asyncio.gather(
            *(route[k].restore_stage(k, session_id, parts[k], timeout_s) for k in stages),
            return_exceptions=True,
        )
        for result in results:
            if isinstance(result, BaseException):
                raise result

    def broken(self, session_id: str) -> list[int]:
        """The parts a failover moves: the stages whose replica on the session's route is
        unreachable, and the stage after each hop of the route that is down (its new replica is
        one the stage before reaches over a live hop)."""
        route = self._route.get(session_id, ())
        moving = {k for k, lane in enumerate(route) if k in lane.watch.unreachable}
        for k in range(len(route) - 1):
            if (k, self._next_hop(route, k)) in route[k].watch.hops_down:
                moving.add(k + 1)
        return sorted(moving)

    async def move_stages(self, session_id: str, stages: list[int], reason: str) -> None:
        """Moves the session's part at each of ``stages`` to another live replica of that stage
        that its route's neighbours forward to and from: aborted on the old replica, opened
        (empty) on the new one, forwarding to the route's next replica. The neighbours are
        re-pointed by ``reroute`` once the part holds its KV. Raises Unavailable when a stage has
        no such replica or an open fails (the route then names the new replicas: a whole-session
        abort frees them)."""
        old = self._route[session_id]
        route = list(old)
        for k in sorted(stages):
            route[k] = self._replacement(route, k, stages)
        await self._abort_on(old, session_id, reason, stages=stages)
        self._route[session_id] = tuple(route)  # counted there at once
        await self._open_parts(tuple(route), session_id, self._terms.get(session_id, PLAIN), stages)

    def _replacement(self, route: list[RemoteStages], k: int, moving: list[int]) -> RemoteStages:
        """The least loaded live replica of stage ``k`` but the route's own that the route's
        previous replica forwards to and that forwards to its next (unless that moves too)."""
        options = []
        for lane in self.lanes:
            if lane is route[k] or not self._live(k, lane):
                continue
            if k and lane not in self._forwards(k - 1, route[k - 1]):
                continue
            if k + 1 < len(route) and k + 1 not in moving and route[k + 1] not in self._forwards(k, lane):
                continue
            options.append(lane)
        if not options:
            why = route[k].watch.route_blocked(k, None) or (
                f"the hop from stage {k - 1} to stage {k} at {route[k].addresses[k]} is down"
            )
            raise Unavailable(f"{why}; no other replica of stage {k} can take its sessions")
        return min(options, key=lambda lane: (self._load(k, lane), self.lanes.index(lane)))

    async def reroute(self, session_id: str, moved: list[int], keep_positions: int) -> None:
        """After ``move_stages``: every other stage of the route cuts the session's cache to
        ``keep_positions`` (the moved parts hold that many: the rest is computed again) and the
        one before each moved part forwards to its new replica."""
        route = self._route[session_id]
        survivors = [k for k in range(len(route)) if k not in moved]
        await asyncio.gather(
            *(
                route[k].route_stage(
                    k, session_id, self._next_hop(route, k) if k + 1 in moved else None, keep_positions
                )
                for k in survivors
            )
        )

    def _may_move(self, session_id: str, holder: RemoteStages) -> bool:
        """Prefix affinity within bounds: the holder serves and runs fewer than PREFIX_SKEW
        sessions more than the session's own lane (with the session counted there)."""
        if holder not in self.live_lanes():
            return False
        own = self._route_or_lane(session_id)[0]
        return self._sessions_on(holder) < self._sessions_on(own) + PREFIX_SKEW

    async def _move_empty(self, session_id: str, lane: RemoteStages) -> None:
        """Reopens a session that holds nothing yet on ``lane`` (same id and terms)."""
        old = self._route_or_lane(session_id)
        self._route[session_id] = (
            lane,
        ) * self.num_stages  # counted there at once: concurrent moves see the skew
        await self._abort_on(old, session_id, "moved to the lane holding its prefix")
        try:
            await lane.open_session(session_id, self._terms.get(session_id, PLAIN))
        except BaseException:
            self._route.pop(session_id, None)
            raise

    def _route_or_lane(self, session_id: str) -> Route:
        return self._route.get(session_id) or (self.lanes[0],) * self.num_stages
