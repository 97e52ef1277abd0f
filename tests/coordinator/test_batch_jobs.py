"""Batch jobs (RunBatch's domain code) with a fake item runner and a fake step batcher: every item
answered once, errors per item, the identity's running limit, the job's codec, and the micro-batch
setting (the auto probe over fake step timings: one second a step, rows per step by M)."""

from __future__ import annotations

import asyncio

import pytest

from pipeshard.errors import InvalidArgument, ResourceExhausted
from pipeshard.identity import Identity
from pipeshard.services.coordinator import batch_jobs
from pipeshard.services.coordinator.batch_jobs import (
    BatchJob,
    MicroBatchControl,
    MicroBatches,
    MicroBatchMemory,
    Workload,
    job_codec,
)
from pipeshard.services.coordinator.ring import PLAIN, Ring, SessionTerms
from pipeshard.services.coordinator.scheduler import Scheduler
from pipeshard.services.coordinator.step_batcher import Grouping
from pipeshard.v1 import coordinator_pb2
from tests.coordinator.engine_fakes import STATEFUL_KV


def items(*ids: str) -> list[coordinator_pb2.BatchJobItem]:
    return [
        coordinator_pb2.BatchJobItem(custom_id=i, request=coordinator_pb2.GenerateRequest(prompt=f"p-{i}"))
        for i in ids
    ]


class FakeSteps:
    """A step batcher stand-in: the job's steps advance on their own, a fake second each, with
    decode rows per step by its count. The first ``prefill_steps`` steps (and every
    ``prefill_every``-th one after, items starting later) carry prompts' chunks instead and only
    ``prefill_rows`` decode rows each."""

    def __init__(
        self,
        rows_per_step: dict[int, float],
        inflight: int = 3,
        prefill_steps: int = 0,
        prefill_every: int = 0,
        prefill_rows: float = 1,
    ):
        self.inflight = inflight  # the batcher's own count: a job never changes it
        self._rows = rows_per_step
        self._prefill_steps = prefill_steps
        self._prefill_every = prefill_every
        self._prefill_rows = prefill_rows

    async def run(self, grouping: Grouping) -> None:
        while True:
            await asyncio.sleep(0.0005)
            grouping.steps_run += 1
            grouping.launched_s = float(grouping.steps_run)  # a second a step: rows/s = rows a step
            n = grouping.steps_run
            if n <= self._prefill_steps or (self._prefill_every and n % self._prefill_every == 0):
                grouping.last_prefill_step = n
                grouping.decode_rows_run += self._prefill_rows
            else:
                grouping.decode_rows_run += self.rows(grouping)

    def rows(self, grouping: Grouping) -> float:
        return self._rows.get(grouping.count, 1)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("off", MicroBatches(1)),
        ("auto", MicroBatches(auto=True)),
        ("", MicroBatches(auto=True)),
        ("3", MicroBatches(3)),
    ],
)
def test_micro_batches_parse(text, expected):
    assert MicroBatches.parse(text) == expected


@pytest.mark.parametrize("text", ["0", "-2", "many", "1.5"])
def test_micro_batches_refused_naming_the_value(text):
    with pytest.raises(InvalidArgument, match=r"`micro_batches`.*" + text.replace(".", r"\.")):
        MicroBatches.parse(text)


def test_empty_job_and_empty_or_repeated_custom_id_refused_naming_the_items():
    async def run(request):
        yield coordinator_pb2.GenerateResponse()

    control = MicroBatchControl(None, 2, MicroBatches(1), MicroBatchMemory())
    with pytest.raises(InvalidArgument, match="`items` must hold at least one"):
        BatchJob([], run, 4, control)
    with pytest.raises(InvalidArgument, match=r"`items\[2\].custom_id` 'a' repeats items\[0\]"):
        BatchJob(items("a", "b", "a"), run, 4, control)
    with pytest.raises(InvalidArgument, match=r"`items\[1\].custom_id` must not be empty"):
        BatchJob(items("a", ""), run, 4, control)


