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
from enum import StrEnum
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


def file_records(root: Path) -> dict[str, FileRecord]:
    """sha256 and size of every file under ``root`` except the manifest, keyed by relative path."""
    root = Path(root)
    records = {}
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        rel = path.relative_to(root).as_posix()
        if rel == MANIFEST:
            continue
        records[rel] = FileRecord(file_sha256(path), path.stat().st_size)
    return records


def export_id(files: Mapping[str, FileRecord]) -> str:
    digest = hashlib.sha256()
    for rel in sorted(files):
        digest.update(f"{rel}:{files[rel].sha256}\n".encode())
    return "sha256:" + digest.hexdigest()


def write_manifest(root: Path, manifest: Manifest) -> Path:
    path = Path(root) / MANIFEST
    path.write_text(json.dumps(manifest.to_dict(), indent=2, sort_keys=False) + "\n")
    return path


@dataclass(frozen=True)
class FileRecord:
    sha256: str
    size: int

    def to_dict(self) -> dict[str, Any]:
        return {"sha256": self.sha256, "size": self.size}


@dataclass(frozen=True)
class ExportStats:
    """How exporting one stage went (for reports; nothing at serving time reads it)."""

    seconds: float
    peak_rss_bytes: int
    rss_scope: str  # "subprocess" or "process"

    def to_dict(self) -> dict[str, Any]:
        return {"seconds": self.seconds, "peak_rss_bytes": self.peak_rss_bytes, "rss_scope": self.rss_scope}


@dataclass(frozen=True)
class PortInfo:
    """One input or output of a stage model: -1 marks a dynamic dimension."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> PortInfo:
        return cls(str(raw["name"]), tuple(int(d) for d in raw["shape"]), str(raw["dtype"]))

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "shape": list(self.shape), "dtype": self.dtype}


@dataclass(frozen=True)
class KvReorder:
    """The exporter's check that every cache variable is reordered by beam_idx."""

    read_values: int
    beam_idx_gathers: int

    def to_dict(self) -> dict[str, Any]:
        return {"read_values": self.read_values, "beam_idx_gathers": self.beam_idx_gathers}


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
    inputs: tuple[PortInfo, ...] = ()
    outputs: tuple[PortInfo, ...] = ()
    kv_reorder: KvReorder | None = None
    # A static export's [slots, 1] twin of ``model`` (same weights and KV inputs) that single-token
    # steps run instead of the [slots, chunk] one; "" when the export has none (chunk 1, stateful).
    decode_model: str = ""

    @property
    def input_name(self) -> str:
        return input_port(self.index == 0)

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> StageEntry:
        reorder = raw.get("kv_reorder")
        return cls(
            index=int(raw["index"]),
            layer_start=int(raw["layer_start"]),
            layer_end=int(raw["layer_end"]),
            folder=str(raw["folder"]),
            model=str(raw["model"]),
            state_variables=tuple(raw["state_variables"]),
            export=ExportStats(
                float(raw["export"]["seconds"]),
                int(raw["export"]["peak_rss_bytes"]),
                str(raw["export"]["rss_scope"]),
            ),
            inputs=tuple(PortInfo.from_dict(p) for p in raw.get("inputs", ())),
            outputs=tuple(PortInfo.from_dict(p) for p in raw.get("outputs", ())),
            kv_reorder=None
            if reorder is None
            else KvReorder(int(reorder["read_values"]), int(reorder["beam_idx_gathers"])),
            decode_model=str(raw.get("decode_model", "")),
        )

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "index": self.index,
            "layer_start": self.layer_start,
            "layer_end": self.layer_end,
            "folder": self.folder,
            "model": self.model,
            **({"decode_model": self.decode_model} if self.decode_model else {}),
            "inputs": [p.to_dict() for p in self.inputs],
            "outputs": [p.to_dict() for p in self.outputs],
            "state_variables": list(self.state_variables),
        }
        if self.kv_reorder is not None:
            out["kv_reorder"] = self.kv_reorder.to_dict()
        out["export"] = self.export.to_dict()
        return out


@dataclass(frozen=True)
class ModelInfo:
    """The exported model: where it came from and its architecture as the exporter resolved it.

    ``spec`` is the architecture record the exporter's model family wrote (``family``,
    ``num_layers``, ``hidden_size``, ...); the serving side reads it through the properties."""

    name: str
    source: str  # the folder exported from
    fingerprint: str
    spec: Mapping[str, Any]
    eos_token_ids: tuple[int, ...]

    @property
    def num_layers(self) -> int:
        return int(self.spec["num_layers"])

    @property
    def hidden_size(self) -> int:
        return int(self.spec["hidden_size"])

    @property
    def vocab_size(self) -> int:
        return int(self.spec["vocab_size"])

    @property
    def num_kv_heads(self) -> int:  # with head_dim, what one cached position of one layer holds
        return int(self.spec["num_kv_heads"])

    @property
    def head_dim(self) -> int:
        return int(self.spec["head_dim"])

    @property
    def synthetic(self) -> bool:  # random weights of a published shape (`pipeshard model synth`)
        return bool(self.spec.get("synthetic", False))

    @property
    def local_layers(self) -> frozenset[int]:  # sliding-window layers (Gemma 3), global indices
        return frozenset(int(i) for i in self.spec.get("local_layers", ()))

    @property
    def sliding_window(self) -> int | None:
        window = self.spec.get("sliding_window")
        return int(window) if window else None

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> ModelInfo:
        own = ("name", "source", "fingerprint", "eos_token_ids")
        info = cls(
            name=str(raw.get("name", "")),
            source=str(raw.get("source", "")),
            fingerprint=str(raw["fingerprint"]),
            spec={k: v for k, v in raw.items() if k not in own},
            eos_token_ids=tuple(int(i) for i in raw.get("eos_token_ids", ())),
        )
        for key in ("num_layers", "hidden_size", "vocab_size", "num_kv_heads", "head_dim"):
            int(info.spec[key])  # what the serving side reads must be there and be a number
        return info

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "source": self.source,
            "fingerprint": self.fingerprint,
            **self.spec,
            "eos_token_ids": list(self.eos_token_ids),
        }


