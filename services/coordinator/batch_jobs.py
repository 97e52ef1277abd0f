"""Offline batch jobs (RunBatch): every item generated as a batch request, results as they finish.

A job keeps at most its identity's running limit of items in the scheduler at once (so its
queue limits never refuse it) and streams each item's result the moment it finishes; an item
that fails answers its error and the job goes on. Items are batch requests: the scheduler admits
them only when no interactive request waits (scheduler.py). A job may name the codec its
sessions ask every stage for (:func:`job_codec`; each item's admission carries it to the sessions
its request opens, a failover's included), so one fleet can run jobs with and without
compression side by side.

Micro-batches: on a paged fleet every running session's rows go through the step batcher
(step_batcher.py), which steps a job's sessions under the job's own :class:`Grouping`: their
decode rows in ``count`` groups, each a plan step, up to ``count`` of them travelling the stages
at once, so stage k computes group i+1 while group i is on the wire. Other sessions (interactive
ones, other jobs) keep their own grouping. ``off`` is one group (the whole batch in one step), M
is M groups, and ``auto`` measures the decode rows per second (the job's tokens) its steps deliver
at each M from 1 to the number of stages and back down, ``PROBE_ROUNDS`` rounds each way (M steps
a round: every session once), then keeps the smallest M within ``PROBE_TIE`` of the fastest. Its
windows compare like work: the first starts once the job's prompts are prefilled, and a window
whose steps carried prefill chunks of the job's (items starting later) is measured again. The
choice holds for the job's :class:`Workload` (its codec and, to a power of two, how many sessions
it runs at once): later auto jobs of that workload use it, a job of another codec or size is
probed anew, and a job that ends before its probe does leaves the rest of the probe to the next
auto job of its workload. The grouping changes only which rows share a step, so in ``exact``
precision every answer is the same whatever M is.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field

import structlog

from pipeshard.errors import InvalidArgument, PipeshardError
from pipeshard.link_model import parse_codec
from pipeshard.services.coordinator.step_batcher import Grouping
from pipeshard.v1 import coordinator_pb2

log = structlog.get_logger(__name__)

# A job's most requests (OpenAI's batch file limit): a 64 MiB message of tiny items would otherwise
# queue millions of them. And the longest custom_id (echoed on every result).
MAX_ITEMS = 50_000
MAX_CUSTOM_ID_CHARS = 256
# Rounds (M steps each) every candidate M runs for while ``auto`` measures it.
PROBE_ROUNDS = 2
# Tries at a window before one whose steps carried the job's prefill chunks is kept (items starting
# all through the job, each a prompt to prefill: then they fall on every count alike).
PROBE_ATTEMPTS = 3
# How often the auto probe looks at the step counters.
PROBE_POLL_S = 0.01
# Counts whose rows/s are within this fraction of the fastest tie, and the smallest of them wins:
# it carries the same rows in fewer steps (less per-step work on every stage), and differences this
# small are within what one probe measures on a loaded machine.
PROBE_TIE = 0.03

# Runs one item's request as a batch request: Generate's response stream.
ItemRunner = Callable[[coordinator_pb2.GenerateRequest], AsyncIterator[coordinator_pb2.GenerateResponse]]


@dataclass(frozen=True)
class MicroBatches:
    """How many groups a job's sessions are stepped in: ``count`` fixed (1 = off), or ``auto``."""

    count: int = 1
    auto: bool = False

    @classmethod
    def parse(cls, text: str) -> MicroBatches:
        """``off``, ``auto`` (also empty) or a number >= 1."""
        if text in ("", "auto"):
            return cls(auto=True)
        if text == "off":
            return cls(1)
        try:
            count = int(text)
        except ValueError:
            raise InvalidArgument(
                "micro_batches", f"must be off, auto or a number >= 1, got {text!r}"
            ) from None
        if count < 1:
            raise InvalidArgument("micro_batches", f"must be off, auto or a number >= 1, got {count}")
        return cls(count)


@dataclass(frozen=True)
class Workload:
    """What an auto choice holds for: the job's codec (the wire time of a step) and how many of its
    sessions run at once, rounded up to a power of two (the rows a step can split)."""

    codec: str = ""
    rows: int = 1

    @classmethod
    def of(cls, codec: str, rows: int) -> Workload:
        return cls(codec, 1 << max(rows - 1, 0).bit_length())


