"""Issue #14 attacks on a real plaintext 2-stage fleet: a second party reaching the stages can
neither read, release, reset nor feed another party's sessions, nor exhaust a stage's sessions."""

from __future__ import annotations

import threading

import grpc
import numpy as np
import pytest

from pipeshard.clients.client import PipeshardClient
from pipeshard.ownership import owner_key, owner_metadata
from pipeshard.tensor_codec import encode
from pipeshard.v1 import activation_pb2, stage_pb2, stage_pb2_grpc, tensor_pb2
from tests.pipeline.stage_probe import live_sessions, sessions_after_release

pytestmark = pytest.mark.slow


class Party:
    """A caller of the stages that holds its own owner secret (as a coordinator does)."""

    def __init__(self, name: str):
        self.secret = f"{name}-secret-for-the-ownership-tests"
        self.metadata = owner_metadata(self.secret)
        self.owner = owner_key(self.secret)

    def stub(self, channel) -> stage_pb2_grpc.StageServiceStub:
        return stage_pb2_grpc.StageServiceStub(channel)


class Subscription:
    """A Results subscription read on a thread; ``results`` collects what it receives."""

    def __init__(self, address: str, metadata, subscriber_id: str = "coordinator-x"):
        self._channel = grpc.insecure_channel(address)
        self._call = stage_pb2_grpc.StageServiceStub(self._channel).Results(
            stage_pb2.ResultsRequest(subscriber_id=subscriber_id), metadata=metadata
        )
        self.results: list[activation_pb2.StepResult] = []
        self.error: grpc.RpcError | None = None
        self._got = threading.Condition()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            for response in self._call:
                with self._got:
                    self.results.append(response.result)
                    self._got.notify_all()
        except grpc.RpcError as exc:
            self.error = exc

    def wait_for(self, count: int, timeout_s: float = 30) -> list[activation_pb2.StepResult]:
        with self._got:
            self._got.wait_for(lambda: len(self.results) >= count, timeout_s)
            return list(self.results)

    def close(self) -> None:
        self._call.cancel()
        self._thread.join(10)
        self._channel.close()


def first_frame(session_id: str, owner: str, step_id: int = 0) -> activation_pb2.ActivationFrame:
    ids = np.array([[1, 9690, 314]], np.int64)  # a few token ids of the vocabulary
    return activation_pb2.ActivationFrame(
        session_id=session_id,
        step_id=step_id,
        positions=[0, 1, 2],
        tensors=[tensor_pb2.NamedTensor(name="input_ids", tensor=encode(ids))],
        owner=owner,
        plan=activation_pb2.PlanFrame(
            rows=[
                activation_pb2.PlanRow(
                    session_id=session_id, step_id=step_id, tokens=3, kind=activation_pb2.ROW_KIND_PREFILL
                )
            ]
        ),
    )


def forward(address: str, frame, metadata=()) -> list[stage_pb2.ForwardResponse]:
    """Send one frame on a fresh Forward stream; returns the stage's errors (none on success)."""
    with grpc.insecure_channel(address) as channel:
        call = stage_pb2_grpc.StageServiceStub(channel).Forward(
            iter([stage_pb2.ForwardRequest(frame=frame)]), timeout=10, metadata=metadata
        )
        return list(call)


@pytest.fixture(scope="module")
def fleet(default_fleet):
    return default_fleet


def test_results_reach_only_the_owner_of_the_session(fleet):
    victim, attacker = Party("victim"), Party("attacker")
    last = fleet.stages[-1]
    with grpc.insecure_channel(last) as channel, pytest.raises(grpc.RpcError) as refused:
        next(stage_pb2_grpc.StageServiceStub(channel).Results(stage_pb2.ResultsRequest(), timeout=5))
    spy = Subscription(last, attacker.metadata)
    mine = Subscription(last, victim.metadata)
    try:
        with PipeshardClient(fleet.coordinator, timeout_s=120) as client:
            answer = client.generate("What is the capital of France?", max_tokens=8, ignore_eos=True)
        assert answer.completion_tokens == 8
        # The victim's own step, sent with its owner key, reaches its subscription only.
        with grpc.insecure_channel(fleet.stages[0]) as c0, grpc.insecure_channel(last) as c1:
            for channel in (c0, c1):
                victim.stub(channel).OpenSession(
                    stage_pb2.OpenSessionRequest(session_id="v"), timeout=5, metadata=victim.metadata
                )
            assert forward(fleet.stages[0], first_frame("v", victim.owner)) == []
            got = mine.wait_for(1)
            for channel in (c0, c1):
                victim.stub(channel).ReleaseSession(
                    stage_pb2.ReleaseSessionRequest(session_id="v"), timeout=5, metadata=victim.metadata
                )
        assert [(r.session_id, r.HasField("error")) for r in got] == [("v", False)]
    finally:
        spy.close()
        mine.close()
    assert spy.results == [], "the attacker's subscription saw another party's results"
    assert spy.error is None or spy.error.code() == grpc.StatusCode.CANCELLED
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED


