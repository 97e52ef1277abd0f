"""``pipeshard distil``: train a draft on the target's own outputs.

    pipeshard distil --target shards/smollm2-135m-instruct-1s-int4 --layers 2 --vocab 8192
    pipeshard distil --kind eagle --target shards/smollm2-135m-instruct-1s-int4
    pipeshard distil --kind medusa --target shards/smollm2-135m-instruct-1s-int4

``--kind token`` (the default) writes SHARDS_DIR/<model>-distil<K>[-v<N>]/{hf,export}; start a
coordinator with ``--self-draft <that>/export`` (or pass ``<that>/hf`` as a request's
``speculative``). ``--kind eagle`` trains a draft that reads the target's final hidden state
(exporter/eagle.py) into SHARDS_DIR/<model>-eagle[-v<N>], reused when it already matches the
target's weights; a coordinator offers it as ``feature`` (``--feature-draft DIR``).
``--kind medusa`` trains draft heads on the same kind of texts (exporter/medusa.py) into
SHARDS_DIR/<model>-medusa<K>[-v<N>], reused likewise; the final stage runs them (``pipeshard stage
--draft-heads DIR``) and a coordinator then offers ``medusa``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pipeshard import paths
from pipeshard.errors import InvalidArgument, PipeshardError
from pipeshard.shard.feature_draft import ARCHS, DEFAULT_ARCH
from pipeshard.shard.manifest import WEIGHT_FORMATS


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
    p.add_argument(
        "--kind",
        default="token",
        choices=("token", "eagle", "medusa"),
        help="token: a k-layer draft of the model; eagle: a draft reading the target's features; "
        "medusa: heads on the final stage reading them",
    )
    p.add_argument("--heads", type=int, default=None, help="--kind medusa: how many heads (default 4)")
    p.add_argument(
        "--arch",
        default=DEFAULT_ARCH,
        choices=tuple(ARCHS),
        help="--kind eagle: mlp, one MLP block over the last position's feature; decoder, a decoder "
        "layer attending over the accepted positions' features (EAGLE's; slower to train); default "
        "%(default)s, the better one measured",
    )
    p.add_argument(
        "--layers", type=int, default=None, help="the token draft keeps the model's first K layers (required)"
    )
    p.add_argument(
        "--vocab", type=int, default=None, help="the draft's head scores N token ids (default all)"
    )
    p.add_argument(
        "--texts",
        type=Path,
        default=None,
        help='JSONL of {"prompt", "text"} to train on (default: the target answers synthetic prompts)',
    )
    p.add_argument(
        "--texts-file",
        type=Path,
        default=None,
        help="--kind eagle/medusa: the .npz keeping the target's answers with their features, reused "
        "when it matches, else generated there (default <target>-texts.npz beside the target's export: "
        "both kinds share it)",
    )
    p.add_argument(
        "--prompts",
        type=int,
        default=None,
        help="prompts answered without --texts: token, synthetic instructions (200); "
        "eagle/medusa, the target's own questions (2048)",
    )
    p.add_argument("--max-tokens", type=int, default=None, help="answer length per prompt (default 128)")
    p.add_argument(
        "--epochs", type=float, default=None, help="passes over the data (token 2, eagle 2, medusa 2)"
    )
    p.add_argument(
        "--train-minutes",
        type=float,
        default=None,
        help="--kind eagle: fewer passes than --epochs where they would not fit this many minutes "
        "(default 25: the default mlp draft takes about 9, the decoder 19, after about 28 of generating the "
        "texts on 2 quiet cores)",
    )
    p.add_argument(
        "--lr", type=float, default=None, help="peak learning rate (token 1e-3, eagle 2e-3, medusa 1e-3)"
    )
    p.add_argument(
        "--soft-weight",
        type=float,
        default=None,
        help="--kind eagle: the share of the token loss on the target's top-k probabilities "
        "(soft targets; default 0.5, 0: its argmax only)",
    )
    p.add_argument("--weights", default="int4", choices=WEIGHT_FORMATS)
    p.add_argument(
        "--out", type=Path, default=None, help="output folder (default SHARDS_DIR/<model>-distil<K>[-v<N>])"
    )
    p.add_argument("--force", action="store_true", help="replace an existing export")
    p.set_defaults(func=run_distil)


class _Report:
    """One line each time a phase passes another tenth, and every message that opens or closes
    one (a phase's fractions need not land on tenths: a timed training's seldom do)."""

    def __init__(self):
        self._tenth: dict[str, int] = {}

    def __call__(self, phase: str, fraction: float, message: str) -> None:
        tenth = int(fraction * 10)
        if fraction in (0.0, 1.0) or tenth > self._tenth.get(phase, 0):
            self._tenth[phase] = tenth
            print(f"[distil] {phase} {fraction:4.0%} {message}", file=sys.stderr, flush=True)


def run_distil(args: argparse.Namespace) -> int:
    from pipeshard.exporter.cli import resolve_model
    from pipeshard.exporter.distil import distil

    try:
        if not (args.target / "manifest.json").is_file():
            raise InvalidArgument("target", f"{args.target} is not a pipeshard export (no manifest.json)")
        model_dir = resolve_model(args.model)
        if args.kind == "eagle":
            return _run_eagle(args, model_dir)
        if args.kind == "medusa":
            return _run_medusa(args, model_dir)
        if args.layers is None:
            raise InvalidArgument("layers", "is required with --kind token")
        vocab = "" if args.vocab is None else f"-v{args.vocab}"
        out = args.out or paths.shards_dir() / f"{model_dir.name}-distil{args.layers}{vocab}"
        result = distil(
            model_dir,
            args.target,
            out,
            layers=args.layers,
            vocab=args.vocab,
            texts=args.texts,
            prompts=args.prompts or 200,
            max_tokens=args.max_tokens or 128,
            epochs=args.epochs or 2.0,
            lr=args.lr or 1e-3,
            report=_Report(),
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


def _texts_file(args: argparse.Namespace) -> Path:
    """--texts-file, or one file beside the target's export that every feature-reading kind shares."""
    return args.texts_file or args.target.parent / f"{args.target.name}-texts.npz"


