"""No model hub is reachable: every entry point calls :func:`set_offline_defaults` first."""

from __future__ import annotations

import os


def set_offline_defaults() -> None:
    """Set HF_HUB_OFFLINE=1 and TRANSFORMERS_OFFLINE=1 unless the user chose otherwise."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
