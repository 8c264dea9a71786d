"""Where a `max serve` start spends its time, for gpt2_max and for MAX's own floor.

    python benchmarks/bench_start.py                     # every subject, cold then warm
    python benchmarks/bench_start.py --subjects tiny --modes warm --cache DIR

Each subject is started cold (an empty MAX cache in a temporary `MODULAR_CACHE_DIR`,
so every graph compiles from nothing) and then warm (the same cache, now filled),
and answers one completion. With `--cache DIR` every start uses `DIR` instead (one
folder per subject inside it, kept): warm starts alone, without paying a cold one
first, once an earlier run has filled it with the same code's graphs.

The wall time from launch to that first completion is
split into phases by the timestamps of the server's own log lines:

  api          launch until MAX starts the model worker (the API process: imports,
               architecture lookup, config)
  worker       the model worker's "Python imports + driver init"
  pipeline     worker ready until the model's graph build starts (weights, config)
  build        building the model's graph
  compile      compiling it (a warm start loads it from MAX's cache)
  after        compile done until MAX starts on its sampler (KV cache, weight setup)
  sampler      building and compiling MAX's sampler graph
  ready        sampler done until the model worker reports ready
  first        ready until the first completion arrived

Subjects (random weights, written once into the user's cache folder):

  tiny    the test suite's fixture GPT-2 (`gpt2_max.testing.reference.TINY`)
  gpt2    the gpt2-small shape (`--preset gpt2`)
  llama   MAX's floor: MAX's built-in Llama architecture on a small LlamaForCausalLM
          (4 layers, 256 wide) written offline by transformers, with the vendored
          GPT-2 tokenizer; no plugin code runs, so the difference to it is the
          plugin's own share.

Run it with nothing else running on the machine: the phases are wall times. The table names
the CPU; JSON and the server logs go to `benchmarks/results/`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from datetime import datetime, timedelta
from pathlib import Path

import httpx

from gpt2_max.testing.reference import write_tiny_checkpoint
from gpt2_max.testing.server import MODEL_NAME, child_env, max_serve
from gpt2_max.tokenizer import copy_tokenizer
from gpt2_max.tools.checkpoint import preset_config, write_checkpoint

RESULTS = Path(__file__).parent / "results"
CHECKPOINTS = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "gpt2-max"
SUBJECTS = ("tiny", "gpt2", "llama")
PHASES = ("api", "worker", "pipeline", "build", "compile", "after", "sampler", "ready", "first")

# The log line that ends each phase (the model's name in MAX's messages varies).
MARKS = {
    "api": r"Starting subprocess: Model Worker",
    "worker": r"Worker process startup took",
    "pipeline": r"Building, compiling, and initializing (?!sampler)\w+\.\.\.",
    "build": r"Building (?!sampler)\w+ graph took",
    "compile": r"Compiling (?!sampler)\w+ took",
    "after": r"Building, compiling, and initializing sampler\.\.\.",
    "sampler": r"Building, compiling, and initializing sampler took",
    "ready": r"Model worker ready",
}
STAMP = re.compile(r"^(\d\d):(\d\d):(\d\d)\.(\d{3}) ")


def cpu_model() -> str:
    """lscpu's model name, with family and model (a cloud CPU may be named "AMD EPYC" only)."""
    fields = {}
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, env=child_env())
    for line in lscpu.stdout.splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    name = fields.get("Model name", "unknown CPU")
    return f"{name} (family {fields.get('CPU family', '?')}, model {fields.get('Model', '?')})"


def checkpoint(subject: str) -> tuple[Path, tuple[str, ...]]:
    """The subject's checkpoint folder (written on first use) and its extra serve flags."""
    folder = CHECKPOINTS / f"start-{subject}"
    plugin = ("--custom-architectures", "gpt2_max")
    if not (folder / "config.json").exists():
        folder.mkdir(parents=True, exist_ok=True)
        if subject == "tiny":
            write_tiny_checkpoint(folder)
        elif subject == "gpt2":
            write_checkpoint(folder, preset_config("gpt2"))
        else:
            write_llama(folder)
    return folder, (() if subject == "llama" else plugin)


