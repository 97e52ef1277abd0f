"""``pipeshard generate``: ask a running coordinator, or run an export's shards in this process.

Both modes print the same JSON keys with ``--json`` (docs/ARCHITECTURE.md, "Interfaces others rely
on"), so a user can try shards locally before building a fleet and compare the two.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, fields
from pathlib import Path

from pipeshard.clients.client import GenerateResult, PipeshardClient, fold

DEFAULT_COORDINATOR = "127.0.0.1:50051"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text from a prompt (coordinator or local shards)")
    p.add_argument("prompt", help="the user message (sent with the model's chat template)")
    where = p.add_mutually_exclusive_group()
    where.add_argument(
        "--coordinator", default=None, help=f"coordinator address (default {DEFAULT_COORDINATOR})"
    )
    where.add_argument(
        "--local", type=Path, metavar="SHARD_DIR", help="run this export in-process, no services"
    )
    p.add_argument("--token", default=None, help="bearer token (default: PIPESHARD_TOKEN, else certs/token)")
    p.add_argument(
        "--ca-cert",
        type=Path,
        default=None,
        help="fleet CA certificate: speak TLS (default: PIPESHARD_CA_CERT, else run/ca.pem if present)",
    )
    p.add_argument("--plaintext", action="store_true", help="no TLS even if a CA certificate is found")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=None, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument(
        "--speculative",
        default="",
        metavar="NAME",
        help="draft source for speculative decoding: auto (the source measured fastest, or plain), "
        "none, ngram, self, feature, mix, medusa or a name the coordinator was started with "
        "(--draft NAME=DIR); with --local also a draft folder (default: the coordinator's; none "
        "with --local); --json's speculative names the one used",
    )
    p.add_argument("--k", type=_k, default=0, metavar="N|auto", help="drafts per verify step (default auto)")
    p.add_argument(
        "--tree",
        default="",
        metavar="auto|off|WxD",
        help="draft trees: auto (the coordinator chooses a tree or a chain; the default), off (chains) "
        "or WxD (up to W candidate paths of D levels; stateful stages)",
    )
    p.add_argument("--self-draft", type=Path, default=None, help="--local only: the self-draft export")
    p.add_argument(
        "--draft-heads",
        type=Path,
        default=None,
        help="--local only: draft heads the final stage runs (pipeshard distil --kind medusa), for `medusa`",
    )
    p.add_argument(
        "--precision", default=None, help="--local only: exact, fast or f32 (unset: the default, exact)"
    )
    p.add_argument(
        "--kv",
        choices=("auto", "stateful", "paged", "static"),
        default="auto",
        help="--local only: the KV backend, auto (static for a static export, else paged), paged "
        "(continuous batching, the fleet's default), stateful (one cache per session) or static",
    )
    p.add_argument("--stream", action="store_true", help="print text as it arrives")
    p.add_argument("--json", action="store_true", help="print one JSON object with the result")
    p.set_defaults(func=run)


def _k(value: str) -> int:
    if value == "auto":
        return 0
    try:
        k = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number or auto, got {value!r}") from None
    if not 1 <= k <= 32:
        raise argparse.ArgumentTypeError(f"must be in 1..32 or auto, got {k}")
    return k


def run(args: argparse.Namespace) -> int:
    stream = args.stream and not args.json
    result = _local(args, stream) if args.local else _remote(args, stream)
    if args.json:
        print(json.dumps(asdict(result), ensure_ascii=False))
    elif not stream:
        print(result.text)
    else:
        print()
    return 0 if result.finish_reason != "error" else 1


def _remote(args: argparse.Namespace, stream: bool) -> GenerateResult:
    import grpc

    result = GenerateResult()
    try:
        with PipeshardClient(
            args.coordinator or DEFAULT_COORDINATOR,
            token=args.token,
            ca_cert="" if args.plaintext else args.ca_cert,
        ) as client:
            for response in client.responses(
                args.prompt,
                max_tokens=args.max_tokens,
                temperature=args.temperature,
                top_p=args.top_p,
                top_k=args.top_k,
                seed=args.seed,
                stop=args.stop,
                ignore_eos=args.ignore_eos,
                speculative=args.speculative,
                k=args.k,
                tree=args.tree,
            ):
                if stream and response.HasField("chunk"):
                    print(response.chunk.text, end="", flush=True)
                fold(result, response)
    except grpc.RpcError as exc:
        print(f"pipeshard generate: {exc.code().name}: {exc.details()}", file=sys.stderr)
        raise SystemExit(2) from None
    return result


def _local(args: argparse.Namespace, stream: bool) -> GenerateResult:
    """The in-process mode belongs to the services; pipeshard/cli.py hands it in as ``run_local``."""
    summary = args.run_local(args, stream)
    return GenerateResult(**{f.name: getattr(summary, f.name) for f in fields(GenerateResult)})
