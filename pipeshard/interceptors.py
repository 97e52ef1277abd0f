"""The one server interceptor every service runs first: errors -> status codes, request ids, metrics.

For each call, :class:`ErrorInterceptor` wraps the handler (all four kinds; streaming responses may
be async generators or coroutines that use ``context.write``) so that:

* a domain error (:mod:`pipeshard.errors`) ends the call with the code its ``.code`` names and its
  message ("`top_p` must be in (0, 1], got 1.5");
* ``TimeoutError`` ends it with DEADLINE_EXCEEDED;
* ``NotImplementedError`` (an RPC the servicer does not override) ends it with UNIMPLEMENTED;
* a request that does not parse (invalid UTF-8 in a string field, say) ends it with
  INVALID_ARGUMENT naming the message type, instead of grpc's UNKNOWN and a logged traceback;
* ``asyncio.CancelledError`` (the client went away) propagates untouched;
* ``context.abort(...)`` called by a servicer passes through;
* anything else ends it with INTERNAL, "internal error: <ExceptionType>" (no stack to the client),
  and the traceback is logged;
* ``request_id`` (from the ``x-request-id`` metadata, else a fresh one) and ``rpc`` are bound into
  structlog's contextvars for the call, so every line the servicer logs carries them;
* ``pipeshard_rpc_requests_total{service,method,code}`` and ``pipeshard_rpc_duration_seconds``
  are recorded.

More interceptors (authentication, say) go after it in the server's list; they then run inside it.
They may refuse a call by raising a domain error from ``intercept_service`` (for example a future
``Unauthenticated`` error with ``code = "UNAUTHENTICATED"``); it is mapped and counted like any other.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc
import structlog

from pipeshard import metrics
from pipeshard.errors import InvalidArgument, PipeshardError

REQUEST_ID_METADATA = "x-request-id"
MAX_REQUEST_ID_CHARS = 128

log = structlog.get_logger("pipeshard.rpc")


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status code and client-facing message for an exception raised by a handler."""
    if isinstance(exc, PipeshardError):
        code = grpc.StatusCode.__members__.get(str(exc.code), grpc.StatusCode.INTERNAL)
        return code, str(exc) or code.name.lower().replace("_", " ")
    if isinstance(exc, NotImplementedError):  # a generated base servicer's method not overridden
        return grpc.StatusCode.UNIMPLEMENTED, "not implemented by this server"
    if isinstance(exc, TimeoutError):  # asyncio.TimeoutError is the same class on 3.11
        return grpc.StatusCode.DEADLINE_EXCEEDED, f"deadline exceeded{': ' + str(exc) if str(exc) else ''}"
    return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}"


@dataclass(frozen=True)
class _Call:
    """What the interceptor knows about one call before its handler runs."""

    service: str
    method: str
    request_id: str

    @classmethod
    def from_details(cls, details: grpc.HandlerCallDetails) -> _Call:
        path = details.method.decode() if isinstance(details.method, bytes) else (details.method or "")
        service, _, method = path.lstrip("/").rpartition("/")
        request_id = ""
        for key, value in details.invocation_metadata or ():
            if key == REQUEST_ID_METADATA:
                request_id = value.decode(errors="replace") if isinstance(value, bytes) else value
                request_id = request_id[:MAX_REQUEST_ID_CHARS]
                break
        return cls(service or "unknown", method or path, request_id or uuid.uuid4().hex)


def _code_name(code: grpc.StatusCode | None) -> str:
    return code.name if code is not None else "OK"


@contextlib.asynccontextmanager
async def _call_scope(call: _Call, context: grpc.aio.ServicerContext) -> AsyncIterator[None]:
    """Binds the log context, maps exceptions to a status and records metrics for one call."""
    started = time.perf_counter()

    def finished(code: str) -> None:
        elapsed = time.perf_counter() - started
        metrics.observe_rpc(call.service, call.method, code, elapsed)
        log.debug("rpc finished", code=code, duration_s=round(elapsed, 6))

    with structlog.contextvars.bound_contextvars(
        request_id=call.request_id, rpc=f"{call.service}/{call.method}"
    ):
        try:
            yield
        except (asyncio.CancelledError, GeneratorExit):
            finished("CANCELLED")  # the client went away (or the server is stopping): let it unwind
            raise
        except grpc.aio.AbortError:
            finished(_code_name(context.code()))  # the servicer called context.abort() itself
            raise
        except Exception as exc:
            status, message = status_for(exc)
            if status is grpc.StatusCode.INTERNAL:
                log.exception("rpc failed", code=status.name, error=str(exc))
            else:
                log.warning("rpc error", code=status.name, error=message)
            finished(status.name)  # before abort(): abort() sends the status, and the client may look
            await context.abort(status, message)
        else:
            finished(_code_name(context.code()))  # OK unless the servicer set a code itself


