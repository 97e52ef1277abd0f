"""Two coordinators over one fleet's stages (a group): a coordinator killed with SIGKILL under 8
users mid-stream loses nobody's answer. The client (several addresses) and the gateway (several
``--coordinator``) keep what they streamed and send each cut stream to the other coordinator as a
continuation (``resume_token_ids``): every stream ends with its solo run's tokens, greedy at the
default precision and one seeded sampled stream, with no token repeated or missing. A stranger
(another owner secret) can neither read nor end the streams' stage sessions meanwhile."""

from __future__ import annotations

import json
import os
import signal
import threading
import uuid

import grpc
import openai
import pytest

from pipeshard.clients.client import PipeshardClient, build_request
from pipeshard.ownership import new_secret, owner_metadata
from pipeshard.services.launcher import Fleet, coordinator_args, fleet_env, spawn
from pipeshard.v1 import stage_pb2, stage_pb2_grpc

pytestmark = pytest.mark.slow

USERS = 8
TOKENS = 40
KILL_AFTER = 6  # tokens (client) or chunks (gateway) every stream has out before the kill
ANIMALS = ("cat", "dog", "fox", "owl", "horse", "crow", "frog", "bee")
PROMPTS = [f"Write a short story about a {animal}." for animal in ANIMALS]
SAMPLED = {"temperature": 0.8, "top_p": 0.95, "seed": 4242}  # the last user's draw


def _params(i: int) -> dict:
    return {"max_tokens": TOKENS, "ignore_eos": True, **(SAMPLED if i == USERS - 1 else {})}


@pytest.fixture(scope="module")
def group(smollm2_export, fleet_factory):
    """2 stages, 2 coordinators over them, a gateway given both."""
    shards = smollm2_export(2, "int4")
    return shards, fleet_factory(shards, 2, coordinators=2, gateway_port=0)


@pytest.fixture(scope="module")
def solo(group):
    """Each user's answer alone, from the first coordinator, before any kill."""
    _, fleet = group
    with PipeshardClient(fleet.coordinators[0], timeout_s=300) as client:
        return [client.generate(PROMPTS[i], **_params(i)) for i in range(USERS)]


def _restart_killed(fleet: Fleet, shards, name: str) -> None:
    """Starts coordinator ``name`` again on its port if it is not running (the next test's group)."""
    proc = fleet.process(name)
    if proc.popen.poll() is None:
        return
    port = int(proc.address.rsplit(":", 1)[1])
    args = coordinator_args(fleet.stages, shards, port, "json")
    fleet.processes[fleet.processes.index(proc)] = spawn(name, args, fleet.run_dir, fleet_env(), 180)


def _resumed(fleet: Fleet, name: str) -> set[str]:
    """The request ids coordinator ``name`` took over from another (its generation_resumed logs)."""
    lines = fleet.process(name).log.read_text().splitlines()
    events = [json.loads(line) for line in lines if line.startswith("{")]
    return {e["request_id"] for e in events if e.get("event") == "generation_resumed"}


class KillWhenAllStream:
    """Kills ``victim`` with SIGKILL once every user has ``KILL_AFTER`` tokens (or has ended)."""

    def __init__(self, fleet: Fleet, victim: str):
        self.pid = fleet.process(victim).popen.pid
        self.counts = [0] * USERS
        self.ended = [False] * USERS
        self.killed = threading.Event()
        self._lock = threading.Lock()

    def saw(self, user: int, n: int = 1, ended: bool = False) -> None:
        with self._lock:
            self.counts[user] += n
            self.ended[user] = self.ended[user] or ended
            ready = all(c >= KILL_AFTER or e for c, e in zip(self.counts, self.ended, strict=True))
            if ready and not self.killed.is_set():
                os.kill(self.pid, signal.SIGKILL)
                self.killed.set()


def _in_threads(run, streaming: threading.Event) -> list[BaseException]:
    """Runs ``run(i)`` for every user in threads, the sampled (last) user first: the others start
    once it is ``streaming``, so it went to a fresh group's first choice, the coordinator killed."""
    errors: list[BaseException] = []

    def guarded(i: int) -> None:
        try:
            run(i)
        except BaseException as exc:  # recorded: the test asserts there were none
            errors.append(exc)
            streaming.set()

    threads = [threading.Thread(target=guarded, args=(i,)) for i in reversed(range(USERS))]
    threads[0].start()
    streaming.wait(300)
    for t in threads[1:]:
        t.start()
    for t in threads:
        t.join(timeout=600)
    return errors


def test_a_killed_coordinators_streams_finish_on_the_other_through_the_client(group, solo):
    shards, fleet = group
    _restart_killed(fleet, shards, "coordinator")
    kill = KillWhenAllStream(fleet, "coordinator")
    results: list[list[int]] = [[] for _ in range(USERS)]
    ids = [f"user{i}-{uuid.uuid4().hex[:8]}" for i in range(USERS)]
    streaming = threading.Event()
    # One client of both addresses for all users: each request goes to the less busy one.
    with PipeshardClient(fleet.coordinators, timeout_s=300) as client:

        def run(i: int) -> None:
            for chunk in client.stream(PROMPTS[i], request_id=ids[i], **_params(i)):
                results[i].extend(chunk.token_ids)
                streaming.set()
                kill.saw(i, len(chunk.token_ids))
            kill.saw(i, 0, ended=True)

        errors = _in_threads(run, streaming)
    assert errors == []
    assert kill.killed.is_set()
    moved = _resumed(fleet, "coordinator1") & set(ids)
    assert ids[USERS - 1] in moved and len(moved) > 1  # the sampled stream and others really moved
    for i in range(USERS):
        assert results[i] == solo[i].token_ids, f"user {i}"


