"""A compose project driven from Python: `make test-docker` and `make bench-deploy` start fleets with it.

The compose file, the certificates (one per service) and the token go into one folder; the project
name is unique to it, so `down` and `leftovers` concern this fleet alone.
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
from pathlib import Path

from compose_gen import FleetSpec, compose_command, make_compose_certs, render


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ComposeFleet:
    """One compose project in ``folder``; the gateway on a free port of the host's loopback."""

    def __init__(self, folder: Path, stages: int, replicas: int = 1, project: str | None = None):
        self.command = compose_command()
        self.project = project or f"ps{stages}x{replicas}{os.getpid()}"
        self.spec = FleetSpec(stages=stages, replicas=replicas, gateway_port=free_port(), certs_dir="./certs")
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.file = self.folder / "compose.yaml"
        self.file.write_text(render(self.spec))
        make_compose_certs(self.spec, self.folder / "certs")
        self.token = (self.folder / "certs" / "token").read_text().strip()
        self.env = {**os.environ, "PIPESHARD_TOKEN": self.token}

    @property
    def gateway(self) -> str:
        return f"http://127.0.0.1:{self.spec.gateway_port}"

    def compose(
        self, *args: str, check: bool = True, timeout: float | None = None
    ) -> subprocess.CompletedProcess:
        cmd = [*self.command, "-p", self.project, "-f", str(self.file), *args]
        return subprocess.run(cmd, env=self.env, capture_output=True, text=True, check=check, timeout=timeout)

    def container(self, service: str) -> str:
        return self.compose("ps", "-q", service).stdout.strip()

    def logs(self, tail: int = 30) -> str:
        return self.compose("logs", "--no-color", "--tail", str(tail), check=False).stdout

    def up(self, timeout_s: float = 1800) -> None:
        """Starts every service (compose waits for each dependency's health) and waits for the gateway."""
        run = self.compose("up", "-d", check=False, timeout=timeout_s)
        if run.returncode != 0:
            raise RuntimeError(f"compose up failed: {run.stderr[-3000:]}\n{self.logs()}")
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.health("gateway") == "healthy":
                return
            time.sleep(1)
        raise RuntimeError(f"the gateway is not healthy:\n{self.logs()}")

    def health(self, service: str) -> str:
        inspect = ["docker", "inspect", "-f", "{{.State.Health.Status}}", self.container(service)]
        return subprocess.run(inspect, capture_output=True, text=True).stdout.strip()

    def down(self, volumes: bool = True) -> None:
        self.compose("down", *(["-v"] if volumes else []), "--remove-orphans", "-t", "5", check=False)

    def leftovers(self) -> dict[str, list[str]]:
        """Containers, networks and volumes still labelled with this project (empty after down)."""
        label = f"label=com.docker.compose.project={self.project}"
        kinds = {
            "containers": ["docker", "ps", "-aq", "--filter", label],
            "networks": ["docker", "network", "ls", "-q", "--filter", label],
            "volumes": ["docker", "volume", "ls", "-q", "--filter", label],
        }
        found = {
            kind: subprocess.run(cmd, capture_output=True, text=True).stdout.split()
            for kind, cmd in kinds.items()
        }
        return {kind: ids for kind, ids in found.items() if ids}
