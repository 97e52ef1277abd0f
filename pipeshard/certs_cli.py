"""``pipeshard certs``: create a fleet CA and per-node certificates (idempotent)."""

from __future__ import annotations

import argparse
from pathlib import Path

from pipeshard import paths


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
    p.set_defaults(func=run)


def node_names(stages: int, extra: str = "") -> list[str]:
    return ["exporter", "coordinator", *(f"stage{k}" for k in range(stages)), *filter(None, extra.split(","))]


def run(args: argparse.Namespace) -> int:
    from pipeshard.tls import make_certs

    folder = args.dir or paths.certs_dir()
    written = make_certs(folder, node_names(args.stages, args.nodes), filter(None, args.hosts.split(",")))
    print(
        f"{len(written)} files written to {folder}" if written else f"{folder} already has every certificate"
    )
    print(f"CA certificate (give it to clients): {folder / 'ca.pem'}; keep {folder / 'ca.key'} offline")
    return 0
