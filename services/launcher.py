"""Start and stop a loopback fleet as plain processes (``make up`` / ``make down`` and the tests).

Stages start from the last to the first, so each knows its next hop's address even when ports
are ephemeral (port 0: each process prints ``<name> listening on HOST:PORT``, which is read
back). Each process logs to ``<run_dir>/<name>.log`` and its pid with its start time goes to
``<run_dir>/pids``, so ``make down`` stops exactly those processes: a pid reused by another
process since (its start time differs) is left alone.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from pipeshard.precision import DEFAULT_PRECISION
from pipeshard.services.memcap import MemoryCap
from pipeshard.shard.draft_heads import is_draft_heads
from pipeshard.shard.draft_heads import read_meta as read_heads
from pipeshard.shard.feature_draft import is_feature_draft, read_meta
from pipeshard.shard.manifest import load_manifest
from pipeshard.tls import CA_CERT
from pipeshard.topology import LANE_SEPARATOR, REPLICA_PORT_STRIDE

_LISTENING = re.compile(r"listening on (\S+:\d+)")
_STAGE_NAME = re.compile(r"stage(\d+)(?:\.r(\d+))?")
_COORDINATOR_NAME = re.compile(r"coordinator\d*")


def stage_name(k: int, replica: int = 0) -> str:
    """The process name of replica ``replica`` of stage ``k``: ``stage1``, ``stage1.r2``."""
    return f"stage{k}" if replica == 0 else f"stage{k}.r{replica}"


def coordinator_name(c: int) -> str:
    """Process name of coordinator ``c`` of a group: the first is ``coordinator``, then ``coordinator1``..."""
    return f"coordinator{c}" if c else "coordinator"


def link_name(k: int, replica: int = 0) -> str:
    """The forwarder on replica ``replica`` of stage ``k``'s hop to the next stage (``faulty_links``)."""
    return f"link{k}" if replica == 0 else f"link{k}.r{replica}"


def link_control(run_dir: Path, k: int, replica: int = 0) -> Path:
    """That forwarder's control socket (services/wan/faults.py: ``stall``, ``reset``, ``heal``)."""
    return run_dir / f"{link_name(k, replica)}.sock"


def spawn_link(run_dir: Path, k: int, replica: int, upstream: str, env: dict[str, str]) -> Process:
    """A forwarder (no delay) in front of ``upstream``, whose faults ``link_control`` switches."""
    args = ["--delay-ms", "0", "--control", str(link_control(run_dir, k, replica)), f"127.0.0.1:0={upstream}"]
    return spawn(link_name(k, replica), args, run_dir, env, 30, module="pipeshard.services.wan.forwarder")


@dataclass
class Process:
    name: str
    popen: subprocess.Popen
    address: str
    log: Path


@dataclass
class Fleet:
    """A running set of stage processes, a coordinator and optionally an OpenAI gateway."""

    run_dir: Path
    processes: list[Process] = field(default_factory=list)
    caps: dict[str, MemoryCap] = field(default_factory=dict)  # process name -> its memory cgroup

    @property
    def coordinator(self) -> str:
        return next(p.address for p in self.processes if p.name == "coordinator")

    @property
    def coordinators(self) -> list[str]:
        """Every coordinator's address, the first (``coordinator``) first (``coordinator_name``)."""
        return [p.address for p in self.processes if _COORDINATOR_NAME.fullmatch(p.name)]

    @property
    def gateway(self) -> str:
        return next(p.address for p in self.processes if p.name == "gateway")

    @property
    def stages(self) -> list[str]:
        """Lane 0's stage addresses in pipeline order (every stage when there are no replicas)."""
        return self.lanes[0]

    @property
    def lanes(self) -> list[list[str]]:
        """Each lane's stage addresses in pipeline order: replica r of every stage (``stage_name``)."""
        lanes: dict[int, dict[int, str]] = {}
        for p in self.processes:
            match = _STAGE_NAME.fullmatch(p.name)
            if match:
                lanes.setdefault(int(match[2] or 0), {})[int(match[1])] = p.address
        return [[lane[k] for k in sorted(lane)] for _, lane in sorted(lanes.items())] or [[]]

    def process(self, name: str) -> Process:
        return next(p for p in self.processes if p.name == name)

    def stop(self, timeout_s: float = 15.0) -> None:
        for proc in reversed(self.processes):
            if proc.popen.poll() is None:
                proc.popen.send_signal(signal.SIGTERM)
        for proc in self.processes:
            try:
                proc.popen.wait(timeout_s)
            except subprocess.TimeoutExpired:
                proc.popen.kill()
                proc.popen.wait()
        for cap in self.caps.values():
            cap.close()


