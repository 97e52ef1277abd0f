"""A process under a MemoryCap (cgroup v1 or v2): over the cap the kernel kills it; under, its peak is
reported. Real processes, real cgroups; skipped where no memory controller is writable."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pipeshard.errors import FailedPrecondition
from pipeshard.services.memcap import MemoryCap

MIB = 2**20
# Touch every page of N MiB, then report.
TOUCH = "import sys; b = bytearray(int(sys.argv[1]) * 2**20); b[::4096] = b'x' * len(b[::4096]); print('ok')"


def _cap(name: str, limit: int) -> MemoryCap:
    try:
        return MemoryCap(name, limit)
    except FailedPrecondition as exc:
        pytest.skip(str(exc))


def _run_under(cap: MemoryCap, mib: int) -> subprocess.CompletedProcess:
    proc = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.readline(); " + TOUCH, str(mib)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    cap.add(proc.pid)  # in the cgroup before it allocates: it waits for a line first
    out, _ = proc.communicate("go\n", timeout=60)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out)


def test_a_process_over_its_cap_is_killed():
    cap = _cap("test-over", 96 * MIB)
    try:
        result = _run_under(cap, 256)
        assert result.returncode == -9 and "ok" not in result.stdout
        assert cap.oom_kills() >= 1
    finally:
        cap.close()
    assert not cap.path.exists()


def test_a_process_under_its_cap_runs_and_its_peak_is_reported():
    cap = _cap("test-under", 512 * MIB)
    try:
        assert int((cap.path / cap.files.limit).read_text()) == 512 * MIB
        result = _run_under(cap, 128)
        assert result.returncode == 0 and result.stdout.strip() == "ok"
        assert 128 * MIB <= cap.peak_bytes() <= 512 * MIB
    finally:
        cap.close()


@pytest.mark.slow
def test_a_capped_fleet_decodes_with_each_stage_in_its_cgroup(smollm2_export, fleet_factory):
    """`start_fleet(stage_memory_limit=...)`: every stage process sits in its own capped cgroup and
    the fleet decodes as usual; stopping it removes the cgroups."""
    from pipeshard.clients.client import PipeshardClient

    limit = 1536 * MIB
    try:
        fleet = fleet_factory(smollm2_export(2, "int4"), 2, stage_memory_limit=limit)
    except FailedPrecondition as exc:
        pytest.skip(str(exc))
    for k in range(2):
        cap = fleet.caps[f"stage{k}"]
        assert int((cap.path / cap.files.limit).read_text()) == limit
        assert str(fleet.process(f"stage{k}").popen.pid) in (cap.path / "cgroup.procs").read_text().split()
    with PipeshardClient(fleet.coordinator) as client:
        result = client.generate("Name a colour.", max_tokens=8, ignore_eos=True)
    assert len(result.token_ids) == 8
    assert all(0 < fleet.caps[f"stage{k}"].peak_bytes() <= limit for k in range(2))
    fleet.stop()
    assert not any(cap.path.exists() for cap in fleet.caps.values())
