"""Fake requests for the engine loop's unit tests: each plays a script of rows, records the load and
budget the engine drafted its rows for, and takes as many drafts as the step leaves room for."""

from __future__ import annotations

import asyncio

from pipeshard.services.coordinator.engine import EngineCore, RequestId, RequestStatus, Row, Upcoming
from pipeshard.services.coordinator.speculation.policy import StepLoad
from pipeshard.services.coordinator.step_batcher import BatchSteps, Grouping, StepSlot
from pipeshard.services.stage.wire import token_frame


class FakeRequest:
    """``script``: its rows in order, each (positions, decoding: else a prompt's chunk);
    ``drafts``: positions each decode row adds when the step's budget leaves them; ``fresh``: its
    first row is its first ever (a newcomer's, which goes first)."""

    def __init__(
        self,
        name: str,
        script: list[tuple[int, bool]],
        *,
        drafts: int = 0,
        grouping: Grouping | None = None,
        fresh: bool = True,
        identity: str = "",
    ):
        self.id = RequestId(name)
        self.status = RequestStatus.DECODING
        self.slot = StepSlot(grouping, identity=identity)
        self.steps_in_flight = 0
        self.landed = asyncio.Event()
        self.landed.set()
        self.script = list(script)
        self.drafts = drafts
        self.fresh = fresh
        self.at = 0  # rows planned so far
        self.loads: list[tuple[StepLoad, int]] = []  # what each row was drafted for
        self.answers: list = []
        self.depth = 1  # its rows in flight at once (more: the engine plans it again as one leaves)

    def pipelines(self) -> bool:
        return self.steps_in_flight < self.depth and self.at < len(self.script)

    def upcoming(self, chunk: int) -> Upcoming:
        tokens, decoding = self.script[self.at]
        return Upcoming(tokens, decoding, self.fresh and self.at == 0)

    def next_row(self, chunk: int, load: StepLoad, budget: int) -> Row:
        tokens, decoding = self.script[self.at]
        self.loads.append((load, budget))
        if decoding:
            tokens += min(self.drafts, budget)
            frame = token_frame(self.id, self.at, [7] * tokens, 0, True, return_last=tokens)
        else:
            frame = token_frame(self.id, self.at, [7] * tokens, 0, True, fill_only=True)
        self.at += 1
        return Row(frame, decoding)


def names(plan) -> list[str]:
    """A plan's rows as ``name:positions``."""
    return [f"{request.id}:{row.tokens}" for request, row in plan.rows]


def plans_of(requests: list[FakeRequest], step_tokens: int = 512, inflight: int = 1) -> list[list[str]]:
    """The steps ``schedule()`` forms from ``requests`` all ready at once, one row each (no step
    is run: each plan is taken as it comes)."""

    async def main():
        engine: EngineCore[FakeRequest] = EngineCore(steps=BatchSteps(step_tokens, inflight))
        for request in requests:
            engine.add(request)
            engine.ready(request)
        plans = []
        while True:
            plan = engine.schedule()
            if not plan.rows:
                break
            plans.append(names(plan))
        await engine.close()
        return plans

    return asyncio.run(main())


async def drive(
    requests: list[FakeRequest],
    run,
    steps: BatchSteps | None,
    *,
    clock=None,
    arrive_after: dict[int, list[FakeRequest]] | None = None,
) -> EngineCore[FakeRequest]:
    """Runs the engine loop over ``requests`` until each has played its script (or failed):
    ``run`` carries each step; ``arrive_after``: requests made ready once that many steps were
    answered."""
    done = asyncio.Event()
    answered_steps = [0]
    later = dict(arrive_after or {})

    async def answered(rows, answers, elapsed):
        for (request, _), answer in zip(rows, answers, strict=True):
            request.answers.append(answer)
            if isinstance(answer, BaseException) or request.at == len(request.script):
                request.status = RequestStatus.FINISHED
                engine.remove(request)
            else:
                engine.ready(request)
        answered_steps[0] += 1
        for request in later.pop(answered_steps[0], []):
            engine.add(request)
            engine.ready(request)
        if not engine.requests and not later:
            done.set()

    kw = {} if clock is None else {"clock": clock}
    engine: EngineCore[FakeRequest] = EngineCore(run, answered, steps=steps, **kw)
    for request in requests:
        engine.add(request)
        engine.ready(request)
    await asyncio.wait_for(done.wait(), 30)
    await engine.close()
    return engine
