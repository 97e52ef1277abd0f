"""``pipeshard distil``: train a draft on the target's own next tokens and export it.

    pipeshard distil --target shards/smollm2-135m-instruct-1s-int4 --layers 2 --vocab 8192

writes SHARDS_DIR/<model>-distil<K>[-v<N>]/{hf,export}; start a coordinator with
``--self-draft <that>/export`` (or pass ``<that>/hf`` as a request's ``speculative``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pipeshard import paths
from pipeshard.errors import InvalidArgument, PipeshardError


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "distil",
        help="train a speculative draft on the target's own next tokens",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--model", default=paths.DEFAULT_MODEL, help="Hugging Face folder or name (default %(default)s)"
    )
    p.add_argument(
        "--target", type=Path, required=True, help="the target's export: it writes and labels the texts"
    )
    p.add_argument("--layers", type=int, required=True, help="the draft keeps the model's first K layers")
    p.add_argument(
        "--vocab", type=int, default=None, help="the draft's head scores N token ids (default all)"
    )
    p.add_argument(
        "--texts",
        type=Path,
        default=None,
        help='JSONL of {"prompt", "text"} to train on (default: the target answers synthetic prompts)',
    )
    p.add_argument("--prompts", type=int, default=200, help="synthetic prompts without --texts (default 200)")
    p.add_argument("--max-tokens", type=int, default=128, help="answer length per synthetic prompt")
    p.add_argument("--epochs", type=float, default=2.0)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--weights", default="int4", choices=("int4", "int8", "fp16", "fp32"))
    p.add_argument(
        "--out", type=Path, default=None, help="output folder (default SHARDS_DIR/<model>-distil<K>[-v<N>])"
    )
    p.add_argument("--force", action="store_true", help="replace an existing export")
    p.set_defaults(func=run_distil)


def _report(phase: str, fraction: float, message: str) -> None:
    # One line per tenth of a phase, and every message that opens or closes one.
    if fraction in (0.0, 1.0) or int(fraction * 10) != int((fraction - 1e-9) * 10):
        print(f"[distil] {phase} {fraction:4.0%} {message}", file=sys.stderr, flush=True)


def run_distil(args: argparse.Namespace) -> int:
    from pipeshard.exporter.cli import resolve_model
    from pipeshard.exporter.distil import distil

    try:
        if not (args.target / "manifest.json").is_file():
            raise InvalidArgument("target", f"{args.target} is not a pipeshard export (no manifest.json)")
        model_dir = resolve_model(args.model)
        vocab = "" if args.vocab is None else f"-v{args.vocab}"
        out = args.out or paths.shards_dir() / f"{model_dir.name}-distil{args.layers}{vocab}"
        result = distil(
            model_dir,
            args.target,
            out,
            layers=args.layers,
            vocab=args.vocab,
            texts=args.texts,
            prompts=args.prompts,
            max_tokens=args.max_tokens,
            epochs=args.epochs,
            lr=args.lr,
            report=_report,
            weights=args.weights,
            force=args.force,
            model_name=f"{model_dir.name}-distil{args.layers}",
        )
    except PipeshardError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, InvalidArgument) else 1
    print(
        f"distilled a {args.layers}-layer draft: held-out agreement with the target "
        f"{result.agreement_before:.3f} -> {result.agreement_after:.3f}; "
        f"Hugging Face folder {result.folder}, export {result.export.path}"
    )
    return 0
