"""The FastAPI app: OpenAI routes over gRPC channels to the coordinator, or to a group of them
(``--coordinator a,b``: each request goes to the one with the fewest outstanding, and a stream whose
coordinator dies continues on another, clients/group.py).

Each HTTP request is one Generate call. The first response is awaited before answering, so
refusals (bad parameter, full queue, stage down) get their HTTP status even when streaming; a
client that goes away, before or during the stream, cancels the call, and the coordinator then
cancels the generation on every stage.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path
from typing import TypeVar

import grpc
import structlog
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, StreamingResponse
from grpc_health.v1 import health_pb2, health_pb2_grpc
from starlette.exceptions import HTTPException as StarletteHTTPException

from pipeshard.auth import Authenticator
from pipeshard.clients.client import Connection
from pipeshard.clients.group import AsyncResumingCall, Coordinators, parse_addresses
from pipeshard.metrics import counter
from pipeshard.services.gateway.calls import failed, generate_call
from pipeshard.services.gateway.errors import GatewayError
from pipeshard.services.gateway.fleet import FleetWatch
from pipeshard.services.gateway.guards import AuthGuard, BodyLimit
from pipeshard.services.gateway.responses import Shaper
from pipeshard.services.gateway.schema import (
    ChatCompletionRequest,
    CompletionRequest,
    OpenAIRequest,
    invalid_body,
)
from pipeshard.services.gateway.settings import GatewaySettings
from pipeshard.services.gateway.streams import StreamCaps, caller_identity, parse_proxies
from pipeshard.v1 import coordinator_pb2, coordinator_pb2_grpc

log = structlog.get_logger(__name__)
REQUESTS = counter(
    "pipeshard_gateway_requests_total", "HTTP requests answered, by path and status.", ("path", "status")
)
# The only paths counted by name: a label taken from the URL would let a caller grow /metrics
# without end (one series per path it invents).
COUNTED_PATHS = frozenset(("/v1/chat/completions", "/v1/completions"))
T = TypeVar("T")
END = grpc.aio.EOF
UI_PAGE = Path(__file__).with_name("ui.html")


def _sse(obj: dict | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, separators=(',', ':'))}\n\n"


def _metadata(request: Request) -> tuple[tuple[str, str], ...]:
    """The caller's ``Authorization: Bearer`` (the OpenAI API key) is the coordinator's client token."""
    value = request.headers.get("authorization", "")
    return (("authorization", value),) if value.lower().startswith("bearer ") else ()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_gone(request: Request, work: Awaitable[T], call: grpc.aio.UnaryStreamCall) -> T:
    """``work``'s result, or the call cancelled and a 499 if the client disconnects first."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if not task.done():
        task.cancel()
        call.cancel()
        raise GatewayError(499, "client disconnected", code="cancelled")
    try:
        return task.result()
    except grpc.aio.AioRpcError as exc:
        raise GatewayError.from_rpc(exc) from None


