"""Domain errors: the one vocabulary every layer raises and the gRPC interceptor maps to codes.

Domain code never imports grpc; servicers never build status codes by hand.
"""

from __future__ import annotations


class PipeshardError(Exception):
    """Base class; unexpected subclasses map to INTERNAL."""

    code = "INTERNAL"


class InvalidArgument(PipeshardError):
    """Bad input from the caller; the message names the parameter."""

    code = "INVALID_ARGUMENT"

    def __init__(self, field: str, problem: str):
        super().__init__(f"`{field}` {problem}")
        self.field = field


class NotFound(PipeshardError):
    """An unknown session, shard, export or file."""

    code = "NOT_FOUND"


class ResourceExhausted(PipeshardError):
    """Capacity is full (sessions, queue, context)."""

    code = "RESOURCE_EXHAUSTED"


class Unavailable(PipeshardError):
    """A dependency (for example a stage) is down or not ready."""

    code = "UNAVAILABLE"


class DeadlineExceeded(PipeshardError):
    """The caller's deadline passed before the work finished."""

    code = "DEADLINE_EXCEEDED"


class Unimplemented(PipeshardError):
    """An RPC of the contract that an open issue will implement (it names the issue)."""

    code = "UNIMPLEMENTED"


class FailedPrecondition(PipeshardError):
    """The system is in the wrong state for the request (for example a shard whose checksums do not match)."""

    code = "FAILED_PRECONDITION"


class PermissionDenied(PipeshardError):
    """The caller may not do this (for example touch a session another coordinator opened)."""

    code = "PERMISSION_DENIED"


class Unauthenticated(PipeshardError):
    """The caller did not prove who it is (a missing or wrong bearer token)."""

    code = "UNAUTHENTICATED"


class Internal(PipeshardError):
    """A bug or an unexpected failure; logged with its traceback."""

    code = "INTERNAL"
