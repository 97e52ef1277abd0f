"""A fleet that starts without a feature draft trains one in the background (services/draft_training.py).

Fast (a fake trainer): `make up` / `make wan-up`'s start launches the trainer once per export,
detached and at nice 19, into the folder the next start looks in, and says so; a start while it
runs does not launch another; a fleet with a draft, or with the training off, launches nothing;
a bad mode is refused by name. Extended (the real trainer, a short run): the draft it writes is
the one the next fleet start offers.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from prometheus_client import REGISTRY
from structlog.testing import capture_logs

from pipeshard import paths
from pipeshard.errors import InvalidArgument
from pipeshard.services.coordinator.draft_watch import DraftWatch, say_default
from pipeshard.services.coordinator.speculation.sources import DraftSources
from pipeshard.services.draft_training import (
    ENV,
    draft_folder,
    draft_watch_args,
    start_background_training,
    trainer_command,
)
from pipeshard.services.launcher import feature_draft_args
from pipeshard.shard import feature_draft
from pipeshard.shard.draft_folder import WEIGHTS
from pipeshard.shard.feature_draft import DEFAULT_ARCH, FeatureDraftMeta
from pipeshard.shard.manifest import load_manifest


@pytest.fixture
def export(smollm2_export, tmp_path) -> Path:
    """A copy of the 1-stage export's manifest and tokenizer (what the start path reads)."""
    out = tmp_path / "smollm2-1s-int4"
    shutil.copytree(smollm2_export(1, "int4"), out, ignore=shutil.ignore_patterns("*.bin", ".compile_cache"))
    return out


def _fake_trainer(marker: Path, seconds: float) -> list[str]:
    """Writes its nice value and arguments to ``marker``, then sleeps."""
    code = (
        "import os, sys, time; "
        f"open({str(marker)!r}, 'a').write(f'{{os.nice(0)}} {{sys.argv[1:]}}\\n'); time.sleep({seconds})"
    )
    return [sys.executable, "-c", code, "ran"]


def _wait_for(path: Path, timeout_s: float = 30.0) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.is_file() and path.read_text().endswith("\n"):
            return path.read_text()
        time.sleep(0.05)
    raise AssertionError(f"{path} was not written")


def test_a_fleet_without_a_draft_trains_one_in_the_background_once(export, tmp_path):
    ran = tmp_path / "ran.txt"
    training = start_background_training(export, "background", [], _fake_trainer(ran, 30))
    try:
        assert training is not None and training.started_now
        assert _wait_for(ran) == "19 ['ran']\n"  # at nice 19, the command given
        assert training.folder == draft_folder(export)
        assert training.folder.name == f"{load_manifest(export).model.name}-eagle-v8192"
        said = training.said()
        assert "background" in said and str(training.pid) in said and str(training.folder) in said
        # A second start while it runs reports it and launches nothing.
        again = start_background_training(export, "background", [], _fake_trainer(ran, 30))
        assert again is not None and not again.started_now and again.pid == training.pid
        time.sleep(0.5)
        assert ran.read_text().count("\n") == 1
    finally:
        os.kill(training.pid, 9)
        os.waitpid(training.pid, 0)
    # Once it has ended (without a draft: it failed or was stopped), the next start tries again.
    retry = start_background_training(export, "background", [], _fake_trainer(ran, 0))
    assert retry is not None and retry.started_now and retry.pid != training.pid
    os.waitpid(retry.pid, 0)


def test_no_training_with_a_draft_or_when_off_and_a_bad_mode_is_refused(export, tmp_path):
    ran = tmp_path / "ran.txt"
    draft = ["--feature-draft", "somewhere"]
    assert start_background_training(export, "background", draft, _fake_trainer(ran, 0)) is None
    assert start_background_training(export, "off", [], _fake_trainer(ran, 0)) is None
    with pytest.raises(InvalidArgument, match="draft_training"):
        start_background_training(export, "sometimes", [], _fake_trainer(ran, 0))
    time.sleep(0.3)
    assert not ran.exists()


def test_the_trainer_is_distil_eagle_for_the_export_into_the_folder_fleets_read(export):
    command = trainer_command(export, draft_folder(export))
    assert command[3:6] == ["distil", "--kind", "eagle"]
    assert command[command.index("--target") + 1] == str(export)
    assert command[command.index("--out") + 1] == str(draft_folder(export))


