"""Traversals in flight per request (fast, a fake stage with a toy target): while a request's step
travels, its next step goes, built on the first being accepted whole; a rejection drops it, its
positions are rewound by the next row's mask, and the output is the target's greedy sequence.
The real-fleet checks are tests/pipeline/test_pipelined_speculation*.py."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from pipeshard.errors import Unavailable
from pipeshard.services.coordinator.generation import Chunk, Generation, Summary
from pipeshard.services.coordinator.sampling import SamplingParams
from pipeshard.services.coordinator.speculation.depth import InFlightDepth, worth_sending
from pipeshard.services.coordinator.speculation.feature import _FeatureDrafting
from pipeshard.services.coordinator.speculation.sources import DraftSources
from pipeshard.services.stage.wire import step_from_frame
from pipeshard.tensor_codec import encode
from pipeshard.v1 import activation_pb2
from tests.coordinator.engine_fakes import VOCAB, answer_on_cache, greedy

# Repeats some of its n-grams with other successors, so prompt lookup guesses wrong at first.
PROMPT = [1, 2, 3, 4, 5, 1, 2, 3, 9, 4, 5, 6]


class Tokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(f"<{i}>" for i in ids)


class StatefulStage:
    """One stateful stage holding the target: each session's cache by physical slot (token,
    valid), masked by the rows' invalidate ranges; rows are taken in the order they were sent,
    each after a short compute, so a request's later rows travel while earlier ones compute."""

    truncates_on_rewind, batch_steps = False, None  # a stateful ring's, stepping alone
    verifies_trees = True

    def __init__(self):
        self.caches: dict[str, list[list]] = {}
        self.in_flight: dict[str, int] = {}
        self.most_in_flight = 0
        self.order = asyncio.Lock()  # FIFO: one stream, in order

    async def open_session(self, session_id, capacity=None, admission=None):
        self.caches[session_id] = []
        return 4096

    async def step(self, frame, slot=None):
        (row,) = step_from_frame(frame, "input_ids").rows
        session = row.session_id
        self.in_flight[session] = self.in_flight.get(session, 0) + 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight[session])
        try:
            async with self.order:
                await asyncio.sleep(0.002)
                return self._run(row)
        finally:
            self.in_flight[session] -= 1

    def _run(self, row) -> activation_pb2.StepResult:
        return answer_on_cache(self.caches[row.session_id], row, compute_micros=(100,))

    async def release_session(self, session_id):
        self.caches.pop(session_id, None)

    async def abort_session(self, session_id, reason=""):
        self.caches.pop(session_id, None)


async def collect(generation: Generation, tokens: int, **asked) -> tuple[list[int], Summary]:
    """One request for PROMPT's next ``tokens`` (``asked``: run's speculative, k, tree): the tokens
    streamed and its summary."""
    out, summary = [], None
    async for event in generation.run(PROMPT, SamplingParams(max_tokens=tokens), **asked):
        if isinstance(event, Chunk):
            out.extend(event.token_ids)
        elif isinstance(event, Summary):
            summary = event
    await generation.released()
    assert summary is not None
    return out, summary


async def _generate(
    stage: StatefulStage,
    depth: int,
    tokens: int,
    speculative: str = "ngram",
    k: int = 0,
    drafts: DraftSources | None = None,
):
    drafts = drafts or DraftSources(Path("."))
    generation = Generation(stage, Tokenizer(), set(), drafts=drafts, spec_depth=depth)
    return await collect(generation, tokens, speculative=speculative, k=k)


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_pipelined_prompt_lookup_equals_the_targets_greedy_sequence(depth):
    stage = StatefulStage()
    out, summary = asyncio.run(_generate(stage, depth, 64, k=3))
    assert out == greedy(PROMPT, 64)
    assert summary.token_ids == out and summary.finish_reason == "length"
    if depth == 1:
        assert stage.most_in_flight == 1 and summary.dropped_steps == 0
    else:
        # The second step went while the first travelled; the toy target's early steps reject
        # drafts, so steps built on them were dropped (and the output is still the target's).
        # At most D live rows; dropped ones still travel beside the D built after the rejection.
        assert depth <= stage.most_in_flight <= 2 * depth - 1
        assert summary.dropped_steps > 0
        assert sum(summary.kept_per_traversal[1:]) > 0  # and later ones kept several tokens


