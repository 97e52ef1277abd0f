"""The ``feature`` draft source: an EAGLE-style draft reading the target's final hidden state.

Fast: the coordinator's numpy forward is the training module's; chains and trees have the shapes
asked for; a draft trained for other weights is refused naming both fingerprints (any split of
the same weights is accepted); the training prompts are none of the benchmark's; generated
training texts are kept and reused only under the settings that made them.
Slow (real INT4 shards at ``exact``): the final stage's features are the LM head's input on both
KV backends; greedy decoding with a (quickly) trained feature draft is token for token plain
greedy over 128 tokens on 1 and 2 stages; sampling with it follows the target's distribution.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from pipeshard.errors import FailedPrecondition
from pipeshard.exporter.distil import synthetic_prompts
from pipeshard.exporter.eagle import EagleDraft, distil_eagle
from pipeshard.exporter.target_texts import FeatureTexts, load_texts, save_texts
from pipeshard.services.coordinator.generation import Generation
from pipeshard.services.coordinator.in_process import local_ring
from pipeshard.services.coordinator.sampling import SamplingParams
from pipeshard.services.coordinator.speculation.feature import FeatureDrafter
from pipeshard.services.coordinator.speculation.sources import DraftSources
from pipeshard.services.coordinator.speculation.tree import TreeShape
from pipeshard.shard import feature_draft
from pipeshard.shard.chain import LocalChain
from pipeshard.shard.manifest import load_manifest
from pipeshard.shard.prompting import Prompter
from tests.speculation.conftest import SPEC_PROMPTS, generate, shards_root

H, V, S = 16, 64, 24


def _random_draft(folder: Path, fingerprint: str = "sha256:test", seed: int = 0) -> EagleDraft:
    torch.manual_seed(seed)
    embed = torch.randn(V, H).half().float()  # the file keeps fp16 rows
    ids = torch.arange(0, V, V // S)[:S]
    draft = EagleDraft(embed, torch.randn(S, H), ids, 1e-5, intermediate=32)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(0.3 * torch.randn_like(p))
    meta = feature_draft.FeatureDraftMeta("eagle", fingerprint, H, V, 32, 1e-5)
    feature_draft.write(folder, meta, draft.arrays())
    return draft


def test_numpy_forward_is_the_training_modules(tmp_path):
    draft = _random_draft(tmp_path)
    model = feature_draft.FeatureDraftModel(tmp_path)
    f = np.random.default_rng(1).standard_normal((5, H)).astype(np.float32)
    tokens = np.array([1, 7, 63, 0, 22])
    out, logits = model.step(f, tokens)
    with torch.no_grad():
        want_out, want_logits = draft.step(torch.as_tensor(f), torch.as_tensor(tokens))
    np.testing.assert_allclose(out, want_out.numpy(), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(logits, want_logits.numpy(), rtol=1e-4, atol=1e-4)


def test_drafter_waits_for_a_feature_then_drafts_chains_and_trees(tmp_path):
    _random_draft(tmp_path)
    drafter = FeatureDrafter(feature_draft.FeatureDraftModel(tmp_path))
    assert drafter.propose([1, 2], 4, None).tokens == []  # no feature seen yet
    drafter.observe(np.ones(H, dtype=np.float32))
    chain = drafter.propose([1, 2], 4, None)
    assert len(chain.tokens) == 4 and all(0 <= t < V for t in chain.tokens)
    tree = drafter.propose_tree([1, 2], TreeShape(3, 4))
    assert len(tree.nodes) == 12 and 1 <= tree.depth <= 4
    # No node's path is likelier than its parent's (so the likeliest nodes form a tree).
    scores = [tree.path_prob(i) for i in range(len(tree.nodes))]
    assert all(scores[i] <= scores[n.parent] for i, n in enumerate(tree.nodes) if n.parent >= 0)
    # ``main`` follows the likeliest child from the root, and starts with the chain's first draft.
    assert tree.main and tree.nodes[tree.main[0]].token == chain.tokens[0]
    for parent, child in zip([-1, *tree.main], tree.main, strict=False):
        assert tree.nodes[child].prob == max(tree.nodes[c].prob for c in tree.children(parent))

    def softmax(row):
        e = np.exp(row - row.max())
        return e / e.sum()

    sampled = drafter.propose([1, 2], 3, (softmax, np.random.default_rng(0)))
    assert len(sampled.probs) == 3 and all(abs(p.sum() - 1) < 1e-6 and p.size == V for p in sampled.probs)
    drafter.observe(None)  # a step without features: idle, no stale drafts
    assert drafter.propose([1, 2], 4, None).tokens == []
    assert not drafter.propose_tree([1, 2], TreeShape(3, 4)).nodes


def test_a_chain_continued_over_its_own_guesses_is_its_longer_chain(tmp_path):
    """Traversals in flight: a step drafted while the one before it travels starts from the last
    answered position and chains over the guesses on its own predicted features, so continuing
    from the draft's own proposal gives what one longer proposal gives."""
    _random_draft(tmp_path)
    drafter = FeatureDrafter(feature_draft.FeatureDraftModel(tmp_path))
    context = [1, 2]
    assert drafter.propose([*context, 5, 6], 3, None, guessed=2).tokens == []  # no feature yet
    drafter.observe(np.ones(H, dtype=np.float32))
    chain = drafter.propose(context, 8, None).tokens
    for n in range(1, 5):
        assert drafter.propose(context + chain[:n], 3, None, guessed=n).tokens == chain[n : n + 3]
    # Levels computed since the last observe are reused: a row built on the rows in flight
    # computes only its own (the level fed its last guess and its drafts after the first).
    levels = []
    real_level = drafter._level
    drafter._level = lambda *args: levels.append(1) or real_level(*args)  # type: ignore[method-assign]
    assert len(drafter.propose(context + chain[:8], 3, None, guessed=8).tokens) == 3
    assert len(levels) == 3  # chain[7]'s level, then two drafts
    drafter.observe(np.ones(H, dtype=np.float32))  # new features: the chain starts over
    levels.clear()
    assert drafter.propose(context + chain[:2], 1, None, guessed=2).tokens == chain[2:3]
    assert len(levels) == 2
    # The root is the answered position, not the last guess: other guesses, other continuations.
    other = [t for t in range(V) if t != chain[0]][:1]
    assert drafter.propose(context + other, 3, None, guessed=1).tokens != chain[1:4]


