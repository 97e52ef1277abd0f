"""Each request's decode loop hands its events to its reader through a stream, and a step waits
only for requests that are about to send: a reader that stops reading never holds up the others'
steps (fast: a fake two-stage transport under the real batching ring)."""

from __future__ import annotations

import asyncio

from pipeshard.services.coordinator.generation import STREAM_EVENTS, Generation, Summary
from pipeshard.services.coordinator.ring import Ring
from pipeshard.services.coordinator.sampling import SamplingParams
from pipeshard.v1 import activation_pb2
from tests.coordinator.engine_fakes import PAGED_KV


class _Tokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(f"<{i}>" for i in ids)


class _Stages:
    """A transport whose stages answer token 7 to every row; records each step's sessions."""

    num_stages = 2

    def __init__(self):
        self.steps: list[list[str]] = []
        self.open: set[str] = set()

    async def start(self):
        pass

    async def run(self, frames):
        self.steps.append([f.session_id for f in frames])
        await asyncio.sleep(0)
        return [
            activation_pb2.StepResult(
                session_id=f.session_id, top1=activation_pb2.Top1(token_ids=[7], probabilities=[1.0])
            )
            for f in frames
        ]

    async def open_session(self, session_id, terms=None):
        self.open.add(session_id)
        return 4096

    async def release_session(self, session_id):
        self.open.discard(session_id)

    async def abort_session(self, session_id, reason):
        self.open.discard(session_id)

    async def close(self):
        pass


def test_a_reader_that_stops_reading_holds_up_no_other_request():
    stages = _Stages()
    ring = Ring(stages, PAGED_KV, inflight=1)
    generation = Generation(ring, _Tokenizer(), set())
    long_tokens = STREAM_EVENTS * 3

    async def main():
        slow = generation.run([1, 2, 3], SamplingParams(max_tokens=long_tokens))
        first = await anext(slow)  # then its reader looks away
        fast = [e async for e in generation.run([4, 5], SamplingParams(max_tokens=20))]
        rest = [e async for e in slow]  # its reader comes back: nothing was lost
        await ring.close()
        return first, fast, rest

    first, fast, rest = asyncio.run(asyncio.wait_for(main(), 120))
    assert isinstance(fast[-1], Summary) and fast[-1].completion_tokens == 20
    assert isinstance(rest[-1], Summary) and rest[-1].completion_tokens == long_tokens
    assert len(first.token_ids) + sum(len(e.token_ids) for e in rest[:-1]) == long_tokens
    assert any(len(step) == 2 for step in stages.steps)  # the two stepped together while both ran
    assert generation.engine.requests == {} and not stages.open


def test_requests_answered_together_step_together_again():
    """Four requests that start together share every step after their first: each step waits
    for the requests it answered (no clock), so none trickles into a step of its own."""
    stages = _Stages()
    ring = Ring(stages, PAGED_KV, inflight=1)
    generation = Generation(ring, _Tokenizer(), set())

    async def one(prompt):
        return [e async for e in generation.run(prompt, SamplingParams(max_tokens=12))]

    async def main():
        out = await asyncio.gather(*(one([i + 1, i + 2]) for i in range(4)))
        await ring.close()
        return out

    out = asyncio.run(asyncio.wait_for(main(), 120))
    assert all(events[-1].completion_tokens == 12 for events in out)
    # 4 x 12 rows (the prompt's row gives the first token): the four arrive together, so the
    # engine plans their prompts' rows into one step, and from there all four go in each step
    # (the requests of one answered step form the next) until they end together.
    rows = [len(s) for s in stages.steps]
    assert sum(rows) == 48 and rows == [4] * 12
