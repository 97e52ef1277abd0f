"""Namespaces, tbf-capped veths and the watchdog, without a model (root only, about 3 s)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time

import pytest

from pipeshard.services.wan import netns
from pipeshard.services.wan.netns import Link

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None,
    reason="the WAN emulator needs root and iproute2 (network namespaces, veth pairs, tc)",
)

SINK = """
import socket, sys
server = socket.create_server((sys.argv[1], 9000))
print("ready", flush=True)
conn, _ = server.accept()
total = 0
while data := conn.recv(65536):
    total += len(data)
conn.sendall(str(total).encode())
"""


@pytest.fixture
def link():
    netns.require_free()
    link = Link(0)
    try:
        netns.create(link, rate_mbit=20)
        yield link
    finally:
        netns.destroy([link.namespace])


def test_veth_is_capped_by_tbf_on_both_ends_and_destroy_leaves_nothing(link):
    assert (
        "tbf"
        in subprocess.run(["tc", "qdisc", "show", "dev", link.root_if], capture_output=True, text=True).stdout
    )
    inside = ["tc", "-n", link.namespace, "qdisc", "show", "dev", link.ns_if]
    assert "tbf" in subprocess.run(inside, capture_output=True, text=True).stdout
    sink = subprocess.Popen(
        [*link.exec_prefix, sys.executable, "-c", SINK, link.ns_ip], stdout=subprocess.PIPE, text=True
    )
    try:
        assert sink.stdout.readline().strip() == "ready"
        payload = b"x" * 1_000_000
        t0 = time.monotonic()
        with socket.create_connection((link.ns_ip, 9000), timeout=10) as conn:
            conn.sendall(payload)
            conn.shutdown(socket.SHUT_WR)
            assert conn.recv(64) == str(len(payload)).encode()
        elapsed = time.monotonic() - t0
    finally:
        sink.kill()
        sink.wait()
    # 1 MB at 20 mbit is 0.4 s; the 64 KB burst passes at once
    assert 0.3 < elapsed < 5, elapsed
    netns.destroy([link.namespace])
    assert link.namespace not in netns.namespaces() and not netns.interfaces()


def test_watchdog_tears_down_when_its_owner_dies_unannounced(link, tmp_path):
    (tmp_path / "namespaces").write_text(f"{link.namespace}\n")
    owner = subprocess.Popen(["sleep", "0.5"])  # stands for a benchmark killed with SIGKILL
    watchdog = subprocess.run(
        [
            sys.executable,
            "-m",
            "pipeshard.services.wan.watchdog",
            str(tmp_path),
            "--owner-pid",
            str(owner.pid),
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    owner.wait()
    assert watchdog.returncode == 0, watchdog.stderr
    assert link.namespace in watchdog.stdout
    assert link.namespace not in netns.namespaces() and not netns.interfaces()
    assert not (tmp_path / "namespaces").exists()


def test_refuses_while_another_emulator_is_up(link):
    with pytest.raises(netns.WanError, match="another WAN emulator"):
        netns.require_free()


def test_a_stale_fleet_record_leaves_the_namespaces_another_fleet_now_lives_in(link, tmp_path):
    """A killed benchmark's run folder records psw-0 and processes long gone; `wan down --run-dir`
    on it while another fleet runs in psw-0 must not cut that fleet's network."""
    from pipeshard.services.wan import state

    stale = tmp_path / "stale"
    stale.mkdir()
    (stale / "pids").write_text("999999 0 stage0\n")  # not the process started (gone)
    (stale / state.NAMESPACES).write_text(link.namespace)
    living = subprocess.Popen([*link.exec_prefix, "sleep", "30"])
    try:
        assert state.teardown(stale) == ([], [])
        assert link.namespace in netns.namespaces()
    finally:
        living.kill()
        living.wait()
    (stale / state.NAMESPACES).write_text(link.namespace)  # no process lives in it now: a leftover
    assert state.teardown(stale) == ([], [link.namespace])
    assert link.namespace not in netns.namespaces()
