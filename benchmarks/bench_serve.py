"""Throughput and latency of gpt2_max under `max serve`, against HF transformers in the same run.

    python benchmarks/bench_serve.py            # gpt2-small shape, 3 repetitions
    python benchmarks/bench_serve.py --preset distilgpt2 --repeat 1 --quick

Scenarios, each on a random-weight checkpoint of the chosen preset (float32):

  a  1 request, 16-token prompt, 128 new tokens
  b  1 request, 512-token prompt, 128 new tokens
  c  8 concurrent requests, distinct 16-token prompts, 128 new tokens each
  d  prefill: 900-token prompt, 1 new token
  e  decode speed at 900 tokens of context / decode speed at 16 tokens

plus time to first token, warm and cold server start and the peak RSS of the
server's process tree. Hugging Face transformers (torch, KV cache) runs the same
prompts in the same run, idle server beside it, and every MAX output is checked
against its greedy tokens: exact, or diverging only at a near-tie (top two HF
logits within 0.01, where float32 summation order decides), or a MISMATCH.
Results are medians over `--repeat` runs, printed as a table and written as
JSON to `benchmarks/results/`; the checkpoint is kept in the user's cache
folder and the server logs and cold-start compile cache go to a temporary one.
Shared, noisy machines: read the ratios to HF, not the absolute numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import llama_cpp_peer
from openai import AsyncOpenAI
from transformers import GPT2LMHeadModel

from gpt2_max.checkpoint import convert_to_gguf, preset_config, write_checkpoint
from gpt2_max.testing.load import GREEDY
from gpt2_max.testing.reference import hf_greedy, random_prompt
from gpt2_max.testing.server import MODEL_NAME, PeakRss, max_serve

RESULTS = Path(__file__).parent / "results"
"""The reports, and nothing else."""
CHECKPOINTS = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "gpt2-max"
"""Random-weight checkpoints, written once per preset and reused by later runs."""
NEW_TOKENS = 128
NEAR_TIE = 0.01
"""A greedy choice whose top-two HF logits differ by less than this is a coin toss
between float32 implementations (different summation orders), not a bug."""


# ---- MAX, through the OpenAI API ------------------------------------------------


async def stream_one(api: AsyncOpenAI, tokens: list[int], max_tokens: int) -> dict:
    """One streamed greedy request: its tokens and the arrival time of each."""
    start = time.perf_counter()
    arrivals: list[float] = []
    out: list[int] = []
    stream = await api.completions.create(
        model=MODEL_NAME, prompt=tokens, max_tokens=max_tokens, stream=True, **GREEDY
    )
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].model_extra.get("token_ids"):
            new = chunk.choices[0].model_extra["token_ids"]
            out += new
            arrivals += [time.perf_counter() - start] * len(new)
    return {"tokens": out, "arrivals": arrivals, "wall": time.perf_counter() - start}


async def run_max(url: str, prompts: list[list[int]], max_tokens: int) -> list[dict]:
    async with AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as api:
        return list(await asyncio.gather(*(stream_one(api, p, max_tokens) for p in prompts)))


def decode_rate(arrivals: list[float]) -> float:
    """Tokens per second after the first token (steady-state decode)."""
    return (len(arrivals) - 1) / (arrivals[-1] - arrivals[0])


# ---- HF transformers --------------------------------------------------------------


def run_hf(model: GPT2LMHeadModel, prompts: list[list[int]], max_tokens: int) -> dict:
    """Greedy generation as one left-padded batch; tokens per prompt and wall time."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=max_tokens,
            min_new_tokens=max_tokens, pad_token_id=0,
        )
    wall = time.perf_counter() - start
    return {"tokens": [row[width:].tolist() for row in out], "wall": wall}


def agreement(model: GPT2LMHeadModel, prompt_tokens: list[int], ours: list[int]) -> str:
    """`exact`, `near-tie` (first divergence where HF's top two logits are within
    NEAR_TIE), or `MISMATCH`, against HF's own one-sequence greedy decode."""
    reference, logits = hf_greedy(model, prompt_tokens, len(ours))
    pairs = zip(ours, reference, strict=False)
    diverge = next((i for i, (a, b) in enumerate(pairs) if a != b), None)
    if diverge is None and len(ours) == len(reference):
        return "exact"
    if diverge is not None:
        top2 = np.sort(logits[diverge])[-2:]
        if top2[1] - top2[0] < NEAR_TIE:
            return "near-tie"
    return "MISMATCH"


