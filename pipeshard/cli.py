"""The ``pipeshard`` console script: one argparse tree, each feature registers its own subcommands."""

from __future__ import annotations

import argparse
import importlib
import sys

from pipeshard.offline import set_offline_defaults

# Modules exposing ``register(subparsers)``; each adds its subcommands with ``set_defaults(func=...)``.
_COMMAND_MODULES = (
    "pipeshard.model.cli",
    "exporter.cli",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pipeshard", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name in _COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    set_offline_defaults()
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