class Gateway:
    """Holds the channel (opened inside the server's event loop) and serves the routes."""

    def __init__(self, settings: GatewaySettings, authenticator: Authenticator):
        self.settings = settings
        self.channels: list[grpc.aio.Channel] = []
        self.auth = authenticator
        self.streams = StreamCaps(settings.max_streams_per_identity, settings.max_streams)
        self._proxies = parse_proxies(settings.trusted_proxies)
        self.fleet = FleetWatch(settings.topology, settings.model_name)
        self._page = UI_PAGE.read_text()

    def _identity(self, request: Request) -> str:
        return caller_identity(
            self.auth,
            request.headers.get("authorization", ""),
            request.client.host if request.client else "",
            request.headers.get("x-forwarded-for", ""),
            self._proxies,
        )

    async def open(self) -> None:
        # TLS to a secured coordinator; the token is each HTTP request's own (see _metadata).
        connection = Connection.resolve(self.settings.ca_cert)
        self.addresses = parse_addresses(self.settings.coordinator)
        self.channels = [connection.aio_channel(a) for a in self.addresses]
        self.group = Coordinators([coordinator_pb2_grpc.CoordinatorServiceStub(c) for c in self.channels])

    async def close(self) -> None:
        for channel in self.channels:
            await channel.close()

    def _generate(self, request: Request, rpc: coordinator_pb2.GenerateRequest):
        """One Generate call: to the coordinator, or over the group (resumed on another if one dies)."""

        def call(stub, one: coordinator_pb2.GenerateRequest):
            return stub.Generate(one, metadata=_metadata(request), timeout=self.settings.request_timeout_s)

        if len(self.channels) == 1:
            return call(self.group.stubs[0], rpc)
        return AsyncResumingCall(self.group, rpc, call)

    async def health(self) -> JSONResponse:
        """Serving while any coordinator of the group serves (each one's state is in the body)."""
        states = await asyncio.gather(*(_serving(c) for c in self.channels))
        if not any(state == "serving" for state in states):
            detail = "; ".join(f"{a} {state}" for a, state in zip(self.addresses, states, strict=True))
            raise GatewayError(503, f"no coordinator serves: {detail}")
        return JSONResponse(
            {
                "status": "ok",
                "coordinator": self.settings.coordinator,
                "coordinators": dict(zip(self.addresses, states, strict=True)),
            }
        )

    def page(self) -> HTMLResponse:
        """The chat and fleet page: static, its key kept in the tab; it calls the API like any client."""
        return HTMLResponse(self._page, headers={"Cache-Control": "no-cache"})

    async def fleet_view(self) -> JSONResponse:
        """Stages and lanes with their nodes, precision, step time, KV use; the coordinator's load."""
        return JSONResponse(await self.fleet.read())

    def models(self) -> dict:
        return {"object": "list", "data": [self._model()]}

    def _model(self) -> dict:
        return {"id": self.settings.model_name, "object": "model", "created": 0, "owned_by": "pipeshard"}

    def model(self, model_id: str) -> dict:
        if model_id != self.settings.model_name:
            raise GatewayError(404, f"model {model_id!r} not found", param="model", code="model_not_found")
        return self._model()

    async def chat(self, body: ChatCompletionRequest, request: Request):
        return await self._answer(request, body, *generate_call(body, self.settings.model_name))

    async def completions(self, body: CompletionRequest, request: Request):
        return await self._answer(request, body, *generate_call(body, self.settings.model_name))

    async def _answer(
        self, request: Request, body: OpenAIRequest, rpc: coordinator_pb2.GenerateRequest, shaper: Shaper
    ):
        try:
            n = body.n or 1
            if not body.stream:
                if n > 1:
                    return await self._choices(request, rpc, n, shaper)
                return await self._whole(request, self._calls(request, rpc, 1)[0], shaper)
            identity = self._identity(request)
            self.streams.open(identity)  # before the calls: a refused stream takes no slot
            try:
                if n > 1:
                    await self._prefill(request, rpc)
                calls = self._calls(request, rpc, n)
            except BaseException:
                self.streams.close(identity)
                raise
            return await self._streamed(request, body, calls, shaper, identity)
        except GatewayError as exc:
            # The coordinator names its own field; the client sent response_format (or a guided_*).
            if exc.param is not None and exc.param.split(".")[0] == "grammar":
                exc.param = body.grammar_param
                exc.message = f"`{body.grammar_param}`: {exc.message.split('` ', 1)[-1]}"
            raise

    async def _prefill(self, request: Request, rpc: coordinator_pb2.GenerateRequest) -> None:
        """Computes the prompt once for ``n`` choices: a one-token generation of it, whose end
        leaves the prompt's KV in the stages' prefix cache (the coordinator keeps a finished
        sequence before its summary), so each choice restores it there instead of prefilling."""
        warm = coordinator_pb2.GenerateRequest()
        warm.CopyFrom(rpc)
        warm.request_id = f"{rpc.request_id}-prefill"
        warm.params.max_tokens = 1
        for name in ("grammar", "seed", "temperature", "logprobs", "top_logprobs", "logit_bias"):
            warm.params.ClearField(name)
        call = self._generate(request, warm)
        try:
            summary, *_ = await _unless_gone(request, _collect(call), call)
        finally:
            call.cancel()
        if (error := failed(summary)) is not None:
            raise error

    def _calls(self, request: Request, rpc: coordinator_pb2.GenerateRequest, n: int) -> list:
        """``n`` Generate calls at once, choice i seeded ``seed + i`` (one call: ``rpc`` itself)."""
        calls = []
        for i in range(n):
            one = rpc
            if n > 1:
                one = coordinator_pb2.GenerateRequest()
                one.CopyFrom(rpc)
                one.request_id = f"{rpc.request_id}-{i}"
                if rpc.params.HasField("seed"):
                    one.params.seed = (rpc.params.seed + i) % 2**64
            calls.append(self._generate(request, one))
        return calls

    async def _choices(self, request: Request, rpc: coordinator_pb2.GenerateRequest, n: int, shaper: Shaper):
        """``n`` > 1 (not streamed): one prefill, then n Generate calls at once reusing it."""
        await self._prefill(request, rpc)
        calls = self._calls(request, rpc, n)
        try:
            results = await asyncio.gather(*(_unless_gone(request, _collect(c), c) for c in calls))
        finally:
            for c in calls:
                c.cancel()
        for summary, *_ in results:
            if (error := failed(summary)) is not None:
                raise error
        return JSONResponse(shaper.completions(results))

    async def _whole(self, request: Request, call, shaper: Shaper) -> JSONResponse:
        """A generation answered whole (not streamed)."""
        try:
            summary, tokens, logprobs, tops = await _unless_gone(request, _collect(call), call)
        finally:
            call.cancel()  # a no-op once the call has finished
        if (error := failed(summary)) is not None:
            raise error
        return JSONResponse(shaper.completion(summary, tokens, logprobs, tops))

    async def _streamed(
        self, request: Request, body: OpenAIRequest, calls: list, shaper: Shaper, identity: str
    ):
        """The SSE response of one or more choices, once each call has answered (a refusal before
        the first token is still an HTTP error)."""
        try:
            firsts = [await _unless_gone(request, call.read(), call) for call in calls]
        except BaseException:
            for call in calls:
                call.cancel()
            self.streams.close(identity)
            raise
        return _EventStream(
            calls,
            _events(calls, firsts, shaper, body.include_usage),
            on_end=lambda: self.streams.close(identity),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )


