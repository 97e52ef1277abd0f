"""Gemma 3 270M with real weights through real fleets (stage processes, a coordinator, gRPC), fp32
shards at the f32 precision, prompts sent as text to continue (a base model):

- 1, 2 and 3 stages paged, and 2 stages stateful: greedy 64 tokens on 4 held-out prompts equal
  transformers' fp32 greedy (2 stages paged in `make test`, the rest in `make test-extended`);
- a 700-token prompt (past the 512-token window of the local layers) prefilled in 256-token chunks
  and whole, on the paged and the stateful backend: transformers' greedy;
- a prompt extending an earlier request's sequence restores its prefix on every stage and gives
  transformers' greedy; prompt-lookup speculation gives it too, with drafts verified.
"""

from __future__ import annotations

import pytest

from pipeshard.clients.client import GenerateResult, PipeshardClient
from pipeshard.services.launcher import Fleet, start_fleet
from tests.conftest import GEMMA3_PROMPTS, GEMMA3_TOKENS, hf_greedy

# The first run fetches the model into models/ (.ci/run does it first: `make model-gemma3`) and
# exports it at 2 stages fp32 into the test shards (both kept for later runs). `make test` runs the
# issue's check (2 stages paged, 4 prompts x 64 tokens); the other splits and modes, each another
# export or fleet, run in `make test-extended` and `make test-gemma3`. The timeout covers a first
# run's fetch, export and transformers reference on a loaded machine (15 min there, 2026-12-05).
pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]

LONG_TOKENS = 16


def _complete(address: str, text: str, max_tokens: int, **kwargs) -> GenerateResult:
    with PipeshardClient(address, timeout_s=900) as client:
        return client.generate(text, max_tokens=max_tokens, ignore_eos=True, complete=True, **kwargs)


@pytest.fixture
def gemma3_fleet(tmp_path, gemma3_export):
    """Factory: a Gemma 3 fleet of fp32 shards at f32, stopped when its test ends. An fp32 fleet
    holds about 2.5 GB (the coordinator 1.1, stage 1 with the 262k-row head 1.0); kept to the end
    of the module (as the shared fleet_factory keeps its fleets), this file's fleets held about
    15 GB by its sixth test, and on a shared 24 GB machine a stage stalled past the step deadline."""
    fleets: list[Fleet] = []

    def start(stages: int, *stage_args: str, coordinator_args=()) -> Fleet:
        fleet = start_fleet(
            gemma3_export(stages, "fp32"),
            stages,
            tmp_path / f"fleet-{len(fleets)}",
            precision="f32",
            extra_stage_args=list(stage_args),
            extra_coordinator_args=list(coordinator_args),
        )
        fleets.append(fleet)
        return fleet

    yield start
    for fleet in fleets:
        fleet.stop()


@pytest.mark.parametrize(
    ("stages", "kv"),
    [
        pytest.param(1, "paged", marks=pytest.mark.extended),
        (2, "paged"),
        pytest.param(2, "stateful", marks=pytest.mark.extended),
        pytest.param(3, "paged", marks=pytest.mark.extended),
    ],
)
def test_fleet_greedy_equals_hf(stages, kv, gemma3_fleet, gemma3_hf_greedy):
    _, want = gemma3_hf_greedy
    fleet = gemma3_fleet(stages, "--kv", kv)
    got = [_complete(fleet.coordinator, text, GEMMA3_TOKENS) for text in GEMMA3_PROMPTS]
    assert [r.token_ids for r in got] == want
    assert all(r.prompt_tokens == len(ids) for r, ids in zip(got, gemma3_hf_greedy[0], strict=True))


@pytest.fixture(scope="module")
def long_prompt(gemma3_dir, gemma3_hf):
    """700 tokens of text (<bos> first), and transformers' greedy continuation of them."""
    from pipeshard.shard.prompting import Prompter

    prompter = Prompter.from_dir(gemma3_dir)
    ids = prompter.encode(" ".join(GEMMA3_PROMPTS) * 40, [])[:700]
    text = prompter.tokenizer.decode(ids[1:])
    assert prompter.encode(text, []) == ids, "the long prompt must survive a decode and re-encode"
    return text, hf_greedy(gemma3_hf, ids, LONG_TOKENS)


@pytest.mark.extended
@pytest.mark.parametrize(
    ("kv", "chunk"),
    [("paged", 0), ("paged", 1024), ("stateful", 0), ("stateful", 100)],
    ids=["paged-chunks-256", "paged-whole", "stateful-whole", "stateful-chunks-100"],
)
def test_a_prompt_past_the_window_gives_hf_greedy(kv, chunk, gemma3_fleet, long_prompt):
    """The local layers see only their window, chunked or not (on paged stages they give back the
    blocks behind it as they go); the global layers see the whole prompt."""
    text, want = long_prompt
    coordinator = ("--prefill-chunk", str(chunk)) if chunk else ()
    fleet = gemma3_fleet(2, "--kv", kv, coordinator_args=coordinator)
    assert _complete(fleet.coordinator, text, LONG_TOKENS).token_ids == want


@pytest.mark.extended
def test_prefix_reuse_and_prompt_lookup_give_hf_greedy(gemma3_fleet, gemma3_dir, gemma3_hf):
    """A request, then one whose prompt extends its whole sequence: the second restores the first's
    KV on every stage (a prefix cache hit in the coordinator's log) and continues as transformers
    does; prompt lookup (n-gram drafts from the prompt) verifies drafts and changes no token."""
    from pipeshard.shard.prompting import Prompter

    prompter = Prompter.from_dir(gemma3_dir)
    fleet = gemma3_fleet(2, coordinator_args=("--prefix-min-tokens", "16"))
    first_text = " ".join(GEMMA3_PROMPTS[:2])
    first = _complete(fleet.coordinator, first_text, 48)
    assert first.token_ids == hf_greedy(gemma3_hf, prompter.encode(first_text, []), 48)

    second_text = first_text + prompter.tokenizer.decode(first.token_ids) + " " + GEMMA3_PROMPTS[2]
    ids = prompter.encode(second_text, [])
    want = hf_greedy(gemma3_hf, ids, 48)
    second = _complete(fleet.coordinator, second_text, 48)
    assert second.token_ids == want
    log = fleet.process("coordinator").log.read_text()
    assert log.count('"prefix_cache_hit"') >= 1 and '"prefix_cache_fallback"' not in log
    assert second.cached_tokens > 0

    looked_up = _complete(fleet.coordinator, GEMMA3_PROMPTS[1], GEMMA3_TOKENS, speculative="ngram", k=3)
    assert looked_up.token_ids == hf_greedy(gemma3_hf, prompter.encode(GEMMA3_PROMPTS[1], []), GEMMA3_TOKENS)
    assert looked_up.verify_steps > 0 and looked_up.draft_tokens > 0
