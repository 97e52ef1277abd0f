"""What every trained draft folder shares (a feature draft, draft heads): a JSON meta file beside
``weights.npz`` of named arrays, written by ``pipeshard distil`` and read where the draft runs,
and accepted only for the weights it was trained on. A draft belongs to the target's weights, not
to a split: its fingerprint is the manifest's model fingerprint, the same for every export (split,
weight format) of the same weights.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipeshard.errors import FailedPrecondition, InvalidArgument
from pipeshard.shard.manifest import load_manifest

WEIGHTS = "weights.npz"


@dataclass(frozen=True)
class DraftFolder:
    """One kind of draft folder: how errors name it, its meta file and the arrays it holds."""

    what: str  # "feature draft", "draft heads": the messages' subject
    parameter: str  # the parameter a bad folder's InvalidArgument names
    meta_file: str
    arrays: tuple[str, ...]

    def holds(self, folder: Path) -> bool:
        return (Path(folder) / self.meta_file).is_file()

    def read(self, folder: Path) -> dict:
        """The folder's meta as written."""
        path = Path(folder) / self.meta_file
        if not path.is_file():
            raise InvalidArgument(self.parameter, f"{folder} holds no {self.what} ({self.meta_file})")
        return json.loads(path.read_text())

    def write(self, folder: Path, meta: dict, arrays: dict[str, np.ndarray]) -> None:
        missing = [name for name in self.arrays if name not in arrays]
        if missing:
            raise InvalidArgument(self.parameter, f"missing arrays: {', '.join(missing)}")
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        # Each file lands whole by a rename, the meta file last: a reader that sees the meta file
        # (a running coordinator watching for a draft trained in the background) sees whole weights.
        partial = folder / f".{WEIGHTS}.partial"
        with partial.open("wb") as out:
            # numpy's stubs type the named arrays as if one could be the ``allow_pickle`` flag
            np.savez(out, **{name: arrays[name] for name in self.arrays})  # type: ignore[arg-type]
        os.replace(partial, folder / WEIGHTS)
        partial = folder / f".{self.meta_file}.partial"
        partial.write_text(json.dumps(meta, indent=2) + "\n")
        os.replace(partial, folder / self.meta_file)

    def check_target(
        self, folder: Path, fingerprint: str, hidden_size: int, vocab_size: int, target_export: Path
    ) -> None:
        """A draft trained on one model's features is refused for another, naming both
        fingerprints; any export of the same weights is accepted."""
        target = load_manifest(Path(target_export)).model
        if fingerprint != target.fingerprint:
            raise FailedPrecondition(
                f"{self.what} {folder}: trained for model fingerprint {fingerprint}; "
                f"the target {target_export} is {target.fingerprint}"
            )
        if hidden_size != target.hidden_size or vocab_size != target.vocab_size:
            raise FailedPrecondition(f"{self.what} {folder}: sizes do not match the target's")
