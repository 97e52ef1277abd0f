"""A secured fleet on a real 3-node Ray cluster on this machine (`make test-ray`): two nodes hold the
fleet's CA and token, a third joined without them. The fleet runs mutual TLS with certificates
the signer issued to keys made on each node; its tokens equal an in-process run; the gateway serves
HTTPS; nothing that crossed Ray (actor arguments, the signer's requests and replies) nor any log
holds a private key or the token; and the stranger node gets no stage."""

from __future__ import annotations

import json
import ssl
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

ray = pytest.importorskip("ray", reason="Ray is not installed: pip install -e '.[ray]' (make setup does)")

from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy  # noqa: E402

from pipeshard.auth import load_or_create_token  # noqa: E402
from pipeshard.clients.client import PipeshardClient  # noqa: E402
from pipeshard.planning.cli import model_cost  # noqa: E402
from pipeshard.services.raycluster import fleet as ray_fleet  # noqa: E402
from pipeshard.services.raycluster.actors import NAMESPACE, node_run_dir  # noqa: E402
from pipeshard.services.raycluster.fleet import RaySpec, fleet_members, remove, start_actor, start_signer, up  # noqa: E402
from pipeshard.services.raycluster.placement import plan_fleet  # noqa: E402
from pipeshard.tls import CA_CERT, CA_KEY, TOKEN_FILE, certificate_role, fleet_ca  # noqa: E402
from tests.ray.reference import greedy_reference  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.ray]

MAX_TOKENS = 32
PROMPTS = ("What is the capital of France?", "List five fruits that are red.")


@pytest.fixture(scope="module")
def credentials(tmp_path_factory):
    """The head's certs (CA key, ca.pem, token), a member's copy (ca.pem, token) and a stranger's
    own CA and token: another fleet's, not this one's."""
    root = tmp_path_factory.mktemp("certs")
    head, member, stranger = root / "head", root / "member", root / "stranger"
    fleet_ca(head)
    load_or_create_token(head / TOKEN_FILE)
    member.mkdir()
    for name in (CA_CERT, TOKEN_FILE):
        (member / name).write_bytes((head / name).read_bytes())
    fleet_ca(stranger)
    load_or_create_token(stranger / TOKEN_FILE)
    return head, member, stranger


@pytest.fixture(scope="module")
def cluster(smollm2_dir, credentials):
    from ray.cluster_utils import Cluster

    head_certs, member_certs, stranger_certs = credentials
    cost = model_cost(smollm2_dir, "int4", None)
    memory = int(cost.stage_bytes(0, cost.num_layers, 1) * 1.5)
    c = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 2,
            "memory": memory,
            "env_vars": {"PIPESHARD_CERTS_DIR": str(head_certs)},
        },
    )
    member = c.add_node(num_cpus=1, memory=memory, env_vars={"PIPESHARD_CERTS_DIR": str(member_certs)})
    stranger = c.add_node(num_cpus=1, memory=memory, env_vars={"PIPESHARD_CERTS_DIR": str(stranger_certs)})
    ray.init(address=c.address, namespace=NAMESPACE)
    c.wait_for_nodes()
    yield c, member, stranger
    ray.shutdown()
    c.shutdown()


@pytest.fixture(scope="module")
def reference(smollm2_export):
    return greedy_reference(smollm2_export(2, "int4"), PROMPTS, MAX_TOKENS)


def _secrets(head: Path) -> list[bytes]:
    """What must never cross Ray or reach a log: the token and any private key."""
    return [b"PRIVATE KEY", (head / TOKEN_FILE).read_text().strip().encode(), (head / CA_KEY).read_bytes()]


def _recording(monkeypatch) -> list[bytes]:
    """Every ServiceActor's constructor arguments, as Ray is handed them."""
    seen: list[bytes] = []
    real = ray_fleet.ServiceActor

    class Recorder:
        @staticmethod
        def options(**options):
            made = real.options(**options)

            class Remote:
                @staticmethod
                def remote(*args):
                    seen.append(repr((options, args)).encode())
                    return made.remote(*args)

            return Remote

    monkeypatch.setattr(ray_fleet, "ServiceActor", Recorder)
    return seen