Behavior = Callable[[Any, grpc.aio.ServicerContext], Any]


@dataclass(frozen=True)
class _Undecodable:
    """Stands for a request message that did not parse; the handler turns it into INVALID_ARGUMENT."""

    error: str

    def fail(self) -> InvalidArgument:
        return InvalidArgument("request", f"cannot be parsed: {self.error}")


def _tolerant(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserializer is None:
        return None

    def parse(data: bytes) -> Any:
        try:
            return deserializer(data)
        except Exception as exc:  # protobuf's DecodeError; the message says which type
            return _Undecodable(str(exc) or type(exc).__name__)

    return parse


def _checked(request: Any) -> Any:
    """The request, or for a request stream an iterator that raises at the first undecodable message."""
    if isinstance(request, _Undecodable):
        raise request.fail()
    if not hasattr(request, "__aiter__"):
        return request

    async def messages() -> AsyncIterator[Any]:
        async for message in request:
            if isinstance(message, _Undecodable):
                raise message.fail()
            yield message

    return messages()


def _wrap_unary_response(behavior: Behavior, call: _Call) -> Callable[..., Awaitable[Any]]:
    async def handle(request: Any, context: grpc.aio.ServicerContext) -> Any:
        async with _call_scope(call, context):
            result = behavior(_checked(request), context)
            return await result if inspect.isawaitable(result) else result

    return handle


def _wrap_stream_response(behavior: Behavior, call: _Call) -> Callable[..., AsyncIterator[Any]]:
    async def handle(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        async with _call_scope(call, context):
            result = behavior(_checked(request), context)
            if hasattr(result, "aclose"):  # an async generator; closed at once if the call ends early,
                async with contextlib.aclosing(result):  # so its finally blocks run (client gone)
                    async for message in result:
                        yield message
            elif hasattr(result, "__aiter__"):  # another async iterable
                async for message in result:
                    yield message
            elif inspect.isawaitable(result):  # a coroutine writing with context.write()
                await result
            elif result is not None:  # a plain iterator
                for message in result:
                    yield message

    return handle


def _wrap(handler: grpc.RpcMethodHandler, call: _Call) -> grpc.RpcMethodHandler:
    kinds = (
        ("unary_unary", grpc.unary_unary_rpc_method_handler, _wrap_unary_response),
        ("stream_unary", grpc.stream_unary_rpc_method_handler, _wrap_unary_response),
        ("unary_stream", grpc.unary_stream_rpc_method_handler, _wrap_stream_response),
        ("stream_stream", grpc.stream_stream_rpc_method_handler, _wrap_stream_response),
    )
    for attribute, make_handler, wrap in kinds:
        behavior = getattr(handler, attribute)
        if behavior is not None:
            return make_handler(
                wrap(behavior, call),
                request_deserializer=_tolerant(handler.request_deserializer),
                response_serializer=handler.response_serializer,
            )
    return handler


def _refusal(exc: Exception, call: _Call) -> grpc.RpcMethodHandler:
    """A handler that fails the call with ``exc`` (raised by an inner interceptor) without reading it."""

    async def refuse(_requests: Any, context: grpc.aio.ServicerContext) -> None:
        async with _call_scope(call, context):
            raise exc

    # Stream-stream so nothing is read first; on the wire this is valid for every call kind.
    return grpc.stream_stream_rpc_method_handler(refuse)


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Maps exceptions to status codes, binds the request id, records RPC metrics. Put it first."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        call = _Call.from_details(handler_call_details)
        try:
            handler = await continuation(handler_call_details)
        except Exception as exc:  # an inner interceptor refused the call
            return _refusal(exc, call)
        if handler is None:  # unknown method: grpc answers UNIMPLEMENTED
            return None
        return _wrap(handler, call)
