"""Throughput and latency of gpt2_max under `max serve`, against HF transformers in the same run.

    python benchmarks/bench_serve.py            # gpt2-small shape, 3 repetitions
    python benchmarks/bench_serve.py --preset distilgpt2 --repeat 1 --quick
    python benchmarks/bench_serve.py --peer llama.cpp --gguf-types q4_k,q6_k,f16
    python benchmarks/bench_serve.py --llama-tools --gguf-types f16,q4_k_m

Scenarios, each on a random-weight checkpoint of the chosen preset (float32):

  a  1 request, 16-token prompt, 128 new tokens
  b  1 request, 512-token prompt, 128 new tokens
  c  8 concurrent requests, distinct 16-token prompts, 128 new tokens each
  d  prefill: 900-token prompt, 1 new token
  e  decode speed at 900 tokens of context / decode speed at 16 tokens

plus time to first token, warm and cold server start and the peak RSS of the
server's process tree. Hugging Face transformers (torch, KV cache) runs the same
prompts in the same run, with the server paused, and every MAX output is checked
against its greedy tokens: exact, or diverging only at a near-tie (top two HF
logits within 0.01, where float32 summation order decides), or a MISMATCH.
Every output also gets a top-1 agreement: the fraction of its tokens that are
HF's argmax given the same prefix, teacher-forced on the engine's own tokens
(one HF forward pass), which tells outputs that part from HF's greedy path at a
close call (high) from garbage (about one in the vocabulary).

GGUF rows: the same checkpoint written as a GGUF of each `--gguf-types` type is
served from that file (`--weight-path`) and runs scenarios a, c and d. Their HF is
float32 on the file's weights dequantized by the `gguf` package, so only the
engines' arithmetic differs from it; for block-quantized types that is not
float32-exact by design (MAX's `qmatmul` quantizes activations to 8 bits per
block, llama.cpp its own way), so their greedy tokens are expected to part from
HF's (MISMATCH); their top-1 agreement, beside llama.cpp's on the same file, is
the figure to read. The random weights (std 0.2) make large activations, whose
8-bit rounding moves the argmax often: both engines' top-1 on 4- and 6-bit files
is modest, and a broken kernel would score about nothing.
Beside each type, the server tree's peak RSS at `--max-batch-size 8`.

With `--peer llama.cpp` the same prompts also run in llama.cpp, in-process on
the same GGUF file (F32 for the float rows) with the same threads, flash
attention off unless `--llama-flash-attn` (off is its most exact setting and
slows its long prefills). Its CPU arithmetic is not float32-exact either (see
`llama_cpp_peer`): the report includes its teacher-forced logits against HF's
on a 512-token prompt.

With `--llama-tools`, llama.cpp's own `llama-bench` (tg128, pp900) and
`llama-batched-bench` (8 sequences of 16 + 128 tokens) run on the same files
(F32 for the float rows; built once by `build_llama_cpp.sh`), and their rows
stand beside the server's single-request, 8-concurrent and 900-token-prefill
ones: each with llama.cpp's CPU repacking of the weights (its default), or where
that crashes without it, labelled so, and `llama-bench` tg128 both ways.
`llama-bench` tg128 and `llama-server` answering the same single request
also run in every repetition, right after the server's single request on the same
weights: each "median pair" row is the pair whose ratio is the median of those
same-minute ratios, the one to read on a machine whose speed drifts.

Every stream, `max serve`'s and `llama-server`'s alike, is read by one lean client
(`streams.py`: server-sent-event lines, one `json.loads` each): the client shares the
cores with the server it times, so a heavier one for either server would slow that one.

Results are medians over `--repeat` runs, printed as a table and written as
JSON to `benchmarks/results/`; the checkpoints (safetensors and GGUF) are kept
in the user's cache folder and the server logs and the cold and warm starts' compile cache go
to a temporary one. Shared, noisy machines: read the ratios, not the absolute
numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

import httpx
import llama_cpp_peer
import llama_cpp_tools
import numpy as np
import streams
import torch
from bench_start import cpu_model
from transformers import GPT2LMHeadModel

from gpt2_max.names import PACKAGE
from gpt2_max.testing.reference import (
    hf_greedy,
    hf_on_gguf_weights,
    random_prompt,
    sampleable,
)
from gpt2_max.testing.server import PeakRss, Server, max_serve
from gpt2_max.tools.checkpoint import (
    convert_to_gguf,
    gguf_file_name,
    preset_config,
    write_checkpoint,
)
from gpt2_max.tools.gguf_config import write_companion_files
from gpt2_max.tools.gguf_writer import FILE_TYPES

RESULTS = Path(__file__).parent / "results"
"""The reports, and nothing else."""
CHECKPOINTS = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "gpt2-max"
"""Random-weight checkpoints, written once per preset and reused by later runs."""
NEW_TOKENS = 128
NEAR_TIE = 0.01
"""A greedy choice whose top-two HF logits differ by less than this is a coin toss
between float32 implementations (different summation orders), not a bug."""
THREADS = os.cpu_count() or 1
"""Every engine gets every core."""
SERVE_ARGS = ("--max-batch-size", "32")
"""How the measured servers run (the RSS servers set their own batch size)."""
GGUF_SCENARIOS = ("a_single_16", "c_concurrent_8x16", "d_prefill_900")
"""The scenarios each GGUF type runs: one request, eight at once, and a 900-token prefill."""
GGUF_RSS_BATCH_SIZE = 8
PAIRED_SCENARIO = "a_single_16"
"""The scenario timed against llama.cpp's one-stream tools in every repetition
(`--llama-tools`): a shared machine's speed drifts within minutes, so its ratios are
read from same-minute pairs."""
PAIRED_TOOLS = {"tg128": "llama-bench tg128", "server_one": "llama-server, 1 request"}
"""The figures `paired_peers` gives, by key, and their labels."""
WARM_UP_SEED = 999_999
"""No scenario's prompt seed."""
LOGIT_CHECK_POSITIONS = [0, 15, 127, 255, 511]
"""Where llama.cpp's logits are compared with HF's, teacher-forced on one 512-token prompt."""


