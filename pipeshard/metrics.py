"""Prometheus metrics: served on their own port; base units (seconds, bytes); counters end in _total.

Metrics live in the process-wide default registry. Create them with :func:`counter`,
:func:`histogram` and :func:`gauge`, which return the existing collector when the name is already
registered, so several servers (or a reloaded module) in one test process never hit
"Duplicated timeseries" errors.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import prometheus_client
from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics import MetricWrapperBase

# Covers a fast unary call (ms) through a long prefill or a whole streamed generation (minutes).
DURATION_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)

_lock = threading.Lock()
_created: dict[str, Any] = {}


def _get_or_create(
    kind: type[MetricWrapperBase], name: str, documentation: str, labelnames: Sequence[str], **kwargs: Any
) -> Any:
    with _lock:
        existing = _created.get(name)
        if existing is None:
            try:
                existing = kind(
                    name, documentation, labelnames=tuple(labelnames), registry=REGISTRY, **kwargs
                )
            except ValueError:
                # Registered by an earlier copy of this module (importlib.reload); reuse it.
                existing = REGISTRY._names_to_collectors.get(name)
                if existing is None:
                    raise
            _created[name] = existing
        if not isinstance(existing, kind):
            raise TypeError(f"metric {name!r} already exists as a {type(existing).__name__}")
        if tuple(existing._labelnames) != tuple(labelnames):
            raise ValueError(f"metric {name!r} already exists with labels {existing._labelnames}")
        return existing


def counter(name: str, documentation: str, labelnames: Sequence[str] = ()) -> Counter:
    """A Counter; ``_total`` is appended on exposition (a trailing ``_total`` in ``name`` is dropped)."""
    return _get_or_create(Counter, name.removesuffix("_total"), documentation, labelnames)


def histogram(
    name: str, documentation: str, labelnames: Sequence[str] = (), buckets: Sequence[float] = DURATION_BUCKETS
) -> Histogram:
    return _get_or_create(Histogram, name, documentation, labelnames, buckets=tuple(buckets))


def gauge(name: str, documentation: str, labelnames: Sequence[str] = ()) -> Gauge:
    return _get_or_create(Gauge, name, documentation, labelnames)


# How an identity appears in label values: its kind alone (key, token, peer) unless the operator
# asks for names, so /metrics never lists API-key names or callers' hosts nobody chose to publish.
IDENTITY_LABEL_MODES = ("kind", "names")
_identity_labels = {"mode": "kind"}


def set_identity_labels(mode: str) -> None:
    """Chooses this process's identity label values (``--metrics-identity-labels``)."""
    if mode not in IDENTITY_LABEL_MODES:
        raise ValueError(
            f"metrics_identity_labels must be one of {', '.join(IDENTITY_LABEL_MODES)}, got {mode!r}"
        )
    _identity_labels["mode"] = mode


def identity_label(name: str) -> str:
    """The label value of the identity called ``name`` (``key:alice`` -> ``key`` by default)."""
    if _identity_labels["mode"] == "names":
        return name
    kind, _, _ = name.partition(":")
    return kind or "anonymous"


# The RPC metrics the server interceptor records for every call (health and reflection included).
RPC_REQUESTS = counter(
    "pipeshard_rpc_requests",
    "gRPC calls finished, by service, method and status code.",
    ("service", "method", "code"),
)
RPC_DURATION = histogram(
    "pipeshard_rpc_duration_seconds",
    "Wall time of a gRPC call from handler start to its last message, in seconds.",
    ("service", "method"),
)


def observe_rpc(service: str, method: str, code: str, seconds: float) -> None:
    RPC_REQUESTS.labels(service=service, method=method, code=code).inc()
    RPC_DURATION.labels(service=service, method=method).observe(seconds)


class MetricsServer:
    """A running /metrics HTTP server (a daemon thread); :meth:`close` stops it."""

    def __init__(self, httpd: Any, thread: threading.Thread):
        self._httpd = httpd
        self._thread = thread

    @property
    def port(self) -> int:
        return int(self._httpd.server_address[1])

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)


def start_metrics_server(
    port: int, host: str = "127.0.0.1", registry: CollectorRegistry = REGISTRY
) -> MetricsServer | None:
    """Serves ``/metrics`` on ``host:port`` in a background thread; ``port`` 0 means disabled (None)."""
    if not port:
        return None
    httpd, thread = prometheus_client.start_http_server(port, addr=host, registry=registry)
    return MetricsServer(httpd, thread)


# --- Serving metrics (issue #18). Defined here, in one place, because `pipeshard top` reads them
# back by name; the stage and the coordinator record them.

# Rows (tokens) per step: 1 for decode, K+1 for a speculative verify, the prompt for a prefill,
# and the packed rows of a batched step once stages batch.
ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
# Per-step and per-token latencies: sub-millisecond decode steps up to long prefills.
STEP_BUCKETS = (0.0005, 0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.064, 0.128, 0.256, 0.5, 1, 2, 5)

