"""``auto``: each request that does not choose gets the draft source that measures fastest on
this fleet, or plain decoding when none beats it.

What a source is worth depends on the fleet more than on the source: over slow hops a traversal
is mostly waiting, so the source keeping the most tokens per traversal wins (measured: ``mix``,
prompt lookup where it matches, else the feature draft); on one node a verify step costs the stages
about twice a plain one and the draft's own time counts, so only a source that keeps many tokens
pays (prompt lookup); at 25 ms per hop the feature draft's rows sent ahead were dropped two times
in three, and their compute on the stages made it slower than plain. A model of all of that (round
trip, compute, verify cost, draft cost, drops in flight) is what adaptive K prices per row
(policy.py); which source to give a request is chosen here from what requests end up measuring:
their decode tokens per second, which holds every one of those costs.

The arms are the offered sources among ``CANDIDATES`` and plain (``none``). Every request that
ran one of them under adaptive K (its own or a client's choice) adds its decode rate to that arm's
window. A new default request gets, in order: an arm neither handed out nor measured yet (each is
measured once); every ``explore_every``-th request, the arm handed out or measured longest ago among
those due a probe (so a source the link or the text made slow is probed again now and then); else
the arm with the best mean rate over its window, recent rates weighing more (before any is
measured, the first candidate). A probe of an arm measured far slower than the best costs that
request the gap (plain over 100 ms hops: a round of the benchmark 30% slower), so an arm is due
only after ``explore_every`` times the square of its gap requests since it was last seen, at most
``MAX_PROBE_SPACING`` times that (one within a few percent of the best: after about
``explore_every``). Plain as the best arm means no source pays for itself on this fleet now: the
request decodes plainly, K = 0 for every row, and the probes tell when that changes. Within a
speculating request adaptive K still drops to K = 0 wherever its text defeats the draft.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

AUTO = "auto"
PLAIN = "none"
# The sources auto chooses among, in the order tried first (the richest first).
CANDIDATES = ("mix", "feature", "ngram")
# A request with fewer decode tokens measures mostly its start, not the source.
MIN_TOKENS = 8
# Requests whose rates each arm's mean is taken over (several of each kind of prompt).
WINDOW = 16
EXPLORE_EVERY = 8
# Default requests after which a measured rate weighs half (see ``Arm.rate``).
HALF_LIFE = 16
# An arm far slower than the best waits at most this many times ``explore_every`` for its probe.
MAX_PROBE_SPACING = 4.0


def among(offered: Sequence[str]) -> list[str]:
    """The arms of a fleet offering ``offered``: its candidate sources, then plain."""
    return [s for s in CANDIDATES if s in offered] + [PLAIN]


@dataclass
class Arm:
    """One source's (or plain's) measured decode rates, each with the choice's count when it came
    in, and when the arm was last handed out or measured."""

    rates: deque[tuple[float, int]] = field(default_factory=lambda: deque(maxlen=WINDOW))
    seen: int = -1  # the choice's count when it was last handed out or measured (-1: never)

    def rate(self, now: int) -> float | None:
        """The mean rate, a sample's weight halving every ``HALF_LIFE`` choices since it came in (a
        rate from before the link or the load changed fades though the arm is seldom tried)."""
        if not self.rates:
            return None
        weights = [0.5 ** ((now - at) / HALF_LIFE) for _, at in self.rates]
        return sum(w * r for w, (r, _) in zip(weights, self.rates, strict=True)) / sum(weights)


@dataclass
class SourceChoice:
    """Per coordinator: the arms' measurements and the choice for the next default request."""

    explore_every: int = EXPLORE_EVERY
    arms: dict[str, Arm] = field(default_factory=dict)
    chosen: int = 0  # default requests given a source so far

    def choose(self, offered: Sequence[str], peek: bool = False) -> str:
        """The source (or ``none``) for the next request that did not choose; ``peek``: for one
        that does not count (the coordinator's warm-up), leaving the choice as it was."""
        arms = among(offered)
        for name in arms:
            self.arms.setdefault(name, Arm())
        fresh = [a for a in arms if self.arms[a].seen < 0]
        rates = {a: self.arms[a].rate(self.chosen) for a in arms}
        measured = [a for a in arms if rates[a] is not None]
        if fresh:
            pick = fresh[0]
        elif measured:
            best = max(measured, key=lambda a: rates[a] or 0.0)
            pick = best
            if self.chosen % self.explore_every == self.explore_every - 1:
                due = [a for a in arms if a != best and self._due(a, rates[a], rates[best] or 0.0)]
                if due:
                    pick = min(due, key=lambda a: self.arms[a].seen)
        else:
            pick = arms[0]
        if not peek:
            self.arms[pick].seen = self.chosen
            self.chosen += 1
        return pick

    def _due(self, name: str, rate: float | None, best: float) -> bool:
        """Whether ``name`` has waited long enough for a probe: the slower it measured against the
        best, the longer (an arm not measured yet is due at once)."""
        spacing = 1.0 if not rate else min(MAX_PROBE_SPACING, (best / rate) ** 2)
        return self.chosen - self.arms[name].seen >= self.explore_every * spacing

    def observe(self, source: str, tokens: int, tok_s: float) -> None:
        """A finished request that ran ``source`` under adaptive K: ``tokens`` generated at
        ``tok_s`` decode tokens per second. Others (a draft model, too short a request) are not
        counted."""
        if source in (*CANDIDATES, PLAIN) and tokens >= MIN_TOKENS and tok_s > 0.0:
            arm = self.arms.setdefault(source, Arm())
            arm.rates.append((tok_s, self.chosen))
            arm.seen = self.chosen

    def rates(self) -> dict[str, float | None]:
        """Each arm's mean measured rate (None: not measured yet), for logs and tests."""
        return {name: arm.rate(self.chosen) for name, arm in self.arms.items()}
