"""CoordinatorService over gRPC: GenerateRequest in, Generation run, GenerateResponse stream out;
RunBatch runs a job's requests the same way as batch requests (batch_jobs.py).

On shutdown :meth:`CoordinatorServicer.drain` refuses new requests with UNAVAILABLE and waits for
the running ones; a generation the ring then stops (:class:`ShuttingDown`) still ends its stream
with a summary, FINISH_REASON_CANCELLED, instead of a bare transport error.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass

import structlog

from pipeshard.auth import Authenticator
from pipeshard.errors import InvalidArgument, Unavailable
from pipeshard.identity import Identity
from pipeshard.interceptors import MAX_REQUEST_ID_CHARS
from pipeshard.metrics import IDENTITY_CACHED_TOKENS, IDENTITY_REQUESTS, identity_label
from pipeshard.sampling import check_stop
from pipeshard.services.coordinator.batch_jobs import (
    BatchJob,
    MicroBatchControl,
    MicroBatches,
    MicroBatchMemory,
    Workload,
    job_codec,
)
from pipeshard.services.coordinator.generation import Chunk, Generation, Speculation
from pipeshard.services.coordinator.grammar import GrammarSpec
from pipeshard.services.coordinator.ring import ShuttingDown
from pipeshard.services.coordinator.sampling import SamplingParams
from pipeshard.services.coordinator.scheduler import ScheduledRequest, Scheduler
from pipeshard.services.coordinator.step_batcher import Grouping
from pipeshard.shard.prompting import Prompter
from pipeshard.v1 import coordinator_pb2, coordinator_pb2_grpc

log = structlog.get_logger(__name__)

# Identities are named "key:NAME", "token:fleet" or "peer:HOST"; this scope is none of them.
SHARED_PREFIX_SCOPE = "shared"

_FINISH = {
    "stop": coordinator_pb2.FINISH_REASON_STOP,
    "length": coordinator_pb2.FINISH_REASON_LENGTH,
    "cancelled": coordinator_pb2.FINISH_REASON_CANCELLED,
    "error": coordinator_pb2.FINISH_REASON_ERROR,
}

# GenerateSummary's fields that Summary holds under the same name (all but the enum and the
# fleet's system_fingerprint, which the servicer adds).
_SUMMARY_FIELDS = tuple(
    f.name
    for f in coordinator_pb2.GenerateSummary.DESCRIPTOR.fields
    if f.name not in ("finish_reason", "system_fingerprint")
)


def params_from_proto(p: coordinator_pb2.SamplingParams, default_max_tokens: int) -> SamplingParams:
    check_stop(p.stop, p.stop_token_ids)  # before the request is tokenized or queued
    return SamplingParams(
        max_tokens=p.max_tokens if p.HasField("max_tokens") else default_max_tokens,
        temperature=p.temperature,
        top_p=p.top_p if p.HasField("top_p") else 1.0,
        top_k=p.top_k,
        seed=p.seed if p.HasField("seed") else None,
        stop=tuple(p.stop),
        stop_token_ids=tuple(p.stop_token_ids),
        ignore_eos=p.ignore_eos,
        logprobs=p.logprobs,
        grammar=_grammar(p.grammar) if p.HasField("grammar") else None,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        logit_bias=tuple(sorted(p.logit_bias.items())),
        top_logprobs=p.top_logprobs,
    )


def _grammar(g: coordinator_pb2.Grammar) -> GrammarSpec:
    kind = g.WhichOneof("kind")
    if kind is None:
        raise InvalidArgument("grammar", "must set one of json_schema, json_object, regex or lark")
    return GrammarSpec(kind, "" if kind == "json_object" else getattr(g, kind))


@dataclass(frozen=True)
class _Admitted:
    """A request as the servicer checked and admitted it: the typed values the engine trusts."""

    prompt_ids: list[int]
    params: SamplingParams
    speculation: Speculation
    client: str  # its identity's name
    reserved: int  # the cache room admission counted for it
    grouping: Grouping | None  # a batch job's micro-batches; None: an interactive request
    admission: ScheduledRequest  # the scheduler's: its sessions take over its KV charge

    @property
    def prompt_tokens(self) -> int:
        """The caller's prompt (``prompt_ids`` ends with the tokens a resumed request had streamed)."""
        return len(self.prompt_ids) - len(self.params.resumed)


