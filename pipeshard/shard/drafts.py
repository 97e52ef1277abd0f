"""Draft exports as the serving side sees them: which folder to draft with, and whether its token
ids mean what the target's mean.

A Hugging Face folder named as a draft is exported on first use by the exporter, in its own
process (``python -m pipeshard.exporter.draft``): serving code never imports the exporter.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from pipeshard.errors import InvalidArgument, NotFound
from pipeshard.shard.manifest import MANIFEST, load_manifest


def existing_draft_export(source: Path) -> Path | None:
    """``source`` when it is a one-stage export, None when it is a Hugging Face folder to export;
    anything else is an InvalidArgument on `speculative`."""
    source = Path(source)
    if (source / MANIFEST).is_file():
        n = load_manifest(source).num_stages
        if n != 1:
            raise InvalidArgument("speculative", f"{source} is a {n}-stage export; a draft must be one stage")
        return source
    if not (source / "config.json").is_file():
        raise InvalidArgument(
            "speculative",
            f"{source} holds neither a pipeshard export (manifest.json) nor a Hugging Face model "
            "(config.json)",
        )
    return None


def resolve_draft(source: Path, cache_root: Path, weights: str = "int4") -> Path:
    """The export to draft with: ``source`` itself, or its one-stage export under ``cache_root``
    (made once by the exporter in a subprocess, reused afterwards)."""
    if (export := existing_draft_export(source)) is not None:
        return export
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pipeshard.exporter.draft",
            str(source),
            str(cache_root),
            "--weights",
            weights,
        ],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines() or [f"exit status {done.returncode}"]
        raise InvalidArgument("speculative", f"exporting the draft {source} failed: {lines[-1]}")
    return Path(done.stdout.strip().splitlines()[-1])


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
        sizes = [load_manifest(p).model.vocab_size for p in (target, draft)]
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
