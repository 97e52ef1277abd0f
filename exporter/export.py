"""Export orchestration: validate the request, export every stage, write tokenizer files and manifest.

Each stage runs load -> trace -> convert (stateful + beam_idx) -> compress -> save, by default in
its own spawned process: the peak RSS of that process is the stage's export footprint (recorded
in the manifest) and all of its memory is returned when it exits. Everything is written into a
hidden sibling folder ``.<name>.partial-<pid>`` that is renamed to the target only at the end,
so an interrupted export never looks complete (and never has a manifest at the target path).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import queue as queue_mod
import resource
import shutil
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeshard import errors
from pipeshard.errors import FailedPrecondition, InvalidArgument
from pipeshard.exporter import EXPORTER_VERSION
from pipeshard.exporter.budget import check_export_memory
from pipeshard.exporter.compress import CompressionPlan, make_plan
from pipeshard.exporter.families import ModelSpec, cut_config, load_config, moe_form, resolve_spec
from pipeshard.exporter.weights import weight_files
from pipeshard.shard.manifest import (
    ExportStats,
    KvReorder,
    Manifest,
    ModelInfo,
    PortInfo,
    StageEntry,
    StaticLayout,
    TokenizerInfo,
    WeightsInfo,
    export_id,
    file_records,
    model_fingerprint,
    write_manifest,
)

if TYPE_CHECKING:
    from pipeshard.exporter.draft import DraftPlan

MODEL_XML = "openvino_model.xml"
DECODE_XML = "openvino_model_decode.xml"  # a static export's [slots, 1] decode-shaped twin
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
    "config.json",
)
PHASES = ("load", "trace", "convert", "compress", "save")


@dataclass(frozen=True)
class ProgressEvent:
    """One progress report: ``stage`` is None for export-wide phases (tokenizer, manifest, done)."""

    stage: int | None
    phase: str
    fraction: float
    message: str = ""


ProgressFn = Callable[[ProgressEvent], object]


@dataclass(frozen=True)
class StageJob:
    """Everything a (possibly separate) process needs to export one stage."""

    model_dir: str
    config: dict
    index: int
    layer_start: int
    layer_end: int
    out_dir: str
    plan: CompressionPlan
    beam_idx: bool
    head_ids: tuple[int, ...] | None = None  # a draft's vocabulary slice: the LM head rows kept
    static: StaticLayout | None = None  # stateless static shapes (static_stage.py) instead of state
    max_context: int = 0  # the static KV inputs' positions


@dataclass
class ExportResult:
    path: Path
    manifest: Manifest
    seconds: float
    stage_seconds: list[float] = field(default_factory=list)


# ----------------------------------------------------------------------------- validation


def default_split(num_layers: int, stages: int) -> list[int]:
    """Layers per stage as even as possible; the remainder goes to the earlier stages (the last
    stage also carries the final norm and the LM head)."""
    base, extra = divmod(num_layers, stages)
    return [base + (1 if i < extra else 0) for i in range(stages)]


def resolve_split(num_layers: int, stages: int | None, split: Sequence[int] | str | None) -> list[int]:
    """Validate ``stages`` / ``split`` against the model; return the layers per stage.

    ``split`` is layers per stage (``10,10,10``) or layer ranges (``0:12,12:20,20:30``, as a plan
    prints them), which must be contiguous from layer 0."""
    if isinstance(split, str) and ":" in split:
        split = _ranges_to_counts(split)
    elif isinstance(split, str):
        try:
            split = [int(p) for p in split.split(",") if p.strip()]
        except ValueError:
            raise InvalidArgument("split", f"must be comma-separated layer counts, got {split!r}") from None
    if split is not None:
        split = list(split)
        if not split:
            raise InvalidArgument("split", "must list at least one stage")
        if any((not isinstance(n, int)) or n < 1 for n in split):
            raise InvalidArgument("split", f"every stage needs at least one layer, got {split}")
        if sum(split) != num_layers:
            raise InvalidArgument(
                "split", f"{split} sums to {sum(split)}, but the model has {num_layers} layers"
            )
        if stages is not None and stages != len(split):
            raise InvalidArgument("stages", f"is {stages} but `split` lists {len(split)} stages")
        return split
    if stages is None:
        raise InvalidArgument("stages", "is required (or give `split`)")
    if not isinstance(stages, int) or stages < 1:
        raise InvalidArgument("stages", f"must be a positive integer, got {stages!r}")
    if stages > num_layers:
        raise InvalidArgument("stages", f"is {stages}, more than the model's {num_layers} layers")
    return default_split(num_layers, stages)


def _ranges_to_counts(text: str) -> list[int]:
    """``0:12,12:20,20:30`` -> [12, 8, 10]; the ranges must follow each other from layer 0."""
    counts, expected = [], 0
    for part in (p.strip() for p in text.split(",") if p.strip()):
        try:
            start, end = (int(x) for x in part.split(":"))
        except ValueError:
            raise InvalidArgument(
                "split", f"must be ranges START:END separated by commas, got {part!r}"
            ) from None
        if start != expected:
            raise InvalidArgument(
                "split", f"range {part} must start at layer {expected} (ranges are contiguous)"
            )
        if end <= start:
            raise InvalidArgument("split", f"range {part} is empty (every stage needs at least one layer)")
        counts.append(end - start)
        expected = end
    return counts


def resolve_max_context(spec: ModelSpec, max_context: int | None) -> int:
    limit = spec.max_positions
    if max_context is None:
        value = min(limit, 4096)
    else:
        if not isinstance(max_context, int) or max_context < 1:
            raise InvalidArgument("max_context", f"must be a positive integer, got {max_context!r}")
        if max_context > limit:
            raise InvalidArgument("max_context", f"is {max_context}, above the model's {limit} positions")
        value = max_context
    if spec.sliding_window and not spec.windowed:
        # A family whose window the stage module does not apply: within it, sliding is full attention.
        value = min(value, spec.sliding_window)
    return value


# ----------------------------------------------------------------------------- one stage


def _port_records(ports) -> tuple[PortInfo, ...]:
    return tuple(
        PortInfo(
            port.get_any_name(),
            tuple(d.get_length() if d.is_static else -1 for d in port.get_partial_shape()),
            port.get_element_type().get_type_name(),
        )
        for port in ports
    )


def export_stage(job: StageJob, progress: ProgressFn) -> StageEntry:
    """load -> trace -> convert -> compress -> save for one stage; returns its manifest entry."""
    import openvino as ov

    from pipeshard.exporter.compress import compress_stage
    from pipeshard.exporter.convert import (
        add_beam_idx,
        kv_reorder_report,
        make_stateful,
        state_variable_ids,
        trace_stage,
    )
    from pipeshard.exporter.stage_module import build_stage_module
    from pipeshard.exporter.static_stage import kv_port_names, trace_static
    from pipeshard.exporter.weights import load_stage_weights

    t0 = time.perf_counter()
    i = job.index
    spec = moe_form(resolve_spec(job.config), job.plan.weights)

    def phase(name: str, fraction: float, message: str = "") -> None:
        progress(ProgressEvent(i, name, fraction, message))

    phase("load", 0.0, f"layers {job.layer_start}..{job.layer_end - 1}")
    weights = load_stage_weights(Path(job.model_dir), spec, job.layer_start, job.layer_end)
    if job.head_ids is not None:
        weights["lm_head.weight"] = weights["lm_head.weight"][list(job.head_ids)]
    module = build_stage_module(spec, job.layer_start, job.layer_end, weights)
    del weights
    phase("load", 1.0, f"{sum(p.numel() for p in module.parameters()) / 1e6:.1f} M parameters")

    phase("trace", 0.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TorchScript tracer warnings about shape-dependent arange
        if job.static is not None:
            model = trace_static(module, job.static, job.max_context)
            decode = (
                trace_static(module, replace(job.static, chunk=1), job.max_context)
                if job.static.chunk > 1
                else None
            )
        else:
            model, decode = trace_stage(module), None
    del module
    phase("trace", 1.0)

    if job.static is None:
        phase("convert", 0.0, "stateful KV" + (" + beam_idx" if job.beam_idx else ""))
        past = [p.get_any_name() for p in model.inputs if p.get_any_name().startswith("past_key_values.")]
        present = [p.get_any_name() for p in model.outputs if p.get_any_name().startswith("present.")]
        if job.beam_idx:
            add_beam_idx(model, past)
        make_stateful(model, dict(zip(past, present, strict=True)))
        phase("convert", 1.0)

    phase("compress", 0.0, job.plan.weights)
    model = compress_stage(model, job.plan)
    if decode is not None:
        decode = compress_stage(decode, job.plan)
    phase("compress", 1.0)

    phase("save", 0.0)
    folder = Path(job.out_dir) / f"stage_{i}"
    folder.mkdir(parents=True, exist_ok=True)
    ov.save_model(model, folder / MODEL_XML, compress_to_fp16=job.plan.save_fp16)
    if decode is not None:
        ov.save_model(decode, folder / DECODE_XML, compress_to_fp16=job.plan.save_fp16)
    phase("save", 1.0, str(folder))
    reorder = kv_reorder_report(model)
    # A static stage has no state: its KV inputs are named as the stateful export's variables.
    kv_names = kv_port_names(model) if job.static is not None else state_variable_ids(model)
    return StageEntry(
        index=i,
        layer_start=job.layer_start,
        layer_end=job.layer_end,
        folder=f"stage_{i}",
        model=f"stage_{i}/{MODEL_XML}",
        decode_model=f"stage_{i}/{DECODE_XML}" if decode is not None else "",
        inputs=_port_records(model.inputs),
        outputs=_port_records(model.outputs),
        state_variables=tuple(kv_names),
        kv_reorder=KvReorder(reorder["read_values"], reorder["beam_idx_gathers"]),
        export=ExportStats(round(time.perf_counter() - t0, 3), _peak_rss_bytes(), "process"),
    )


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _stage_worker(job: StageJob, events: Any) -> None:
    """Entry point of a spawned stage process: progress and the result go back over ``events``."""
    try:
        from pipeshard.offline import set_offline_defaults

        set_offline_defaults()
        entry = export_stage(job, lambda ev: events.put(("progress", asdict(ev))))
        events.put(("result", replace(entry, export=replace(entry.export, rss_scope="subprocess"))))
    except BaseException as exc:  # report everything; the parent re-raises it
        events.put(
            (
                "error",
                {
                    "type": type(exc).__name__,
                    "field": getattr(exc, "field", None),
                    "message": str(exc),
                    "traceback": traceback.format_exc(),
                },
            )
        )


def _raise_remote(info: dict[str, Any], stage: int) -> None:
    if info["type"] == "InvalidArgument" and info.get("field"):
        prefix = f"`{info['field']}` "
        message = info["message"][len(prefix) :] if info["message"].startswith(prefix) else info["message"]
        raise InvalidArgument(info["field"], message)
    cls = getattr(errors, info["type"], None)
    if isinstance(cls, type) and issubclass(cls, errors.PipeshardError) and cls is not InvalidArgument:
        raise cls(info["message"])
    raise errors.Internal(
        f"stage {stage} export failed: {info['type']}: {info['message']}\n{info['traceback']}"
    )


def _check_cancel(cancel: threading.Event | None) -> None:
    if cancel is not None and cancel.is_set():
        raise errors.Cancelled("export cancelled: its caller went away")


def run_stage_isolated(
    job: StageJob,
    progress: ProgressFn,
    timeout: float | None = None,
    cancel: threading.Event | None = None,
) -> StageEntry:
    """Export one stage in a spawned process; returns its manifest entry with its peak RSS.
    Setting ``cancel`` stops the process within about half a second."""
    ctx = mp.get_context("spawn")
    events = ctx.Queue()
    proc = ctx.Process(target=_stage_worker, args=(job, events), name=f"pipeshard-export-stage-{job.index}")
    proc.start()
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        while True:
            _check_cancel(cancel)
            try:
                kind, payload = events.get(timeout=0.5)
            except queue_mod.Empty:
                if not proc.is_alive():
                    raise errors.Internal(
                        f"stage {job.index} export process exited with code {proc.exitcode} without a result"
                    ) from None
                if deadline is not None and time.monotonic() > deadline:
                    raise errors.DeadlineExceeded(
                        f"stage {job.index} export took longer than {timeout} s"
                    ) from None
                continue
            if kind == "progress":
                progress(ProgressEvent(**payload))
            elif kind == "result":
                return payload
            else:
                _raise_remote(payload, job.index)
    finally:
        proc.join(timeout=0 if cancel is not None and cancel.is_set() else 30)
        if proc.is_alive():
            proc.terminate()
            proc.join()
        events.close()


# ----------------------------------------------------------------------------- tokenizer


def _eos_ids(model_dir: Path, config: dict[str, Any]) -> list[int]:
    ids: set[int] = set()

    def add(value: Any) -> None:
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(v for v in value if isinstance(v, int))

    gen = model_dir / "generation_config.json"
    if gen.is_file():
        add(json.loads(gen.read_text()).get("eos_token_id"))
    else:
        add(config.get("eos_token_id"))
    return sorted(ids)


def copy_tokenizer(
    model_dir: Path, out: Path, progress: ProgressFn, convert_ov: bool = True
) -> TokenizerInfo:
    """Copy tokenizer files and chat template; convert an openvino-tokenizers pair when possible."""
    copied = []
    for name in TOKENIZER_FILES:
        src = model_dir / name
        if src.is_file():
            shutil.copy2(src, out / name)
            copied.append(name)
    cfg = out / "tokenizer_config.json"
    chat_template = (out / "chat_template.jinja").is_file() or bool(
        cfg.is_file() and json.loads(cfg.read_text()).get("chat_template")
    )
    info = TokenizerInfo(tuple(copied), chat_template)
    has_tokenizer = any(n in copied for n in ("tokenizer.json", "tokenizer.model", "vocab.json"))
    if not has_tokenizer:
        return replace(info, error="the model folder has no tokenizer files")
    if not convert_ov:
        return info
    progress(ProgressEvent(None, "tokenizer", 0.0, "openvino-tokenizers"))
    try:
        import openvino as ov
        from openvino_tokenizers import convert_tokenizer
        from transformers import AutoTokenizer

        hf_tok = AutoTokenizer.from_pretrained(out)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tok, detok = convert_tokenizer(hf_tok, with_detokenizer=True)
        ov.save_model(tok, out / "openvino_tokenizer.xml")
        ov.save_model(detok, out / "openvino_detokenizer.xml")
        progress(ProgressEvent(None, "tokenizer", 1.0, "converted"))
        return replace(
            info, openvino_tokenizer="openvino_tokenizer.xml", openvino_detokenizer="openvino_detokenizer.xml"
        )
    except Exception as exc:  # a tokenizer openvino-tokenizers cannot convert is not fatal
        for name in ("openvino_tokenizer", "openvino_detokenizer"):
            for ext in (".xml", ".bin"):
                (out / f"{name}{ext}").unlink(missing_ok=True)
        error = f"openvino-tokenizers conversion failed: {type(exc).__name__}: {exc}"
        progress(ProgressEvent(None, "tokenizer", 1.0, error))
        return replace(info, error=error)


# ----------------------------------------------------------------------------- the export


def _default_progress(event: ProgressEvent) -> None:
    where = "export" if event.stage is None else f"stage {event.stage}"
    print(
        f"[{where}] {event.phase} {event.fraction:.0%} {event.message}".rstrip(), file=sys.stderr, flush=True
    )


@dataclass(frozen=True)
class ExportPlan:
    """An export settled before any stage runs: every argument checked, the layers placed."""

    model_dir: Path
    out_dir: Path
    config: dict[str, Any]
    spec: ModelSpec
    layers: list[int]  # per stage
    compression: CompressionPlan
    max_context: int
    beam_idx: bool
    model_name: str
    draft: DraftPlan | None
    weight_files: list[Path]  # the safetensors files the fingerprint covers
    static: StaticLayout | None = None

    def jobs(self, tmp: Path) -> list[StageJob]:
        starts = [sum(self.layers[:i]) for i in range(len(self.layers))]
        head_ids = None if self.draft is None else self.draft.vocab_ids
        return [
            StageJob(
                str(self.model_dir),
                self.config,
                index,
                start,
                start + count,
                str(tmp),
                self.compression,
                self.beam_idx,
                head_ids,
                self.static,
                self.max_context,
            )
            for index, (start, count) in enumerate(zip(starts, self.layers, strict=True))
        ]


def plan_export(
    model_dir: Path,
    out_dir: Path,
    *,
    stages: int | None,
    split: Sequence[int] | str | None,
    weights: str,
    group_size: int | str | None,
    head_precision: str,
    int8_sym: bool,
    max_context: int | None,
    beam_idx: bool,
    force: bool,
    model_name: str | None,
    draft: DraftPlan | None,
    max_stage_memory: int | None = None,
    static: StaticLayout | None = None,
) -> ExportPlan:
    """Check every argument against the model before anything is written."""
    config = load_config(model_dir)
    if draft is not None:
        if stages != 1 or split is not None:
            raise InvalidArgument("stages", "must be 1 for a draft (a draft is one stage)")
        config = cut_config(config, draft.layers)  # a k-layer model: its one stage is the last
    spec = resolve_spec(config)
    layers = resolve_split(spec.num_layers, stages, split)
    check_export_memory(spec, layers, max_stage_memory)
    compression = make_plan(spec, weights, group_size, head_precision, int8_sym)
    spec = moe_form(spec, weights)
    context = resolve_max_context(spec, max_context)
    if static is not None:
        check_static(static, context, draft is not None)
    if out_dir.exists() and not force:
        raise FailedPrecondition(f"{out_dir} already exists; pass --force (force=True) to replace it")
    wfiles = weight_files(model_dir)
    return ExportPlan(
        model_dir,
        out_dir,
        config,
        spec,
        layers,
        compression,
        context,
        beam_idx,
        model_name or model_dir.name,
        draft,
        wfiles,
        static,
    )


def check_static(static: StaticLayout, max_context: int, draft: bool) -> None:
    """A static export's shapes: at least one slot, a chunk within the context, no draft."""
    if draft:
        raise InvalidArgument(
            "static", "a draft is exported stateful (its stage runs beside the coordinator)"
        )
    if not isinstance(static.slots, int) or static.slots < 1:
        raise InvalidArgument("slots", f"must be a positive integer, got {static.slots!r}")
    if not isinstance(static.chunk, int) or not 1 <= static.chunk <= max_context:
        raise InvalidArgument(
            "chunk", f"must be an integer in [1, max_context {max_context}], got {static.chunk!r}"
        )