def test_generated_texts_are_reused_only_under_the_key_that_made_them(tmp_path):
    rng = np.random.default_rng(0)
    lengths = (5, 3, 7)
    data = FeatureTexts(
        [rng.integers(0, V, n) for n in lengths],
        [rng.standard_normal((n, H)).astype(np.float16) for n in lengths],  # as the wire returns them
        [rng.integers(0, V, n) for n in lengths],
        minutes=3.5,
    )
    path = tmp_path / "draft" / "texts.npz"
    save_texts(path, "sha256:a prompts=3 max_tokens=8 seed=0", data)
    back = load_texts(path, "sha256:a prompts=3 max_tokens=8 seed=0")
    for name in ("ids", "features", "argmax"):
        assert [a.tolist() for a in getattr(back, name)] == [a.tolist() for a in getattr(data, name)]
    assert back.minutes == 3.5  # what generating them took, for the draft's total
    assert load_texts(path, "sha256:b prompts=3 max_tokens=8 seed=0") is None
    assert load_texts(tmp_path / "missing.npz", "sha256:a prompts=3 max_tokens=8 seed=0") is None


def test_training_prompts_are_not_benchmark_or_test_prompts():
    from bench.spec import KINDS

    held = {text for _, text in KINDS} | {m[-1][1] for _, m in SPEC_PROMPTS}
    assert not held & set(synthetic_prompts(3000))


def test_a_draft_for_other_weights_is_refused_naming_both_fingerprints(smollm2_export, tmp_path):
    one, two = smollm2_export(1, "int4"), smollm2_export(2, "int4")
    target = load_manifest(two).model.fingerprint
    _random_draft(tmp_path / "other", fingerprint="sha256:" + "0" * 64)
    with pytest.raises(FailedPrecondition) as refused:
        DraftSources(two, feature=tmp_path / "other")
    assert "sha256:" + "0" * 64 in str(refused.value) and target in str(refused.value)
    # The same weights under any split (1 or 2 stages) are accepted: the check is the fingerprint.
    model = load_manifest(one).model
    meta = feature_draft.FeatureDraftMeta("eagle", target, model.hidden_size, model.vocab_size, 32, 1e-5)
    for export in (one, two):
        feature_draft.check_target(meta, export, tmp_path)


# -- slow: real shards ----------------------------------------------------------------------


