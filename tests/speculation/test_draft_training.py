"""A fleet that starts without a feature draft trains one in the background (services/draft_training.py).

Fast (a fake trainer): `make up` / `make wan-up`'s start launches the trainer once per export,
detached and at nice 19, into the folder the next start looks in, and says so; a start while it
runs does not launch another; a fleet with a draft, or with the training off, launches nothing;
a bad mode is refused by name. Extended (the real trainer, a short run): the draft it writes is
the one the next fleet start offers.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path

import pytest

from pipeshard.errors import InvalidArgument
from pipeshard.services.draft_training import (
    ENV,
    draft_folder,
    start_background_training,
    trainer_command,
)
from pipeshard.services.launcher import feature_draft_args
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
    draft = ["--feature-draft", "somewhere", "--speculative", "feature"]
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
    assert feature_draft_args(export) == ["--feature-draft", str(training.folder), "--speculative", "feature"]