def test_a_killed_coordinators_streams_finish_on_the_other_through_the_gateway(group, solo):
    shards, fleet = group
    _restart_killed(fleet, shards, "coordinator")
    kill = KillWhenAllStream(fleet, "coordinator")
    texts: list[str] = ["" for _ in range(USERS)]
    finishes: list[str | None] = [None] * USERS
    ids = [""] * USERS  # each stream's request id: its chunks' id is chatcmpl-<request id>
    streaming = threading.Event()
    with openai.OpenAI(
        base_url=f"http://{fleet.gateway}/v1", api_key="unused", max_retries=0, timeout=300
    ) as api:

        def run(i: int) -> None:
            p = _params(i)
            sampled = {k: p[k] for k in ("temperature", "top_p", "seed") if k in p}
            stream = api.chat.completions.create(
                model="any",
                messages=[{"role": "user", "content": PROMPTS[i]}],
                max_tokens=TOKENS,
                stream=True,
                extra_body={"ignore_eos": True},
                **sampled,
            )
            for event in stream:
                ids[i] = event.id.removeprefix("chatcmpl-")
                streaming.set()
                choice = event.choices[0] if event.choices else None
                if choice is not None:
                    texts[i] += choice.delta.content or ""
                    finishes[i] = choice.finish_reason or finishes[i]
                    kill.saw(i)
            kill.saw(i, 0, ended=True)

        errors = _in_threads(run, streaming)
    assert errors == []
    assert kill.killed.is_set()
    moved = _resumed(fleet, "coordinator1") & set(ids)
    assert ids[USERS - 1] in moved and len(moved) > 1
    for i in range(USERS):
        assert (texts[i], finishes[i]) == (solo[i].text, "length"), f"user {i}"


def test_a_stranger_can_neither_read_nor_end_the_sessions_of_a_moved_stream(group, solo):
    """While a stream runs on the first coordinator, another owner secret asks the stages for its
    session (its id is the request id): NOT_FOUND to a capture, nothing released. Then its
    coordinator dies and the stream ends on the other with its solo tokens: the other coordinator
    reopened it under its own owner, it adopted nothing."""
    shards, fleet = group
    _restart_killed(fleet, shards, "coordinator")
    stranger = owner_metadata(new_secret())
    session = f"victim-{uuid.uuid4().hex[:8]}"
    tokens: list[int] = []
    with PipeshardClient(fleet.coordinators, timeout_s=300) as client:  # a fresh group: the first first
        for chunk in client.stream(PROMPTS[0], request_id=session, **_params(0)):
            tokens.extend(chunk.token_ids)
            if len(tokens) >= KILL_AFTER and fleet.process("coordinator").popen.poll() is None:
                for address in fleet.stages:
                    with grpc.insecure_channel(address) as channel:
                        stub = stage_pb2_grpc.StageServiceStub(channel)
                        with pytest.raises(grpc.RpcError) as read:
                            stub.CaptureKv(
                                stage_pb2.CaptureKvRequest(session_id=session), timeout=10, metadata=stranger
                            )
                        assert read.value.code() == grpc.StatusCode.NOT_FOUND
                        released = stub.ReleaseSession(
                            stage_pb2.ReleaseSessionRequest(session_id=session), timeout=10, metadata=stranger
                        )
                        assert not released.released
                os.kill(fleet.process("coordinator").popen.pid, signal.SIGKILL)
    assert tokens == solo[0].token_ids


def test_resume_tokens_out_of_range_are_refused_naming_the_field(group):
    _, fleet = group
    with PipeshardClient(fleet.coordinators[1], timeout_s=60) as client:
        for resume, text in (([1] * 8, "fewer than max_tokens (8)"), ([10**9], "is not a token id")):
            request = build_request("Hi", max_tokens=8)
            request.resume_token_ids.extend(resume)
            with pytest.raises(grpc.RpcError) as refused:
                list(client._stub.Generate(request, timeout=60))
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "`resume_token_ids`" in refused.value.details() and text in refused.value.details()
        assert client.generate("Hi", max_tokens=2).completion_tokens == 2  # it keeps serving


_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "legs": {"type": "integer"}},
    "required": ["name", "legs"],
    "additionalProperties": False,
}


def test_a_structured_stream_resumed_anywhere_continues_its_grammar(group):
    """A continuation's grammar starts where the cut stream's stood (the resumed tokens advance it):
    resumed after any prefix, the rest is the undisturbed run's, and the whole text is valid JSON."""
    _, fleet = group

    def request(resume: list[int]):
        sent = build_request("Describe a cat as JSON with its name and legs.", max_tokens=48)
        sent.params.grammar.json_schema = json.dumps(_SCHEMA)
        sent.resume_token_ids.extend(resume)
        return sent

    def streamed(stub, sent) -> tuple[list[int], str, str]:
        tokens, text, finish = [], "", ""
        for response in stub.Generate(sent, timeout=300):
            if response.HasField("chunk"):
                tokens += response.chunk.token_ids
                text += response.chunk.text
            else:
                finish = response.summary.finish_reason
        return tokens, text, finish

    with PipeshardClient(fleet.coordinators[1], timeout_s=300) as client:
        whole, text, finish = streamed(client._stub, request([]))
        answer = json.loads(text)
        assert set(answer) == {"name", "legs"} and isinstance(answer["legs"], int)
        assert len(whole) > 6
        for cut in (1, 3, len(whole) // 2, len(whole) - 1):
            rest, rest_text, rest_finish = streamed(client._stub, request(whole[:cut]))
            assert rest == whole[cut:], f"resumed after {cut} tokens"
            assert rest_finish == finish
            assert text.endswith(rest_text)