@pytest.fixture(scope="session")
def eagle_draft(smollm2_dir, smollm2_export) -> Path:
    """A feature draft trained briefly on the 1-stage INT4 target (reused from the test cache): the
    decoder kind, whose per-request cache and tree mask the exactness tests then cover."""
    out = shards_root() / "smollm2-eagle-test"
    distil_eagle(
        smollm2_dir,
        smollm2_export(1, "int4"),
        out,
        prompts=12,
        max_tokens=40,
        epochs=8,
        batch=64,
        arch="decoder",
    )
    return out


@pytest.mark.slow
def test_final_stage_features_are_the_lm_heads_input_on_both_backends(smollm2_export, smollm2_dir):
    from pipeshard.shard.paged import PagedRow, PagedShard

    export = smollm2_export(2, "int4")
    ids = Prompter.from_dir(export).encode("Name three rivers in Europe.", [])
    chain = LocalChain(export, "exact")
    logits = chain.step(np.asarray([ids]), return_last=len(ids))[0]
    features = chain.sessions[-1].features()
    assert features.shape == (len(ids), chain.manifest.model.hidden_size)
    from safetensors.numpy import load_file  # SmolLM2 ties its LM head to the input embedding

    embed = load_file(str(smollm2_dir / "model.safetensors"))["model.embed_tokens.weight"].astype(np.float32)
    agree = (np.argmax(features @ embed.T, -1) == logits.argmax(-1)).mean()
    assert agree > 0.8, agree  # the export quantizes its head; the embedding here is the f32 one
    stage0 = PagedShard(export, 0, "exact")
    last = PagedShard(export, 1, "exact")
    stage0.open("s", 256)
    last.open("s", 256)
    pos = np.arange(len(ids), dtype=np.int64)
    hidden = stage0.step([PagedRow("s", np.asarray(ids), pos)])[0]
    paged_logits, paged_features = last.step_features([PagedRow("s", hidden, pos, logits=3)])
    np.testing.assert_allclose(paged_features[0], features[-3:], atol=2e-3)
    assert (paged_logits[0].argmax(-1) == logits[-3:].argmax(-1)).all()


def _greedy_case(export: Path, draft: Path, prompt: int, tokens: int, k: int):
    prompter = Prompter.from_dir(export)
    ids = prompter.encode("", SPEC_PROMPTS[prompt][1])
    generation = Generation(
        local_ring(export, "exact"),
        prompter.tokenizer,
        prompter.eos_ids,
        drafts=DraftSources(export, feature=draft),
    )
    out = generate(generation, ids, SamplingParams(max_tokens=tokens, ignore_eos=True), "feature", k)
    expected = LocalChain(export, "exact").generate_greedy(ids, tokens, ignore_eos=True).token_ids
    return out, expected


@pytest.mark.slow
@pytest.mark.timeout(3600)  # the first run trains the test's draft (a few minutes, more when loaded)
@pytest.mark.parametrize(
    ("stages", "prompt", "k"), [pytest.param(1, 0, 4, marks=pytest.mark.extended), (2, 2, 0)]
)
def test_feature_draft_greedy_is_plain_greedy(smollm2_export, eagle_draft, stages, prompt, k):
    out, expected = _greedy_case(smollm2_export(stages, "int4"), eagle_draft, prompt, 128, k)
    assert out.token_ids == expected, next(
        i for i, (a, b) in enumerate(zip(out.token_ids, expected, strict=False)) if a != b
    )
    if k:
        assert out.verify_steps > 0 and out.accepted_tokens > 0  # the accept path was exercised


@pytest.mark.slow
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("tree", ["3x4", pytest.param("auto", marks=pytest.mark.extended)])
def test_feature_trees_on_paged_stages_are_plain_greedy(smollm2_export, eagle_draft, greedy_reference, tree):
    """Paged stages run a feature draft's tree as one masked sequence and return the features of
    its rows: the drafter reads the accepted path's, and decoding stays plain greedy."""
    import asyncio

    from pipeshard.services.coordinator.in_process import batched_ring

    export = smollm2_export(1, "int4")
    prompter = Prompter.from_dir(export)
    ids = prompter.encode("", SPEC_PROMPTS[0][1])
    generation = Generation(
        batched_ring(export, "exact", cache_bytes=96 << 20),
        prompter.tokenizer,
        prompter.eos_ids,
        drafts=DraftSources(export, feature=eagle_draft),
    )

    async def run():
        params = SamplingParams(max_tokens=128, ignore_eos=True)
        return [e async for e in generation.run(ids, params, speculative="feature", tree=tree)][-1]

    out = asyncio.run(run())
    assert out.token_ids == greedy_reference(1, 0, "int4")[:128]
    if tree != "auto":  # every step drafts a tree, and the features keep it drafting
        assert out.verify_steps > 10 and out.accepted_tokens > 0, out


