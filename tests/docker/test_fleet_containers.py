"""The compose fleet for real (`make test-docker` only: it needs Docker, the images and minutes).

Each fleet is the generated compose file in mutual TLS: the exporter exports into its own volume,
every stage container pulls its own shard over FetchShard, the coordinator pulls the manifest and
tokenizer. Answers through the gateway (official openai client, greedy, 128 tokens, 4 prompts) are
compared token for token with a plain-process fleet on the same export (copied out of the exporter
container) at the same precision; one stage replica container is killed mid-stream with no request
failing; after `down` no container, network or volume of the project is left.
"""

from __future__ import annotations

import os
import subprocess
import threading

import openai
import pytest

from pipeshard.services.launcher import start_fleet
from tests.docker.test_compose import load

pytestmark = [
    pytest.mark.slow,
    # the exporter container exports at start: 15 min on this shared 2-core machine under load
    pytest.mark.timeout(3600),
    pytest.mark.skipif(
        not os.environ.get("PIPESHARD_DOCKER_FLEET"), reason="needs Docker and the images: `make test-docker`"
    ),
]

TOKENS = 128
PROMPTS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers and explain why they are prime.",
    "Explain in two sentences what a pipeline is.",
)


@pytest.fixture(scope="module", params=[(2, 2), (3, 1)], ids=["2stages-2replicas", "3stages"])
def fleets(request, tmp_path_factory):
    """The compose fleet and a plain-process fleet on the export the exporter container made."""
    stages, replicas = request.param
    folder = tmp_path_factory.mktemp(f"compose{stages}")
    fleet = load("fleet").ComposeFleet(folder, stages, replicas)
    try:
        fleet.up()
        export = folder / "shards" / fleet.spec.export
        export.parent.mkdir()
        source = f"{fleet.container('exporter')}:/app/data/shards/{fleet.spec.export}"
        subprocess.run(["docker", "cp", source, str(export)], check=True, capture_output=True)
        plain = start_fleet(export, stages, folder / "run", gateway_port=0)
        try:
            yield fleet, plain
        finally:
            plain.stop()
    finally:
        fleet.down()
        left = fleet.leftovers()
        assert not left, f"left behind after down: {left}"


def _client(base: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=600)


def _answer(client: openai.OpenAI, prompt: str) -> tuple[list[str], str]:
    reply = client.chat.completions.create(
        model="any",
        messages=[{"role": "user", "content": prompt}],
        max_tokens=TOKENS,
        temperature=0,
        logprobs=True,
    )
    return [c.token for c in reply.choices[0].logprobs.content], reply.choices[0].message.content


def _streamed(client: openai.OpenAI, prompt: str, first: threading.Event) -> tuple[list[str], str]:
    tokens: list[str] = []
    stream = client.chat.completions.create(
        model="any",
        messages=[{"role": "user", "content": prompt}],
        max_tokens=TOKENS,
        temperature=0,
        logprobs=True,
        stream=True,
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].logprobs and chunk.choices[0].logprobs.content:
            tokens += [c.token for c in chunk.choices[0].logprobs.content]
            if len(tokens) >= 8:
                first.set()
    return tokens, "".join(tokens)


def test_containers_answer_token_for_token_as_plain_processes(fleets):
    fleet, plain = fleets
    with (
        _client(fleet.gateway, fleet.token) as containers,
        _client(f"http://{plain.gateway}", "unused") as processes,
    ):
        for prompt in PROMPTS:
            got, want = _answer(containers, prompt), _answer(processes, prompt)
            assert len(want[0]) > 8
            assert got == want, prompt


def test_a_killed_stage_replica_fails_no_request(fleets):
    fleet, plain = fleets
    if fleet.spec.replicas < 2:
        pytest.skip("this fleet has one lane")
    with _client(f"http://{plain.gateway}", "unused") as processes:
        want = [_answer(processes, p)[0] for p in PROMPTS]
    results: dict[int, object] = {}
    started = [threading.Event() for _ in PROMPTS]

    def run(i: int) -> None:
        with _client(fleet.gateway, fleet.token) as client:
            try:
                results[i] = _streamed(client, PROMPTS[i], started[i])[0]
            except Exception as exc:  # recorded: the assertion names every failed request
                results[i] = exc
            finally:
                started[i].set()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for event in started:
        assert event.wait(600)
    victim = fleet.container(load("compose_gen").stage_service(fleet.spec.stages - 1, 1))
    subprocess.run(["docker", "kill", victim], check=True, capture_output=True)
    for t in threads:
        t.join(900)
    failed = {i: r for i, r in results.items() if isinstance(r, Exception)}
    assert not failed, failed
    assert [results[i] for i in range(len(PROMPTS))] == want
