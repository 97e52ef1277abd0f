"""A running fleet picks up the feature draft its background training writes (`make up` without a
draft: services/draft_training.py, services/coordinator/draft_watch.py).

A real coordinator and 2 INT4 stages start as `make up` starts them, ``auto`` choosing among
prompt lookup and plain, with a watched, empty draft folder. A damaged draft landing there is
refused with a log naming why, and serving goes on as before; the test's trained draft landing
there (weights, then the meta file, each by a rename, as the trainer writes them) is offered to new
requests, which auto tries first with ``mix`` and ``feature`` (each measured once) and which equal
plain greedy token for token; a request already streaming keeps its source.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest

from pipeshard.clients.client import GenerateResult, PipeshardClient, fold
from pipeshard.services.launcher import Fleet, default_speculation
from pipeshard.shard.draft_folder import WEIGHTS
from pipeshard.shard.feature_draft import META
from tests.speculation import test_feature

eagle_draft = test_feature.eagle_draft  # the trained test draft (its folder is reused once trained)

pytestmark = pytest.mark.slow

TOKENS = 64


def _events(fleet: Fleet, event: str) -> list[dict]:
    lines = fleet.process("coordinator").log.read_text().splitlines()
    return [json.loads(line) for line in lines if f'"{event}"' in line]


def _logged(fleet: Fleet, event: str, timeout_s: float = 120) -> dict:
    deadline = time.monotonic() + timeout_s
    while not (found := _events(fleet, event)):
        assert time.monotonic() < deadline, f"the coordinator never logged {event}"
        time.sleep(0.2)
    return found[-1]


def _land(source: Path, folder: Path, weights: bytes | None = None) -> None:
    """The draft's files into ``folder`` the way the trainer writes them: whole, meta last."""
    folder.mkdir(exist_ok=True)
    partial = folder / ".landing"
    if weights is None:
        shutil.copyfile(source / WEIGHTS, partial)
    else:
        partial.write_bytes(weights)
    os.replace(partial, folder / WEIGHTS)
    shutil.copyfile(source / META, partial)
    os.replace(partial, folder / META)


@pytest.fixture(scope="module")
def watched(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("drafts") / "smollm2-eagle-v8192"


@pytest.fixture(scope="module")
def fleet(smollm2_export, fleet_factory, watched):
    speculation, _ = default_speculation([])  # what `pipeshard up` passes without a draft
    watch = ["--feature-draft-watch", str(watched), "--feature-draft-poll-s", "0.2"]
    return fleet_factory(smollm2_export(2, "int4"), 2, extra_coordinator_args=speculation + watch)


@pytest.mark.timeout(3600)  # the first run trains the test's draft (a few minutes, more when loaded)
def test_a_running_fleet_refuses_a_damaged_draft_then_picks_up_a_whole_one(
    fleet,
    watched,
    eagle_draft,
    prompts,
):
    with PipeshardClient(fleet.coordinator, timeout_s=900) as client:
        before = client.generate(prompts[0], max_tokens=TOKENS, ignore_eos=True)
        assert before.speculative == "ngram"  # auto's first arm, measured once

        # A truncated weights file (what an interrupted copy leaves) is refused by name.
        whole = (eagle_draft / WEIGHTS).read_bytes()
        _land(eagle_draft, watched, weights=whole[: len(whole) // 2])
        refused = _logged(fleet, "feature_draft_refused")
        assert WEIGHTS in refused["reason"] and refused["default"] == "auto", refused
        still = client.generate(prompts[0], max_tokens=TOKENS, ignore_eos=True)
        assert still.speculative == "none" and still.token_ids == before.token_ids  # plain, measured once
        assert not _events(fleet, "feature_draft_picked_up")

        # The whole draft lands while a request streams: new requests take it, that one keeps its own.
        running = client.responses(prompts[1], max_tokens=TOKENS, ignore_eos=True)
        streaming = GenerateResult()
        for response in running:
            fold(streaming, response)
            if streaming.token_ids:
                break
        _land(eagle_draft, watched)
        picked = _logged(fleet, "feature_draft_picked_up")
        assert picked["replaced"] == picked["default"] == "auto", picked
        assert picked["folder"] == str(watched) and "mix" in picked["offered"], picked
        for response in running:
            fold(streaming, response)
        assert streaming.speculative in ("ngram", "none")  # chosen before the draft came

        used = []
        for prompt in prompts[:4]:
            default = client.generate(prompt, max_tokens=TOKENS, ignore_eos=True)
            plain = client.generate(prompt, max_tokens=TOKENS, ignore_eos=True, speculative="none")
            assert default.token_ids == plain.token_ids, prompt
            used.append(default.speculative)
            if default.speculative in ("mix", "feature"):
                assert default.verify_steps > 0, prompt  # it did draft
        assert used[:2] == ["mix", "feature"], used  # the draft's sources, each measured once first
        assert (
            streaming.token_ids
            == client.generate(prompts[1], max_tokens=TOKENS, ignore_eos=True, speculative="none").token_ids
        )
