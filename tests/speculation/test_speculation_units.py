"""Acceptance rules, prompt lookup, the K policy and the session cursor, without a model."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from scipy import stats

from pipeshard.sampling import accept_sampled
from pipeshard.services.coordinator.generation import _Cursor
from pipeshard.services.coordinator.sampling import Sampler, SamplingParams
from pipeshard.services.coordinator.speculation.acceptance import accept_greedy
from pipeshard.services.coordinator.speculation.depth import worth_sending
from pipeshard.services.coordinator.speculation.drafts import NgramDrafter
from pipeshard.services.coordinator.speculation.policy import (
    KPolicy,
    SourceMemory,
    StepCost,
    StepLoad,
    StepTime,
    TimingModel,
    expected_tokens,
)
from pipeshard.services.coordinator.step_batcher import BatchSteps
from pipeshard.v1 import activation_pb2
from tests.coordinator.engine_fakes import FakeRequest, drive


def test_greedy_keeps_the_matching_prefix_and_the_targets_next_token():
    assert accept_greedy([5, 6, 7], [5, 6, 9, 1]) == [5, 6, 9]
    assert accept_greedy([5, 6, 7], [4, 6, 7, 1]) == [4]
    assert accept_greedy([5, 6, 7], [5, 6, 7, 1]) == [5, 6, 7, 1]
    assert accept_greedy([], [3]) == [3]
    with pytest.raises(ValueError, match="need 3 target tokens"):
        accept_greedy([1, 2], [1, 2])


def _first_token_counts(draft_probs, target, draws: int, seed: int) -> np.ndarray:
    """Run the acceptance rule many times; count the first emitted token."""
    rng = np.random.default_rng(seed)
    vocab = target.shape[1]
    counts = np.zeros(vocab)
    for _ in range(draws):
        if draft_probs is None:
            drafts = [int(rng.integers(vocab)) for _ in range(target.shape[0] - 1)]
            probs = None
        else:
            drafts = [int(rng.choice(vocab, p=q)) for q in draft_probs]
            probs = draft_probs
        out = accept_sampled(drafts, probs, np.log(target), lambda row: np.exp(row) / np.exp(row).sum(), rng)
        counts[out[0]] += 1
    return counts


@pytest.mark.parametrize("draft", ["model", "point-mass"])
def test_rejection_sampling_follows_the_target_distribution(draft):
    """The first emitted token must be distributed as the target's first row, whatever the draft."""
    rng = np.random.default_rng(0)
    vocab, k, draws = 6, 3, 20000
    target = rng.dirichlet(np.ones(vocab), size=k + 1)
    # A draft that is confidently wrong about the target.
    draft_probs = None if draft == "point-mass" else list(rng.dirichlet(np.full(vocab, 0.3), size=k))
    counts = _first_token_counts(draft_probs, target, draws, seed=1)
    p_value = stats.chisquare(counts, target[0] * draws).pvalue
    assert p_value > 1e-3, (counts / draws, target[0])


def test_rejection_sampling_check_can_fail():
    """The same check rejects a rule that keeps every draft (the draft's distribution leaks)."""
    rng = np.random.default_rng(0)
    vocab, draws = 6, 20000
    target = rng.dirichlet(np.ones(vocab), size=2)
    q = rng.dirichlet(np.full(vocab, 0.3))
    counts = np.bincount(rng.choice(vocab, size=draws, p=q), minlength=vocab)
    assert stats.chisquare(counts, target[0] * draws).pvalue < 1e-3


def test_ngram_proposes_what_followed_the_latest_match():
    drafter = NgramDrafter(max_ngram=3)
    context = [1, 2, 3, 4, 5, 9, 2, 3, 4, 7, 8, 1, 2, 3]
    # suffix [1, 2, 3] last occurred at the start: what followed was 4, 5, 9
    assert drafter.propose(context, 3, None).tokens == [4, 5, 9]
    assert drafter.propose([1, 2, 3, 4], 3, None).tokens == []  # 4 never occurred before
    assert drafter.propose([7, 7], 5, None).tokens == [7]  # 1-gram: what followed the earlier 7


