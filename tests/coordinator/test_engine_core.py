"""The engine core's request table: one id for a request's whole life, its status, and the table
empty again on every way a request ends (finished, failed before or after output, its client gone,
moved to another lane); and its task, which ends with its last request or its owner's close."""

from __future__ import annotations

import asyncio

import pytest
import structlog

from pipeshard.errors import Internal, Unavailable
from pipeshard.identity import Identity
from pipeshard.services.coordinator.engine import EngineCore, RequestId, RequestStatus
from pipeshard.services.coordinator.generation import Generation
from pipeshard.services.coordinator.ring import ShuttingDown
from pipeshard.services.coordinator.sampling import SamplingParams
from pipeshard.services.coordinator.scheduler import Scheduler
from pipeshard.v1 import activation_pb2


class _Tokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(f"<{i}>" for i in ids)


class _Ring:
    """Answers token 7 to every step; step ``fail_at`` (from 0) raises ``error``."""

    truncates_on_rewind, batch_steps = False, None
    verifies_trees = True

    def __init__(self, fail_at: int = 99, error: Exception | None = None):
        self.fail_at, self.steps, self.sessions = fail_at, 0, []
        self.error = error or Unavailable("stage 1 at 127.0.0.1:1 is not answering")
        self.seen: list[dict[RequestId, RequestStatus]] = []  # the engine's table at each step
        self.engine: EngineCore | None = None

    async def open_session(self, session_id, capacity=None, admission=None):
        self.sessions.append(session_id)
        return 64

    async def step(self, frame, slot=None):
        assert self.engine is not None
        self.seen.append({i: r.status for i, r in self.engine.requests.items()})
        self.steps += 1
        if self.steps - 1 == self.fail_at:
            raise self.error
        return activation_pb2.StepResult(top1=activation_pb2.Top1(token_ids=[7], probabilities=[1.0]))

    async def release_session(self, session_id):
        pass

    async def abort_session(self, session_id, reason):
        pass


def _generation(ring: _Ring) -> Generation:
    generation = Generation(ring, _Tokenizer(), set())
    ring.engine = generation.engine
    return generation


def test_a_request_is_tracked_under_one_id_from_prefill_to_finish():
    ring = _Ring()
    generation = _generation(ring)

    async def main():
        return [e async for e in generation.run([1, 2, 3], SamplingParams(max_tokens=3))]

    events = asyncio.run(main())
    assert events[-1].finish_reason == "length"
    (first, *rest) = ring.seen
    (request_id,) = first
    assert first == {request_id: RequestStatus.PREFILLING}  # the prompt's step
    assert rest == [{request_id: RequestStatus.DECODING}] * 2
    assert ring.sessions == [request_id]  # its first session is named by it
    assert generation.engine.requests == {}


@pytest.mark.parametrize(
    ("fail_at", "error", "raises"),
    [
        (0, Unavailable("stage 1 down"), True),  # before any output
        (2, Unavailable("stage 1 down"), True),  # after output, a transport fault
        (2, Internal("stage 1: the step failed"), False),  # after output: an error summary
    ],
)
def test_every_failure_leaves_the_table_empty(fail_at, error, raises):
    ring = _Ring(fail_at, error)
    generation = _generation(ring)

    async def main():
        return [e async for e in generation.run([1, 2, 3], SamplingParams(max_tokens=5))]

    if raises:
        with pytest.raises(Unavailable):
            asyncio.run(main())
    else:
        assert asyncio.run(main())[-1].finish_reason == "error"
    assert len(ring.seen[-1]) == 1 and generation.engine.requests == {}


def test_a_client_that_goes_away_mid_stream_leaves_the_table_empty():
    ring = _Ring()
    generation = _generation(ring)

    async def main():
        events = generation.run([1, 2, 3], SamplingParams(max_tokens=50))
        await anext(events)
        during = dict(generation.engine.requests)
        await events.aclose()
        return during

    during = asyncio.run(main())
    assert len(during) == 1 and generation.engine.requests == {}


class _Tracked:
    def __init__(self, request_id: str, status: RequestStatus):
        self.id, self.status = RequestId(request_id), status


