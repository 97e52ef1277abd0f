"""Failover as engine events (fast: the real generation, engine and failover over a toy batching
fleet whose lanes die on cue): the failover only reopens the session; the replay is the moved
request's rows, which ``schedule()`` plans under the step's budget beside other requests' rows,
under the request's one id, and a lane that dies during the replay moves it again. The real kills
run in tests/pipeline/test_failover_fleet.py and test_per_hop_fleet.py."""

from __future__ import annotations

import asyncio

from pipeshard.services.coordinator.engine import RequestStatus
from pipeshard.services.coordinator.failover import Failover
from pipeshard.services.coordinator.generation import Generation
from pipeshard.services.coordinator.sampling import SamplingParams
from tests.coordinator.engine_fakes import SeenRow, ToyFleet, TwoLanes, greedy

CHUNK = 4
FIRST = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]  # three chunks
SECOND = [3, 1, 4, 1, 5]


class _Tokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(f"<{i}>" for i in ids)


def _run(fleet: ToyFleet, prompts: list[tuple[list[int], int]]) -> list[list[int]]:
    """Runs each (prompt, max_tokens) as a request (in order, each once the one before opened its
    session) on a generation with a failover; their generated tokens."""
    generation = Generation(
        fleet,
        _Tokenizer(),
        set(),
        prefill_chunk=CHUNK,
        failover=Failover(TwoLanes()),  # type: ignore[arg-type]
    )
    fleet.engine = generation.engine

    async def one(prompt: list[int], tokens: int) -> list[int]:
        events = [e async for e in generation.run(prompt, SamplingParams(max_tokens=tokens))]
        return events[-1].token_ids

    async def main() -> list[list[int]]:
        tasks = []
        for prompt, tokens in prompts:
            tasks.append(asyncio.ensure_future(one(prompt, tokens)))
            while len(fleet.opened) < len(tasks):
                await asyncio.sleep(0)
        outputs = await asyncio.wait_for(asyncio.gather(*tasks), 30)
        await generation.released()
        assert generation.engine.requests == {}
        return list(outputs)

    return asyncio.run(main())


def _rows(fleet: ToyFleet, status: RequestStatus) -> list[tuple[int, SeenRow]]:
    """Every row the fleet ran of a request in ``status``, with the index of its step."""
    return [(i, row) for i, step in enumerate(fleet.steps) for row in step if row.status is status]


def test_a_moved_requests_replay_rows_come_from_schedule_beside_another_requests_decode_rows():
    """The first request's session dies after its prompt (3 chunks) and 5 decode rows: it moves
    under its id, and its replay (the prompt and 5 tokens but the last, 17, in chunks of 4) rides
    in the steps of the other request's decoding; the tail rides with the lost step, which goes
    at once, alone; both outputs are the target's greedy sequence."""
    fleet = ToyFleet({0: 8})
    first, second = _run(fleet, [(FIRST, 12), (SECOND, 40)])
    assert first == greedy(FIRST, 12) and second == greedy(SECOND, 40)
    assert len(fleet.opened) == 3 and fleet.aborted[0] == fleet.opened[0]
    replay = _rows(fleet, RequestStatus.REPLAYING)
    ((moved, *_),) = {(row.request,) for _, row in replay}  # one request replays, under one id
    assert [(row.tokens, row.fill_only) for _, row in replay] == [(CHUNK, True)] * 4
    # Before the failure the same id prefilled: the table never named the request otherwise.
    assert len({row.request for step in fleet.steps for row in step}) == 2
    assert any(r.request == moved and r.status is RequestStatus.PREFILLING for s in fleet.steps for r in s)
    beside = [fleet.steps[i] for i, _ in replay]
    assert any(any(r.request != moved and not r.fill_only for r in step) for step in beside)
    last_replay = replay[-1][0]
    resend = next(step for step in fleet.steps[last_replay + 1 :] if any(r.request == moved for r in step))
    assert [(r.request, r.tokens) for r in resend] == [(moved, 2)]  # alone: the tail and the pending


def test_a_long_replay_is_chunked_across_steps_under_the_token_budget():
    """The lane both requests run on dies while they decode: both replay at once, 4-token chunks
    under a 6-token step, so no step carries two chunks and none exceeds the budget."""
    fleet = ToyFleet(lane_dies_at=14, step_tokens=6)
    first, second = _run(fleet, [(FIRST, 12), (FIRST[::-1], 12)])
    assert first == greedy(FIRST, 12) and second == greedy(FIRST[::-1], 12)
    replay = _rows(fleet, RequestStatus.REPLAYING)
    assert len({row.request for _, row in replay}) == 2  # both moved and replayed
    assert all(row.tokens == CHUNK and row.fill_only for _, row in replay)
    assert max(sum(r.tokens for r in step) for step in fleet.steps) <= 6
    per_step = [sum(r.status is RequestStatus.REPLAYING for r in step) for step in fleet.steps]
    assert max(per_step) == 1 and sum(per_step) == len(replay) >= 6


def test_an_unavailable_during_the_replay_moves_the_request_again_under_the_same_id():
    """The request's new session dies after the replay's first chunk: the second chunk's
    Unavailable moves it again (a third session), it replays from the start there and ends with
    the target's sequence, under the one id it had from its first row."""
    fleet = ToyFleet({0: 8, 1: 1})
    (tokens,) = _run(fleet, [(FIRST, 12)])
    assert tokens == greedy(FIRST, 12)
    assert len(fleet.opened) == 3 and fleet.aborted[:2] == fleet.opened[:2]
    assert fleet.rows_of[fleet.opened[1]] == 2  # one chunk answered, the next failed
    assert len({row.request for step in fleet.steps for row in step}) == 1
    replay = [row for _, row in _rows(fleet, RequestStatus.REPLAYING)]
    # Two chunks on the second session; on the third, the 16 positions before its pending tokens
    # (the first replay's tail rides there): three chunks, the fourth with the lost step.
    assert len(replay) == 2 + 3
    resend = next(s for s in fleet.steps if s[0].status is RequestStatus.DECODING and s[0].tokens > 1)
    assert [row.tokens for row in resend] == [4 + 2]
