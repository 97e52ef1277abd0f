"""The scripted coordinator the gateway tests run against (no model, no stages)."""

from __future__ import annotations

import time
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2_grpc

from pipeshard.services.launcher import fleet_env, spawn
from pipeshard.v1 import coordinator_pb2, coordinator_pb2_grpc

FOREVER = "forever"  # a prompt streamed 2 KiB chunks until the caller goes


class ScriptedCoordinator(coordinator_pb2_grpc.CoordinatorServiceServicer):
    """Answers "Hello world" in two chunks (with logprobs when asked); a prompt naming a status
    code aborts with it; FOREVER streams until the call is cancelled (counted in ``cancelled``)."""

    def __init__(self):
        self.requests: list[coordinator_pb2.GenerateRequest] = []
        self.metadata: list[dict[str, str]] = []
        self.cancelled = 0

    def Generate(self, request, context):
        self.requests.append(request)
        self.metadata.append(dict(context.invocation_metadata()))
        text = request.prompt or request.messages[-1].content
        if text in grpc.StatusCode.__members__:
            context.abort(grpc.StatusCode[text], f"`max_tokens` scripted {text}")
        if text == FOREVER:
            yield from self._forever(context)
            return
        alternatives = {"Hello": ("Hi", -1.5), " world": (" you", -2.0)}
        for text, token, logprob in (("Hello", 1, -0.5), (" world", 2, -0.25)):
            chunk = coordinator_pb2.TokenChunk(text=text, token_ids=[token])
            if request.params.logprobs:
                chunk.logprobs.append(logprob)
                chunk.tokens.append(text)
            if request.params.top_logprobs:
                other, other_logprob = alternatives[text]
                chunk.top_logprobs.append(
                    coordinator_pb2.TopLogprobs(
                        token_ids=[token, 9], logprobs=[logprob, other_logprob], tokens=[text, other]
                    )
                )
            yield coordinator_pb2.GenerateResponse(chunk=chunk)
        yield coordinator_pb2.GenerateResponse(
            summary=coordinator_pb2.GenerateSummary(
                finish_reason=coordinator_pb2.FINISH_REASON_LENGTH,
                prompt_tokens=5,
                completion_tokens=2,
                cached_tokens=3,
                text="Hello world",
            )
        )

    def _forever(self, context):
        while context.is_active():
            yield coordinator_pb2.GenerateResponse(
                chunk=coordinator_pb2.TokenChunk(text="x" * 2048, token_ids=[1])
            )
            time.sleep(0.01)
        self.cancelled += 1


@pytest.fixture(scope="module")
def coordinator():
    server = grpc.server(futures.ThreadPoolExecutor(4))
    servicer = ScriptedCoordinator()
    coordinator_pb2_grpc.add_CoordinatorServiceServicer_to_server(servicer, server)
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, f"127.0.0.1:{port}"
    server.stop(None)


@pytest.fixture(scope="module")
def gateways(coordinator, tmp_path_factory):
    """Factory: a gateway process before the scripted coordinator with extra flags; stopped at the end."""
    run_dir = tmp_path_factory.mktemp("gateways")
    started = []

    def start(*flags: str) -> str:
        args = ["serve-openai", "--coordinator", coordinator[1], "--port", "0", *flags]
        process = spawn(f"gateway{len(started)}", args, run_dir, fleet_env(), 60)
        started.append(process)
        return process.address

    yield start
    for process in started:
        process.popen.terminate()
        process.popen.wait(10)