def hf_decode_rate(model: GPT2LMHeadModel, tokens: list[int], steps: int = 64) -> float:
    """HF's steady-state decode speed after prefilling `tokens`."""
    with torch.no_grad():
        out = model(torch.tensor([tokens]), use_cache=True)
        nxt = out.logits[:, -1:].argmax(-1)
        start = time.perf_counter()
        for _ in range(steps):
            out = model(nxt, past_key_values=out.past_key_values, use_cache=True)
            nxt = out.logits[:, -1:].argmax(-1)
    return steps / (time.perf_counter() - start)


# ---- scenarios --------------------------------------------------------------------


def scenarios(quick: bool, repetition: int) -> dict[str, list[list[int]]]:
    """Fresh prompts for every repetition, so no run is served from the prefix cache."""
    long = 256 if quick else 512
    seed = 1000 * repetition
    return {
        "a_single_16": [random_prompt(16, seed + 1)],
        "b_single_long": [random_prompt(long, seed + 2)],
        "c_concurrent_8x16": [random_prompt(16, seed + 10 + i) for i in range(8)],
        "d_prefill_900": [random_prompt(900, seed + 3)],
    }


def measure(
    url: str, hf: GPT2LMHeadModel, peer: llama_cpp_peer.LlamaCpp | None, quick: bool,
    repetition: int,
) -> dict:
    """One repetition of every scenario: MAX, HF, then the peer if there is one."""
    row: dict[str, dict] = {}
    for name, prompts in scenarios(quick, repetition).items():
        new = 1 if name.startswith("d_") else NEW_TOKENS
        ours = asyncio.run(run_max(url, prompts, new))
        ref = run_hf(hf, prompts, new)
        theirs = peer.greedy(prompts, new) if peer else None
        checks = [agreement(hf, p, o["tokens"]) for p, o in zip(prompts, ours, strict=True)]
        if name.startswith("d_"):
            units = len(prompts[0])  # prompt tokens processed
        else:
            units = new * len(prompts)
        max_wall = max(o["wall"] for o in ours)
        row[name] = {
            "max_tok_s": units / max_wall,
            "hf_tok_s": units / ref["wall"],
            "ttft_s": statistics.median(o["arrivals"][0] for o in ours),
            "checks": checks,
        }
        if theirs:
            row[name]["peer_tok_s"] = units / theirs["wall"]
            row[name]["peer_checks"] = [
                agreement(hf, p, t) for p, t in zip(prompts, theirs["tokens"], strict=True)
            ]
    seed = 1000 * repetition + 4
    short_prompt, long_prompt = random_prompt(16, seed), random_prompt(900, seed + 1)
    short = asyncio.run(run_max(url, [short_prompt], NEW_TOKENS))
    long = asyncio.run(run_max(url, [long_prompt], 120))
    hf_ratio = hf_decode_rate(hf, long_prompt) / hf_decode_rate(hf, short_prompt)
    row["e_decode_900_over_16"] = {
        "max_ratio": decode_rate(long[0]["arrivals"]) / decode_rate(short[0]["arrivals"]),
        "hf_ratio": hf_ratio,
    }
    return row


def concurrency_sweep(url: str, levels: list[int]) -> dict[int, float]:
    """Aggregate MAX tokens/s for `n` concurrent 16-token prompts, 64 new tokens each."""
    rates = {}
    for n in levels:
        prompts = [random_prompt(16, 100_000 + 100 * n + i) for i in range(n)]
        results = asyncio.run(run_max(url, prompts, 64))
        rates[n] = 64 * n / max(r["wall"] for r in results)
    return rates


def median_table(runs: list[dict]) -> dict:
    out: dict[str, dict] = {}
    for name in runs[0]:
        out[name] = {
            key: (sum((r[name][key] for r in runs), []) if key.endswith("checks")
                  else statistics.median(r[name][key] for r in runs))
            for key in runs[0][name]
        }
    return out


def tally(checks: list[str]) -> str:
    return ", ".join(f"{checks.count(c)} {c}" for c in sorted(set(checks)))


def print_table(table: dict, startup: dict, sweep: dict[int, float], rss: dict) -> None:
    print(f"\n{'scenario':<22}{'MAX tok/s':>12}{'HF tok/s':>12}{'MAX/HF':>9}"
          f"{'llama.cpp':>12}{'MAX/llama':>11}{'TTFT s':>9}  outputs vs HF greedy")
    for name, m in table.items():
        if "max_tok_s" in m:
            peer = (f"{m['peer_tok_s']:>12.1f}{m['max_tok_s'] / m['peer_tok_s']:>11.2f}"
                    if "peer_tok_s" in m else f"{'-':>12}{'-':>11}")
            print(f"{name:<22}{m['max_tok_s']:>12.1f}{m['hf_tok_s']:>12.1f}"
                  f"{m['max_tok_s'] / m['hf_tok_s']:>9.2f}{peer}{m['ttft_s']:>9.3f}  "
                  f"MAX: {tally(m['checks'])}"
                  + (f"; llama.cpp: {tally(m['peer_checks'])}" if "peer_checks" in m else ""))
        else:
            print(f"{name:<22}{'MAX ' + format(m['max_ratio'], '.2f'):>12}"
                  f"{'HF ' + format(m['hf_ratio'], '.2f'):>12}")
    print(f"\nserver start: cold {startup['cold_s']:.1f} s, warm {startup['warm_s']:.1f} s; "
          f"peak RSS of the server tree {startup['peak_rss_gb']:.2f} GB")
    print("concurrency sweep (16-token prompts, 64 new tokens): " + ", ".join(
        f"{n}: {rate:.0f} tok/s" for n, rate in sweep.items()))
    if rss:
        print("peak RSS of the server tree at full load, by --max-batch-size: " + ", ".join(
            f"{n}: {gb:.2f} GB" for n, gb in rss.items()))


