"""manifest.json: what an export holds, and the checks a stage runs before trusting its shard.

Top-level keys (``format_version`` 1):

- ``format`` ("pipeshard-shards"), ``format_version``, ``exporter_version``, ``created_at``, ``name``;
- ``model``: ``name``, ``source`` (folder exported from), ``fingerprint`` ("sha256:..." over
  config.json and every weight file), and the resolved spec (``family``, ``model_type``,
  ``num_layers``, ``hidden_size``, ``num_heads``, ``num_kv_heads``, ``head_dim``, ``vocab_size``,
  ``rope_theta``, ``rms_eps``, ``tie_word_embeddings``, ...), ``eos_token_ids``;
- ``export_id``: "sha256:..." over the sorted (path, sha256) list of every exported file, so two
  exports with equal ids hold byte-identical shards (the key for KV capture compatibility);
- ``num_stages``, ``split`` (layers per stage), ``max_context``, ``beam_idx`` (bool);
- ``weights``: ``format`` (int4|int8|fp16|fp32), ``group_size``, ``mode``, ``embedding_and_lm_head``;
- ``stages``: one object per stage: ``index``, ``layer_start``, ``layer_end`` (exclusive),
  ``folder``, ``model`` (the .xml path), ``inputs`` / ``outputs`` (each ``name``, ``shape`` with
  -1 for dynamic dims, ``dtype``), ``state_variables``, ``export`` (``seconds``,
  ``peak_rss_bytes``, ``rss_scope`` "subprocess" or "process");
- ``tokenizer``: ``files`` copied, ``chat_template`` (bool), ``openvino_tokenizer`` /
  ``openvino_detokenizer`` (file names or null) and ``error`` when conversion failed;
- ``files``: relative path -> {``sha256``, ``size``} for every file of the export except the
  manifest itself;
- ``draft`` (drafts only): ``layers``, ``vocab_ids`` (path of the int64 .npy of the LM head's
  token ids, or null for the full vocabulary), ``source_layers``.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeshard.errors import FailedPrecondition, InvalidArgument, NotFound

MANIFEST = "manifest.json"
FORMAT = "pipeshard-shards"
FORMAT_VERSION = 1
WEIGHT_FORMATS = ("int4", "int8", "fp16", "fp32")


def input_port(is_first: bool) -> str:
    """The first stage reads token ids, every later stage the previous stage's hidden states."""
    return "input_ids" if is_first else "hidden_states"