async def _serving(channel: grpc.aio.Channel) -> str:
    """One coordinator's health: "serving", "not serving" or "unreachable: <why>"."""
    try:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2.0)
    except grpc.aio.AioRpcError as exc:
        return f"unreachable: {exc.details()}"
    return "serving" if reply.status == health_pb2.HealthCheckResponse.SERVING else "not serving"


class _EventStream(StreamingResponse):
    """Cancels its Generate calls however the response ends. When the client goes away (or is
    aborted for not reading) Starlette cancels the streaming task, which leaves the event generator
    suspended at a ``yield`` until garbage collection, its calls (and coordinator slots) still live."""

    def __init__(
        self,
        calls: list[grpc.aio.UnaryStreamCall],
        events: AsyncIterator[str],
        on_end: Callable[[], None],
        **kwargs,
    ):
        super().__init__(events, **kwargs)
        self._calls = calls
        self._on_end = on_end
        self._ended = False

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._end()

    def _end(self) -> None:
        for call in self._calls:
            call.cancel()  # a no-op once the call has finished
        if not self._ended:  # the stream's count, once however the response ends
            self._ended = True
            self._on_end()

    async def stream_response(self, send) -> None:
        try:
            await super().stream_response(send)
        finally:
            self._end()


async def _collect(
    call: grpc.aio.UnaryStreamCall,
) -> tuple[coordinator_pb2.GenerateSummary, list[str], list[float], list[coordinator_pb2.TopLogprobs]]:
    """The whole stream: its summary and every token's text, logprob and alternatives (when asked for)."""
    summary, tokens, logprobs, tops = None, [], [], []
    while (response := await call.read()) is not END:
        if response.HasField("summary"):
            summary = response.summary
        else:
            tokens.extend(response.chunk.tokens)
            logprobs.extend(response.chunk.logprobs)
            tops.extend(response.chunk.top_logprobs)
    if summary is None:
        raise GatewayError(502, "the coordinator ended the stream without a summary")
    return summary, tokens, logprobs, tops


async def _events(
    calls: list[grpc.aio.UnaryStreamCall], firsts: list, shaper: Shaper, include_usage: bool
) -> AsyncIterator[str]:
    """SSE lines: each choice's role chunk (chat), text deltas and finish chunk (interleaved as
    they come when n > 1, each with its ``index``), then the usage chunk and ``[DONE]``. Cancelled
    by Starlette when the client disconnects; the calls are cancelled with it."""
    summaries: dict[int, coordinator_pb2.GenerateSummary] = {}
    shapers = [shaper] + [replace(shaper) for _ in calls[1:]]  # each choice's own text offsets
    choices = [
        _choice_events(call, first, one, include_usage, index, summaries)
        for index, (call, first, one) in enumerate(zip(calls, firsts, shapers, strict=True))
    ]
    try:
        async for line in choices[0] if len(choices) == 1 else _merged(choices):
            yield line
        if include_usage:
            yield _sse(shaper.usage_chunk([summaries[i] for i in range(len(calls))]))
        yield _sse("[DONE]")
    except GatewayError as exc:
        yield _sse(exc.body())
    except grpc.aio.AioRpcError as exc:
        yield _sse(GatewayError.from_rpc(exc).body())
    finally:
        for call in calls:
            call.cancel()  # a no-op once the call has finished