def test_ngram_names_the_length_of_the_match_its_draft_rests_on():
    drafter = NgramDrafter(max_ngram=3)
    cases = {
        "lookup3": [1, 2, 3, 4, 5, 9, 2, 3, 4, 7, 8, 1, 2, 3],
        "lookup2": [5, 2, 3, 4, 9, 2, 3],
        "lookup1": [7, 8, 7],
        "lookup": [1, 2, 3, 4],  # nothing matched, nothing drafted
    }
    for part, context in cases.items():
        assert drafter.part(context) == part
        assert drafter.propose(context, 3, None).part == part  # the draft carries it


def test_adaptive_k_keeps_an_acceptance_per_part_of_a_source():
    """Prompt lookup's 1-token matches rejected, its 3-token ones kept: one acceptance over both
    would draft on the weak matches and too little on the strong; per part K follows each, and a
    later request starts each part from that part's history."""
    timing = _trained(slope_s=0.004, fixed_s=0.02)
    memory = SourceMemory()
    first = KPolicy(timing, fixed_k=None, max_k=10, explore_every=1000, memory=memory)
    for _ in range(20):
        first.observe(3, 0, timing.estimate(4), 0.0, part="lookup1")
        first.observe(5, 5, timing.estimate(6), 0.0, part="lookup3")
    assert first.acceptance_of("lookup1") < 0.1 < 0.9 < first.acceptance_of("lookup3")
    assert first.choose(100, part="lookup1") == 0
    assert first.choose(100, part="lookup3") >= 5
    second = KPolicy(timing, fixed_k=None, max_k=10, explore_every=1000, memory=memory)
    assert second.choose(100, part="lookup1") == 0  # from the part's history, at its first step
    assert second.choose(100, part="lookup3") >= 5
    # a part not seen yet starts from the source's history
    assert second.acceptance_of("lookup2") == pytest.approx(memory.kept / memory.tried)


def test_expected_tokens():
    assert expected_tokens(0, 0.7) == 1.0
    assert expected_tokens(3, 1.0) == 4.0
    assert expected_tokens(2, 0.5) == pytest.approx(1.75)


def _trained(slope_s: float, fixed_s: float) -> TimingModel:
    timing = TimingModel()
    for n in (1, 2, 4, 6, 9, 11):
        timing.observe(n, fixed_s + slope_s * n)
    return timing


def _policy_with_acceptance(timing: TimingModel, acceptance_steps: int = 30) -> KPolicy:
    policy = KPolicy(timing, fixed_k=None, max_k=10, explore_every=1000)
    for _ in range(acceptance_steps):
        policy.observe(5, 4, timing.estimate(6), 0.0)  # 4 of 5 kept: acceptance about 0.8
    return policy


def test_adaptive_k_is_long_when_round_trips_dominate():
    policy = _policy_with_acceptance(_trained(slope_s=0.002, fixed_s=0.4))  # 100 ms per hop
    assert 0.7 < policy.acceptance < 0.9
    assert policy.choose(limit=100) >= 8


def test_adaptive_k_is_short_on_a_fast_link():
    policy = _policy_with_acceptance(_trained(slope_s=0.004, fixed_s=0.02))
    assert 1 <= policy.choose(limit=100) <= 6


def test_adaptive_k_falls_back_to_plain_when_positions_cost_more_than_round_trips_save():
    # A slow link: each extra position's bytes cost as much as a whole round trip.
    policy = _policy_with_acceptance(_trained(slope_s=0.05, fixed_s=0.01))
    assert policy.choose(limit=100) == 0


def test_adaptive_k_starts_from_what_earlier_requests_of_the_source_learnt():
    timing = _trained(slope_s=0.004, fixed_s=0.02)
    memory = SourceMemory()
    first = KPolicy(timing, fixed_k=None, max_k=10, explore_every=1000, memory=memory)
    assert first.choose(limit=100) >= 1  # no history: the Beta(3, 2) prior says drafting pays
    for _ in range(20):
        first.observe(3, 0, timing.estimate(4), 0.003)  # a draft that never agrees
    second = KPolicy(timing, fixed_k=None, max_k=10, explore_every=1000, memory=memory)
    assert second.acceptance < 0.05
    assert second.choose(limit=100) == 0  # plain decoding from its first step
    fresh = KPolicy(timing, fixed_k=None, max_k=10, explore_every=1000, memory=SourceMemory())
    assert fresh.choose(limit=100) >= 1  # another source's history is its own