@pytest.mark.slow
@pytest.mark.extended
@pytest.mark.timeout(3600)
def test_feature_draft_sampling_follows_the_target(smollm2_export, eagle_draft):
    from scipy import stats

    from tests.speculation.test_spec_sampling import _table

    export = smollm2_export(1, "int4")
    prompter = Prompter.from_dir(export)
    generation = Generation(
        local_ring(export, "exact"),
        prompter.tokenizer,
        prompter.eos_ids,
        drafts=DraftSources(export, feature=eagle_draft),
    )
    ids = prompter.encode("Once upon a time, in a small village,", [])
    plain, spec, verified = Counter(), Counter(), 0
    for seed in range(300):
        params = SamplingParams(max_tokens=3, temperature=1.0, top_k=6, seed=seed, ignore_eos=True)
        a = generate(generation, ids, params, "none", 0)
        b = generate(generation, ids, params, "feature", 3)
        verified += b.verify_steps
        plain[tuple(a.token_ids[1:])] += 1
        spec[tuple(b.token_ids[1:])] += 1
    assert verified >= 300
    table = _table(plain, spec)
    assert len(table[0]) >= 4, "the distribution is too concentrated to test"
    assert stats.chi2_contingency(table).pvalue > 1e-3, table


def test_only_feature_drafts_read_features(tmp_path):
    from pipeshard.services.coordinator.speculation.drafts import NgramDrafter

    _random_draft(tmp_path)
    assert FeatureDrafter(feature_draft.FeatureDraftModel(tmp_path)).reads_features
    assert not NgramDrafter().reads_features