# ---- MAX, through the OpenAI API ------------------------------------------------


SERVE_ENV: dict[str, str] = {}
"""Added to every server's environment (`--serve-env`)."""


def serve(
    weights: Path, *args: str, devices: str, log: Path, env: dict | None = None
) -> AbstractContextManager[Server]:
    """`max serve` of a checkpoint folder, or of one `.gguf` file from its folder (named
    with `--weight-path`: MAX picks GGUFs in a folder by name patterns only some match)."""
    if weights.suffix == ".gguf":
        args = ("--weight-path", str(weights), *args)
        weights = weights.parent
    return max_serve(weights, *args, log=log, devices=devices, env={**SERVE_ENV, **(env or {})})


async def run_max(url: str, prompts: list[list[int]], max_tokens: int) -> list[dict]:
    """`prompts` sent at once, each streamed (`streams.max_completion`): per request its
    tokens, their arrival times and its wall time."""
    return await streams.gather(streams.max_completion, url, prompts, max_tokens)


def warm_up(url: str) -> None:
    """One short request before a server is measured, as `llama-bench` warms up before it
    times: the first request after a start pays one-time costs no later one does. Its
    prompt is no measured prompt's prefix, so the prefix cache gives nothing away."""
    asyncio.run(run_max(url, [random_prompt(16, WARM_UP_SEED)], 8))


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


def hf_logits(model: GPT2LMHeadModel, tokens: list[int]) -> np.ndarray:
    """HF's next-token logits after every prefix of `tokens`, in one forward pass."""
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0, :, : sampleable(model)].numpy()


def top1(model: GPT2LMHeadModel, prompt_tokens: list[int], ours: list[int]) -> float:
    """The fraction of `ours` that are HF's argmax after the same prefix, teacher-forced
    on `ours` itself, so one early divergence does not decide every later position."""
    logits = hf_logits(model, prompt_tokens + ours)[len(prompt_tokens) - 1 : -1]
    return float(np.mean(logits.argmax(-1) == np.asarray(ours)))


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


