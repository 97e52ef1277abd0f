"""The remote stages' timeouts: the step deadline grows with the rows of a step and with the time a
row has taken on this ring (a one-pass prefill on a slow machine or at f32 is not a dead stage);
the control-call timeout is the coordinator's setting (flag and environment)
and, when it expires, the error names the stage and the call."""

from __future__ import annotations

import asyncio
import gc

import grpc
import pytest

from pipeshard.auth import Authenticator
from pipeshard.errors import Unavailable
from pipeshard.services.coordinator.main import Coordinator, CoordinatorSettings
from pipeshard.services.coordinator.remote_stages import RemoteStages
from pipeshard.services.coordinator.step_deadline import (
    MAX_STRETCH,
    MIN_SAMPLE_ROWS,
    SAMPLES,
    SLACK,
    TIMEOUT_ROWS,
    StepDeadline,
)
from pipeshard.services.stage.wire import token_frame
from pipeshard.settings import load_settings
from pipeshard.v1 import activation_pb2, stage_pb2, stage_pb2_grpc


def test_step_timeout_is_per_started_block_of_rows():
    async def check() -> list[float]:
        stages = RemoteStages(["127.0.0.1:9"], step_timeout_s=2.0)
        rows = [1, TIMEOUT_ROWS, TIMEOUT_ROWS + 1, 4000]
        return [stages.timeout_for(n) for n in rows]

    assert asyncio.run(check()) == [2.0, 2.0, 4.0, 2.0 * 16]


def test_the_deadline_follows_the_rings_measured_time_per_row():
    """Session 20's case: a 700-row f32 prefill on a loaded machine got 3 x 30 s whatever a row
    had been seen to cost. Once a large step has shown the ring's time per row, a step gets SLACK
    times its rows at that rate when that is more than the floor, up to MAX_STRETCH floors."""
    deadline = StepDeadline(30.0)
    assert deadline.for_rows(700) == 90.0  # nothing measured yet: 30 s per started 256 rows
    deadline.observe(1024, 20.48)  # the warm-up prefill: 20 ms a row (f32, loaded)
    assert deadline.seconds_per_row == 0.02
    assert deadline.for_rows(700) == SLACK * 700 * 0.02  # 112 s, beyond the 90 s floor
    assert deadline.for_rows(1) == 30.0  # a decode step keeps the floor
    deadline.observe(256, 256 * 0.5)  # a step that stalled: the stretch is capped
    assert deadline.for_rows(700) == MAX_STRETCH * 90.0


def test_small_steps_do_not_teach_the_deadline_and_old_slow_steps_are_forgotten():
    deadline = StepDeadline(2.0)
    deadline.observe(MIN_SAMPLE_ROWS - 1, 60.0)  # a decode step's time is mostly fixed cost
    assert deadline.seconds_per_row == 0.0 and deadline.for_rows(4000) == 2.0 * 16
    deadline.observe(MIN_SAMPLE_ROWS, MIN_SAMPLE_ROWS * 0.005)  # slow: 5 ms a row
    assert deadline.for_rows(512) == SLACK * 512 * 0.005
    for _ in range(SAMPLES - 1):
        deadline.observe(256, 256 * 0.0005)
    assert deadline.seconds_per_row == 0.005  # still among the recent steps
    deadline.observe(256, 256 * 0.0005)
    assert deadline.seconds_per_row == 0.0005  # pushed out: the floor rules again
    assert deadline.for_rows(512) == 4.0


def test_the_remote_stages_step_timeout_is_their_learned_deadline():
    async def check() -> tuple[float, float]:
        stages = RemoteStages(["127.0.0.1:9"], step_timeout_s=10.0)
        before = stages.timeout_for(512)
        stages.deadline.observe(512, 512 * 0.01)
        return before, stages.timeout_for(512)

    assert asyncio.run(check()) == (20.0, SLACK * 512 * 0.01)


@pytest.mark.parametrize(
    ("argv", "env", "expected"),
    [
        ([], {}, 30.0),
        ([], {"PIPESHARD_CONTROL_TIMEOUT_S": "45"}, 45.0),
        (["--control-timeout-s", "12.5"], {"PIPESHARD_CONTROL_TIMEOUT_S": "45"}, 12.5),
    ],
)
def test_control_timeout_setting_reaches_the_remote_stages(argv, env, expected):
    settings = load_settings(CoordinatorSettings, [*argv, "--stages", "127.0.0.1:9"], env=env)

    async def lane() -> RemoteStages:
        stages = Coordinator(settings, Authenticator())._lane(settings.stages)
        await stages.close()
        return stages

    assert asyncio.run(lane()).control_timeout_s == expected


class _SilentStage(stage_pb2_grpc.StageServiceServicer):
    """A stage too busy to answer an open in time."""

    async def OpenSession(self, request, context):
        await asyncio.sleep(5)
        return stage_pb2.OpenSessionResponse()


def test_an_expired_control_call_names_the_stage_the_call_and_the_setting():
    async def scenario() -> str:
        server = grpc.aio.server()
        stage_pb2_grpc.add_StageServiceServicer_to_server(_SilentStage(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        stages = RemoteStages([f"127.0.0.1:{port}"], control_timeout_s=0.3)
        try:
            with pytest.raises(Unavailable) as info:
                await stages.open_session("s1")
            return str(info.value)
        finally:
            await stages.close()
            await server.stop(0)

    message = asyncio.run(scenario())
    assert "stage 0 at 127.0.0.1:" in message
    assert "did not answer OpenSession within 0.3 s (--control-timeout-s)" in message


def test_a_failed_row_answers_alone_and_every_failed_step_future_is_retrieved():
    """Two rows of a step fail (their route lost a stage) while a third is answered: each row gets
    its own answer, and no failed future is left for asyncio to log as never retrieved."""

    async def check():
        stages = RemoteStages(["127.0.0.1:9"], step_timeout_s=5.0)

        class Entry:  # stage 0's stream: the step is sent, one row answered, two failed
            async def send(self, plan):
                stages._pending.resolve(activation_pb2.StepResult(session_id="ok", step_id=0))
                stages._pending.fail(Unavailable("stage 1 is gone"), lambda s: s.startswith("bad"))

        stages._entry = Entry()
        logged: list[str] = []
        asyncio.get_running_loop().set_exception_handler(lambda loop, ctx: logged.append(ctx["message"]))
        frames = [token_frame(s, 0, [1], 0, True) for s in ("ok", "bad1", "bad2")]
        answers = await stages.run(frames)
        gc.collect()
        await asyncio.sleep(0)
        return answers, logged

    (ok, bad1, bad2), logged = asyncio.run(check())
    assert isinstance(ok, activation_pb2.StepResult) and ok.session_id == "ok"
    assert isinstance(bad1, Unavailable) and isinstance(bad2, Unavailable)
    assert not [m for m in logged if "never retrieved" in m]
