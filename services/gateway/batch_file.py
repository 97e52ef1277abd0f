"""OpenAI's batch file format: input lines to Generate calls, results to output records.

Input, one JSON object a line: ``{"custom_id", "method": "POST", "url", "body"}`` with ``url``
``/v1/chat/completions`` or ``/v1/completions`` and the body as the gateway takes it (validated
by the gateway's own schema and ``generate_call``). Output, one record a line:
``{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}``, the body
shaped as the gateway's non-streaming answer. A line that cannot run gets a record with
``response`` null and ``error`` {``code``, ``message``} naming its line number (``custom_id``
null when the line has none to read), and the job goes on.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from pathlib import Path

import pydantic

from pipeshard.services.gateway.calls import failed, generate_call
from pipeshard.services.gateway.errors import GatewayError
from pipeshard.services.gateway.responses import Shaper
from pipeshard.services.gateway.schema import ChatCompletionRequest, CompletionRequest, invalid_body
from pipeshard.v1 import coordinator_pb2

BODIES: dict[str, type[ChatCompletionRequest | CompletionRequest]] = {
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/completions": CompletionRequest,
}
# The HTTP status each BatchJobError code stands for (the gateway's mapping of gRPC codes).
_STATUS = {
    "INVALID_ARGUMENT": 400,
    "OUT_OF_RANGE": 400,
    "UNAUTHENTICATED": 401,
    "PERMISSION_DENIED": 403,
    "NOT_FOUND": 404,
    "RESOURCE_EXHAUSTED": 429,
    "CANCELLED": 499,
    "UNAVAILABLE": 503,
    "DEADLINE_EXCEEDED": 504,
}


class BatchFileError(Exception):
    """The job cannot start (empty input, unreadable input, unwritable output); names the path."""


@dataclass(frozen=True)
class BatchLine:
    """A valid input line: its Generate request and how to shape the answer."""

    number: int
    custom_id: str
    request: coordinator_pb2.GenerateRequest
    shaper: Shaper


@dataclass(frozen=True)
class LineError:
    """An input line that cannot run."""

    number: int
    custom_id: str | None
    code: str
    message: str

    def record(self) -> dict:
        return _record(self.custom_id, None, {"code": self.code, "message": self.message})


def _record(custom_id: str | None, response: dict | None, error: dict | None) -> dict:
    return {
        "id": f"batch_req_{uuid.uuid4().hex}",
        "custom_id": custom_id,
        "response": response,
        "error": error,
    }


def parse_line(number: int, text: str, model_name: str) -> BatchLine | LineError:
    """One input line (``number`` counts from 1) as a request, or the error that names it."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        return LineError(
            number, None, "invalid_json", f"line {number}: not JSON: {exc.msg} (column {exc.colno})"
        )
    if not isinstance(obj, dict):
        return LineError(number, None, "invalid_json", f"line {number}: not a JSON object")
    custom_id = obj.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return LineError(
            number, None, "invalid_request", f"line {number}: `custom_id` must be a non-empty string"
        )

    def refused(code: str, message: str) -> LineError:
        return LineError(number, custom_id, code, f"line {number}: {message}")

    if obj.get("method") != "POST":
        return refused("invalid_request", f"`method` must be POST, got {obj.get('method')!r}")
    url = obj.get("url")
    if url not in BODIES:
        return refused("invalid_url", f"`url` must be {' or '.join(BODIES)}, got {url!r}")
    if not isinstance(obj.get("body"), dict):
        return refused("invalid_request", "`body` must be a JSON object")
    try:
        body = BODIES[url].model_validate(obj["body"])
        if body.stream:
            raise GatewayError(
                400, "`stream` must be false in a batch: each answer is written whole", param="stream"
            )
        if (body.n or 1) > 1:
            raise GatewayError(
                400,
                "unsupported parameter: n (a batch line has one answer)",
                param="n",
                code="unsupported_parameter",
            )
        request, shaper = generate_call(body, model_name)
    except pydantic.ValidationError as exc:
        first = exc.errors()[0]
        param = invalid_body(first).param
        return refused("invalid_request", f"`{'body.' + param if param else 'body'}`: {first['msg']}")
    except GatewayError as exc:
        return refused(exc.code or "invalid_request", exc.message)
    return BatchLine(number, custom_id, request, shaper)