_OWNED: list[subprocess.Popen] = []


@atexit.register
def _stop_owned() -> None:
    """A crashed test or benchmark must not leave stage processes behind."""
    for popen in _OWNED:
        if popen.poll() is None:
            popen.kill()


def spawn(
    name: str,
    args: list[str],
    run_dir: Path,
    env: dict[str, str],
    timeout_s: float,
    *,
    detach: bool = False,
    prefix: Sequence[str] = (),
    module: str = "pipeshard.cli",
    memory_cap: MemoryCap | None = None,
) -> Process:
    """Start ``[PREFIX] python -m MODULE ARGS`` and wait for its ``listening on`` line. Unless ``detach``
    (``make up``), the process is killed when this interpreter exits, however it exits. ``prefix``
    wraps the command (``ip netns exec NS`` for the WAN emulator; it must exec, so the pid stays).
    ``memory_cap`` takes the process in as it starts, before it has loaded anything."""
    log = run_dir / f"{name.replace(' ', '')}.log"
    out = log.open("w")
    popen = subprocess.Popen(
        [*prefix, sys.executable, "-m", module, *args],
        stdout=out,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
    )
    if not detach:
        _OWNED.append(popen)
    if memory_cap is not None:
        memory_cap.add(popen.pid)
    with (run_dir / "pids").open("a") as pids:
        pids.write(f"{popen.pid} {process_start_time(popen.pid)} {name}\n")
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        match = _LISTENING.search(log.read_text())
        if match:
            return Process(name, popen, match.group(1), log)
        if popen.poll() is not None:
            raise RuntimeError(
                f"{name} exited with {popen.returncode}; see {log}:\n{log.read_text()[-3000:]}"
            )
        time.sleep(0.1)
    popen.kill()
    raise RuntimeError(f"{name} did not start within {timeout_s:g} s; see {log}")


def process_start_time(pid: int) -> str:
    """When ``pid`` started (clock ticks since boot, from /proc), or "" when there is no such pid.
    A pid and its start time name one process: a recycled pid has a later start time."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    # Field 22 of proc(5), counted after the name (which may hold spaces). A zombie keeps its start
    # time until reaped, so `down` returns only once the processes are gone.
    return stat.rpartition(")")[2].split()[19]


def fleet_env() -> dict[str, str]:
    return {
        **os.environ,
        "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1"),
        "TRANSFORMERS_OFFLINE": os.environ.get("TRANSFORMERS_OFFLINE", "1"),
    }


def stage_args(
    k: int,
    shards: Path,
    port: int,
    precision: str,
    log_format: str,
    next_hop: str | None,
    extra: Sequence[str] = (),
) -> list[str]:
    """``pipeshard stage`` arguments for stage ``k`` (no ``--next-hop`` for the final stage)."""
    args = ["stage", "--stage", str(k), "--shards", str(shards), "--port", str(port)]
    args += ["--precision", precision, "--log-format", log_format, *extra]
    return [*args, "--next-hop", next_hop] if next_hop else args


def feature_draft_args(shards: Path, choice: str = "auto") -> list[str]:
    """The coordinator arguments that offer a trained feature draft (``pipeshard distil --kind
    eagle``) as the sources ``feature`` and ``mix`` (``default_speculation`` says which requests
    get by default). ``auto``: the draft in the shards folder trained for these weights, if any (of
    several, the one with the best held-out chain); ``off``:
    none; else a folder, checked by the coordinator against the export's fingerprint."""
    if choice == "off":
        return []
    if choice != "auto":
        return ["--feature-draft", choice]
    model = load_manifest(shards).model
    ours = [
        (read_meta(folder), folder)
        for folder in sorted(Path(shards).parent.glob(f"{model.name}-eagle*"))
        if is_feature_draft(folder)
    ]
    ours = [(meta, folder) for meta, folder in ours if meta.model_fingerprint == model.fingerprint]
    if not ours:
        return []
    # Of several (architectures, trainings), the one whose held-out chain kept the most.
    _, best = max(ours, key=lambda m: held_out_chain(m[0].training))
    return ["--feature-draft", str(best)]


