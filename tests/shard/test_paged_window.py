"""Local (sliding-window) layers on the paged backend hold only their window's blocks: tiny Gemma 3
(a 4-token window on three of its four layers) at 2 stages, fp32, over sequences several blocks
long. Greedy equals HF's with the local blocks given back as the window moves, in whole and chunked
prefill, two sequences sharing the steps; a rewind or a capture that would need a given-back block
is refused by name; a sequence that starts afresh gets its blocks back."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pipeshard.errors import InvalidArgument
from pipeshard.shard.paged import PagedRow, PagedShard

pytestmark = pytest.mark.slow

PROMPT, NEW_TOKENS = 40, 60  # 100 positions: past the 128-position context's 3rd block of 32


def _prompt(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=PROMPT, dtype=np.int64)


def _hf_greedy(hf, prompt: np.ndarray, n: int) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.from_numpy(prompt)[None], max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def gemma(tiny_model, tiny_export):
    _, hf = tiny_model("gemma3_text")
    shards = [PagedShard(tiny_export("gemma3_text", 2), s, "f32", 1, cache_bytes=4 << 20) for s in (0, 1)]
    return hf, shards


def _generate(shards, prompts: dict[str, np.ndarray], chunk: dict[str, int], n: int) -> dict[str, list[int]]:
    """Greedy for every sequence at once: each step carries one row per sequence still going."""
    pending = {s: [p[i : i + chunk[s]] for i in range(0, len(p), chunk[s])] for s, p in prompts.items()}
    out: dict[str, list[int]] = {s: [] for s in prompts}
    while any(len(v) < n for v in out.values()):
        seqs = [s for s in prompts if len(out[s]) < n]
        rows = {s: pending[s].pop(0) for s in seqs}
        last = {s: not pending[s] for s in seqs}
        hidden = shards[0].step([PagedRow(s, rows[s]) for s in seqs])
        logits = shards[1].step(
            [PagedRow(s, h, logits=int(last[s])) for s, h in zip(seqs, hidden, strict=True)]
        )
        for s, lg in zip(seqs, logits, strict=True):
            if last[s]:
                out[s].append(int(lg[-1].argmax()))
                pending[s] = [np.array([out[s][-1]], dtype=np.int64)]
    return out


def test_local_layers_give_back_blocks_behind_the_window_and_greedy_equals_hf(gemma):
    hf, shards = gemma
    prompts = {"whole": _prompt(1), "chunked": _prompt(2)}
    want = {s: _hf_greedy(hf, p, NEW_TOKENS) for s, p in prompts.items()}
    capacity = PROMPT + NEW_TOKENS
    for shard in shards:
        assert shard.window == 4 and shard.local_block_bytes > 0
        for s in prompts:
            shard.open(s, capacity)
    try:
        got = _generate(shards, prompts, {"whole": PROMPT, "chunked": 7}, NEW_TOKENS)
        assert got == want
        for shard in shards:
            bt = shard.block_tokens
            usage = shard.usage()
            # 99 positions cached, the last step started at 98: every global block stays reserved,
            # the local layers keep the blocks from the one that step's window (95..98) began in.
            length = shard.length("whole")
            kept = shard.blocks_for(length) - (length - 1 - shard.window + 1) // bt
            assert usage.blocks_used == 2 * shard.blocks_for(capacity)
            assert kept == 2 and usage.local_blocks_used == 2 * kept
            reserved = shard.blocks_for(capacity)
            global_bytes = shard.block_bytes - shard.local_block_bytes
            held = shard.held_bytes("whole")
            assert held == reserved * global_bytes + kept * shard.local_block_bytes
            assert held < reserved * shard.block_bytes  # what every layer holding the context takes
            with pytest.raises(InvalidArgument) as err:
                shard.rewind("whole", bt)  # its window lies in a given-back block
            assert err.value.field == "length"
            with pytest.raises(InvalidArgument) as err:
                shard.export_kv("whole", length)
            assert err.value.field == "positions"
            shard.rewind("whole", length - 2)  # a rewind within the kept blocks is fine
    finally:
        for shard in shards:
            for s in prompts:
                shard.free(s)
    for shard in shards:
        assert shard.usage().local_blocks_used == 0 and shard.usage().blocks_used == 0


def test_a_sequence_reset_to_the_start_gets_its_local_blocks_back(gemma):
    hf, shards = gemma
    prompt = _prompt(3)
    want = _hf_greedy(hf, prompt, NEW_TOKENS)
    for shard in shards:
        shard.open("again", PROMPT + NEW_TOKENS)
    try:
        assert _generate(shards, {"again": prompt}, {"again": 16}, NEW_TOKENS)["again"] == want
        for shard in shards:
            shard.rewind("again", 0)
        assert _generate(shards, {"again": prompt}, {"again": PROMPT}, NEW_TOKENS)["again"] == want
    finally:
        for shard in shards:
            shard.free("again")
