"""Turns a request's ``speculative`` field into a drafter factory, loading draft models once."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import structlog

from pipeshard.errors import InvalidArgument
from pipeshard.services.coordinator.speculation.drafts import Drafter, DraftModel, NgramDrafter
from pipeshard.shard.runtime import ShardRunner

log = structlog.get_logger(__name__)

MODES = ("none", "self", "ngram")


class DraftSources:
    """``none``, ``ngram``, ``self`` (the configured self-draft export) or a draft folder (an
    export, or a same-tokenizer Hugging Face model folder exported on first use)."""

    def __init__(
        self,
        target_shards: Path,
        *,
        self_draft: Path | None = None,
        draft_cache: Path | None = None,
        num_threads: int | None = None,
    ):
        self.target_shards = Path(target_shards)
        self.self_draft = self_draft
        self.draft_cache = Path(draft_cache) if draft_cache else self.target_shards.parent / ".drafts"
        self.num_threads = num_threads
        self._models: dict[Path, DraftModel] = {}
        self._lock = asyncio.Lock()

    def validate(self, mode: str) -> None:
        """Cheap checks at request time, before any slot or session is taken."""
        if mode in ("none", "ngram"):
            return
        if mode == "self":
            if self.self_draft is None:
                raise InvalidArgument(
                    "speculative",
                    "self-draft is not configured on this coordinator (start it with --self-draft DIR)",
                )
            return
        if not Path(mode).is_dir():
            raise InvalidArgument(
                "speculative", f"must be none, self, ngram or a draft model folder; {mode!r} is none of these"
            )

    async def factory(self, mode: str) -> Callable[[], Drafter] | None:
        self.validate(mode)
        if mode == "none":
            return None
        if mode == "ngram":
            return NgramDrafter
        folder = self.self_draft if mode == "self" else Path(mode)
        model = await self._load(Path(folder).resolve())
        return model.drafter

    async def _load(self, folder: Path) -> DraftModel:
        async with self._lock:
            if folder not in self._models:
                self._models[folder] = await asyncio.to_thread(self._build, folder)
            return self._models[folder]

    def _build(self, folder: Path) -> DraftModel:
        from pipeshard.exporter.draft import check_same_tokenizer, ensure_draft_export

        export = ensure_draft_export(folder, self.draft_cache)
        check_same_tokenizer(self.target_shards, export)
        runner = ShardRunner(export, 0, num_threads=self.num_threads)
        runner.warmup()
        log.info("draft_loaded", folder=str(folder), export=str(export), sliced=runner.vocab_ids is not None)
        return DraftModel(runner, runner.vocab_ids, runner.vocab_size)