def test_a_jobs_size_and_its_custom_ids_are_bounded_by_name():
    async def run(request):
        yield coordinator_pb2.GenerateResponse()

    control = MicroBatchControl(None, 2, MicroBatches(1), MicroBatchMemory())
    flood = [coordinator_pb2.BatchJobItem()] * (batch_jobs.MAX_ITEMS + 1)
    with pytest.raises(InvalidArgument, match=r"`items` holds 50001 requests, over the limit of 50000"):
        BatchJob(flood, run, 4, control)
    with pytest.raises(InvalidArgument, match=r"`items\[1\].custom_id` is 257 characters"):
        BatchJob(items("a", "c" * 257), run, 4, control)
    assert BatchJob(items("a", "c" * 256), run, 4, control) is not None


class _OpenedStages:
    """A transport that records what each session was opened with."""

    num_stages = 2

    def __init__(self):
        self.opened: dict[str, SessionTerms] = {}

    async def open_session(self, session_id, terms=PLAIN):
        self.opened[session_id] = terms
        return 4096


def test_a_jobs_codec_reaches_its_items_sessions_only_and_an_unknown_one_is_refused():
    """The codec rides on each item's admission: every session its request opens (a failover's
    reopen passes the same admission) asks the stages for it; other requests' sessions and one
    opened outside a request ask for none."""
    stages = _OpenedStages()
    ring = Ring(stages, STATEFUL_KV)

    async def scenario():
        scheduler = Scheduler(max_running=4, max_queue=4)
        codec = job_codec("lane_blocks_zstd")
        async with scheduler.admit(Identity("a"), 10, batch=True, codec=codec) as item:
            await ring.open_session("item", 10, item)
            await ring.open_session("item-moved", 10, item)
        async with scheduler.admit(Identity("a"), 10) as interactive:
            await ring.open_session("interactive", 10, interactive)
        await ring.open_session("warm-up", 5)

    asyncio.run(scenario())
    job = SessionTerms(10, "lane_blocks_zstd")
    assert stages.opened == {
        "item": job,
        "item-moved": job,
        "interactive": SessionTerms(10, ""),
        "warm-up": SessionTerms(5, ""),
    }
    assert job_codec("") == ""
    with pytest.raises(InvalidArgument, match=r"`codec` must be one of .*'gzip'"):
        job_codec("gzip")


def test_every_item_answered_once_errors_per_item_and_at_most_the_running_limit_at_once():
    running = {"now": 0, "most": 0}

    async def run(request):
        running["now"] += 1
        running["most"] = max(running["most"], running["now"])
        try:
            await asyncio.sleep(0.001)
            if request.prompt == "p-bad":
                raise ResourceExhausted("`max_queued` 1 reached for identity key:x")
            yield coordinator_pb2.GenerateResponse(
                chunk=coordinator_pb2.TokenChunk(tokens=["x"], logprobs=[-0.5])
            )
            yield coordinator_pb2.GenerateResponse(
                summary=coordinator_pb2.GenerateSummary(text=request.prompt, completion_tokens=1)
            )
        finally:
            running["now"] -= 1

    async def scenario():
        job = BatchJob(
            items("a", "bad", "c", "d", "e"),
            run,
            2,
            MicroBatchControl(None, 2, MicroBatches(2), MicroBatchMemory()),
        )
        return [r async for r in job.results()]

    results = asyncio.run(scenario())
    assert sorted(r.custom_id for r in results) == ["a", "bad", "c", "d", "e"]
    by_id = {r.custom_id: r for r in results}
    assert by_id["bad"].error.code == "RESOURCE_EXHAUSTED" and "max_queued" in by_id["bad"].error.message
    assert by_id["c"].summary.text == "p-c" and list(by_id["c"].tokens) == ["x"]
    assert running["most"] == 2


