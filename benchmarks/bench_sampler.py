"""The token sampler alone: MAX's sampler graph, as MAX builds it and with the `min_p`
cut the package adds to it on the CPU (`shims.min_p`), against the sampler MAX's text
pipeline calls with the package's `sampler` room (`gpt2_max.sampler`, in front of the
cut graph), same logits, same CPU, same run.

    PYTHONPATH=. python benchmarks/bench_sampler.py     # nothing else running

For 1, 8 and 32 rows of GPT-2's vocabulary, each request kind a client sends:
greedy (temperature 0, which MAX makes top-k 1), a temperature alone (OpenAI's
API has no top-k; MAX's default, what `max benchmark` sends), top-k 50
(transformers' default), top-p 0.95 and min-p 0.05. Median milliseconds of one call as MAX's
`FusedSamplingProcessor` makes it (`_sample_logits`' inputs). The rows the room
does not take go to MAX's graph, so their two columns time the same graph.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
from bench_start import cpu_model
from max.driver import CPU, Buffer
from max.engine import InferenceSession
from max.graph import DeviceRef
from max.pipelines.lib import SamplingConfig
from max.pipelines.sampling import sampling

from gpt2_max.sampler import PlainRowsSampler
from gpt2_max.shims import min_p

VOCAB = 50257
KINDS = {
    "greedy": dict(top_k=1, temperature=0.0),
    "temperature 1": dict(),
    "top-k 50": dict(top_k=50),
    "top-p 0.95": dict(top_p=0.95),
    "min-p 0.05": dict(min_p=0.05),
}
"""Each request kind's sampling settings beside MAX's defaults (temperature 1, no
top-k, top-p 1, min-p 0)."""


def sampler_inputs(rows: int, top_k: int = -1, temperature: float = 1.0,
                   top_p: float = 1.0, min_p: float = 0.0) -> list[Buffer]:
    """MAX's plain sampler inputs for `rows` rows of random logits at a GPT-2 scale."""
    rng = np.random.default_rng(rows)
    arrays = [
        rng.normal(0, 3, (rows, VOCAB)).astype(np.float32), np.zeros((rows, 64), np.int64),
        np.full(rows, top_k, np.int64), np.array(top_k, np.int64),
        np.full(rows, temperature, np.float32), np.full(rows, top_p, np.float32),
        np.array(top_p, np.float32), np.full(rows, min_p, np.float32),
        np.arange(rows, dtype=np.uint64),
    ]
    return [Buffer.from_numpy(a) for a in arrays]


def median_ms(call, inputs: list[Buffer], repeat: int) -> float:
    call(*inputs)
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        call(*inputs)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,8,32", type=lambda s: [int(r) for r in s.split(",")])
    parser.add_argument("--repeat", type=int, default=30)
    args = parser.parse_args()
    device = CPU()
    session = InferenceSession(devices=[device])
    min_p.install()
    cut = sampling.topk_fused_sampling
    sampling.topk_fused_sampling = cut.__wrapped__  # MAX's own call, for MAX's graph
    try:
        maxs = session.load(sampling.token_sampler(SamplingConfig(), DeviceRef.CPU()))
    finally:
        sampling.topk_fused_sampling = cut
    served = session.load(sampling.token_sampler(SamplingConfig(), DeviceRef.CPU()))
    package = PlainRowsSampler(served, device)
    print(f"CPU: {cpu_model()}; vocabulary {VOCAB}; ms per call (median of {args.repeat})\n")
    print("| request kind | rows | MAX's sampler graph | with the min_p cut "
          "| with gpt2_max.sampler | ratio to MAX's |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for name, settings in KINDS.items():
        for rows in args.rows:
            inputs = sampler_inputs(rows, **settings)
            theirs = median_ms(maxs, inputs, args.repeat)
            with_cut = median_ms(served, inputs, args.repeat)
            ours = median_ms(package, inputs, args.repeat)
            print(f"| {name} | {rows} | {theirs:.2f} | {with_cut:.2f} | {ours:.2f} "
                  f"| {theirs / ours:.1f}x |")


if __name__ == "__main__":
    main()
