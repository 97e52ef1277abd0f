"""Draft models for speculative decoding.

A self-draft is the target's first k layers + its final norm + its LM head, exported as one
stateful stage with the same ports as any last stage (so ``ShardRunner(out, 0)`` runs it). With
``vocab=N`` the LM head keeps only N rows (token ids ranked by BPE merge order, special tokens
always in): the head then costs N/vocab of the full one. The ids are stored as an int64 .npy in
the stage folder (checksummed like the IR) and named by the manifest's ``draft`` entry; the
runtime maps a logit column back to its token id with ``ShardRunner.vocab_ids``.

A draft can also be any same-tokenizer Hugging Face model: ``ensure_draft_export`` exports it
once into a cache folder (serving processes run it as ``python -m pipeshard.exporter.draft``
through ``pipeshard.shard.drafts.resolve_draft``), and ``pipeshard.shard.drafts.check_same_tokenizer``
refuses a pair whose token ids differ.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pipeshard.errors import InvalidArgument, PipeshardError
from pipeshard.exporter.export import ExportResult, ProgressFn, _eos_ids, export_model
from pipeshard.exporter.families import load_config, resolve_spec
from pipeshard.exporter.weights import weight_files
from pipeshard.shard.drafts import existing_draft_export
from pipeshard.shard.manifest import DraftInfo, model_fingerprint

VOCAB_FILE = "draft_vocab_ids.npy"


@dataclass(frozen=True)
class DraftPlan:
    """What makes an export a draft: how many of the source's layers, and which head rows."""

    layers: int
    source_layers: int
    vocab_ids: tuple[int, ...] | None = None

    def write(self, export_dir: Path, stage_folder: str) -> DraftInfo:
        """Save the vocabulary ids into the stage folder; returns the manifest's ``draft`` entry."""
        rel = None
        if self.vocab_ids is not None:
            rel = f"{stage_folder}/{VOCAB_FILE}"
            np.save(Path(export_dir) / rel, np.asarray(self.vocab_ids, dtype=np.int64))
        return DraftInfo(self.layers, rel, self.source_layers)


def merge_rank(model_dir: Path, vocab_size: int) -> np.ndarray:
    """Token ids, most frequent first as far as the tokenizer tells without a corpus.

    A BPE tokenizer learns its merges most frequent pair first, so the merge that creates a
    token ranks it: base alphabet first (in id order), then merge products in merge order. Ids
    the tokenizer does not rank (no tokenizer.json, padding rows) follow in id order.
    """
    rank = np.arange(vocab_size, dtype=np.float64) + 1e9  # unranked: after everything, in id order
    path = Path(model_dir) / "tokenizer.json"
    model = json.loads(path.read_text()).get("model", {}) if path.is_file() else {}
    if model.get("type") == "BPE":
        vocab = model["vocab"]
        merged = {}
        for i, pair in enumerate(model.get("merges", [])):
            a, b = pair.split(" ", 1) if isinstance(pair, str) else pair
            merged.setdefault(a + b, i)
        for token, tid in vocab.items():
            if tid < vocab_size:
                rank[tid] = merged.get(token, -1.0)
    return np.argsort(rank, kind="stable")


def special_ids(model_dir: Path, config: dict[str, Any], vocab_size: int) -> set[int]:
    """Ids a vocabulary slice must keep: eos ids and the tokenizer's special added tokens."""
    ids = set(_eos_ids(Path(model_dir), config))
    path = Path(model_dir) / "tokenizer.json"
    if path.is_file():
        ids |= {t["id"] for t in json.loads(path.read_text()).get("added_tokens", []) if t.get("special")}
    return {i for i in ids if 0 <= i < vocab_size}


def plan_draft(
    model_dir: Path | str, layers: int, vocab: int | None = None, counts: np.ndarray | None = None
) -> DraftPlan:
    """Validate a draft request against the source model; pick the vocabulary slice: the special
    tokens, then the ids ``counts`` (per token id) saw most, then the rest in merge order. A
    draft trained on the target's texts counts the target's own argmax there: merge order alone
    left 11% of the target's answer tokens on the benchmark prompts outside an 8192-row slice,
    counts over its answers to its own questions 3.8%."""
    model_dir = Path(model_dir)
    config = load_config(model_dir)
    spec = resolve_spec(config)
    n = spec.num_layers
    if isinstance(layers, bool) or not isinstance(layers, int) or not 1 <= layers < n:
        raise InvalidArgument("draft_layers", f"must be an integer in [1, {n - 1}] for this {n}-layer model")
    if vocab is None:
        return DraftPlan(layers, n)
    specials = special_ids(model_dir, config, spec.vocab_size)
    if isinstance(vocab, bool) or not isinstance(vocab, int) or not len(specials) <= vocab <= spec.vocab_size:
        raise InvalidArgument(
            "draft_vocab",
            f"must be an integer in [{len(specials)}, {spec.vocab_size}] (the special tokens up to the "
            f"vocabulary size), got {vocab!r}",
        )
    order = merge_rank(model_dir, spec.vocab_size)
    if counts is not None:
        order = order[np.argsort(-np.asarray(counts)[order], kind="stable")]
    ranked = [int(i) for i in order if int(i) not in specials]
    ids = sorted(specials | set(ranked[: vocab - len(specials)]))
    return DraftPlan(layers, n, tuple(ids))


def export_draft(
    model_dir: Path | str,
    out_dir: Path | str,
    *,
    layers: int,
    vocab: int | None = None,
    weights: str = "int4",
    **options: Any,
) -> ExportResult:
    """Export the first ``layers`` layers + final norm + LM head (optionally ``vocab`` rows of it)
    as a one-stage draft; ``options`` are export_model's (group_size, force, progress, ...)."""
    plan = plan_draft(model_dir, layers, vocab)
    return export_model(model_dir, out_dir, stages=1, weights=weights, draft=plan, **options)


def ensure_draft_export(
    source: Path | str,
    cache_root: Path | str,
    weights: str = "int4",
    *,
    progress: ProgressFn | None = None,
    isolate: bool = True,
) -> Path:
    """An export to draft with: ``source`` itself if it is a one-stage export, else the one-stage
    export of the Hugging Face folder ``source``, made once under ``cache_root`` and reused (the
    folder name carries a hash of config and weights, so a changed model is exported again)."""
    source = Path(source)
    if (export := existing_draft_export(source)) is not None:
        return export
    try:
        digest = model_fingerprint(source / "config.json", weight_files(source)).split(":")[1][:12]
        out = Path(cache_root) / f"{source.name}-{digest}-{weights}"
        if not (out / "manifest.json").is_file():
            export_model(
                source,
                out,
                stages=1,
                weights=weights,
                force=out.exists(),
                model_name=source.name,
                progress=progress,
                isolate=isolate,
            )
    except InvalidArgument as exc:  # the draft is what the caller named in `speculative`
        raise InvalidArgument("speculative", f"cannot export {source} as a draft: {exc}") from None
    return out


def main(argv: list[str] | None = None) -> int:
    """``python -m pipeshard.exporter.draft SOURCE CACHE_ROOT [--weights W]``: ensure_draft_export in
    its own process, for a serving process that must not import the exporter; prints the export."""
    import argparse
    import sys

    parser = argparse.ArgumentParser(prog="python -m pipeshard.exporter.draft", description=main.__doc__)
    parser.add_argument("source", type=Path)
    parser.add_argument("cache_root", type=Path)
    parser.add_argument("--weights", default="int4")
    args = parser.parse_args(argv)
    try:
        print(ensure_draft_export(args.source, args.cache_root, args.weights))
    except PipeshardError as exc:
        print(exc, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
