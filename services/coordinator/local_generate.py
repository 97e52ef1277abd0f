"""``pipeshard generate --local``: the coordinator's decode loop over every stage in this process.

It lives with the coordinator because it runs the coordinator's internals; the client CLI only
dispatches to it (through pipeshard/cli.py), so clients/ imports nothing but the contract.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from pipeshard.errors import Internal, PipeshardError
from pipeshard.logs import configure_logging
from pipeshard.precision import DEFAULT_PRECISION
from pipeshard.services.coordinator.generation import Generation, Summary
from pipeshard.services.coordinator.in_process import InProcessStages
from pipeshard.services.coordinator.sampling import SamplingParams
from pipeshard.services.coordinator.speculation.sources import DraftSources
from pipeshard.services.stage.backends import choose_backend
from pipeshard.shard.manifest import load_manifest
from pipeshard.shard.prompting import Prompter


def generate_local(args: argparse.Namespace, stream: bool) -> Summary:
    """Run ``pipeshard generate``'s arguments against the export ``args.local``, no services."""
    # stdout carries the answer (or its JSON); the shards' own log lines go to stderr, warnings only
    configure_logging(fmt="console", level="warning", stream=sys.stderr)
    prompter = Prompter.from_dir(args.local)
    precision = args.precision or DEFAULT_PRECISION
    backend = choose_backend(args.kv, load_manifest(Path(args.local)))
    ring = InProcessStages.of(backend, args.local, precision).ring()
    heads = ring.stages.run_heads(args.draft_heads) if args.draft_heads else 0
    ring.stages.warmup()  # the first inference prepares kernels (0.5-2 s); keep it out of ttft
    generation = Generation(
        ring,
        prompter.tokenizer,
        prompter.eos_ids,
        prefill_chunk=ring.prefill_chunk,
        drafts=DraftSources(args.local, self_draft=args.self_draft, heads=heads, allow_paths=True),
    )
    ids = prompter.user_text(args.prompt)
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature or 0.0,
        top_p=1.0 if args.top_p is None else args.top_p,
        top_k=args.top_k or 0,
        seed=args.seed,
        stop=tuple(args.stop or ()),
        ignore_eos=args.ignore_eos,
    )

    async def generate() -> Summary:
        params.validate(
            prompt_tokens=len(ids), max_context=ring.stages.max_context, vocab_size=ring.stages.vocab_size
        )
        summary = None
        try:
            async for event in generation.run(
                ids, params, speculative=args.speculative, k=args.k, tree=args.tree
            ):
                if isinstance(event, Summary):
                    summary = event
                elif stream:
                    print(event.text, end="", flush=True)
        finally:
            await generation.close()  # its engine task ends with this event loop
        if summary is None:
            raise Internal("the generation ended without a summary")
        return summary

    try:
        return asyncio.run(generate())
    except PipeshardError as exc:
        print(f"pipeshard generate: {exc.code}: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
