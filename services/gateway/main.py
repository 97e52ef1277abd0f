"""``pipeshard serve-openai``: the OpenAI-compatible HTTP gateway in front of a coordinator."""

from __future__ import annotations

import asyncio
import socket

import uvicorn

from pipeshard.logs import configure_logging
from pipeshard.metrics import start_metrics_server
from pipeshard.services.gateway.app import create_app
from pipeshard.services.gateway.protocol import guarded_protocol
from pipeshard.services.gateway.settings import GatewaySettings
from pipeshard.settings import load_settings


def _listen(host: str, port: int) -> socket.socket:
    """Bound and listening before the ``listening on`` line, so a reader can connect at once."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def main(argv: list[str] | None = None) -> int:
    settings = load_settings(GatewaySettings, argv, prog="pipeshard serve-openai")
    configure_logging(settings.log_format, settings.log_level, service="gateway")
    sock = _listen(settings.host, settings.port)
    metrics = start_metrics_server(settings.metrics_port, settings.metrics_host)
    config = uvicorn.Config(
        create_app(settings),
        log_config=None,
        access_log=False,
        timeout_graceful_shutdown=10,
        timeout_keep_alive=settings.idle_timeout_s,
        http=guarded_protocol(
            settings.header_timeout_s, settings.drain_timeout_s, settings.write_buffer_bytes
        ),
    )
    server = uvicorn.Server(config)
    host, port = sock.getsockname()[:2]
    print(f"openai gateway listening on {host}:{port}", flush=True)
    try:
        asyncio.run(server.serve(sockets=[sock]))
    finally:
        if metrics is not None:
            metrics.close()
    return 0