class CoordinatorServicer(coordinator_pb2_grpc.CoordinatorServiceServicer):
    def __init__(
        self,
        generation: Generation,
        prompter: Prompter,
        *,
        max_context: int,
        vocab_size: int,
        default_max_tokens: int,
        scheduler: Scheduler,
        max_prompt_bytes: int,
        authenticator: Authenticator | None = None,
        prefix_cache_scope: str = "identity",
        system_fingerprint: str = "",
    ):
        """``system_fingerprint``: the fleet's promise (services/coordinator/fleet_promise.py),
        set on every final summary."""
        self._scheduler = scheduler
        self._authenticator = authenticator or Authenticator()
        self._shared_prefixes = prefix_cache_scope == "shared"
        self._system_fingerprint = system_fingerprint
        self._max_prompt_bytes = max_prompt_bytes
        self._generation = generation
        self._micro_batches = MicroBatchMemory()  # what this coordinator's batch jobs share
        self._prompter = prompter
        self._max_context = max_context
        self._vocab_size = vocab_size
        self._default_max_tokens = default_max_tokens
        self._draining = False
        self._active = 0
        self._idle = asyncio.Event()
        self._idle.set()

    async def drain(self, timeout_s: float) -> bool:
        """Stops admission and waits up to ``timeout_s`` for running generations; True if none remain."""
        self._draining = True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            return False
        return True

    async def released(self) -> None:
        await self._generation.released()

    def _refuse_if_draining(self) -> None:
        if self._draining:
            raise Unavailable("coordinator is shutting down and takes no new requests; retry elsewhere")

    @contextlib.contextmanager
    def _counted(self):
        """Counts a call as running until it ends (what drain waits for)."""
        self._refuse_if_draining()
        self._active += 1
        self._idle.clear()
        try:
            yield
        finally:
            self._active -= 1
            if not self._active:
                self._idle.set()

    async def Generate(self, request, context):
        with self._counted():
            async for response in self._generate(request, context):
                yield response

    async def RunBatch(self, request, context):
        with self._counted():
            identity = self._authenticator.identify(context) if context else Identity("")
            codec = job_codec(request.codec)
            concurrency = min(self._scheduler.running_limit(identity), len(request.items))
            micro = MicroBatchControl(
                self._generation.step_batcher,
                self._generation.num_stages,
                MicroBatches.parse(request.micro_batches),
                self._micro_batches,
                Workload.of(codec, concurrency),
            )
            job = BatchJob(
                request.items,
                lambda item: self._generate(
                    item, context, identity=identity, grouping=micro.grouping, codec=codec
                ),
                concurrency,
                micro,
            )
            log.info("batch_job", items=len(request.items), identity=identity.name)
            async for response in job.results():
                yield response

    async def _generate(
        self,
        request,
        context,
        *,
        identity: Identity | None = None,
        grouping: Grouping | None = None,
        codec: str = "",
    ):
        """``grouping``: a batch job's micro-batches (its items are batch requests, the lower class);
        ``codec``: its sessions' codec (the job's, checked)."""
        # The request's own id names this generation in the logs (else the interceptor's).
        ids = {"request_id": request.request_id[:MAX_REQUEST_ID_CHARS]} if request.request_id else {}
        with structlog.contextvars.bound_contextvars(**ids):
            async for response in self._admitted(request, context, identity, grouping, codec):
                yield response

    async def _admitted(
        self, request, context, identity: Identity | None, grouping: Grouping | None, codec: str
    ):
        messages = [(m.role, m.content) for m in request.messages]
        self._prompter.check_size(request.prompt, messages, self._max_prompt_bytes)
        # Tokenizing runs on a worker thread: a long prompt must not stall the other streams.
        prompt_ids = await asyncio.to_thread(self._prompter.encode, request.prompt, messages)
        params = params_from_proto(request.params, self._default_max_tokens)
        params.validate(
            prompt_tokens=len(prompt_ids), max_context=self._max_context, vocab_size=self._vocab_size
        )
        # A continuation of another coordinator's stream: its tokens so far join the context.
        params = params.resuming(request.resume_token_ids, self._vocab_size)
        prompt_ids += params.resumed
        if params.resumed:
            log.info("generation_resumed", resumed_tokens=len(params.resumed))
        # Checked once, here: what follows trusts the typed values.
        speculation = self._generation.check_speculative(request.speculative, request.k, request.tree)
        if params.grammar is not None:  # compiled (and cached) before the request queues
            await self._generation.check_grammar(params)
        if identity is None:
            identity = self._authenticator.identify(context) if context else Identity("")
        tokens = self._generation.capacity(prompt_ids, params)
        deadline = context.time_remaining() if context else None
        batch = grouping is not None
        async with self._scheduler.admit(identity, tokens, deadline, batch=batch, codec=codec) as admission:
            self._refuse_if_draining()  # queued while the drain began
            admitted = _Admitted(prompt_ids, params, speculation, identity.name, tokens, grouping, admission)
            async for response in self._stream(admitted):
                yield response

    async def _stream(self, admitted: _Admitted):
        token_ids: list[int] = list(admitted.params.resumed)
        text: list[str] = []
        try:
            async for response in self._responses(admitted):
                if response.HasField("chunk"):
                    token_ids.extend(response.chunk.token_ids)
                    text.append(response.chunk.text)
                yield response
        except ShuttingDown as exc:
            yield coordinator_pb2.GenerateResponse(
                summary=coordinator_pb2.GenerateSummary(
                    finish_reason=coordinator_pb2.FINISH_REASON_CANCELLED,
                    prompt_tokens=admitted.prompt_tokens,
                    completion_tokens=len(token_ids),
                    text="".join(text),
                    error=str(exc),
                    system_fingerprint=self._system_fingerprint,
                )
            )

    async def _responses(self, admitted: _Admitted):
        # The identity scopes its prefix cache entries (a hit's timing reveals a prompt) unless the
        # operator shares them (--prefix-cache-scope shared).
        client = admitted.client
        scope = SHARED_PREFIX_SCOPE if self._shared_prefixes else client
        events = self._generation.generate(
            admitted.prompt_ids,
            admitted.params,
            admitted.speculation,
            scope=scope,
            reserved=admitted.reserved,
            grouping=admitted.grouping,
            admission=admitted.admission,
        )
        async for event in events:
            if isinstance(event, Chunk):
                yield coordinator_pb2.GenerateResponse(
                    chunk=coordinator_pb2.TokenChunk(
                        text=event.text,
                        token_ids=event.token_ids,
                        logprobs=event.logprobs,
                        tokens=event.tokens,
                        top_logprobs=[
                            coordinator_pb2.TopLogprobs(
                                token_ids=t.token_ids, logprobs=t.logprobs, tokens=t.tokens
                            )
                            for t in event.top
                        ],
                    )
                )
            else:
                label = identity_label(client)
                IDENTITY_REQUESTS.labels(identity=label, finish_reason=event.finish_reason).inc()
                IDENTITY_CACHED_TOKENS.labels(identity=label).inc(event.cached_tokens)
                copied = {name: getattr(event, name) for name in _SUMMARY_FIELDS}
                # The whole completion's counts, a resumed request's earlier tokens included.
                copied["prompt_tokens"] = admitted.prompt_tokens
                copied["completion_tokens"] += len(admitted.params.resumed)
                yield coordinator_pb2.GenerateResponse(
                    summary=coordinator_pb2.GenerateSummary(
                        finish_reason=_FINISH[event.finish_reason],
                        system_fingerprint=self._system_fingerprint,
                        **copied,
                    )
                )
