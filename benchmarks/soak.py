"""Soak `max serve` with a bounded, exactly-checked load and report what happened.

    python benchmarks/soak.py --requests 500 --concurrency 32 --cancel 50

Writes a tiny random GPT-2 with `gpt2_max.testing`, serves it on
127.0.0.1, sends `--requests` greedy completions (prompts of 1-900 tokens,
max_tokens up to past the context window, half streaming, `--cancel` of the
streams hung up after their first token), and checks every completed answer
against transformers. Reports completed / exact / lost / duplicated / failed,
cancellations, and the server tree's memory before and after.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from gpt2_max.testing.load import expected_tokens, plan_requests, run_load
from gpt2_max.testing.reference import TINY, load_reference, write_tiny_checkpoint
from gpt2_max.testing.server import max_serve, tree_rss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=500)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--cancel", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    n_positions = TINY["n_positions"]
    folder = Path(tempfile.mkdtemp(prefix="gpt2-max-soak-"))
    checkpoint = write_tiny_checkpoint(folder / "checkpoint")
    model = load_reference(checkpoint)
    requests = plan_requests(
        args.requests, n_positions, distinct_prompts=max(args.requests // 8, 1),
        max_prompt=900, cancellations=args.cancel, seed=args.seed,
    )
    kept = [r for r in requests if not r.cancel_after_first_token]
    expected = expected_tokens(model, kept, n_positions)
    with max_serve(
        checkpoint, "--max-batch-size", str(args.concurrency), log=folder / "server.log"
    ) as server:
        run_load(server.url, requests[: args.concurrency], args.concurrency)  # warm-up
        before = tree_rss(server.pid)
        report = run_load(server.url, requests, args.concurrency)
        after = tree_rss(server.pid)
    exact = sum(report.completed.get(r.index) == expected[r.index] for r in kept)
    summary = {
        "requests": len(requests),
        "completed": len(report.completed),
        "exact": exact,
        "lost": len(kept) - len(report.completed) - len(report.failed),
        "duplicated": len(report.duplicated),
        "failed": len(report.failed),
        "cancelled": report.cancelled,
        "wall_s": round(report.wall_s, 1),
        "rss_before_mb": round(before / 2**20),
        "rss_after_mb": round(after / 2**20),
        "server_log": str(folder / "server.log"),
    }
    print(json.dumps(summary, indent=2))
    if report.failed:
        print("failures:", json.dumps(dict(list(report.failed.items())[:5]), indent=2))
    sys.exit(0 if exact == len(kept) and not report.failed else 1)


if __name__ == "__main__":
    main()
