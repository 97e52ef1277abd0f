"""The gRPC server every pipeshard service runs: one place for options, health, reflection, shutdown.

:class:`GrpcServer` builds a ``grpc.aio`` server with message-size and keepalive options, the
:class:`~pipeshard.interceptors.ErrorInterceptor` first (extra interceptors, e.g. auth, after it),
the given servicers, ``grpc.health.v1`` (overall "" and every service SERVING once started) and
server reflection. On SIGTERM/SIGINT (when asked to handle signals) it marks every service
NOT_SERVING, runs the shutdown hooks, then ``server.stop(grace_seconds)``: new calls are refused,
in-flight calls get the grace period to finish, and :meth:`GrpcServer.wait` returns.

Service entry points use :func:`run_server` (see docs/SERVICES.md).
"""

from __future__ import annotations

import asyncio
import inspect
import signal
import sys
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from pipeshard import revocation, trace
from pipeshard.auth import Authenticator, AuthInterceptor
from pipeshard.errors import PipeshardError
from pipeshard.interceptors import ErrorInterceptor
from pipeshard.logs import configure_logging
from pipeshard.metrics import MetricsServer, start_metrics_server
from pipeshard.settings import MIB, ServerSettings
from pipeshard.tls import TlsConfig

log = structlog.get_logger("pipeshard.server")

HEALTH_SERVICE = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVICE_UNKNOWN = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN

AddServicer = Callable[[Any, grpc.aio.Server], None]
ShutdownHook = Callable[[], Awaitable[None] | None]


@dataclass(frozen=True)
class Service:
    """A servicer with its generated ``add_XServicer_to_server`` function and full service name."""

    add: AddServicer
    servicer: Any
    name: str = ""  # "pipeshard.v1.StageService"; found from ``add`` when empty


ServiceSpec = Service | tuple[AddServicer, Any] | tuple[AddServicer, Any, str]


class _NameRecorder:
    """Stands in for a server so a generated ``add_..._to_server`` reveals its service name."""

    def __init__(self) -> None:
        self.names: list[str] = []

    def add_generic_rpc_handlers(self, handlers: Iterable[Any]) -> None:
        self.names.extend(h.service_name() for h in handlers if hasattr(h, "service_name"))

    def add_registered_method_handlers(self, name: str, _handlers: Any) -> None:
        self.names.append(name)


def _as_service(spec: ServiceSpec) -> Service:
    service = spec if isinstance(spec, Service) else Service(*spec)
    if service.name:
        return service
    recorder = _NameRecorder()
    service.add(service.servicer, recorder)
    names = list(dict.fromkeys(recorder.names))
    if len(names) != 1:
        raise ValueError(f"cannot tell the service name of {service.servicer!r}; pass it explicitly")
    return Service(service.add, service.servicer, names[0])


class HealthServicer(health_pb2_grpc.HealthServicer):
    """grpc.health.v1 with a shutdown that also ends Watch streams.

    The reference servicer keeps Watch streams open forever, so a single watcher (a coordinator
    watching its stages) would hold every graceful stop open for the whole grace period. Here a
    watcher receives NOT_SERVING and then its stream ends with OK.
    """

    def __init__(self) -> None:
        self._status: dict[str, int] = {}
        self._changed = asyncio.Event()
        self._shutting_down = False

    def set(self, service: str, status: int) -> None:
        """Sets a service's status ("" is the whole server); ignored once shutdown has begun."""
        if not self._shutting_down:
            self._status[service] = status
            self._notify()

    def status(self, service: str = "") -> int | None:
        return self._status.get(service)

    def enter_graceful_shutdown(self) -> None:
        """Marks every service NOT_SERVING for good and ends the Watch streams."""
        self._shutting_down = True
        for service in self._status:
            self._status[service] = NOT_SERVING
        self._notify()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def Check(self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext) -> Any:
        status = self._status.get(request.service)
        if status is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {request.service!r}")
        return health_pb2.HealthCheckResponse(status=status)

    async def Watch(self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext) -> Any:
        last = None
        while True:
            changed = self._changed
            status = self._status.get(request.service, SERVICE_UNKNOWN)
            if status != last:
                yield health_pb2.HealthCheckResponse(status=status)
                last = status
            if self._shutting_down:
                return
            await changed.wait()


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


