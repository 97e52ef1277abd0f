"""Offline batch jobs through real processes: `pipeshard batch` on a 2-stage fleet (a bad line,
a restart that skips finished custom_ids), and RunBatch's answers token for token the same
whatever the micro-batch count (fixed, or changed by auto's probe while the job runs) or the
job's codec (greedy, ``exact``)."""

from __future__ import annotations

import json
import subprocess
import sys

import grpc
import pytest

from pipeshard.v1 import coordinator_pb2, coordinator_pb2_grpc

pytestmark = pytest.mark.slow

PROMPTS = ("The capital of France is", "Write a haiku about rain.", "List three colours:", "2 + 2 =")


@pytest.fixture(scope="module")
def fleet(default_fleet):
    return default_fleet


def _chat(custom_id: str, prompt: str) -> str:
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 8, "temperature": 0}
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body})


def _batch(fleet, source, out, *extra) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "pipeshard.cli", "batch", str(source), "--out", str(out)]
    cmd += ["--coordinator", fleet.coordinator, "--no-progress", *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)


def test_batch_cli_writes_a_record_per_line_and_a_restart_skips_finished_ids(fleet, tmp_path):
    lines = [_chat(f"req-{i}", p) for i, p in enumerate(PROMPTS)]
    completion = {"prompt": "Once upon a time", "max_tokens": 6, "temperature": 0}
    lines.append(
        json.dumps({"custom_id": "text", "method": "POST", "url": "/v1/completions", "body": completion})
    )
    lines.insert(2, "{this is not json")  # line 3
    out = tmp_path / "out.jsonl"
    first = tmp_path / "first.jsonl"
    first.write_text("\n".join(lines[:2]) + "\n")  # a job that stopped after its first two
    assert _batch(fleet, first, out).returncode == 0
    earlier = {r["custom_id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert set(earlier) == {"req-0", "req-1"}

    full = tmp_path / "in.jsonl"
    full.write_text("\n".join(lines) + "\n")
    run = _batch(fleet, full, out, "--micro-batches", "2")
    assert run.returncode == 1, run.stderr  # the bad line
    records = [json.loads(x) for x in out.read_text().splitlines()]
    ids = [r["custom_id"] for r in records]
    assert sorted(ids, key=str) == sorted([None, "req-0", "req-1", "req-2", "req-3", "text"], key=str)
    by_id = {r["custom_id"]: r for r in records}
    assert by_id["req-0"]["id"] == earlier["req-0"]["id"]  # not run again
    assert by_id[None]["response"] is None
    assert by_id[None]["error"]["code"] == "invalid_json" and by_id[None]["error"]["message"].startswith(
        "line 3:"
    )
    for custom_id in ("req-2", "req-3", "text"):
        record = by_id[custom_id]
        assert record["error"] is None and record["response"]["status_code"] == 200
        body = record["response"]["body"]
        assert body["usage"]["completion_tokens"] >= 1
    assert by_id["text"]["response"]["body"]["object"] == "text_completion"
    assert by_id["req-2"]["response"]["body"]["choices"][0]["message"]["content"]


def test_micro_batch_count_never_changes_a_greedy_answer(fleet):
    items = []
    for i, prompt in enumerate(PROMPTS):
        request = coordinator_pb2.GenerateRequest(
            messages=[coordinator_pb2.ChatMessage(role="user", content=prompt)],
            params=coordinator_pb2.SamplingParams(
                max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=True
            ),
        )
        items.append(coordinator_pb2.BatchJobItem(custom_id=f"p{i}", request=request))
    answers = {}
    with grpc.insecure_channel(fleet.coordinator) as channel:
        stub = coordinator_pb2_grpc.CoordinatorServiceStub(channel)
        # The fourth job also asks every stage to compress its sessions' frames (the job's codec);
        # the last regroups its sessions while they run (auto's probe changes M between windows).
        jobs = (("off", ""), ("1", ""), ("2", ""), ("3", "lane_blocks_zstd"), ("auto", ""))
        for micro, codec in jobs:
            request = coordinator_pb2.RunBatchRequest(items=items, micro_batches=micro, codec=codec)
            results = list(stub.RunBatch(request, timeout=600))
            assert {r.custom_id for r in results} == {f"p{i}" for i in range(len(PROMPTS))}
            assert all(not r.HasField("error") for r in results), [r.error for r in results]
            counts = {r.micro_batches for r in results}
            assert counts <= {1, 2} if micro == "auto" else counts == {1 if micro == "off" else int(micro)}
            answers[micro] = {r.custom_id: (list(r.tokens), r.summary.text) for r in results}
        with pytest.raises(grpc.RpcError) as bad:
            list(stub.RunBatch(coordinator_pb2.RunBatchRequest(items=items, codec="gzip"), timeout=60))
        assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "`codec`" in bad.value.details()
    for micro in ("1", "2", "3", "auto"):
        assert answers[micro] == answers["off"], f"micro-batches {micro} changed an answer"
    assert all(len(tokens) == 12 for tokens, _ in answers["off"].values())
