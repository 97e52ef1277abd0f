"""Python client of CoordinatorService.Generate, sync and asyncio.

with PipeshardClient("127.0.0.1:50051") as client:   # or ["127.0.0.1:50051", "127.0.0.1:50052"]
    for chunk in client.stream("What is the capital of France?"):
        print(chunk.text, end="")
    result = client.generate("Hello", max_tokens=16)

Security (docs/SECURITY.md): the client speaks TLS when it finds the fleet CA certificate
(``ca_cert``, else PIPESHARD_CA_CERT, else ``run/ca.pem`` that ``make up SECURE=1`` writes; an
empty PIPESHARD_CA_CERT means plaintext) and then sends the bearer token (``token``, else
PIPESHARD_TOKEN, else ``certs/token``).
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path

import grpc

from pipeshard.clients.group import AsyncResumingCall, Coordinators, ResumingCall, parse_addresses
from pipeshard.v1 import coordinator_pb2, coordinator_pb2_grpc

# Where `make up SECURE=1` leaves the fleet's CA certificate and client token (docs/SECURITY.md).
# The client knows only the contract, so these defaults are spelled here, not imported.
RUN_CA_CERT = Path("run") / "ca.pem"


def _stored_token_file() -> Path:
    return Path(os.environ.get("PIPESHARD_CERTS_DIR", "certs")) / "token"


@dataclass(frozen=True)
class Connection:
    """How to reach a coordinator: the CA certificate to verify it (None = plaintext) and the
    token to present."""

    ca_cert: Path | None
    token: str | None

    @classmethod
    def resolve(cls, ca_cert: Path | str | None = None, token: str | None = None) -> Connection:
        if ca_cert is None:
            env = os.environ.get("PIPESHARD_CA_CERT")
            if env is not None:
                ca_cert = env or None
            elif RUN_CA_CERT.is_file():
                ca_cert = RUN_CA_CERT
        if ca_cert is not None and token is None:
            token = os.environ.get("PIPESHARD_TOKEN")
            stored = _stored_token_file()
            if token is None and stored.is_file():
                token = stored.read_text().strip()
        if token is None:
            token = os.environ.get("PIPESHARD_TOKEN")
        return cls(Path(ca_cert) if ca_cert else None, token or None)

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.token}"),) if self.token else ()

    def _credentials(self) -> grpc.ChannelCredentials:
        # Verifies the coordinator against the fleet CA; a client presents no certificate.
        return grpc.ssl_channel_credentials(root_certificates=Path(self.ca_cert).read_bytes())

    def channel(self, address: str) -> grpc.Channel:
        if self.ca_cert is None:
            return grpc.insecure_channel(address)
        return grpc.secure_channel(address, self._credentials())

    def aio_channel(self, address: str) -> grpc.aio.Channel:
        if self.ca_cert is None:
            return grpc.aio.insecure_channel(address)
        return grpc.aio.secure_channel(address, self._credentials())


_FINISH = {
    coordinator_pb2.FINISH_REASON_STOP: "stop",
    coordinator_pb2.FINISH_REASON_LENGTH: "length",
    coordinator_pb2.FINISH_REASON_CANCELLED: "cancelled",
    coordinator_pb2.FINISH_REASON_ERROR: "error",
}


@dataclass
class GenerateResult:
    """The CLI's JSON keys (docs/ARCHITECTURE.md, Interfaces), the same as ``--local`` prints."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    ttft_ms: float = 0.0
    tok_s: float = 0.0
    speculative: str = "none"
    verify_steps: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens the prefix cache restored instead of prefilling
    logprobs: list[float] = field(default_factory=list)  # per generated token, with logprobs=True
    # [i]: decode traversals that kept i + 1 tokens (accepted drafts plus the target's own)
    kept_per_traversal: list[int] = field(default_factory=list)
    # steps sent while an earlier one travelled (in-flight depth > 1), dropped after a rejection
    dropped_steps: int = 0


# Summary fields a GenerateResult takes over as they are (finish_reason is mapped, token_ids and
# logprobs are collected from the chunks, kept_per_traversal is copied into a list).
_SUMMARY_FIELDS = tuple(
    f.name
    for f in fields(GenerateResult)
    if f.name not in ("finish_reason", "token_ids", "logprobs", "kept_per_traversal")
)