def test_the_table_refuses_a_second_request_of_one_id_and_a_removal_before_it_ended():
    engine: EngineCore[_Tracked] = EngineCore()
    running = _Tracked("a", RequestStatus.DECODING)
    engine.add(running)
    with pytest.raises(ValueError, match="already running"):
        engine.add(_Tracked("a", RequestStatus.PREFILLING))
    with pytest.raises(ValueError, match="decoding, not finished"):
        engine.remove(running)
    engine.add(_Tracked("b", RequestStatus.MOVING))
    assert [r.id for r in engine.with_status(RequestStatus.MOVING)] == ["b"]
    running.status = RequestStatus.FINISHED
    engine.remove(running)
    assert list(engine.requests) == ["b"]


class _Failover:
    """Moves a failed request to a new session (as failover.py does, without the lanes)."""

    def __init__(self):
        self.moved: list[tuple[RequestId, RequestStatus, str]] = []

    def applies(self, error) -> bool:
        return True

    async def resume(self, ring, request, error, capacity, prefill_chunk, warm=None):
        request.move_to("moved-session")
        self.moved.append((request.id, request.status, request.session_id))

    def computed(self, session_id, tokens) -> None:
        pass

    def ended(self, session_id) -> None:
        pass


def test_a_moved_request_keeps_its_id_and_goes_on_decoding():
    ring = _Ring(fail_at=2)
    failover = _Failover()
    generation = Generation(ring, _Tokenizer(), set(), failover=failover)
    ring.engine = generation.engine

    async def main():
        return [e async for e in generation.run([1, 2, 3], SamplingParams(max_tokens=4))]

    events = asyncio.run(main())
    (request_id,) = ring.seen[0]
    assert failover.moved == [(request_id, RequestStatus.MOVING, "moved-session")]
    assert ring.seen[3:] == [{request_id: RequestStatus.DECODING}] * (len(ring.seen) - 3)
    assert events[-1].finish_reason == "length" and events[-1].token_ids == [7] * 4
    assert generation.engine.requests == {}


class _HeldFailover(_Failover):
    """A failover that waits for ``release`` before the request goes on (a slow restore)."""

    def __init__(self):
        super().__init__()
        self.release = asyncio.Event()
        self.started = asyncio.Event()

    async def resume(self, ring, request, error, capacity, prefill_chunk, warm=None):
        self.started.set()
        await self.release.wait()
        await super().resume(ring, request, error, capacity, prefill_chunk, warm)


class _OneFailing(_Ring):
    """Fails the first step of the first session opened, once; answers 7 otherwise."""

    def __init__(self):
        super().__init__()
        self.failed: set[str] = set()
        self.victim: str | None = None

    async def open_session(self, session_id, capacity=None, admission=None):
        self.victim = self.victim or session_id  # the first request's session
        return await super().open_session(session_id, capacity, admission)

    async def step(self, frame, slot=None):
        if frame.session_id == self.victim and self.victim not in self.failed:
            self.failed.add(self.victim)
            raise self.error
        return await super().step(frame)


def test_a_failover_is_an_engine_event_the_other_requests_do_not_wait_for():
    """The first request's step fails: it is MOVING in the table while its failover runs as a task
    of its own, and the second request decodes to its end meanwhile; then the moved request comes
    back under the same id and finishes."""
    ring = _OneFailing()
    failover = _HeldFailover()
    generation = Generation(ring, _Tokenizer(), set(), failover=failover)
    ring.engine = generation.engine

    async def main():
        moving = asyncio.ensure_future(_events(generation, SamplingParams(max_tokens=4)))
        await failover.started.wait()
        (moved_id,) = [i for i, r in generation.engine.requests.items() if r.status is RequestStatus.MOVING]
        other = await asyncio.wait_for(_events(generation, SamplingParams(max_tokens=6)), 30)
        still = {i: r.status for i, r in generation.engine.requests.items()}
        failover.release.set()
        return moved_id, other, still, await asyncio.wait_for(moving, 30)

    moved_id, other, still, moved = asyncio.run(main())
    assert other[-1].finish_reason == "length" and other[-1].token_ids == [7] * 6
    assert still == {moved_id: RequestStatus.MOVING}  # the other ended while this one moved
    assert failover.moved == [(moved_id, RequestStatus.MOVING, "moved-session")]
    assert moved[-1].finish_reason == "length" and moved[-1].token_ids == [7] * 4
    assert generation.engine.requests == {}


async def _events(generation: Generation, params: SamplingParams) -> list:
    return [e async for e in generation.run([1, 2, 3], params)]


