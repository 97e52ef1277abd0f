"""Issue #14 on a secured fleet (mutual TLS between all processes, a client token): it generates
exactly like the in-process ring, and every outsider is refused: a client without the token, a
plaintext connection to a stage, a node whose certificate another CA signed, and a fleet member
asking for another coordinator's sessions. Issue #37: API keys beside the token, each its own
identity and prefix-cache scope, checked by the coordinator and the gateway, revocable live;
fair share: one key's queued burst never delays another key's one request behind it."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx2 as httpx
import pytest

from pipeshard.certs_cli import node_names
from pipeshard.clients.client import PipeshardClient
from pipeshard.keys import add_key, revoke_key
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
def keys(tmp_path_factory) -> dict:
    """A key file with three users' keys (issue #37); the fleet accepts them beside the token."""
    path = tmp_path_factory.mktemp("keys") / "api-keys"
    return {"path": path, **{name: add_key(path, name) for name in ("alice", "bob", "carol", "hog")}}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def fleet(shards, fleet_factory, certs, keys):
    # Two running slots, so a burst of one key fills the fleet and fair share decides who goes next.
    metrics = {"coordinator": _free_port()}
    started = fleet_factory(
        shards,
        2,
        tls_dir=certs,
        token=TOKEN,
        api_keys=keys["path"],
        gateway_port=0,
        metrics_ports=metrics,
        extra_coordinator_args=["--max-running", "2"],
    )
    started.metrics_ports = metrics
    return started


def member_channel(address: str, folder, name: str) -> grpc.Channel:
    return grpc.secure_channel(address, TlsConfig.from_dir(folder, name).channel_credentials())


def stage_info(channel: grpc.Channel) -> stage_pb2.GetStageInfoResponse:
    return stage_pb2_grpc.StageServiceStub(channel).GetStageInfo(stage_pb2.GetStageInfoRequest(), timeout=10)


def test_secured_fleet_generates_exactly_like_the_in_process_ring(fleet, certs, shards):
    from pipeshard.services.coordinator.generation import Generation, Summary
    from pipeshard.services.coordinator.in_process import local_ring
    from pipeshard.services.coordinator.sampling import SamplingParams
    from pipeshard.shard.prompting import Prompter

    with PipeshardClient(fleet.coordinator, timeout_s=120, token=TOKEN, ca_cert=certs / "ca.pem") as client:
        remote = client.generate(PROMPT, max_tokens=24, ignore_eos=True)
    prompter = Prompter.from_dir(shards)
    generation = Generation(local_ring(shards), prompter.tokenizer, prompter.eos_ids)
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


def _client(fleet, certs, key: str) -> PipeshardClient:
    return PipeshardClient(fleet.coordinator, timeout_s=120, token=key, ca_cert=certs / "ca.pem")


# Long enough for the prefix cache (over --prefix-min-tokens, 64) to keep and restore it.
PRIVATE = "Summarise my private notes. " + " ".join(
    f"Note {i}: the meeting moved to room {i}." for i in range(14)
)


def test_listed_keys_are_served_unlisted_refused_and_revocation_is_live(fleet, certs, keys):
    for key in (keys["alice"], keys["carol"]):
        with _client(fleet, certs, key) as client:
            assert client.generate("Say hi.", max_tokens=3, ignore_eos=True).completion_tokens == 3
    for key in ("psk-invented", keys["alice"][:-2]):
        with _client(fleet, certs, key) as client, pytest.raises(grpc.RpcError) as info:
            client.generate("hi", max_tokens=2)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    revoke_key(keys["path"], "carol")
    time.sleep(0.6)  # each service checks the key file for changes at most every 0.5 s
    with _client(fleet, certs, keys["carol"]) as client, pytest.raises(grpc.RpcError) as info:
        client.generate("hi", max_tokens=2)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    chat = {"model": "m", "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 3}
    url = f"http://{fleet.gateway}/v1/chat/completions"
    served = httpx.post(url, json=chat, headers={"authorization": f"Bearer {keys['bob']}"}, timeout=120)
    assert served.status_code == 200, served.text
    for key in (keys["carol"], "invented"):
        refused = httpx.post(url, json=chat, headers={"authorization": f"Bearer {key}"}, timeout=120)
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"


def test_two_keys_have_separate_prefix_scopes(fleet, certs, keys):
    def cached(key: str) -> int:
        with _client(fleet, certs, key) as client:
            return client.generate(PRIVATE, max_tokens=2, ignore_eos=True).cached_tokens

    alice_first, alice_again = cached(keys["alice"]), cached(keys["alice"])
    bob_first, bob_again = cached(keys["bob"]), cached(keys["bob"])
    assert alice_first == 0 and alice_again > 64  # alice's own prefix is reused...
    assert bob_first == 0  # ...but never bob's first request of the same prompt
    assert bob_again > 64


def _queued(fleet) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    port = fleet.metrics_ports["coordinator"]
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "pipeshard_coordinator_queued_requests"
    )


