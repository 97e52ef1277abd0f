"""A plain decode sends its next step before streaming the current token (generation.py), and never
leaves a step in flight or sends one past the end."""

from __future__ import annotations

import asyncio

from pipeshard.services.coordinator.generation import Chunk, Generation, Summary
from pipeshard.services.coordinator.sampling import SamplingParams
from pipeshard.v1 import activation_pb2


class Tokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(f"<{i}>" for i in ids)


class Ring:
    """Answers token 7 to every step after a short compute; counts steps sent and in flight."""

    truncates_on_rewind, batch_steps = False, None  # a stateful ring's, stepping alone
    verifies_trees = True

    def __init__(self):
        self.sent, self.in_flight, self.in_flight_at_release = 0, 0, None
        self.kinds: list[int] = []  # each step's row kind, in order

    async def open_session(self, session_id, capacity=None, admission=None):
        return 64

    async def step(self, frame, slot=None):
        self.sent += 1
        self.kinds.append(frame.plan.rows[0].kind)
        self.in_flight += 1
        try:
            await asyncio.sleep(0.001)
        finally:
            self.in_flight -= 1
        return activation_pb2.StepResult(top1=activation_pb2.Top1(token_ids=[7], probabilities=[1.0]))

    async def release_session(self, session_id):
        self.in_flight_at_release = self.in_flight


async def _run(ring: Ring, params: SamplingParams, eos: set[int] = frozenset()) -> tuple[list, list[int]]:
    """The events, and the steps the ring had been sent when each chunk reached the caller."""

    generation = Generation(ring, Tokenizer(), set(eos))
    events, sent_at_chunk = [], []
    async for event in generation.run([1, 2, 3], params):
        events.append(event)
        if isinstance(event, Chunk):
            sent_at_chunk.append(ring.sent)
    await generation.released()
    return events, sent_at_chunk


def test_the_next_step_is_sent_before_a_token_streams_and_none_past_the_length():
    ring = Ring()
    events, sent_at_chunk = asyncio.run(_run(ring, SamplingParams(max_tokens=5)))
    assert [e.token_ids for e in events if isinstance(e, Chunk)] == [[7]] * 5
    assert sent_at_chunk == [2, 3, 4, 5, 5]  # one step ahead, but not past the fifth token
    assert ring.sent == 5 and ring.in_flight_at_release == 0


def test_a_stop_token_sends_nothing_ahead():
    ring = Ring()
    events, _ = asyncio.run(_run(ring, SamplingParams(max_tokens=5), eos={7}))
    assert isinstance(events[-1], Summary) and events[-1].finish_reason == "stop"
    assert ring.sent == 1


def test_a_stop_string_waits_out_the_step_sent_ahead_before_releasing():
    ring = Ring()
    events, _ = asyncio.run(_run(ring, SamplingParams(max_tokens=8, stop=("<7><7>",))))
    summary = events[-1]
    assert summary.finish_reason == "stop" and summary.text == ""
    assert ring.sent == 3  # the third went ahead of the second token's detokenizing
    assert ring.in_flight_at_release == 0


def test_the_prompt_row_is_a_prefill_row_and_every_step_sent_ahead_a_decode_row():
    ring = Ring()
    asyncio.run(_run(ring, SamplingParams(max_tokens=4)))
    assert ring.kinds == [activation_pb2.ROW_KIND_PREFILL] + [activation_pb2.ROW_KIND_DECODE] * 3
