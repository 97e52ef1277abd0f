"""Traversals in flight per request through real fleets (coordinator --spec-depth D): a request's
next speculative step goes while its step travels, built on that step's draft accepted whole, and
is dropped (its positions rewound by the next row's mask) when the step rejects; the output is the
fleet's plain greedy, token for token, on INT4 shards, on paged and stateful stages.

The feature draft pipelines too: a step drafted while the one before it travels chains over the
guesses on the draft's own predicted features.

make test runs the 2-stage case, the feature draft's, the 8 users and the failover; the long matrix
(1/2/3 stages, D = 2..3, both backends, `exact`) is marked extended (make test-extended)."""

from __future__ import annotations

import threading

import pytest

from pipeshard.clients.client import PipeshardClient
from pipeshard.precision import DEFAULT_PRECISION
from pipeshard.services.launcher import stage_name
from tests.pipeline.concurrent_streams import concurrently
from tests.speculation.test_feature import eagle_draft  # noqa: F401 (the trained feature draft)

pytestmark = pytest.mark.slow

MAX_TOKENS = 128
# Natural prompts of several kinds: text to repeat (prompt lookup's best case), code to edit, and
# an open question (few matches: most drafts rejected, so steps in flight are dropped).
PROMPTS = (
    "Repeat this list exactly, one item per line: apples, pears, plums, cherries, grapes, lemons, "
    "limes, oranges, peaches, apricots.",
    "Rename the variable x to total in this code and show the whole function:\n"
    "def add(values):\n    x = 0\n    for v in values:\n        x += v\n    return x\n",
    "Explain how a refrigerator keeps food cold.",
)


def _fleet(
    shared_fleet, smollm2_export, stages: int, depth: int, kv: str, precision: str = DEFAULT_PRECISION
):
    return shared_fleet(
        smollm2_export(stages, "int4"),
        stages,
        precision=precision,
        extra_stage_args=("--kv", kv),
        extra_coordinator_args=("--spec-depth", str(depth)),
    )


def _first_diff(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), len(a) if a != b else None)


@pytest.mark.parametrize(
    ("stages", "depth", "kv", "precision"),
    [
        (2, 2, "paged", DEFAULT_PRECISION),
        pytest.param(3, 3, "paged", DEFAULT_PRECISION, marks=pytest.mark.extended),
        pytest.param(1, 2, "paged", DEFAULT_PRECISION, marks=pytest.mark.extended),
        pytest.param(1, 3, "stateful", DEFAULT_PRECISION, marks=pytest.mark.extended),
        pytest.param(3, 3, "stateful", DEFAULT_PRECISION, marks=pytest.mark.extended),
        pytest.param(2, 3, "stateful", "exact", marks=pytest.mark.extended),
        pytest.param(2, 2, "paged", "exact", marks=pytest.mark.extended),
        pytest.param(3, 2, "paged", "exact", marks=pytest.mark.extended),
    ],
)
def test_pipelined_speculation_equals_plain_greedy(
    shared_fleet, smollm2_export, stages, depth, kv, precision
):
    fleet = _fleet(shared_fleet, smollm2_export, stages, depth, kv, precision)
    dropped = 0
    with PipeshardClient(fleet.coordinator, timeout_s=600) as client:
        for i, prompt in enumerate(PROMPTS):
            plain = client.generate(prompt, max_tokens=MAX_TOKENS, ignore_eos=True, speculative="none")
            assert plain.dropped_steps == 0 and len(plain.token_ids) == MAX_TOKENS
            # Adaptive K (tree=auto drafts chains at D > 1) and a fixed one.
            for k, tree in ((0, ""), (4, "")):
                got = client.generate(
                    prompt, max_tokens=MAX_TOKENS, ignore_eos=True, speculative="ngram", k=k, tree=tree
                )
                assert got.token_ids == plain.token_ids, (
                    f"prompt {i}, K={k or 'auto'} tree={tree or 'auto'}: differs at "
                    f"{_first_diff(got.token_ids, plain.token_ids)}"
                )
                assert sum(got.kept_per_traversal) > 0
                dropped += got.dropped_steps
    # Steps went while earlier ones travelled, and rejections dropped some of them.
    assert dropped > 0