def test_distil_cli_names_what_is_missing_for_each_kind(smollm2_export, tmp_path):
    import subprocess
    import sys

    target = str(smollm2_export(1, "int4"))
    cli = [sys.executable, "-m", "pipeshard.cli", "distil", "--target", target]
    token = subprocess.run(cli, capture_output=True, text=True, timeout=120)
    assert token.returncode == 2 and "`layers`" in token.stderr, token.stderr
    eagle = subprocess.run(
        [*cli, "--kind", "eagle", "--texts", str(tmp_path / "t.jsonl"), "--out", str(tmp_path / "o")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert eagle.returncode == 2 and "`texts`" in eagle.stderr and not (tmp_path / "o").exists(), eagle.stderr


def test_fleets_offer_the_draft_trained_for_their_weights_only(smollm2_export, tmp_path):
    """`make up` / `make wan-up` (``feature_draft_args``): a draft beside the export whose
    fingerprint is the export's is offered as the default ``feature``; one for other weights is not."""
    import shutil

    from pipeshard.services.launcher import feature_draft_args

    export = tmp_path / "smollm2-1s-int4"
    skip = shutil.ignore_patterns("*.bin", ".compile_cache")  # the manifest is what is read
    shutil.copytree(smollm2_export(1, "int4"), export, ignore=skip)
    model = load_manifest(export).model
    _random_draft(tmp_path / f"{model.name}-eagle-v1", fingerprint="sha256:" + "1" * 64)
    assert feature_draft_args(export) == []
    _random_draft(tmp_path / f"{model.name}-eagle-v8192", fingerprint=model.fingerprint)
    ours = str(tmp_path / f"{model.name}-eagle-v8192")
    assert feature_draft_args(export) == ["--feature-draft", ours]
    assert feature_draft_args(export, "off") == []
    # Of two drafts for these weights, the one whose held-out chain kept more.
    better = tmp_path / f"{model.name}-eagle-x-v8192"
    draft = _random_draft(better, fingerprint=model.fingerprint)
    meta = feature_draft.read_meta(better)
    trained = {"held_out_chain_of_3": 1.5}
    feature_draft.write(better, dataclasses.replace(meta, training=trained), draft.arrays())
    assert feature_draft_args(export)[1] == str(better)
    # A draft trained on texts of several kinds is compared on its greedy answers' chain.
    mixed = tmp_path / f"{model.name}-eagle-mixed-v8192"
    trained = {"held_out_chain_of_3": 1.2, "held_out_chain_of_3_by_kind": {"greedy": 1.6, "sampled": 0.8}}
    feature_draft.write(mixed, dataclasses.replace(meta, training=trained), draft.arrays())
    assert feature_draft_args(export)[1] == str(mixed)


def test_a_fleet_speculates_by_default_with_the_best_source_it_has():
    """`make up` / `make wan-up`: ``auto``, offering the trained draft when there is one, else
    prompt lookup alone; the line printed at start names the policy and what it chooses among."""
    from pipeshard.services.launcher import default_speculation

    given = ["--feature-draft", "shards/d"]
    args, said = default_speculation(given)
    assert args == ["--feature-draft", "shards/d", "--speculative", "auto"]
    assert "auto" in said and "mix" in said and "shards/d" in said
    args, said = default_speculation([])
    assert args == ["--speculative", "auto"] and "ngram" in said and "mix" not in said
    assert "KIND=eagle" in said


def test_training_stops_at_its_time_budget_with_the_rate_annealed():
    """A step that takes longer than planned shortens training instead of overrunning
    ``--train-minutes``, and the learning rate still ends at zero."""
    from pipeshard.exporter.eagle import schedule, train

    rng = np.random.default_rng(0)
    ids = [rng.integers(0, V, 30) for _ in range(4)]
    data = FeatureTexts(  # all answer: every next token is the argmax before it
        ids,
        [rng.standard_normal((30, H)).astype(np.float16) for _ in range(4)],
        [np.append(i[1:], 0) for i in ids],
    )
    torch.manual_seed(0)
    draft = EagleDraft(torch.randn(V, H), torch.randn(S, H), torch.arange(0, V, V // S)[:S], 1e-5, 32)
    ticks = iter(range(0, 10_000, 10))  # every step takes 10 s
    steps = train(
        draft, data, epochs=1000, lr=1e-3, batch=8, seed=0, report=lambda *a: None, minutes=1.0,
        clock=lambda: float(next(ticks)),
    )  # fmt: skip
    assert steps == 6  # 60 s of 10 s steps, not the 1000 epochs' 13,500
    assert schedule(1.0) == 0.0 and 0.0 < schedule(0.0) < schedule(0.05) == 1.0
    assert train(draft, data, epochs=2, lr=1e-3, batch=8, seed=0, report=lambda *a: None) == 27


def test_distil_progress_prints_every_tenth_of_a_phase(capsys):
    from pipeshard.exporter.distil_cli import _Report

    report = _Report()
    for step in range(1357):  # 1356 steps: no fraction but 0, 1/2 and 1 lands on a tenth
        report("train", step / 1356, f"step {step}")
    lines = capsys.readouterr().err.splitlines()
    assert [line.split()[2] for line in lines] == [f"{10 * t}%" for t in range(11)]


def test_soft_targets_are_the_targets_top_k_over_the_head_slice():
    """A one-hot soft target is the argmax's cross-entropy; probability on ids the head slice does
    not score is dropped (the rest renormalised); ``soft`` mixes the two losses."""
    from pipeshard.exporter.eagle import soft_loss, token_loss

    torch.manual_seed(0)
    head_ids = torch.arange(0, V, V // S)[:S]
    draft = EagleDraft(torch.randn(V, H), torch.randn(S, H), head_ids, 1e-5, 32)
    logits = torch.randn(4, S)
    label = torch.tensor([0, 3, 5, 7])
    hard = torch.nn.functional.cross_entropy(logits, label)
    one_hot_ids = head_ids[label][:, None].repeat(1, 2)
    one_hot_ids[:, 1] = 1  # 1 is off the slice (every V // S-th id is on it)
    probs = torch.tensor([[0.6, 0.4]]).repeat(4, 1).half()
    assert torch.allclose(soft_loss(draft, logits, one_hot_ids, probs), hard, atol=1e-4)
    spread_ids = torch.stack([head_ids[label], head_ids[(label + 1) % S]], 1)
    spread = soft_loss(draft, logits, spread_ids, torch.tensor([[0.5, 0.5]]).repeat(4, 1))
    assert not torch.allclose(spread, hard)
    assert torch.allclose(token_loss(draft, logits, label), hard)
    mixed = token_loss(draft, logits, label, spread_ids, torch.tensor([[0.5, 0.5]]).repeat(4, 1), 0.25)
    assert torch.allclose(mixed, 0.75 * hard + 0.25 * spread)