class _SecondFailing(_OneFailing):
    """Fails the first step of the second session opened, once; records each open's codec."""

    def __init__(self):
        super().__init__()
        self.opened: list[tuple[str, str]] = []  # (session id, the codec its admission names)

    async def open_session(self, session_id, capacity=None, admission=None):
        self.opened.append((session_id, admission.codec if admission is not None else ""))
        if len(self.opened) == 2:
            self.victim = session_id
        return await _Ring.open_session(self, session_id, capacity, admission)


class _ReopeningFailover(_Failover):
    """Reopens the moved request's session as failover.py does: with the request's admission;
    records the request id its logs would carry (its task's context)."""

    def __init__(self):
        super().__init__()
        self.logged_as: list[str] = []

    async def resume(self, ring, request, error, capacity, prefill_chunk, warm=None):
        self.logged_as.append(structlog.contextvars.get_contextvars().get("request_id", ""))
        await super().resume(ring, request, error, capacity, prefill_chunk, warm)
        await ring.open_session(request.session_id, capacity, request.admission)


def test_a_moved_request_reopens_with_its_own_session_codec_not_that_of_the_request_that_woke_the_engine():
    """A batch job's session codec is its request's (the admission's), not a context: the second
    request, moved, reopens with its own codec, not with the first's, whose arrival started the
    engine; and its failover runs in its caller's context (its request id in the logs)."""
    ring = _SecondFailing()
    failover = _ReopeningFailover()
    generation = Generation(ring, _Tokenizer(), set(), failover=failover)
    ring.engine = generation.engine

    async def main():
        scheduler = Scheduler(max_running=4, max_queue=4)

        async def with_codec(codec: str, tokens: int) -> list:
            params, plain = SamplingParams(max_tokens=tokens), generation.check_speculative("", 0)
            with structlog.contextvars.bound_contextvars(request_id=codec or "plain"):
                async with scheduler.admit(Identity("job"), 10, batch=bool(codec), codec=codec) as admission:
                    events = generation.generate([1, 2, 3], params, plain, admission=admission)
                    return [e async for e in events]

        first = asyncio.ensure_future(with_codec("zstd", 8))
        while not ring.sessions:
            await asyncio.sleep(0)
        second = await asyncio.wait_for(with_codec("", 4), 30)
        return await asyncio.wait_for(first, 30), second

    first, second = asyncio.run(main())
    first_session, second_session = ring.opened[0][0], ring.opened[1][0]
    assert ring.opened == [(first_session, "zstd"), (second_session, ""), ("moved-session", "")]
    assert failover.logged_as == ["plain"]
    assert first[-1].token_ids == [7] * 8 and second[-1].token_ids == [7] * 4


class _Holding(_Ring):
    """Answers its first ``answered`` steps, then holds every later one (a stage gone quiet)."""

    def __init__(self, answered: int):
        super().__init__()
        self.answered = answered
        self.holding = asyncio.Event()

    async def step(self, frame, slot=None):
        if self.steps >= self.answered:
            self.holding.set()
            await asyncio.Event().wait()
        return await super().step(frame)


def _engine_tasks() -> list[str]:
    return [t.get_name() for t in asyncio.all_tasks() if t.get_name().startswith("engine")]


def test_the_engine_task_ends_by_itself_once_the_last_request_left():
    generation = _generation(_Ring())

    async def main():
        events = await _events(generation, SamplingParams(max_tokens=3))
        during = _engine_tasks()
        for _ in range(5):
            await asyncio.sleep(0)
        return events, during, _engine_tasks()

    events, during, after = asyncio.run(main())
    assert events[-1].token_ids == [7] * 3
    assert during == ["engine-core"] and after == []  # nothing pending when the loop closes


@pytest.mark.parametrize("answered", [0, 3])  # a request held before any output, and mid-stream
def test_closing_a_generation_ends_its_engine_tasks_and_a_request_in_flight_gets_a_clear_error(answered):
    ring = _Holding(answered)
    generation = _generation(ring)

    async def main():
        reader = asyncio.ensure_future(_events(generation, SamplingParams(max_tokens=50)))
        await asyncio.wait_for(ring.holding.wait(), 30)
        during = sorted(_engine_tasks())
        await generation.close()
        after = _engine_tasks()
        with pytest.raises(ShuttingDown, match="engine closed"):
            await asyncio.wait_for(reader, 30)  # an error, not a hang
        return during, after

    during, after = asyncio.run(main())
    assert during == ["engine-core", "engine-step"] and after == []
    assert generation.engine.requests == {}
