"""deploy/k8s on paper (no cluster runs here): the core objects validate against the Kubernetes
schemas (kubernetes-validate), the LeaderWorkerSet's pod templates too (its custom resource
has no schema there), and every command line, with the LWS or StatefulSet variables filled
in, parses with the service's own settings (flags and PIPESHARD_* variables), listening on
the ports the manifests declare."""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from pipeshard.exporter import main as exporter
from pipeshard.services.coordinator import main as coordinator
from pipeshard.services.gateway.settings import GatewaySettings
from pipeshard.services.stage import main as stage
from pipeshard.settings import load_settings

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
KUBERNETES = "1.37.0"
# each command's settings and how the service completes them before it listens
SETTINGS = {
    "stage": (stage.StageSettings, stage.resolve),
    "coordinator": (coordinator.CoordinatorSettings, coordinator.resolve),
    "exporter-service": (exporter.ExporterSettings, exporter.resolve),
    "serve-openai": (GatewaySettings, lambda settings: settings),
}
# What the controllers give each pod: LWS's variables for group 0 of `pipeshard` (worker 1 of
# 3), a StatefulSet pod's index label (read through a fieldRef).
POD_ENV = {
    "LWS_LEADER_ADDRESS": "pipeshard-0.pipeshard.default",
    "LWS_GROUP_SIZE": "3",
    "LWS_WORKER_INDEX": "1",
}
FIELD_REFS = {"metadata.labels['apps.kubernetes.io/pod-index']": "0"}


def objects() -> list[dict]:
    return [doc for path in sorted(K8S.glob("*.yaml")) for doc in yaml.safe_load_all(path.read_text()) if doc]


def pod_templates() -> list[dict]:
    """Every pod template: the workloads' own, and the LeaderWorkerSet's leader and worker."""
    out = []
    for obj in objects():
        if obj["kind"] == "LeaderWorkerSet":
            lws = obj["spec"]["leaderWorkerTemplate"]
            out += [lws["leaderTemplate"], lws["workerTemplate"]]
        elif "template" in obj.get("spec", {}):
            out.append(obj["spec"]["template"])
    return out


def containers() -> list[dict]:
    return [c for template in pod_templates() for c in template["spec"]["containers"]]


CORE = [o for o in objects() if o["kind"] != "LeaderWorkerSet"]  # a custom resource: see below


@pytest.mark.parametrize("obj", CORE, ids=lambda o: f"{o['kind']}/{o['metadata']['name']}")
def test_core_objects_validate_against_the_kubernetes_schema(obj):
    kubernetes_validate.validate(obj, KUBERNETES, strict=True)


def test_the_leaderworkerset_pod_templates_validate_as_pods():
    (lws,) = [o for o in objects() if o["kind"] == "LeaderWorkerSet"]
    assert lws["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
    spec = lws["spec"]["leaderWorkerTemplate"]
    assert spec["size"] == 3  # the coordinator and two stages
    for role in ("leaderTemplate", "workerTemplate"):
        template = spec[role]
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": template["metadata"], "spec": template["spec"]}
        kubernetes_validate.validate(pod, KUBERNETES, strict=True)


def command_line(container: dict) -> list[str]:
    """The container's pipeshard argv as the pod runs it: a shell script is run with the pod's
    variables and its `exec pipeshard` turned into an echo."""
    argv = [*container.get("command", ["pipeshard"]), *container.get("args", [])]
    if argv[:2] != ["sh", "-c"]:
        assert argv[0] == "pipeshard", argv
        return argv[1:]
    script = argv[2]
    assert script.count("exec pipeshard ") == 1, script
    env = dict(POD_ENV)
    for var in container.get("env", []):
        env[var["name"]] = var.get("value") or FIELD_REFS[var["valueFrom"]["fieldRef"]["fieldPath"]]
    echo = script.replace("exec pipeshard ", "echo ")
    done = subprocess.run(["sh", "-c", echo], env=env, capture_output=True, text=True, check=True)
    return shlex.split(done.stdout)


@pytest.mark.parametrize("container", containers(), ids=lambda c: c["name"])
def test_every_command_parses_with_its_services_settings_and_declares_its_ports(container, monkeypatch):
    argv = command_line(container)
    command, flags = argv[0], argv[1:]
    cls, resolve = SETTINGS[command]
    env = {
        v["name"]: v.get("value") or FIELD_REFS[v["valueFrom"]["fieldRef"]["fieldPath"]]
        for v in container["env"]
    }
    ours = {k: v for k, v in env.items() if k.startswith("PIPESHARD_")}
    known = {f"PIPESHARD_{name.upper()}" for name in cls.__dataclass_fields__}
    assert set(ours) <= known, f"{container['name']}: {set(ours) - known} are not {cls.__name__} variables"
    settings = resolve(load_settings(cls, flags, env=ours, prog=command))  # unknown flags exit
    declared = {p["containerPort"] for p in container["ports"]}
    listening = {settings.port, getattr(settings, "metrics_port", 0)} - {0, None}
    assert listening == declared, f"{container['name']} listens on {listening}, declares {declared}"
    probe = container.get("readinessProbe", {})
    for kind in ("grpc", "httpGet"):
        if kind in probe:
            assert probe[kind]["port"] == settings.port


def test_the_stages_chain_into_each_other_and_the_coordinator_dials_them():
    lws = {c["name"]: command_line(c) for c in containers() if "LWS" in str(c)}
    worker = load_settings(stage.StageSettings, lws["stage"][1:], env={})
    assert worker.stage == 0 and worker.next_hop == "pipeshard-0-2.pipeshard.default:50061"
    leader = load_settings(coordinator.CoordinatorSettings, lws["coordinator"][1:], env={})
    workers = [f"pipeshard-0-{w}.pipeshard.default:50061" for w in (1, 2)]
    assert leader.stages == workers
    assert leader.exporter == worker.exporter == "pipeshard-exporter:50071"


def test_services_point_at_ports_their_pods_declare():
    ports = {p["containerPort"] for c in containers() for p in c["ports"]}
    for obj in objects():
        if obj["kind"] == "Service":
            assert {p["targetPort"] for p in obj["spec"]["ports"]} <= ports, obj["metadata"]["name"]
