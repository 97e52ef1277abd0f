"""The manifest is written and read by one typed class: ``Manifest.to_dict`` gives back the JSON
an export holds, for exports written before this class wrote them and for new ones."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeshard.shard.manifest import MANIFEST, Manifest, load_manifest


@pytest.mark.slow
@pytest.mark.parametrize("stages, weights", [(2, "int4"), (1, "fp32")])
def test_real_export_manifest_round_trips(smollm2_export, stages, weights):
    """An export of the real model (cached across sessions, so possibly written by an older exporter)."""
    export = smollm2_export(stages, weights)
    raw = json.loads((export / MANIFEST).read_text())
    assert Manifest.from_dict(export, raw).to_dict() == raw


@pytest.mark.slow
def test_real_draft_manifest_round_trips(smollm2_draft):
    export = smollm2_draft(2, 4096, "int4")
    raw = json.loads((export / MANIFEST).read_text())
    assert Manifest.from_dict(export, raw).to_dict() == raw


def test_written_manifest_round_trips_and_is_what_the_export_returned(tiny_model, tmp_path):
    from pipeshard.exporter.draft import DraftPlan
    from pipeshard.exporter.export import export_model

    folder, _ = tiny_model("llama")
    out = tmp_path / "draft"
    plan = DraftPlan(layers=1, source_layers=2, vocab_ids=(0, 1, 2, 5))
    result = export_model(
        folder,
        out,
        stages=1,
        weights="fp32",
        isolate=False,
        convert_tokenizer=False,
        draft=plan,
        progress=lambda e: None,
    )
    raw = json.loads((out / MANIFEST).read_text())
    assert result.manifest.to_dict() == raw
    loaded = load_manifest(out)
    assert loaded.to_dict() == raw
    assert loaded.draft is not None and loaded.draft.vocab_ids == "stage_0/draft_vocab_ids.npy"
    assert loaded.stages[0].kv_reorder is not None
    assert loaded.tokenizer.error == "the model folder has no tokenizer files"
    assert loaded.split == (1,) and loaded.num_stages == 1


def test_a_missing_key_is_named():
    from pipeshard.errors import FailedPrecondition

    with pytest.raises(FailedPrecondition, match="hidden_size"):
        Manifest.from_dict(Path("x"), {"model": {"fingerprint": "f", "num_layers": 1}, "stages": []})
