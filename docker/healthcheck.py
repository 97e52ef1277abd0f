"""Container HEALTHCHECK: asks this container's service whether it serves.

gRPC services: grpc.health.v1 status ("") on 127.0.0.1:PIPESHARD_PORT, over mutual TLS with the
container's own certificate when PIPESHARD_TLS_DIR is set (its name PIPESHARD_TLS_NAME; every
certificate is valid for 127.0.0.1), so a TLS service is seen healthy. Health calls need no token.
The gateway (HEALTHCHECK_URL set): HTTP GET of that URL, healthy on 200.
Exit 0 only when serving; a coordinator reports NOT_SERVING while any stage is unreachable and
every service does while it drains, so the orchestrator sees both.
"""

import os
import sys
import urllib.request
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def http_check(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=3) as reply:
            status = reply.status
    except OSError as exc:
        print(f"{url}: {exc}", file=sys.stderr)
        return 1
    print(f"{url}: HTTP {status}")
    return 0 if status == 200 else 1


def channel(address: str) -> grpc.Channel:
    tls_dir = os.environ.get("PIPESHARD_TLS_DIR")
    if not tls_dir:
        return grpc.insecure_channel(address)
    name = os.environ.get("PIPESHARD_TLS_NAME", "")
    folder = Path(tls_dir)
    credentials = grpc.ssl_channel_credentials(
        root_certificates=(folder / "ca.pem").read_bytes(),
        private_key=(folder / f"{name}.key").read_bytes(),
        certificate_chain=(folder / f"{name}.pem").read_bytes(),
    )
    return grpc.secure_channel(address, credentials)


def main() -> int:
    url = os.environ.get("HEALTHCHECK_URL")
    if url:
        return http_check(url)
    address = f"127.0.0.1:{os.environ.get('PIPESHARD_PORT', '50051')}"
    try:
        with channel(address) as chan:
            reply = health_pb2_grpc.HealthStub(chan).Check(health_pb2.HealthCheckRequest(), timeout=3)
    except (grpc.RpcError, OSError) as exc:
        detail = exc.code().name if isinstance(exc, grpc.RpcError) else str(exc)
        print(f"{address}: {detail}", file=sys.stderr)
        return 1
    print(f"{address}: {health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)}")
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1


if __name__ == "__main__":
    sys.exit(main())
