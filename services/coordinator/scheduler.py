"""The coordinator's scheduler: one queue, admission against the stages' KV budget, fair share.

A request is admitted when a running slot is free (``max_running``, capped by the sessions each
stage lets this coordinator hold), its identity may run another (its share, below), and every
paged stage's block pool, as mirrored here (kv_mirror.py), has room for what that stage will
reserve for it; so a stage never refuses an admitted request for space. Otherwise it waits.

Fair share: waiting identities are served in turn, weighted by ``Identity.weight`` (stride
scheduling: an admission advances its identity's pass by 1/weight, the identity whose pass after
its next admission is smallest goes next, and an identity that starts waiting joins at the
current pass), first come first served within an identity. The identity whose turn it is blocks
the queue until its oldest request fits, with one bounded exception: a waiting request that fits
now and needs at most a quarter of the blocked head's KV may run ahead of it (backfill), at most
``max_running`` times per head, so a large request waits behind at most that many small ones and
a short request is not stuck behind long ones its own identity queued (never-read streams of
2000 tokens held a normal chat request of the same host in the queue for minutes). No
preemption: a running request keeps what it reserved (the stages reserve a session's whole
capacity when it opens, as TGI does, so a step never fails for space).
Running share, work-conserving: an identity's share is ``max_running_per_identity`` requests
running at once (an API key's own ``max_running`` is a hard limit instead). While no other
identity waits, an identity may run beyond its share, up to ``max_running``: slots nobody else
asks for are not left idle (16 users behind one address, one identity, all run at once). It
gives the excess back as others arrive: while any identity below its share waits, no identity
at or above its share is admitted, so every freed slot goes to those below it until each has
its share (no preemption: a borrowed slot returns when its request ends). When the KV pool is
the limit another identity gets the next room that frees up, since its turn comes before the
busy identity's next one.

Batch requests (RunBatch, batch_jobs.py) are a lower class: they fill idle capacity. An
identity's interactive requests queue ahead of its batch ones, and a lane whose next request is a
batch one gets its turn only when no lane's next request is interactive; once admitted a batch
request runs like any other (no preemption) and counts against the same limits.

Limits answer RESOURCE_EXHAUSTED naming the limit: an identity's queued requests
(``max_queued_per_identity``, or its own ``max_queued``), the whole queue (``max_queue``), and a
request no stage's pool could ever hold. A queued request whose deadline passes leaves the queue
with DEADLINE_EXCEEDED; one cancelled while queued leaves it holding nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import itertools
from collections import Counter, deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from pipeshard.errors import DeadlineExceeded, InvalidArgument, ResourceExhausted
from pipeshard.identity import Identity
from pipeshard.metrics import COORDINATOR_RUNNING_BY_IDENTITY, identity_label
from pipeshard.services.coordinator.kv_mirror import KvMirror, Need


class RequestStatus(enum.Enum):
    QUEUED = "queued"
    RUNNING = "running"
    FINISHED = "finished"
    REFUSED = "refused"  # a limit was reached while it would have queued
    EXPIRED = "expired"  # its deadline passed in the queue
    CANCELLED = "cancelled"  # its caller went away while it was queued


@dataclass(eq=False)
class ScheduledRequest:
    identity: Identity
    need: Need  # blocks it holds on each paged stage while it runs
    seq: int  # arrival order
    batch: bool = False  # an offline batch job's request: admitted only when no interactive one waits
    # The codec its sessions ask every stage for (OpenSession's codec: a batch job's; empty: each
    # stage's own --codec), on its first session and on each one a failover or move reopens.
    codec: str = ""
    status: RequestStatus = RequestStatus.QUEUED
    admitted: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    # True while the mirror's charge for ``need`` is this request's (from its admission, and again
    # once the stages released its session while it runs); False while a session it opened
    # carries the charge (SessionAccounts), or once it was credited.
    charged: bool = False
    overtaken: int = 0  # requests admitted ahead of it while it was the blocked head (backfill)


BACKFILL_SHARE = 4  # a request may overtake a blocked head needing at least this many times its KV


@dataclass
class _Lane:
    """One identity's place in the fair-share order."""

    identity: Identity
    queue: deque[ScheduledRequest] = field(default_factory=deque)
    running: int = 0
    passed: float = 0.0  # stride scheduling's pass: admissions weighted by 1/weight


def _stride(lane: _Lane) -> float:
    """How far one admission moves an identity's pass: heavier identities move less, go more often."""
    return 1.0 / max(lane.identity.weight, 1e-9)


def _queue_in_class(queue: deque[ScheduledRequest], request: ScheduledRequest) -> None:
    """Appends ``request`` after its class: an interactive one goes before the batch ones."""
    if request.batch:
        queue.append(request)
        return
    first_batch = next((i for i, r in enumerate(queue) if r.batch), len(queue))
    queue.insert(first_batch, request)