def test_a_fixed_count_is_the_grouping_of_the_jobs_items_only():
    """The job's grouping is what its items' requests carry (the servicer hands each item's
    generation ``control.grouping``); the batcher's own count, the other sessions', is untouched."""
    steps = FakeSteps({})
    control = MicroBatchControl(steps, 3, MicroBatches(2), MicroBatchMemory())
    seen = []

    async def run(request):
        seen.append(control.grouping.count)
        yield coordinator_pb2.GenerateResponse(summary=coordinator_pb2.GenerateSummary())

    async def scenario():
        job = BatchJob(items("a", "b"), run, 2, control)
        return [r async for r in job.results()]

    results = asyncio.run(scenario())
    assert seen == [2, 2] and [r.micro_batches for r in results] == [2, 2]
    assert steps.inflight == 3  # other sessions' grouping untouched


async def _auto_job(steps: FakeSteps, memory: MicroBatchMemory, workload: Workload, steps_alive: int | None):
    """An auto job that lasts until its probe has chosen, or only ``steps_alive`` of its steps."""
    control = MicroBatchControl(steps, 3, MicroBatches(auto=True), memory, workload)
    ticker = asyncio.create_task(steps.run(control.grouping))
    async with control.applied():
        while (
            memory.probes[workload].chosen is None
            if steps_alive is None
            else control.grouping.steps_run < steps_alive
        ):
            await asyncio.sleep(0.001)
    ticker.cancel()
    return control


def _probe(monkeypatch, rows: dict[int, float], steps: FakeSteps | None = None) -> MicroBatchControl:
    monkeypatch.setattr(batch_jobs, "PROBE_POLL_S", 0.0002)
    steps = steps or FakeSteps(rows)
    return asyncio.run(asyncio.wait_for(_auto_job(steps, MicroBatchMemory(), Workload(), None), 10))


def test_auto_tries_each_count_up_to_the_stages_and_keeps_the_fastest(monkeypatch):
    monkeypatch.setattr(batch_jobs, "PROBE_POLL_S", 0.0002)
    steps = FakeSteps({1: 4, 2: 9, 3: 7, 4: 50})  # rows per step at each M: M=2 is best of 1..3
    memory = MicroBatchMemory()
    control = asyncio.run(asyncio.wait_for(_auto_job(steps, memory, Workload(), None), 10))
    assert sorted(control.measured) == [1, 2, 3]
    assert max(control.measured, key=control.measured.get) == 2 == control.current
    assert steps.inflight == 3  # the batcher's own count untouched
    later = asyncio.run(asyncio.wait_for(_auto_job(steps, memory, Workload(), 2), 10))
    assert (later.current, later.measured) == (2, {})  # the measured choice, no new probe


class DriftingSteps(FakeSteps):
    """Rows per step fall as the job goes on (its sessions end): whatever is measured later looks slower."""

    def rows(self, grouping: Grouping) -> float:
        return self._rows.get(grouping.count, 1) * max(0.0, 1.0 - 0.02 * grouping.steps_run)


def test_auto_keeps_the_fastest_count_while_the_jobs_rate_drifts_down(monkeypatch):
    """M = 3 delivers 10% more rows than M = 2 at any moment, but in one rising pass it would be
    measured later, when the job delivers less: the pass back down must cancel that."""
    control = _probe(monkeypatch, {}, DriftingSteps({1: 4, 2: 10, 3: 11}))
    assert control.current == 3, control.measured


def test_auto_measures_after_the_jobs_prompts_are_prefilled(monkeypatch):
    """M = 1 delivers as many decode rows as M = 2 once decoding, but the job's first 12 steps carry
    its prompts' chunks (1 decode row each): measured then, M = 1 would look 10x slower."""
    steps = FakeSteps({1: 10, 2: 10.1, 3: 7}, prefill_steps=12)
    control = _probe(monkeypatch, {}, steps)
    assert control.current == 1, control.measured
    assert control.measured[1] == pytest.approx(10)


