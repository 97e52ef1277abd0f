"""One Ray actor per pipeshard service: the actor owns the service's process on its node.

The process is the same one the CLI starts (``python -m pipeshard.cli stage ...``), started by the
launcher's ``spawn`` under ``setpriv --pdeathsig KILL``: when the actor's worker dies (its node
died, or Ray killed it) the service dies with it, and when Ray restarts the actor (``max_restarts``)
on a node with room, its constructor starts the service again there. The actor reports where the
service listens. In a secured fleet it first makes the service's key on its node and has the
fleet's signer certify it (``certify``): nothing secret is in its arguments or its replies.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path

import ray

from pipeshard.services.launcher import Process, fleet_env, spawn
from pipeshard.services.raycluster.certify import request_certificate

# Kill the service when the actor's worker exits however it exits (setpriv execs, the pid stays).
_DIE_WITH_ACTOR = ("setpriv", "--pdeathsig", "KILL")
NAMESPACE = "pipeshard"


@dataclass(frozen=True)
class ServiceInfo:
    """Where one service of the fleet runs: what the coordinator and `pipeshard top` need."""

    name: str
    address: str  # host:port it serves gRPC (or HTTP, the gateway) on
    node_id: str
    node_ip: str
    pid: int
    restarts: int  # how often Ray restarted this actor (0: first start)
    started_at: float  # wall-clock time its actor began (before its certificate, pull and compile)
    listening_at: float  # wall-clock time its service began to listen


def node_run_dir(base: str, node_id: str) -> Path:
    """This node's working folder for the fleet: logs and pulled shards, one per Ray node."""
    return Path(base) / f"node-{node_id[:12]}"


@ray.remote(num_cpus=0)
class ServiceActor:
    """Starts ``pipeshard ARGS`` on this node, listening on the node's address.

    ``args`` may hold ``{host}`` (this node's IP), ``{run}`` (this node's run folder) and, with a
    ``role``, ``{tls}`` (the folder of the key made here and its certificate from ``signer``)."""

    def __init__(
        self,
        name: str,
        args: list[str],
        base_dir: str,
        env: dict[str, str] | None = None,
        timeout_s: float = 300.0,
        role: str | None = None,
        signer=None,
    ):
        self.started_at = time.time()
        context = ray.get_runtime_context()
        self.name = name
        self.node_id = context.get_node_id()
        self.node_ip = ray.util.get_node_ip_address()
        self.restarts = int(context.was_current_actor_reconstructed)
        run_dir = node_run_dir(base_dir, self.node_id)
        run_dir.mkdir(parents=True, exist_ok=True)
        values = {"host": self.node_ip, "run": str(run_dir)}
        env = {**fleet_env(), **(env or {})}
        if role is not None:
            tls = run_dir / "tls" / name
            env.update(request_certificate(signer, tls, name, role, self.node_ip))
            values["tls"] = str(tls)
        argv = [a.format(**values) for a in args]
        self.process: Process = spawn(name, argv, run_dir, env, timeout_s, prefix=_DIE_WITH_ACTOR)
        self.listening_at = time.time()

    def info(self) -> ServiceInfo:
        return ServiceInfo(
            self.name,
            self.process.address,
            self.node_id,
            self.node_ip,
            self.process.popen.pid,
            self.restarts,
            self.started_at,
            self.listening_at,
        )

    def log_tail(self, chars: int = 3000) -> str:
        return self.process.log.read_text()[-chars:]

    def signal_reload(self, topology: str, text: str) -> None:
        """Write the coordinator's topology file on its node and have it re-read (SIGHUP)."""
        import signal

        Path(topology).write_text(text)
        os.kill(self.process.popen.pid, signal.SIGHUP)

    def run(self, argv: list[str], timeout_s: float = 1800.0) -> str:
        """Run a one-off pipeshard command on this node (the exporter's exports); returns its output."""
        import subprocess
        import sys

        done = subprocess.run(
            [sys.executable, "-m", "pipeshard.cli", *argv],
            env=fleet_env(),
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
        if done.returncode:
            raise RuntimeError(
                f"pipeshard {' '.join(argv)} failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}"
            )
        return done.stdout

    def stop(self) -> None:
        self.process.popen.terminate()
        try:
            self.process.popen.wait(15)
        except Exception:
            self.process.popen.kill()


def free_port() -> int:
    """A port free on this machine now (the driver's choice for services pinned to its node)."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]
