"""``pipeshard certs``: create a fleet CA and per-node certificates (idempotent); with
``--topology``, a bundle per host (its own certificates, the CA certificate and the fleet token)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from pipeshard import paths
from pipeshard.tls import TOKEN_FILE, HostCert
from pipeshard.topology import Topology


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "certs", help="create the fleet CA and node certificates for mutual TLS (keeps existing ones)"
    )
    p.add_argument(
        "--dir", type=Path, default=None, help="output folder (default: certs/ or PIPESHARD_CERTS_DIR)"
    )
    p.add_argument("--stages", type=int, default=8, help="certificates stage0..stage{N-1} (default 8)")
    p.add_argument(
        "--nodes", default="", help="more node names, comma-separated (each gets NAME.pem and NAME.key)"
    )
    p.add_argument(
        "--hosts",
        default="",
        help="host names or IPs every certificate is valid for besides its node name and loopback "
        "(comma-separated; the addresses nodes dial each other by)",
    )
    p.add_argument(
        "--topology",
        type=Path,
        default=None,
        help="a fleet on several hosts: per host, DIR/hosts/HOST/ with ca.pem, the fleet token and "
        "the certificates of only the processes the topology puts there (each valid for that host "
        "alone, its role written in it); copy each folder to its host as --tls-dir. Remade on every run",
    )
    p.add_argument("--days", type=int, default=None, help="node certificates' validity in days (default 90)")
    p.set_defaults(func=run)
    actions = p.add_subparsers(dest="certs_action", metavar="revoke")
    revoke = actions.add_parser(
        "revoke",
        help="revoke a node's certificates: their serials go to DIR/revoked and every host bundle's "
        "revoked; copy it to each host's --tls-dir (stages re-read it within a second)",
    )
    revoke.add_argument("name", help="node name (stage0, coordinator, exporter, gateway, ...)")
    revoke.add_argument(
        "--dir", type=Path, default=None, help="certificates folder (default: certs/ or PIPESHARD_CERTS_DIR)"
    )
    revoke.set_defaults(func=run_revoke)


def node_names(stages: int, extra: str = "") -> list[str]:
    return ["exporter", "coordinator", *(f"stage{k}" for k in range(stages)), *filter(None, extra.split(","))]


def host_certs(topology: Topology) -> list[HostCert]:
    """Every process the topology places, as (node name, role, host); the gateway runs beside the
    coordinator. Replicas of a stage keep the stage's name: each host holds one of them."""
    certs = [
        HostCert("exporter", "exporter", topology.exporter.host),
        HostCert("coordinator", "coordinator", topology.coordinator.host),
        HostCert("gateway", "gateway", topology.coordinator.host),
    ]
    for lane in topology.lanes:
        certs += [HostCert(f"stage{k}", "stage", stage.host) for k, stage in enumerate(lane)]
    return list(dict.fromkeys(certs))


def run_bundles(folder: Path, topology: Path, days: int) -> int:
    from pipeshard.auth import load_or_create_token
    from pipeshard.tls import make_host_bundles

    certs = host_certs(Topology.load(topology))
    bundles = make_host_bundles(folder, certs, days)
    token = load_or_create_token(folder / TOKEN_FILE)
    for host, bundle in bundles.items():
        write_token(bundle / TOKEN_FILE, token)
        names = ", ".join(c.name for c in certs if c.host == host)
        print(f"{bundle}/  ->  copy to {host} as its --tls-dir ({names})")
    print(f"fleet token in {folder / TOKEN_FILE} and in every bundle (mode 0600); clients: PIPESHARD_TOKEN")
    print(f"CA certificate (give it to clients): {folder / 'ca.pem'}; keep {folder / 'ca.key'} here")
    return 0


def run(args: argparse.Namespace) -> int:
    from pipeshard.tls import VALID_DAYS, make_certs

    folder = args.dir or paths.certs_dir()
    if args.days is not None and args.days < 1:
        print(f"error: --days must be at least 1, got {args.days}", file=sys.stderr)
        return 2
    days = args.days or VALID_DAYS
    if args.topology is not None:
        return run_bundles(folder, args.topology, days)
    hosts = filter(None, args.hosts.split(","))
    written = make_certs(folder, node_names(args.stages, args.nodes), hosts, days)
    print(
        f"{len(written)} files written to {folder}" if written else f"{folder} already has every certificate"
    )
    print(f"CA certificate (give it to clients): {folder / 'ca.pem'}; keep {folder / 'ca.key'} offline")
    return 0


def run_revoke(args: argparse.Namespace) -> int:
    from pipeshard.errors import NotFound
    from pipeshard.revocation import REVOKED_FILE, revoke

    folder = args.dir or paths.certs_dir()
    try:
        revoked = revoke(folder, args.name)
    except NotFound as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for path, serial in revoked:
        print(f"revoked {path} (serial {serial:x})")
    print(
        f"written to {folder / REVOKED_FILE} and every host bundle's {REVOKED_FILE}: copy it to each "
        "host's --tls-dir; `pipeshard certs` (the same options) issues the node a new certificate"
    )
    return 0


def write_token(path: Path, token: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
