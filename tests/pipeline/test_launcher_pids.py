"""`make down` signals a recorded pid only while it is still the process the launcher started."""

from __future__ import annotations

import subprocess

from pipeshard.services.launcher import process_start_time, stop_recorded


def _sleeper() -> subprocess.Popen:
    return subprocess.Popen(["sleep", "60"])


def test_a_recorded_process_is_stopped(tmp_path):
    proc = _sleeper()
    (tmp_path / "pids").write_text(f"{proc.pid} {process_start_time(proc.pid)} stage 0\n")
    assert stop_recorded(tmp_path, timeout_s=5) == ["stage 0"]
    assert proc.wait(5) == -15
    assert not (tmp_path / "pids").exists()


def test_a_pid_that_now_names_another_process_is_left_alone(tmp_path):
    proc = _sleeper()
    try:
        started = int(process_start_time(proc.pid))
        (tmp_path / "pids").write_text(f"{proc.pid} {started - 1} stage0\n")  # as if the pid was reused
        assert stop_recorded(tmp_path, timeout_s=5) == []
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait()
    assert process_start_time(proc.pid) == ""
