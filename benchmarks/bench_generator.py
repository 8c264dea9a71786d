"""In-process rows beside `bench_serve.py`: one prompt, a batch of 8, N branches, a JSON schema.

    PYTHONPATH=. python benchmarks/bench_generator.py             # tiny shape, compiles fast
    PYTHONPATH=. python benchmarks/bench_generator.py --preset gpt2

Each row runs on a random-weight checkpoint through `gpt2_max.Generator` and
prints requests, new tokens, model steps, forced (fast-forwarded) tokens, wall
time and new tokens per second. Branch rows stand beside the same number of
independent requests, and the constrained row beside an unconstrained run of
the same length. Shared, noisy machines: compare rows of one run, not numbers
across runs.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from gpt2_max.generate import Completion, Generator
from gpt2_max.tools.checkpoint import preset_config, write_checkpoint

TINY = dict(n_layer=2, n_embd=64, n_head=4)
SCHEMA = {
    "type": "object",
    "properties": {
        "customerFirstName": {"enum": ["Ann", "Bob", "Cleo"]},
        "shippingAddressLine": {"type": "string", "maxLength": 12},
        "orderQuantity": {"type": "integer", "minimum": 1, "maximum": 99},
        "giftWrappingRequested": {"type": "boolean"},
    },
    "required": [
        "customerFirstName", "shippingAddressLine", "orderQuantity", "giftWrappingRequested"
    ],
    "additionalProperties": False,
}


def row(name: str, generator: Generator, run: Callable[[], list[Completion]]) -> list[Completion]:
    steps, start = generator.model_steps, time.perf_counter()
    results = run()
    wall = time.perf_counter() - start
    tokens = sum(len(r.token_ids) for r in results)
    forced = sum(r.forced_tokens for r in results)
    cached = sum(r.cached_tokens for r in results)
    print(
        f"{name:<28} {len(results):>4} {tokens:>7} {generator.model_steps - steps:>6} "
        f"{forced:>7} {cached:>7} {wall:>8.3f} {tokens / wall:>9.1f}",
        flush=True,
    )
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default=None, help="a GPT-2 shape; default: tiny")
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args()
    config = preset_config(args.preset or "gpt2", **({} if args.preset else TINY))
    new = args.new_tokens
    with tempfile.TemporaryDirectory() as folder:
        write_checkpoint(Path(folder), config)
        with Generator(folder, device="cpu", max_batch_size=16) as gen:
            prompt = list(range(1000, 1300))
            prompts = [list(range(2000 + 100 * i, 2016 + 100 * i)) for i in range(8)]
            # Warm-up, llguidance's tokenizer (built on the first constrained request) included.
            gen.generate(prompt, 4, json_schema=SCHEMA)
            print(f"{'row':<28} {'reqs':>4} {'tokens':>7} {'steps':>6} {'forced':>7} "
                  f"{'cached':>7} {'wall s':>8} {'tok/s':>9}")
            row("1 prompt", gen, lambda: [gen.generate(prompts[0], new, ignore_eos=True)])
            row("batch of 8", gen, lambda: gen.generate_batch(prompts, new, ignore_eos=True))
            row("8 one by one", gen,
                lambda: [gen.generate(p, new, ignore_eos=True) for p in prompts])
            sampled = dict(temperature=1.0, ignore_eos=True)
            for n in (1, 4, 8, 16):
                # A fresh prompt per row, so no row finds another's pages cached.
                shared = [t + 7 * n for t in prompt]
                row(f"N={n} branches, 300-tok prompt", gen,
                    lambda s=shared, n=n: gen.branches(s, n, new, **sampled))
                alone = [[t + 11 * n + 1000 * i for t in prompt] for i in range(n)]
                row(f"N={n} independent requests", gen,
                    lambda a=alone: gen.generate_batch(a, new, **sampled))
            schema = row("JSON schema, batch of 8", gen,
                         lambda: gen.generate_batch(prompts, 4 * new, json_schema=SCHEMA))
            length = max(len(r.token_ids) for r in schema)
            row("same length, no schema", gen,
                lambda: gen.generate_batch(prompts, length, ignore_eos=True))
            steps = sum(r.steps for r in schema)
            forced = sum(r.forced_tokens for r in schema)
            print(f"fast-forward: {forced} of {steps + forced} schema tokens forced, "
                  f"{forced / (steps + forced):.0%} of per-request steps saved")


if __name__ == "__main__":
    main()
