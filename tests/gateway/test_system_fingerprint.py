"""The gateway's objects carry the fleet's system_fingerprint from the coordinator's summary."""

from __future__ import annotations

from pipeshard.services.gateway.responses import Shaper
from pipeshard.v1 import coordinator_pb2


def test_objects_carry_the_summary_fingerprint():
    summary = coordinator_pb2.GenerateSummary(
        finish_reason=coordinator_pb2.FINISH_REASON_STOP, text="hi", system_fingerprint="fp_0123456789ab"
    )
    whole = Shaper("chatcmpl-1", "m", chat=True).completion(summary)
    assert whole["system_fingerprint"] == "fp_0123456789ab"
    stream = Shaper("cmpl-2", "m", chat=False)
    assert stream.chunk("h")["system_fingerprint"] is None  # before the summary: unknown
    stream.summarized(summary)
    assert stream.chunk(None, "stop")["system_fingerprint"] == "fp_0123456789ab"
    assert stream.usage_chunk([summary])["system_fingerprint"] == "fp_0123456789ab"
    old = coordinator_pb2.GenerateSummary(finish_reason=coordinator_pb2.FINISH_REASON_STOP)
    assert Shaper("chatcmpl-3", "m", chat=True).completion(old)["system_fingerprint"] is None