def verdicts(model: GPT2LMHeadModel, prompts: list[list[int]], outputs: list[list[int]]) -> dict:
    """`checks` (greedy agreement) and `top1` of each output, for one engine."""
    pairs = list(zip(prompts, outputs, strict=True))
    return {
        "checks": [agreement(model, p, o) for p, o in pairs],
        "top1": [top1(model, p, o) for p, o in pairs],
    }


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
    server: Server, hf: GPT2LMHeadModel, peer: llama_cpp_peer.LlamaCpp | None,
    prompts_by_scenario: dict[str, list[list[int]]],
    paired_tools: Callable[[list[list[int]]], dict[str, float]] | None = None,
) -> dict:
    """One repetition of each scenario: MAX, HF, then the peer if there is one; every
    output is checked against `hf`. With `paired_tools` (`paired_peers`: llama.cpp's
    one-stream figures on the same file, tokens per second), the one-request scenario
    is also timed against them, run right after, so those ratios compare the engines
    in the same minute. The other engines run with the server paused (`Server.paused`)."""
    row: dict[str, dict] = {}
    for name, prompts in prompts_by_scenario.items():
        new = 1 if name.startswith("d_") else NEW_TOKENS
        ours = asyncio.run(run_max(server.url, prompts, new))
        with server.paused():
            paired = (paired_tools(prompts)
                      if paired_tools is not None and name == PAIRED_SCENARIO else None)
            ref = run_hf(hf, prompts, new)
            theirs = peer.greedy(prompts, new) if peer else None
        if name.startswith("d_"):
            units = len(prompts[0])  # prompt tokens processed
        else:
            units = new * len(prompts)
        max_wall = max(o["wall"] for o in ours)
        row[name] = {
            "max_tok_s": units / max_wall,
            "hf_tok_s": units / ref["wall"],
            "ttft_s": statistics.median(o["arrivals"][0] for o in ours),
            **verdicts(hf, prompts, [o["tokens"] for o in ours]),
        }
        for key, tok_s in (paired or {}).items():
            if key.startswith("no_repack:"):  # a marker (`attempt`), not a figure
                row[name][f"paired_{key}"] = True
                continue
            row[name][f"paired_{key}_tok_s"] = tok_s
            row[name][f"max_over_paired_{key}"] = row[name]["max_tok_s"] / tok_s
        if theirs:
            row[name]["peer_tok_s"] = units / theirs["wall"]
            row[name].update(
                (f"peer_{key}", value)
                for key, value in verdicts(hf, prompts, theirs["tokens"]).items()
            )
    return row


def context_ratio(server: Server, hf: GPT2LMHeadModel, repetition: int) -> dict:
    """Scenario e: decode speed at 900 tokens of context over that at 16, MAX and HF."""
    seed = 1000 * repetition + 4
    short_prompt, long_prompt = random_prompt(16, seed), random_prompt(900, seed + 1)
    short = asyncio.run(run_max(server.url, [short_prompt], NEW_TOKENS))
    long = asyncio.run(run_max(server.url, [long_prompt], 120))
    with server.paused():
        hf_ratio = hf_decode_rate(hf, long_prompt) / hf_decode_rate(hf, short_prompt)
    return {"e_decode_900_over_16": {
        "max_ratio": decode_rate(long[0]["arrivals"]) / decode_rate(short[0]["arrivals"]),
        "hf_ratio": hf_ratio,
    }}


def concurrency_sweep(url: str, levels: list[int]) -> dict[int, float]:
    """Aggregate MAX tokens/s for `n` concurrent 16-token prompts, 64 new tokens each."""
    rates = {}
    for n in levels:
        prompts = [random_prompt(16, 100_000 + 100 * n + i) for i in range(n)]
        results = asyncio.run(run_max(url, prompts, 64))
        rates[n] = 64 * n / max(r["wall"] for r in results)
    return rates


def median_table(runs: list[dict]) -> dict:
    """Per scenario, the median of each figure over the runs, and every run's checks
    (a figure some run lacks, a llama.cpp tool that crashed there, is left out)."""
    out: dict[str, dict] = {}
    for name in runs[0]:
        out[name] = {
            key: (sum((r[name][key] for r in runs), []) if isinstance(value, list)
                  else statistics.median(r[name][key] for r in runs))
            for key, value in runs[0][name].items() if all(key in r[name] for r in runs)
        }
    return out


