"""Serving under continuous arrivals: MAX's own benchmark client (`max benchmark`)
against `max serve` of this package and llama.cpp's `llama-server`, on the same GGUF
file, the same cores and the same seeded workload, at each concurrency.

    PYTHONPATH=. python benchmarks/bench_load.py     # nothing else running
    PYTHONPATH=. python benchmarks/bench_load.py --types f32 --concurrency 8
    PYTHONPATH=. python benchmarks/bench_load.py --types f32 --concurrency 1,8 \
        --variant burst-100ms:GPT2_MAX_BURST_MS=100 \
        --variant in-flight:--enable-in-flight-batching

The client keeps `--concurrency` requests in flight (random prompts of
`--input-len` tokens, `--output-len` generated, `--seed`ed), so requests start
while others decode and batches mix prefill and decode, as production traffic
does. It runs on the same cores as the server, for both servers alike. Each
server runs as README recommends for the CPU: `max serve` with metric recording
off and a KV cache bounded to the tokens in flight, `llama-server` with a slot per
request in flight and every core. Reported per server and concurrency: total
output throughput, mean TTFT and TPOT, mean and p50 inter-token latency (the
gaps a streaming client sees), failed requests; and the ratios against
llama-server. The figures also go to `results/` as JSON.

Each `--variant LABEL:ITEM,ITEM...` is one more `max serve` of the package on the
same file and workload, README's settings plus its items (an environment setting
`KEY=VALUE` or a flag `--flag`), with a row and a ratio of its own beside the one
llama-server run: so each setting can be measured alone in one run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import tempfile
import time
from pathlib import Path

import llama_cpp_tools
from bench_serve import CHECKPOINTS, RESULTS, THREADS, gguf_file
from bench_start import cpu_model

from gpt2_max.testing.server import MODEL_NAME, child_env, max_serve
from gpt2_max.tools.checkpoint import preset_config, write_checkpoint

SERVE_ENV = {"MAX_SERVE_METRIC_RECORDING_METHOD": "NOOP"}
"""README's recommendation for serving on the CPU: no per-step metric recording."""
FIGURES = {
    "output_tok_s": "output tok/s",
    "mean_ttft_ms": "TTFT mean ms",
    "mean_tpot_ms": "TPOT mean ms",
    "mean_itl_ms": "ITL mean ms",
    "median_itl_ms": "ITL p50 ms",
    "failed": "failed",
}
"""The table's figures (`figures`), and their labels."""
KV_PAGE = 128
"""MAX's KV page size (tokens): a request holds whole pages, so a cache bounded to
the tokens in flight without rounding makes MAX preempt requests, recomputing them."""


def client(url: str, tokenizer: Path, concurrency: int, args: argparse.Namespace,
           out: Path) -> dict[str, float]:
    """One `max benchmark` run against `url`; its result file's figures."""
    host, port = url.removeprefix("http://").split(":")
    command = [
        "max", "benchmark", "--backend", "vllm", "--host", host, "--port", port,
        "--model", MODEL_NAME, "--tokenizer", str(tokenizer),
        "--dataset-name", "random", "--random-input-len", str(args.input_len),
        "--random-output-len", str(args.output_len),
        "--num-prompts", str(max(args.min_prompts, args.prompts_per_slot * concurrency)),
        "--max-concurrency", str(concurrency), "--seed", str(args.seed),
        "--skip-test-prompt", "--result-filename", str(out),
    ]
    # In the scratch folder: the client writes a folder of its own where it runs.
    subprocess.run(command, check=True, capture_output=True, env=child_env(), cwd=out.parent)
    return figures(json.loads(out.read_text()))


def figures(result: dict) -> dict[str, float]:
    """The table's figures from `max benchmark`'s result file: its latency means and
    medians as they are, the output rate over the requests it counts (it leaves the
    first and last of a run out, outside the steady state) and their duration."""
    shown = {key: float(result[key]) for key in FIGURES if key in result}
    shown["output_tok_s"] = result["total_output_tokens"] / result["duration"]
    shown["failed"] = float(result["failures"])
    return shown


def request_tokens(args: argparse.Namespace) -> int:
    """The KV cache one request holds: its prompt, its answer and the token after, in
    whole pages of `KV_PAGE`."""
    return math.ceil((args.input_len + args.output_len + 1) / KV_PAGE) * KV_PAGE


def variant(spec: str) -> tuple[str, dict[str, str], list[str]]:
    """`LABEL:ITEM,ITEM...` -> (label, environment, flags): an item with `=` and no
    leading `--` is a setting, any other a flag."""
    label, _, items = spec.partition(":")
    parts = [item for item in items.split(",") if item]
    env = dict(item.split("=", 1) for item in parts if "=" in item and not item.startswith("--"))
    return label, env, [item for item in parts if item.startswith("--")]