def rss_by_batch_size(checkpoint: Path, sizes: list[int], devices: str, scratch: Path) -> dict:
    """Peak server-tree RSS with `--max-batch-size n` while n requests decode at once."""
    peaks = {}
    for n in sizes:
        with max_serve(checkpoint, "--max-batch-size", str(n), devices=devices,
                       log=scratch / f"server-rss-{n}.log") as server:
            rss = PeakRss(server.pid)
            prompts = [random_prompt(16, 200_000 + 100 * n + i) for i in range(n)]
            asyncio.run(run_max(server.url, prompts, 64))
            peaks[n] = rss.stop() / 1e9
    return peaks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="gpt2")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--devices", default="cpu")
    parser.add_argument("--quick", action="store_true", help="shorter long prompt")
    parser.add_argument("--sweep", default="1,2,4,8,16,32")
    parser.add_argument("--peer", choices=["llama.cpp"], help="also run this engine")
    parser.add_argument("--rss-batch-sizes", default="1,8,32")
    args = parser.parse_args()
    if args.peer and not llama_cpp_peer.available():
        parser.error('--peer llama.cpp needs llama-cpp-python: pip install -e ".[bench]"')

    torch.set_num_threads(os.cpu_count() or 1)  # every engine gets every core
    RESULTS.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="gpt2-max-bench-"))
    checkpoint = CHECKPOINTS / f"checkpoint-{args.preset}"
    if not (checkpoint / "model.safetensors").exists():
        write_checkpoint(checkpoint, preset_config(args.preset), std=0.2)
    hf = GPT2LMHeadModel.from_pretrained(checkpoint).eval()
    threads = os.cpu_count() or 1
    peer = None
    if args.peer:
        gguf = CHECKPOINTS / f"checkpoint-{args.preset}-f32.gguf"
        if not gguf.exists():
            convert_to_gguf(checkpoint, gguf, "f32")
        peer = llama_cpp_peer.LlamaCpp(gguf, threads=threads, n_ctx=2048, max_seqs=8)
    serve_args = ["--max-batch-size", "32"]

    startup: dict[str, float] = {}
    cold_cache = scratch / "cold-cache"  # empty, so the first start compiles from nothing
    for label, env in (("cold_s", {"XDG_CACHE_HOME": str(cold_cache)}), ("warm_s", {})):
        start = time.perf_counter()
        with max_serve(checkpoint, *serve_args, log=scratch / f"server-{label}.log",
                       devices=args.devices, env=env):
            startup[label] = time.perf_counter() - start
    shutil.rmtree(cold_cache, ignore_errors=True)
    with max_serve(checkpoint, *serve_args, log=scratch / "server.log",
                   devices=args.devices) as server:
        url = server.url
        rss = PeakRss(server.pid)
        runs = [
            measure(url, hf, peer, args.quick, repetition) for repetition in range(args.repeat)
        ]
        sweep = concurrency_sweep(url, [int(n) for n in args.sweep.split(",")])
        startup["peak_rss_gb"] = rss.stop() / 1e9
    if peer:
        peer.close()
    sizes = [int(n) for n in args.rss_batch_sizes.split(",") if n]
    rss = rss_by_batch_size(checkpoint, sizes, args.devices, scratch)
    table = median_table(runs)
    print_table(table, startup, sweep, rss)
    result = {
        "preset": args.preset, "devices": args.devices, "repeat": args.repeat,
        "cpus": os.cpu_count(), "load_avg": os.getloadavg(), "median": table,
        "runs": runs, "startup": startup, "concurrency_sweep": sweep,
        "peer": args.peer, "threads": threads, "rss_by_max_batch_size": rss,
    }
    out = RESULTS / f"bench-{args.preset}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps(result, indent=2))
    print(f"\nwrote {out}; server logs in {scratch}")


if __name__ == "__main__":
    main()
