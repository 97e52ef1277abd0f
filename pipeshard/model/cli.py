"""`pipeshard model ...` subcommands."""

from __future__ import annotations

import argparse
from pathlib import Path

from pipeshard import paths


def register(subparsers: argparse._SubParsersAction) -> None:
    model = subparsers.add_parser("model", help="manage the bundled default model")
    model_sub = model.add_subparsers(dest="model_command", required=True)
    fetch = model_sub.add_parser(
        "fetch",
        help=f"install and convert the default model into MODELS_DIR/{paths.DEFAULT_MODEL} (idempotent)",
    )
    fetch.add_argument(
        "--models-dir",
        type=Path,
        default=None,
        help="where models live (env PIPESHARD_MODELS_DIR, default ./models)",
    )
    fetch.set_defaults(func=run_fetch)


def run_fetch(args: argparse.Namespace) -> int:
    from pipeshard.model.fetch import ensure_default_model

    ensure_default_model(args.models_dir)
    return 0
