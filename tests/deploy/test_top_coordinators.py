"""Coordinators in a group in the topology, `pipeshard top` and the fleet reader: the topology
names every coordinator (``group`` after the first, ports 50051 + c by default), a file without a
group still loads, and top lists each coordinator with its own state (two grpc.health.v1 servers,
one serving and one draining, and a third address where nothing listens)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from pipeshard.cli import main as pipeshard
from pipeshard.errors import InvalidArgument
from pipeshard.grpc_server import GrpcServer
from pipeshard.services.fleet_status import FleetReader
from pipeshard.topology import Endpoint, Topology


def test_the_loopback_topology_names_every_coordinator_of_the_group(tmp_path):
    topo = Topology.loopback("shards/x", 2, coordinators=3)
    assert [(c.port, c.metrics_port) for c in topo.coordinators] == [
        (50051, 9151),
        (50052, 9152),
        (50053, 9153),
    ]
    topo.save(tmp_path / "topology.yaml")
    assert Topology.load(tmp_path / "topology.yaml").coordinators == topo.coordinators
    alone = Topology.loopback("shards/x", 2)
    assert alone.coordinators == [alone.coordinator] and alone.group == []
    with pytest.raises(InvalidArgument, match="coordinators"):
        Topology.loopback("shards/x", 2, coordinators=0)


def test_a_topology_written_before_groups_loads_with_one_coordinator(tmp_path):
    path = tmp_path / "topology.yaml"
    Topology.loopback("shards/x", 2).save(path)
    path.write_text("\n".join(line for line in path.read_text().splitlines() if not line.startswith("group")))
    assert "group" not in path.read_text()
    topo = Topology.load(path)
    assert [c.port for c in topo.coordinators] == [50051]


class _Coordinators:
    """Two grpc.health.v1 servers on their own loop: the first serving, the second draining."""

    def __init__(self):
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self.servers = [GrpcServer([], port=0) for _ in range(2)]
        for server in self.servers:
            self._run(server.start())
        self.servers[1].set_serving("", False)

    def _run(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(30)

    def close(self) -> None:
        for server in self.servers:
            self._run(server.stop(0))
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


@pytest.fixture
def group_topology(tmp_path):
    running = _Coordinators()
    addresses = [s.address.rsplit(":", 1) for s in running.servers]
    endpoints = [Endpoint(host, int(port), 0) for host, port in addresses]
    topo = Topology(
        shards="unused",
        coordinator=endpoints[0],
        exporter=Endpoint("127.0.0.1", 1, 0),
        group=[endpoints[1], Endpoint("127.0.0.1", 2, 0)],  # nothing listens on port 2
    )
    topo.save(tmp_path / "topology.yaml")
    yield topo, tmp_path / "topology.yaml"
    running.close()


def test_the_fleet_reader_reads_every_coordinator_with_its_own_state(group_topology):
    topo, _ = group_topology
    rows = FleetReader(topo).snapshot().coordinators
    assert [(row.index, row.address) for row in rows] == [
        (c, e.address) for c, e in enumerate(topo.coordinators)
    ]
    assert [row.health.split(" ")[0] for row in rows] == ["serving", "not_serving", "down"]


def test_top_lists_every_coordinator_of_the_group(group_topology, capsys):
    topo, path = group_topology
    capsys.readouterr()
    assert pipeshard(["top", "--once", "--interval", "0.1", "--topology", str(path), "--gateway", ""]) == 0
    out = capsys.readouterr().out
    for c, endpoint in enumerate(topo.coordinators):
        line = next(line for line in out.splitlines() if endpoint.address in line)
        assert f"coordinator {c}" in line
        assert ("serving", "not_serving", "down")[c] in line
        assert (c == 1) == ("not_serving" in line)
