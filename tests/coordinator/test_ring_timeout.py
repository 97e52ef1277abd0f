"""The remote stages' timeouts: the step timeout grows with the rows of a step (a one-pass prefill
is not a dead stage); the control-call timeout is the coordinator's setting (flag and environment)
and, when it expires, the error names the stage and the call."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from pipeshard.auth import Authenticator
from pipeshard.errors import Unavailable
from pipeshard.services.coordinator.main import Coordinator, CoordinatorSettings
from pipeshard.services.coordinator.remote_stages import TIMEOUT_ROWS, RemoteStages
from pipeshard.settings import load_settings
from pipeshard.v1 import stage_pb2, stage_pb2_grpc


def test_step_timeout_is_per_started_block_of_rows():
    async def check() -> list[float]:
        stages = RemoteStages(["127.0.0.1:9"], step_timeout_s=2.0)
        rows = [1, TIMEOUT_ROWS, TIMEOUT_ROWS + 1, 4000]
        return [stages.timeout_for(n) for n in rows]

    assert asyncio.run(check()) == [2.0, 2.0, 4.0, 2.0 * 16]


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
