"""/metrics is plaintext and unauthenticated: every service serves it on loopback unless told
(`--metrics-host`), whatever address its API listens on (`--host`)."""

from __future__ import annotations

import socket

import pytest
from prometheus_client import CollectorRegistry

from pipeshard.exporter.main import ExporterSettings
from pipeshard.metrics import start_metrics_server
from pipeshard.services.coordinator.main import CoordinatorSettings
from pipeshard.services.gateway.settings import GatewaySettings
from pipeshard.services.stage.main import StageSettings
from pipeshard.settings import load_settings


@pytest.mark.parametrize("cls", [StageSettings, CoordinatorSettings, ExporterSettings, GatewaySettings])
def test_metrics_stay_on_loopback_when_the_service_listens_everywhere(cls):
    wide = load_settings(cls, ["--host", "0.0.0.0"], env={})
    assert wide.metrics_host == "127.0.0.1"
    told = load_settings(cls, ["--host", "0.0.0.0", "--metrics-host", "0.0.0.0"], env={})
    assert told.metrics_host == "0.0.0.0"


def test_the_metrics_server_listens_only_where_it_is_told():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = start_metrics_server(port, registry=CollectorRegistry())
    assert server is not None
    try:
        assert server._httpd.server_address[0] == "127.0.0.1"
    finally:
        server.close()
