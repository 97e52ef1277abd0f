"""Speculative decoding through a real fleet: exact greedy, per-request choice, bad input, cancel."""

from __future__ import annotations

import json
import subprocess
import sys

import grpc
import pytest

from pipeshard.clients.client import PipeshardClient
from tests.pipeline.stage_probe import sessions_after_release

pytestmark = pytest.mark.slow

MAX_TOKENS = 128


@pytest.fixture(scope="module")
def self_draft(smollm2_draft):
    return smollm2_draft(2, 4096, "int4")


@pytest.fixture(scope="module")
def fleet(smollm2_export, fleet_factory, self_draft, hf_draft_dir):
    cache = self_draft.parent / ".drafts"  # shared with tests/speculation: a draft folder exports once
    return fleet_factory(
        smollm2_export(2, "fp32"),
        2,
        precision="f32",
        extra_coordinator_args=[
            *("--self-draft", str(self_draft), "--draft-cache", str(cache)),
            *("--draft", f"hf={hf_draft_dir}"),  # the operator names the folder; clients say "hf"
        ],
    )


@pytest.fixture(scope="module")
def client(fleet):
    with PipeshardClient(fleet.coordinator, timeout_s=600) as c:
        yield c


@pytest.mark.parametrize(
    ("source", "k", "prompt_indices"),
    [
        pytest.param("ngram", 0, (0, 1), marks=pytest.mark.extended),
        pytest.param("self", 3, (2, 3), marks=pytest.mark.extended),
        pytest.param("hf", 5, (4, 5), marks=pytest.mark.extended),
    ],
)
def test_speculative_fleet_matches_hf_greedy(client, source, k, prompt_indices, prompts, hf_greedy_128):
    speculative = source
    verify_steps = []
    for i in prompt_indices:
        result = client.generate(
            prompts[i], max_tokens=MAX_TOKENS, ignore_eos=True, speculative=speculative, k=k
        )
        assert result.token_ids == hf_greedy_128[i], f"prompt {i} differs under {source} K={k or 'auto'}"
        assert result.speculative == speculative
        assert result.accepted_tokens <= result.draft_tokens
        verify_steps.append(result.verify_steps)
    if k:
        assert all(verify_steps), verify_steps
    else:
        # Auto K drafts from the first request on a new coordinator; later requests may rightly
        # skip a source whose history (SourceMemory) shows drafting does not pay.
        assert verify_steps[0] > 0, verify_steps


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"speculative": "no-such-draft"}, "`speculative`"),
        ({"speculative": "ngram", "k": 40}, "`k`"),
        ({"speculative": "ngram", "k": -1}, "`k`"),
    ],
)
def test_bad_speculation_requests_name_the_field_and_the_service_keeps_serving(client, kwargs, field):
    with pytest.raises(grpc.RpcError) as info:
        client.generate("hi", max_tokens=4, **kwargs)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in info.value.details()
    assert client.generate("Say hi.", max_tokens=3, speculative="self", k=2).completion_tokens == 3


def test_a_client_cannot_name_a_folder_and_learns_no_paths(client, hf_draft_dir, self_draft):
    """Issue #14: a draft folder path from a client, real or not, is refused the same way, listing
    the names on offer and echoing no path (neither its own nor the operator's)."""
    details = set()
    for probe in (str(hf_draft_dir), str(self_draft), "/etc", "/no/such/dir", "../shards"):
        with pytest.raises(grpc.RpcError) as info:
            client.generate("hi", max_tokens=4, speculative=probe)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        details.add(info.value.details())
    assert details == {
        "`speculative` must name a draft source this coordinator offers: none, ngram, self, hf"
    }
    assert client.generate("Say hi.", max_tokens=3, speculative="self", k=2).completion_tokens == 3


def test_seeded_speculative_sampling_is_reproducible_at_fixed_k(client):
    def sample(seed: int) -> list[int]:
        return client.generate(
            "Write a poem about rain.",
            max_tokens=32,
            temperature=0.9,
            top_k=40,
            seed=seed,
            ignore_eos=True,
            speculative="self",
            k=4,
        ).token_ids

    first = sample(7)
    assert sample(7) == first
    assert len(first) == 32 and sample(8) != first


def test_cancelled_speculative_stream_releases_sessions(fleet, client):
    call = client.responses(
        "List every country in Europe.", max_tokens=400, ignore_eos=True, speculative="self"
    )
    next(call)
    next(call)
    call.cancel()
    assert sessions_after_release(fleet.stages) == [0, 0]


def test_cli_speculative_flags(fleet):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pipeshard.cli",
            "generate",
            "--json",
            "--coordinator",
            fleet.coordinator,
            "--speculative",
            "ngram",
            "--k",
            "auto",
            "--max-tokens",
            "48",
            "--ignore-eos",
            "List the days of the week, then list them again.",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    result = json.loads(out.stdout)
    assert result["speculative"] == "ngram" and result["completion_tokens"] == 48
    bad = subprocess.run(
        [
            sys.executable,
            "-m",
            "pipeshard.cli",
            "generate",
            "--coordinator",
            fleet.coordinator,
            "--k",
            "0",
            "hi",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "--k" in bad.stderr
