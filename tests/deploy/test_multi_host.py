"""docs/DEPLOY.md's steps, run on four machines emulated by network namespaces (``psd-*``,
10.88.0.x): each host has its own working folder and shares nothing with the others but the
network. The operator plans the topology and makes the certificates once, copies each host its
bundle and the topology, and starts one short command per host, TLS on everywhere. The stages
and the coordinator start empty and pull what they need from the exporter; the fleet then
generates exactly what the in-process ring does. `make test-deploy` (needs root)."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import httpx2 as httpx
import pytest
import yaml

from pipeshard.clients.client import PipeshardClient
from pipeshard.services.launcher import spawn
from pipeshard.shard.prompting import Prompter
from tests.deploy import hosts as netns
from tests.pipeline.conftest import _greedy_in_process as greedy_in_process

pytestmark = [pytest.mark.slow, pytest.mark.deploy]

PROMPT = "What is the capital of France?"
MACHINES = {"exp": "10.88.0.2", "s0": "10.88.0.3", "s1": "10.88.0.4", "co": "10.88.0.5"}


def pipeshard(*args: str, cwd: Path) -> None:
    """The operator's command, run on the operator's own machine (the root namespace)."""
    import subprocess

    done = subprocess.run(
        [sys.executable, "-m", "pipeshard.cli", *args], cwd=cwd, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.fixture(scope="module")
def machines(tmp_path_factory):
    why = netns.missing()
    if why is not None:
        pytest.skip(f"the multi-host test cannot run here: {why}")
    root = tmp_path_factory.mktemp("hosts")
    made = {name: netns.Host(name, ip, root / name) for name, ip in MACHINES.items()}
    netns.create(list(made.values()))
    yield made
    netns.destroy(list(made.values()))


def host_env() -> dict[str, str]:
    """A host's environment: nothing pointing into another machine's folders."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIPESHARD_")}
    env["PIPESHARD_COMPILE_CACHE_DIR"] = ""  # inside the host's own copy of the export
    return env


def test_the_deploy_guide_on_four_hosts_generates_like_the_in_process_ring(
    machines, smollm2_export, smollm2_dir, tmp_path
):
    export = smollm2_export(2, "int4")
    operator = tmp_path / "operator"
    operator.mkdir()
    # 1. Export on the exporter machine (here: the cached export copied into its folder).
    shutil.copytree(export, machines["exp"].folder / "shards" / export.name)
    # 2. Plan the fleet: every process's host, port and device in one topology file.
    from pipeshard.planning.cli import model_cost

    cost = model_cost(smollm2_dir, "int4", None)  # memory for about half the model each: two stages
    memory = int(1.05 * max(cost.stage_bytes(0, 15, 1), cost.stage_bytes(15, 30, 1)))
    nodes = [
        {
            "name": name,
            "address": f"{MACHINES[name]}:{50061 + k}",
            "per_layer_ms": 1.0,
            "memory_bytes": memory,
        }
        for k, name in enumerate(("s0", "s1"))
    ]
    (operator / "nodes.yaml").write_text(yaml.safe_dump(nodes))
    pipeshard(
        "plan", "--nodes", "nodes.yaml", "--model", str(smollm2_dir), "--topology", "topology.yaml",
        "--shards", f"shards/{export.name}", "--coordinator", MACHINES["co"], "--exporter", MACHINES["exp"],
        cwd=operator,
    )  # fmt: skip
    # 3. Certificates once; each host gets only its own bundle (and the topology).
    pipeshard("certs", "--topology", "topology.yaml", "--dir", "certs", cwd=operator)
    for host in machines.values():
        shutil.copytree(operator / "certs" / "hosts" / host.ip, host.folder / "tls")
        shutil.copy(operator / "topology.yaml", host.folder / "topology.yaml")
    # 4. One short command per host.
    fleet = ["--topology", "topology.yaml", "--tls-dir", "tls", "--log-format", "json"]
    fleet += ["--metrics-host", "0.0.0.0"]  # `pipeshard top` reads them from the operator's machine
    commands = [
        ("exp", ["exporter-service", *fleet, "--shards-dir", "shards"]),
        ("s1", ["stage", "--stage", "1", *fleet]),
        ("s0", ["stage", "--stage", "0", *fleet]),
        ("co", ["coordinator", *fleet]),
    ]
    procs = []
    try:
        for name, args in commands:
            host = machines[name]
            procs.append(spawn(name, args, host.folder, host_env(), 600, prefix=host.prefix()))
        ports = {"exp": 50071, "s1": 50062, "s0": 50061, "co": 50051}
        assert [p.address for p in procs] == [f"{MACHINES[n]}:{ports[n]}" for n, _ in commands]
        # Each stage pulled only its own shard; the coordinator only the root files.
        for name, stage in (("s0", 0), ("s1", 1)):
            pulled = machines[name].folder / "shards" / export.name
            assert (pulled / f"stage_{stage}").is_dir() and not (pulled / f"stage_{1 - stage}").exists()
        assert not list((machines["co"].folder / "shards" / export.name).glob("stage_*"))
        # 5. Check a hop: the stage's metrics (what `pipeshard top` reads) on its fixed port.
        metrics = httpx.get(f"http://{MACHINES['s0']}:9161/metrics", timeout=10).text
        assert "pipeshard_" in metrics
        # 6. A client with the CA certificate and the fleet token generates.
        token = (operator / "certs" / "token").read_text().strip()
        ca = operator / "certs" / "ca.pem"
        with PipeshardClient(f"{MACHINES['co']}:50051", timeout_s=300, token=token, ca_cert=ca) as client:
            remote = client.generate(PROMPT, max_tokens=24, ignore_eos=True)
        ids = Prompter.from_dir(export).encode("", [("user", PROMPT)])
        assert remote.token_ids == greedy_in_process(export, [ids], 24)[0]
    finally:
        # 7. Down on every host: SIGTERM drains each process.
        for proc in reversed(procs):
            proc.popen.terminate()
        for proc in procs:
            proc.popen.wait(30)