def run_max(gguf: Path, tokenizer: Path, args: argparse.Namespace, scratch: Path,
            label: str, env: dict[str, str], extra: list[str]) -> dict:
    top = max(args.concurrency)
    flags = ("--weight-path", str(gguf), "--max-batch-size", str(top),
             "--max-batch-total-tokens", str(top * request_tokens(args)), *extra)
    name = f"{label}-{gguf.stem}"
    with max_serve(gguf.parent, *flags, log=scratch / f"{name}.log",
                   env={**SERVE_ENV, **env}) as server:
        return {c: client(server.url, tokenizer, c, args, scratch / f"{name}-{c}.json")
                for c in args.concurrency}


def run_llama(gguf: Path, tokenizer: Path, args: argparse.Namespace, scratch: Path) -> dict:
    top = max(args.concurrency)
    with llama_cpp_tools.server(gguf, THREADS, parallel=top,
                                ctx_per_slot=request_tokens(args)) as url:
        return {c: client(url, tokenizer, c, args, scratch / f"llama-{gguf.stem}-{c}.json")
                for c in args.concurrency}


def table(results: dict, args: argparse.Namespace, cpu: str) -> str:
    lines = [f"CPU: {cpu}; max benchmark, random {args.input_len} in / {args.output_len} "
             f"out, seed {args.seed}; client on the same cores", "",
             "| file | concurrency | server | " + " | ".join(FIGURES.values()) + " |",
             "| --- | ---: | --- |" + " ---: |" * len(FIGURES)]
    for file_type, servers in results.items():
        for c in args.concurrency:
            for name, runs in servers.items():
                cells = [f"{runs[c][k]:,.1f}" for k in FIGURES]
                lines.append(f"| {file_type} | {c} | {name} | " + " | ".join(cells) + " |")
            theirs = servers["llama-server"][c]
            for name, runs in servers.items():
                if name == "llama-server":
                    continue
                ours = runs[c]
                ratio = [f"{ours[k] / theirs[k]:.2f}x" if theirs[k] else "-" for k in FIGURES]
                label = "ratio" if len(servers) == 2 else f"{name} / llama-server"
                lines.append(f"| {file_type} | {c} | {label} | " + " | ".join(ratio) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="gpt2")
    parser.add_argument("--types", default="f32,q4_k_m")
    parser.add_argument("--concurrency", default="1,8,32",
                        type=lambda s: [int(c) for c in s.split(",")])
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--prompts-per-slot", type=int, default=4)
    parser.add_argument("--min-prompts", type=int, default=16)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--serve-env", action="append", default=[], metavar="KEY=VALUE",
                        help="add to max serve's environment (repeatable)")
    parser.add_argument("--serve-arg", action="append", default=[], metavar="FLAG",
                        help="add to max serve's flags (repeatable), e.g. "
                        "--serve-arg=--enable-in-flight-batching")
    parser.add_argument("--variant", action="append", default=[], metavar="LABEL:ITEMS",
                        help="one more max serve: README's settings plus ITEMS (comma-"
                        "separated KEY=VALUE settings and --flags), labelled (repeatable)")
    args = parser.parse_args()
    variants = [("gpt2-max", dict(e.split("=", 1) for e in args.serve_env), args.serve_arg)]
    variants += [variant(spec) for spec in args.variant]
    checkpoint = CHECKPOINTS / f"checkpoint-{args.preset}"
    if not (checkpoint / "model.safetensors").exists():
        write_checkpoint(checkpoint, preset_config(args.preset), std=0.2)
    scratch = Path(tempfile.mkdtemp(prefix="gpt2-max-load-"))
    results = {}
    for file_type in args.types.split(","):
        gguf = gguf_file(checkpoint, file_type)
        results[file_type] = {
            label: run_max(gguf, checkpoint, args, scratch, label, env, extra)
            for label, env, extra in variants
        }
        results[file_type]["llama-server"] = run_llama(gguf, checkpoint, args, scratch)
        print(table({file_type: results[file_type]}, args, cpu_model()), flush=True)
    report = table(results, args, cpu_model())
    print(report)
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"load-{args.preset}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps({"cpu": cpu_model(), "args": vars(args), "results": results}))
    print(f"(wrote {out}; server logs and client results in {scratch})")


if __name__ == "__main__":
    os.environ.setdefault("MODULAR_TELEMETRY_ENABLED", "0")
    main()
