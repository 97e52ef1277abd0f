"""``pipeshard serve-openai``: the OpenAI-compatible HTTP gateway in front of a coordinator."""

from __future__ import annotations

import asyncio
import socket
import sys

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


def _refusal(settings: GatewaySettings) -> str:
    """Why the gateway must not start as configured ("" if it may)."""
    if settings.chunk_deadline_s < 0:
        return f"--chunk-deadline-s must be 0 (off) or more, got {settings.chunk_deadline_s:g}"
    if (settings.tls_cert is None) != (settings.tls_key is None):
        return "--tls-cert and --tls-key go together"
    loopback = settings.host in ("localhost", "::1") or settings.host.startswith("127.")
    if settings.tls_cert is None and not loopback and not settings.allow_plaintext:
        return (
            f"refusing to serve plain HTTP on {settings.host}: API keys would cross the network in "
            "clear; give --tls-cert and --tls-key, or ask for plaintext with --allow-plaintext"
        )
    return ""


def main(argv: list[str] | None = None) -> int:
    settings = load_settings(GatewaySettings, argv, prog="pipeshard serve-openai")
    configure_logging(settings.log_format, settings.log_level, service="gateway")
    if refusal := _refusal(settings):
        print(f"openai gateway: {refusal}", file=sys.stderr, flush=True)
        return 1
    sock = _listen(settings.host, settings.port)
    metrics = start_metrics_server(settings.metrics_port, settings.metrics_host)
    config = uvicorn.Config(
        create_app(settings),
        log_config=None,
        access_log=False,
        timeout_graceful_shutdown=10,
        # uvicorn annotates it int but schedules it with call_later, which takes any seconds
        timeout_keep_alive=settings.idle_timeout_s,  # type: ignore[arg-type]
        ssl_certfile=str(settings.tls_cert) if settings.tls_cert else None,
        ssl_keyfile=str(settings.tls_key) if settings.tls_key else None,
        http=guarded_protocol(
            settings.header_timeout_s,
            settings.drain_timeout_s,
            settings.write_buffer_bytes,
            settings.chunk_deadline_s,
        ),
    )
    server = uvicorn.Server(config)
    host, port = sock.getsockname()[:2]
    scheme = "https" if settings.tls_cert else "http"
    print(f"openai gateway listening on {host}:{port} ({scheme})", flush=True)
    try:
        asyncio.run(server.serve(sockets=[sock]))
    finally:
        if metrics is not None:
            metrics.close()
    return 0