def test_plain_steps_probe_k1_rarely_and_more_rarely_with_history():
    timing = _trained(slope_s=0.004, fixed_s=0.02)
    useless = SourceMemory(kept=0.0, tried=40.0)
    new, known = (KPolicy(timing, fixed_k=None, explore_every=8, memory=m) for m in (None, useless))
    for policy in (new, known):
        policy._counts[""] = (0.0, 5.0)  # this request's acceptance: nothing kept
    new_ks = [new.choose(100) for _ in range(64)]
    known_ks = [known.choose(100) for _ in range(64)]
    assert set(new_ks) == {0, 1} and new_ks.count(1) == 8  # one K = 1 probe per 8 steps
    assert known_ks.count(1) == 1  # eight times rarer: the source never agreed


def _paged_step_cost() -> TimingModel:
    """A paged step's cost by its total positions: 34 ms plus 3.5 ms per position (as measured on
    the 2-stage INT4 stages, docs/benchmarks-history.md, "Step cost against rows and tokens")."""
    timing = TimingModel()
    for n in (1, 2, 4, 8, 16, 32):
        timing.observe(n, 0.034 + 0.0035 * n)
    return timing


def _k_under(load: StepLoad, accepted: int = 3) -> int:
    policy = KPolicy(_paged_step_cost(), fixed_k=None, max_k=10, explore_every=1000)
    for _ in range(30):
        policy.observe(5, accepted, policy.timing.estimate(6), 0.0)  # keeps the cost line as it is
    return policy.choose(limit=100, load=load)


def test_batch_aware_k_shrinks_as_the_step_fills():
    alone, few, full = (_k_under(StepLoad(rows, rows)) for rows in (0, 3, 15))
    assert alone > few > full >= 1  # each draft delays every other row of the step
    assert _k_under(StepLoad(15, 15), accepted=1) == 0  # a weak draft does not pay for 15 rows
    assert _k_under(StepLoad(0, 0), accepted=1) >= 1  # but does alone


def test_batch_aware_k_times_the_whole_step():
    timing = TimingModel()
    load = StepLoad(rows=4, tokens=260)  # a decode row beside a prefill chunk and three others
    policy = KPolicy(timing, fixed_k=3)
    assert policy.choose(limit=100, load=load) == 3
    policy.observe(3, 2, 0.05, 0.001)
    assert list(timing.steps) == [StepTime(5, 264, 0.05)]  # all of the step's rows and positions
    alone = KPolicy(timing, fixed_k=3)
    alone.choose(limit=100)
    alone.observe(3, 2, 0.02, 0.001)
    assert timing.steps[-1] == StepTime(1, 4, 0.02)


def _steps_of(users: int, fixed_s: float, per_position_s: float) -> tuple[BatchSteps, StepLoad]:
    """The engine's step timing after 12 steps of ``users`` requests on a fake clock (each step
    costs ``fixed_s`` plus ``per_position_s`` per position; request 0 verifies 0..5 drafts), and
    the load request 0's last row was drafted for (the rest of its step)."""
    now = [0.0]

    async def run(frames):
        now[0] += fixed_s + per_position_s * sum(len(f.positions) for f in frames)
        return [activation_pb2.StepResult() for _ in frames]

    requests = [FakeRequest(f"s{i}", [(1, True)] * 12) for i in range(users)]
    row = requests[0].next_row

    def verifying(chunk, load, budget):  # request 0's k-th row carries k % 6 drafts
        requests[0].drafts = requests[0].at % 6
        return row(chunk, load, budget)

    requests[0].next_row = verifying  # type: ignore[method-assign]
    steps = BatchSteps(512, 1)
    asyncio.run(drive(requests, run, steps, clock=lambda: now[0]))
    return steps, requests[0].loads[-1][0]