def _run_eagle(args: argparse.Namespace, model_dir: Path) -> int:
    from pipeshard.exporter.eagle import SOFT_WEIGHT, TRAIN_MINUTES, distil_eagle
    from pipeshard.exporter.target_texts import PROMPTS

    if args.texts is not None:
        raise InvalidArgument("texts", "--kind eagle trains on the target's own answers, not on --texts")
    vocab = 8192 if args.vocab is None else args.vocab
    out = args.out or paths.shards_dir() / paths.feature_draft_name(model_dir.name, vocab)
    result = distil_eagle(
        model_dir,
        args.target,
        out,
        vocab=vocab,
        prompts=args.prompts or PROMPTS,
        max_tokens=args.max_tokens or 128,
        epochs=args.epochs or 2.0,
        lr=args.lr or 2e-3,
        force=args.force,
        texts=_texts_file(args),
        train_minutes=args.train_minutes or TRAIN_MINUTES,
        report=_Report(),
        arch=args.arch,
        soft=SOFT_WEIGHT if args.soft_weight is None else args.soft_weight,
    )
    t = result.meta.training
    verb = "reused" if result.reused else "trained"
    print(
        f"{verb} an {result.meta.kind} draft in {result.folder}: {t.get('texts')} texts, "
        f"{t.get('positions')} positions, {t.get('minutes')} minutes; held-out agreement with the target "
        f"{t.get('held_out_agreement')}, accepted of a 3-token chain {t.get('held_out_chain_of_3')}"
    )
    return 0


def _run_medusa(args: argparse.Namespace, model_dir: Path) -> int:
    from pipeshard.exporter.medusa import HEADS, distil_medusa
    from pipeshard.exporter.target_texts import PROMPTS

    if args.texts is not None:
        raise InvalidArgument("texts", "--kind medusa trains on the target's own answers, not on --texts")
    vocab = 8192 if args.vocab is None else args.vocab
    heads = args.heads or HEADS
    out = args.out or paths.shards_dir() / paths.draft_heads_name(model_dir.name, heads, vocab)
    result = distil_medusa(
        model_dir,
        args.target,
        out,
        heads=heads,
        vocab=vocab,
        texts=_texts_file(args),
        prompts=args.prompts or PROMPTS,
        max_tokens=args.max_tokens or 128,
        epochs=args.epochs or 2.0,
        lr=args.lr or 1e-3,
        force=args.force,
        report=_Report(),
    )
    t = result.meta.training
    verb = "reused" if result.reused else "trained"
    accuracy = ", ".join(
        f"head {i + 1} {a['top1']:.3f}/{a['top3']:.3f}" for i, a in enumerate(t.get("held_out", []))
    )
    print(
        f"{verb} {result.meta.heads} medusa heads in {result.folder}: {t.get('texts')} texts, "
        f"{t.get('train_positions')} training positions, {t.get('minutes')} minutes; held-out top-1/top-3 "
        f"{accuracy}, a chain of all heads "
        f"{t.get('held_out_chain_tokens_per_traversal')} tokens per traversal; "
        f"serve them with `pipeshard stage --draft-heads {result.folder}` on the final stage"
    )
    return 0