STAGE_STEP_SECONDS = histogram(
    "pipeshard_stage_step_seconds",
    "Compute time of one step on a stage's shard (the inference alone), in seconds.",
    ("stage",),
    buckets=STEP_BUCKETS,
)
STAGE_STEP_ROWS = histogram(
    "pipeshard_stage_step_rows",
    "Rows (tokens) computed in one step on a stage, all sessions of the step together.",
    ("stage",),
    buckets=ROW_BUCKETS,
)
STAGE_HEADS_SECONDS = histogram(
    "pipeshard_stage_draft_heads_seconds",
    "Time the final stage's draft heads took for one row (path, heads and top candidates), in seconds.",
    ("stage",),
    buckets=STEP_BUCKETS,
)
STAGE_SESSIONS = gauge("pipeshard_stage_sessions", "Sessions open on a stage.", ("stage",))
STAGE_CACHE_POSITIONS = gauge(
    "pipeshard_stage_cache_positions",
    "KV cache positions written by the open sessions of a stage (valid or masked out).",
    ("stage",),
)
STAGE_KV_RESTORED_BLOCKS = counter(
    "pipeshard_stage_kv_restored_blocks_total",
    "KV blocks of prefix-cache restores on a paged stage: shared (a pinned pool block referenced, "
    "nothing copied) or copied (written from the prefix store).",
    ("stage", "how"),
)
STAGE_CACHE_BYTES = gauge(
    "pipeshard_stage_cache_bytes",
    "KV cache held by the open sessions of a stage, in bytes: positions x layers x 2 x KV heads x "
    "head size x the element size of the compiled KV cache precision (quantization scales not counted).",
    ("stage",),
)

COORDINATOR_RUNNING = gauge(
    "pipeshard_coordinator_running_requests", "Generations running on the coordinator (its users)."
)
COORDINATOR_RUNNING_BY_IDENTITY = gauge(
    "pipeshard_coordinator_running_requests_by_identity",
    "Generations running on the coordinator per identity label (its kind, key, token or peer; its "
    "name only with --metrics-identity-labels names).",
    ("identity",),
)
COORDINATOR_QUEUED = gauge(
    "pipeshard_coordinator_queued_requests", "Generations waiting in the coordinator's queue for a slot."
)
IDENTITY_REQUESTS = counter(
    "pipeshard_coordinator_identity_requests_total",
    "Generations finished, by identity label (key, token or peer; key:NAME, token:fleet or peer:HOST "
    "only with --metrics-identity-labels names; never a key) and finish reason.",
    ("identity", "finish_reason"),
)
IDENTITY_CACHED_TOKENS = counter(
    "pipeshard_coordinator_identity_cached_tokens_total",
    "Prompt tokens restored from the prefix cache instead of prefilled, by identity label.",
    ("identity",),
)
PREFIX_STAGE_MISSES = counter(
    "pipeshard_coordinator_prefix_stage_misses_total",
    "Prefix index hits a stage could not restore (it no longer held a block): each costs an "
    "aborted session and a cold prefill; 0 while the stages' eviction reports keep the index exact.",
)
FAILOVERS = counter(
    "pipeshard_coordinator_failovers_total",
    "Running sessions moved to another replica lane after theirs failed (services/coordinator/failover.py).",
)
STANDBY_KV_BYTES = gauge(
    "pipeshard_coordinator_standby_kv_bytes",
    "Bytes of running sessions' KV this coordinator holds captured from their replica lanes, for a "
    "failover to restore (services/coordinator/kv_standby.py; at most --standby-kv-bytes).",
)
GENERATED_TOKENS = counter(
    "pipeshard_generated_tokens_total", "Tokens generated and streamed to clients by the coordinator."
)
TIME_TO_FIRST_TOKEN = histogram(
    "pipeshard_time_to_first_token_seconds",
    "From a generation's start (session opened, prompt tokenized) to its first token, in seconds.",
    buckets=DURATION_BUCKETS,
)
INTER_TOKEN = histogram(
    "pipeshard_inter_token_seconds",
    "Time per generated token after the first: a step's wall time divided by the tokens it "
    "produced, observed once per token, in seconds.",
    buckets=STEP_BUCKETS,
)
SPECULATIVE_DRAFTED = counter(
    "pipeshard_speculative_draft_tokens_total",
    "Draft tokens proposed for verification, by draft source.",
    ("source",),
)
TOKENS_PER_TRAVERSAL = histogram(
    "pipeshard_tokens_per_traversal",
    "Tokens a decode traversal of the stages kept (accepted drafts plus the target's own), by "
    "draft source (none: always 1).",
    ("source",),
    buckets=tuple(range(1, 17)),
)
SPECULATIVE_ACCEPTED = counter(
    "pipeshard_speculative_accepted_tokens_total",
    "Draft tokens the target accepted, by draft source.",
    ("source",),
)
SPECULATION_DEFAULT = gauge(
    "pipeshard_speculation_default",
    "1 for the draft source that requests which do not choose one speculate with (the "
    "coordinator's default), 0 for one it replaced: a feature draft trained in the background "
    "is picked up while the fleet runs.",
    ("source",),
)
SPECULATIVE_DROPPED_STEPS = counter(
    "pipeshard_speculative_dropped_steps_total",
    "Steps sent while an earlier step of the same request travelled (in-flight depth > 1) that "
    "were dropped unused: the earlier step rejected a draft they were built on, or a failover "
    "came first; by draft source.",
    ("source",),
)
