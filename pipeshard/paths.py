"""Default locations, each overridable by an environment variable (docs/SERVICES.md, Default ports)."""

from __future__ import annotations

import os
from pathlib import Path

DEFAULT_MODEL = "smollm2-135m-instruct"


def repo_root() -> Path:
    """The working directory the user runs pipeshard from (paths are relative to it)."""
    return Path.cwd()


def models_dir() -> Path:
    return Path(os.environ.get("PIPESHARD_MODELS_DIR", repo_root() / "models"))


def shards_dir() -> Path:
    return Path(os.environ.get("PIPESHARD_SHARDS_DIR", repo_root() / "shards"))


def certs_dir() -> Path:
    """Fleet CA, node certificates and the client token of ``make up SECURE=1``."""
    return Path(os.environ.get("PIPESHARD_CERTS_DIR", repo_root() / "certs"))


def default_model_dir() -> Path:
    return models_dir() / DEFAULT_MODEL


def export_name(model: str, stages: int, weights: str) -> str:
    """Folder name of an export: ``<model>-<N>s-<weights>``."""
    return f"{model}-{stages}s-{weights}"


def feature_draft_name(model: str, vocab: int | None) -> str:
    """Folder name of a trained eagle draft (``pipeshard distil --kind eagle``): ``<model>-eagle[-v<N>]``."""
    return f"{model}-eagle{'' if vocab is None else f'-v{vocab}'}"


def draft_heads_name(model: str, heads: int, vocab: int | None) -> str:
    """Folder name of trained draft heads (``pipeshard distil --kind medusa``): ``<model>-medusa<K>[-v<N>]``
    (K heads, a head slice of N ids)."""
    return f"{model}-medusa{heads}{'' if vocab is None else f'-v{vocab}'}"


def draft_export_name(model: str, layers: int, vocab: int | None, weights: str) -> str:
    """Folder name of a self-draft export: ``<model>-draft<K>[-v<N>]-<weights>``."""
    return f"{model}-draft{layers}{'' if vocab is None else f'-v{vocab}'}-{weights}"
