"""The kernel's link faults (nftables in a namespace) measured on a real veth: each does what
netns.fault claims (root and nft only, a few seconds, no model).

loss: the counted drop rate is the one asked for and every byte still arrives intact (TCP resent
what was dropped).
partition: an open connection carries nothing either way and is neither reset nor closed; healed,
the bytes held arrive. reset: the namespace's side is refused with an RST. Only the fault's port
is touched: another port on the same veth still carries bytes.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import threading

import pytest

from pipeshard.services.wan import netns
from pipeshard.services.wan.netns import Link

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("nft") is None,
    reason="kernel link faults need root, iproute2 and nft (nftables)",
)

PORT = 7001  # the emulator's next-hop port on the root side
OTHER_PORT = 7000
HELD_S = 1.0

# A client in the namespace: connects to ARGV[1]:ARGV[2], then sends each stdin line and says so.
CLIENT = """
import socket, sys
conn = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=60)
print("connected", flush=True)
for line in sys.stdin:
    try:
        conn.sendall(line.encode())
        print("sent", flush=True)
    except OSError as exc:
        print(type(exc).__name__, flush=True)
"""


@pytest.fixture
def link():
    netns.require_free()
    link = Link(0)
    try:
        netns.create(link, rate_mbit=None)
        yield link
    finally:
        netns.destroy([link.namespace])


def _listen(link: Link, port: int) -> socket.socket:
    server = socket.create_server((link.root_ip, port))
    server.settimeout(30)
    return server


def test_loss_drops_the_rate_asked_for_and_tcp_delivers_every_byte(link):
    server = _listen(link, PORT)
    netns.fault(link, "loss", PORT, percent=10)
    payload = os.urandom(24_000_000)  # GSO sends up to 64 KB a packet on a veth
    got = bytearray()

    def sink() -> None:
        conn, _ = server.accept()
        with conn:
            while data := conn.recv(65536):
                got.extend(data)

    reader = threading.Thread(target=sink)
    reader.start()
    sender = f"import socket,sys; c=socket.create_connection(('{link.root_ip}',{PORT}),timeout=120); "
    sender += "c.sendall(sys.stdin.buffer.read()); c.close()"
    subprocess.run([*link.exec_prefix, sys.executable, "-c", sender], input=payload, check=True, timeout=300)
    reader.join(timeout=300)
    server.close()
    dropped, passed = netns.fault_counts(link)
    assert bytes(got) == payload
    assert dropped + passed > 300, (dropped, passed)
    assert 0.05 <= dropped / (dropped + passed) <= 0.15, (dropped, passed)


def test_partition_holds_an_open_connection_without_closing_it_then_heals(link):
    server = _listen(link, PORT)
    client = subprocess.Popen(
        [*link.exec_prefix, sys.executable, "-c", CLIENT, link.root_ip, str(PORT)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert client.stdout.readline().strip() == "connected"
        conn, _ = server.accept()
        client.stdin.write("before\n")
        client.stdin.flush()
        assert client.stdout.readline().strip() == "sent"
        assert conn.recv(64) == b"before\n"

        netns.fault(link, "partition", PORT)
        client.stdin.write("during\n")
        client.stdin.flush()
        assert client.stdout.readline().strip() == "sent"  # into the socket buffer: no error
        conn.settimeout(HELD_S)
        with pytest.raises(TimeoutError):
            conn.recv(64)  # nothing arrives, and no EOF or reset either
        dropped, passed = netns.fault_counts(link)
        assert dropped > 0 and passed == 0

        netns.heal(link)
        conn.settimeout(60)
        assert conn.recv(64) == b"during\n"  # TCP's retransmit brings it once healed
        conn.close()
    finally:
        client.kill()
        client.wait()
        server.close()


def test_reset_refuses_the_port_with_an_rst_and_leaves_other_ports_alone(link):
    other = _listen(link, OTHER_PORT)
    netns.fault(link, "reset", PORT)
    refused = subprocess.run(
        [*link.exec_prefix, sys.executable, "-c", CLIENT, link.root_ip, str(PORT)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "ConnectionRefusedError" in refused.stderr  # an RST answers the SYN
    reached = subprocess.run(
        [*link.exec_prefix, sys.executable, "-c", CLIENT, link.root_ip, str(OTHER_PORT)],
        input="x\n",
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert reached.stdout.split() == ["connected", "sent"]
    conn, _ = other.accept()
    assert conn.recv(8) == b"x\n"
    conn.close()
    other.close()


def test_a_fault_names_a_bad_kind_or_rate():
    with pytest.raises(ValueError, match="kind"):
        netns.fault(Link(0), "reorder", PORT)
    with pytest.raises(ValueError, match="percent"):
        netns.fault(Link(0), "loss", PORT, percent=0)
