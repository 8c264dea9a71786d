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

With `--account`, each `max serve` of the package runs with `worker_probe.py` armed,
and each concurrency's run also prints where the model worker's time went under the
load (`account`): the shares of the wall time in decode batches and in prefill
batches (mixed ones with them), their rows and tokens, the tokens a decode batch's
row got from one pass (the decode bursts' length), MAX's loop around the steps, the
worker's idle time, and the CPU the worker, the API process and the client took of
the cores.

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
from typing import Any

import llama_cpp_tools
import psutil
import worker_probe
from bench_serve import CHECKPOINTS, RESULTS, THREADS, gguf_file
from bench_start import cpu_model

from gpt2_max.testing.server import MODEL_NAME, child_env, max_serve
from gpt2_max.tools.checkpoint import preset_config, write_checkpoint

SERVE_ENV = {"MAX_SERVE_METRIC_RECORDING_METHOD": "NOOP", "GPT2_MAX_BURST_MS": "100"}
"""README's recommendation for serving on the CPU: no per-step metric recording, decode
bursts of at most 100 ms."""
FIGURES = {
    "output_tok_s": "output tok/s",
    "mean_ttft_ms": "TTFT mean ms",
    "mean_tpot_ms": "TPOT mean ms",
    "mean_itl_ms": "ITL mean ms",
    "median_itl_ms": "ITL p50 ms",
    "failed": "failed",
}
"""The table's figures (`figures`), and their labels."""
PREFILL_TOKENS = 512
"""README's prefill batch budget on the CPU (`--max-batch-input-tokens`): prompts that
wait together get their first tokens a batch of this size apart, not all after one."""
KV_PAGE = 128
"""MAX's KV page size (tokens): a request holds whole pages, so a cache bounded to
the tokens in flight without rounding makes MAX preempt requests, recomputing them."""


def client(url: str, tokenizer: Path, concurrency: int, args: argparse.Namespace,
           out: Path, server: Any = None, probe: Path | None = None) -> dict[str, float]:
    """One `max benchmark` run against `url`; its result file's figures, with the
    model worker's account of the run (`account`) and the cores each process kept
    busy meanwhile when `probe` is given."""
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
    first = worker_probe.request_totals(probe) if probe else None
    # In the scratch folder: the client writes a folder of its own where it runs.
    log = out.with_suffix(".log")
    with log.open("wb") as output, subprocess.Popen(
        command, stdout=output, stderr=subprocess.STDOUT, env=child_env(), cwd=out.parent
    ) as process:
        watched = {"client": psutil.Process(process.pid)}
        if server is not None:
            root = psutil.Process(server.pid)
            workers = root.children(recursive=True)
            watched |= {"API process": root, **{f"child {p.pid}": p for p in workers}}
        samples = []
        while process.poll() is None:
            samples.append(cpu_sample(watched))
            time.sleep(0.2)
    if process.returncode:
        raise RuntimeError(f"max benchmark failed ({process.returncode}); its output: {log}")
    shown = figures(json.loads(out.read_text()))
    if first is None:
        return shown
    last = worker_probe.request_totals(probe)
    # From the first step the client's requests caused to the last: the client's own
    # start (its tokenizer, its prompts) is not the server's idle time.
    start, end = last[worker_probe.WINDOW]
    busy = cores_busy(samples, start, end)
    worker = max((name for name in busy if name.startswith("child")), key=busy.get)
    return {**shown, **account(first, last, end - start), "worker CPU": busy[worker],
            "API process CPU": busy["API process"], "client CPU": busy["client"]}


def cpu_sample(processes: dict[str, psutil.Process]) -> tuple[float, dict[str, float]]:
    """The time and each process's CPU seconds so far (a process gone counts nothing)."""
    seconds = {}
    for name, process in processes.items():
        try:
            seconds[name] = sum(process.cpu_times()[:2])
        except psutil.Error:
            continue
    return time.time(), seconds


def cores_busy(samples: list[tuple[float, dict[str, float]]], start: float,
               end: float) -> dict[str, float]:
    """Each process's CPU seconds over wall seconds between the samples nearest `start`
    and `end`."""
    first = min(samples, key=lambda s: abs(s[0] - start))
    last = min(samples, key=lambda s: abs(s[0] - end))
    wall = last[0] - first[0]
    return {name: (last[1][name] - first[1].get(name, 0.0)) / wall
            for name in last[1] if wall > 0}


def account(first: dict[str, list[float]], last: dict[str, list[float]],
            wall: float) -> dict[str, float]:
    """Where the model worker's time went between two `worker_probe` reads, whose
    steps spanned `wall` seconds: shares of the wall time (the scheduler's iterations, decode and
    prefill batches, the model graph, prepare_batch and the sampler inside them, MAX's
    loop beside them, idle), the batches' count, rows and tokens, and the tokens a
    decode batch's row got from one pass."""
    took = {name: [b - a for a, b in zip(first[name], last[name], strict=True)]
            for name in first if name != worker_probe.WINDOW}
    decode, prefill = (took[name] for name in worker_probe.BATCHES)
    iteration, execute = took["scheduler iteration"][0], took["pipeline.execute"][0]
    inside = sum(took[name][0] for name in worker_probe.PIPELINE_PARTS)
    return {
        "decode share": decode[0] / wall,
        "prefill share": prefill[0] / wall,
        "model graph share": took["model graph"][0] / wall,
        "prepare+sampler share": (inside - took["model graph"][0]) / wall,
        "pipeline other share": (execute - inside) / wall,
        "loop share": (iteration - execute) / wall,
        "idle share": 1 - iteration / wall,
        "decode batches": decode[1],
        "decode rows": decode[2] / max(decode[1], 1),
        "decode ms": decode[0] / max(decode[1], 1) * 1e3,
        "burst tokens": decode[4] / max(decode[2], 1),
        "prefill batches": prefill[1],
        "prefill rows": prefill[2] / max(prefill[1], 1),
        "prefill tokens in": prefill[3] / max(prefill[1], 1),
        "prefill ms": prefill[0] / max(prefill[1], 1) * 1e3,
    }


ACCOUNT = (
    ("decode share", "decode batches' share of the wall time", "{:.0%}"),
    ("prefill share", "prefill (and mixed) batches' share", "{:.0%}"),
    ("model graph share", "  the model graph's share (bursts' steps in it)", "{:.0%}"),
    ("prepare+sampler share", "  prepare_batch and MAX's sampler", "{:.0%}"),
    ("pipeline other share", "  the rest of pipeline.execute", "{:.0%}"),
    ("loop share", "MAX's scheduler around the steps", "{:.0%}"),
    ("idle share", "the worker idle (no iteration running)", "{:.0%}"),
    ("decode batches", "decode batches", "{:,.0f}"),
    ("decode rows", "  rows a batch (mean)", "{:.1f}"),
    ("decode ms", "  ms a batch (mean)", "{:.1f}"),
    ("burst tokens", "  tokens a row got from one pass (mean)", "{:.2f}"),
    ("prefill batches", "prefill batches", "{:,.0f}"),
    ("prefill rows", "  rows a batch (mean)", "{:.1f}"),
    ("prefill tokens in", "  tokens in a batch (mean)", "{:.0f}"),
    ("prefill ms", "  ms a batch (mean)", "{:.1f}"),
    ("worker CPU", "cores the model worker kept busy", "{:.2f}"),
    ("API process CPU", "cores the API process kept busy", "{:.2f}"),
    ("client CPU", "cores the client kept busy", "{:.2f}"),
)
"""The account's rows (`account` and the CPU `client` adds): key, label, format."""


def account_table(results: dict, args: argparse.Namespace) -> str:
    """The accounts of every probed server, a column per concurrency."""
    lines = []
    for file_type, servers in results.items():
        for name, runs in servers.items():
            if "decode share" not in runs[args.concurrency[0]]:
                continue  # llama-server, or a run without --account
            lines += ["", f"Where {name}'s model worker spent a run ({file_type}):", "",
                      "| | " + " | ".join(f"concurrency {c}" for c in args.concurrency) + " |",
                      "| --- |" + " ---: |" * len(args.concurrency)]
            for key, label, form in ACCOUNT:
                cells = [form.format(runs[c][key]) for c in args.concurrency]
                lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


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
             "--max-batch-total-tokens", str(top * request_tokens(args)),
             "--max-batch-input-tokens", str(PREFILL_TOKENS), *extra)
    name = f"{label}-{gguf.stem}"
    env = {**SERVE_ENV, **env}
    probe = None
    if args.account:
        probe = scratch / f"{name}-probe"
        probe.mkdir()
        env = worker_probe.server_env(probe, env)
    with max_serve(gguf.parent, *flags, log=scratch / f"{name}.log", env=env) as server:
        return {c: client(server.url, tokenizer, c, args, scratch / f"{name}-{c}.json",
                          server, probe)
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
    parser.add_argument("--account", action="store_true",
                        help="arm worker_probe.py in each max serve and print where the "
                        "model worker's time went at each concurrency")
    args = parser.parse_args()
    if args.account and (missing := worker_probe.missing_parts()):
        parser.error(f"this MAX lacks what worker_probe times: {', '.join(missing)}")
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
    report = table(results, args, cpu_model()) + account_table(results, args)
    print(report)
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"load-{args.preset}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps({"cpu": cpu_model(), "args": vars(args), "results": results}))
    print(f"(wrote {out}; server logs and client results in {scratch})")


if __name__ == "__main__":
    os.environ.setdefault("MODULAR_TELEMETRY_ENABLED", "0")
    main()