def test_another_partys_session_cannot_be_released_reset_aborted_or_fed(fleet):
    victim, attacker = Party("victim2"), Party("attacker2")
    first, last = fleet.stages
    lease = Subscription(last, victim.metadata)
    lease0 = Subscription(first, victim.metadata)
    try:
        with grpc.insecure_channel(first) as c0, grpc.insecure_channel(last) as c1:
            for channel in (c0, c1):
                victim.stub(channel).OpenSession(
                    stage_pb2.OpenSessionRequest(session_id="s"), timeout=5, metadata=victim.metadata
                )
            before = [live_sessions(first), live_sessions(last)]
            evil = attacker.stub(c0)
            released = evil.ReleaseSession(
                stage_pb2.ReleaseSessionRequest(session_id="s"), timeout=5, metadata=attacker.metadata
            )
            aborted = evil.AbortSession(
                stage_pb2.AbortSessionRequest(session_id="s", reason="x"),
                timeout=5,
                metadata=attacker.metadata,
            )
            assert (released.released, aborted.aborted) == (False, False)
            with pytest.raises(grpc.RpcError) as reset:
                evil.ResetSession(
                    stage_pb2.ResetSessionRequest(session_id="s"), timeout=5, metadata=attacker.metadata
                )
            assert reset.value.code() == grpc.StatusCode.NOT_FOUND
            with pytest.raises(grpc.RpcError) as anonymous:
                evil.ReleaseSession(stage_pb2.ReleaseSessionRequest(session_id="s"), timeout=5)
            assert anonymous.value.code() == grpc.StatusCode.PERMISSION_DENIED
            # Frames into the victim's session: under the attacker's owner key, under none, and
            # straight into stage 1 as if from stage 0. Each is an unknown session.
            hidden = encode(np.ones((1, 1, 576), np.float32))
            stage1_frame = activation_pb2.ActivationFrame(
                session_id="s",
                step_id=5,
                positions=[0],
                tensors=[tensor_pb2.NamedTensor(name="hidden_states", tensor=hidden)],
                plan=activation_pb2.PlanFrame(
                    rows=[
                        activation_pb2.PlanRow(
                            session_id="s", step_id=5, tokens=1, kind=activation_pb2.ROW_KIND_PREFILL
                        )
                    ]
                ),
                owner=attacker.owner,
            )
            errors = [
                *forward(first, first_frame("s", attacker.owner), attacker.metadata),
                *forward(first, first_frame("s", "")),
                *forward(last, stage1_frame, attacker.metadata),
            ]
            assert [e.error.code for e in errors] == ["NOT_FOUND"] * 3
            assert all(e.error.message == "unknown session 's'" for e in errors)
            # The same id opened by the attacker is its own session: no collision, no hint.
            evil.OpenSession(
                stage_pb2.OpenSessionRequest(session_id="s"), timeout=5, metadata=attacker.metadata
            )
            evil.ReleaseSession(
                stage_pb2.ReleaseSessionRequest(session_id="s"), timeout=5, metadata=attacker.metadata
            )
            assert [live_sessions(first), live_sessions(last)] == before
            # The victim's session is intact and still runs from position 0.
            assert forward(first, first_frame("s", victim.owner)) == []
            (result,) = lease.wait_for(1)
            assert (
                result.session_id == "s" and not result.HasField("error") and len(result.top1.token_ids) == 1
            )
            for channel in (c0, c1):
                assert (
                    victim.stub(channel)
                    .ReleaseSession(
                        stage_pb2.ReleaseSessionRequest(session_id="s"), timeout=5, metadata=victim.metadata
                    )
                    .released
                )
    finally:
        lease.close()
        lease0.close()


def test_one_party_cannot_exhaust_a_stage_and_its_sessions_go_with_its_streams(fleet):
    hog = Party("hog")
    last = fleet.stages[-1]
    lease = Subscription(last, hog.metadata)
    opened = 0
    with grpc.insecure_channel(last) as channel:
        stub = hog.stub(channel)
        with pytest.raises(grpc.RpcError) as full:
            for i in range(64):  # the stage holds 64 sessions; before issue #14 one party took them all
                stub.OpenSession(
                    stage_pb2.OpenSessionRequest(session_id=f"h{i}"), timeout=5, metadata=hog.metadata
                )
                opened += 1
    assert full.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "max_sessions_per_owner" in full.value.details()
    assert 0 < opened < 64
    with PipeshardClient(fleet.coordinator, timeout_s=120) as client:  # others are still served
        assert client.generate("Say hi.", max_tokens=4, ignore_eos=True).completion_tokens == 4
    lease.close()
    # Released by the lease (seconds after the stream closed), not the 300 s idle reaper.
    assert sessions_after_release([last], timeout_s=60) == [0]
