"""What securing a fleet costs: decode tok/s of a plaintext and a secured (mutual TLS + token)
2-stage fleet side by side, interleaved rounds, ratio of medians with its 95% interval.

Run: ``.venv/bin/python -m bench.tls SHARD_DIR`` (a 2-stage export; BENCH_RUNS rounds, default 12).
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

from bench.stats import interleaved_generations, median, ratio_ci, summary, write_result
from pipeshard.certs_cli import node_names
from pipeshard.clients.client import PipeshardClient
from pipeshard.services.launcher import start_fleet
from pipeshard.tls import make_certs

PROMPT = "Explain in a few paragraphs how a bicycle works."
TOKENS = 64
RUNS = int(os.environ.get("BENCH_RUNS", "12"))
TOKEN = "bench-token"


def main(shards: Path) -> None:
    run = Path(tempfile.mkdtemp(prefix="bench-tls-"))
    make_certs(run / "certs", node_names(2))
    plain = start_fleet(shards, 2, run / "plain")
    secure = start_fleet(shards, 2, run / "secure", tls_dir=run / "certs", token=TOKEN)
    try:
        clients = {
            "plain": PipeshardClient(plain.coordinator, ca_cert=""),
            "secure": PipeshardClient(secure.coordinator, ca_cert=run / "certs" / "ca.pem", token=TOKEN),
        }

        def runner(name: str):
            def run_once() -> dict:
                r = clients[name].generate(PROMPT, max_tokens=TOKENS, ignore_eos=True)
                return {"tok_s": r.tok_s, "tokens": r.token_ids}

            return run_once

        samples, last = interleaved_generations({n: runner(n) for n in clients}, RUNS)
        if last["plain"]["tokens"] != last["secure"]["tokens"]:
            raise SystemExit("the secured fleet generated other tokens")
        ratio, ci = ratio_ci(samples["secure"], samples["plain"])
        print(
            f"secure/plain {ratio:.3f} [{ci[0]:.3f}, {ci[1]:.3f}], plain {median(samples['plain']):.1f} tok/s"
        )
        write_result(
            "tls",
            {
                "rounds": RUNS,
                "tokens": TOKENS,
                "tok_s": {n: summary(v) for n, v in samples.items()},
                "secure_over_plain": {"ratio": ratio, "ci95": ci},
            },
            f"BENCH_RUNS={RUNS} .venv/bin/python -m bench.tls {shards}",
        )
    finally:
        plain.stop()
        secure.stop()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
