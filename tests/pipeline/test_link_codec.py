"""A loopback fleet measures its hops and leaves compression off (``--codec auto``, the default)."""

from __future__ import annotations

import json

import pytest

from pipeshard.clients.client import PipeshardClient

pytestmark = pytest.mark.slow


def _events(log_path, name: str) -> list[dict]:
    out = []
    for line in log_path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if record.get("event") == name:
            out.append(record)
    return out


def test_loopback_fleet_measures_its_hop_and_picks_none(smollm2_export, fleet_factory):
    fleet = fleet_factory(smollm2_export(2, "int4"), 2)
    with PipeshardClient(fleet.coordinator, timeout_s=120) as client:
        prompt = "Explain in a few sentences how a refrigerator keeps food cold, step by step."
        result = client.generate(prompt, max_tokens=8, ignore_eos=True)
    assert result.completion_tokens == 8
    stage0 = fleet.process("stage0").log
    measured = _events(stage0, "link_measured")
    assert measured, "stage 0 never measured its hop"
    assert measured[-1]["address"] == fleet.stages[1]
    # loopback moves far more than the ~70 Mbit/s below which lane blocks would pay off
    assert measured[-1]["bandwidth_bytes_s"] > 50e6 and measured[-1]["rtt_s"] > 0
    choices = _events(stage0, "link_codec")
    assert choices and {c["mode"] for c in choices} == {"auto"}
    assert {c["codec"] for c in choices} == {"CODEC_NONE"}
