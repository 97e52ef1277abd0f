"""Issue #14 on a secured fleet (mutual TLS between all processes, a client token): it generates
exactly like the in-process ring, and every outsider is refused: a client without the token, a
plaintext connection to a stage, a node whose certificate another CA signed, and a fleet member
asking for another coordinator's sessions."""

from __future__ import annotations

import asyncio
import threading

import grpc
import pytest

from pipeshard.certs_cli import node_names
from pipeshard.clients.client import PipeshardClient
from pipeshard.ownership import owner_metadata
from pipeshard.tls import TlsConfig, make_certs
from pipeshard.v1 import stage_pb2, stage_pb2_grpc

pytestmark = pytest.mark.slow

TOKEN = "client-token-of-the-tls-tests"
PROMPT = "What is the capital of France?"


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("certs")
    make_certs(folder, node_names(2, "intruder"))
    return folder


@pytest.fixture(scope="module")
def foreign_certs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("other-ca")
    make_certs(folder, ["coordinator"])  # same node name, another fleet's CA
    return folder


@pytest.fixture(scope="module")
def shards(smollm2_export):
    return smollm2_export(2, "int4")


@pytest.fixture(scope="module")
def fleet(shards, fleet_factory, certs):
    return fleet_factory(shards, 2, tls_dir=certs, token=TOKEN)


def member_channel(address: str, folder, name: str) -> grpc.Channel:
    return grpc.secure_channel(address, TlsConfig.from_dir(folder, name).channel_credentials())


def stage_info(channel: grpc.Channel) -> stage_pb2.GetStageInfoResponse:
    return stage_pb2_grpc.StageServiceStub(channel).GetStageInfo(stage_pb2.GetStageInfoRequest(), timeout=10)


def test_secured_fleet_generates_exactly_like_the_in_process_ring(fleet, certs, shards):
    from pipeshard.services.coordinator.generation import Generation, Summary
    from pipeshard.services.coordinator.local_ring import LocalRing
    from pipeshard.services.coordinator.sampling import SamplingParams
    from pipeshard.shard.prompting import Prompter

    with PipeshardClient(fleet.coordinator, timeout_s=120, token=TOKEN, ca_cert=certs / "ca.pem") as client:
        remote = client.generate(PROMPT, max_tokens=24, ignore_eos=True)
    prompter = Prompter.from_dir(shards)
    generation = Generation(LocalRing(shards), prompter.tokenizer, prompter.eos_ids)
    ids = prompter.encode("", [("user", PROMPT)])

    async def local() -> Summary:
        params = SamplingParams(max_tokens=24, ignore_eos=True)
        (summary,) = [e async for e in generation.run(ids, params) if isinstance(e, Summary)]
        return summary

    assert remote.completion_tokens == 24
    assert remote.token_ids == asyncio.run(local()).token_ids


def test_clients_without_the_token_are_refused(fleet, certs):
    for token in ("", "not-the-token"):
        with PipeshardClient(
            fleet.coordinator, timeout_s=30, token=token, ca_cert=certs / "ca.pem"
        ) as client:
            with pytest.raises(grpc.RpcError) as info:
                client.generate("hi", max_tokens=2)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with PipeshardClient(fleet.coordinator, timeout_s=30, token=TOKEN, ca_cert="") as client:
        with pytest.raises(grpc.RpcError) as info:  # plaintext to the TLS coordinator
            client.generate("hi", max_tokens=2)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE


def test_stages_refuse_plaintext_foreign_certificates_and_clients_without_one(fleet, certs, foreign_certs):
    member = member_channel(fleet.stages[0], certs, "intruder")  # a fleet certificate: admitted
    assert stage_info(member).num_stages == 2
    member.close()
    ca_only = grpc.secure_channel(  # verifies the stage but shows no certificate of its own
        fleet.stages[0], grpc.ssl_channel_credentials(root_certificates=(certs / "ca.pem").read_bytes())
    )
    trusted_ca = (certs / "ca.pem").read_bytes()
    foreign = TlsConfig.from_dir(foreign_certs, "coordinator")
    other_ca = grpc.secure_channel(  # trusts the fleet CA but holds another CA's certificate
        fleet.stages[0],
        grpc.ssl_channel_credentials(
            root_certificates=trusted_ca,
            private_key=foreign.key.read_bytes(),
            certificate_chain=foreign.cert.read_bytes(),
        ),
    )
    for channel in (
        grpc.insecure_channel(fleet.stages[0]),
        grpc.insecure_channel(fleet.stages[1]),
        ca_only,
        other_ca,
    ):
        with channel, pytest.raises(grpc.RpcError) as info:
            stage_info(channel)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE, info.value.details()


def test_a_fleet_member_cannot_read_another_coordinators_results(fleet, certs):
    with member_channel(fleet.stages[1], certs, "intruder") as channel:
        stub = stage_pb2_grpc.StageServiceStub(channel)
        with pytest.raises(grpc.RpcError) as anonymous:
            next(stub.Results(stage_pb2.ResultsRequest(subscriber_id="x"), timeout=10))
        assert anonymous.value.code() == grpc.StatusCode.PERMISSION_DENIED
        spy = stub.Results(
            stage_pb2.ResultsRequest(subscriber_id="x"), metadata=owner_metadata("intruder-secret-of-its-own")
        )
        seen: list = []

        def read() -> None:
            try:
                seen.extend(spy)
            except grpc.RpcError as exc:
                seen.extend([] if exc.code() == grpc.StatusCode.CANCELLED else [exc])

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        try:
            with PipeshardClient(
                fleet.coordinator, timeout_s=120, token=TOKEN, ca_cert=certs / "ca.pem"
            ) as client:
                assert client.generate("Say hi.", max_tokens=6, ignore_eos=True).completion_tokens == 6
        finally:
            spy.cancel()
            reader.join(10)
    assert seen == []