def tally(m: dict, prefix: str = "") -> str:
    """How one engine's outputs compare with HF's: greedy verdicts, then mean top-1."""
    checks = m[f"{prefix}checks"]
    return (", ".join(f"{checks.count(c)} {c}" for c in sorted(set(checks)))
            + f", top-1 {statistics.mean(m[f'{prefix}top1']):.3f}")


def print_table(tables: dict[str, dict]) -> None:
    """One row per scenario of each table, labelled with the table's name."""
    print(f"\n{'scenario':<28}{'MAX tok/s':>12}{'HF tok/s':>12}{'MAX/HF':>9}"
          f"{'llama.cpp':>12}{'MAX/llama':>11}{'TTFT s':>9}  outputs vs HF greedy")
    for label, table in tables.items():
        for name, m in table.items():
            name = f"{label} {name}".strip()
            if "max_tok_s" not in m:
                print(f"{name:<28}{'MAX ' + format(m['max_ratio'], '.2f'):>12}"
                      f"{'HF ' + format(m['hf_ratio'], '.2f'):>12}")
                continue
            peer = (f"{m['peer_tok_s']:>12.1f}{m['max_tok_s'] / m['peer_tok_s']:>11.2f}"
                    if "peer_tok_s" in m else f"{'-':>12}{'-':>11}")
            print(f"{name:<28}{m['max_tok_s']:>12.1f}{m['hf_tok_s']:>12.1f}"
                  f"{m['max_tok_s'] / m['hf_tok_s']:>9.2f}{peer}{m['ttft_s']:>9.3f}  "
                  f"MAX: {tally(m)}"
                  + (f"; llama.cpp: {tally(m, 'peer_')}" if "peer_checks" in m else ""))


TOOL_ROWS = (
    ("a_single_16", "tg128", "llama-bench tg128"),
    ("a_single_16", "server_a_single_16", "llama-server, 1 request"),
    ("c_concurrent_8x16", "batched_tg", "llama-batched-bench 8 seq, decode"),
    ("c_concurrent_8x16", "server_c_concurrent_8x16", "llama-server --parallel 8, 8 req."),
    ("d_prefill_900", "pp900", "llama-bench pp900"),
    ("a_single_16", "tg128_no_repack", "llama-bench tg128, no repack"),
)
"""(server scenario, llama.cpp tool figure, its label), side by side."""


def attempt(label: str, run: Callable[[bool], dict[str, float]]) -> dict[str, float]:
    """`run(repack)`'s figures with llama.cpp's CPU repacking of the weights (its default),
    else without it, else none: llama.cpp 0.3.36 segfaults on Q4_K_M files (its own
    llama-quantize's too) whenever it processes more than one token at once with the
    weights repacked, on the Intel Xeon (family 6, model 167) of these machines. A figure
    taken without repacking comes with a key `no_repack:<its name>`, and the report says
    so, or which figures are missing."""
    for repack in (True, False):
        try:
            figures = run(repack)
            return figures if repack else {**figures, **{f"no_repack:{k}": 1.0 for k in figures}}
        except (subprocess.CalledProcessError, RuntimeError, OSError, httpx.HTTPError) as error:
            how = "" if repack else " without repacking"
            print(f"{label}{how} failed{'' if repack else ', its figures are left out'}: {error}")
    return {}


