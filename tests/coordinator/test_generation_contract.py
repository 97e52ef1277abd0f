"""The contract says only what is true (issue #11 item 5): failures mid-stream end with an error
summary and abort the session on every stage; GenerateRequest.request_id names the generation."""

from __future__ import annotations

import asyncio

import pytest
import structlog

from pipeshard.errors import Internal, PipeshardError, Unavailable
from pipeshard.services.coordinator.generation import Chunk, Generation, Speculation, Summary
from pipeshard.services.coordinator.sampling import SamplingParams
from pipeshard.services.coordinator.scheduler import Scheduler
from pipeshard.services.coordinator.servicer import CoordinatorServicer
from pipeshard.shard.prompting import Prompter
from pipeshard.v1 import activation_pb2, coordinator_pb2


class Tokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(f"<{i}>" for i in ids)


class Ring:
    """Answers token 7 to every step until step ``fail_at`` (counted from 0), which raises ``error``."""

    truncates_on_rewind, batch_steps = False, None  # a stateful ring's, stepping alone
    verifies_trees = True

    def __init__(self, fail_at: int, error: PipeshardError | None = None):
        self.fail_at, self.steps, self.calls = fail_at, 0, []
        self.error = error or Unavailable("stage 1 at 127.0.0.1:1 is not answering")

    async def open_session(self, session_id, capacity=None, admission=None):
        self.calls.append("open")
        return 64

    async def step(self, frame, slot=None):
        self.steps += 1
        if self.steps - 1 == self.fail_at:
            raise self.error
        return activation_pb2.StepResult(top1=activation_pb2.Top1(token_ids=[7], probabilities=[1.0]))

    async def release_session(self, session_id):
        self.calls.append("release")

    async def abort_session(self, session_id, reason):
        self.calls.append(("abort", reason))


async def _run(ring: Ring, max_tokens: int = 5) -> list[Chunk | Summary]:
    generation = Generation(ring, Tokenizer(), set())
    events = [e async for e in generation.run([1, 2, 3], SamplingParams(max_tokens=max_tokens))]
    await asyncio.sleep(0)  # let the background release/abort task run
    return events


def test_a_failure_after_output_ends_with_an_error_summary_and_aborts():
    ring = Ring(fail_at=2, error=Internal("stage 1: the step failed"))
    events = asyncio.run(_run(ring))
    summary = events[-1]
    assert [e.token_ids for e in events[:-1]] == [[7], [7]]
    assert isinstance(summary, Summary) and summary.finish_reason == "error"
    assert "stage 1" in summary.error and summary.token_ids == [7, 7] and summary.text == "<7><7>"
    assert ring.calls == ["open", ("abort", "stage 1: the step failed")]


def test_an_unreachable_stage_after_output_ends_the_call_unavailable_and_aborts():
    """A stage that is down is a transport fault (issue #15): the status names it, even mid-stream."""

    ring = Ring(fail_at=2)
    with pytest.raises(Unavailable, match="stage 1"):
        asyncio.run(_run(ring))
    assert ring.calls == ["open", ("abort", "stage 1 at 127.0.0.1:1 is not answering")]


def test_a_failure_before_output_raises_and_aborts():
    ring = Ring(fail_at=0)
    with pytest.raises(Unavailable, match="stage 1"):
        asyncio.run(_run(ring))
    assert ring.calls == ["open", ("abort", "stage 1 at 127.0.0.1:1 is not answering")]


def test_a_finished_generation_releases():
    ring = Ring(fail_at=99)
    summary = asyncio.run(_run(ring, max_tokens=3))[-1]
    assert summary.finish_reason == "length" and summary.error == ""
    assert ring.calls == ["open", "release"]


class _Prompter:
    check_size = staticmethod(Prompter.check_size)

    def encode(self, prompt, messages):
        return [1, 2, 3]


class _Generation:
    """Reports the request id its log lines would carry."""

    def check_speculative(self, speculative, k, tree=""):
        return Speculation()

    def capacity(self, prompt_ids, params):
        return len(prompt_ids) + params.max_tokens

    async def generate(
        self, prompt_ids, params, speculation, *, scope="", reserved=None, grouping=None, admission=None
    ):
        yield Chunk(text=structlog.contextvars.get_contextvars().get("request_id", ""), token_ids=[])


@pytest.mark.parametrize(("sent", "logged"), [("req-42", "req-42"), ("x" * 300, "x" * 128), ("", "outer")])
def test_request_id_names_the_generation_in_logs(sent, logged):
    servicer = CoordinatorServicer(
        _Generation(),
        _Prompter(),
        max_context=64,
        vocab_size=10,
        default_max_tokens=4,
        scheduler=Scheduler(1, 1),
        max_prompt_bytes=1 << 16,
    )
    request = coordinator_pb2.GenerateRequest(prompt="hi", request_id=sent)

    async def first_text():
        with structlog.contextvars.bound_contextvars(request_id="outer"):  # the interceptor's
            async for response in servicer.Generate(request, None):
                return response.chunk.text

    assert asyncio.run(first_text()) == logged


def test_unimplemented_rpcs_answer_unimplemented():
    import grpc

    from pipeshard.errors import Unimplemented
    from pipeshard.interceptors import status_for

    assert status_for(Unimplemented("not yet (issue #N)"))[0] == grpc.StatusCode.UNIMPLEMENTED
    # a method of the generated base servicer that nobody overrides raises NotImplementedError
    assert status_for(NotImplementedError("Method not implemented!"))[0] == grpc.StatusCode.UNIMPLEMENTED


def test_the_summary_reaches_the_client_result_field_for_field():
    """One field list: Summary -> GenerateSummary (servicer) -> GenerateResult (client fold)."""
    from pipeshard.clients.client import GenerateResult, fold

    summary = Summary(
        "error",
        3,
        2,
        12.5,
        40.0,
        "<7><7>",
        [7, 7],
        "stage 1 failed",
        "ngram",
        1,
        2,
        1,
        [-0.5, -0.25],
        kept_per_traversal=[0, 1],
    )

    class Finished(_Generation):
        async def generate(
            self, prompt_ids, params, speculation, *, scope="", reserved=None, grouping=None, admission=None
        ):
            yield Chunk(text="<7><7>", token_ids=[7, 7], logprobs=[-0.5, -0.25], tokens=["<7>", "<7>"])
            yield summary

    servicer = CoordinatorServicer(
        Finished(),
        _Prompter(),
        max_context=64,
        vocab_size=10,
        default_max_tokens=4,
        scheduler=Scheduler(1, 1),
        max_prompt_bytes=1 << 16,
    )

    async def responses():
        return [r async for r in servicer.Generate(coordinator_pb2.GenerateRequest(prompt="hi"), None)]

    result = GenerateResult()
    for response in asyncio.run(responses()):
        fold(result, response)
    assert asyncio.run(responses())[-1].summary.error == "stage 1 failed"
    expected = {name: getattr(summary, name) for name in GenerateResult.__dataclass_fields__}
    assert vars(result) == expected
