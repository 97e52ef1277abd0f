"""Real-model fixtures for the model tests, each loaded once per session."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def gguf_tokenizer():
    """The tokenizer transformers builds straight from the GGUF: the reference for ids (12 s to load)."""
    from transformers import AutoTokenizer

    from pipeshard.model.fetch import locate_gguf

    gguf = locate_gguf(progress=print)
    return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)


@pytest.fixture(scope="session")
def tokenizer(smollm2_dir: Path):
    """The repaired tokenizer as shipped in the converted folder."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)