def export_stages(
    plan: ExportPlan, tmp: Path, progress: ProgressFn, isolate: bool, cancel: threading.Event | None
) -> list[StageEntry]:
    """Every stage in turn, each in its own process when ``isolate``."""
    entries = []
    for job in plan.jobs(tmp):
        _check_cancel(cancel)
        entry = run_stage_isolated(job, progress, cancel=cancel) if isolate else export_stage(job, progress)
        stats = entry.export
        progress(
            ProgressEvent(
                job.index,
                "finished",
                1.0,
                f"{stats.seconds:.1f} s, peak RSS {stats.peak_rss_bytes / 2**20:.0f} MiB ({stats.rss_scope})",
            )
        )
        entries.append(entry)
    return entries


def write_export(
    plan: ExportPlan, tmp: Path, entries: list[StageEntry], progress: ProgressFn, convert_tokenizer: bool
) -> Manifest:
    """Tokenizer, draft vocabulary and manifest into ``tmp``, once the stages are there."""
    tokenizer = copy_tokenizer(plan.model_dir, tmp, progress, convert_ov=convert_tokenizer)
    draft = None if plan.draft is None else plan.draft.write(tmp, entries[0].folder)
    progress(ProgressEvent(None, "manifest", 0.0, "hashing files"))
    files = file_records(tmp)
    manifest = Manifest(
        export_dir=plan.out_dir,
        name=plan.out_dir.name,
        exporter_version=EXPORTER_VERSION,
        created_at=datetime.now(UTC).isoformat(timespec="seconds"),
        model=ModelInfo(
            name=plan.model_name,
            source=str(plan.model_dir.resolve()),
            fingerprint=model_fingerprint(plan.model_dir / "config.json", plan.weight_files),
            spec=plan.spec.to_json(),
            eos_token_ids=tuple(_eos_ids(plan.model_dir, plan.config)),
        ),
        export_id=export_id(files),
        split=tuple(plan.layers),
        max_context=plan.max_context,
        beam_idx=plan.beam_idx,
        weights=WeightsInfo.from_dict(plan.compression.to_json()),
        stages=tuple(entries),
        tokenizer=tokenizer,
        files=files,
        draft=draft,
        static=plan.static,
    )
    write_manifest(tmp, manifest)
    return manifest


