"""``auto`` (speculation/choice.py): each default request gets the source measured fastest on this
fleet, or plain when none beats it, and probes the others now and then.

The fleet here is a fake one: a round trip (4 hops of ``hop_s``, the stages' compute, a verify
step costing the stages twice a plain one) and per source the tokens a traversal keeps and the
draft's time on the coordinator, from which each request's decode rate follows. Over a slow hop the
source keeping the most tokens per traversal measures best (``mix``); on one node the draft's own
time and the verify cost weigh, and prompt lookup does; where no source keeps enough, plain."""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest

from pipeshard.services.coordinator.generation import Generation, Summary
from pipeshard.services.coordinator.speculation.choice import (
    EXPLORE_EVERY,
    MAX_PROBE_SPACING,
    PLAIN,
    SourceChoice,
    among,
)
from pipeshard.services.coordinator.speculation.sources import DraftSources
from tests.coordinator.engine_fakes import greedy
from tests.coordinator.test_engine_pipelined import PROMPT, StatefulStage, Tokenizer, collect

COMPUTE_S = 0.030  # the stages' compute of a plain step; a verify step costs twice that


@dataclass(frozen=True)
class Source:
    tokens_per_traversal: float
    draft_s: float  # the draft's time per traversal on the coordinator


GOOD = {
    "ngram": Source(2.2, 0.0),
    "mix": Source(2.5, 0.012),
    "feature": Source(1.5, 0.012),
}
# Drafts that never hold: no source keeps a token beyond the target's own to pay for its verify
# steps and its drafting.
POOR = {name: Source(1.0, 0.020) for name in GOOD}


def decode_rate(source: str, hop_s: float, sources: dict[str, Source], rng: random.Random) -> float:
    """A request's decode tokens per second on the fake fleet (a prompt's luck: +-10%)."""
    round_trip = 4 * hop_s
    if source == PLAIN:
        rate = 1.0 / (round_trip + COMPUTE_S)
    else:
        s = sources[source]
        rate = s.tokens_per_traversal / (round_trip + 2 * COMPUTE_S + s.draft_s)
    return rate * rng.uniform(0.9, 1.1)


def serve(hop_s: float, sources: dict[str, Source], requests: int = 96) -> list[str]:
    """``requests`` default requests one after another, each measured when it ends: the choices."""
    choice, rng = SourceChoice(), random.Random(7)
    offered = ["none", "ngram", "feature", "mix"]
    picks = []
    for _ in range(requests):
        source = choice.choose(offered)
        picks.append(source)
        choice.observe(source, 64, decode_rate(source, hop_s, sources, rng))
    return picks


@pytest.mark.parametrize(("hop_s", "best"), [(0.100, "mix"), (0.025, "mix"), (0.0, "ngram")])
def test_each_default_request_gets_the_source_that_measures_best_on_this_link(hop_s, best):
    picks = serve(hop_s, GOOD)
    assert picks[:4] == ["mix", "feature", "ngram", PLAIN]  # each measured once first
    settled = Counter(picks[16:])
    assert settled.most_common(1)[0][0] == best, settled
    # Exploiting all but every EXPLORE_EVERY-th request, which probes the arm seen longest ago.
    assert settled[best] >= len(picks[16:]) * (1 - 1.5 / EXPLORE_EVERY), settled
    assert all(settled[arm] > 0 for arm in among(GOOD)), settled


@pytest.mark.parametrize("hop_s", [0.0, 0.100])
def test_where_no_source_pays_for_itself_requests_decode_plainly_and_still_probe(hop_s):
    picks = serve(hop_s, POOR)
    settled = Counter(picks[16:])
    assert settled.most_common(1)[0][0] == PLAIN, settled
    # every source is still probed; on one node, where each measures far slower than plain, less
    # often than every EXPLORE_EVERY-th request
    assert all(settled[arm] > 0 for arm in GOOD), settled
    probes = sum(n for arm, n in settled.items() if arm != PLAIN)
    assert probes <= len(picks[16:]) // EXPLORE_EVERY - (2 if hop_s == 0.0 else 0), settled