@dataclass(frozen=True)
class WeightsInfo:
    format: str  # int4|int8|fp16|fp32
    group_size: int | None
    mode: str = ""  # int4_sym, int8_asym, ... ("" in manifests written before it existed)
    embedding_and_lm_head: str = ""  # the precision of the embedding and LM head

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> WeightsInfo:
        group = raw.get("group_size")
        return cls(
            str(raw["format"]),
            None if group is None else int(group),
            str(raw.get("mode", "")),
            str(raw.get("embedding_and_lm_head", "")),
        )

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"format": self.format, "group_size": self.group_size}
        if self.mode:
            out["mode"] = self.mode
        if self.embedding_and_lm_head:
            out["embedding_and_lm_head"] = self.embedding_and_lm_head
        return out


@dataclass(frozen=True)
class TokenizerInfo:
    """What the export holds to tokenize: copied files, chat template, an OpenVINO tokenizer pair."""

    files: tuple[str, ...]
    chat_template: bool
    openvino_tokenizer: str | None = None
    openvino_detokenizer: str | None = None
    error: str | None = None  # why there is no tokenizer pair

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> TokenizerInfo:
        return cls(
            files=tuple(str(f) for f in raw.get("files", ())),
            chat_template=bool(raw.get("chat_template", False)),
            openvino_tokenizer=raw.get("openvino_tokenizer"),
            openvino_detokenizer=raw.get("openvino_detokenizer"),
            error=raw.get("error"),
        )

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "files": list(self.files),
            "chat_template": self.chat_template,
            "openvino_tokenizer": self.openvino_tokenizer,
            "openvino_detokenizer": self.openvino_detokenizer,
        }
        if self.error is not None:
            out["error"] = self.error
        return out


@dataclass(frozen=True)
class DraftInfo:
    layers: int
    vocab_ids: str | None  # the .npy of the LM head's token ids; None = the full vocabulary
    source_layers: int | None = None  # the layers of the model it was cut from

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> DraftInfo:
        source = raw.get("source_layers")
        return cls(int(raw["layers"]), raw.get("vocab_ids"), None if source is None else int(source))

    def to_dict(self) -> dict[str, Any]:
        return {"layers": self.layers, "vocab_ids": self.vocab_ids, "source_layers": self.source_layers}


class KvLayout(StrEnum):
    """How an export's stages hold the KV cache (manifest.json's ``kv_layout``): the kind a
    stage's KV backend is chosen from (services/stage/backends.py)."""

    STATEFUL = "stateful"  # KV as graph state: the stateful and paged backends run it
    STATIC = "static"  # KV as inputs and outputs of static-shape models: the static backend


@dataclass(frozen=True)
class StaticLayout:
    """A static export's fixed shapes (``pipeshard export --static``): every inference runs
    ``slots`` rows of ``chunk`` tokens over KV inputs of max_context positions per slot."""

    slots: int
    chunk: int

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> StaticLayout:
        return cls(int(raw["slots"]), int(raw["chunk"]))

    def to_dict(self) -> dict[str, Any]:
        return {"slots": self.slots, "chunk": self.chunk}


def check_layout(where: Path, named: object, has_static: bool) -> None:
    """A manifest's ``kv_layout`` (absent in stateful exports) is one this pipeshard reads and
    agrees with its ``static`` block; otherwise FAILED_PRECONDITION naming the field."""
    if named is None:
        return
    known = [str(kind) for kind in KvLayout]
    if named not in known:
        raise FailedPrecondition(
            f"{where}: kv_layout is {named!r}; this pipeshard reads {' or '.join(known)} (a newer exporter?)"
        )
    if (named == KvLayout.STATIC) != has_static:
        block = "there" if has_static else "missing"
        raise FailedPrecondition(f"{where}: kv_layout is {named!r} but the `static` block is {block}")


