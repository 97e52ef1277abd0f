"""The chaos soak's recovery analysis over a scripted run (logs and client timings written here):
a stage failover is measured to the stream's first token after the failover finished, not to a
later stall; a coordinator's to its continuation's first token, not to a token of the dead one
read late, split kill -> resent -> resumed -> token; and a coordinator fault after a stage fault
is analysed at all (a shadowed table once crashed the end of a 10-minute run)."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace

import pytest

from bench import soak_chaos
from bench.soak_chaos import _recovery

T0 = 1_800_000_000.0  # wall seconds


def _log(path: Path, event: str, request_id: str, at: float) -> None:
    stamp = datetime.fromtimestamp(at, UTC).isoformat().replace("+00:00", "Z")
    with path.open("a") as log:
        log.write(json.dumps({"event": event, "request_id": request_id, "timestamp": stamp}) + "\n")


def test_recovery_counts_from_the_fault_to_the_first_token_after_the_move(tmp_path, monkeypatch):
    monkeypatch.setattr(soak_chaos, "KINDS", ("stage", "coordinator"))
    monkeypatch.setattr(soak_chaos, "COORDINATORS", 2)
    # A stage fault at T0: the failover ends at +0.8 s, the next token at +1.0 s, then a 2 s stall
    # unrelated to it ends at +5 s. A coordinator kill at T0 + 10: a token of the dead coordinator
    # is read late at +10.3, the client sends the stream on at +10.5, the survivor logs it at
    # +10.7 and the continuation's first token comes at +12.0.
    _log(tmp_path / "coordinator.log", "session_failed_over", "a", T0 + 0.8)
    _log(tmp_path / "coordinator1.log", "generation_resumed", "b", T0 + 10.7)
    chaos = SimpleNamespace(
        fleet=SimpleNamespace(run_dir=tmp_path),
        faults=[{"kind": "stage", "at": T0}, {"kind": "coordinator", "at": T0 + 10}],
        streams={
            "a": [T0 - 0.1, T0 + 1.0, T0 + 3.0, T0 + 5.0],
            "b": [T0 + 9.9, T0 + 10.3, T0 + 12.0, T0 + 12.1],
        },
        resent={"b": T0 + 10.5},
    )
    recovery = _recovery(chaos)
    assert recovery["stage"]["p50"] == pytest.approx(1000, abs=1)
    coordinator = recovery["coordinator"]
    assert coordinator["p50"] == pytest.approx(2000, abs=1) and coordinator["faults"] == 1
    split = {part: figures["p50"] for part, figures in coordinator["split"].items()}
    assert split == pytest.approx(
        {"kill_to_resent": 500, "resent_to_resumed": 200, "resumed_to_token": 1300}, abs=1
    )