async def _choice_events(
    call: grpc.aio.UnaryStreamCall,
    response,
    shaper: Shaper,
    include_usage: bool,
    index: int,
    summaries: dict[int, coordinator_pb2.GenerateSummary],
) -> AsyncIterator[str]:
    """One choice's chunks, from its first response on; its summary goes into ``summaries``
    (a failed generation raises its GatewayError)."""
    if shaper.chat:
        yield _sse(shaper.chunk(None, role=True, with_usage=include_usage, index=index))
    summary = None
    held: list[str] = []  # an answer that may be a tool call, until it ends
    while response is not END:
        if response.HasField("chunk"):
            chunk = response.chunk
            if shaper.holds_text:
                held.append(chunk.text)
            # A token that ends inside a UTF-8 character brings no text, but its logprob.
            elif chunk.text or (shaper.logprobs and chunk.token_ids):
                logprobs = shaper.token_logprobs(chunk.tokens, chunk.logprobs, chunk.top_logprobs)
                yield _sse(shaper.chunk(chunk.text, with_usage=include_usage, logprobs=logprobs, index=index))
        else:
            summary = response.summary
        response = await call.read()
    if summary is None:
        raise GatewayError(502, "no summary from coordinator")
    error = failed(summary)
    if error is not None:
        raise error
    finish = "length" if summary.finish_reason == coordinator_pb2.FINISH_REASON_LENGTH else "stop"
    if held:
        tool = shaper.tool_call("".join(held)) if finish == "stop" else None
        if tool is not None:
            finish = "tool_calls"
            yield _sse(shaper.tool_call_chunk(tool, include_usage, index=index))
        else:
            yield _sse(shaper.chunk("".join(held), with_usage=include_usage, index=index))
    shaper.summarized(summary)
    summaries[index] = summary
    yield _sse(shaper.chunk(None, finish, with_usage=include_usage, index=index))


async def _merged(streams: list[AsyncIterator[str]]) -> AsyncIterator[str]:
    """The lines of several streams as each comes; the first failure ends them all."""
    queue: asyncio.Queue[str | Exception | None] = asyncio.Queue()

    async def pump(stream: AsyncIterator[str]) -> None:
        try:
            async for line in stream:
                await queue.put(line)
            await queue.put(None)
        except Exception as exc:  # handed to the reader, which raises it
            await queue.put(exc)

    tasks = [asyncio.ensure_future(pump(stream)) for stream in streams]
    try:
        left = len(tasks)
        while left:
            item = await queue.get()
            if item is None:
                left -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()


def create_app(settings: GatewaySettings) -> FastAPI:
    authenticator = Authenticator.from_settings(settings.token, settings.api_keys)
    gateway = Gateway(settings, authenticator)

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        await gateway.open()
        yield
        await gateway.close()

    app = FastAPI(title="pipeshard OpenAI-compatible gateway", lifespan=lifespan)
    app.state.gateway = gateway
    # Added last runs first: the key check, then the body limit, then the routes.
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes, timeout_s=settings.body_timeout_s)
    app.add_middleware(AuthGuard, authenticator=authenticator)

    @app.middleware("http")
    async def count(request: Request, call_next):
        response = await call_next(request)
        path = request.url.path if request.url.path in COUNTED_PATHS else "other"
        REQUESTS.labels(path=path, status=str(response.status_code)).inc()
        return response

    @app.exception_handler(GatewayError)
    async def gateway_error(_request: Request, exc: GatewayError) -> JSONResponse:
        if exc.status >= 500:
            log.warning("request failed", status=exc.status, error=exc.message)
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        """404, 405 and the like in OpenAI's shape instead of FastAPI's ``{"detail": ...}``."""
        if exc.status_code == 400:  # FastAPI's "error parsing the body": bytes that are not UTF-8 JSON
            error = GatewayError(400, "the request body is not valid UTF-8 JSON", code="invalid_json")
            return JSONResponse(error.body(), status_code=400)
        what = {404: "no such route", 405: "method not allowed on"}.get(exc.status_code, exc.detail)
        error = GatewayError(exc.status_code, f"{what}: {request.method} {request.url.path}")
        return JSONResponse(error.body(), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(_request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0]
        if first["type"] == "json_invalid":  # its location is a character offset, not a parameter
            error = first.get("ctx", {}).get("error", first["msg"])
            message = f"the request body is not valid JSON: {error} (at character {first['loc'][-1]})"
            return JSONResponse(GatewayError(400, message, code="invalid_json").body(), status_code=400)
        return JSONResponse(invalid_body(first).body(), status_code=400)

    app.get("/health")(gateway.health)
    app.get("/", include_in_schema=False)(lambda: RedirectResponse("/ui"))
    app.get("/ui", include_in_schema=False)(gateway.page)
    app.get("/fleet")(gateway.fleet_view)
    app.get("/v1/models")(gateway.models)
    app.get("/v1/models/{model_id}")(gateway.model)
    app.post("/v1/chat/completions")(gateway.chat)
    app.post("/v1/completions")(gateway.completions)
    return app
