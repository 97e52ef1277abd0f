"""``pipeshard exporter-service``: serve Export and FetchShard over gRPC."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pipeshard import paths
from pipeshard.exporter.service import ExporterServicer
from pipeshard.grpc_server import run_server
from pipeshard.offline import set_offline_defaults
from pipeshard.settings import ServerSettings, load_settings, setting
from pipeshard.topology import Topology
from pipeshard.v1 import exporter_pb2_grpc


@dataclass
class ExporterSettings(ServerSettings):
    topology: Path | None = setting(None, "topology file giving this service's port")
    shards_dir: Path | None = setting(
        None, "folder exports are written to and served from (default ./shards)"
    )
    models_dir: Path | None = setting(
        None,
        "folder of the models Export may convert, named by folder name (default ./models); a path "
        "or `..` in a request's `model` is refused",
    )


def main(argv: list[str] | None = None) -> int:
    set_offline_defaults()
    settings = load_settings(ExporterSettings, argv, prog="pipeshard exporter-service")
    if settings.topology is not None:
        me = Topology.load(settings.topology).exporter
        settings.port = settings.port or me.port
        settings.metrics_port = settings.metrics_port or me.metrics_port
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