def _make_distil_eagle(*variables: str) -> list[str]:
    """The `pipeshard distil --kind eagle` command `make distil KIND=eagle` runs (make -n: nothing runs)."""
    out = subprocess.run(
        ["make", "-n", "-s", "distil", "KIND=eagle", *variables],
        cwd=paths.repo_root(),
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    line = next(x for x in out.splitlines() if "distil --kind eagle" in x)
    return line.split(";")[0].split()


def test_make_distil_eagle_trains_on_the_texts_file_it_is_given(tmp_path):
    """TEXTS_FILE reaches `--kind eagle` as it reaches `--kind medusa` (it was dropped: each kind
    then generated its own texts, ~16 minutes each)."""
    command = _make_distil_eagle(f"TEXTS_FILE={tmp_path / 'shared.npz'}")
    assert command[command.index("--texts-file") + 1] == str(tmp_path / "shared.npz")
    assert "--texts-file" not in _make_distil_eagle()  # default: beside the target's export


def test_make_distil_and_the_background_training_default_to_the_same_arch(export):
    """`make distil KIND=eagle`, `pipeshard distil --kind eagle` and the draft `make up` trains in
    the background are one default architecture (the better one measured, feature_draft.DEFAULT_ARCH)."""
    from pipeshard.cli import build_parser

    command = _make_distil_eagle()
    assert command[command.index("--arch") + 1] == DEFAULT_ARCH
    background = build_parser().parse_args(trainer_command(export, draft_folder(export))[3:])
    assert background.arch == DEFAULT_ARCH


def test_tests_start_fleets_without_background_training():
    assert os.environ.get(ENV) == "off"  # tests/conftest.py: no test fleet launches a 45-minute job


@pytest.mark.slow
@pytest.mark.extended
@pytest.mark.timeout(1800)
def test_the_background_draft_is_offered_by_the_next_fleet_start(smollm2_export, tmp_path):
    """The real trainer, short (8 questions, 16 tokens, seconds of training): what it writes is the
    draft the next start's ``feature_draft_args`` offers."""
    export = tmp_path / "smollm2-135m-instruct-1s-int4"
    os.symlink(smollm2_export(1, "int4"), export)
    assert feature_draft_args(export) == []
    short = ["--prompts", "8", "--max-tokens", "16", "--train-minutes", "0.1", "--texts-file"]
    command = [*trainer_command(export, draft_folder(export)), *short, str(tmp_path / "texts.npz")]
    training = start_background_training(export, "background", [], command)
    assert training is not None
    _, status = os.waitpid(training.pid, 0)
    assert status == 0, training.log.read_text()[-3000:]
    assert feature_draft_args(export) == ["--feature-draft", str(training.folder)]


# -- the running coordinator picks the draft up (services/coordinator/draft_watch.py) -------------


class _Generation:
    """What the watch changes on the coordinator's Generation: its sources and default."""

    def __init__(self) -> None:
        self.default_speculative = "ngram"
        self.offered: list[tuple[list[str], str]] = []

    def offer_drafts(self, drafts, default_speculative: str) -> None:
        self.offered.append((drafts.names, default_speculative))
        self.default_speculative = default_speculative


def _draft_arrays(export: Path, **changes) -> tuple[FeatureDraftMeta, dict[str, np.ndarray]]:
    """A random feature draft with the target's sizes and fingerprint (``changes`` replace arrays)."""
    model = load_manifest(export).model
    h, i, v, s = model.hidden_size, 32, model.vocab_size, 64
    meta = FeatureDraftMeta("eagle", model.fingerprint, h, v, i, 1e-5)
    rng = np.random.default_rng(0)
    ids = np.arange(s, dtype=np.int64)
    arrays = {
        name: rng.standard_normal(shape).astype(np.float16 if name == "embed" else np.float32) * 0.02
        for name, shape in feature_draft.expected_shapes(meta, s).items()
        if name != "head_ids"
    }
    return meta, {**arrays, "head_ids": ids, **changes}


def _watch(export: Path, folder: Path) -> tuple[DraftWatch, _Generation]:
    generation = _Generation()
    return DraftWatch(folder, export, generation, lambda f: DraftSources(export, feature=f)), generation


def _refusal(watch: DraftWatch) -> str:
    with capture_logs() as logs:
        assert not asyncio.run(watch.poll())
    refused = [e for e in logs if e["event"] == "feature_draft_refused"]
    assert len(refused) == 1 and refused[0]["default"] == "ngram", logs
    return refused[0]["reason"]


def test_the_running_coordinator_refuses_bad_drafts_by_name_and_picks_up_a_whole_one(export, tmp_path):
    folder = tmp_path / "draft"
    watch, generation = _watch(export, folder)
    say_default("ngram")  # what the coordinator's start says
    assert not asyncio.run(watch.poll())  # nothing there yet
    meta, arrays = _draft_arrays(export)

    feature_draft.write(folder, replace(meta, model_fingerprint="sha256:" + "1" * 64), arrays)
    assert "trained for model fingerprint" in _refusal(watch)
    with capture_logs() as logs:  # the same files are not tried again
        assert not asyncio.run(watch.poll())
    assert logs == []

    feature_draft.write(folder, meta, {**arrays, "fc_bias": arrays["fc_bias"][:-1]})
    assert "fc_bias" in _refusal(watch)
    feature_draft.write(folder, meta, {**arrays, "down": arrays["down"] * np.float32("nan")})
    reason = _refusal(watch)
    assert "down" in reason and "not finite" in reason
    (folder / WEIGHTS).write_bytes((folder / WEIGHTS).read_bytes()[:4096])  # a truncated file
    assert WEIGHTS in _refusal(watch)
    assert generation.offered == [] and generation.default_speculative == "ngram"
    assert _gauge("ngram") == 1.0

    feature_draft.write(folder, meta, arrays)
    with capture_logs() as logs:
        assert asyncio.run(watch.poll())
    assert [e["event"] for e in logs][-1] == "feature_draft_picked_up", logs
    assert generation.offered == [(["none", "ngram", "feature", "mix"], "feature")]
    assert _gauge("feature") == 1.0 and _gauge("ngram") == 0.0


def test_under_auto_a_picked_up_draft_joins_the_sources_auto_chooses_among(export, tmp_path):
    """`make up` starts with ``auto``: the draft is offered (as ``feature`` and ``mix``) and auto
    stays the default, the gauge naming it before and after."""
    folder = tmp_path / "draft"
    watch, generation = _watch(export, folder)
    generation.default_speculative = "auto"
    say_default("auto")
    meta, arrays = _draft_arrays(export)
    feature_draft.write(folder, meta, arrays)
    with capture_logs() as logs:
        assert asyncio.run(watch.poll())
    picked = [e for e in logs if e["event"] == "feature_draft_picked_up"]
    assert picked and picked[0]["default"] == "auto" and picked[0]["replaced"] == "auto", logs
    assert generation.offered == [(["none", "ngram", "feature", "mix"], "auto")]
    assert _gauge("auto") == 1.0  # a switch to "feature" would have set it to 0


def _gauge(source: str) -> float | None:
    return REGISTRY.get_sample_value("pipeshard_speculation_default", {"source": source})


def test_a_draft_lands_whole_weights_first_then_its_meta_file(export, tmp_path, monkeypatch):
    meta, arrays = _draft_arrays(export)
    renamed: list[str] = []
    real = os.replace
    monkeypatch.setattr(os, "replace", lambda a, b: (renamed.append(Path(b).name), real(a, b))[1])
    feature_draft.write(tmp_path / "d", meta, arrays)
    assert renamed == [WEIGHTS, feature_draft.META]
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == sorted(renamed)  # no partial file left


def test_a_fleet_started_without_a_draft_watches_the_folder_its_training_writes(export):
    assert draft_watch_args(export, []) == ["--feature-draft-watch", str(draft_folder(export))]
    assert draft_watch_args(export, ["--feature-draft", "d"]) == []
    assert draft_watch_args(export, [], "off") == []


def test_make_up_without_a_draft_trains_it_and_its_coordinator_watches_for_it(export, monkeypatch, tmp_path):
    """`pipeshard up` with no draft: the coordinator speculates with prompt lookup and watches the
    folder the training writes, and the training is launched (it was not: the start passed the
    coordinator's speculation arguments where the draft's belonged)."""
    import argparse

    from pipeshard.services import fleet_cli

    monkeypatch.chdir(tmp_path)
    seen: dict = {}

    def start_fleet(shards, stages, run_dir, **kwargs):
        seen["coordinator"] = kwargs["extra_coordinator_args"]
        return object()

    def start_training(shards, mode, draft_args):
        seen["draft_args"] = draft_args
        raise RuntimeError("stop before anything prints")

    monkeypatch.setattr(fleet_cli, "ensure_shards", lambda model, stages, weights: export)
    monkeypatch.setattr(fleet_cli, "start_fleet", start_fleet)
    monkeypatch.setattr(fleet_cli, "start_background_training", start_training)
    root = argparse.ArgumentParser()
    fleet_cli.register(root.add_subparsers())
    with pytest.raises(RuntimeError, match="stop before"):
        fleet_cli.run_up(root.parse_args(["up"]))
    assert seen["draft_args"] == []  # no draft: the training starts
    assert seen["coordinator"] == [
        "--speculative",
        "auto",
        "--feature-draft-watch",
        str(draft_folder(export)),
    ]


def test_pipeshard_top_shows_the_source_the_coordinators_gauge_says():
    from pipeshard.services.fleet_status import Scrape, speculation_source

    def scrape(default: str, replaced: str) -> Scrape:
        name = "pipeshard_speculation_default"
        return Scrape(
            at=0.0,
            samples={
                (name, frozenset({("source", default)})): 1.0,
                (name, frozenset({("source", replaced)})): 0.0,
            },
        )

    assert speculation_source(scrape("ngram", "feature")) == "ngram"
    assert speculation_source(scrape("feature", "ngram")) == "feature"  # after the pick-up
    assert speculation_source(None) == "-"