def _batch_k(batched: tuple[BatchSteps, StepLoad], acceptance_quarter: bool = True) -> int:
    """K that request 0 chooses from the engine's timing for the load of its step, having kept one
    draft in four (or every draft) while each of its steps took 10 s of wall time (waiting
    included)."""
    steps, load = batched
    policy = KPolicy(steps.timing, fixed_k=None, explore_every=1000, times_steps=False)
    fitted = list(steps.timing.steps)
    for kept in (1, 0, 0) * 10 if acceptance_quarter else (4,) * 30:
        policy.observe(4, kept, 10.0, 0.0)
    assert list(steps.timing.steps) == fitted  # a request's wall time does not feed the engine's
    return policy.choose(limit=100, load=load)


def test_batch_aware_k_falls_to_plain_in_a_full_compute_bound_step():
    # The paged 2-stage step: 34 ms plus 3.5 ms a position; one draft in four kept.
    assert _batch_k(_steps_of(8, 0.034, 0.0035)) == 0  # 7 rows wait for each draft
    assert _batch_k(_steps_of(1, 0.034, 0.0035)) >= 1  # alone the same draft pays
    assert _batch_k(_steps_of(8, 0.034, 0.0035), acceptance_quarter=False) >= 3


def test_batch_aware_k_stays_on_when_the_step_is_latency_bound():
    # Four 50 ms hops: the fixed cost dwarfs a position's, so drafts are nearly free.
    assert _batch_k(_steps_of(8, 0.200, 0.0035)) >= 1
    assert _batch_k(_steps_of(8, 0.200, 0.0035), acceptance_quarter=False) >= 6


def _timed(steps: list[tuple[int, int]], cost: StepCost, noise: float = 0.0, seed: int = 0) -> TimingModel:
    """A timing model fed ``(rows, positions)`` steps costing ``cost`` plus Gaussian noise (s)."""
    rng = np.random.default_rng(seed)
    timing = TimingModel()
    for rows, positions in steps:
        timing.observe(positions, cost.seconds(rows, positions) + rng.normal(0.0, noise), rows=rows)
    return timing