def held_out_chain(training: dict) -> float:
    """What a draft's held-out 3-token chain kept on the target's greedy answers: drafts trained on
    texts of several kinds record it per kind (their whole held-out set mixes in sampled text, which
    keeps less), earlier ones on greedy answers only."""
    by_kind = training.get("held_out_chain_of_3_by_kind") or {}
    return float(by_kind.get("greedy", training.get("held_out_chain_of_3", 0.0)))


def default_speculation(feature_args: list[str]) -> tuple[list[str], str]:
    """(the coordinator arguments, a line saying which) of the speculation requests that do not
    choose get: ``auto``, the source measured fastest on this fleet per request (the trained
    feature draft ``feature_draft_args`` offers, alone or as ``mix``, or prompt lookup), or plain
    where none pays (speculation/choice.py); each runs under adaptive K and is greedy-exact. A
    request's ``speculative`` still overrides (``none``: plain)."""
    among = "mix (prompt lookup, else the feature draft), feature, ngram" if feature_args else "ngram"
    said = f"speculation: auto by default: the fastest measured of {among} or plain, per request"
    if feature_args:
        return [*feature_args, "--speculative", "auto"], f"{said}; the feature draft {feature_args[1]}"
    return ["--speculative", "auto"], (
        f"{said}; no feature draft for these weights yet (`make distil KIND=eagle` trains one)"
    )


def draft_heads_args(shards: Path, choice: str = "auto") -> list[str]:
    """The final stage's arguments that run trained draft heads (``pipeshard distil --kind
    medusa``), so the coordinator offers ``medusa``. ``auto``: heads in the shards folder trained
    for these weights, if any; ``off``: none; else a folder, checked by the stage against the
    export's fingerprint."""
    if choice == "off":
        return []
    if choice != "auto":
        return ["--draft-heads", choice]
    model = load_manifest(shards).model
    for folder in sorted(Path(shards).parent.glob(f"{model.name}-medusa*")):
        if is_draft_heads(folder) and read_heads(folder).model_fingerprint == model.fingerprint:
            return ["--draft-heads", str(folder)]
    return []


def coordinator_args(
    stages: list[str], shards: Path, port: int, log_format: str, extra: Sequence[str] = ()
) -> list[str]:
    return [
        "coordinator",
        "--stages",
        ",".join(stages),
        "--shards",
        str(shards),
        "--port",
        str(port),
        "--log-format",
        log_format,
        *extra,
    ]


def gateway_args(coordinator: str, shards: Path, port: int, log_format: str) -> list[str]:
    """``pipeshard serve-openai`` in front of ``coordinator``; /v1/models names the export's model."""
    model = json.loads((Path(shards) / "manifest.json").read_text())["model"]["name"]
    args = ["serve-openai", "--coordinator", coordinator, "--port", str(port), "--model-name", model]
    return [*args, "--log-format", log_format]