class GrpcServer:
    """One grpc.aio server with the pipeshard defaults; ``port`` holds the bound port after start()."""

    def __init__(
        self,
        services: Sequence[ServiceSpec],
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        grace_seconds: float = 10.0,
        max_message_bytes: int = 64 * MIB,
        keepalive_time_ms: int = 30_000,
        keepalive_timeout_ms: int = 10_000,
        min_ping_interval_ms: int = 500,
        metrics_port: int = 0,
        metrics_host: str = "127.0.0.1",
        interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
        credentials: grpc.ServerCredentials | None = None,
        options: Sequence[tuple[str, Any]] = (),
        handle_signals: bool = False,
        shutdown_hooks: Sequence[ShutdownHook] = (),
    ) -> None:
        self.services = [_as_service(s) for s in services]
        self.host = host
        self.port = port  # replaced by the bound port in start()
        self.grace_seconds = grace_seconds
        self.metrics_port = metrics_port
        self.metrics_host = metrics_host
        self.credentials = credentials
        self.handle_signals = handle_signals
        self.interceptors: list[grpc.aio.ServerInterceptor] = [ErrorInterceptor(), *interceptors]
        self.options: list[tuple[str, Any]] = [
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.keepalive_time_ms", keepalive_time_ms),
            ("grpc.keepalive_timeout_ms", keepalive_timeout_ms),
            ("grpc.keepalive_permit_without_calls", 1),
            # Smallest interval at which clients may ping without data; clients keepalive at >= this
            # (services/transport/channels.py: as often as every 0.5 s, to find a stalled hop soon).
            ("grpc.http2.min_ping_interval_without_data_ms", min_ping_interval_ms),
            ("grpc.http2.max_pings_without_data", 0),
            # grpc sets SO_REUSEPORT by default, so a second process on the same port would start
            # silently and steal half the connections; fail to bind instead.
            ("grpc.so_reuseport", 0),
            *options,
        ]
        self.health = HealthServicer()
        self._shutdown_hooks: list[ShutdownHook] = list(shutdown_hooks)
        self._server: grpc.aio.Server | None = None
        self._metrics: MetricsServer | None = None
        self._stopping: asyncio.Task[None] | None = None
        self._signals: list[int] = []

    @classmethod
    def from_settings(
        cls, settings: ServerSettings, services: Sequence[ServiceSpec], **kwargs: Any
    ) -> GrpcServer:
        """A server configured from the common :class:`ServerSettings` fields (kwargs override)."""
        base = {
            "host": settings.host,
            "port": settings.port,
            "grace_seconds": settings.grace_seconds,
            "max_message_bytes": settings.max_message_bytes,
            "keepalive_time_ms": settings.keepalive_time_ms,
            "keepalive_timeout_ms": settings.keepalive_timeout_ms,
            "metrics_port": settings.metrics_port,
            "metrics_host": settings.metrics_host,
        }
        return cls(services, **{**base, **kwargs})

    @property
    def address(self) -> str:
        """``host:port`` (the bound port once started)."""
        return _address(self.host, self.port)

    @property
    def service_names(self) -> list[str]:
        return [s.name for s in self.services]

    def add_shutdown_hook(self, hook: ShutdownHook) -> None:
        """Runs ``hook`` (sync or async) after health goes NOT_SERVING, before the server stops:
        the place to end persistent streams so they do not hold the drain open."""
        self._shutdown_hooks.append(hook)

    def set_serving(self, service: str, serving: bool) -> None:
        """Reports one service ("" = the whole server) SERVING or NOT_SERVING on grpc.health.v1."""
        self.health.set(service, SERVING if serving else NOT_SERVING)

    async def start(self) -> None:
        if self._server is not None:
            raise RuntimeError("server already started")
        server = grpc.aio.server(interceptors=self.interceptors, options=self.options)
        for service in self.services:
            service.add(service.servicer, server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection(
            [*self.service_names, HEALTH_SERVICE, reflection.SERVICE_NAME], server
        )
        wanted = _address(self.host, self.port)
        try:
            if self.credentials is not None:
                bound = server.add_secure_port(wanted, self.credentials)
            else:
                bound = server.add_insecure_port(wanted)
        except RuntimeError as exc:
            raise OSError(f"cannot listen on {wanted}: {exc}") from exc
        if not bound:
            raise OSError(f"cannot listen on {wanted}")
        self.port = bound
        await server.start()
        self._server = server
        self._metrics = start_metrics_server(self.metrics_port, self.metrics_host)
        for name in ("", *self.service_names):
            self.set_serving(name, True)
        if self.handle_signals:
            self.install_signal_handlers()
        log.info(
            "grpc server started",
            address=self.address,
            services=self.service_names,
            metrics_port=self._metrics.port if self._metrics else 0,
        )

    def install_signal_handlers(self) -> None:
        """SIGTERM/SIGINT -> :meth:`stop` with the configured grace (main thread, running loop)."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal, sig)
            self._signals.append(sig)

    def _on_signal(self, sig: int) -> None:
        log.info(
            "signal received, draining", signal=signal.Signals(sig).name, grace_seconds=self.grace_seconds
        )
        if self._stopping is None:
            self._stopping = asyncio.get_running_loop().create_task(self._stop(self.grace_seconds))

    async def stop(self, grace: float | None = None) -> None:
        """Health NOT_SERVING, shutdown hooks, then stop: in-flight calls get ``grace`` seconds
        (default: the configured grace) before they are cancelled. Safe to call more than once."""
        if self._stopping is None:
            self._stopping = asyncio.ensure_future(self._stop(self.grace_seconds if grace is None else grace))
        await asyncio.shield(self._stopping)

    async def _stop(self, grace: float) -> None:
        if self._server is None:
            return
        self.health.enter_graceful_shutdown()
        await asyncio.sleep(0)  # let Watch streams pick up NOT_SERVING
        for hook in self._shutdown_hooks:
            try:
                result = hook()
                if inspect.isawaitable(result):
                    await result
            except Exception:
                log.exception("shutdown hook failed", hook=repr(hook))
        await self._server.stop(grace)
        if self._metrics is not None:
            self._metrics.close()
            self._metrics = None
        loop = asyncio.get_running_loop()
        for sig in self._signals:
            loop.remove_signal_handler(sig)
        self._signals.clear()
        log.info("grpc server stopped", address=self.address)

    async def wait(self) -> None:
        """Returns once the server has stopped (after :meth:`stop` or a handled signal)."""
        if self._server is None:
            raise RuntimeError("server not started")
        await self._server.wait_for_termination()
        if self._stopping is not None:
            await asyncio.shield(self._stopping)  # metrics closed, hooks done


ServicesFactory = Callable[[], Sequence[ServiceSpec] | Awaitable[Sequence[ServiceSpec]]]

_LOOPBACK = ("localhost", "::1", "[::1]")


def _is_loopback(host: str) -> bool:
    return host in _LOOPBACK or host.startswith("127.")


def server_security(
    settings: ServerSettings, *, peers: str, node_name: str, authenticator: Authenticator | None = None
) -> tuple[grpc.ServerCredentials | None, list[grpc.aio.ServerInterceptor]]:
    """The credentials and auth interceptors a service runs with, from its settings.

    ``peers="fleet"`` (stages): with ``tls_dir`` only holders of a fleet certificate connect.
    ``peers="clients"`` (coordinator, exporter): TLS with ``tls_dir``, and with ``token`` or
    ``api_keys`` every call but health checks needs the token or a listed key.
    Plaintext on a non-loopback address needs ``allow_plaintext``. A service that also identifies
    callers itself passes its ``authenticator``, so the key file is loaded once.
    """
    if peers not in ("fleet", "clients"):
        raise ValueError(f"peers must be fleet or clients, got {peers!r}")
    credentials = None
    if settings.tls_dir is not None:
        tls = TlsConfig.from_dir(settings.tls_dir, settings.tls_name or node_name)
        credentials = tls.server_credentials(require_client_cert=peers == "fleet")
        if peers == "fleet":
            revocation.watch(settings.tls_dir)  # every call's peer is held against it
    elif not _is_loopback(settings.host) and not settings.allow_plaintext:
        raise OSError(
            f"refusing to serve plaintext on {settings.host}: give --tls-dir (see `pipeshard certs`) "
            "or ask for plaintext with --allow-plaintext"
        )
    interceptors: list[grpc.aio.ServerInterceptor] = []
    if peers == "clients":
        authenticator = authenticator or Authenticator.from_settings(settings.token, settings.api_keys)
        if authenticator.required:
            interceptors.append(AuthInterceptor(authenticator))
        elif credentials is not None:
            # TLS says "secured" to whoever deploys it; without a secret it admits every caller.
            if not settings.allow_anonymous:
                raise OSError(
                    f"refusing to serve {node_name} over TLS without --token or --api-keys: anyone who "
                    "reaches the port could call it; give one, or --allow-anonymous to serve it open"
                )
            log.warning("serving_without_token", service=node_name, reason="--allow-anonymous")
    return credentials, interceptors


async def serve(
    settings: ServerSettings,
    services: Sequence[ServiceSpec] | ServicesFactory,
    *,
    name: str,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    credentials: grpc.ServerCredentials | None = None,
    shutdown_hooks: Sequence[ShutdownHook] = (),
    handle_signals: bool = True,
    on_started: Callable[[GrpcServer], None] | None = None,
) -> None:
    """Starts a server from ``settings``, prints ``<name> listening on HOST:PORT`` to stdout, and
    returns after a signal-triggered drain. ``services`` may be a (sync or async) factory, called
    inside the running loop, so servicers can create loop-bound objects (channels, queues).
    ``on_started`` gets the running server (e.g. to report health that follows dependencies)."""
    if callable(services):
        made = services()
        services = await made if inspect.isawaitable(made) else made
    server = GrpcServer.from_settings(
        settings,
        services,
        interceptors=interceptors,
        credentials=credentials,
        shutdown_hooks=shutdown_hooks,
        handle_signals=handle_signals,
    )
    await server.start()
    if on_started is not None:
        on_started(server)
    print(f"{name} listening on {server.address}", flush=True)
    await server.wait()


def run_server(
    settings: ServerSettings,
    services: Sequence[ServiceSpec] | ServicesFactory,
    *,
    name: str,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    credentials: grpc.ServerCredentials | None = None,
    shutdown_hooks: Sequence[ShutdownHook] = (),
    peers: str | None = None,
    node_name: str = "",
    authenticator: Authenticator | None = None,
    on_started: Callable[[GrpcServer], None] | None = None,
) -> int:
    """Entry-point helper: configures logging from ``settings``, serves until SIGTERM/SIGINT has
    drained the server, returns the exit status (0). With ``peers`` the TLS credentials and token
    check come from the settings (:func:`server_security`; ``node_name`` names its certificate)."""
    configure_logging(settings.log_format, settings.log_level, service=name)
    trace.name_process(name)
    if peers is not None:
        try:
            credentials, extra = server_security(
                settings, peers=peers, node_name=node_name, authenticator=authenticator
            )
        except (OSError, PipeshardError) as exc:
            log.error("cannot start", error=str(exc))
            print(f"{name}: {exc}", file=sys.stderr, flush=True)
            return 1
        interceptors = [*interceptors, *extra]
    try:
        import uvloop  # a dependency; an install without it falls back to asyncio
    except ImportError:
        runner = asyncio.run
    else:
        runner = uvloop.run
    try:
        runner(
            serve(
                settings,
                services,
                name=name,
                interceptors=interceptors,
                credentials=credentials,
                shutdown_hooks=shutdown_hooks,
                on_started=on_started,
            )
        )
    except (OSError, PipeshardError) as exc:  # a port in use, a bad setting, an absent device
        log.error("cannot start", error=str(exc))
        print(f"{name}: {exc}", file=sys.stderr, flush=True)
        return 1
    return 0
