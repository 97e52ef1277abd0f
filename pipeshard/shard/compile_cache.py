"""Where a stage keeps its compiled models (OpenVINO's CACHE_DIR), so a restart imports the
compiled blob instead of compiling again.

One folder per export and device: by default ``<export>/.compile_cache/<device>``; with a
configured root (``--compile-cache-dir``, PIPESHARD_COMPILE_CACHE_DIR)
``<root>/<export name>-<export id>/<device>``, so one root serves many exports; ``off`` turns
caching off. OpenVINO keys each blob by the model, the device and the compile properties, so
precisions, thread counts and stages share a folder without mixing. A folder that cannot be
written (a read-only shard cache) turns caching off for that start, with a warning: the stage
still starts, it only compiles.
"""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

import structlog

from pipeshard.shard.manifest import Manifest

log = structlog.get_logger(__name__)

OFF = "off"
FOLDER = ".compile_cache"


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text)


def cache_folder(setting: str | Path | None, manifest: Manifest, device: str) -> Path | None:
    """The folder for this export and device (module doc); None when caching is off."""
    if str(setting or "").strip().lower() == OFF:
        return None
    if not setting:
        return manifest.export_dir / FOLDER / _slug(device)
    export_key = manifest.name + (
        f"-{manifest.export_id.removeprefix('sha256:')[:16]}" if manifest.export_id else ""
    )
    return Path(setting) / _slug(export_key) / _slug(device)


def writable_cache(folder: Path | None) -> Path | None:
    """``folder``, created, if this process can write there; else None and a warning."""
    if folder is None:
        return None
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".probe-"):
            pass
    except OSError as exc:
        log.warning("compile_cache_off", folder=str(folder), reason=f"{type(exc).__name__}: {exc}")
        return None
    return folder


def cache_config(setting: str | Path | None, manifest: Manifest, device: str) -> dict[str, str]:
    """The CACHE_DIR compile property for this stage ({} when off or not writable)."""
    folder = writable_cache(cache_folder(setting, manifest, device))
    return {} if folder is None else {"CACHE_DIR": str(folder)}
