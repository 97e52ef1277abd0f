"""Turns a request's ``speculative`` field into a drafter factory, loading draft models once.

A client only picks a name: the operator decides at start-up which draft folders exist
(``--draft NAME=DIR``, plus ``self``: the ``--self-draft`` export, ``feature``: the
``--feature-draft`` folder, a draft reading the target's features, ``mix``: prompt lookup where
it finds a match, else that feature draft, and ``medusa``: the final
stage's draft heads, when its GetStageInfo reports them; ``auto`` is no source but the choice
among them by measurement, speculation/choice.py), so a request can never make
the coordinator read, export or keep in memory a folder it chose, nor learn which folders exist.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable, Mapping
from pathlib import Path

import structlog

from pipeshard.errors import InvalidArgument
from pipeshard.services.coordinator.speculation.choice import AUTO
from pipeshard.services.coordinator.speculation.drafts import Drafter, DraftModel, NgramDrafter
from pipeshard.services.coordinator.speculation.feature import DecoderFeatureDrafter, FeatureDrafter
from pipeshard.services.coordinator.speculation.medusa import MedusaDrafter
from pipeshard.services.coordinator.speculation.mixed import MixedDrafter
from pipeshard.shard import feature_draft
from pipeshard.shard.drafts import check_same_tokenizer, resolve_draft
from pipeshard.shard.feature_decoder import FeatureDecoderModel
from pipeshard.shard.runtime import ShardRunner

log = structlog.get_logger(__name__)

MODES = ("none", AUTO, "self", "ngram", "feature", "mix", "medusa")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


def parse_named(specs: list[str]) -> dict[str, Path]:
    """``NAME=DIR`` items of ``--draft`` as a name -> folder map (operator input, checked at start)."""
    named: dict[str, Path] = {}
    for spec in specs:
        name, sep, folder = spec.partition("=")
        if not sep or not _NAME.fullmatch(name) or not folder:
            raise InvalidArgument("draft", f"items must be NAME=DIR with a plain name, got {spec!r}")
        if name in MODES or name in named:
            raise InvalidArgument("draft", f"name {name!r} is built in or given twice")
        if not Path(folder).is_dir():
            raise InvalidArgument("draft", f"{name}: {folder} is not a folder")
        named[name] = Path(folder)
    return named


class DraftSources:
    """``none``, ``ngram``, ``self`` (the configured self-draft export), ``feature`` (the
    configured feature draft, checked against the target's fingerprint here, at start),
    ``medusa`` (the final stage's ``heads`` draft heads, which the stage checked) or an
    operator-named draft folder (an export, or a same-tokenizer Hugging Face model folder
    exported on first use).
    ``allow_paths`` lets a mode be a folder itself: only where the caller is the operator
    (``pipeshard generate --local``, in-process tests and benchmarks), never in a service."""

    def __init__(
        self,
        target_shards: Path,
        *,
        self_draft: Path | None = None,
        feature: Path | None = None,
        heads: int = 0,
        named: Mapping[str, Path] | None = None,
        draft_cache: Path | None = None,
        num_threads: int | None = None,
        allow_paths: bool = False,
    ):
        self.target_shards = Path(target_shards)
        self.self_draft = self_draft
        self.feature = Path(feature) if feature is not None else None
        self._feature_meta = None
        if self.feature is not None:
            self._feature_meta = feature_draft.read_meta(self.feature)
            feature_draft.check_target(self._feature_meta, self.target_shards, self.feature)
        self._feature_model: feature_draft.FeatureDraftModel | FeatureDecoderModel | None = None
        self.heads = heads
        self.named = dict(named or {})
        self.allow_paths = allow_paths
        self.draft_cache = Path(draft_cache) if draft_cache else self.target_shards.parent / ".drafts"
        self.num_threads = num_threads
        self._models: dict[Path, DraftModel] = {}
        self._lock = asyncio.Lock()

    @property
    def names(self) -> list[str]:
        """What a client may ask for, in a stable order."""
        return [
            "none",
            "ngram",
            *(["self"] if self.self_draft is not None else []),
            *(["feature", "mix"] if self.feature is not None else []),
            *(["medusa"] if self.heads else []),
            *sorted(self.named),
        ]

    def validate(self, mode: str) -> None:
        """Cheap checks at request time, before any slot or session is taken (``auto``, a policy
        over the sources offered, is always valid)."""
        if mode in (*self.names, AUTO) or (self.allow_paths and mode not in MODES and Path(mode).is_dir()):
            return
        if mode == "self":
            raise InvalidArgument(
                "speculative",
                "self-draft is not configured on this coordinator (start it with --self-draft DIR)",
            )
        if mode in ("feature", "mix"):
            raise InvalidArgument(
                "speculative",
                "no feature draft is configured on this coordinator (train one with "
                "`pipeshard distil --kind eagle`, start it with --feature-draft DIR)",
            )
        if mode == "medusa":
            raise InvalidArgument(
                "speculative",
                "medusa needs draft heads on the final stage, and this fleet's has none (train them "
                "with `pipeshard distil --kind medusa`, start the final stage with --draft-heads DIR)",
            )
        # The request's value is not echoed: it may be a probe for which paths exist.
        raise InvalidArgument(
            "speculative", f"must name a draft source this coordinator offers: {', '.join(self.names)}"
        )

    async def factory(self, mode: str) -> Callable[[], Drafter] | None:
        self.validate(mode)
        if mode == "none":
            return None
        if mode == "ngram":
            return NgramDrafter
        if mode == "medusa":
            return lambda: MedusaDrafter(self.heads)
        if mode in ("feature", "mix"):
            drafter = _feature_drafter(await self._feature_draft())
            if mode == "mix":
                return lambda: MixedDrafter(drafter())
            return drafter
        folder = self.self_draft if mode == "self" else self.named.get(mode, Path(mode))
        if folder is None:
            raise InvalidArgument("speculative", "this coordinator has no self-draft")
        model = await self._load(Path(folder).resolve())
        return model.drafter

    async def _feature_draft(self) -> feature_draft.FeatureDraftModel | FeatureDecoderModel:
        folder, meta = self.feature, self._feature_meta
        if folder is None or meta is None:
            raise InvalidArgument("speculative", "this coordinator has no feature draft (--feature-draft)")
        async with self._lock:
            model = self._feature_model
            if model is None:
                model = await asyncio.to_thread(_feature_model, folder, meta)
                self._feature_model = model
                log.info("feature_draft_loaded", folder=str(folder), kind=meta.kind)
            return model

    async def _load(self, folder: Path) -> DraftModel:
        async with self._lock:
            if folder not in self._models:
                self._models[folder] = await asyncio.to_thread(self._build, folder)
            return self._models[folder]

    def _build(self, folder: Path) -> DraftModel:
        export = resolve_draft(folder, self.draft_cache)
        check_same_tokenizer(self.target_shards, export)
        runner = ShardRunner(export, 0, num_threads=self.num_threads)
        runner.warmup()
        log.info("draft_loaded", folder=str(folder), export=str(export), sliced=runner.vocab_ids is not None)
        return DraftModel(runner, runner.vocab_ids, runner.vocab_size)


def _feature_drafter(
    model: feature_draft.FeatureDraftModel | FeatureDecoderModel,
) -> Callable[[], FeatureDrafter | DecoderFeatureDrafter]:
    """A request's drafter of the draft's kind."""
    if isinstance(model, FeatureDecoderModel):
        return lambda: DecoderFeatureDrafter(model)
    return lambda: FeatureDrafter(model)


def _feature_model(
    folder: Path, meta: feature_draft.FeatureDraftMeta
) -> feature_draft.FeatureDraftModel | FeatureDecoderModel:
    """The forward pass of the draft's kind."""
    if meta.kind == "eagle-decoder":
        return FeatureDecoderModel(folder, meta)
    return feature_draft.FeatureDraftModel(folder, meta)
