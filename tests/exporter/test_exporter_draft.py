"""Self-draft exports (first k layers + norm + head, optionally a vocabulary slice), HF drafts."""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from pipeshard.errors import InvalidArgument
from pipeshard.exporter.draft import (
    VOCAB_FILE,
    ensure_draft_export,
    export_draft,
    plan_draft,
)
from pipeshard.exporter.export import export_model
from pipeshard.exporter.truncate import truncate_model
from pipeshard.shard.chain import LocalChain
from pipeshard.shard.drafts import check_same_tokenizer, resolve_draft
from pipeshard.shard.manifest import load_manifest, verify_export, verify_shard
from pipeshard.shard.runtime import ShardRunner

QUIET = dict(isolate=False, convert_tokenizer=False, progress=lambda event: None)
PREFILL, DECODE = 7, 5


def _logits(export: Path, ids: np.ndarray) -> np.ndarray:
    """Draft logits at every position: a prefill, then single-token steps."""
    session = ShardRunner(export, 0, precision="f32").new_session()
    out = [session.run(ids[:, :PREFILL], return_last=PREFILL)]
    out += [session.run(ids[:, t : t + 1]) for t in range(PREFILL, ids.shape[1])]
    return np.concatenate(out, axis=1)


@pytest.fixture(scope="module")
def tiny_draft(tiny_model, tmp_path_factory):
    """Factory: (family, layers, vocab, weights) -> a draft export of a tiny model, built once."""
    cache: dict[tuple, Path] = {}

    def get(family: str, layers: int, vocab: int | None = None, weights: str = "fp32") -> Path:
        key = (family, layers, vocab, weights)
        if key not in cache:
            folder, _ = tiny_model(family)
            out = tmp_path_factory.mktemp("drafts") / f"{family}-draft{layers}-{vocab}-{weights}"
            export_draft(folder, out, layers=layers, vocab=vocab, weights=weights, **QUIET)
            cache[key] = out
        return cache[key]

    return get


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_draft_matches_truncated_hf(family, tiny_model, tiny_draft, tmp_path):
    """The draft is the HF model cut to 2 layers (+ final norm + head), untied and tied heads."""
    from transformers import AutoModelForCausalLM

    folder, _ = tiny_model(family)
    export = tiny_draft(family, 2)
    m = verify_export(export).to_dict()
    assert m["draft"] == {"layers": 2, "vocab_ids": None, "source_layers": 4}
    assert m["num_stages"] == 1 and m["split"] == [2] and m["model"]["num_layers"] == 2
    assert m["stages"][0]["state_variables"][-1] == "past_key_values.1.value"
    assert ShardRunner(export, 0).vocab_ids is None

    hf = AutoModelForCausalLM.from_pretrained(truncate_model(folder, tmp_path / "hf2", 2)).eval()
    assert hf.config.num_hidden_layers == 2
    ids = np.random.default_rng(3).integers(0, 256, size=(1, PREFILL + DECODE), dtype=np.int64)
    with torch.no_grad():
        ref = hf(torch.from_numpy(ids)).logits.numpy()
    np.testing.assert_allclose(_logits(export, ids), ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("weights", ["fp32", "int4"])
def test_vocab_slice_equals_full_draft_at_ids(weights, tiny_draft):
    """The sliced head's logits are the full draft's logits at the kept ids (the same head rows,
    quantized per row alike); the ids file is checksummed and read by the runner."""
    full, sliced = tiny_draft("llama", 2, None, weights), tiny_draft("llama", 2, 40, weights)
    m = verify_shard(sliced, 0).to_dict()
    rel = f"stage_0/{VOCAB_FILE}"
    assert m["draft"] == {"layers": 2, "vocab_ids": rel, "source_layers": 4} and rel in m["files"]
    vocab_ids = ShardRunner(sliced, 0).vocab_ids
    assert vocab_ids.dtype == np.int64 and vocab_ids.tolist() == list(range(40))  # no tokenizer: id order
    assert m["stages"][0]["outputs"][0]["shape"] == [-1, -1, 40]
    ids = np.random.default_rng(5).integers(0, 256, size=(1, PREFILL + DECODE), dtype=np.int64)
    want = _logits(full, ids)[..., vocab_ids]
    np.testing.assert_allclose(_logits(sliced, ids), want, rtol=1e-5, atol=1e-5)
    # LocalChain maps the argmax column back to a token id: greedy over the kept ids only.
    tokens = LocalChain(sliced, "f32").generate_greedy([3, 4, 5], 6, eos_ids=[]).token_ids
    session, token, want_tokens = ShardRunner(full, 0, "f32").new_session(), np.array([[3, 4, 5]]), []
    for _ in range(6):
        token = np.array([[vocab_ids[np.argmax(session.run(token)[0, -1, vocab_ids])]]])
        want_tokens.append(int(token[0, 0]))
    assert tokens == want_tokens


def test_vocab_ranking_follows_merges_and_keeps_specials(tiny_model, tmp_path):
    """Ranking = base alphabet, then merge products in merge order (not id order); specials always in."""
    folder, _ = tiny_model("llama")
    model = tmp_path / "m"
    shutil.copytree(folder, model)
    vocab = {"a": 0, "b": 1, "c": 2, "ab": 5, "abc": 4, "ca": 3}  # merges create ab, ca, abc in that order
    tokenizer = {
        "added_tokens": [{"id": 200, "content": "<|end|>", "special": True}],
        "model": {"type": "BPE", "vocab": vocab, "merges": ["a b", "c a", "ab c"]},
    }
    (model / "tokenizer.json").write_text(json.dumps(tokenizer))
    # eos 2 (generation_config.json), special 200, base a b c (0 1 2), merges ab (5) then ca (3)
    assert plan_draft(model, 1, 6).vocab_ids == (0, 1, 2, 3, 5, 200)
    assert plan_draft(model, 1, None).vocab_ids is None
    with pytest.raises(InvalidArgument) as err:
        plan_draft(model, 1, 1)  # fewer than the 2 special ids
    assert err.value.field == "draft_vocab"


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"layers": 0}, "draft_layers"),
        ({"layers": 4}, "draft_layers"),  # all 4 layers: that is the target, not a draft
        ({"layers": "2"}, "draft_layers"),
        ({"layers": 2, "vocab": 257}, "draft_vocab"),
        ({"layers": 2, "vocab": 0}, "draft_vocab"),
        ({"layers": 2, "weights": "int3"}, "weights"),
    ],
)
def test_bad_draft_request_names_field(kwargs, field, tiny_model, tmp_path):
    folder, _ = tiny_model("llama")
    with pytest.raises(InvalidArgument) as err:
        export_draft(folder, tmp_path / "out", **kwargs, **QUIET)
    assert err.value.field == field, str(err.value)
    assert not (tmp_path / "out").exists()


