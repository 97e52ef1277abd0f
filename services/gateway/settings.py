"""``pipeshard serve-openai`` settings (every flag also a PIPESHARD_* environment variable)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pipeshard.settings import setting

GATEWAY_PORT = 8080
GATEWAY_METRICS_PORT = 9180  # `make up`; the gRPC services' metrics ports are 9100 + their port offset


@dataclass
class GatewaySettings:
    host: str = setting("127.0.0.1", "address to listen on")
    port: int = setting(GATEWAY_PORT, "HTTP port (0 = an ephemeral port, printed at start)")
    coordinator: str = setting(
        "127.0.0.1:50051",
        "coordinator gRPC address; several of one fleet, comma-separated, are a group: requests go to the "
        "least busy and a stream whose coordinator dies continues on another",
    )
    ca_cert: str | None = setting(
        None, "fleet CA certificate of a TLS coordinator (unset: run/ca.pem if present, else plaintext)"
    )
    model_name: str = setting("pipeshard", "model id /v1/models names (requests may send any `model`)")
    topology: Path | None = setting(
        None, "the fleet's topology file (`make up` writes config/topology.yaml): the /ui page's fleet view"
    )
    request_timeout_s: float | None = setting(
        None, "deadline of each Generate call in seconds (none = no limit)"
    )
    token: str | None = setting(
        None, "the fleet token; with it or --api-keys, every route but /health needs a bearer key (else 401)"
    )
    api_keys: Path | None = setting(
        None, "key file of `pipeshard keys` (re-read when it changes): any listed key is accepted"
    )
    max_body_bytes: int = setting(8 * 1024 * 1024, "largest request body; a larger one is 413, unread")
    body_timeout_s: float = setting(30.0, "time a request body may take to arrive; then 408")
    header_timeout_s: float = setting(
        10.0, "time a connection may take to send a request's headers (from its start or its last response)"
    )
    idle_timeout_s: float = setting(
        5.0, "a keep-alive connection with no new request for this long is closed"
    )
    drain_timeout_s: float = setting(
        10.0,
        "a connection whose unsent response bytes have not drained for this long (its reader stopped "
        "reading) is aborted, and its generation cancelled",
    )
    chunk_deadline_s: float = setting(
        10.0,
        "every chunk of a response (an SSE event of a stream) must be taken by the client (its TCP "
        "stack acknowledged it) this long after it was written, else the connection is aborted and "
        "its generation cancelled, freeing its stream slot (0 = off; Linux only)",
    )
    write_buffer_bytes: int = setting(
        0,
        "unsent bytes a connection may hold (gateway buffer and socket send buffer each) before its "
        "writes count as not drained (0 = 64 KiB and the kernel's default)",
    )
    max_streams_per_identity: int = setting(
        8,
        "SSE streams one caller (API key, fleet token, or host of an open gateway) may hold open; "
        "one more is 429",
    )
    max_streams: int = setting(
        12,
        "SSE streams all callers may hold open; keep it below the coordinator's --max-running so "
        "non-streamed requests always find a slot",
    )
    trusted_proxies: str = setting(
        "",
        "comma-separated addresses of reverse proxies whose X-Forwarded-For (its last entry) names "
        "the caller's host for the stream caps; empty: the connection's own peer",
    )
    tls_cert: Path | None = setting(
        None, "certificate (PEM, its chain after it) the gateway serves HTTPS with; with --tls-key"
    )
    tls_key: Path | None = setting(None, "private key (PEM) of --tls-cert")
    allow_plaintext: bool = setting(
        False,
        "serve plain HTTP on an address other than loopback (API keys would cross the network in clear)",
    )
    metrics_port: int = setting(0, "Prometheus /metrics port (0 = disabled)")
    metrics_host: str = setting(
        "127.0.0.1", "address /metrics listens on: loopback unless told (it is plaintext and unauthenticated)"
    )
    log_format: str = setting("json", "log line format", choices=("json", "console"))
    log_level: str = setting("info", "log level", choices=("debug", "info", "warning", "error", "critical"))
