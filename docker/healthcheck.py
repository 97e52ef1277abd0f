"""Container HEALTHCHECK: asks this container's gRPC server for grpc.health.v1 status ("").

Exit 0 only for SERVING; a coordinator reports NOT_SERVING while any stage is unreachable and
every service does while it drains, so the orchestrator sees both.
"""

import os
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def main() -> int:
    address = f"127.0.0.1:{os.environ.get('PIPESHARD_PORT', '50051')}"
    try:
        with grpc.insecure_channel(address) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=3)
    except grpc.RpcError as exc:
        print(f"{address}: {exc.code().name}", file=sys.stderr)
        return 1
    print(f"{address}: {health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)}")
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1


if __name__ == "__main__":
    sys.exit(main())
