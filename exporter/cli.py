"""``pipeshard export``: a Hugging Face model folder -> N per-stage OpenVINO shards + manifest.

Every flag can also be set by an environment variable ``PIPESHARD_EXPORT_<FLAG>`` (for example
``PIPESHARD_EXPORT_WEIGHTS=int8``); a flag on the command line wins.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from pipeshard import paths
from pipeshard.errors import InvalidArgument, PipeshardError
from pipeshard.shard.manifest import WEIGHT_FORMATS, StaticLayout
from pipeshard.sizes import parse_bytes

ENV_PREFIX = "PIPESHARD_EXPORT_"


def _env(name: str, default=None):
    return os.environ.get(ENV_PREFIX + name.upper().replace("-", "_"), default)


def _env_flag(name: str) -> bool:
    return str(_env(name, "")).lower() in ("1", "true", "yes", "on")


def _int_or_none(value):
    return None if value in (None, "") else int(value)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "export",
        help="export a model into per-stage OpenVINO shards",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--model",
        default=_env("model", paths.DEFAULT_MODEL),
        help="a Hugging Face model folder, or a name under the models dir (default %(default)s)",
    )
    split = p.add_mutually_exclusive_group()
    split.add_argument(
        "--stages", type=int, default=_int_or_none(_env("stages")), help="number of stages (even split)"
    )
    split.add_argument(
        "--split",
        default=_env("split"),
        help="layers per stage (10,10,10) or layer ranges (0:12,12:20,20:30)",
    )
    split.add_argument(
        "--plan",
        type=Path,
        default=_env("plan"),
        help="a plan.yaml of `pipeshard plan`: export its layer ranges",
    )
    p.add_argument(
        "--draft-layers",
        type=int,
        default=_int_or_none(_env("draft_layers")),
        help="export a one-stage speculative draft: the first K layers + final norm + LM head",
    )
    p.add_argument(
        "--draft-vocab",
        type=int,
        default=_int_or_none(_env("draft_vocab")),
        help="the draft's LM head scores only N token ids (BPE merge order, special tokens always in)",
    )
    p.add_argument("--weights", default=_env("weights", "int4"), choices=WEIGHT_FORMATS)
    p.add_argument(
        "--group-size",
        default=_env("group_size", "auto"),
        help="int4 group size: auto (largest of 128/64/32 dividing every input dim) or a number",
    )
    p.add_argument(
        "--head-precision",
        default=_env("head_precision", "int8"),
        choices=("int8", "int4", "fp16", "fp32"),
        help="embedding and LM head precision with int4/int8 weights (default int8, as optimum-intel)",
    )
    p.add_argument(
        "--int8-sym",
        action="store_true",
        default=_env_flag("int8_sym"),
        help="INT8 symmetric instead of asymmetric (int8 weights, and int8 embeddings/LM head)",
    )
    p.add_argument(
        "--max-context",
        type=int,
        default=_int_or_none(_env("max_context")),
        help="longest sequence the shards serve (default min(max_position_embeddings, 4096))",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=_env("out"),
        help="output folder (default SHARDS_DIR/<model>-<N>s-<weights>, "
        "for a draft SHARDS_DIR/<model>-draft<K>[-v<N>]-<weights>)",
    )
    p.add_argument(
        "--no-beam-idx",
        action="store_true",
        default=_env_flag("no_beam_idx"),
        help="do not add the beam_idx Gather in front of the KV state (benchmark config B0)",
    )
    p.add_argument(
        "--static",
        action="store_true",
        default=_env_flag("static"),
        help="stateless static-shape stages (KV cache as inputs and outputs, fixed [slots, chunk] rows): "
        "what an NPU compiles; stages take their backend from the manifest",
    )
    p.add_argument(
        "--slots",
        type=int,
        default=_int_or_none(_env("slots")) or 4,
        help="--static: sequences one inference holds (continuous batching up to this many)",
    )
    p.add_argument(
        "--chunk",
        type=int,
        default=_int_or_none(_env("chunk")) or 16,
        help="--static: tokens per slot and inference (prefill chunk; a verify row fits in it)",
    )
    p.add_argument(
        "--max-stage-memory",
        default=_env("max_stage_memory"),
        help="refuse a split with a stage whose estimated export peak is over this size (6G, 512M, bytes)",
    )
    p.add_argument(
        "--force", action="store_true", default=_env_flag("force"), help="replace an existing export"
    )
    p.add_argument(
        "--in-process",
        action="store_true",
        default=_env_flag("in_process"),
        help="export stages in this process (no per-stage subprocess; peak RSS is then the process's)",
    )
    p.add_argument(
        "--no-ov-tokenizer",
        action="store_true",
        default=_env_flag("no_ov_tokenizer"),
        help="do not convert an openvino-tokenizers tokenizer/detokenizer pair",
    )
    p.set_defaults(func=run_export)


def resolve_model(spec: str) -> Path:
    from pipeshard.model.fetch import resolve_model_source

    return resolve_model_source(spec)


def run_export(args: argparse.Namespace) -> int:
    from pipeshard.exporter.draft import export_draft
    from pipeshard.exporter.export import export_model, resolve_split
    from pipeshard.exporter.families import load_config, resolve_spec
    from pipeshard.exporter.progress import ProgressPrinter

    try:
        model_dir = resolve_model(args.model)
        if args.draft_layers is not None:
            if args.static:
                raise InvalidArgument("static", "does not apply to a draft (a draft is exported stateful)")
            if args.stages not in (None, 1) or args.split is not None or args.plan is not None:
                raise InvalidArgument("stages", "does not apply to a draft (a draft is one stage)")
            name = paths.draft_export_name(model_dir.name, args.draft_layers, args.draft_vocab, args.weights)
        elif args.draft_vocab is not None:
            raise InvalidArgument("draft_vocab", "needs --draft-layers")
        elif args.static and args.draft_layers is None and args.max_context is None:
            raise InvalidArgument("max_context", "is required with --static (the KV inputs' fixed length)")
        elif args.stages is None and args.split is None and args.plan is None:
            raise InvalidArgument("stages", "is required (or give --split or --plan)")
        else:
            spec = resolve_spec(load_config(model_dir))
            if args.plan is not None:
                args.split = _plan_split(args.plan, spec.num_layers)
            layers = resolve_split(spec.num_layers, args.stages, args.split)
            name = paths.export_name(model_dir.name, len(layers), args.weights)
            if args.static:
                name += f"-static{args.slots}x{args.chunk}"
        group = args.group_size if args.group_size in (None, "auto") else _parse_group(args.group_size)
        out = args.out or paths.shards_dir() / name
        options = dict(
            weights=args.weights,
            group_size=group,
            head_precision=args.head_precision,
            int8_sym=args.int8_sym,
            max_context=args.max_context,
            beam_idx=not args.no_beam_idx,
            force=args.force,
            model_name=model_dir.name,
            isolate=not args.in_process,
            convert_tokenizer=not args.no_ov_tokenizer,
        )
        budget = (
            None if args.max_stage_memory is None else parse_bytes(args.max_stage_memory, "max_stage_memory")
        )
        printer = ProgressPrinter()
        try:
            if args.draft_layers is not None:
                result = export_draft(
                    model_dir,
                    out,
                    layers=args.draft_layers,
                    vocab=args.draft_vocab,
                    progress=printer,
                    **options,
                )
            else:
                static = StaticLayout(args.slots, args.chunk) if args.static else None
                result = export_model(
                    model_dir,
                    out,
                    split=layers,
                    progress=printer,
                    max_stage_memory=budget,
                    static=static,
                    **options,
                )
        finally:
            printer.close()
    except PipeshardError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, InvalidArgument) else 1
    m = result.manifest
    for stage in m.stages:
        e = stage.export
        print(
            f"stage {stage.index}: layers {stage.layer_start}..{stage.layer_end - 1}, "
            f"{e.seconds:.1f} s, peak RSS {e.peak_rss_bytes / 2**20:.0f} MiB ({e.rss_scope})"
        )
    kind = f"draft of {m.draft.layers} layers" if m.draft else f"{m.num_stages} stages"
    if m.static is not None:
        kind += f", static {m.static.slots} slots x {m.static.chunk} rows"
    print(
        f"exported {m.model.name} to {result.path}: {kind}, {m.weights.format}"
        + (f" (group {m.weights.group_size})" if m.weights.group_size else "")
        + f", max_context {m.max_context}, {result.seconds:.1f} s"
    )
    return 0


def _plan_split(path: Path, num_layers: int) -> str:
    """The layer ranges of a plan file, checked against the model being exported."""
    from pipeshard.planning.plan import Plan

    plan = Plan.load(path)
    if plan.num_layers != num_layers:
        raise InvalidArgument(
            "plan", f"{path} places {plan.num_layers} layers, but the model has {num_layers}"
        )
    return plan.ranges


def _parse_group(value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise InvalidArgument("group_size", f"must be 'auto' or a positive integer, got {value!r}") from None