def export_model(
    model_dir: Path | str,
    out_dir: Path | str,
    *,
    stages: int | None = None,
    split: Sequence[int] | str | None = None,
    weights: str = "int4",
    group_size: int | str | None = "auto",
    head_precision: str = "int8",
    int8_sym: bool = False,
    max_context: int | None = None,
    beam_idx: bool = True,
    force: bool = False,
    model_name: str | None = None,
    progress: ProgressFn | None = None,
    isolate: bool = True,
    convert_tokenizer: bool = True,
    draft: DraftPlan | None = None,
    cancel: threading.Event | None = None,
    max_stage_memory: int | None = None,
    static: StaticLayout | None = None,
) -> ExportResult:
    """Export ``model_dir`` (a Hugging Face folder with safetensors) into N stage shards at ``out_dir``.

    ``isolate`` runs each stage in a spawned process (peak RSS per stage, memory freed between
    stages); tests of tiny models turn it off to save the process start-up. ``draft`` (see
    ``pipeshard.exporter.draft.export_draft``) exports the model cut to its first layers as one stage.
    Setting ``cancel`` stops the export (Cancelled) and removes its partial folder; ``out_dir``
    is untouched unless the export completes. ``max_stage_memory`` (bytes) refuses a split with a
    stage whose estimated export peak is larger (``pipeshard.exporter.budget``). ``static``
    writes stateless static-shape stages (``pipeshard.exporter.static_stage``).
    """
    t0 = time.perf_counter()
    progress = progress or _default_progress
    model_dir = Path(model_dir)
    out_dir = Path(out_dir)
    plan = plan_export(
        model_dir,
        out_dir,
        stages=stages,
        split=split,
        weights=weights,
        group_size=group_size,
        head_precision=head_precision,
        int8_sym=int8_sym,
        max_context=max_context,
        beam_idx=beam_idx,
        force=force,
        model_name=model_name,
        draft=draft,
        max_stage_memory=max_stage_memory,
        static=static,
    )
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f".{out_dir.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        entries = export_stages(plan, tmp, progress, isolate, cancel)
        _check_cancel(cancel)
        manifest = write_export(plan, tmp, entries, progress, convert_tokenizer)
        _check_cancel(cancel)
        _replace_folder(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    seconds = time.perf_counter() - t0
    progress(ProgressEvent(None, "done", 1.0, f"{out_dir} in {seconds:.1f} s"))
    return ExportResult(out_dir, manifest, seconds, [e.export.seconds for e in entries])


def _replace_folder(new: Path, target: Path) -> None:
    """Rename ``new`` to ``target``; an existing ``target`` (force) is moved aside and removed after."""
    if not target.exists():
        new.rename(target)
        return
    old = target.parent / f".{target.name}.old-{os.getpid()}"
    shutil.rmtree(old, ignore_errors=True)
    target.rename(old)
    new.rename(target)
    shutil.rmtree(old, ignore_errors=True)