class Scheduler:
    def __init__(
        self,
        max_running: int,
        max_queue: int,
        *,
        max_running_per_identity: int | None = None,
        max_queued_per_identity: int | None = None,
        kv: KvMirror | None = None,
    ):
        if max_running < 1:
            raise InvalidArgument("max_running", f"must be at least 1, got {max_running}")
        if max_queue < 0:
            raise InvalidArgument("max_queue", f"must be 0 or more, got {max_queue}")
        self.max_running = max_running
        self.max_queue = max_queue
        self.max_running_per_identity = max_running_per_identity or max_running
        self.max_queued_per_identity = (
            max_queue if max_queued_per_identity is None else max_queued_per_identity
        )
        self.kv = kv or KvMirror([])
        self.kv.on_credit = self._admit_waiting
        self._lanes: dict[str, _Lane] = {}
        self._seq = itertools.count()
        self._vtime = 0.0  # the pass of the last admission: where a newly waiting identity starts
        self.running = 0
        self.queued = 0
        self._running_by_label: Counter[str] = Counter()  # what the per-identity gauge shows

    def running_limit(self, identity: Identity) -> int:
        """The requests ``identity`` may run at once whoever else waits, its share (a batch job
        keeps no more in the queue)."""
        own = identity.max_running
        return min(self.max_running, self.max_running_per_identity if own is None else own)

    def running_of(self, name: str) -> int:
        lane = self._lanes.get(name)
        return 0 if lane is None else lane.running

    @contextlib.asynccontextmanager
    async def admit(
        self,
        identity: Identity,
        tokens: int,
        timeout_s: float | None = None,
        *,
        batch: bool = False,
        codec: str = "",
    ) -> AsyncIterator[ScheduledRequest]:
        """Holds a running place for the body, for a request whose sessions hold ``tokens`` of
        KV capacity; waits in the queue up to ``timeout_s``; ``batch``: the lower class;
        ``codec``: its sessions' codec (checked by the caller). The admission it yields goes with
        the request to the sessions it opens (their charge and codec)."""
        self.kv.check_ever_fits(tokens)
        request = ScheduledRequest(identity, self.kv.need(tokens), next(self._seq), batch=batch, codec=codec)
        self._enqueue(request)
        try:
            await self._wait(request, timeout_s)
            yield request
        finally:
            self._finish(request)

    def _enqueue(self, request: ScheduledRequest) -> None:
        lane = self._lanes.get(request.identity.name)
        if lane is None:
            lane = self._lanes[request.identity.name] = _Lane(request.identity, passed=self._vtime)
        lane.identity = request.identity  # its limits as this request's credentials state them
        if not lane.queue and not lane.running:
            lane.passed = max(lane.passed, self._vtime)
        _queue_in_class(lane.queue, request)
        self.queued += 1
        self._admit_waiting()
        if request.status is RequestStatus.QUEUED:
            refusal = self._refusal(lane)
            if refusal:
                self._leave_queue(request, RequestStatus.REFUSED)
                raise ResourceExhausted(refusal)

    def _refusal(self, lane: _Lane) -> str:
        """Which queue limit a request just queued passes ("" if none)."""
        name = lane.identity.name
        limit, flag = self._queued_limit(lane)
        if len(lane.queue) > limit:
            return (
                f"`{flag}` {limit} reached for identity {name}: it has {lane.running} running and "
                f"{len(lane.queue) - 1} queued; retry later"
            )
        if self.queued > self.max_queue:
            return (
                f"coordinator is full: {self.running} generations running (max_running "
                f"{self.max_running}) and {self.queued - 1} queued (max_queue {self.max_queue}); retry later"
            )
        return ""

    def _queued_limit(self, lane: _Lane) -> tuple[int, str]:
        if lane.identity.max_queued is not None:
            return lane.identity.max_queued, "max_queued"
        return self.max_queued_per_identity, "max_queued_per_identity"

    def _share(self, lane: _Lane) -> int:
        """What ``lane`` runs whoever else waits: its key's own max_running, else the default share."""
        own = lane.identity.max_running
        return self.max_running_per_identity if own is None else own

    def _ceiling(self, lane: _Lane) -> int:
        """What ``lane`` may run while no identity below its share waits: a key's own max_running
        is a hard limit; the default share may be exceeded up to ``max_running``."""
        own = lane.identity.max_running
        return self.max_running if own is None else own

    def _admissible(self) -> list[_Lane]:
        """The waiting lanes that may be admitted now: those below their share, or when there are
        none, those below their ceiling (work-conserving, module docstring)."""
        waiting = [lane for lane in self._lanes.values() if lane.queue]
        below = [lane for lane in waiting if lane.running < self._share(lane)]
        return below or [lane for lane in waiting if lane.running < self._ceiling(lane)]

    async def _wait(self, request: ScheduledRequest, timeout_s: float | None) -> None:
        if request.status is RequestStatus.RUNNING:
            return
        try:
            await asyncio.wait([request.admitted], timeout=timeout_s)
        except asyncio.CancelledError:
            self._leave_queue(request, RequestStatus.CANCELLED)
            raise
        if request.status is RequestStatus.QUEUED:
            self._leave_queue(request, RequestStatus.EXPIRED)
            raise DeadlineExceeded(f"deadline passed after waiting {timeout_s:.1f} s in the queue")

    def _leave_queue(self, request: ScheduledRequest, status: RequestStatus) -> None:
        if request.status is RequestStatus.QUEUED:
            self._lanes[request.identity.name].queue.remove(request)
            self.queued -= 1
            request.status = status
            self._forget_if_idle(request.identity.name)
            self._admit_waiting()  # it may have been the head everyone waited behind

    def _finish(self, request: ScheduledRequest) -> None:
        """Frees the running place; the KV charge goes once the stages released the session."""
        if request.status is not RequestStatus.RUNNING:
            return
        request.status = RequestStatus.FINISHED
        lane = self._lanes[request.identity.name]
        lane.running -= 1
        self.running -= 1
        self._count_running(request.identity.name, -1)
        self._forget_if_idle(request.identity.name)
        if request.charged:
            request.charged = False
            self.kv.credit(request.need)  # looks at the queue
        else:
            self._admit_waiting()

    def _forget_if_idle(self, name: str) -> None:
        lane = self._lanes[name]
        if not lane.queue and not lane.running:
            del self._lanes[name]

    def _count_running(self, name: str, change: int) -> None:
        """Moves the gauge of ``name``'s label, which several identities may share; a label with
        nothing running loses its series."""
        label = identity_label(name)
        self._running_by_label[label] += change
        if self._running_by_label[label] > 0:
            COORDINATOR_RUNNING_BY_IDENTITY.labels(label).set(self._running_by_label[label])
            return
        del self._running_by_label[label]
        with contextlib.suppress(KeyError):
            COORDINATOR_RUNNING_BY_IDENTITY.remove(label)

    def _admit_waiting(self) -> None:
        """Admits queued requests in fair-share order while the head of the next one's turn fits,
        and small ones ahead of a head that does not (:meth:`_backfill`)."""
        while self.running < self.max_running:
            lane = self._next_lane()
            if lane is None:
                return
            request = lane.queue[0]
            if not self.kv.has_room(request.need):
                if not self._backfill(request):
                    return  # nothing else overtakes it
                continue
            self._start(lane, request)

    def _backfill(self, head: ScheduledRequest) -> bool:
        """Admits the oldest waiting request that fits now and needs at most 1/BACKFILL_SHARE of
        ``head``'s blocks, unless ``head`` was overtaken ``max_running`` times already."""
        if head.overtaken >= self.max_running:
            return False
        limit = sum(head.need)
        candidates = [
            (request, lane)
            for lane in self._admissible()
            for request in lane.queue
            if request is not head and not request.batch
        ]
        for request, lane in sorted(candidates, key=lambda pair: pair[0].seq):
            if sum(request.need) * BACKFILL_SHARE <= limit and self.kv.has_room(request.need):
                head.overtaken += 1
                self._start(lane, request)
                return True
        return False

    def _start(self, lane: _Lane, request: ScheduledRequest) -> None:
        """Moves ``request`` from its lane's queue to running, charging its KV."""
        lane.queue.remove(request)
        self.queued -= 1
        self._vtime = lane.passed
        lane.passed += _stride(lane)
        lane.running += 1
        self.running += 1
        self._count_running(lane.identity.name, +1)
        self.kv.charge(request.need)
        request.charged = True
        request.status = RequestStatus.RUNNING
        request.admitted.set_result(None)

    def _next_lane(self) -> _Lane | None:
        return min(
            self._admissible(),
            key=lambda lane: (lane.queue[0].batch, lane.passed + _stride(lane), lane.queue[0].seq),
            default=None,
        )

    def accounts(self) -> SessionAccounts:
        """What a ring counts its sessions' reservations in (the scheduler's KV mirror)."""
        return SessionAccounts(self.kv)


class SessionAccounts:
    """The sessions a ring opened, counted in the KV mirror until every stage has released them.

    The session a scheduled request opens takes over the request's charge; when the stages have
    released it the charge goes back to the request while it still runs (a prefix restore that
    failed reopens a session under it) and is credited otherwise. A session opened outside a
    request (the coordinator's warm-up) is charged on its own.
    """

    def __init__(self, kv: KvMirror):
        self._kv = kv
        self._sessions: dict[str, tuple[Need, ScheduledRequest | None]] = {}

    def opening(self, session_id: str, capacity: int | None, request: ScheduledRequest | None) -> None:
        """``request``: the admission the session is opened for (None: charged on its own)."""
        if request is not None and request.charged:
            request.charged = False
            need = request.need
        else:
            request, need = None, self._kv.need(capacity)
            self._kv.charge(need)
        self._sessions[session_id] = (need, request)

    def released(self, session_id: str) -> None:
        need, request = self._sessions.pop(session_id, ((), None))
        if request is not None and request.status is RequestStatus.RUNNING:
            request.charged = True  # its finish credits it, unless it opens another session first
        elif need:
            self._kv.credit(need)
