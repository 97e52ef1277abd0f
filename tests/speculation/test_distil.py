"""Distilled drafts: training raises agreement with the target, the export plugs in as the
self-draft, and speculative greedy with it stays token-for-token target-only greedy."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pipeshard.errors import InvalidArgument
from pipeshard.exporter.distil import TrainableDraft, distil, label, read_texts, synthetic_prompts, train
from pipeshard.exporter.draft import plan_draft
from pipeshard.exporter.truncate import truncate_model
from pipeshard.services.coordinator.generation import Generation
from pipeshard.services.coordinator.in_process import local_ring
from pipeshard.services.coordinator.sampling import SamplingParams
from pipeshard.services.coordinator.speculation.sources import DraftSources
from pipeshard.shard.prompting import Prompter
from tests.speculation.conftest import TOKENS, generate

pytestmark = pytest.mark.slow

QUIET = dict(isolate=False, convert_tokenizer=False, progress=lambda event: None)
ANSWERS = [
    ("Name a color.", "Blue is a calm color. Blue is the color of the sky and the sea."),
    ("Say something about cats.", "Cats are curious animals. Cats sleep a lot and cats love to play."),
    ("What is rain?", "Rain is water that falls from clouds. Rain helps plants grow."),
    ("Describe bread.", "Bread is a food made from flour, water and yeast. Bread is baked."),
]


@pytest.fixture(scope="module")
def texts_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("texts") / "answers.jsonl"
    path.write_text("".join(json.dumps({"prompt": p, "text": t}) + "\n" for p, t in ANSWERS))
    return path


@pytest.fixture(scope="module")
def distilled(smollm2_dir, smollm2_export, texts_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("distil") / "smollm2-distil1-v4096"
    return distil(
        smollm2_dir,
        smollm2_export(1, "fp32"),
        out,
        layers=1,
        vocab=4096,
        texts=texts_file,
        epochs=8,
        batch=2,
        held_out=0.25,
        **QUIET,
    )


def test_training_raises_agreement_with_the_target(smollm2_dir, smollm2_export, texts_file, tmp_path):
    target = smollm2_export(1, "fp32")
    samples = label(target, read_texts(texts_file, target), lambda *a: None)
    truncate_model(smollm2_dir, tmp_path / "prefix", 1)
    draft = TrainableDraft(tmp_path / "prefix", plan_draft(smollm2_dir, 1, 4096).vocab_ids)
    before = draft.agreement(samples)
    train(draft, samples, epochs=8, lr=1e-3, batch=2, seed=0, report=lambda *a: None)
    after = draft.agreement(samples)
    assert after >= before + 0.2, (before, after)


def test_distilled_draft_is_an_untied_one_stage_export(distilled):
    config = json.loads((distilled.folder / "config.json").read_text())
    assert config["num_hidden_layers"] == 1 and config["tie_word_embeddings"] is False
    manifest = json.loads((distilled.export.path / "manifest.json").read_text())
    assert manifest["num_stages"] == 1
    assert manifest["draft"]["layers"] == 1 and manifest["draft"]["source_layers"] == 30
    assert manifest["stages"][0]["outputs"][0]["shape"][-1] == 4096
    assert 0.0 <= distilled.agreement_before <= 1.0 and 0.0 <= distilled.agreement_after <= 1.0


def test_speculation_with_the_distilled_draft_is_exact(
    distilled, smollm2_export, spec_prompt_ids, greedy_reference
):
    target = smollm2_export(1, "fp32")
    prompter = Prompter.from_dir(target)
    drafts = DraftSources(target, self_draft=distilled.export.path)
    generation = Generation(local_ring(target, "f32"), prompter.tokenizer, prompter.eos_ids, drafts=drafts)
    for p in (0, 4):
        out = generate(
            generation, spec_prompt_ids[p], SamplingParams(max_tokens=TOKENS, ignore_eos=True), "self", 3
        )
        assert out.token_ids == greedy_reference(1, p), f"prompt {p}"
        assert out.verify_steps > 0 and out.accepted_tokens <= out.draft_tokens


def test_bad_distil_input_names_what_was_wrong(smollm2_dir, smollm2_export, tmp_path):
    target = smollm2_export(1, "fp32")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "text": "b"}\n{"prompt": "a"}\n')
    with pytest.raises(InvalidArgument) as err:
        read_texts(bad, target)
    assert err.value.field == "texts" and "bad.jsonl:2" in str(err.value)
    with pytest.raises(InvalidArgument) as err:
        synthetic_prompts(0)
    assert err.value.field == "prompts"
    with pytest.raises(InvalidArgument) as err:
        distil(smollm2_dir, target, tmp_path / "out", layers=30, **QUIET)
    assert err.value.field == "draft_layers" and not (tmp_path / "out").exists()


def test_cli_refuses_a_target_that_is_not_an_export(tmp_path):
    run = subprocess.run(
        [sys.executable, "-m", "pipeshard.cli", "distil", "--target", str(tmp_path), "--layers", "2"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2 and "`target`" in run.stderr, run.stderr