def _mixed_load(
    steps: int = 400, seed: int = 1, drafts: tuple[int, ...] = (0, 0, 0, 1, 2, 4)
) -> list[tuple[int, int]]:
    """1, 4 or 8 sessions a step, each drafting one of ``drafts`` tokens (mostly none)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        rows = int(rng.choice([1, 4, 8]))
        out.append((rows, rows + int(rng.choice(drafts, size=rows).sum())))
    return out


def test_step_cost_recovers_fixed_per_row_per_position_and_verify_terms_from_noisy_steps():
    # A busy coordinator's rows (20 ms each), and a step with a verify row leaving the decode kernel.
    truth = StepCost(fixed=0.030, per_row=0.020, per_position=0.003, verify=0.014)
    cost = _timed(_mixed_load(), truth, noise=0.004).cost()
    assert cost.fixed == pytest.approx(truth.fixed, abs=0.003)
    assert cost.per_row == pytest.approx(truth.per_row, abs=0.0015)
    assert cost.per_position == pytest.approx(truth.per_position, abs=0.0015)
    assert cost.verify == pytest.approx(truth.verify, abs=0.003)
    assert _timed(_mixed_load(), StepCost(0.030, 0.020, 0.003), noise=0.004).cost().verify < 0.003


def test_step_cost_takes_the_prior_per_position_when_every_row_is_one_position():
    # Every session decodes plainly: rows == positions, so a row and a position cannot be told
    # apart; a position costs the prior share (5%) of a one-row, one-position step.
    cost = _timed([(n, n) for n in (1, 2, 4, 8) * 10], StepCost(0.030, 0.005, 0.0)).cost()
    assert cost.per_position == pytest.approx(0.05 * 0.035)
    assert cost.per_row == pytest.approx(0.005 - 0.05 * 0.035)
    assert cost.fixed == pytest.approx(0.030)
    one = _timed([(1, 1)] * 5, StepCost(0.030, 0.0, 0.005)).cost()  # one session, plain steps
    assert (one.per_row, one.per_position) == (0.0, pytest.approx(0.05 * 0.035))
    assert one.seconds(1, 1) == pytest.approx(0.035)


def test_step_cost_is_refit_once_enough_of_its_window_is_new():
    """A long window's fit is reused until 8 steps came in since it (one step barely moves a fit
    over hundreds, and refitting cost every speculative step half a millisecond); a short one's
    follows every step."""
    short = TimingModel()
    short.observe(1, 0.010)
    assert short.estimate(1) == pytest.approx(0.010)
    short.observe(1, 0.020)
    assert short.estimate(1) != pytest.approx(0.010)
    long = TimingModel()
    for _ in range(512):
        long.observe(1, 0.010)
    fit = long.cost()
    for _ in range(7):
        long.observe(1, 0.030)
    assert long.cost() is fit
    long.observe(1, 0.030)
    assert long.cost() is not fit and long.estimate(1) > 0.010


def _k_from(timing: TimingModel, load: StepLoad) -> int:
    """K chosen under ``load`` having kept one draft in five (four verifies of which one kept 1)."""
    policy = KPolicy(timing, fixed_k=None, explore_every=1000, times_steps=False)
    for kept in (1, 0, 0, 0) * 10:
        policy.observe(4, kept, 0.0, 0.0)
    assert 0.15 < policy.acceptance < 0.25
    return policy.choose(limit=100, load=load)


def test_k_stays_on_alone_when_rows_not_drafts_made_busy_steps_dear():
    # 1, 4 and 8 users on one ring, nearly all decoding plainly (a K = 1 probe now and then), each
    # busy row costing 20 ms (Python per session), a position 3 ms: a draft kept one time in five
    # still pays alone (a line over positions charged the rows to them and gave K = 0 there).
    timing = _timed(_mixed_load(drafts=(0,) * 15 + (1,)), StepCost(0.030, 0.020, 0.003), noise=0.004)
    assert _k_from(timing, StepLoad()) >= 1


def test_k_stays_plain_alone_when_a_verify_step_leaves_the_fast_decode_kernel():
    # Measured alone on the paged CPU stages: 17 ms a plain step, 31 ms with a 2-token row. One
    # draft in five never pays for that; behind four 50 ms hops the same verify cost does.
    probes = _mixed_load(drafts=(0,) * 7 + (1, 2, 4, 6))
    fast = _timed(probes, StepCost(0.012, 0.004, 0.001, verify=0.014), noise=0.001)
    assert _k_from(fast, StepLoad()) == 0
    far = _timed(probes, StepCost(0.212, 0.004, 0.001, verify=0.014), noise=0.001)
    assert _k_from(far, StepLoad()) >= 1


def test_k_falls_to_plain_in_a_full_compute_bound_step_and_stays_on_when_hops_dominate():
    compute = _timed(_mixed_load(), StepCost(0.029, 0.0012, 0.0025), noise=0.002)  # CPU cost model
    assert _k_from(compute, StepLoad(rows=7, tokens=7)) == 0  # 7 rows wait
    assert _k_from(compute, StepLoad()) >= 1  # alone the same draft pays
    hops = _timed(_mixed_load(), StepCost(0.200, 0.0012, 0.0025), noise=0.002)  # four 50 ms hops
    assert _k_from(hops, StepLoad(rows=7, tokens=7)) >= 1
    assert _k_from(hops, StepLoad()) >= 1


def test_fixed_k_is_kept_and_clipped():
    policy = KPolicy(TimingModel(), fixed_k=5)
    assert [policy.choose(10), policy.choose(3), policy.choose(0)] == [5, 3, 0]


def test_cursor_masks_rejected_positions_in_the_next_frame():
    cursor = _Cursor("s", greedy=True)
    cursor.frame([1, 2, 3, 4])  # prompt: physical 0..3
    cursor.frame([9, 10, 11, 12], return_last=4)  # last token + 3 drafts at 4..7
    cursor.reject(2)  # drafts at 6, 7 rejected
    frame = cursor.frame([13], return_last=1)
    assert [(r.start, r.end) for r in frame.plan.rows[0].mask_update.invalidate] == [(6, 8)]
    assert list(frame.positions) == [6]  # logical position continues after the kept tokens
    assert cursor.physical == 9 and cursor.logical == 7
    assert not cursor.frame([14]).plan.rows[0].mask_update.invalidate


def test_sampler_probabilities_are_what_acceptance_uses():
    sampler = Sampler(SamplingParams(temperature=0.7, top_k=3, seed=1))
    p = sampler.probabilities(np.array([3.0, 1.0, 2.0, 0.5]))
    assert p[3] == 0.0 and p.sum() == pytest.approx(1.0)


def test_draft_sources_offer_only_operator_names_and_echo_no_path(tmp_path):
    from pipeshard.errors import InvalidArgument
    from pipeshard.services.coordinator.speculation.sources import DraftSources, parse_named

    folder = tmp_path / "secret-draft"
    folder.mkdir()
    named = parse_named([f"mine={folder}"])
    sources = DraftSources(tmp_path, named=named)
    assert sources.names == ["none", "ngram", "mine"]
    for mode in ("none", "ngram", "mine"):
        sources.validate(mode)
    for probe in (str(folder), str(tmp_path), "/etc", "nope"):
        with pytest.raises(InvalidArgument, match=r"none, ngram, mine$") as info:
            sources.validate(probe)
        assert str(tmp_path) not in str(info.value) and probe not in str(info.value)
    with pytest.raises(InvalidArgument, match="--self-draft"):
        sources.validate("self")
    DraftSources(tmp_path, allow_paths=True).validate(str(folder))  # the operator's own command line
    for bad in (
        ["mine"],
        ["self=/x"],
        [f"a/b={folder}"],
        ["x=/no/such/folder"],
        [f"m={folder}", f"m={folder}"],
    ):
        with pytest.raises(InvalidArgument, match="`draft`"):
            parse_named(bad)


def _drafting_at_100ms(kept: tuple[int, ...]) -> KPolicy:
    """A request over 100 ms hops (450 ms steps, 0.5 ms a position) whose draft costs 10 ms a
    token on the coordinator and keeps, of 4 drafts a step, ``kept`` in turn."""
    timing = TimingModel()
    for rows, positions in ((3, 3), (4, 9), (2, 12), (5, 20), (3, 7), (4, 16)):
        timing.observe(positions, 0.450 + 0.0005 * positions, rows=rows)
    policy = KPolicy(timing, fixed_k=None, max_k=10, explore_every=1000, times_steps=False)
    for step in range(30):
        policy.observe(4, kept[step % len(kept)], 0.45, 0.040)
    return policy


def test_drafts_are_priced_against_the_rows_in_flight_their_drafting_holds_up():
    """The coordinator drafts on its one loop: every row of the steps in flight waits on it, so
    a row beside many in flight drafts less, and a weak draft nothing, where alone it drafts."""
    weak = _drafting_at_100ms(kept=(0, 1))  # a third of its drafts kept
    beside = StepLoad(rows=3, tokens=3)
    assert weak.choose(limit=10, load=beside) >= 1  # 3 rows beside it, nothing in flight
    assert weak.choose(limit=10, load=StepLoad(3, 3, waiting=12)) == 0  # two more steps travel
    strong = _drafting_at_100ms(kept=(3,))  # three quarters
    alone, held = (
        strong.choose(limit=10, load=beside),
        strong.choose(limit=10, load=StepLoad(3, 3, waiting=12)),
    )
    assert 1 <= held < alone


def test_a_wrong_guess_of_the_bonus_token_counts_as_a_rejected_draft():
    """A request drafting nothing still sends rows ahead on a guess of its bonus token: the guesses
    that fail teach it that they fail, so it stops sending rows that are dropped (worth_sending)."""
    policy = KPolicy(_trained(slope_s=0.002, fixed_s=0.4), fixed_k=None, explore_every=1000)
    assert worth_sending(policy.acceptance, 0, shared=True)
    for _ in range(12):
        policy.observe_guess(False)
    assert not worth_sending(policy.acceptance, 0, shared=True)
    right = KPolicy(_trained(slope_s=0.002, fixed_s=0.4), fixed_k=None, explore_every=1000)
    for _ in range(12):
        right.observe_guess(True)
    assert right.acceptance > 0.9
