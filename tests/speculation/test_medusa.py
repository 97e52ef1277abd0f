"""Medusa draft heads, unit level: the heads folder (fingerprint refusal, the compiled forward
against a numpy reference), the trainer's labels, the final stage's greedy path through a row, the
candidates on the wire and the ``medusa`` source's chains and trees."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from unittest.mock import patch

import numpy as np
import pytest

from pipeshard.errors import FailedPrecondition, InvalidArgument
from pipeshard.exporter.medusa import Labels, MedusaHeads, accuracy, labels
from pipeshard.exporter.target_texts import FeatureTexts
from pipeshard.services.coordinator.speculation.medusa import MedusaDrafter
from pipeshard.services.coordinator.speculation.sources import DraftSources
from pipeshard.services.coordinator.speculation.tree import ROOT, TreeShape
from pipeshard.services.stage.domain import ReturnMode, RowKind, StepOutput, StepRow
from pipeshard.services.stage.main import StageSettings, load_heads
from pipeshard.services.stage.step_engine import check_heads, greedy_path_end
from pipeshard.services.stage.wire import head_candidates, result_from_output
from pipeshard.shard import draft_heads
from pipeshard.shard.draft_heads import DraftHeads, DraftHeadsMeta, HeadCandidates
from pipeshard.shard.manifest import load_manifest

K, H, S, V = 3, 16, 32, 64


def _arrays(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "head_ids": np.sort(rng.choice(V, S, replace=False)).astype(np.int64),
        "head": rng.standard_normal((S, H)).astype(np.float16),
        "weight": (rng.standard_normal((K, H, H)) * 0.3).astype(np.float32),
        "bias": (rng.standard_normal((K, H)) * 0.1).astype(np.float32),
    }


def _heads(folder: Path, fingerprint: str = "sha256:aa") -> tuple[Path, dict]:
    arrays = _arrays()
    meta = DraftHeadsMeta(draft_heads.KIND, fingerprint, K, H, V)
    draft_heads.write(folder, meta, arrays)
    return folder, arrays


def _reference(arrays: dict, feature: np.ndarray) -> np.ndarray:
    z = np.einsum("koi,i->ko", arrays["weight"], feature) + arrays["bias"]
    z = feature + z / (1.0 + np.exp(-z))
    return z @ arrays["head"].astype(np.float32).T  # [K, S]


def test_compiled_heads_match_a_numpy_reference(tmp_path):
    folder, arrays = _heads(tmp_path / "heads")
    heads = DraftHeads(folder)
    rng = np.random.default_rng(1)
    for _ in range(5):
        feature = rng.standard_normal(H).astype(np.float32)
        got = heads.candidates(feature, 4, row=2)
        logits = _reference(arrays, feature)
        probs = np.exp(logits - logits.max(1, keepdims=True))
        probs /= probs.sum(1, keepdims=True)
        best = np.argsort(-logits, axis=1)[:, :4]
        assert got.row == 2 and got.token_ids.shape == (K, 4)
        # int8 head rows: the best candidate is the reference's, the probabilities close to it
        assert (got.token_ids[:, 0] == arrays["head_ids"][best[:, 0]]).all()
        want = np.take_along_axis(probs, best, axis=1)
        assert np.abs(got.probabilities - want).max() < 0.05
        assert (np.diff(got.probabilities, axis=1) <= 1e-6).all()


def test_heads_for_another_model_are_refused_naming_both_fingerprints(smollm2_export, tmp_path):
    """By the stage at start, before it compiles; heads for the same weights pass under any split;
    a stage other than the final one refuses them by name."""
    one, two = smollm2_export(1, "int4"), smollm2_export(2, "int4")
    model = load_manifest(two).model
    other = tmp_path / "other"
    draft_heads.write(other, DraftHeadsMeta(draft_heads.KIND, "sha256:" + "0" * 64, K, H, V), _arrays())
    with pytest.raises(FailedPrecondition) as info:
        load_heads(StageSettings(stage=1, shards=two, draft_heads=other), 2)
    assert model.fingerprint in str(info.value) and "sha256:" + "0" * 64 in str(info.value)
    meta = DraftHeadsMeta(draft_heads.KIND, model.fingerprint, K, model.hidden_size, model.vocab_size)
    same = tmp_path / "same"
    (same).mkdir()
    (same / draft_heads.META).write_text(json.dumps(meta.to_dict()))
    for export in (one, two):
        draft_heads.check_target(draft_heads.read_meta(same), export, same)
    with pytest.raises(InvalidArgument) as info:
        load_heads(StageSettings(stage=0, shards=two, draft_heads=same), 2)
    assert "draft_heads" in str(info.value) and "final stage" in str(info.value)


def test_labels_are_the_greedy_continuation_of_the_answer():
    # prompt 5, 6, 7 (the target would not have said 6 or 7), then its greedy answer 1, 2, 3, 4
    ids = np.array([5, 6, 7, 1, 2, 3, 4])
    top = np.array([9, 9, 1, 2, 3, 4, 8])  # argmax at each position: the token after it
    data = FeatureTexts([ids], [np.arange(7, dtype=np.float32)[:, None].repeat(2, 1)], [top])
    column = np.arange(16)
    got = labels(data, 2, column)
    # positions 2 (the prompt's last) .. 5 have a next token the target chose
    assert got.features[:, 0].tolist() == [2, 3, 4, 5]
    assert got.tokens.tolist() == [[2, 3], [3, 4], [4, 8], [8, -1]]
    assert got.columns[3, 1] == -100


def _row(tokens, parents=(), returned=None, **kw) -> StepRow:
    n = len(tokens)
    returned = n if returned is None else returned
    return StepRow(
        session_id="s",
        step_id=1,
        kind=RowKind.VERIFY if returned > 1 else RowKind.DECODE,
        positions=np.arange(n),
        activations=np.asarray([tokens]),
        return_last=returned,
        tree_parents=tuple(parents),
        draft_heads=4,
        head_path_tokens=tuple(tokens[n - returned :]),
        **kw,
    )


def test_greedy_path_end_follows_a_chain_and_a_tree():
    # chain: pending 10, drafts 11 12 13; the target agrees with 11 and 12, not 13
    assert greedy_path_end(_row([10, 11, 12, 13]), np.array([11, 12, 99, 5])) == 2
    assert greedy_path_end(_row([10, 11]), np.array([7, 1])) == 0
    # tree after two pending tokens [3, 10]: nodes 20 (root child), 21 (root child), 22 (child of 21)
    tokens, parents = [3, 10, 20, 21, 22], (-1, 0, 1, 1, 3)
    row = _row(tokens, parents, returned=4)
    assert greedy_path_end(row, np.array([21, 0, 22, 0])) == 3  # root -> 21 -> 22
    assert greedy_path_end(row, np.array([20, 5, 0, 0])) == 1
    assert greedy_path_end(row, np.array([99, 0, 0, 0])) == 0


def test_a_row_asking_for_heads_is_checked():
    check_heads(_row([1, 2, 3]))
    with pytest.raises(InvalidArgument, match="head_path_tokens"):
        check_heads(replace(_row([1, 2, 3]), head_path_tokens=(1,)))
    with pytest.raises(InvalidArgument, match="draft_heads"):
        check_heads(_row([1, 2], return_mode=ReturnMode.LOGITS))


def test_candidates_cross_the_wire_as_ids_and_fp16():
    c = HeadCandidates(
        2, np.array([[5, 6], [7, 8], [9, 1]]), np.array([[0.5, 0.25], [0.9, 0.05], [0.3, 0.2]])
    )
    out = StepOutput(row=_row([1, 2, 3]), head_candidates=c)
    got = head_candidates(result_from_output(out, []))
    assert got.row == 2 and got.token_ids.tolist() == c.token_ids.tolist()
    assert np.allclose(got.probabilities, c.probabilities, atol=1e-3)
    assert head_candidates(result_from_output(StepOutput(row=_row([1])), [])) is None


def _candidates() -> HeadCandidates:
    ids = np.array([[10, 11, 12], [20, 21, 22], [30, 31, 32]])
    probs = np.array([[0.6, 0.3, 0.1], [0.5, 0.4, 0.1], [0.9, 0.05, 0.05]])
    return HeadCandidates(0, ids, probs)


def test_medusa_chain_takes_each_heads_best_and_falls_back_to_lookup():
    drafter = MedusaDrafter(3)
    drafter.observe_heads(_candidates())
    assert drafter.propose([1, 2], 2, None).tokens == [10, 20]
    assert drafter.propose([1, 2], 8, None).tokens == [10, 20, 30]
    drafter.observe_heads(None)  # no candidates: prompt lookup
    assert drafter.propose([4, 5, 6, 4, 5], 2, None).tokens == [6, 4]


def test_medusa_tree_keeps_the_best_nodes_within_its_shape():
    drafter = MedusaDrafter(3)
    drafter.observe_heads(_candidates())
    tree = drafter.propose_tree([1], TreeShape(2, 3))
    assert len(tree.leaves()) <= 2 and tree.depth <= 3 and len(tree.nodes) <= 6
    paths = {tuple(tree.nodes[i].token for i in tree.path(leaf)) for leaf in tree.leaves()}
    # best first: 10 (.6), 10-20 (.3), 11 (.3), 10-20-30 (.27), 10-21 would be a third path
    assert (10, 20, 30) in paths and any(p[0] == 11 for p in paths)
    assert [tree.nodes[i].token for i in tree.main] == [10, 20, 30]
    first = [tree.nodes[i].token for i in tree.children(ROOT)]
    assert first == [10, 11]
    assert abs(tree.path_prob(tree.main[-1]) - 0.6 * 0.5 * 0.9) < 1e-6
    chain = drafter.propose_tree([1], TreeShape(1, 2))
    assert [n.token for n in chain.nodes] == [10, 20]


def test_medusa_is_offered_only_where_the_final_stage_runs_heads(tmp_path):
    export = tmp_path / "export"
    without = DraftSources(export)
    assert "medusa" not in without.names
    with pytest.raises(InvalidArgument) as info:
        without.validate("medusa")
    assert "medusa" in str(info.value) and "--draft-heads" in str(info.value)
    assert "medusa" in DraftSources(export, heads=3).names


def test_held_out_accuracy_counts_top_k_and_the_chain():
    torch = pytest.importorskip("torch")
    model = MedusaHeads(torch.eye(4), torch.arange(4), 2)  # W = 0: every head scores the feature itself
    features = np.array([[5, 1, 0, 0], [0, 5, 1, 0]], np.float32)
    columns = np.array([[0, 0], [1, 2]])  # the second position's head 2 wants its second best
    per_head, chain = accuracy(model, Labels(features, columns, columns.copy()))
    assert per_head[0]["top1"] == 1.0 and per_head[1]["top1"] == 0.5 and per_head[1]["top3"] == 1.0
    assert chain == 1 + (2 + 1) / 2


def test_distil_medusa_refuses_jsonl_texts(smollm2_export, tmp_path):
    import subprocess
    import sys

    target = str(smollm2_export(1, "int4"))
    cli = [sys.executable, "-m", "pipeshard.cli", "distil", "--kind", "medusa", "--target", target]
    done = subprocess.run(
        [*cli, "--texts", str(tmp_path / "t.jsonl"), "--out", str(tmp_path / "o")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and "`texts`" in done.stderr and not (tmp_path / "o").exists(), done.stderr


def test_up_finds_heads_trained_for_the_exports_weights(tmp_path):
    from pipeshard.services.launcher import draft_heads_args

    export = tmp_path / "m-1s-int4"  # its manifest is the patched one below
    model = SimpleNamespace(name="m", fingerprint="sha256:mine")
    for name, fingerprint in (("m-medusa3-v8", "sha256:other"), ("m-medusa4-v8", "sha256:mine")):
        meta = DraftHeadsMeta(draft_heads.KIND, fingerprint, K, H, V)
        (tmp_path / name).mkdir()
        (tmp_path / name / draft_heads.META).write_text(json.dumps(meta.to_dict()))
    with patch("pipeshard.services.launcher.load_manifest", return_value=SimpleNamespace(model=model)):
        assert draft_heads_args(export) == ["--draft-heads", str(tmp_path / "m-medusa4-v8")]
        assert draft_heads_args(export, "off") == []
        assert draft_heads_args(export, "/x") == ["--draft-heads", "/x"]
        model.fingerprint = "sha256:none"
        assert draft_heads_args(export) == []