def start_fleet(
    shards: Path,
    num_stages: int,
    run_dir: Path,
    *,
    stage_ports: list[int] | None = None,
    coordinator_port: int = 0,
    precision: str = DEFAULT_PRECISION,
    extra_stage_args: Sequence[str] = (),
    final_stage_args: Sequence[str] = (),
    devices: Sequence[str] = (),
    extra_coordinator_args: Sequence[str] = (),
    extra_gateway_args: Sequence[str] = (),
    exporter_port: int | None = None,
    gateway_port: int | None = None,
    metrics_ports: dict[str, int] | None = None,
    detach: bool = False,
    timeout_s: float = 180.0,
    log_format: str = "json",
    tls_dir: Path | None = None,
    token: str | None = None,
    api_keys: Path | None = None,
    replicas: int = 1,
    stage_memory_limit: int | None = None,
    faulty_links: bool = False,
    coordinators: int = 1,
    fixed_lanes: bool = False,
) -> Fleet:
    """Start ``num_stages`` stage processes and a coordinator on loopback; ports 0 = ephemeral.

    With ``exporter_port`` set, an exporter service over the shards' parent folder starts first and
    every stage may pull its shard from it. With ``tls_dir`` (certificates of ``pipeshard certs``
    for exporter, coordinator and stage0..) every link is TLS; ``token`` (passed in the
    environment, not on command lines) is then what clients of the coordinator and exporter need;
    with ``api_keys`` (a `pipeshard keys` file) the coordinator, exporter and gateway also accept
    any key listed there, each its own identity.
    With ``gateway_port`` set, the OpenAI gateway starts last. ``metrics_ports`` maps process
    names (exporter, stage0, ..., coordinator, gateway) to the port each serves Prometheus /metrics on.
    ``final_stage_args`` go to the final stage only (``--draft-heads DIR``, which others refuse).
    ``devices`` gives each stage its OpenVINO device (``--device``; empty: the stage's default).
    ``replicas`` lanes of stages start (replica r of each stage forwards to every replica of the
    next, replica r first, so the coordinator routes each session per stage; with ``faulty_links``
    to replica r's only, through its forwarder, and with ``fixed_lanes`` to replica r's only: the
    lanes of a fleet before per-hop routing, which bench-failover compares with;
    ``stage_ports`` are lane 0's, lane r adds 20r to each non-zero port; metrics likewise, by
    process name ``stage_name(k, r)``); the coordinator is given every lane.
    ``stage_memory_limit`` (bytes) runs every stage process in its own memory cgroup with that
    limit (``pipeshard.services.memcap``); their paths go to ``<run_dir>/cgroups``.
    ``faulty_links`` sends every hop between stages through its own forwarder process
    (``link_name``), so a test or the chaos soak can stall or reset one link (``link_control``).
    ``coordinators`` of them start over the same stages, a group (``coordinator_name``; coordinator
    c on ``coordinator_port`` + c, or an ephemeral port); the gateway is given them all."""
    run_dir.mkdir(parents=True, exist_ok=True)

    def metered(name: str, args: list[str]) -> list[str]:
        port = (metrics_ports or {}).get(name)
        return [*args, "--metrics-port", str(port)] if port else args

    env = fleet_env()
    if token:
        env["PIPESHARD_TOKEN"] = token
    if api_keys is not None:
        env["PIPESHARD_API_KEYS"] = str(api_keys)
    if tls_dir is not None:
        env["PIPESHARD_TLS_DIR"] = str(tls_dir)
        env["PIPESHARD_CA_CERT"] = str(tls_dir / CA_CERT)  # the gateway's view of the coordinator
    ports = stage_ports or [0] * num_stages
    fleet = Fleet(run_dir)
    try:
        if exporter_port is not None:
            exporter = spawn(
                "exporter",
                metered(
                    "exporter",
                    [
                        "exporter-service",
                        "--shards-dir",
                        str(Path(shards).parent),
                        "--port",
                        str(exporter_port),
                        "--log-format",
                        log_format,
                    ],
                ),
                run_dir,
                env,
                timeout_s,
                detach=detach,
            )
            fleet.processes.append(exporter)
            extra_stage_args = [*extra_stage_args, "--exporter", exporter.address]
        after: list[str] = []  # the next stage's hop addresses, one per lane
        for k in reversed(range(num_stages)):
            here: list[str] = []
            for r in range(replicas):
                # every replica of the next stage, its own lane's first (per-hop routing); through
                # forwarders only its own lane's, so each link of a lane is the one a fault hits
                hops = after[r : r + 1] if faulty_links or fixed_lanes else after[r:] + after[:r]
                port = ports[k] + REPLICA_PORT_STRIDE * r if ports[k] else 0
                next_hop = ",".join(hops) or None
                args = stage_args(k, shards, port, precision, log_format, next_hop, extra_stage_args)
                args += ["--device", devices[k]] if devices else []
                args += list(final_stage_args) if k == num_stages - 1 else []
                name = stage_name(k, r)
                cap = None
                if stage_memory_limit is not None:
                    cap = fleet.caps[name] = MemoryCap(f"{run_dir.name}-{name}", stage_memory_limit)
                    with (run_dir / "cgroups").open("a") as cgroups:
                        cgroups.write(f"{cap.path}\n")
                proc = spawn(
                    name, metered(name, args), run_dir, env, timeout_s, detach=detach, memory_cap=cap
                )
                fleet.processes.insert(1 if exporter_port is not None else 0, proc)
                here.append(proc.address)
                if faulty_links and k > 0:
                    fleet.processes.append(spawn_link(run_dir, k - 1, r, proc.address, env))
                    here[-1] = fleet.processes[-1].address
            after = here
        stages = [LANE_SEPARATOR.join(lane[k] for lane in fleet.lanes) for k in range(num_stages)]
        for c in range(coordinators):
            name = coordinator_name(c)
            port = coordinator_port + c if coordinator_port else 0
            coordinator = spawn(
                name,
                metered(name, coordinator_args(stages, shards, port, log_format, extra_coordinator_args)),
                run_dir,
                env,
                timeout_s,
                detach=detach,
            )
            fleet.processes.append(coordinator)
        if gateway_port is not None:
            gateway = spawn(
                "gateway",
                metered(
                    "gateway",
                    [
                        *gateway_args(",".join(fleet.coordinators), shards, gateway_port, log_format),
                        *extra_gateway_args,
                    ],
                ),
                run_dir,
                env,
                timeout_s,
                detach=detach,
            )
            fleet.processes.append(gateway)
    except BaseException:
        fleet.stop()
        raise
    return fleet