def parse_input(path: Path, model_name: str, done: set[str]) -> tuple[list[BatchLine], list[LineError]]:
    """The lines to run (skipping ``done`` custom_ids) and the lines that cannot; blank lines are
    skipped. BatchFileError when the file cannot be read or holds no request."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise BatchFileError(f"cannot read input {path}: {exc}") from None
    runnable: list[BatchLine] = []
    errors: list[LineError] = []
    first_line: dict[str, int] = {}
    for number, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        parsed = parse_line(number, text, model_name)
        custom_id = parsed.custom_id
        if custom_id is not None and custom_id in first_line:
            errors.append(
                LineError(
                    number,
                    custom_id,
                    "duplicate_custom_id",
                    f"line {number}: `custom_id` {custom_id!r} repeats line {first_line[custom_id]}",
                )
            )
            continue
        if custom_id is not None:
            first_line[custom_id] = number
            if custom_id in done:
                continue
        if isinstance(parsed, LineError):
            errors.append(parsed)
        else:
            runnable.append(parsed)
    if not any(text.strip() for text in lines):
        raise BatchFileError(f"input {path} is empty: no request lines")
    return runnable, errors


class OutputFile:
    """The output records, appended and flushed one by one so a restart sees every finished one."""

    def __init__(self, path: Path):
        self.path = path
        self.done: set[str] = set()  # custom_ids with a record already
        self._errors: set[str] = set()  # messages of records without a custom_id (lines not JSON)
        self._read_previous()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.path.open("a", encoding="utf-8")
        except OSError as exc:
            raise BatchFileError(f"cannot use output {path}: {exc.strerror or exc}") from None

    def _read_previous(self) -> None:
        """The records of an earlier run of the job; a torn last line (a crash mid-write) is cut."""
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return
        except OSError as exc:
            raise BatchFileError(f"cannot use output {self.path}: {exc.strerror or exc}") from None
        whole = data[: data.rfind(b"\n") + 1]
        if whole != data:
            try:
                self.path.write_bytes(whole)
            except OSError as exc:
                raise BatchFileError(f"cannot use output {self.path}: {exc.strerror or exc}") from None
        for line in whole.decode("utf-8", errors="replace").splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if not isinstance(record, dict):
                continue
            if isinstance(record.get("custom_id"), str):
                self.done.add(record["custom_id"])
            elif isinstance(record.get("error"), dict):
                self._errors.add(str(record["error"].get("message")))

    def write_error(self, error: LineError) -> bool:
        """Writes a line's error record unless an earlier run already did; True if written."""
        if error.custom_id is None and error.message in self._errors:
            return False
        self.write(error.record())
        return True

    def write(self, record: dict) -> None:
        self._file.write(json.dumps(record, ensure_ascii=False) + "\n")
        self._file.flush()
        if record["custom_id"] is not None:
            self.done.add(record["custom_id"])

    def close(self) -> None:
        self._file.close()


def result_record(line: BatchLine, result: coordinator_pb2.RunBatchResponse) -> dict:
    """The output record of one finished item: the gateway's answer, or its error."""
    if result.HasField("error"):
        status = _STATUS.get(result.error.code, 500)
        error: GatewayError | None = GatewayError(
            status, result.error.message, code=result.error.code.lower()
        )
    else:
        error = failed(result.summary)
    response = {"status_code": 200, "request_id": line.request.request_id}
    if error is not None:
        response.update(status_code=error.status, body=error.body())
        return _record(
            line.custom_id, response, {"code": error.code, "message": f"line {line.number}: {error.message}"}
        )
    response["body"] = line.shaper.completion(result.summary, result.tokens, result.logprobs)
    return _record(line.custom_id, response, None)
