"""``pipeshard serve-openai`` settings (every flag also a PIPESHARD_* environment variable)."""

from __future__ import annotations

from dataclasses import dataclass

from pipeshard.settings import setting

GATEWAY_PORT = 8080
GATEWAY_METRICS_PORT = 9180  # `make up`; the gRPC services' metrics ports are 9100 + their port offset


@dataclass
class GatewaySettings:
    host: str = setting("127.0.0.1", "address to listen on")
    port: int = setting(GATEWAY_PORT, "HTTP port (0 = an ephemeral port, printed at start)")
    coordinator: str = setting("127.0.0.1:50051", "coordinator gRPC address")
    ca_cert: str | None = setting(
        None, "fleet CA certificate of a TLS coordinator (unset: run/ca.pem if present, else plaintext)"
    )
    model_name: str = setting("pipeshard", "model id /v1/models names (requests may send any `model`)")
    request_timeout_s: float | None = setting(
        None, "deadline of each Generate call in seconds (none = no limit)"
    )
    metrics_port: int = setting(0, "Prometheus /metrics port (0 = disabled)")
    log_format: str = setting("json", "log line format", choices=("json", "console"))
    log_level: str = setting("info", "log level", choices=("debug", "info", "warning", "error", "critical"))