@pytest.mark.timeout(3600)  # the first run trains the test's draft (a few minutes, more when loaded)
@pytest.mark.parametrize(
    ("stages", "depth", "precision"),
    [(2, 2, DEFAULT_PRECISION), pytest.param(2, 3, "exact", marks=pytest.mark.extended)],
)
def test_pipelined_feature_draft_equals_plain_greedy(
    shared_fleet,
    smollm2_export,
    eagle_draft,  # noqa: F811 (the imported fixture)
    stages,
    depth,
    precision,
):
    fleet = shared_fleet(
        smollm2_export(stages, "int4"),
        stages,
        precision=precision,
        extra_stage_args=("--kv", "paged"),
        extra_coordinator_args=("--spec-depth", str(depth), "--feature-draft", str(eagle_draft)),
    )
    dropped = kept = 0
    with PipeshardClient(fleet.coordinator, timeout_s=600) as client:
        for i, prompt in enumerate(PROMPTS):
            plain = client.generate(prompt, max_tokens=MAX_TOKENS, ignore_eos=True, speculative="none")
            for k in (0, 4):
                got = client.generate(
                    prompt, max_tokens=MAX_TOKENS, ignore_eos=True, speculative="feature", k=k
                )
                assert got.token_ids == plain.token_ids, (
                    f"prompt {i}, K={k or 'auto'}: differs at {_first_diff(got.token_ids, plain.token_ids)}"
                )
                dropped += got.dropped_steps
                kept += sum(got.kept_per_traversal[1:])  # steps that kept a draft
    # Its drafts were kept, steps went while earlier ones travelled, and rejections dropped some.
    assert kept > 0 and dropped > 0


@pytest.mark.parametrize("depth", [3])
def test_eight_users_mixed_speculative_and_plain_equal_their_solo_runs(shared_fleet, smollm2_export, depth):
    fleet = _fleet(shared_fleet, smollm2_export, 2, depth, "paged")
    users = [(PROMPTS[i % len(PROMPTS)], "ngram" if i % 2 == 0 else "none") for i in range(8)]
    with PipeshardClient(fleet.coordinator, timeout_s=600) as client:
        solo = {
            prompt: client.generate(prompt, max_tokens=64, ignore_eos=True, speculative="none").token_ids
            for prompt in PROMPTS
        }
    results: list = [None] * len(users)
    errors: list[BaseException] = []

    def run(i: int) -> None:
        prompt, speculative = users[i]
        try:
            with PipeshardClient(fleet.coordinator, timeout_s=600) as c:
                results[i] = c.generate(prompt, max_tokens=64, ignore_eos=True, speculative=speculative)
        except BaseException as exc:  # reported below, with the user's index
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(users))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=900)
    assert not errors, errors
    for i, (prompt, speculative) in enumerate(users):
        assert results[i].token_ids == solo[prompt], (
            f"user {i} ({speculative}): differs at {_first_diff(results[i].token_ids, solo[prompt])}"
        )


def test_a_failover_mid_stream_with_steps_in_flight_keeps_the_tokens(smollm2_export, fleet_factory):
    """Two lanes, every request speculating with prompt lookup at D = 3 (the coordinator's
    default); the final stage of lane 1 is killed once every stream has tokens out: the streams on
    it fail over with steps in flight (dropped, resumed from the committed tokens) and end with
    the undisturbed run's tokens."""
    fleet = fleet_factory(
        smollm2_export(2, "int4"),
        2,
        replicas=2,
        extra_coordinator_args=["--speculative", "ngram", "--spec-depth", "3"],
    )
    prompts = [PROMPTS[0], PROMPTS[1]] * 2
    undisturbed, errors = concurrently(fleet.coordinator, prompts, 64)
    assert not errors, errors
    started = threading.Barrier(len(prompts) + 1)
    victim = fleet.process(stage_name(1, 1))
    killer = threading.Thread(target=lambda: (started.wait(timeout=300), victim.popen.kill()))
    killer.start()
    disturbed, errors = concurrently(
        fleet.coordinator, prompts, 64, on_out=lambda: started.wait(timeout=300), after=8
    )
    killer.join()
    assert victim.popen.wait(timeout=10) is not None
    assert not errors, errors
    assert disturbed == undisturbed
    assert '"session_failed_over"' in fleet.process("coordinator").log.read_text()