def test_an_arm_far_slower_than_the_best_is_probed_rarer_than_a_close_one():
    """A probe costs its request the gap to the best: plain over 100 ms hops (half the rate) waits
    MAX_PROBE_SPACING times longer than a source within a few percent of the best."""
    choice = SourceChoice()
    rates = {"mix": 10.0, "ngram": 9.5, PLAIN: 4.0}
    picks = []
    for _ in range(400):
        source = choice.choose(["none", "ngram", "mix"])
        picks.append(source)
        choice.observe(source, 64, rates[source])
    settled = Counter(picks[16:])
    assert settled[PLAIN] >= 1, settled
    spacing = EXPLORE_EVERY * MAX_PROBE_SPACING
    assert settled[PLAIN] <= len(picks[16:]) / spacing + 1, settled
    assert settled["ngram"] >= len(picks[16:]) / (3 * EXPLORE_EVERY), settled


def test_a_source_that_turns_slow_loses_its_requests():
    """The link changes (or the text does): the probes and the window follow it."""
    choice, rng = SourceChoice(), random.Random(3)
    offered = ["none", "ngram", "mix"]
    for hop_s, best in ((0.100, "mix"), (0.0, "ngram"), (0.100, "mix")):
        picks = []
        for _ in range(96):
            source = choice.choose(offered)
            picks.append(source)
            choice.observe(source, 64, decode_rate(source, hop_s, GOOD, rng))
        assert Counter(picks[48:]).most_common(1)[0][0] == best, (hop_s, Counter(picks))


def test_only_adaptive_requests_long_enough_and_of_a_candidate_count():
    choice = SourceChoice()
    choice.observe("ngram", 4, 50.0)  # too short: its start, not the source
    choice.observe("self", 64, 50.0)  # a draft model: not among auto's sources
    assert choice.rates() == {}
    choice.observe("ngram", 64, 20.0)
    choice.observe("ngram", 64, 30.0)
    assert choice.rates() == {"ngram": 25.0}
    # measured sources are not handed out again just to be measured
    assert choice.choose(["none", "ngram"], peek=True) == PLAIN  # (the warm-up's: nothing counted)
    assert choice.choose(["none", "ngram"]) == PLAIN
    assert choice.choose(["none", "ngram"]) == "ngram"


async def _generate(generation: Generation, speculative: str = "", k: int = 0) -> tuple[list[int], Summary]:
    """One request on the fake stateful stage, chains only (the fake verifies no tree rows)."""
    return await collect(generation, 24, speculative=speculative, k=k, tree="off")


def test_a_default_request_under_auto_names_the_source_it_used_and_feeds_the_choice():
    generation = Generation(
        StatefulStage(), Tokenizer(), set(), drafts=DraftSources(Path(".")), default_speculative="auto"
    )

    learnt = []

    async def requests():
        first = await _generate(generation)
        second = await _generate(generation)
        learnt.append(generation._sources["ngram"].tried)
        fixed = await _generate(generation, "ngram", k=3)  # a client's own choice wins
        return first, second, fixed

    (out1, first), (out2, second), (out3, fixed) = asyncio.run(requests())
    expected = greedy(PROMPT, 24)
    assert out1 == out2 == out3 == expected
    assert first.speculative == "ngram" and first.verify_steps > 0  # offered: ngram, then plain
    assert second.speculative == PLAIN and second.verify_steps == 0
    assert fixed.speculative == "ngram"
    rates = generation.choice.rates()
    # the two default requests measured their arms; the fixed K request is no evidence for auto
    assert rates["ngram"] == pytest.approx(first.tok_s) and rates[PLAIN] == pytest.approx(second.tok_s)
    assert generation.choice.chosen == 2
    # adaptive K's memory of a source is learnt from adaptive requests only (a fixed K's deep
    # drafts keep less per draft)
    assert learnt[0] > 0 and generation._sources["ngram"].tried == learnt[0]
