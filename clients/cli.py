"""``pipeshard generate``: ask a running coordinator, or run an export's shards in this process.

Both modes print the same JSON keys with ``--json`` (DESIGN.md Interfaces), so a user can try
shards locally before building a fleet and compare the two.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

from clients.client import GenerateResult, PipeshardClient, fold

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
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=None, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--precision", choices=("default", "f32"), default="default", help="--local only")
    p.add_argument("--stream", action="store_true", help="print text as it arrives")
    p.add_argument("--json", action="store_true", help="print one JSON object with the result")
    p.set_defaults(func=run)


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
        with PipeshardClient(args.coordinator or DEFAULT_COORDINATOR) as client:
            for response in client.responses(
                args.prompt,
                max_tokens=args.max_tokens,
                temperature=args.temperature,
                top_p=args.top_p,
                top_k=args.top_k,
                seed=args.seed,
                stop=args.stop,
                ignore_eos=args.ignore_eos,
            ):
                if stream and response.HasField("chunk"):
                    print(response.chunk.text, end="", flush=True)
                fold(result, response)
    except grpc.RpcError as exc:
        print(f"pipeshard generate: {exc.code().name}: {exc.details()}", file=sys.stderr)
        raise SystemExit(2) from None
    return result


def _local(args: argparse.Namespace, stream: bool) -> GenerateResult:
    from services.coordinator.detokenizer import IncrementalDetokenizer
    from services.coordinator.prompting import Prompter
    from services.runtime.chain import LocalChain

    if args.temperature:
        raise SystemExit("pipeshard generate: --local decodes greedily; use a coordinator to sample")
    prompter = Prompter.from_dir(args.local)
    chain = LocalChain(args.local, precision=args.precision)
    chain.warmup()  # the first inference prepares kernels (0.5-2 s); keep it out of ttft
    detok = IncrementalDetokenizer(prompter.tokenizer)
    eos = prompter.eos_ids

    def on_token(token: int) -> None:
        if token in eos and not args.ignore_eos:
            return
        detok.add(token)
        if stream:
            print(detok.delta(), end="", flush=True)

    ids = prompter.encode("", [("user", args.prompt)])
    out = chain.generate_greedy(
        ids, args.max_tokens, eos_ids=sorted(eos), ignore_eos=args.ignore_eos, on_token=on_token
    )
    if stream:
        print(detok.delta(final=True), end="", flush=True)
    return GenerateResult(
        text=detok.text,
        token_ids=out.token_ids,
        finish_reason=out.finish_reason,
        prompt_tokens=out.prompt_tokens,
        completion_tokens=out.completion_tokens,
        ttft_ms=out.ttft_s * 1000.0,
        tok_s=out.tok_s,
    )
