"""A feature draft picked up by the running coordinator once its background training finishes.

`make up` / `make wan-up` without a draft for the export's weights serve with prompt lookup and
train the draft in the background (services/draft_training.py), into a folder the coordinator is
told to watch (``--feature-draft-watch``). One stat of the draft's meta file per interval: the
trainer writes the weights and then the meta file, each by an atomic rename
(pipeshard/shard/draft_folder.py), so a meta file there means a whole draft. It is checked against
the target's weights (fingerprint and sizes) and its arrays against the sizes its meta declares,
loaded, and offered to new requests (under ``auto``, the default `make up` starts with, as one more
source to choose among; else as the default source); requests already admitted keep theirs. A
draft that fails any check is refused with a log naming why, the fleet keeps what it serves with,
and the watch tries again only once the files change (a new training writes them anew).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import structlog

from pipeshard.metrics import SPECULATION_DEFAULT
from pipeshard.services.coordinator.speculation.choice import AUTO
from pipeshard.services.coordinator.speculation.sources import DraftSources
from pipeshard.shard import feature_draft
from pipeshard.shard.draft_folder import WEIGHTS

log = structlog.get_logger(__name__)


def say_default(source: str, replaced: str | None = None) -> None:
    """The default source in the metrics (the start-up's log line says it too)."""
    if replaced is not None and replaced != source:
        SPECULATION_DEFAULT.labels(source=replaced).set(0)
    SPECULATION_DEFAULT.labels(source=source).set(1)


class TakesDrafts(Protocol):
    """What the watch changes: the generation's draft sources and its default (generation.py)."""

    default_speculative: str

    def offer_drafts(self, drafts: DraftSources, default_speculative: str) -> None: ...


def _stamp(path: Path) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_mtime_ns, st.st_size


class DraftWatch:
    """Watches ``folder`` for a whole feature draft and hands it to ``generation`` as the default
    of new requests; ``sources`` builds the coordinator's draft sources with that draft offered."""

    def __init__(
        self,
        folder: Path,
        target_shards: Path,
        generation: TakesDrafts,
        sources: Callable[[Path], DraftSources],
        interval_s: float = 10.0,
    ):
        self.folder = Path(folder)
        self.target_shards = Path(target_shards)
        self._generation = generation
        self._sources = sources
        self.interval_s = interval_s
        self._tried: tuple | None = None  # the files' stamps last tried (refused): not tried again
        self.picked_up = False

    def _files(self) -> tuple | None:
        """The meta and weights files' (mtime, size), once the meta file (written last) is there."""
        meta = _stamp(self.folder / feature_draft.META)
        return None if meta is None else (meta, _stamp(self.folder / WEIGHTS))

    async def poll(self) -> bool:
        """One look: True once a draft is picked up (now or before)."""
        if self.picked_up:
            return True
        files = self._files()
        if files is None or files == self._tried:
            return False
        self._tried = files
        try:
            drafts = await self._checked()
        except Exception as exc:  # any failure of a file written outside this process refuses it
            log.warning(
                "feature_draft_refused",
                folder=str(self.folder),
                reason=f"{type(exc).__name__}: {exc}",
                default=self._generation.default_speculative,
            )
            return False
        replaced = self._generation.default_speculative
        # auto stays the default and chooses among the draft's sources too (speculation/choice.py)
        default = AUTO if replaced == AUTO else "feature"
        self._generation.offer_drafts(drafts, default)
        say_default(default, replaced)
        self.picked_up = True
        log.info(
            "feature_draft_picked_up",
            folder=str(self.folder),
            default=default,
            replaced=replaced,
            offered=drafts.names,
            note="new requests that do not choose may speculate with it; running ones keep theirs",
        )
        return True

    async def _checked(self) -> DraftSources:
        meta = feature_draft.read_meta(self.folder)
        feature_draft.check_target(meta, self.target_shards, self.folder)
        await asyncio.to_thread(feature_draft.check_weights, self.folder, meta)
        drafts = self._sources(self.folder)
        await drafts.factory("feature")  # loads it now, not on a request
        return drafts

    async def run(self) -> None:
        """Polls until a draft is picked up (a task the coordinator cancels at shutdown)."""
        log.info("feature_draft_watch", folder=str(self.folder), interval_s=self.interval_s)
        while not await self.poll():
            await asyncio.sleep(self.interval_s)