def test_draft_is_one_stage_and_truncate_checks_layers(tiny_model, tmp_path):
    folder, _ = tiny_model("llama")
    with pytest.raises(InvalidArgument) as err:
        export_model(folder, tmp_path / "out", stages=2, draft=plan_draft(folder, 2), **QUIET)
    assert err.value.field == "stages"
    with pytest.raises(InvalidArgument) as err:
        truncate_model(folder, tmp_path / "t", 4)
    assert err.value.field == "layers" and not (tmp_path / "t").exists()


def test_cli_draft_flags(tiny_model, tmp_path, capsys, monkeypatch):
    from pipeshard.exporter import cli

    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers(dest="command"))
    folder, _ = tiny_model("llama")
    base = ["export", "--model", str(folder), "--weights", "fp32", "--in-process", "--no-ov-tokenizer"]
    args = parser.parse_args([*base, "--draft-vocab", "64"])
    assert args.func(args) == 2 and "`draft_vocab` needs --draft-layers" in capsys.readouterr().err
    args = parser.parse_args([*base, "--draft-layers", "2", "--stages", "2"])
    assert args.func(args) == 2 and "`stages`" in capsys.readouterr().err
    monkeypatch.setenv("PIPESHARD_SHARDS_DIR", str(tmp_path))
    args = parser.parse_args([*base, "--draft-layers", "1", "--draft-vocab", "64"])
    assert args.func(args) == 0 and "draft of 1 layers" in capsys.readouterr().out
    out = tmp_path / f"{folder.name}-draft1-v64-fp32"
    assert verify_export(out).to_dict()["draft"]["layers"] == 1 and len(ShardRunner(out, 0).vocab_ids) == 64


