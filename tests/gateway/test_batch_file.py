"""OpenAI's batch file format (batch_file.py): input lines to Generate requests, error records
naming the line, restarts that skip finished custom_ids, and output records shaped as the
gateway's answers."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pipeshard.services.gateway.batch_file import (
    BatchFileError,
    BatchLine,
    LineError,
    OutputFile,
    parse_input,
    parse_line,
    result_record,
)
from pipeshard.v1 import coordinator_pb2


def line(custom_id="a", url="/v1/chat/completions", body=None, method="POST") -> str:
    body = body if body is not None else {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    return json.dumps({"custom_id": custom_id, "method": method, "url": url, "body": body})


def test_chat_and_completion_lines_become_generate_requests():
    chat = parse_line(1, line(), "m")
    text = parse_line(
        2, line("b", "/v1/completions", {"prompt": "Once", "max_tokens": 3, "temperature": 0}), "m"
    )
    assert isinstance(chat, BatchLine) and isinstance(text, BatchLine)
    assert [(m.role, m.content) for m in chat.request.messages] == [("user", "Hi")]
    assert chat.request.params.max_tokens == 4 and chat.shaper.chat
    assert text.request.prompt == "Once" and not text.request.messages and not text.shaper.chat


@pytest.mark.parametrize(
    ("text", "custom_id", "code", "needle"),
    [
        ("{not json", None, "invalid_json", "line 7: not JSON"),
        ("[1, 2]", None, "invalid_json", "line 7: not a JSON object"),
        (json.dumps({"method": "POST"}), None, "invalid_request", "line 7: `custom_id`"),
        (
            line(url="/v1/embeddings"),
            "a",
            "invalid_url",
            "line 7: `url` must be /v1/chat/completions or /v1/completions, got '/v1/embeddings'",
        ),
        (line(method="GET"), "a", "invalid_request", "line 7: `method` must be POST, got 'GET'"),
        (line(body={"messages": []}), "a", "invalid_request", "line 7: `body.messages`"),
        (
            line(body={"messages": [{"role": "user", "content": "x"}], "n": 3}),
            "a",
            "unsupported_parameter",
            "line 7: unsupported parameter: n",
        ),
        (
            line(body={"messages": [{"role": "user", "content": "x"}], "stream": True}),
            "a",
            "invalid_request",
            "line 7: `stream` must be false",
        ),
    ],
)
def test_invalid_lines_get_an_error_record_naming_the_line(text, custom_id, code, needle):
    error = parse_line(7, text, "m")
    assert isinstance(error, LineError)
    assert (error.custom_id, error.code) == (custom_id, code)
    assert needle in error.message
    record = error.record()
    assert record["response"] is None and record["error"] == {"code": code, "message": error.message}


@given(st.text(max_size=60))
def test_any_text_is_a_request_or_an_error_naming_its_line(text):
    parsed = parse_line(3, text, "m")
    assert isinstance(parsed, BatchLine | LineError)
    if isinstance(parsed, LineError):
        assert parsed.message.startswith("line 3: ")


def test_duplicate_custom_id_names_both_lines_and_done_ids_are_skipped(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join([line("a"), line("b"), "", line("a"), line("c"), "oops"]) + "\n")
    runnable, errors = parse_input(path, "m", done={"b"})
    assert [(r.number, r.custom_id) for r in runnable] == [(1, "a"), (5, "c")]
    assert [(e.number, e.custom_id, e.code) for e in errors] == [
        (4, "a", "duplicate_custom_id"),
        (6, None, "invalid_json"),
    ]
    assert "`custom_id` 'a' repeats line 1" in errors[0].message


def test_empty_input_and_unwritable_output_name_the_path(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n  \n")
    with pytest.raises(BatchFileError, match=f"input {empty} is empty"):
        parse_input(empty, "m", set())
    with pytest.raises(BatchFileError, match=f"cannot read input {tmp_path / 'missing.jsonl'}"):
        parse_input(tmp_path / "missing.jsonl", "m", set())
    with pytest.raises(BatchFileError, match=f"cannot use output {tmp_path}: Is a directory"):
        OutputFile(tmp_path)
    under_a_file = empty / "out.jsonl"
    with pytest.raises(BatchFileError, match=f"cannot use output {under_a_file}: Not a directory"):
        OutputFile(under_a_file)


def test_restart_reads_finished_ids_cuts_a_torn_line_and_does_not_repeat_line_errors(tmp_path):
    out = tmp_path / "out.jsonl"
    bad = parse_line(2, "{", "m")
    first = OutputFile(out)
    first.write({"id": "x", "custom_id": "a", "response": {}, "error": None})
    assert first.write_error(bad)
    first.close()
    with out.open("a") as f:
        f.write('{"id": "y", "custom_id": "b", "resp')  # crashed mid-write
    again = OutputFile(out)
    assert again.done == {"a"}
    assert not again.write_error(bad)
    again.close()
    assert [json.loads(x)["custom_id"] for x in out.read_text().splitlines()] == ["a", None]


def test_result_records_are_the_gateways_answer_or_its_error():
    chat = parse_line(1, line(body={"messages": [{"role": "user", "content": "Hi"}], "logprobs": True}), "m")
    ok = coordinator_pb2.RunBatchResponse(
        custom_id="a",
        summary=coordinator_pb2.GenerateSummary(
            text="Hello",
            finish_reason=coordinator_pb2.FINISH_REASON_LENGTH,
            prompt_tokens=5,
            completion_tokens=1,
        ),
        tokens=["Hello"],
        logprobs=[-0.25],
    )
    record = result_record(chat, ok)
    assert record["custom_id"] == "a" and record["error"] is None and record["id"].startswith("batch_req_")
    body = record["response"]["body"]
    assert record["response"]["status_code"] == 200
    assert body["object"] == "chat.completion" and body["model"] == "m"
    assert (
        body["choices"][0]["message"]["content"] == "Hello"
        and body["choices"][0]["finish_reason"] == "length"
    )
    assert body["choices"][0]["logprobs"]["content"][0]["logprob"] == -0.25
    assert body["usage"]["total_tokens"] == 6

    refused = coordinator_pb2.RunBatchResponse(
        custom_id="a",
        error=coordinator_pb2.BatchJobError(code="INVALID_ARGUMENT", message="`max_tokens` too big"),
    )
    record = result_record(chat, refused)
    assert record["response"]["status_code"] == 400
    assert record["error"] == {"code": "invalid_argument", "message": "line 1: `max_tokens` too big"}
    broken = coordinator_pb2.RunBatchResponse(
        custom_id="a",
        summary=coordinator_pb2.GenerateSummary(
            finish_reason=coordinator_pb2.FINISH_REASON_ERROR, error="stage 1 died"
        ),
    )
    record = result_record(chat, broken)
    assert record["response"]["status_code"] == 503 and record["error"]["message"] == "line 1: stage 1 died"


def test_cli_stops_at_once_naming_an_empty_input_or_an_unusable_output(tmp_path, capsys):
    from pipeshard.cli import main

    empty = tmp_path / "in.jsonl"
    empty.write_text("")
    assert main(["batch", str(empty), "--out", str(tmp_path / "out.jsonl"), "--no-progress"]) == 2
    assert f"input {empty} is empty" in capsys.readouterr().err
    assert main(["batch", str(empty), "--out", str(tmp_path), "--no-progress"]) == 2
    assert f"cannot use output {tmp_path}" in capsys.readouterr().err


def test_cli_records_bad_lines_without_a_coordinator_when_nothing_else_runs(tmp_path, capsys):
    from pipeshard.cli import main

    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("{oops\n" + line(url="/v1/embeddings") + "\n")
    assert (
        main(["batch", str(source), "--out", str(out), "--no-progress", "--coordinator", "127.0.0.1:1"]) == 1
    )
    records = [json.loads(x) for x in out.read_text().splitlines()]
    assert [(r["custom_id"], r["error"]["code"]) for r in records] == [
        (None, "invalid_json"),
        ("a", "invalid_url"),
    ]
    assert "nothing to run (2 invalid line(s) recorded)" in capsys.readouterr().err
    assert main(["batch", str(source), "--out", str(out), "--no-progress"]) == 1  # a rerun adds nothing
    assert len(out.read_text().splitlines()) == 2


def test_cli_names_an_unreachable_coordinator_and_keeps_what_was_recorded(tmp_path, capsys):
    from pipeshard.cli import main

    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text(line("a") + "\n{bad\n")
    assert main(["batch", str(source), "--out", str(out), "--coordinator", "127.0.0.1:1"]) == 2
    err = capsys.readouterr().err
    assert "coordinator 127.0.0.1:1: UNAVAILABLE" in err and "run again to resume" in err
    assert [json.loads(x)["custom_id"] for x in out.read_text().splitlines()] == [None]
