"""``Generation.update``: every decode step's result goes through it (acceptance, then emission
with the stop checks into the request's output stream), and the request is released on every way
it ends there (the length limit, a stop string, a stop token), and let go once on every other
(an error before or after output, a stage unreachable, its client gone or cancelled)."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from pipeshard.errors import Internal, Unavailable
from pipeshard.services.coordinator.generation import Generation
from pipeshard.services.coordinator.sampling import SamplingParams
from pipeshard.v1 import activation_pb2


class _Tokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(f"<{i}>" for i in ids)


class _Ring:
    """Answers 10, 11, 12, ... to its steps in order; keeps the sessions it released."""

    truncates_on_rewind, batch_steps = False, None
    verifies_trees = True

    def __init__(self):
        self.steps = 0
        self.released: list[str] = []

    async def open_session(self, session_id, capacity=None, admission=None):
        return 64

    async def step(self, frame, slot=None):
        self.steps += 1
        token = 9 + self.steps
        return activation_pb2.StepResult(top1=activation_pb2.Top1(token_ids=[token], probabilities=[1.0]))

    async def release_session(self, session_id):
        self.released.append(session_id)

    async def abort_session(self, session_id, reason):
        raise AssertionError(f"a request that ended well was aborted: {reason}")


def _run(params: SamplingParams):
    """The events of one request, what ``update`` accepted at each call, and the ring."""
    ring = _Ring()
    generation = Generation(ring, _Tokenizer(), set())
    accepted: list[list[int]] = []
    update = generation.update

    async def spy(request, draft, answer, elapsed):
        accepted.append(list(answer.top1))
        return await update(request, draft, answer, elapsed)

    generation.update = spy  # type: ignore[method-assign]

    async def main():
        events = [e async for e in generation.run([1, 2, 3], params)]
        await generation.released()
        return events

    events = asyncio.run(main())
    assert generation.engine.requests == {}
    return events, accepted, ring


def test_every_step_result_goes_through_update_into_the_stream():
    events, accepted, ring = _run(SamplingParams(max_tokens=4, ignore_eos=True))
    *chunks, summary = events
    assert accepted == [[10], [11], [12], [13]]
    assert [c.token_ids for c in chunks] == accepted  # each update streamed its tokens, in order
    assert summary.finish_reason == "length" and summary.token_ids == [10, 11, 12, 13]
    assert len(ring.released) == 1


@pytest.mark.parametrize(
    ("params", "tokens", "text"),
    [
        (SamplingParams(max_tokens=20, stop=("<12>",)), [10, 11, 12], "<10><11>"),
        (SamplingParams(max_tokens=20, stop_token_ids=(11,)), [10, 11], "<10>"),
    ],
    ids=["stop string", "stop token"],
)
def test_a_stop_found_in_update_ends_and_releases_the_request(params, tokens, text):
    events, accepted, ring = _run(params)
    summary = events[-1]
    assert summary.finish_reason == "stop"
    assert summary.token_ids == tokens and summary.text == text
    assert accepted == [[t] for t in tokens]  # nothing after the stop was accepted
    assert len(ring.released) == 1  # released, not aborted


class _Failing(_Ring):
    """Fails its step ``fail_at`` (from 1) with ``error``; keeps the sessions it aborted."""

    def __init__(self, fail_at: int, error: Exception):
        super().__init__()
        self.fail_at, self.error = fail_at, error
        self.aborted: list[str] = []
        self.opened: list[str] = []

    async def open_session(self, session_id, capacity=None, admission=None):
        self.opened.append(session_id)
        return 64

    async def step(self, frame, slot=None):
        if self.steps + 1 == self.fail_at:
            self.steps += 1
            raise self.error
        return await super().step(frame)

    async def abort_session(self, session_id, reason):
        self.aborted.append(session_id)


@pytest.mark.parametrize(
    ("exit_path", "fail_at", "error", "released"),
    [
        ("length", 0, None, True),
        ("stop", 0, None, True),
        ("error before output", 1, Internal("stage 1: the step failed"), False),
        ("error after output", 3, Internal("stage 1: the step failed"), False),
        ("unreachable", 3, Unavailable("stage 1 is unreachable"), False),
        ("client gone", 0, None, True),
        ("cancelled", 0, None, True),
    ],
)
def test_the_request_is_let_go_on_every_exit_path_once(exit_path, fail_at, error, released):
    """Whatever way a request ends, its session is released (or, after a failure, aborted) on the
    ring exactly once, and the engine's table is empty."""
    ring = _Failing(fail_at, error or Internal("unused"))
    generation = Generation(ring, _Tokenizer(), set())
    params = SamplingParams(max_tokens=20, stop=("<13>",) if exit_path == "stop" else ())
    if exit_path == "length":
        params = SamplingParams(max_tokens=4)

    async def main():
        events = generation.run([1, 2, 3], params)
        if exit_path == "client gone":  # the reader stops reading and closes the stream
            await anext(events)
            await events.aclose()
        elif exit_path == "cancelled":  # the reader's task is cancelled mid-stream
            task = asyncio.ensure_future(anext(events))
            await task
            reader = asyncio.ensure_future(anext(events))
            await asyncio.sleep(0)
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)
            await events.aclose()
        else:
            with contextlib.suppress(Internal, Unavailable):  # raised when nothing was streamed
                [e async for e in events]
        await generation.released()

    asyncio.run(main())
    (session,) = ring.opened
    assert (ring.released, ring.aborted) == (([session], []) if released else ([], [session]))
    assert generation.engine.requests == {}
