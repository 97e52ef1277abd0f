"""Errors in OpenAI's shape, and the HTTP status each gRPC status code of the coordinator maps to."""

from __future__ import annotations

import re
from http import HTTPStatus

import grpc

# OpenAI's error "type" per HTTP status (the values its API and client library use).
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout",
    413: "invalid_request_error",
    429: "rate_limit_exceeded",
    499: "cancelled",
    503: "service_unavailable",
    504: "timeout",
}

_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.CANCELLED: 499,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}

# The coordinator's INVALID_ARGUMENT messages start with the parameter in backticks (pipeshard.errors).
_PARAM = re.compile(r"^`([^`]+)`")


class GatewayError(Exception):
    """An HTTP error answered as ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict:
        kind = _TYPES.get(self.status, "server_error" if self.status >= 500 else "invalid_request_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}

    @classmethod
    def from_rpc(cls, error: grpc.aio.AioRpcError) -> GatewayError:
        status = _STATUS.get(error.code(), 500)
        details = error.details() or ("cancelled" if status == 499 else HTTPStatus(status).phrase)
        match = _PARAM.match(details)
        return cls(status, details, param=match.group(1) if match else None, code=error.code().name.lower())
