"""How many tokens to draft per verify step: a fixed K, or K chosen from measurements.

Adaptive K maximises expected tokens per second of one verify step,

    rate(K) = E[tokens | K] / (T(K + 1) + K * t_draft),   E[tokens | K] = 1 + a + a^2 + ... + a^K

where ``a`` is the running per-draft acceptance of this request for the part of its source the
next draft rests on (``Drafter.part``: prompt lookup's long context matches are kept far more
often than its one-token ones, so one acceptance for both drafts on the weak ones and too little
on the strong; each starts from what earlier requests of the same draft source learnt), ``T(n)``
the measured wall time of a pipeline traversal carrying n positions and ``t_draft`` the measured
cost of one draft token. ``T`` is learned per coordinator (it is a property of the fleet and its
links), so it holds everything the link costs: round trips, compute of n positions on every stage
and the bytes of n positions per hop over the link's bandwidth. K = 0 is plain decoding; whenever
no K > 0 beats it (BloomBee's break-even: the extra bytes and compute of K + 1 positions outweigh
the round trips saved), the request falls back to plain steps, and tries K = 1 now and then so the
decision follows the link.

Batch-aware (continuous batching, issue #17): a verify row shares its step with other sessions'
rows, and its K extra positions lengthen that step for all of them. So K maximises the step's
tokens per second, not the request's alone,

    rate(K) = (R + E[tokens | K]) / (T(R + 1, n + K + 1) + K * t_draft)

where R and n are the other sessions' rows and tokens in the step (``StepLoad``; R also counts the
rows of the steps in flight, ``waiting``: drafting runs on the coordinator's one loop, so a draft
token delays their answers as much as this step's, and with 8 users at 100 ms the drafts of a
step's rows took 10-320 ms) and ``T(rows,
positions)`` the step's cost: the step keeps its rows whatever K is, a draft adds positions
only. Both come from the engine loop (engine.py): it times every step from send to result once
for all sessions, and drafts for a row knowing the rest of the step it is forming; so ``T`` is
what a step costs, not a request's wall time per step
(which in a batch includes waiting for the step under way: a flat line that made drafts look
free). ``T`` is fitted over rows and positions apart (``TimingModel``): measured on the paged
2-stage INT4 stages (docs/benchmarks-history.md, bench.spec_batch, "step cost against rows and tokens")
a position costs about 2.5 ms of CPU and a row about 1.2 ms more on a fixed cost of about 29 ms,
and a busy step's wall time adds per-row work on the coordinator (Python per session), which a
line over positions alone charged to drafts; and a step with any row of more than one token
pays a fixed ``verify`` cost once (the paged CPU stages leave their decode kernel), so the first
draft in a step of plain rows costs more than the next. Alone (R = n = 0) this is the formula above; in a
full compute-bound step a draft must be likely to be kept to pay for delaying everyone, so K
shrinks, to 0 when it does not pay; when the fixed cost (round trips) dominates, drafts stay cheap.

Draft trees (``choose_shape``): a tree of W paths and depth D is priced the same way, with its
own running acceptance per level ``a_W`` (learnt from this request's tree steps of that width,
starting optimistic: a wider tree keeps more) and the positions it computes (``nodes_W`` per
level, measured: shared prefixes make it less than W), so

    rate(W, D) = (R + E[tokens | D, a_W]) / (T(R + 1, n + 1 + nodes_W * D) + D * t_draft)

and the step takes the best (W, D) over W in {1, the source's width}: a wide tree where round
trips dominate (its extra positions cost little against a traversal), a chain or plain steps
where compute does. ``prune_floor`` is the break-even of one more node: a node whose path
probability is p adds p tokens and one position, so it pays when p / T_position exceeds the
step's tokens per second; a slow hop's floor is low (nothing pruned), a fast one's high.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

# Before K + 1 positions are measured, assume each extra position adds this share of a
# one-position traversal (CPU verify of a few rows costs little more than one row).
_PRIOR_SLOPE = 0.05
_EMA = 0.2
# A request starts from its source's acceptance with the weight of this many drafts (the weight of
# the Beta(3, 2) prior a source without history starts from): enough to skip drafting at once
# for a source that never agrees, little enough that the request's own text soon takes over.
_MEMORY_WEIGHT = 5.0
_MEMORY_DECAY = 0.98
# The per-position cost is fitted once the positions beyond one per row span this many (a
# narrower spread, e.g. a batch whose sessions all decode plainly, measures noise: the prior).
_MIN_SPAN = 4
# The step cost is fitted over this many recent steps, a step's weight halving every _HALF_LIFE.
_WINDOW = 512
_HALF_LIFE = 128
_REFIT_EVERY = 8


def ema(old: float | None, new: float) -> float:
    """Exponential moving average with weight _EMA on ``new``; the first sample (``old`` None or
    0.0, "nothing measured yet") is taken as is."""
    return new if not old else old + _EMA * (new - old)


def decayed_counts(kept: float, tried: float, decay: float, k: int, accepted: int) -> tuple[float, float]:
    """Acceptance counts after one verify of ``k`` drafts of which ``accepted`` were kept: older
    evidence weighs ``decay``; a rejection counts the one draft that failed as tried."""
    return decay * kept + accepted, decay * tried + accepted + (1 if accepted < k else 0)


@dataclass(frozen=True)
class StepLoad:
    """The rest of the step a request's next row joins (the step the engine is forming): the
    other sessions' rows and tokens; ``waiting``: the rows of the steps already in flight, whose
    answers the coordinator's drafting holds up too (it handles them on the same loop)."""

    rows: int = 0
    tokens: int = 0
    waiting: int = 0