class FeatureStage(StatefulStage):
    """Returns features when a row asks: a position's feature is its token (the toy target's next
    token follows from the last two, so a feature and the next token are all a draft needs)."""

    def _run(self, row) -> activation_pb2.StepResult:
        result = super()._run(row)
        if row.return_features:
            returned = np.asarray(row.activations[0][-row.return_last :], dtype=np.float32)
            result.features.CopyFrom(encode(returned.reshape(-1, 1), as_fp16=True, field="features"))
        return result


class ToyFeatureDraft(_FeatureDrafting):
    """A feature draft of the toy target: from a position's feature (its token) and the next token
    it predicts the target's token after them, wrongly where the two sum to a multiple of 7."""

    def __init__(self):
        super().__init__(VOCAB, np.arange(VOCAB))
        self._feature: np.ndarray | None = None

    def observe(self, feature: np.ndarray | None) -> None:
        self._forget()
        self._feature = None if feature is None else np.asarray(feature, dtype=np.float32).reshape(-1, 1)[-1:]

    def _root(self, context):
        if self._feature is None:
            return None
        return self._predict(self._feature, np.asarray([context[-1]]))

    def _level(self, parents, features, tokens):
        out, logits = self._predict(features, tokens)
        return out, logits, [-1] * len(parents)

    @staticmethod
    def _predict(features: np.ndarray, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        before = np.rint(features[:, 0]).astype(np.int64)
        nxt = (tokens * 7 + before * 3 + 1) % VOCAB
        nxt = np.where((before + tokens) % 7 == 0, (nxt + 1) % VOCAB, nxt)
        return tokens.astype(np.float32).reshape(-1, 1), np.eye(VOCAB, dtype=np.float32)[nxt]

    def close(self) -> None:
        self._forget()
        self._feature = None


class ToyFeatureSources(DraftSources):
    """``feature`` is the toy target's feature draft."""

    def __init__(self):
        super().__init__(Path("."))
        self.feature = Path(".")

    async def factory(self, mode: str):
        return ToyFeatureDraft if mode == "feature" else await super().factory(mode)


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_pipelined_feature_draft_equals_the_targets_greedy_sequence(depth):
    """A feature draft drafts a step while the one before it travels, over the guesses on its own
    predicted features; the real features correct it when the answer comes."""
    stage = FeatureStage()
    out, summary = asyncio.run(_generate(stage, depth, 64, "feature", 3, ToyFeatureSources()))
    assert out == greedy(PROMPT, 64)
    assert summary.token_ids == out and summary.finish_reason == "length"
    # The toy draft is right unless a pair sums to a multiple of 7: it keeps most of its drafts.
    steps = summary.kept_per_traversal  # [i]: steps that kept i + 1 tokens
    assert sum((i + 1) * n for i, n in enumerate(steps)) / sum(steps) > 2.5, steps
    if depth == 1:
        assert stage.most_in_flight == 1 and summary.dropped_steps == 0
    else:
        assert depth <= stage.most_in_flight <= 2 * depth - 1
        # Its wrong guesses dropped the steps built on them, but chained over the right features
        # (the guesses' predicted ones, then the answered ones) most steps sent ahead stand;
        # drafting each from the answered feature and the last guess drops about all of them.
        assert 0 < summary.dropped_steps <= summary.verify_steps * (depth - 1) // 2


def test_plain_decoding_keeps_one_step_in_flight_whatever_the_depth():
    stage = StatefulStage()
    out, summary = asyncio.run(_generate(stage, 3, 16, speculative="none"))
    assert out == greedy(PROMPT, 16)
    assert summary.dropped_steps == 0 and stage.most_in_flight <= 2  # a plain step sent ahead only


def test_auto_depth_is_the_round_trip_over_compute_and_one_on_one_node():
    depth = InFlightDepth()
    assert depth.depth() == 1  # nothing measured
    depth.observe(0.300, [20_000, 20_000, 20_000])  # 300 ms round trip, 60 ms compute over 3 stages
    assert depth.depth() == 4  # 5 steps of compute fit, capped at AUTO_MAX_DEPTH
    for _ in range(30):  # compute comes to fill the round trip: one step at a time again
        depth.observe(0.070, [20_000, 20_000, 20_000])
    assert depth.depth() == 1
    near = InFlightDepth()
    near.observe(0.015, [2_000, 2_000, 2_000])  # a fleet on one machine: 9 ms waiting, not worth it
    assert near.depth() == 1
    one_node = InFlightDepth()
    one_node.observe(0.300, [20_000])
    assert one_node.depth() == 1
    assert InFlightDepth(fixed=3).depth() == 3
    with pytest.raises(ValueError, match="spec_depth"):
        InFlightDepth(fixed=99)


def test_a_row_goes_ahead_of_shared_steps_only_while_likely_to_stand():
    assert worth_sending(0.25, 8, shared=False)  # alone, its step waits on the hops anyway
    assert not worth_sending(0.25, 1, shared=True)  # 1/16 to stand: it would delay the others
    assert worth_sending(0.9, 5, shared=True) and not worth_sending(0.9, 30, shared=True)


class FailingStage(StatefulStage):
    """Its first session's lane dies after ``rows`` rows: every later row of it is Unavailable."""

    def __init__(self, rows: int):
        super().__init__()
        self.rows, self.victim, self.seen = rows, "", 0
        self.in_flight_at_failure = 0

    async def open_session(self, session_id, capacity=None, admission=None):
        self.victim = self.victim or session_id
        return await super().open_session(session_id, capacity, admission)

    def _run(self, row) -> activation_pb2.StepResult:
        if row.session_id == self.victim:
            self.seen += 1
            if self.seen > self.rows:
                self.in_flight_at_failure = max(self.in_flight_at_failure, self.in_flight[self.victim])
                raise Unavailable("stage 1 at test is unreachable")
        return super()._run(row)


class Failover:
    """Moves a failed request to a new session and replays what it had (as failover.py does,
    without lanes or standby copies)."""

    def __init__(self):
        self.moves = 0

    def applies(self, error) -> bool:
        return True

    async def resume(self, ring, request, error, capacity, prefill_chunk, warm=None):
        self.moves += 1
        replay = request.move_to(f"moved-{self.moves}")
        await ring.open_session(request.session_id)
        request.replay(replay, 1)  # the engine's rows; the last token goes with the resent step
        request.expedite()

    def computed(self, request, tokens) -> None:
        pass

    def ended(self, request) -> None:
        pass


def test_a_failover_with_steps_in_flight_drops_them_and_keeps_the_tokens():
    stage, failover = FailingStage(rows=12), Failover()

    async def main():
        generation = Generation(
            stage, Tokenizer(), set(), drafts=DraftSources(Path(".")), spec_depth=3, failover=failover
        )
        events = [
            e async for e in generation.run(PROMPT, SamplingParams(max_tokens=64), speculative="ngram", k=3)
        ]
        await generation.released()
        return events

    events = asyncio.run(main())
    summary = events[-1]
    assert failover.moves == 1 and stage.in_flight_at_failure > 1  # it failed with steps in flight
    assert summary.finish_reason == "length" and summary.token_ids == greedy(PROMPT, 64)
    assert [t for e in events if isinstance(e, Chunk) for t in e.token_ids] == summary.token_ids