def write_llama(folder: Path) -> None:
    """A random small Llama in transformers' own layout: what MAX's Llama reads."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=50257, hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=1024,
        bos_token_id=50256, eos_token_id=50256, tie_word_embeddings=False,
        torch_dtype="float32",
    )
    LlamaForCausalLM(config).save_pretrained(folder)
    copy_tokenizer(folder)


def phases(log: Path, launched: float, answered: float) -> dict[str, float]:
    """Seconds per phase, from the first log line matching each phase's end mark."""
    day = datetime.fromtimestamp(launched).replace(hour=0, minute=0, second=0, microsecond=0)
    ends: dict[str, float] = {}
    for line in log.read_text(errors="replace").splitlines():
        stamp = STAMP.match(line)
        if not stamp:
            continue
        for phase, mark in MARKS.items():
            if phase not in ends and re.search(mark, line):
                h, m, s, ms = map(int, stamp.groups())
                at = day + timedelta(hours=h, minutes=m, seconds=s, milliseconds=ms)
                if at.timestamp() < launched - 1:  # the log crossed midnight
                    at += timedelta(days=1)
                ends[phase] = at.timestamp()
    ends["first"] = answered
    missing = [p for p in PHASES if p not in ends]
    if missing:
        raise RuntimeError(f"{log} lacks the log lines that end {missing}")
    result, previous = {}, launched
    for phase in PHASES:
        result[phase] = ends[phase] - previous
        previous = ends[phase]
    result["total"] = answered - launched
    return result


def start_once(subject: str, cache: Path, log: Path) -> dict[str, float]:
    folder, flags = checkpoint(subject)
    launched = time.time()
    with max_serve(folder, *flags, log=log, env={"MODULAR_CACHE_DIR": str(cache)}) as server:
        reply = httpx.post(
            f"{server.url}/v1/completions",
            json={"model": MODEL_NAME, "prompt": "Hello, my name is", "max_tokens": 4},
            timeout=600,
        )
        answered = time.time()
        reply.raise_for_status()
    return phases(log, launched, answered)


def table(rows: list[dict], cpu: str) -> str:
    head = ["subject", "start", *PHASES, "total"]
    lines = [
        f"start profile, seconds ({cpu}, {os.cpu_count()} cores)",
        "| " + " | ".join(head) + " |",
        "| " + " | ".join(["---"] * 2 + ["---:"] * (len(head) - 2)) + " |",
    ]
    for row in rows:
        cells = [row["subject"], row["mode"], *(f"{row[p]:.1f}" for p in [*PHASES, "total"])]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--subjects", default=",".join(SUBJECTS))
    parser.add_argument("--modes", default="cold,warm", help="cold, warm or both, in that order")
    parser.add_argument("--label", default="", help="a name for this run in the JSON file")
    parser.add_argument(
        "--cache", type=Path, help="keep MAX's caches in this folder (default: a temporary one)"
    )
    args = parser.parse_args()
    cpu = cpu_model()
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-start-") as scratch:
        for subject in args.subjects.split(","):
            cache = (args.cache or Path(scratch)) / f"cache-{subject}"
            for mode in args.modes.split(","):
                log = Path(scratch) / f"{subject}-{mode}.log"
                try:
                    row = {"subject": subject, "mode": mode, **start_once(subject, cache, log)}
                except Exception:
                    print(log.read_text(errors="replace")[-3000:] if log.exists() else "no log")
                    raise
                rows.append(row)
                print(table([row], cpu).splitlines()[-1], flush=True)
        RESULTS.mkdir(exist_ok=True)
        logs = RESULTS / f"start-logs-{time.strftime('%Y%m%d-%H%M%S')}"
        shutil.copytree(scratch, logs, ignore=shutil.ignore_patterns("cache-*"))
    print()
    print(table(rows, cpu))
    label = f"-{args.label}" if args.label else ""
    out = RESULTS / f"start-{time.strftime('%Y%m%d-%H%M%S')}{label}.json"
    out.write_text(json.dumps({"cpu": cpu, "label": args.label, "rows": rows}, indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