def file_sha256(path: Path, chunk: int = 4 << 20) -> str:
    digest = hashlib.sha256()
    with Path(path).open("rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def model_fingerprint(config_path: Path, weight_paths: list[Path]) -> str:
    """sha256 over config.json and the weight files (each named, in order)."""
    digest = hashlib.sha256()
    for path in [Path(config_path), *map(Path, weight_paths)]:
        digest.update(f"{path.name}:{file_sha256(path)}\n".encode())
    return "sha256:" + digest.hexdigest()


def file_records(root: Path) -> dict[str, dict[str, Any]]:
    """sha256 and size of every file under ``root`` except the manifest, keyed by relative path."""
    root = Path(root)
    records = {}
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        rel = path.relative_to(root).as_posix()
        if rel == MANIFEST:
            continue
        records[rel] = {"sha256": file_sha256(path), "size": path.stat().st_size}
    return records


def export_id(files: dict[str, dict[str, Any]]) -> str:
    digest = hashlib.sha256()
    for rel in sorted(files):
        digest.update(f"{rel}:{files[rel]['sha256']}\n".encode())
    return "sha256:" + digest.hexdigest()


def write_manifest(root: Path, manifest: dict[str, Any]) -> Path:
    path = Path(root) / MANIFEST
    path.write_text(json.dumps(manifest, indent=2, sort_keys=False) + "\n")
    return path


@dataclass(frozen=True)
class FileRecord:
    sha256: str
    size: int


@dataclass(frozen=True)
class ExportStats:
    """How exporting one stage went (for reports; nothing at serving time reads it)."""

    seconds: float
    peak_rss_bytes: int
    rss_scope: str  # "subprocess" or "process"


@dataclass(frozen=True)
class StageEntry:
    """One stage of an export, as the manifest lists it."""

    index: int
    layer_start: int
    layer_end: int  # exclusive
    folder: str
    model: str  # the .xml path, relative to the export folder
    state_variables: tuple[str, ...]
    export: ExportStats

    @property
    def input_name(self) -> str:
        return input_port(self.index == 0)


@dataclass(frozen=True)
class ModelInfo:
    name: str
    fingerprint: str
    hidden_size: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    num_kv_heads: int  # with head_dim, what one cached position of one layer holds
    head_dim: int


@dataclass(frozen=True)
class WeightsInfo:
    format: str  # int4|int8|fp16|fp32
    group_size: int | None


@dataclass(frozen=True)
class DraftInfo:
    layers: int
    vocab_ids: str | None  # the .npy of the LM head's token ids; None = the full vocabulary


@dataclass(frozen=True)
class Manifest:
    """A validated manifest.json; ``raw`` is the JSON as written (for printing and forwarding)."""

    export_dir: Path
    num_stages: int
    max_context: int
    model: ModelInfo
    weights: WeightsInfo
    stages: tuple[StageEntry, ...]
    files: Mapping[str, FileRecord]
    draft: DraftInfo | None
    export_id: str  # "" in exports written before it existed
    raw: Mapping[str, Any]

    @classmethod
    def from_dict(cls, export_dir: Path, raw: Mapping[str, Any]) -> Manifest:
        """Typed view of a manifest dict; a missing or mistyped key is a FailedPrecondition."""
        where = Path(export_dir) / MANIFEST
        try:
            model = raw["model"]
            draft = raw.get("draft")
            return cls(
                export_dir=Path(export_dir),
                num_stages=int(raw["num_stages"]),
                max_context=int(raw["max_context"]),
                model=ModelInfo(
                    name=str(model.get("name", "")),
                    fingerprint=str(model["fingerprint"]),
                    hidden_size=int(model["hidden_size"]),
                    vocab_size=int(model["vocab_size"]),
                    eos_token_ids=tuple(int(i) for i in model.get("eos_token_ids", ())),
                    num_kv_heads=int(model["num_kv_heads"]),
                    head_dim=int(model["head_dim"]),
                ),
                weights=WeightsInfo(str(raw["weights"]["format"]), raw["weights"].get("group_size")),
                stages=tuple(
                    StageEntry(
                        index=int(s["index"]),
                        layer_start=int(s["layer_start"]),
                        layer_end=int(s["layer_end"]),
                        folder=str(s["folder"]),
                        model=str(s["model"]),
                        state_variables=tuple(s["state_variables"]),
                        export=ExportStats(
                            float(s["export"]["seconds"]),
                            int(s["export"]["peak_rss_bytes"]),
                            str(s["export"]["rss_scope"]),
                        ),
                    )
                    for s in raw["stages"]
                ),
                files={rel: FileRecord(str(r["sha256"]), int(r["size"])) for rel, r in raw["files"].items()},
                draft=DraftInfo(int(draft["layers"]), draft.get("vocab_ids")) if draft else None,
                export_id=str(raw.get("export_id", "")),
                raw=raw,
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise FailedPrecondition(f"{where} is malformed: {type(exc).__name__} {exc}") from None

    def stage(self, stage: int) -> StageEntry:
        n = self.num_stages
        if not isinstance(stage, int) or not 0 <= stage < n:
            raise InvalidArgument("stage", f"must be in [0, {n}) for this {n}-stage export, got {stage!r}")
        return self.stages[stage]

    def stage_files(self, stage: int) -> list[str]:
        folder = self.stage(stage).folder.rstrip("/") + "/"
        return sorted(rel for rel in self.files if rel.startswith(folder))

    def files_for_stage(self, stage: int) -> list[str]:
        """What one stage needs: the manifest, the shared root files (config, tokenizer), its folder."""
        stage_folders = tuple(s.folder.rstrip("/") + "/" for s in self.stages)
        shared = [rel for rel in self.files if not rel.startswith(stage_folders)]
        return [MANIFEST, *sorted(shared), *self.stage_files(stage)]


def load_manifest(export_dir: Path) -> Manifest:
    """Read and sanity-check an export's manifest."""
    export_dir = Path(export_dir)
    path = export_dir / MANIFEST
    if not path.is_file():
        raise NotFound(f"no {MANIFEST} in {export_dir}: not a pipeshard export (or an unfinished one)")
    try:
        raw = json.loads(path.read_text())
    except ValueError as exc:
        raise FailedPrecondition(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        got = raw.get("format") if isinstance(raw, dict) else type(raw).__name__
        raise FailedPrecondition(f"{path} is not a {FORMAT} manifest (format={got!r})")
    if raw.get("format_version") != FORMAT_VERSION:
        raise FailedPrecondition(
            f"{path} has format_version {raw.get('format_version')}, this build reads {FORMAT_VERSION}"
        )
    if len(raw.get("stages", ())) != raw.get("num_stages"):
        raise FailedPrecondition(f"{path} lists {len(raw.get('stages', ()))} stages, expected num_stages")
    return Manifest.from_dict(export_dir, raw)


def _check_files(export_dir: Path, manifest: Manifest, rels: list[str], hashes: bool, what: str) -> None:
    for rel in rels:
        record = manifest.files.get(rel)
        path = export_dir / rel
        if record is None:
            raise FailedPrecondition(f"{what}: {rel} is not listed in the manifest of {export_dir}")
        if not path.is_file():
            raise FailedPrecondition(f"{what}: {rel} is missing from {export_dir}; re-export or re-fetch it")
        size = path.stat().st_size
        if size != record.size:
            raise FailedPrecondition(
                f"{what}: {rel} has {size} bytes, the manifest says {record.size}; "
                "the shard is damaged or from another export"
            )
        if hashes:
            digest = file_sha256(path)
            if digest != record.sha256:
                raise FailedPrecondition(
                    f"{what}: {rel} has sha256 {digest[:16]}..., "
                    f"the manifest says {record.sha256[:16]}...; "
                    "the shard is damaged or from another export"
                )


def verify_shard(export_dir: Path, stage: int, hashes: bool = True) -> Manifest:
    """Check one stage's files against the manifest (size, and sha256 unless ``hashes`` is off).

    Returns the manifest; raises FailedPrecondition naming the first file that does not match.
    """
    export_dir = Path(export_dir)
    manifest = load_manifest(export_dir)
    rels = manifest.stage_files(stage)
    entry = manifest.stages[stage]
    if entry.model not in rels:
        raise FailedPrecondition(
            f"stage {stage}: {entry.model} is not listed in the manifest of {export_dir}"
        )
    _check_files(export_dir, manifest, rels, hashes, f"stage {stage}")
    return manifest


def verify_export(export_dir: Path, hashes: bool = True) -> Manifest:
    """Check every file of an export against its manifest."""
    export_dir = Path(export_dir)
    manifest = load_manifest(export_dir)
    _check_files(export_dir, manifest, sorted(manifest.files), hashes, "export")
    return manifest