def llama_tools(path: Path, flash_attn: bool, repetition: int = 0) -> dict[str, float]:
    """llama.cpp's own tools on one file, tokens per second: llama-bench, batched-bench,
    and llama-server (8 slots) over HTTP on scenarios a and c's prompts; each with the
    weights repacked, or where that crashes without (`attempt`), and `llama-bench` tg128
    both ways (`tg128_no_repack`), the faster being llama.cpp's best one stream."""
    rows = attempt(f"llama-bench pp900 + tg128 on {path.name}", lambda repack:
                   llama_cpp_tools.llama_bench(path, THREADS, flash_attn=flash_attn,
                                               repack=repack))
    plain = llama_cpp_tools.llama_bench(
        path, THREADS, prompt=0, flash_attn=flash_attn, repack=False)[f"tg{NEW_TOKENS}"]
    batched = attempt(f"llama-batched-bench on {path.name}", lambda repack: {
        "batched_tg": llama_cpp_tools.batched_bench(
            path, THREADS, sequences=8, prompt=16, generate=NEW_TOKENS, flash_attn=flash_attn,
            repack=repack,
        )["tg"]})
    prompts = scenarios(quick=True, repetition=repetition)

    def served(repack: bool) -> dict[str, float]:
        with llama_server(path, repack) as url:
            return {f"server_{name}": llama_server_tok_s(url, prompts[name])
                    for name in ("a_single_16", "c_concurrent_8x16")}

    return {**rows, "tg128_no_repack": plain, **batched,
            **attempt(f"llama-server on {path.name}", served)}


def llama_server(path: Path, repack: bool = True) -> contextlib.AbstractContextManager[str]:
    """`llama-server` on `path` as every row runs it: 8 slots of 256 tokens."""
    return llama_cpp_tools.server(path, THREADS, parallel=8, ctx_per_slot=256,
                                  extra=() if repack else ("--no-repack",))


def llama_server_tok_s(url: str, prompts: list[list[int]]) -> float:
    """Tokens per second of `prompts` sent at once, `NEW_TOKENS` each, after a warm-up."""
    llama_cpp_tools.server_run(url, prompts[:1], 8)
    results = llama_cpp_tools.server_run(url, prompts, NEW_TOKENS)
    return NEW_TOKENS * len(results) / max(r["wall"] for r in results)


def paired_peers(
    path: Path | None, args: argparse.Namespace
) -> Callable[[list[list[int]]], dict[str, float]] | None:
    """llama.cpp's one-stream figures on `path`, tokens per second, as `measure` pairs
    them with the one-request scenario (`PAIRED_TOOLS`): `llama-bench` tg128, and a
    fresh `llama-server` answering the same prompt (left out where it crashes, as in
    `llama_tools`); None without `--llama-tools`."""
    if path is None or not args.llama_tools:
        return None

    def run(prompts: list[list[int]]) -> dict[str, float]:
        tg = llama_cpp_tools.llama_bench(
            path, THREADS, prompt=0, generate=NEW_TOKENS, flash_attn=args.llama_flash_attn
        )[f"tg{NEW_TOKENS}"]

        def served(repack: bool) -> dict[str, float]:
            with llama_server(path, repack) as url:
                return {"server_one": llama_server_tok_s(url, prompts)}

        return {"tg128": tg, **attempt(f"paired llama-server on {path.name}", served)}

    return run


def print_tool_rows(result: dict) -> None:
    """The server's rows beside llama.cpp's own tools on the same weights."""
    tables = {"f32": (result["median"], result["runs"], result["llama_tools"])}
    tables.update(
        (t, (g["median"], g["runs"], g["llama_tools"])) for t, g in result["gguf"].items()
    )
    print(f"\n{'file':<8}{'MAX scenario':<22}{'MAX tok/s':>11}  {'llama.cpp tool':<36}"
          f"{'tok/s':>9}{'MAX/tool':>10}{'ms/tok MAX / tool':>20}")

    def row(label: str, scenario: str, ours: float, tool: str, theirs: float) -> None:
        print(f"{label:<8}{scenario:<22}{ours:>11.1f}  {tool:<36}{theirs:>9.1f}"
              f"{ours / theirs:>10.2f}{1e3 / ours:>11.2f} / {1e3 / theirs:.2f}")

    for label, (median, runs, tools) in tables.items():
        for scenario, figure, tool in TOOL_ROWS:
            if scenario in median and figure in tools:
                how = " (no repack)" if f"no_repack:{figure}" in tools else ""
                row(label, scenario, median[scenario]["max_tok_s"], tool + how, tools[figure])
        for key, tool in PAIRED_TOOLS.items():
            if all(f"max_over_paired_{key}" in r.get(PAIRED_SCENARIO, {}) for r in runs):
                pair = median_pair(runs, key)
                how = " (no repack)" if pair.get(f"paired_no_repack:{key}") else ""
                row(label, PAIRED_SCENARIO, pair["max_tok_s"], f"{tool}, median pair{how}",
                    pair[f"paired_{key}_tok_s"])


