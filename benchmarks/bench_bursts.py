"""Decode bursts through `max serve`: which `K` (`GPT2_MAX_DECODE_STEPS`) and budget
(`GPT2_MAX_BURST_MS`), and what a burst costs a request that arrives during one.

    python benchmarks/bench_bursts.py                     # gpt2-small shape, f32 and Q4_K_M
    python benchmarks/bench_bursts.py --steps 1,8 --types q4_k_m --llama-bench
    python benchmarks/bench_bursts.py --steps 8:50,8:150 --types f32   # K:budget in ms

For each file and each setting, a fresh server (the README's recommended metric setting
plus `GPT2_MAX_DECODE_STEPS=K`, and `GPT2_MAX_BURST_MS` where given) answers, after a
warm-up:

- one streamed greedy request, 16-token prompt, 128 new tokens: ms per decode token
  (from the first token's arrival to the last's) and the request's time to first token;
- the same request again, and while it decodes (after its 40th token) a second one
  (16 new tokens): the second's time to first token, what a burst in flight costs a
  request that arrives mid-burst.

`--llama-bench` adds llama.cpp's `llama-bench` tg128 on the same file, right after,
for the ratio. Medians over `--repeat` rounds, the `K` order alternating each round.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
from pathlib import Path

import llama_cpp_tools
import streams
from bench_serve import CHECKPOINTS, THREADS, gguf_file, serve
from bench_start import cpu_model
from bench_step import PROMPT

from gpt2_max.bursts.model import BUDGET_ENV, ENV
from gpt2_max.tools.checkpoint import preset_config, write_checkpoint

SECOND = list(range(3000, 3016))
"""The prompt of the request that arrives mid-burst (`PROMPT` is `bench_step`'s)."""
NEW_TOKENS = 128
ARRIVES_AFTER = 40
"""The second request is sent as the first's 40th token arrives."""
RECOMMENDED = {"MAX_SERVE_METRIC_RECORDING_METHOD": "NOOP"}
"""README's recommended CPU command's metric setting; its 100 ms burst budget is the
setting `K:100`, the budget's default (250 ms) that of a plain `K`."""


async def one_stream(url: str) -> tuple[float, float]:
    """(ms per decode token, time to first token in ms) of one streamed request."""
    async with streams.client() as client:
        result = await streams.max_completion(client, url, PROMPT, NEW_TOKENS)
    arrivals = result["arrivals"]
    return (arrivals[-1] - arrivals[0]) / (len(arrivals) - 1) * 1e3, arrivals[0] * 1e3


async def mid_burst(url: str) -> float:
    """Time to first token (ms) of a request sent as another's `ARRIVES_AFTER`-th token
    arrives, so while that one decodes."""
    received = 0
    second: asyncio.Task | None = None

    async with streams.client() as client:

        def first_ids(event: dict) -> list[int]:
            nonlocal received, second
            ids = streams.completion_token_ids(event)
            received += len(ids)
            if second is None and received >= ARRIVES_AFTER:
                second = asyncio.create_task(streams.max_completion(client, url, SECOND, 16))
            return ids

        body = {"model": streams.MODEL_NAME, "prompt": PROMPT, "max_tokens": NEW_TOKENS,
                "stream": True, **streams.MAX_GREEDY}
        await streams.stream(client, f"{url}/v1/completions", body, first_ids)
        assert second is not None
        return (await second)["arrivals"][0] * 1e3


def measure(path: Path, setting: str) -> dict[str, float]:
    """One fresh server's figures at `setting`: `K`, or `K:budget_ms`."""
    steps, _, budget = setting.partition(":")
    env = {**RECOMMENDED, ENV: steps, **({BUDGET_ENV: budget} if budget else {})}
    with tempfile.TemporaryDirectory() as scratch:
        with serve(path, "--max-batch-size", "16", devices="cpu",
                   log=Path(scratch) / "server.log", env=env) as server:
            asyncio.run(one_stream(server.url))  # warm-up
            token, ttft = asyncio.run(one_stream(server.url))
            arriving = asyncio.run(mid_burst(server.url))
    return {"token ms": token, "TTFT ms": ttft, "TTFT mid-burst ms": arriving}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="gpt2")
    parser.add_argument("--types", default="f32,q4_k_m")
    parser.add_argument("--steps", default="1,2,4,8,16")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--llama-bench", action="store_true")
    args = parser.parse_args()
    checkpoint = CHECKPOINTS / f"checkpoint-{args.preset}"
    if not (checkpoint / "model.safetensors").exists():
        write_checkpoint(checkpoint, preset_config(args.preset), std=0.2)
    ks = args.steps.split(",")
    print(f"CPU: {cpu_model()}; preset {args.preset}; one stream of {len(PROMPT)} + "
          f"{NEW_TOKENS} tokens; server env {RECOMMENDED}; median of {args.repeat}")
    for file_type in args.types.split(","):
        path = gguf_file(checkpoint, file_type)
        rows: dict[str, list[dict[str, float]]] = {k: [] for k in ks}
        tg = []
        for r in range(args.repeat):
            for k in ks if r % 2 == 0 else ks[::-1]:
                rows[k].append(measure(path, k))
            if args.llama_bench:
                tg.append(llama_cpp_tools.llama_bench(path, THREADS, prompt=0)["tg128"])
        print(f"\n{file_type} ({path.name})")
        print("| K[:budget ms] | ms per token | tok/s | TTFT ms "
              "| TTFT of a request arriving mid-burst ms |"
              + (" vs llama-bench tg128 |" if tg else ""))
        print("| ---: | ---: | ---: | ---: | ---: |" + (" ---: |" if tg else ""))
        for k in ks:
            med = {key: statistics.median(m[key] for m in rows[k]) for key in rows[k][0]}
            ratio = f" {1e3 / med['token ms'] / statistics.median(tg):.2f} |" if tg else ""
            print(f"| {k} | {med['token ms']:.2f} | {1e3 / med['token ms']:.1f} | "
                  f"{med['TTFT ms']:.1f} | {med['TTFT mid-burst ms']:.1f} |{ratio}")
        if tg:
            print(f"llama-bench tg128: {statistics.median(tg):.1f} tok/s "
                  f"({1e3 / statistics.median(tg):.2f} ms per token)")


if __name__ == "__main__":
    main()