@dataclass
class Probe:
    """An auto probe of one workload, kept across jobs: the windows still to measure (each count
    going up from 1 to the stages and back down) and the rows and seconds measured so far."""

    plan: list[int]
    rows: dict[int, int]  # decode rows
    seconds: dict[int, float]
    chosen: int | None = None
    running: bool = False  # a job is measuring it now

    @classmethod
    def over(cls, stages: int) -> Probe:
        counts = list(range(1, stages + 1))
        return cls(counts + counts[::-1], dict.fromkeys(counts, 0), dict.fromkeys(counts, 0.0))

    def rates(self) -> dict[int, float]:
        """Decode rows per second of every count measured so far."""
        return {c: self.rows[c] / s for c, s in self.seconds.items() if s > 0}

    def choose(self) -> int:
        """The smallest count within PROBE_TIE of the fastest."""
        rates = self.rates()
        best = max(rates.values())
        self.chosen = min(c for c, rate in rates.items() if rate >= best * (1 - PROBE_TIE))
        return self.chosen


@dataclass
class MicroBatchMemory:
    """What one coordinator keeps across batch jobs: the auto probe of each workload."""

    probes: dict[Workload, Probe] = field(default_factory=dict)


class MicroBatchControl:
    """The job's :class:`Grouping`: its count fixed, or measured and chosen under ``auto``.

    ``steps`` is the ring's step batcher (None on the stateful backend, where every session steps
    alone and there is nothing to group); ``memory`` is the coordinator's, shared by its jobs;
    ``workload`` names the auto probe this job uses or continues."""

    def __init__(
        self,
        steps,
        stages: int,
        setting: MicroBatches,
        memory: MicroBatchMemory,
        workload: Workload = Workload(),
    ):
        self._steps = steps
        self._stages = max(stages, 1)
        self._setting = setting
        self._memory = memory
        self._workload = workload
        self.grouping = Grouping(setting.count)
        self.measured: dict[int, float] = {}  # auto: decode rows per second at each M tried

    @property
    def current(self) -> int:
        return self.grouping.count

    @contextlib.asynccontextmanager
    async def applied(self) -> AsyncIterator[MicroBatchControl]:
        """Chooses the count for the job's run, measuring it under ``auto`` while the job runs."""
        task = probe = None
        if self._steps is not None and self._setting.auto:
            probe = self._memory.probes.setdefault(self._workload, Probe.over(self._stages))
            if probe.chosen is not None:
                self.grouping.count = probe.chosen
            elif probe.running:  # another job of this workload probes: the batcher's own count
                self.grouping.count = self._steps.inflight
            else:
                probe.running = True
                task = asyncio.create_task(self._probe(probe), name="micro-batch-probe")
        try:
            yield self
        finally:
            if task is not None and probe is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                probe.running = False

    async def _probe(self, probe: Probe) -> None:
        """Runs the probe's remaining windows, PROBE_ROUNDS rounds of each count, going up from 1
        to the stages and then back down, then keeps its choice. Each count's two windows sit
        symmetrically about the probe's middle, so a drift of the job's rate through the probe
        (sessions ending towards its end) weighs on every count alike instead of favouring the ones
        measured first. The first window waits for the job's prompts to be prefilled: a prefill
        chunk is not a token, and steps carrying them deliver a fraction of the decode rows. A
        window cut off by the job's end counts for nothing: the next job of the workload measures
        it again."""
        grouping = self.grouping
        grouping.count = probe.plan[0]
        await self._until(lambda: grouping.steps_run - grouping.last_prefill_step >= grouping.count)
        while probe.plan:
            count = probe.plan[0]
            rows, seconds = await self._window(count)
            probe.rows[count] += rows
            probe.seconds[count] += seconds
            probe.plan.pop(0)
            self.measured = probe.rates()
        grouping.count = probe.choose()
        log.info(
            "micro_batches_chosen",
            micro_batches=grouping.count,
            codec=self._workload.codec,
            rows=self._workload.rows,
            rows_per_s={k: round(v, 1) for k, v in self.measured.items()},
        )

    async def _window(self, count: int) -> tuple[int, float]:
        """Decode rows and seconds of PROBE_ROUNDS rounds at ``count``, from the launch of a step
        to that of the step whole rounds later (steps leave in bursts of up to ``count``: whole
        rounds take the same share of every burst). Measured again, up to PROBE_ATTEMPTS tries,
        while the window's steps carry prefill chunks of the job's."""
        grouping = self.grouping
        grouping.count = count
        for attempt in range(1, PROBE_ATTEMPTS + 1):
            # Steps formed under the previous count are still travelling: start a step later.
            await self._until_steps(1)
            steps, rows, start = grouping.steps_run, grouping.decode_rows_run, grouping.launched_s
            await self._until_steps(PROBE_ROUNDS * count)
            # Clean: no prefill chunk in its steps nor in those travelling at its start.
            if grouping.last_prefill_step <= steps - count or attempt == PROBE_ATTEMPTS:
                break
            log.debug("micro_batch_window_again", micro_batches=count, attempt=attempt)
        # The steps counted are those launched after ``steps``, the time from its launch on.
        return grouping.decode_rows_run - rows, grouping.launched_s - start

    async def _until_steps(self, steps: int) -> None:
        """Until ``steps`` more steps carried the job's rows."""
        target = self.grouping.steps_run + steps
        await self._until(lambda: self.grouping.steps_run >= target)

    async def _until(self, done: Callable[[], bool]) -> None:
        while not done():
            await asyncio.sleep(PROBE_POLL_S)