def median_pair(runs: list[dict], key: str) -> dict:
    """`PAIRED_SCENARIO` of the run whose ratio to `key`'s tool is the median (of an
    even count, the lower middle one), so its two figures divide to the ratio shown."""
    pairs = sorted((r[PAIRED_SCENARIO] for r in runs), key=lambda m: m[f"max_over_paired_{key}"])
    return pairs[(len(pairs) - 1) // 2]


def print_report(result: dict) -> None:
    gguf = result["gguf"]
    print(f"CPU: {result['cpu_model']}, {result['threads']} threads per engine")
    print_table({"": result["median"], **{t: g["median"] for t, g in gguf.items()}})
    for t, g in gguf.items():
        for line in g.get("kernels", []):
            print(f"{t}: {line}")
    if result.get("llama_tools"):
        print_tool_rows(result)
    print("\ntop-1: fraction of generated tokens that are HF's argmax after the same prefix, "
          "teacher-forced on the engine's own tokens.")
    if gguf:
        print("GGUF rows: HF is float32 on the file's weights dequantized by `gguf`. For "
              "block-quantized types exact agreement is not expected: MAX's qmatmul quantizes "
              "activations to 8 bits per block, llama.cpp its own way, so greedy paths part "
              "from HF's (MISMATCH); compare the engines' top-1 on the same file.")
    check = result["llama_cpp_logit_check"]
    if check:
        print(f"llama.cpp vs HF logits, F32 file, teacher-forced on a {check['tokens']}-token "
              "prompt: max |delta| at position " + ", ".join(
                  f"{p}: {d:.3f}" for p, d in check["max_abs_diff_at"].items())
              + f"; median over positions {check['median_max_abs_diff']:.3f} "
              f"(HF logit std {check['reference_logit_std']:.2f}); argmax agreement "
              f"{check['argmax_agreement']:.3f}. Its GELU reads a float16 table; that error, "
              "not the comparison, is what its MISMATCH outputs show.")
    startup = result["startup"]
    print(f"\nserver start: cold {startup['cold_s']:.1f} s, warm {startup['warm_s']:.1f} s; "
          f"peak RSS of the server tree {startup['peak_rss_gb']:.2f} GB")
    print("concurrency sweep (16-token prompts, 64 new tokens): " + ", ".join(
        f"{n}: {rate:.0f} tok/s" for n, rate in result["concurrency_sweep"].items()))
    rss = result["rss_by_max_batch_size"]
    if rss:
        print("peak RSS of the server tree at full load, by --max-batch-size: " + ", ".join(
            f"{n}: {gb:.2f} GB" for n, gb in rss.items()))
    if gguf:
        peaks = {"float32": rss.get(GGUF_RSS_BATCH_SIZE)}
        peaks.update((t, g["peak_rss_gb"]) for t, g in gguf.items())
        print(f"peak RSS of the server tree at full load, --max-batch-size "
              f"{GGUF_RSS_BATCH_SIZE}, by weights: " + ", ".join(
                  f"{name}: {gb:.2f} GB" for name, gb in peaks.items() if gb is not None))


def rss_by_batch_size(weights: Path, sizes: list[int], devices: str, scratch: Path) -> dict:
    """Peak server-tree RSS with `--max-batch-size n` while n requests decode at once."""
    peaks = {}
    for n in sizes:
        with serve(weights, "--max-batch-size", str(n), devices=devices,
                   log=scratch / f"server-{weights.stem}-rss-{n}.log") as server:
            rss = PeakRss(server.pid)
            prompts = [random_prompt(16, 200_000 + 100 * n + i) for i in range(n)]
            asyncio.run(run_max(server.url, prompts, 64))
            peaks[n] = rss.stop() / 1e9
    return peaks


def gguf_file(checkpoint: Path, file_type: str) -> Path:
    """The checkpoint's weights as a GGUF of `file_type`, written once into a servable
    folder beside it, with the `config.json` and tokenizer files written from its metadata."""
    path = checkpoint.with_name(f"{checkpoint.name}-gguf") / gguf_file_name(file_type)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(".partial")  # an interrupted write is not cached
        convert_to_gguf(checkpoint, partial, file_type)
        write_companion_files(partial)
        partial.rename(path)
    return path


def llama_cpp(
    args: argparse.Namespace, checkpoint: Path, file_type: str
) -> AbstractContextManager[llama_cpp_peer.LlamaCpp | None]:
    """The llama.cpp peer on the checkpoint's GGUF of `file_type`, sized for the
    scenarios, or nothing when not asked for."""
    if not args.peer:
        return nullcontext()
    return llama_cpp_peer.LlamaCpp(
        gguf_file(checkpoint, file_type), threads=THREADS, n_ctx=2048, max_seqs=8,
        flash_attn=args.llama_flash_attn,
    )


def llama_cpp_logit_check(hf: GPT2LMHeadModel, peer: llama_cpp_peer.LlamaCpp) -> dict:
    """llama.cpp's logits on the F32 file against HF's, teacher-forced on one long prompt."""
    prompt = random_prompt(LOGIT_CHECK_POSITIONS[-1] + 1, seed=7)
    return llama_cpp_peer.logit_gap(peer, prompt, hf_logits(hf, prompt), LOGIT_CHECK_POSITIONS)


def measure_gguf(
    checkpoint: Path, file_type: str, hf: GPT2LMHeadModel, args: argparse.Namespace,
    scratch: Path,
) -> dict:
    """Scenarios a and c served from the checkpoint's GGUF of `file_type`, beside HF on its
    dequantized weights and llama.cpp on the file itself, then the server's RSS at the
    batch size of c."""
    path = gguf_file(checkpoint, file_type)
    reference = hf_on_gguf_weights(hf, path)
    log = scratch / f"server-{path.stem}.log"
    with (
        llama_cpp(args, checkpoint, file_type) as peer,
        serve(path, *SERVE_ARGS, devices=args.devices, log=log) as server,
    ):
        warm_up(server.url)
        runs = [
            measure(server, reference, peer, {
                name: prompts for name, prompts in scenarios(args.quick, repetition).items()
                if name in GGUF_SCENARIOS
            }, paired_peers(path, args))
            for repetition in range(args.repeat)
        ]
    rss = rss_by_batch_size(path, [GGUF_RSS_BATCH_SIZE], args.devices, scratch)
    return {
        "file": path.name, "median": median_table(runs), "runs": runs,
        "kernels": kernel_lines(log), "peak_rss_gb": rss[GGUF_RSS_BATCH_SIZE],
        "llama_tools": llama_tools(path, args.llama_flash_attn) if args.llama_tools else None,
    }


def kernel_lines(log: Path) -> list[str]:
    """The kernel the server gave each packed block type and why, as its log says
    (`layers/kernel_choice.py`: for the requests' weights, and for those multiplying
    a few rows a step), and the layout of float16 block weights
    (`layers/lines_choice.py`), once each."""
    lines = log.read_text(errors="replace").splitlines() if log.exists() else []
    found = (line.split("Packed ", 1)[-1].split(f"{PACKAGE}: ", 1)[-1] for line in lines
             if " weights" in line and ("'s kernel (" in line or "float16 weights" in line))
    return list(dict.fromkeys(found))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="gpt2")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--devices", default="cpu")
    parser.add_argument("--quick", action="store_true", help="shorter long prompt")
    parser.add_argument("--sweep", default="1,2,4,8,16,32")
    parser.add_argument("--peer", choices=["llama.cpp"], help="also run this engine")
    parser.add_argument("--rss-batch-sizes", default="1,8,32")
    parser.add_argument(
        "--llama-flash-attn", action="store_true",
        help="llama.cpp with its default flash attention: faster long prefills, less exact",
    )
    parser.add_argument(
        "--llama-tools", action="store_true",
        help="also run llama.cpp's llama-bench and llama-batched-bench on the same files "
        "(built once by build_llama_cpp.sh)",
    )
    parser.add_argument(
        "--serve-env", action="append", default=[], metavar="KEY=VALUE",
        help="add to every server's environment (repeatable), e.g. README's recommended "
        "MAX_SERVE_METRIC_RECORDING_METHOD=NOOP",
    )
    parser.add_argument(
        "--gguf-types", default="q4_k,q6_k,f16",
        help="GGUF types to serve scenarios a and c from ('' for none)",
    )
    args = parser.parse_args()
    SERVE_ENV.update(item.split("=", 1) for item in args.serve_env)
    if args.peer and not llama_cpp_peer.available():
        parser.error('--peer llama.cpp needs llama-cpp-python: pip install -e ".[bench]"')
    gguf_types = [t for t in args.gguf_types.split(",") if t]
    if unknown := sorted(set(gguf_types) - set(FILE_TYPES)):
        parser.error(f"unknown --gguf-types {unknown}; known: {sorted(FILE_TYPES)}")

    torch.set_num_threads(THREADS)
    RESULTS.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="gpt2-max-bench-"))
    checkpoint = CHECKPOINTS / f"checkpoint-{args.preset}"
    if not (checkpoint / "model.safetensors").exists():
        write_checkpoint(checkpoint, preset_config(args.preset), std=0.2)
    hf = GPT2LMHeadModel.from_pretrained(checkpoint).eval()

    startup: dict[str, float] = {}
    # Empty, so the first start compiles from nothing; the second start reuses what the
    # first compiled there, so it is warm even when the user's cache holds no graph of
    # this code yet (after a kernel change).
    start_cache = scratch / "start-cache"
    for label in ("cold_s", "warm_s"):
        start = time.perf_counter()
        with serve(checkpoint, *SERVE_ARGS, log=scratch / f"server-{label}.log",
                   devices=args.devices, env={"XDG_CACHE_HOME": str(start_cache)}):
            startup[label] = time.perf_counter() - start
    shutil.rmtree(start_cache, ignore_errors=True)
    f32_gguf = gguf_file(checkpoint, "f32") if args.llama_tools else None
    with (
        llama_cpp(args, checkpoint, "f32") as peer,
        serve(checkpoint, *SERVE_ARGS, log=scratch / "server.log",
              devices=args.devices) as server,
    ):
        warm_up(server.url)
        rss = PeakRss(server.pid)
        runs = [
            {**measure(server, hf, peer, scenarios(args.quick, repetition),
                       paired_peers(f32_gguf, args)),
             **context_ratio(server, hf, repetition)}
            for repetition in range(args.repeat)
        ]
        sweep = concurrency_sweep(server.url, [int(n) for n in args.sweep.split(",")])
        startup["peak_rss_gb"] = rss.stop() / 1e9
        logit_check = llama_cpp_logit_check(hf, peer) if peer else None
    sizes = [int(n) for n in args.rss_batch_sizes.split(",") if n]
    result = {
        "preset": args.preset, "devices": args.devices, "repeat": args.repeat,
        "cpus": os.cpu_count(), "median": median_table(runs),
        "runs": runs, "startup": startup, "concurrency_sweep": sweep,
        "cpu_model": cpu_model(),
        "peer": args.peer, "llama_flash_attn": args.llama_flash_attn, "threads": THREADS,
        "rss_by_max_batch_size": rss_by_batch_size(checkpoint, sizes, args.devices, scratch),
        "llama_cpp_logit_check": logit_check,
        "llama_tools": (
            llama_tools(f32_gguf, args.llama_flash_attn) if f32_gguf else None
        ),
        "gguf": {t: measure_gguf(checkpoint, t, hf, args, scratch) for t in gguf_types},
        "load_avg": os.getloadavg(),
    }
    print_report(result)
    save_result(f"bench-{args.preset}", result, scratch)


def save_result(stem: str, result: dict, scratch: Path) -> None:
    """`result` as JSON in `RESULTS`, named by `stem` and the time; says where the logs are."""
    out = RESULTS / f"{stem}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps(result, indent=2))
    print(f"\nwrote {out}; server logs in {scratch}")


if __name__ == "__main__":
    main()