@dataclass(frozen=True)
class Manifest:
    """manifest.json as one typed object: the exporter builds and writes it (``to_dict``), every
    reader loads it (``from_dict``); the two are inverse on every export."""

    export_dir: Path
    name: str
    exporter_version: str
    created_at: str  # ISO 8601, UTC
    model: ModelInfo
    split: tuple[int, ...]  # layers per stage
    max_context: int
    beam_idx: bool
    weights: WeightsInfo
    stages: tuple[StageEntry, ...]
    tokenizer: TokenizerInfo
    files: Mapping[str, FileRecord]
    draft: DraftInfo | None = None
    export_id: str = ""  # "" in exports written before it existed
    static: StaticLayout | None = None  # stateless static-shape stages; None: stateful (KV as graph state)

    @property
    def kv_layout(self) -> KvLayout:
        """How the stages hold the KV cache: static (inputs and outputs) or stateful."""
        return KvLayout.STATIC if self.static is not None else KvLayout.STATEFUL

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @classmethod
    def from_dict(cls, export_dir: Path, raw: Mapping[str, Any]) -> Manifest:
        """Typed view of a manifest dict; a missing or mistyped key is a FailedPrecondition."""
        where = Path(export_dir) / MANIFEST
        try:
            draft = raw.get("draft")
            static = raw.get("static")
            check_layout(where, raw.get("kv_layout"), static is not None)
            stages = tuple(StageEntry.from_dict(s) for s in raw["stages"])
            return cls(
                export_dir=Path(export_dir),
                name=str(raw.get("name", Path(export_dir).name)),
                exporter_version=str(raw.get("exporter_version", "")),
                created_at=str(raw.get("created_at", "")),
                model=ModelInfo.from_dict(raw["model"]),
                split=tuple(int(n) for n in raw.get("split", [s.layer_end - s.layer_start for s in stages])),
                max_context=int(raw["max_context"]),
                beam_idx=bool(raw.get("beam_idx", True)),
                weights=WeightsInfo.from_dict(raw["weights"]),
                stages=stages,
                tokenizer=TokenizerInfo.from_dict(raw.get("tokenizer", {})),
                files={rel: FileRecord(str(r["sha256"]), int(r["size"])) for rel, r in raw["files"].items()},
                draft=DraftInfo.from_dict(draft) if draft else None,
                export_id=str(raw.get("export_id", "")),
                static=StaticLayout.from_dict(static) if static else None,
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise FailedPrecondition(f"{where} is malformed: {type(exc).__name__} {exc}") from None

    def to_dict(self) -> dict[str, Any]:
        """The manifest.json this object is (the exporter writes it; ExportService forwards it)."""
        out: dict[str, Any] = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "exporter_version": self.exporter_version,
            "created_at": self.created_at,
            "name": self.name,
            "model": self.model.to_dict(),
        }
        if self.export_id:
            out["export_id"] = self.export_id
        out.update(
            num_stages=self.num_stages,
            split=list(self.split),
            max_context=self.max_context,
            beam_idx=self.beam_idx,
            weights=self.weights.to_dict(),
            stages=[s.to_dict() for s in self.stages],
            tokenizer=self.tokenizer.to_dict(),
            files={rel: r.to_dict() for rel, r in self.files.items()},
        )
        if self.draft is not None:
            out["draft"] = self.draft.to_dict()
        if self.static is not None:
            out["kv_layout"] = str(self.kv_layout)
            out["static"] = self.static.to_dict()
        return out

    def stage(self, stage: int) -> StageEntry:
        n = self.num_stages
        if not isinstance(stage, int) or not 0 <= stage < n:
            raise InvalidArgument("stage", f"must be in [0, {n}) for this {n}-stage export, got {stage!r}")
        return self.stages[stage]

    def stage_files(self, stage: int) -> list[str]:
        folder = self.stage(stage).folder.rstrip("/") + "/"
        return sorted(rel for rel in self.files if rel.startswith(folder))

    def root_files(self) -> list[str]:
        """What every process of a fleet reads (a coordinator no more): the manifest and the files
        outside the stage folders (config, tokenizer)."""
        stage_folders = tuple(s.folder.rstrip("/") + "/" for s in self.stages)
        shared = [rel for rel in self.files if not rel.startswith(stage_folders)]
        return [MANIFEST, *sorted(shared)]

    def files_for_stage(self, stage: int) -> list[str]:
        """What one stage needs: the root files and its folder."""
        return [*self.root_files(), *self.stage_files(stage)]


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
    for model in filter(None, (entry.model, entry.decode_model)):
        if model not in rels:
            raise FailedPrecondition(f"stage {stage}: {model} is not listed in the manifest of {export_dir}")
    _check_files(export_dir, manifest, rels, hashes, f"stage {stage}")
    return manifest


def verify_root_files(export_dir: Path, hashes: bool = True) -> Manifest:
    """Check the export's root files (what a coordinator reads) against the manifest."""
    export_dir = Path(export_dir)
    manifest = load_manifest(export_dir)
    _check_files(export_dir, manifest, manifest.root_files()[1:], hashes, "export root")
    return manifest


def verify_export(export_dir: Path, hashes: bool = True) -> Manifest:
    """Check every file of an export against its manifest."""
    export_dir = Path(export_dir)
    manifest = load_manifest(export_dir)
    _check_files(export_dir, manifest, sorted(manifest.files), hashes, "export")
    return manifest
