"""``pipeshard batch INPUT.jsonl --out OUTPUT.jsonl``: an offline job in OpenAI's batch file format.

The lines are validated here as the gateway validates a body (batch_file.py), the valid ones
sent to the coordinator's RunBatch in one call, and each result appended to the output as it
finishes, with a progress bar (requests done, tokens per second, ETA). A restarted job skips the
custom_ids the output already holds.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from pipeshard.clients.cli import DEFAULT_COORDINATOR
from pipeshard.clients.client import Connection
from pipeshard.services.gateway.batch_file import BatchFileError, OutputFile, parse_input, result_record
from pipeshard.v1 import coordinator_pb2, coordinator_pb2_grpc

# What the answers' `model` says when a line's body names none (the gateway's default name).
DEFAULT_MODEL_NAME = "pipeshard"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("batch", help="run an OpenAI batch file (JSONL) through a coordinator")
    p.add_argument("input", type=Path, help="input JSONL: custom_id, method POST, url, body per line")
    p.add_argument(
        "--out", type=Path, required=True, help="output JSONL (appended; finished custom_ids are skipped)"
    )
    p.add_argument(
        "--coordinator",
        default=DEFAULT_COORDINATOR,
        help=f"coordinator address (default {DEFAULT_COORDINATOR})",
    )
    p.add_argument(
        "--micro-batches",
        default="auto",
        metavar="M|auto|off",
        help="groups the job's sessions are stepped in, each travelling the stages behind the other "
        "(off: the whole batch in one step; auto: chosen from measured step throughput; default auto)",
    )
    p.add_argument(
        "--codec",
        default="",
        metavar="MODE",
        help="how every stage sends this job's hidden states and logits: none, zstd, byte_split_zstd, "
        "lane_blocks_zstd, quantum_zstd or auto (default: the stages' own --codec)",
    )
    p.add_argument(
        "--model-name", default=DEFAULT_MODEL_NAME, help="`model` of answers whose body names none"
    )
    p.add_argument("--token", default=None, help="bearer token (default: PIPESHARD_TOKEN, else certs/token)")
    p.add_argument("--ca-cert", type=Path, default=None, help="fleet CA certificate: speak TLS")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (a summary line at the end)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        output = OutputFile(args.out)
    except BatchFileError as exc:
        return _fail(str(exc))
    try:
        lines, errors = parse_input(args.input, args.model_name, output.done)
        for error in errors:
            output.write_error(error)
        if not lines:
            print(
                f"pipeshard batch: nothing to run ({len(errors)} invalid line(s) recorded)", file=sys.stderr
            )
            return 0 if not errors else 1
        failed = _submit(args, lines, output)
    except BatchFileError as exc:
        return _fail(str(exc))
    finally:
        output.close()
    return 1 if failed or errors else 0


def _fail(message: str) -> int:
    print(f"pipeshard batch: {message}", file=sys.stderr)
    return 2


def _submit(args: argparse.Namespace, lines, output: OutputFile) -> int:
    """Runs the lines through RunBatch and writes each record; the number of failed items."""
    import grpc
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    by_id = {line.custom_id: line for line in lines}
    request = coordinator_pb2.RunBatchRequest(
        items=[
            coordinator_pb2.BatchJobItem(custom_id=line.custom_id, request=line.request) for line in lines
        ],
        micro_batches=args.micro_batches,
        codec=args.codec,
    )
    connection = Connection.resolve(args.ca_cert, args.token)
    failed = tokens = 0
    start = time.perf_counter()
    columns = (
        TextColumn("batch"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[tok_s]:.1f} tok/s"),
        TimeRemainingColumn(),
    )
    with (
        connection.channel(args.coordinator) as channel,
        Progress(*columns, disable=args.no_progress, transient=False) as progress,
    ):
        task = progress.add_task("batch", total=len(lines), tok_s=0.0)
        stub = coordinator_pb2_grpc.CoordinatorServiceStub(channel)
        try:
            for result in stub.RunBatch(request, metadata=connection.metadata):
                record = result_record(by_id[result.custom_id], result)
                output.write(record)
                failed += record["error"] is not None
                tokens += result.summary.completion_tokens
                progress.update(task, advance=1, tok_s=tokens / max(time.perf_counter() - start, 1e-9))
        except grpc.RpcError as exc:
            raise BatchFileError(
                f"coordinator {args.coordinator}: {exc.code().name}: {exc.details()} "
                f"(finished records are in {output.path}; run again to resume)"
            ) from None
    if args.no_progress:
        elapsed = time.perf_counter() - start
        print(
            f"pipeshard batch: {len(lines)} requests, {failed} failed, {tokens / elapsed:.1f} tok/s",
            file=sys.stderr,
        )
    return failed