def check_items(items: Sequence[coordinator_pb2.BatchJobItem]) -> None:
    """InvalidArgument for an empty job or one over MAX_ITEMS (checked before any item is read), an
    empty or overlong custom_id, or a repeated one (naming both items)."""
    if not items:
        raise InvalidArgument("items", "must hold at least one request, got none")
    if len(items) > MAX_ITEMS:
        raise InvalidArgument("items", f"holds {len(items)} requests, over the limit of {MAX_ITEMS}")
    seen: dict[str, int] = {}
    for i, item in enumerate(items):
        if not item.custom_id:
            raise InvalidArgument(f"items[{i}].custom_id", "must not be empty")
        if len(item.custom_id) > MAX_CUSTOM_ID_CHARS:
            raise InvalidArgument(
                f"items[{i}].custom_id",
                f"is {len(item.custom_id)} characters, over the {MAX_CUSTOM_ID_CHARS}-character limit",
            )
        if item.custom_id in seen:
            raise InvalidArgument(
                f"items[{i}].custom_id", f"{item.custom_id!r} repeats items[{seen[item.custom_id]}].custom_id"
            )
        seen[item.custom_id] = i


def job_codec(codec: str) -> str:
    """The codec a job's sessions ask every stage for, checked (InvalidArgument naming ``codec``);
    empty: the stages' own."""
    return parse_codec(codec) if codec else ""


class BatchJob:
    """Runs ``items`` through ``run`` with at most ``concurrency`` at once; yields each result."""

    def __init__(
        self,
        items: Sequence[coordinator_pb2.BatchJobItem],
        run: ItemRunner,
        concurrency: int,
        micro: MicroBatchControl,
    ):
        check_items(items)
        self._items = list(items)
        self._run = run
        self._concurrency = max(1, min(concurrency, len(self._items)))
        self._micro = micro

    async def results(self) -> AsyncIterator[coordinator_pb2.RunBatchResponse]:
        pending: asyncio.Queue[coordinator_pb2.BatchJobItem] = asyncio.Queue()
        for item in self._items:
            pending.put_nowait(item)
        done: asyncio.Queue[coordinator_pb2.RunBatchResponse] = asyncio.Queue()
        async with self._micro.applied():
            workers = [
                asyncio.create_task(self._worker(pending, done), name=f"batch-worker-{i}")
                for i in range(self._concurrency)
            ]
            try:
                for _ in self._items:
                    yield await done.get()
            finally:
                for task in workers:
                    task.cancel()
                await asyncio.gather(*workers, return_exceptions=True)

    async def _worker(self, pending: asyncio.Queue, done: asyncio.Queue) -> None:
        while not pending.empty():
            item = pending.get_nowait()
            response = await self._one(item)
            response.micro_batches = self._micro.current
            done.put_nowait(response)

    async def _one(self, item: coordinator_pb2.BatchJobItem) -> coordinator_pb2.RunBatchResponse:
        out = coordinator_pb2.RunBatchResponse(custom_id=item.custom_id)
        try:
            async for response in self._run(item.request):
                if response.HasField("summary"):
                    out.summary.CopyFrom(response.summary)
                else:
                    out.tokens.extend(response.chunk.tokens)
                    out.logprobs.extend(response.chunk.logprobs)
        except PipeshardError as exc:
            out.error.CopyFrom(coordinator_pb2.BatchJobError(code=exc.code, message=str(exc)))
        except Exception as exc:  # one item's bug must not end the others'
            log.exception("batch item failed", custom_id=item.custom_id)
            out.error.CopyFrom(
                coordinator_pb2.BatchJobError(code="INTERNAL", message=f"{type(exc).__name__}: {exc}")
            )
        if not out.HasField("summary") and not out.HasField("error"):
            out.error.CopyFrom(
                coordinator_pb2.BatchJobError(
                    code="INTERNAL", message="the generation ended without a summary"
                )
            )
        return out