def test_another_keys_request_goes_ahead_of_a_queued_burst(fleet, certs, keys):
    """Fair share (issue #37): key hog fills both running slots and queues 6 more; bob's one
    request, sent after all of them, is admitted at the next free slot, so its first token comes
    before those of hog's later requests (first come first served it would come after all 8)."""
    first_tokens: list[str] = []  # who got a first token, in arrival order
    lock = threading.Lock()

    def run(who: str, key: str, tokens: int) -> int:
        with _client(fleet, certs, key) as client:
            count = 0
            for chunk in client.stream("Count to a hundred.", max_tokens=tokens, ignore_eos=True):
                if chunk.token_ids and count == 0:
                    with lock:
                        first_tokens.append(who)
                count += len(chunk.token_ids)
            return count

    with ThreadPoolExecutor(9) as pool:
        burst = [pool.submit(run, f"hog{i}", keys["hog"], 40) for i in range(8)]
        deadline = time.monotonic() + 60
        while _queued(fleet) < 6 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _queued(fleet) == 6  # two running, six queued behind them
        bob = pool.submit(run, "bob", keys["bob"], 8)
        assert bob.result(timeout=120) == 8
        assert [f.result(timeout=120) for f in burst] == [40] * 8
    # bob took the first slot that freed; at most hog's 2 running and the one admitted beside bob
    # started before him (FIFO across identities: all 8).
    assert first_tokens.index("bob") <= 3, first_tokens


def test_a_revoked_certificate_is_refused_by_every_stage_at_once(fleet, certs):
    """`pipeshard certs revoke intruder`: the stages re-read the list beside their certificates
    and refuse the intruder's next call (its connection already open), while the fleet serves
    on. Without the check in the stages' role check the intruder's calls go on succeeding."""
    from pipeshard.revocation import revoke

    channels = [member_channel(address, certs, "intruder") for address in fleet.stages]
    metadata = owner_metadata("intruder-secret-of-its-own")

    def open_session(channel: grpc.Channel) -> None:
        stub = stage_pb2_grpc.StageServiceStub(channel)
        stub.OpenSession(stage_pb2.OpenSessionRequest(session_id="rv"), metadata=metadata, timeout=10)
        stub.ReleaseSession(stage_pb2.ReleaseSessionRequest(session_id="rv"), metadata=metadata, timeout=10)

    try:
        for channel in channels:
            open_session(channel)  # a fleet member's own session: admitted
        (revoked,) = revoke(certs, "intruder")
        assert not revoked[0].exists()  # `pipeshard certs` issues a new one
        time.sleep(1.0)  # the stages look at the list at most every 0.5 s
        for channel in channels:
            with pytest.raises(grpc.RpcError) as info:
                open_session(channel)
            assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED, info.value.details()
            assert "revoked" in info.value.details()
    finally:
        for channel in channels:
            channel.close()
    with PipeshardClient(fleet.coordinator, timeout_s=120, token=TOKEN, ca_cert=certs / "ca.pem") as client:
        assert client.generate("hi", max_tokens=2).completion_tokens == 2
