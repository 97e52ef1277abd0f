"""Writes the Docker Compose file of a containerised fleet: any number of stages and replicas.

Each service runs in its own container on one private bridge network, with the ports of
``make up`` (pipeshard/topology.py). Nothing holding shards is shared: the exporter exports into
its own volume and serves FetchShard; every stage container starts empty and pulls its own stage
(checksums verified), and the coordinator pulls the manifest and tokenizer the same way. With
``secure`` every gRPC hop is mutual TLS with a certificate named after the service, and each
container mounts only its own certificate, key and the CA certificate (never the CA's key). Only
the OpenAI gateway is published, on the host's loopback.

    python docker/compose_gen.py --stages 3 --replicas 2 --out build/compose-3s.yaml
    python docker/compose_gen.py certs --stages 3 --replicas 2 --dir build/compose-certs
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

from pipeshard.paths import DEFAULT_MODEL, export_name
from pipeshard.topology import LANE_SEPARATOR, Topology

SERVING_IMAGE = "pipeshard:latest"
EXPORTER_IMAGE = "pipeshard-exporter:latest"
GATEWAY_PORT = 8080
UID = 10001  # the images' unprivileged user
DATA = "/app/data"  # the exporter's volume: models/ and shards/
CERTS = "/app/certs"
TOKEN = "${PIPESHARD_TOKEN:?set PIPESHARD_TOKEN (the token file of compose_gen.py certs)}"
PROBE = ["CMD", "python", "/usr/local/bin/pipeshard-healthcheck"]


@dataclass(frozen=True)
class FleetSpec:
    """What the compose file runs: the export, its stage count and lanes, and whether TLS is on."""

    stages: int = 2
    replicas: int = 1
    model: str = DEFAULT_MODEL
    weights: str = "int4"
    precision: str | None = None
    secure: bool = True
    gateway_port: int = GATEWAY_PORT
    certs_dir: str = "../build/compose-certs"  # relative to the compose file

    def __post_init__(self) -> None:
        if self.stages < 1:
            raise ValueError(f"stages must be at least 1, got {self.stages}")
        if self.replicas < 1:
            raise ValueError(f"replicas must be at least 1, got {self.replicas}")

    @property
    def export(self) -> str:
        return export_name(self.model, self.stages, self.weights)


def stage_service(k: int, r: int) -> str:
    """The service (and certificate) name of replica ``r`` of stage ``k``."""
    return f"stage{k}" if r == 0 else f"stage{k}-r{r}"


def node_names(spec: FleetSpec) -> list[str]:
    """Every service that holds a certificate (the gateway only verifies the coordinator's)."""
    stages = [stage_service(k, r) for r in range(spec.replicas) for k in range(spec.stages)]
    return ["exporter", "coordinator", *stages]


def _tls(spec: FleetSpec, name: str | None) -> tuple[dict[str, str], list[str]]:
    """Environment and read-only mounts of one service's TLS identity (``name`` None: the CA only)."""
    if not spec.secure:
        return {"PIPESHARD_ALLOW_PLAINTEXT": "1"}, []
    mounts = [f"{spec.certs_dir}/ca.pem:{CERTS}/ca.pem:ro"]
    if name is None:
        return {"PIPESHARD_CA_CERT": f"{CERTS}/ca.pem", "PIPESHARD_TOKEN": TOKEN}, mounts
    mounts += [f"{spec.certs_dir}/{name}.{ext}:{CERTS}/{name}.{ext}:ro" for ext in ("pem", "key")]
    env = {"PIPESHARD_TLS_DIR": CERTS, "PIPESHARD_TLS_NAME": name, "PIPESHARD_TOKEN": TOKEN}
    return env, mounts


def _service(spec: FleetSpec, image: str, name: str | None, env: dict[str, str], command: list[str]) -> dict:
    tls_env, mounts = _tls(spec, name)
    service = {
        "image": image,
        "user": f"{UID}:{UID}",
        "command": command,
        "environment": {"PIPESHARD_HOST": "0.0.0.0", **env, **tls_env},
        "healthcheck": {"test": list(PROBE), "interval": "5s", "timeout": "5s", "retries": 3},
        "networks": ["fleet"],
    }
    if mounts:
        service["volumes"] = mounts
    return service


def compose(spec: FleetSpec) -> dict:
    """The compose document (a plain mapping, dumped as YAML) for ``spec``."""
    topo = Topology.loopback(f"shards/{spec.export}", spec.stages, replicas=spec.replicas)
    shards = f"/app/shards/{spec.export}"
    exporter_addr = f"exporter:{topo.exporter.port}"
    precision = {"PIPESHARD_PRECISION": spec.precision} if spec.precision else {}
    export = f"{DATA}/shards/{spec.export}"
    export_cmd = (
        f"pipeshard model fetch && {{ test -f {export}/manifest.json || pipeshard export --model {spec.model}"
        f" --stages {spec.stages} --weights {spec.weights} --out {export}; }}"
        " && exec pipeshard exporter-service"
    )
    exporter = _service(
        spec,
        EXPORTER_IMAGE,
        "exporter",
        {
            "PIPESHARD_MODELS_DIR": f"{DATA}/models",
            "PIPESHARD_SHARDS_DIR": f"{DATA}/shards",
            "PIPESHARD_PORT": str(topo.exporter.port),
        },
        [export_cmd],
    )
    exporter["entrypoint"] = ["sh", "-c"]
    # the first start exports (15+ min on a loaded 2-core machine); unhealthy before it would stop the fleet
    exporter["healthcheck"]["start_period"] = "3600s"
    exporter.setdefault("volumes", []).append(f"exports:{DATA}")
    services: dict[str, dict] = {"exporter": exporter}
    for r, lane in enumerate(topo.lanes):
        for k, endpoint in enumerate(lane):
            env = {
                "PIPESHARD_STAGE": str(k),
                "PIPESHARD_PORT": str(endpoint.port),
                "PIPESHARD_SHARDS": shards,
                "PIPESHARD_EXPORTER": exporter_addr,
                **precision,
            }
            if k + 1 < spec.stages:
                env["PIPESHARD_NEXT_HOP"] = f"{stage_service(k + 1, r)}:{lane[k + 1].port}"
            service = _service(spec, SERVING_IMAGE, stage_service(k, r), env, ["stage"])
            service["healthcheck"]["start_period"] = "300s"
            service["depends_on"] = {"exporter": {"condition": "service_healthy"}}
            services[stage_service(k, r)] = service
    stage_list = ",".join(
        LANE_SEPARATOR.join(f"{stage_service(k, r)}:{lane[k].port}" for r, lane in enumerate(topo.lanes))
        for k in range(spec.stages)
    )
    coordinator = _service(
        spec,
        SERVING_IMAGE,
        "coordinator",
        {
            "PIPESHARD_PORT": str(topo.coordinator.port),
            "PIPESHARD_STAGES": stage_list,
            "PIPESHARD_SHARDS": shards,
            "PIPESHARD_EXPORTER": exporter_addr,
            # requests that do not choose get the speculation source measured fastest on this fleet
            "PIPESHARD_SPECULATIVE": "auto",
        },
        ["coordinator"],
    )
    coordinator["healthcheck"]["start_period"] = "300s"
    coordinator["depends_on"] = {
        stage_service(k, r): {"condition": "service_healthy"}
        for r in range(spec.replicas)
        for k in range(spec.stages)
    }
    gateway_cmd = ["serve-openai", "--coordinator", f"coordinator:{topo.coordinator.port}"]
    gateway = _service(
        spec,
        SERVING_IMAGE,
        None,
        {
            "PIPESHARD_PORT": str(GATEWAY_PORT),
            "PIPESHARD_MODEL_NAME": spec.model,
            "HEALTHCHECK_URL": f"http://127.0.0.1:{GATEWAY_PORT}/health",
            # Plain HTTP on the container's 0.0.0.0 is asked for: its port is published on the
            # host's loopback only (below); the fleet's own hops are mutual TLS.
            "PIPESHARD_ALLOW_PLAINTEXT": "1",
        },
        gateway_cmd,
    )
    gateway["ports"] = [f"127.0.0.1:{spec.gateway_port}:{GATEWAY_PORT}"]
    gateway["depends_on"] = {"coordinator": {"condition": "service_healthy"}}
    services["coordinator"] = coordinator
    services["gateway"] = gateway
    return {
        "services": services,
        "networks": {"fleet": {"driver": "bridge"}},
        "volumes": {"exports": {}},
    }


HEADER = """\
# Generated by docker/compose_gen.py ({args}); docs/CONTAINERS.md.
# Secure mode needs the certificates first (each container mounts only its own key and ca.pem):
#   python docker/compose_gen.py certs {args} --dir build/compose-certs
#   PIPESHARD_TOKEN=$(cat build/compose-certs/token) docker compose -p pipeshard -f docker/compose.yaml up -d
"""


def render(spec: FleetSpec) -> str:
    args = f"--stages {spec.stages} --replicas {spec.replicas}" + ("" if spec.secure else " --plaintext")
    body = yaml.safe_dump(compose(spec), sort_keys=False, width=120)
    return HEADER.format(args=args) + body


def make_compose_certs(spec: FleetSpec, folder: Path) -> list[Path]:
    """The CA, one certificate per service and the fleet token in ``folder``. The keys are handed
    to the images' user (root only can), since each container reads its key as that user."""
    from pipeshard.auth import load_or_create_token
    from pipeshard.tls import make_certs

    written = make_certs(folder, node_names(spec))
    load_or_create_token(folder / "token")
    if os.geteuid() == 0:
        for name in node_names(spec):
            os.chown(folder / f"{name}.key", UID, UID)
    return written


COMPOSE_MISSING = (
    "error: Docker Compose is missing (install the compose plugin, or `sudo apt-get install docker-compose`)"
)


DAEMON_MISSING = (
    "error: no Docker daemon answers (start it: `sudo systemctl start docker` or `sudo dockerd &`)"
)
DOCKER_MISSING = "error: the docker command is missing (install Docker: `sudo apt-get install docker.io`)"


def compose_command() -> list[str]:
    """``docker compose`` (the plugin) where it answers, else the standalone ``docker-compose``."""
    plugin = subprocess.run(["docker", "compose", "version"], capture_output=True, check=False)
    if plugin.returncode == 0:
        return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    raise RuntimeError(COMPOSE_MISSING)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("action", nargs="?", choices=("compose", "certs", "check"), default="compose")
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--weights", default="int4")
    parser.add_argument("--precision", default=None)
    parser.add_argument("--plaintext", action="store_true", help="no TLS between the containers")
    parser.add_argument("--gateway-port", type=int, default=GATEWAY_PORT, help="host loopback port")
    parser.add_argument("--certs-dir", default=FleetSpec.certs_dir, help="as the compose file sees it")
    parser.add_argument("--dir", type=Path, default=Path("build/compose-certs"), help="certs: output folder")
    parser.add_argument("--out", type=Path, default=None, help="compose: file to write (default stdout)")
    args = parser.parse_args(argv)
    spec = FleetSpec(
        stages=args.stages,
        replicas=args.replicas,
        model=args.model,
        weights=args.weights,
        precision=args.precision,
        secure=not args.plaintext,
        gateway_port=args.gateway_port,
        certs_dir=args.certs_dir,
    )
    if args.action == "check":
        try:
            if subprocess.run(["docker", "info"], capture_output=True, check=False).returncode:
                raise RuntimeError(DAEMON_MISSING)
            print(f"compose: {' '.join(compose_command())}")
        except (RuntimeError, FileNotFoundError) as exc:
            print(exc if isinstance(exc, RuntimeError) else DOCKER_MISSING, file=sys.stderr)
            return 1
        return 0
    if args.action == "certs":
        written = make_compose_certs(spec, args.dir)
        print(f"{len(written)} files written to {args.dir}; token in {args.dir / 'token'}")
        return 0
    text = render(spec)
    if args.out is None:
        sys.stdout.write(text)
    else:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
