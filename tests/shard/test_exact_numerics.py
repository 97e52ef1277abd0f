"""``exact`` precision on INT4 shards: regrouping rows keeps every logit within 1e-3 of one-row
decoding and never changes a greedy token (teacher-forced, so every grouping sees one sequence).

At `fast` (the CPU plugin's own choice) the same comparisons differ by up to about 1.6 (argmax changes):
these tests fail if ``exact`` loses a property it needs (docs/BENCHMARKS.md, bench-numerics)."""

from __future__ import annotations

import pytest

from pipeshard.shard.chain import LocalChain
from pipeshard.shard.numerics import batch_logits, blocks_for, chain_logits, max_abs_delta
from pipeshard.shard.prompting import Prompter
from pipeshard.shard.runtime import ShardRunner

pytestmark = pytest.mark.slow

TOLERANCE = 1e-3
NEW_TOKENS = 40
PROMPTS = ("Explain how a refrigerator keeps food cold.", "List five fruits that are red.")


# One stage repeats the two-stage case without its stage boundary: extended.
@pytest.fixture(
    scope="module", params=[pytest.param(1, marks=pytest.mark.extended, id="1s"), pytest.param(2, id="2s")]
)
def exact_chain(request, smollm2_export):
    """(runners at ``exact``, [(prompt + greedy continuation, prompt length)] for each prompt)."""
    export = smollm2_export(request.param, "int4")
    chain = LocalChain(export, "exact")
    prompter = Prompter.from_dir(export)
    seqs = []
    for prompt in PROMPTS:
        ids = prompter.encode("", [("user", prompt)])
        out = chain.generate_greedy(ids, NEW_TOKENS, ignore_eos=True)
        seqs.append((ids + out.token_ids[:-1], len(ids)))
    return chain.runners, seqs


@pytest.mark.parametrize("k", [1, 3, 7])
def test_verify_rows_match_one_row_steps(exact_chain, k):
    runners, seqs = exact_chain
    for seq, p in seqs:
        plain = chain_logits(runners, seq, blocks_for(len(seq), 0, p, 1))
        verify = chain_logits(runners, seq, blocks_for(len(seq), 0, p, k + 1))
        delta = max_abs_delta(verify, plain, start=p - 1)
        assert delta.argmax_changes == 0 and delta.max_abs <= TOLERANCE, delta


@pytest.mark.parametrize("chunk", [0, 5, 16])
def test_chunked_prefill_matches_one_row_decoding(exact_chain, chunk):
    runners, seqs = exact_chain
    for seq, p in seqs:
        one_row = chain_logits(runners, seq, blocks_for(len(seq), 1, p, 1))
        chunked = chain_logits(runners, seq, blocks_for(len(seq), chunk, p, 1))
        delta = max_abs_delta(chunked, one_row)
        assert delta.argmax_changes == 0 and delta.max_abs <= TOLERANCE, delta


def test_rows_of_different_prompts_sharing_inferences_match_each_alone(smollm2_export):
    export = smollm2_export(1, "int4")
    runner = ShardRunner(export, 0, "exact")  # its own compilation, batch only (bench/numerics.py)
    chain = LocalChain(export, "exact")
    prompter = Prompter.from_dir(export)
    seqs = []
    for prompt in PROMPTS:
        ids = prompter.encode("", [("user", prompt)])
        seqs.append((ids + chain.generate_greedy(ids, 24, ignore_eos=True).token_ids[:-1], len(ids)))
    assert seqs[0][1] != seqs[1][1]  # different lengths: the shorter prompt is left-padded
    together = batch_logits(runner, [s for s, _ in seqs], [p for _, p in seqs])
    for (seq, p), got in zip(seqs, together, strict=True):
        alone = chain_logits(chain.runners, seq, blocks_for(len(seq), 0, p, 1))
        delta = max_abs_delta(got, alone)
        assert delta.argmax_changes == 0 and delta.max_abs <= TOLERANCE, delta
