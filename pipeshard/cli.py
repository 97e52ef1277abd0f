"""The ``pipeshard`` console script: one argparse tree, each feature registers its own subcommands."""

from __future__ import annotations

import argparse
import importlib
import sys

from pipeshard.offline import set_offline_defaults

# Modules exposing ``register(subparsers)``; each adds its subcommands with ``set_defaults(func=...)``.
_COMMAND_MODULES = (
    "pipeshard.model.cli",
    "pipeshard.exporter.cli",
    "pipeshard.exporter.family_list",
    "pipeshard.exporter.distil_cli",
    "pipeshard.clients.cli",
    "pipeshard.services.gateway.batch_cli",
    "pipeshard.services.fleet_cli",
    "pipeshard.services.raycluster.cli",
    "pipeshard.services.top",
    "pipeshard.services.wan.cli",
    "pipeshard.certs_cli",
    "pipeshard.keys_cli",
    "pipeshard.planning.cli",
)

# Long-running services parse their own flags (typed settings, each also an environment variable).
_SERVERS = {
    "stage": ("pipeshard.services.stage.main", "serve one pipeline stage"),
    "coordinator": ("pipeshard.services.coordinator.main", "serve Generate over a ring of stages"),
    "exporter-service": ("pipeshard.exporter.main", "serve Export and FetchShard"),
    "serve-openai": (
        "pipeshard.services.gateway.main",
        "serve the OpenAI HTTP API before a coordinator",
    ),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pipeshard", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (_, text) in _SERVERS.items():
        sub.add_parser(name, help=f"{text} (see `pipeshard {name} --help`)", add_help=False)
    for name in _COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    sub.choices["generate"].set_defaults(run_local=_generate_local)
    return parser


def _generate_local(args: argparse.Namespace, stream: bool):
    """``generate --local`` runs the coordinator in this process; imported only when asked for."""
    from pipeshard.services.coordinator.local_generate import generate_local

    return generate_local(args, stream)


def main(argv: list[str] | None = None) -> int:
    set_offline_defaults()
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in _SERVERS:
        return importlib.import_module(_SERVERS[argv[0]][0]).main(argv[1:])
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