def recorded(run_dir: Path) -> list[tuple[int, str, str]]:
    """The (pid, start time, name) of each process ``start_fleet`` recorded in ``run_dir``."""
    pids_file = run_dir / "pids"
    if not pids_file.exists():
        return []
    rows = []
    for line in pids_file.read_text().splitlines():
        if line.strip():
            pid, started, name = line.split(" ", 2)
            rows.append((int(pid), started, name))
    return rows


def stop_recorded(run_dir: Path, timeout_s: float = 15.0) -> list[str]:
    """Stop the processes whose pids ``start_fleet`` recorded in ``run_dir``; returns their names.
    A pid whose process is gone, or is another process now (a different start time), is skipped."""
    pids_file = run_dir / "pids"
    if not pids_file.exists():
        return []
    ours: list[tuple[int, str, str]] = []
    for pid, started, name in recorded(run_dir):
        if process_start_time(pid) != started:
            print(f"not stopping pid {pid} ({name}): it is no longer the process started", file=sys.stderr)
            continue
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid), signal.SIGTERM)
            ours.append((int(pid), started, name))
    deadline = time.monotonic() + timeout_s
    for pid, started, _ in ours:
        while time.monotonic() < deadline and process_start_time(pid) == started:
            time.sleep(0.1)
        if process_start_time(pid) == started:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    pids_file.unlink()
    cgroups = run_dir / "cgroups"
    if cgroups.exists():  # the stages' memory cgroups (--stage-memory-limit), empty once they exited
        for line in cgroups.read_text().splitlines():
            with contextlib.suppress(OSError):
                Path(line).rmdir()
        cgroups.unlink()
    return [name for _, _, name in ours]