@dataclass(frozen=True)
class StepTime:
    """One timed traversal: its rows (sessions), its positions (every row's tokens), its wall time."""

    rows: int
    positions: int
    seconds: float


@dataclass(frozen=True)
class StepCost:
    """The fitted cost of a step (seconds),

        T(rows, positions) = fixed + per_row * rows + per_position * positions
                             + verify * (positions > rows),

    a draft adds positions to its session's row, never a row; ``verify`` is what a step pays
    once when any row carries more than one token (measured on the paged CPU stages: the step
    leaves the decode kernel, about +14 ms on a 17 ms one-row step, bench.spec_batch)."""

    fixed: float
    per_row: float
    per_position: float
    verify: float = 0.0

    def seconds(self, rows: int, positions: int) -> float:
        t = (
            self.fixed
            + self.per_row * rows
            + self.per_position * positions
            + self.verify * (positions > rows)
        )
        return max(t, 1e-6)


@dataclass
class TimingModel:
    """Wall time of a traversal by its rows and positions, shared by every request of a
    coordinator (or, batched, timed by the step batcher for all of them).

    Rows and positions are fitted apart because they cost differently and K changes only the
    positions: a busy step's per-row cost (per-session work on the coordinator and the stages)
    charged to positions made drafts look as dear as rows (and a one-line fit's fixed cost
    vanish). Weighted least squares over the recent steps (newer weigh more); a term the steps
    do not identify takes its prior: no rows spread (a single session), a row costs only its
    position (``per_row`` 0); no plain steps or no verify steps, ``verify`` 0; too narrow a spread
    of drafted positions (every session decoding plainly, or K = 1 probes only), a position costs
    ``_PRIOR_SLOPE`` of a one-row, one-position step."""

    steps: deque[StepTime] = field(default_factory=lambda: deque(maxlen=_WINDOW))
    _cost: StepCost | None = field(default=None, repr=False)  # the latest fit
    _unfitted: int = field(default=0, repr=False)  # steps observed since it

    def observe(self, positions: int, seconds: float, rows: int = 1) -> None:
        self.steps.append(StepTime(rows, positions, seconds))
        self._unfitted += 1

    def cost(self) -> StepCost | None:
        """The fitted terms; None before any step was timed. Refit once a sixteenth of the window
        is new (at most every ``_REFIT_EVERY`` steps): a fit over hundreds of steps takes 0.3-0.7
        ms, which every speculative step paid (5% of a 10 ms one-node step, at K = 0 too), and
        one more step barely moves it."""
        if not self.steps:
            return None
        if self._cost is None or self._unfitted >= min(_REFIT_EVERY, max(1, len(self.steps) // 16)):
            self._cost = self._fit()
            self._unfitted = 0
        return self._cost

    def estimate(self, positions: int, rows: int = 1) -> float | None:
        cost = self.cost()
        return None if cost is None else cost.seconds(rows, positions)

    def _fit(self) -> StepCost:
        steps = list(self.steps)
        r = np.array([s.rows for s in steps], dtype=np.float64)
        p = np.array([s.positions for s in steps], dtype=np.float64)
        t = np.array([s.seconds for s in steps], dtype=np.float64)
        w = 0.5 ** (np.arange(len(steps))[::-1] / _HALF_LIFE)  # the newest step weighs 1
        verifies = p > r
        free = {
            "per_row": bool(r.max() > r.min()),
            "verify": bool(verifies.any() and not verifies.all()),
            # with ``verify`` fitted, the drafted positions of verify steps must spread
            "per_position": bool(np.ptp((p - r)[verifies] if verifies.any() else p - r) >= _MIN_SPAN),
        }
        columns = {"per_row": r, "verify": verifies.astype(np.float64), "per_position": p}
        # The prior per-position cost is a share of the one-row, one-position step it helps fit.
        base = np.average(t, weights=w) / (1.0 + _PRIOR_SLOPE * (np.average(p, weights=w) - 1.0))
        cost = StepCost(base * (1.0 - _PRIOR_SLOPE), 0.0, _PRIOR_SLOPE * base)
        for _ in range(10):  # a fixed point (a 5% share converges fast): the prior moves with the step
            prior = {"per_row": 0.0, "verify": 0.0}
            prior["per_position"] = _PRIOR_SLOPE * (cost.fixed + cost.per_row) / (1.0 - _PRIOR_SLOPE)
            cost = _least_squares(t, w, columns, dict(free), prior)
            if free["per_position"]:  # no prior in the fit
                break
        return cost


def _least_squares(t, w, columns: dict, free: dict[str, bool], prior: dict[str, float]) -> StepCost:
    """Weighted least squares of ``t`` on the intercept and the free terms, the others at their
    priors; a term the steps cannot tell from the others (collinear) takes its prior, and one
    that comes out negative (noise) is pinned to 0."""
    sw = np.sqrt(w)
    while True:
        names = [n for n in columns if free[n]]
        x = np.stack([np.ones_like(t)] + [columns[n] for n in names], axis=1) * sw[:, None]
        y = t - sum(prior[n] * columns[n] for n in columns if not free[n])
        if np.linalg.matrix_rank(x) < len(names) + 1:  # e.g. every verify step drafts alike
            free[names[-1]] = False
            continue
        beta = np.linalg.lstsq(x, y * sw, rcond=None)[0]
        terms = dict(prior) | dict(zip(names, (float(b) for b in beta[1:]), strict=True))
        negative = [n for n in names if terms[n] < 0.0]
        if negative:
            free[negative[0]], prior[negative[0]] = False, 0.0
            continue
        return StepCost(float(beta[0]), terms["per_row"], terms["per_position"], terms["verify"])


@dataclass
class SourceMemory:
    """Acceptance and draft cost of one draft source, learnt across a coordinator's requests, so
    adaptive K does not spend each short request relearning that a draft is useless: over all its
    drafts (``kept``, ``tried``) and per part (``parts``: the evidence a draft rests on, e.g. how
    long a context match prompt lookup found; drafts.py)."""

    kept: float = 0.0
    tried: float = 0.0
    draft_s: float = 0.0
    parts: dict[str, tuple[float, float]] = field(default_factory=dict)  # part -> (kept, tried)

    def observe(self, k: int, kept: int, draft_per_token_s: float, part: str = "") -> None:
        self.kept, self.tried = decayed_counts(self.kept, self.tried, _MEMORY_DECAY, k, kept)
        self.parts[part] = decayed_counts(*self.parts.get(part, (0.0, 0.0)), _MEMORY_DECAY, k, kept)
        self.draft_s = ema(self.draft_s, draft_per_token_s)

    def start(self, part: str) -> tuple[float, float] | None:
        """Where a request's acceptance of ``part`` starts: the part's history, else the source's,
        with the weight of at most ``_MEMORY_WEIGHT`` drafts (None: no history)."""
        kept, tried = self.parts.get(part, (self.kept, self.tried))
        if tried <= 0.0:
            return None
        scale = min(1.0, _MEMORY_WEIGHT / tried)
        return kept * scale, tried * scale


@dataclass
class TreeStats:
    """What one request's tree steps of one width measured: the per-level acceptance (decayed
    counts, as a chain's) and the positions per level a tree of the source held."""

    kept: float
    tried: float
    per_level: float

    @property
    def acceptance(self) -> float:
        return self.kept / self.tried


def expected_tokens(k: int, acceptance: float) -> float:
    """Tokens one verify yields when each draft is kept with probability ``acceptance``."""
    return float(sum(acceptance**i for i in range(k + 1)))


class KPolicy:
    """Chooses K for each verify step of one request."""

    def __init__(
        self,
        timing: TimingModel,
        *,
        fixed_k: int | None,
        max_k: int = 10,
        initial_k: int = 4,
        explore_every: int = 8,
        memory: SourceMemory | None = None,
        times_steps: bool = True,
    ):
        """``times_steps`` False: ``timing`` is fed by whoever runs the steps (the engine loop),
        not from this request's wall time per step."""
        self.timing = timing
        self.times_steps = times_steps
        self.fixed_k = fixed_k
        self.max_k = max_k
        self.initial_k = initial_k
        self.explore_every = explore_every
        # Acceptance per part of the source (drafts.py: prompt lookup's first draft was right
        # 0.89 of the time after a 3-token match, 0.20 after a 1-token one, on bench-spec's
        # answers), each starting from the source's history of that part (else of the source,
        # else Beta(3, 2)) and decayed as steps come in so it follows the text as it changes.
        self._memory = memory
        self._counts: dict[str, tuple[float, float]] = {}  # part -> (kept, tried)
        self._part = ""  # the part the last K was chosen for
        self._draft_s = 0.0
        self._probe_backoff = 1
        if memory is not None and memory.tried > 0:
            self._probe_backoff = 1 + min(7, int(memory.tried // _MEMORY_WEIGHT))
            self._draft_s = memory.draft_s
        self._steps = 0
        self._load = StepLoad()  # the load the last chosen K was chosen for
        self._trees: dict[int, TreeStats] = {}  # by width

    @property
    def acceptance(self) -> float:
        """The acceptance of the part the last K was chosen for."""
        return self.acceptance_of(self._part)

    def acceptance_of(self, part: str) -> float:
        kept, tried = self._of(part)
        return kept / tried

    def _of(self, part: str) -> tuple[float, float]:
        if part not in self._counts:
            start = self._memory.start(part) if self._memory is not None else None
            self._counts[part] = start or (3.0, 5.0)
        return self._counts[part]

    def choose(self, limit: int, load: StepLoad = StepLoad(), part: str = "") -> int:
        """K for the next step, at most ``limit`` (remaining tokens, cache room, the step's budget
        left), for a row joining ``load`` (the rest of the step being formed) whose draft rests
        on ``part`` (the drafter's ``part``)."""
        limit = max(0, limit)
        self._load = load
        self._part = part
        k = min(self.fixed_k if self.fixed_k is not None else self._adaptive(), limit)
        self._steps += 1
        return k

    def choose_shape(
        self, limit: int, width: int, load: StepLoad = StepLoad(), part: str = ""
    ) -> tuple[int, int]:
        """(paths, depth) for the next step of a request whose source offers trees of up to
        ``width`` paths: the best of a chain and a tree of ``width`` (module docstring); a fixed
        K keeps its chains. Now and then the other width is tried at the same depth, so both
        acceptances stay measured."""
        if width <= 1 or self.fixed_k is not None:
            return 1, self.choose(limit, load, part)
        self._load = load
        self._part = part
        if not self.timing.steps:
            paths, k = width, self.initial_k
        else:
            tree = self._tree(width)
            chain_rate, chain_k = self._best(self.acceptance, 1.0)
            tree_rate, tree_k = self._best(tree.acceptance, tree.per_level)
            paths, k = (width, tree_k) if tree_rate > chain_rate else (1, chain_k)
            k = self._probed(k)
            if k and self._steps % self.explore_every == 1:
                paths = 1 if paths > 1 else width
        self._steps += 1
        return paths, min(k, max(0, limit))

    def prune_floor(self, width: int, depth: int) -> float:
        """The path probability below which one more node of a tree of ``width`` paths and
        ``depth`` levels costs more step time than its expected token is worth (0 before the
        step cost is measured)."""
        cost = self.timing.cost()
        if cost is None or depth < 1:
            return 0.0
        tree = self._tree(width)
        others = self._load
        t = cost.seconds(others.rows + 1, others.tokens + 1 + round(tree.per_level * depth))
        tokens = others.rows + others.waiting + expected_tokens(depth, tree.acceptance)
        return cost.per_position * tokens / (t + depth * self._draft_s)

    def observe_guess(self, stood: bool, part: str = "") -> None:
        """A row sent ahead was built on a guess of the bonus token before it (the draft's next
        proposal from ``part``, a draft like any other): whether it was right. Without this a
        request drafting nothing (K = 0) never learns that its guesses fail and keeps sending rows
        that are dropped."""
        self._counts[part] = decayed_counts(*self._of(part), 0.9, 1, int(stood))

    def _tree(self, width: int) -> TreeStats:
        """The request's measurements of trees of ``width`` paths; before any, a chain's
        acceptance made optimistic (each path as a try of its own: 1 - (1 - a)^(1 + (W-1)/2))
        with the weight of 3 drafts, and every path a position per level."""
        if width not in self._trees:
            a = 1.0 - (1.0 - self.acceptance) ** (1.0 + (width - 1) / 2)
            self._trees[width] = TreeStats(3.0 * a, 3.0, float(width))
        return self._trees[width]

    def _best(self, acceptance: float, per_level: float) -> tuple[float, int]:
        """The best (tokens per second, depth) at this acceptance and positions per level."""
        others = self._load
        held = others.rows + others.waiting  # rows whose answers this row's drafting holds up
        best = (0.0, 0)
        for k in range(self.max_k + 1):
            t = self.timing.estimate(others.tokens + 1 + round(per_level * k), rows=others.rows + 1)
            rate = (held + expected_tokens(k, acceptance)) / (t + k * self._draft_s) if t else 0.0
            if rate > best[0]:
                best = (rate, k)
        return best

    def _adaptive(self) -> int:
        if not self.timing.steps:
            return self.initial_k
        return self._probed(self._best(self.acceptance, 1.0)[1])

    def _probed(self, best: int) -> int:
        """The best depth, or now and then a neighbour (K = 1 where plain steps win)."""
        if best == 0:
            # Plain steps win: K = 1 now and then tells whether the text or the link changed; the
            # more drafts the source's history holds, the rarer (a probe costs a 2-row verify).
            every = self.explore_every * self._probe_backoff
            return 1 if self._steps % every == every - 1 else 0
        # Probe a neighbour now and then so the estimates near the optimum stay measured.
        phase = self._steps % self.explore_every
        if phase == self.explore_every // 2 - 1:
            return min(best + 1, self.max_k)
        if phase == self.explore_every - 1:
            return max(best - 1, 1)
        return best

    def observe(
        self,
        k: int,
        kept: int,
        seconds: float,
        draft_seconds: float,
        positions: int | None = None,
        width: int = 1,
        part: str = "",
    ) -> None:
        """One step's outcome: ``kept`` of ``k`` drafts accepted; wall times of the traversal
        and of drafting. ``positions``: what the step computed when not k + 1 (a draft tree's
        nodes or chains); ``width``: the tree's paths (1: a chain); ``part``: what the drafts
        rested on."""
        if self.times_steps:
            computed = k + 1 if positions is None else positions
            self.timing.observe(self._load.tokens + computed, seconds, rows=self._load.rows + 1)
        if k == 0:
            return
        if width > 1:
            tree = self._tree(width)
            tree.kept, tree.tried = decayed_counts(tree.kept, tree.tried, 0.9, k, kept)
            tree.per_level = ema(tree.per_level, ((positions or k + 1) - 1) / k)
        else:
            self._counts[part] = decayed_counts(*self._of(part), 0.9, k, kept)
        per_token = draft_seconds / k
        self._draft_s = ema(self._draft_s, per_token)
        if self._memory is not None:
            self._memory.observe(k, kept, per_token, part if width == 1 else "")
