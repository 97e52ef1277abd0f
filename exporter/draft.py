"""Draft models for speculative decoding.

A self-draft is the target's first k layers + its final norm + its LM head, exported as one
stateful stage with the same ports as any last stage (so ``ShardRunner(out, 0)`` runs it). With
``vocab=N`` the LM head keeps only N rows (token ids ranked by BPE merge order, special tokens
always in): the head then costs N/vocab of the full one. The ids are stored as an int64 .npy in
the stage folder (checksummed like the IR) and named by the manifest's ``draft`` entry; the
runtime maps a logit column back to its token id with ``ShardRunner.vocab_ids``.

A draft can also be any same-tokenizer Hugging Face model: ``ensure_draft_export`` exports it
once into a cache folder, and ``check_same_tokenizer`` refuses a pair whose token ids differ.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pipeshard.errors import InvalidArgument, NotFound
from pipeshard.exporter.export import ExportResult, ProgressFn, _eos_ids, export_model
from pipeshard.exporter.families import load_config, resolve_spec
from pipeshard.exporter.weights import weight_files
from pipeshard.shard.manifest import load_manifest, model_fingerprint

VOCAB_FILE = "draft_vocab_ids.npy"


@dataclass(frozen=True)
class DraftPlan:
    """What makes an export a draft: how many of the source's layers, and which head rows."""

    layers: int
    source_layers: int
    vocab_ids: tuple[int, ...] | None = None

    def write(self, export_dir: Path, stage_folder: str) -> dict[str, Any]:
        """Save the vocabulary ids into the stage folder; returns the manifest's ``draft`` entry."""
        rel = None
        if self.vocab_ids is not None:
            rel = f"{stage_folder}/{VOCAB_FILE}"
            np.save(Path(export_dir) / rel, np.asarray(self.vocab_ids, dtype=np.int64))
        return {"layers": self.layers, "vocab_ids": rel, "source_layers": self.source_layers}


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


def plan_draft(model_dir: Path | str, layers: int, vocab: int | None = None) -> DraftPlan:
    """Validate a draft request against the source model; pick the vocabulary slice."""
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
    ranked = [int(i) for i in merge_rank(model_dir, spec.vocab_size) if int(i) not in specials]
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
    if (source / "manifest.json").is_file():
        n = load_manifest(source)["num_stages"]
        if n != 1:
            raise InvalidArgument("speculative", f"{source} is a {n}-stage export; a draft must be one stage")
        return source
    if not (source / "config.json").is_file():
        raise InvalidArgument(
            "speculative",
            f"{source} holds neither a pipeshard export (manifest.json) nor a Hugging Face model "
            "(config.json)",
        )
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


def _token_ids(export_dir: Path) -> dict[str, int]:
    """token -> id of an export's tokenizer (vocabulary and added tokens)."""
    path = export_dir / "tokenizer.json"
    if path.is_file():
        data = json.loads(path.read_text())
        ids = dict(data.get("model", {}).get("vocab", {}))
        ids.update({t["content"]: t["id"] for t in data.get("added_tokens", [])})
        return ids
    if (export_dir / "vocab.json").is_file():
        return json.loads((export_dir / "vocab.json").read_text())
    raise InvalidArgument("speculative", f"{export_dir} has no tokenizer.json or vocab.json to compare")


def check_same_tokenizer(target_export: Path | str, draft_export: Path | str) -> None:
    """Refuse a draft whose token ids mean something else than the target's.

    The draft reads and proposes token ids, so what must agree is the id space (vocab size) and
    the id -> token mapping; merges or normaliser details only matter to the target, which alone
    tokenizes text.
    """
    target, draft = Path(target_export), Path(draft_export)
    try:
        sizes = [load_manifest(p)["model"]["vocab_size"] for p in (target, draft)]
    except NotFound as exc:
        raise InvalidArgument("speculative", str(exc)) from None
    if sizes[0] != sizes[1]:
        raise InvalidArgument(
            "speculative", f"draft {draft} has vocab size {sizes[1]}, the target {target} has {sizes[0]}"
        )
    a, b = _token_ids(target), _token_ids(draft)
    if a != b:
        diff = sorted(set(a.items()) ^ set(b.items()), key=lambda kv: kv[1])[:3]
        raise InvalidArgument(
            "speculative",
            f"draft {draft} has a different tokenizer than the target {target} "
            f"({len(a)} vs {len(b)} tokens; e.g. {diff})",
        )
