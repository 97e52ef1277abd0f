"""A feature draft trained in the background when a fleet starts without one (`make up`, `make wan-up`).

A fleet with no draft for its weights speculates with prompt lookup; the draft that does better
(`pipeshard distil --kind eagle`) takes about 40 minutes on 2 cores, a step a user would have to
know about. So the fleet's start launches that training itself, once per export: detached (it
outlives the command and `make down`), at the lowest CPU priority (nice 19, so serving keeps the
cores), into the folder `launcher.feature_draft_args` looks in. The running coordinator watches
that folder (``--feature-draft-watch``, services/coordinator/draft_watch.py) and makes the draft
its default once it is written whole; later fleet starts offer it from the start. A marker beside
the folder names the running trainer, so a second start does not launch another.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from pipeshard import paths
from pipeshard.errors import InvalidArgument
from pipeshard.shard.manifest import load_manifest

MODES = ("background", "off")
ENV = "PIPESHARD_DRAFT_TRAINING"  # the default of --draft-training (tests set it off)
VOCAB = 8192  # `make distil KIND=eagle`'s head slice
NICE = 19
_LAUNCHED: list[subprocess.Popen] = []  # held, so a running trainer's handle is not collected


@dataclass(frozen=True)
class Training:
    """A background training of the draft for one export: where it writes, its process, its log."""

    folder: Path
    pid: int
    log: Path
    started_now: bool  # False: an earlier fleet start launched it and it still runs

    def said(self) -> str:
        when = "started now" if self.started_now else "already running"
        return (
            f"draft training: a feature draft for these weights is training in the background ({when}, "
            f"nice {NICE}, pid {self.pid}, about 40 minutes on 2 cores; log {self.log}); the running "
            f"fleet offers it to new requests once it is written ({self.folder})"
        )


def add_flag(parser: argparse.ArgumentParser) -> None:
    """``--draft-training`` of `pipeshard up` and `pipeshard wan up`."""
    parser.add_argument(
        "--draft-training",
        choices=MODES,
        default=None,
        help="background (default, or $PIPESHARD_DRAFT_TRAINING): with no feature draft for this "
        "export's weights, train one in the background at nice 19 (about 40 minutes on 2 cores); "
        "the running fleet picks it up when it is written",
    )


def default_mode() -> str:
    mode = os.environ.get(ENV, "background")
    if mode not in MODES:
        raise InvalidArgument(ENV, f"must be one of {', '.join(MODES)}, got {mode!r}")
    return mode


def draft_folder(shards: Path) -> Path:
    """Where the background training writes the draft: beside the export, under the name
    `launcher.feature_draft_args` looks for."""
    return Path(shards).parent / paths.feature_draft_name(load_manifest(shards).model.name, VOCAB)


def draft_watch_args(shards: Path, feature_args: Sequence[str], choice: str = "auto") -> list[str]:
    """The coordinator arguments that watch for the draft of a fleet started without one
    (``feature_args`` empty, ``--feature-draft auto``): the folder the background training (or
    a hand-run `pipeshard distil --kind eagle` into it) writes."""
    if feature_args or choice != "auto":
        return []
    return ["--feature-draft-watch", str(draft_folder(shards))]


def trainer_command(shards: Path, folder: Path) -> list[str]:
    """`pipeshard distil --kind eagle` for the export ``shards`` (any split: it reads every
    stage in process) into ``folder``, its texts kept beside the export."""
    model = load_manifest(shards).model.name
    return [
        sys.executable,
        "-m",
        "pipeshard.cli",
        "distil",
        "--kind",
        "eagle",
        "--model",
        model,
        "--target",
        str(shards),
        "--out",
        str(folder),
    ]


def _marker(folder: Path) -> Path:
    return folder.parent / f"{folder.name}.training.json"


def _running(marker: Path) -> int | None:
    """The pid the marker names if that very process still runs (pid and start time), else None."""
    from pipeshard.services.launcher import process_start_time

    try:
        recorded = json.loads(marker.read_text())
        pid, start = int(recorded["pid"]), str(recorded["start"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return pid if start and process_start_time(pid) == start else None


def start_background_training(
    shards: Path, mode: str, draft_args: Sequence[str], command: Sequence[str] | None = None
) -> Training | None:
    """Launch the draft's training for ``shards`` unless ``mode`` is off or the fleet already has a
    draft (``draft_args``, launcher.feature_draft_args's answer); a training an earlier start
    launched that still runs is reported, not doubled. ``command`` replaces the trainer (tests)."""
    from pipeshard.services.launcher import process_start_time

    if mode not in MODES:
        raise InvalidArgument("draft_training", f"must be one of {', '.join(MODES)}, got {mode!r}")
    if mode == "off" or draft_args:
        return None
    folder = draft_folder(shards)
    marker = _marker(folder)
    log = folder.parent / f"{folder.name}.training.log"
    running = _running(marker)
    if running is not None:
        return Training(folder, running, log, started_now=False)
    with log.open("w") as out:
        popen = subprocess.Popen(
            ["nice", "-n", str(NICE), *(command or trainer_command(shards, folder))],  # nice execs: one pid
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # outlives this command, `make down` and a Ctrl-C here
        )
    _LAUNCHED.append(popen)
    marker.write_text(json.dumps({"pid": popen.pid, "start": process_start_time(popen.pid)}))
    return Training(folder, popen.pid, log, started_now=True)