def test_auto_measures_a_window_again_when_an_items_prefill_rode_in_it(monkeypatch):
    """Items starting later: every 20th step carries a chunk and 1 decode row. Windows holding one
    are measured again, so each count's rate is its decode rate; M = 3 is the fastest."""
    steps = FakeSteps({1: 8, 2: 9, 3: 10}, prefill_every=20)
    control = _probe(monkeypatch, {}, steps)
    assert control.current == 3, control.measured
    assert control.measured == pytest.approx({1: 8, 2: 9, 3: 10})


def test_auto_keeps_a_window_after_its_tries_when_prefill_rides_in_every_one(monkeypatch):
    """Prefill in every other step: no clean window exists, so after PROBE_ATTEMPTS tries each
    window is kept (decode rows only) and the probe still ends with a choice."""
    steps = FakeSteps({1: 8, 2: 9, 3: 10}, prefill_every=2)
    control = _probe(monkeypatch, {}, steps)
    assert sorted(control.measured) == [1, 2, 3] and control.current in (1, 2, 3)


def test_auto_resolves_a_near_tie_toward_the_smaller_count(monkeypatch):
    """M = 3 delivers 2% more rows than M = 2 (within PROBE_TIE): M = 2 carries them in fewer steps."""
    assert _probe(monkeypatch, {1: 4, 2: 10, 3: 10.2}).current == 2
    assert _probe(monkeypatch, {1: 4, 2: 10, 3: 10.5}).current == 3


def test_a_probe_cut_off_by_its_jobs_end_is_finished_by_the_next_job_of_its_workload(monkeypatch):
    monkeypatch.setattr(batch_jobs, "PROBE_POLL_S", 0.0002)
    steps = FakeSteps({1: 4, 2: 9, 3: 7})
    memory = MicroBatchMemory()
    workload = Workload.of("none", 32)
    asyncio.run(asyncio.wait_for(_auto_job(steps, memory, workload, 12), 10))
    probe = memory.probes[workload]
    assert probe.chosen is None and not probe.running and 0 < len(probe.plan) < 6
    second = asyncio.run(asyncio.wait_for(_auto_job(steps, memory, workload, None), 10))
    assert probe.chosen == 2 == second.current and not probe.plan


def test_another_codec_or_job_size_is_probed_anew_and_the_same_reuses_the_choice(monkeypatch):
    monkeypatch.setattr(batch_jobs, "PROBE_POLL_S", 0.0002)
    assert Workload.of("none", 20) == Workload.of("none", 32) == Workload("none", 32)
    assert Workload.of("none", 8) != Workload.of("none", 32) != Workload.of("lane_blocks_zstd", 32)
    steps = FakeSteps({1: 4, 2: 9, 3: 7})
    memory = MicroBatchMemory()
    asyncio.run(asyncio.wait_for(_auto_job(steps, memory, Workload.of("none", 32), None), 10))
    steps._rows = {1: 4, 2: 7, 3: 9}  # compressed frames: M = 3 now fastest
    compressed = Workload.of("lane_blocks_zstd", 32)
    asyncio.run(asyncio.wait_for(_auto_job(steps, memory, compressed, None), 10))
    assert memory.probes[Workload.of("none", 32)].chosen == 2 and memory.probes[compressed].chosen == 3
    again = asyncio.run(asyncio.wait_for(_auto_job(steps, memory, Workload.of("none", 24), 3), 10))
    assert again.current == 2 and again.measured == {}


def test_two_jobs_at_once_keep_their_own_counts():
    steps = FakeSteps({})
    memory = MicroBatchMemory()

    async def scenario():
        first = MicroBatchControl(steps, 3, MicroBatches(2), memory)
        second = MicroBatchControl(steps, 3, MicroBatches(3), memory)
        async with first.applied(), second.applied():
            return first.grouping is not second.grouping, first.current, second.current

    assert asyncio.run(scenario()) == (True, 2, 3)
