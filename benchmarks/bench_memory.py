"""Peak RSS of the `max serve` process tree under full load, MAX's KV-cache sizing vs bounded.

    python benchmarks/bench_memory.py                  # gpt2-small shape, every configuration
    python benchmarks/bench_memory.py --only bounded

Each configuration serves the checkpoint with `--max-batch-size 32` and sends 32
greedy requests of 900 prompt + 100 new tokens at once, every answer checked
against transformers; the tree's RSS (API process, model worker, metrics
process) is sampled every 0.2 s from the start of the load to its end. Run it
where README's install runs (torch not installed): a server that finds torch
imports it and is larger by that much.
"""

from __future__ import annotations

import argparse
import re
import tempfile
from pathlib import Path

from bench_serve import CHECKPOINTS
from transformers import GPT2LMHeadModel

from gpt2_max.testing.load import LoadRequest, expected_tokens, run_load
from gpt2_max.testing.reference import random_prompt
from gpt2_max.testing.server import PeakRss, max_serve
from gpt2_max.tools.checkpoint import preset_config, write_checkpoint

CONCURRENCY = 32
PROMPT, NEW = 900, 100
BOUNDED = ("--max-batch-total-tokens", "8192")
ASYNCIO_METRICS = {"MAX_SERVE_METRIC_RECORDING_METHOD": "ASYNCIO"}
CONFIGURATIONS: dict[str, tuple[tuple[str, ...], dict[str, str]]] = {
    "default": ((), {}),
    "bounded": (BOUNDED, {}),
    "bounded-input-2048": ((*BOUNDED, "--max-batch-input-tokens", "2048"), {}),
    "recommended": (BOUNDED, ASYNCIO_METRICS),
}
"""Flags besides `--max-batch-size 32`, and environment: MAX's sizing, then a cache
of 8 full windows; README's recommended line also records metrics in the API process."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="gpt2")
    parser.add_argument("--only", choices=sorted(CONFIGURATIONS), action="append")
    args = parser.parse_args()
    checkpoint = CHECKPOINTS / f"checkpoint-{args.preset}"
    if not (checkpoint / "model.safetensors").exists():
        write_checkpoint(checkpoint, preset_config(args.preset), std=0.2)
    n_positions = preset_config(args.preset).n_positions
    requests = [
        LoadRequest(i, tuple(random_prompt(PROMPT, seed=i)), NEW, stream=i % 2 == 1)
        for i in range(CONCURRENCY)
    ]
    expected = expected_tokens(GPT2LMHeadModel.from_pretrained(checkpoint).eval(), requests,
                               n_positions)
    scratch = Path(tempfile.mkdtemp(prefix="gpt2-max-memory-"))
    for name in args.only or CONFIGURATIONS:
        log = scratch / f"server-{name}.log"
        flags, env = CONFIGURATIONS[name]
        with max_serve(checkpoint, "--max-batch-size", str(CONCURRENCY), *flags,
                       log=log, env=env) as server:
            rss = PeakRss(server.pid)
            report = run_load(server.url, requests, CONCURRENCY)
            peak = rss.stop()
        (cache,) = re.findall(r"cache_memory: (\S+ \S+)", log.read_text())[-1:]
        exact = sum(report.completed.get(i) == expected[i] for i in expected)
        print(f"{name:20s} peak RSS {peak / 1e9:.2f} GB  KV cache {cache}  "
              f"{exact}/{len(requests)} exact, {len(report.failed)} failed")
    print(f"server logs in {scratch}")


if __name__ == "__main__":
    main()
