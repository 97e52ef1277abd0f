"""A fleet speculates by default (`make up` without a trained draft: ``auto`` over prompt lookup and
plain, adaptive K): 8 users at once, each request that does not choose gets a source by
measurement and names it, and every one's tokens equal `speculative: none`'s, token for token
(INT4, 2 stages, the default precision)."""

from __future__ import annotations

import asyncio

import pytest

from pipeshard.clients.client import AsyncPipeshardClient
from pipeshard.services.launcher import default_speculation

pytestmark = pytest.mark.slow

TOKENS = 64


@pytest.fixture(scope="module")
def fleet(smollm2_export, fleet_factory):
    coordinator_args, _ = default_speculation([])  # what `pipeshard up` passes without a draft
    return fleet_factory(smollm2_export(2, "int4"), 2, extra_coordinator_args=coordinator_args)


@pytest.mark.timeout(1800)
def test_eight_users_speculating_by_default_equal_plain(fleet, prompts):
    users = [*prompts[:6], "Repeat exactly: red blue green red blue green red blue green", prompts[7]]

    async def everyone(**kwargs):
        async with AsyncPipeshardClient(fleet.coordinator, timeout_s=900) as client:
            return await asyncio.gather(
                *(client.generate(p, max_tokens=TOKENS, ignore_eos=True, **kwargs) for p in users)
            )

    default = asyncio.run(everyone())
    plain = asyncio.run(everyone(speculative="none"))
    for i, (d, p) in enumerate(zip(default, plain, strict=True)):
        assert d.speculative in ("ngram", "none") and p.speculative == "none", i
        assert d.token_ids == p.token_ids, i
        assert p.verify_steps == 0 and p.kept_per_traversal == [TOKENS - 1], i
        if d.speculative == "none":  # auto's plain arm: no drafts at all
            assert d.verify_steps == 0, i
    # auto measures each arm once (prompt lookup first, then plain), then the rest take the first
    # source while nothing is measured yet
    assert sorted(d.speculative for d in default) == ["ngram"] * 7 + ["none"]
    assert sum(d.accepted_tokens for d in default) > 0  # the default did speculate
