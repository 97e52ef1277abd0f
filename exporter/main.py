"""``pipeshard exporter-service``: serve Export and FetchShard over gRPC."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pipeshard import paths
from pipeshard.exporter.service import ExporterServicer
from pipeshard.grpc_server import run_server
from pipeshard.offline import set_offline_defaults
from pipeshard.settings import LOOPBACK, ServerSettings, load_settings, setting
from pipeshard.topology import EXPORTER_PORT, Topology, fleet_ports
from pipeshard.v1 import exporter_pb2_grpc


@dataclass
class ExporterSettings(ServerSettings):
    port: int | None = setting(None, "gRPC port (default: the topology's, else 50071; 0 = ephemeral)")
    metrics_port: int | None = setting(
        None,
        "Prometheus /metrics port (default: the topology's, else 9171; off when --port is given; 0 = off)",
    )
    topology: Path | None = setting(None, "topology file giving this service's host and port")
    shards_dir: Path | None = setting(
        None, "folder exports are written to and served from (default ./shards)"
    )
    models_dir: Path | None = setting(
        None,
        "folder of the models Export may convert, named by folder name (default ./models); a path "
        "or `..` in a request's `model` is refused",
    )


def resolve(settings: ExporterSettings) -> ExporterSettings:
    """Fill what the topology file knows and the flags did not say; else the fleet's ports."""
    if settings.topology is not None:
        me = Topology.load(settings.topology).exporter
        settings.host = me.host if settings.host == LOOPBACK else settings.host
        settings.port = me.port if settings.port is None else settings.port
        settings.metrics_port = me.metrics_port if settings.metrics_port is None else settings.metrics_port
    settings.port, settings.metrics_port = fleet_ports(settings.port, settings.metrics_port, EXPORTER_PORT)
    return settings


def main(argv: list[str] | None = None) -> int:
    set_offline_defaults()
    settings = resolve(load_settings(ExporterSettings, argv, prog="pipeshard exporter-service"))
    servicer = ExporterServicer(
        settings.shards_dir or paths.shards_dir(), settings.models_dir or paths.models_dir()
    )
    return run_server(
        settings,
        [(exporter_pb2_grpc.add_ExporterServiceServicer_to_server, servicer)],
        name="exporter",
        peers="clients",
        node_name="exporter",
    )