def build_request(
    prompt: str | None = None,
    *,
    messages: list[dict[str, str]] | None = None,
    max_tokens: int | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    seed: int | None = None,
    stop: list[str] | None = None,
    stop_token_ids: list[int] | None = None,
    ignore_eos: bool = False,
    speculative: str = "",
    k: int = 0,
    tree: str = "",
    request_id: str = "",
    logprobs: bool = False,
    complete: bool = False,
) -> coordinator_pb2.GenerateRequest:
    """A plain prompt is sent as one user chat message unless ``messages`` is given, or as text to
    continue with ``complete`` (a base model, which has no chat template). With ``logprobs`` every
    chunk carries each token's log-probability and text."""
    params = coordinator_pb2.SamplingParams(
        stop=stop or [], stop_token_ids=stop_token_ids or [], ignore_eos=ignore_eos, logprobs=logprobs
    )
    for name, value in (
        ("max_tokens", max_tokens),
        ("temperature", temperature),
        ("top_p", top_p),
        ("top_k", top_k),
        ("seed", seed),
    ):
        if value is not None:
            setattr(params, name, value)
    if complete:
        messages = []
    elif messages is None:
        messages = [{"role": "user", "content": prompt or ""}]
    return coordinator_pb2.GenerateRequest(
        prompt=(prompt or "") if complete else "",
        messages=[coordinator_pb2.ChatMessage(role=m["role"], content=m["content"]) for m in messages],
        params=params,
        speculative=speculative,
        k=k,
        tree=tree,
        request_id=request_id,
    )


def fold(result: GenerateResult, response: coordinator_pb2.GenerateResponse) -> GenerateResult:
    """Accumulate one streamed response into ``result``."""
    if response.HasField("chunk"):
        result.token_ids.extend(response.chunk.token_ids)
        result.logprobs.extend(response.chunk.logprobs)
    else:
        s = response.summary
        result.finish_reason = _FINISH.get(s.finish_reason, "error")
        for name in _SUMMARY_FIELDS:
            setattr(result, name, getattr(s, name))
        result.kept_per_traversal = list(s.kept_per_traversal)
    return result


class _Client:
    """The connection both clients share; they differ only in the kind of channel.

    ``address``: one coordinator, or several of one fleet (a sequence or ``"a:1,b:2"``): then each
    request goes to the one with the fewest outstanding and a stream whose coordinator goes away
    continues on another (clients/group.py)."""

    _aio = False

    def __init__(
        self,
        address: str | Sequence[str],
        *,
        timeout_s: float | None = None,
        token: str | None = None,
        ca_cert: Path | str | None = None,
    ):
        self._connection = Connection.resolve(ca_cert, token)
        channel = self._connection.aio_channel if self._aio else self._connection.channel
        self._channels = [channel(a) for a in parse_addresses(address)]
        self._channel = self._channels[0]
        self._stub = coordinator_pb2_grpc.CoordinatorServiceStub(self._channel)
        self._group = Coordinators([coordinator_pb2_grpc.CoordinatorServiceStub(c) for c in self._channels])
        self._timeout = timeout_s

    def _call(self, stub, request: coordinator_pb2.GenerateRequest):
        return stub.Generate(request, timeout=self._timeout, metadata=self._connection.metadata)

    def _generate(
        self, request: coordinator_pb2.GenerateRequest, resuming: type[ResumingCall | AsyncResumingCall]
    ):
        """One coordinator's own call, or a group's call that resumes on another."""
        if len(self._channels) == 1:
            return self._call(self._stub, request)
        return resuming(self._group, request, self._call)


class PipeshardClient(_Client):
    def __enter__(self) -> PipeshardClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        for channel in self._channels:
            channel.close()

    def responses(self, prompt: str | None = None, **kwargs):
        """The streaming call: iterate it for responses, ``cancel()`` it to stop the generation."""
        return self._generate(build_request(prompt, **kwargs), ResumingCall)

    def stream(self, prompt: str | None = None, **kwargs) -> Iterator[coordinator_pb2.TokenChunk]:
        for response in self.responses(prompt, **kwargs):
            if response.HasField("chunk"):
                yield response.chunk

    def generate(self, prompt: str | None = None, **kwargs) -> GenerateResult:
        result = GenerateResult()
        for response in self.responses(prompt, **kwargs):
            fold(result, response)
        return result


class AsyncPipeshardClient(_Client):
    _aio = True

    async def __aenter__(self) -> AsyncPipeshardClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        for channel in self._channels:
            await channel.close()

    async def responses(
        self, prompt: str | None = None, **kwargs
    ) -> AsyncIterator[coordinator_pb2.GenerateResponse]:
        async for response in self._generate(build_request(prompt, **kwargs), AsyncResumingCall):
            yield response

    async def generate(self, prompt: str | None = None, **kwargs) -> GenerateResult:
        result = GenerateResult()
        async for response in self.responses(prompt, **kwargs):
            fold(result, response)
        return result