def test_secured_fleet_is_exact_over_mutual_tls_and_no_secret_crosses_ray(
    cluster, credentials, smollm2_export, reference, tmp_path, monkeypatch
):
    _, member, stranger = cluster
    head_certs = credentials[0]
    shards = smollm2_export(2, "int4")
    spec = RaySpec(
        shards_root=shards.parent,
        work_dir=tmp_path / "nodes",
        topology=tmp_path / "topology.yaml",
        export=shards,
        gateway_port=0,
        certs=head_certs,
    )
    crossed = _recording(monkeypatch)
    signer = start_signer(spec)
    try:
        found, refused = fleet_members(spec)
        assert [m.node_id for m in refused] == [stranger.node_id]
        assert member.node_id in {m.node_id for m in found} and len(found) == 2
        fleet = up(spec, plan_fleet(found, Path(shards), "int4", stages=2, profile=False))
        (lane,) = fleet.lanes
        assert {s.node_id for s in lane} == {m.node_id for m in found}, "a stage off the members"

        # each service's certificate: made for its node's address and its role, key on its node
        for info, role in [(fleet.exporter, "exporter"), (fleet.coordinator, "coordinator")] + [
            (s, "stage") for s in lane
        ]:
            folder = node_run_dir(str(spec.work_dir), info.node_id) / "tls" / info.name
            assert certificate_role((folder / f"{info.name}.pem").read_bytes()) == role
            assert ((folder / f"{info.name}.key").stat().st_mode & 0o777) == 0o600

        token = (head_certs / TOKEN_FILE).read_text().strip()
        ca = head_certs / CA_CERT
        got = []
        for prompt in PROMPTS:
            with PipeshardClient(fleet.coordinator.address, timeout_s=600, token=token, ca_cert=ca) as client:
                got.append(
                    [
                        t
                        for piece in client.stream(prompt, max_tokens=MAX_TOKENS, ignore_eos=True)
                        for t in piece.token_ids
                    ]
                )
        assert got == reference

        # no plaintext anywhere: a stage refuses a plaintext health check, and a TLS one without a
        # fleet certificate (mutual TLS)
        with grpc.insecure_channel(lane[0].address) as channel, pytest.raises(grpc.RpcError):
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        creds = grpc.ssl_channel_credentials(root_certificates=ca.read_bytes())
        with grpc.secure_channel(lane[0].address, creds) as channel, pytest.raises(grpc.RpcError):
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)

        # the gateway serves HTTPS with its own certificate, and no plain HTTP
        context = ssl.create_default_context(cafile=str(ca))
        request = urllib.request.Request(
            f"https://{fleet.gateway.address}/v1/models", headers={"Authorization": f"Bearer {token}"}
        )
        with urllib.request.urlopen(request, context=context, timeout=30) as reply:
            assert json.loads(reply.read())["data"]
        with pytest.raises((urllib.error.URLError, ConnectionError)):
            urllib.request.urlopen(f"http://{fleet.gateway.address}/health", timeout=10)

        # a stage forced onto the stranger node: refused a certificate, so it never starts
        onto_stranger = NodeAffinitySchedulingStrategy(stranger.node_id, soft=False)
        with pytest.raises(Exception, match="does not hold the fleet's token"):
            start_actor("stage0.r9", ["stage", "--stage", "0"], spec, onto_stranger, "stage")

        # what crossed Ray: actor arguments, the signer's requests and its replies; then every log
        audit = ray.get(signer.audit.remote())
        assert {req.name for req, _ in audit} >= {"exporter", "coordinator", "gateway", "stage0", "stage1"}
        crossed += [repr(req).encode() + req.csr_pem + cert for req, cert in audit]
        logs = [p for p in (tmp_path / "nodes").rglob("*.log")]
        session = Path(ray._private.worker._global_node.get_session_dir_path()) / "logs"
        logs += [p for p in session.rglob("*") if p.is_file()]
        for secret in _secrets(head_certs):
            assert not [x for x in crossed if secret in x], f"{secret[:20]!r} crossed Ray"
            assert not [p for p in logs if secret in p.read_bytes()], f"{secret[:20]!r} in a log"
    finally:
        remove(["keeper", ray_fleet.SIGNER, *ray.util.list_named_actors()])