def test_ensure_draft_export(tiny_model, tiny_export, tmp_path, monkeypatch):
    """An HF folder is exported once into the cache and reused; an export passes through."""
    import pipeshard.exporter.draft as draft_mod

    folder, _ = tiny_model("llama")
    hf2 = truncate_model(folder, tmp_path / "tiny-2l", 2)
    cache = tmp_path / "cache"
    out = ensure_draft_export(hf2, cache, "fp32", progress=lambda event: None, isolate=False)
    assert out.parent == cache and out.name.startswith("tiny-2l-") and out.name.endswith("-fp32")
    m = verify_export(out).to_dict()
    assert m["num_stages"] == 1 and m["model"]["num_layers"] == 2 and "draft" not in m

    def no_export(*args, **kwargs):
        raise AssertionError("exported again")

    monkeypatch.setattr(draft_mod, "export_model", no_export)
    assert ensure_draft_export(hf2, cache, "fp32") == out
    one_stage = tiny_export("llama", 1)
    assert ensure_draft_export(one_stage, cache) == one_stage
    for source, text in (
        (tiny_export("llama", 2), "2-stage export"),
        (tmp_path / "empty", "neither a pipeshard export"),
        (tmp_path / "nowhere", "neither a pipeshard export"),
    ):
        (tmp_path / "empty").mkdir(exist_ok=True)
        with pytest.raises(InvalidArgument, match=text) as err:
            ensure_draft_export(source, cache)
        assert err.value.field == "speculative" and str(source) in str(err.value)


def test_resolve_draft_exports_in_a_subprocess(tiny_model, tmp_path):
    """Serving code never imports the exporter: an HF draft is exported by a child process."""
    folder, _ = tiny_model("llama")
    hf2 = truncate_model(folder, tmp_path / "tiny-2l", 2)
    cache = tmp_path / "cache"
    out = resolve_draft(hf2, cache, "fp32")
    assert out.parent == cache and out.name.endswith("-fp32") and verify_export(out).num_stages == 1
    assert resolve_draft(hf2, cache, "fp32") == out and resolve_draft(out, cache) == out
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{}")
    with pytest.raises(InvalidArgument, match=r"exporting the draft .* failed: ") as err:
        resolve_draft(broken, cache)
    assert err.value.field == "speculative"


def test_check_same_tokenizer(tiny_export, tmp_path):
    vocab = {f"t{i}": i for i in range(256)}
    tokenizer = {"added_tokens": [], "model": {"type": "BPE", "vocab": vocab, "merges": []}}
    exports = []
    for name in ("target", "draft"):
        export = tmp_path / name
        shutil.copytree(tiny_export("llama", 1), export)
        (export / "tokenizer.json").write_text(json.dumps(tokenizer))
        exports.append(export)
    target, draft = exports
    check_same_tokenizer(target, draft)

    vocab["t1"], vocab["t2"] = 2, 1
    (draft / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(InvalidArgument, match="different tokenizer") as err:
        check_same_tokenizer(target, draft)
    assert err.value.field == "speculative"

    manifest = load_manifest(draft).to_dict()
    manifest["model"]["vocab_size"] = 300
    (draft / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(InvalidArgument, match="vocab size 300"):
        check_same_tokenizer(target, draft)
    with pytest.raises(InvalidArgument, match=r"no tokenizer\.json"):
        check_same_tokenizer(target, tiny_export("llama", 1))
