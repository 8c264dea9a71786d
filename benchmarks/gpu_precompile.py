"""The graphs the next GPU run builds, compiled on any machine for the card's architecture,
packed for the device tool.

    PYTHONPATH=$PWD python3 benchmarks/gpu_precompile.py OUT.tar.xz [--only NAME,...]

A first start on the card spends about three minutes compiling each graph, and a lent
card has fifteen minutes in all. MAX compiles for a GPU it does not have through
virtual devices (`max warm-cache --target cuda:sm_90`, or `max.driver`'s
`set_virtual_device_*` before a model is built), writing the same cache the card
would read. This builds every model of `gpu_check.sh`'s run that way, one process
each, into a cache folder of its own (`--cache`, kept between runs), and packs the
compiled graphs (a few MB after xz). `gpu_check.sh` unpacks them into MAX's cache
before its first start (`PRECOMPILED=...`) and lists the graphs the card still had to
compile: a model whose graph differs from the one built here, or one of the small
graphs built at a first request rather than at a start (the log-probabilities graph).
Benchmark variants that change only the run (MAX's device-sync mode, its legacy KV
cache) are not built here.

Which settings make another graph was measured on the CPU (a second build that finds
its graph in the cache takes seconds): the shape, the dtype and `--enable-echo` do;
the batch size, the cache's size, prefix caching and chunked prefill do not; the
weights' values do not (checkpoints of one shape share a graph).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from gpt2_max.names import PACKAGE
from gpt2_max.testing.reference import (
    TINY_HEAD64,
    load_reference,
    save_gguf,
    saved_in,
    write_tiny_checkpoint,
)
from gpt2_max.testing.server import child_env, serve_command
from gpt2_max.tools.checkpoint import (
    PRESETS,
    gguf_file_name,
    preset_config,
    write_checkpoint,
)
from tests.gpu.parity import GPU_STD, IN_PROCESS
from tests.gpu.test_serve import SERVE_ARGS
from tests.gpu.test_sizes import ENCODINGS

TARGET = "cuda:sm_90"
"""The H100's and H200's architecture, the cards the device tool lends."""

MEF_VERSION_DIR = Path(".max_cache/mof/mef")
"""Where inside MAX's cache root the compiled graphs live (one folder per MAX version)."""


def _preset(name: str) -> Callable[[Path], Path]:
    return lambda folder: write_checkpoint(folder, preset_config(name), std=GPU_STD)


def _tiny(folder: Path) -> Path:
    return write_tiny_checkpoint(folder, seed=3, std=GPU_STD, **TINY_HEAD64)


def _tiny_gguf(folder: Path) -> Path:
    path = save_gguf(load_reference(_tiny(folder / "float")), folder, "q8_0")
    assert path.name == gguf_file_name("q8_0")
    return folder


CHECKPOINTS: dict[str, Callable[[Path], Path]] = {
    "tiny64": _tiny,
    "tiny64-float16": lambda folder: saved_in(_tiny(folder), torch.float16),
    "tiny64-q8_0": _tiny_gguf,
    **{name: _preset(name) for name in PRESETS},
}
"""The checkpoints of `tests/gpu` and the benchmarks, by shape (their weights do not matter)."""

IN_TIER = {"max_batch_size": 4, **IN_PROCESS}
GRAPHS: list[tuple[str, str, str, object, dict[str, str]]] = [
    # name, checkpoint, "auto" (AutoModel's keywords, or a function of the checkpoint's
    # folder giving them) or "serve" (`max serve`'s flags), environment
    ("tier bfloat16", "tiny64", "auto", IN_TIER, {}),
    ("tier float32", "tiny64", "auto", {**IN_TIER, "quantization_encoding": "float32"}, {}),
    ("tier server", "tiny64", "serve", SERVE_ARGS, {}),
    ("tier float16 folder", "tiny64-float16", "auto", IN_TIER, {}),
    ("tier q8_0 gguf", "tiny64-q8_0", "auto",
     lambda folder: {**IN_TIER, "weight_path": [str(folder / gguf_file_name("q8_0"))]}, {}),
    ("gpt2-small server", "gpt2", "serve", ("--max-batch-size", "64"), {}),
    *((f"family {shape} {encoding}", shape, "auto",
       {**IN_TIER, "quantization_encoding": encoding}, {})
      for shape in ("gpt2", "gpt2-xl") for encoding in ("bfloat16", "float32")),
    ("bench k8 server", "gpt2", "serve", ("--max-batch-size", "64"),
     {"GPT2_MAX_DECODE_STEPS": "8"}),
    ("bench capture server", "gpt2", "serve", ("--max-batch-size", "64", "--device-graph-capture"),
     {}),
    *((f"sizes {size} {encoding}", size, "serve", flags, {})
      for size in PRESETS for encoding, (flags, _, _) in ENCODINGS.items()),
]
"""`gpu_check.sh`'s models, the tier's first, then the benchmark's, then every size."""

AUTO = """
import json, sys
from max import driver
api, _, arch = sys.argv[1].partition(":")
driver.set_virtual_device_api(api)
driver.set_virtual_device_target_arch(arch)
driver.set_virtual_device_count(1)
from max.pipelines import AutoModel
AutoModel(sys.argv[2], devices="gpu", custom_architectures=[sys.argv[3]], **json.loads(sys.argv[4]))
"""
"""One in-process model built on a virtual device: building it compiles its graphs."""


def command(how: str, checkpoint: Path, settings: object, target: str) -> list[str]:
    if how == "auto":
        return [sys.executable, "-c", AUTO, target, str(checkpoint), PACKAGE, json.dumps(settings)]
    line = serve_command(checkpoint, *settings, devices=None)  # type: ignore[misc]
    line[1:2] = ["warm-cache", "--target", target]
    return line


def compiled_graphs(cache: Path) -> set[str]:
    return {str(path.relative_to(cache / MEF_VERSION_DIR))
            for path in (cache / MEF_VERSION_DIR).glob("*/*")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="the .tar.xz to write")
    parser.add_argument("--target", default=TARGET)
    parser.add_argument("--cache", type=Path, default=Path("/tmp/gpt2-max-gpu-cache"),
                        help="MAX's cache root for these builds (kept between runs)")
    parser.add_argument("--only", default="", help="comma-separated graph names (all if empty)")
    args = parser.parse_args()
    wanted = [name for name in args.only.split(",") if name]
    args.out.parent.mkdir(parents=True, exist_ok=True)  # before hours of compiling
    checkpoints_dir = args.cache / "checkpoints"
    report = []
    for name, checkpoint, how, settings, env in GRAPHS:
        if wanted and name not in wanted:
            continue
        folder = checkpoints_dir / checkpoint
        if not folder.exists():
            CHECKPOINTS[checkpoint](folder)
        if callable(settings):  # settings naming the checkpoint's files
            settings = settings(folder)
        before, began = compiled_graphs(args.cache), time.monotonic()
        log = args.cache / "logs" / f"{name.replace(' ', '-')}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "wb") as out:
            result = subprocess.run(
                command(how, folder, settings, args.target), stdout=out, stderr=subprocess.STDOUT,
                env=child_env(MODULAR_CACHE_DIR=str(args.cache), MODULAR_TELEMETRY_ENABLED="0",
                              **env),
            )
        new = sorted(compiled_graphs(args.cache) - before)
        row = {"graph": name, "rc": result.returncode, "seconds": round(time.monotonic() - began),
               "new": new}
        report.append(row)
        print(json.dumps(row), flush=True)
    with tarfile.open(args.out, "w:xz") as tar:
        tar.add(args.cache / MEF_VERSION_DIR, arcname=".")
    (args.out.parent / (args.out.name + ".json")).write_text(json.dumps(report, indent=1))
    print(f"{len(compiled_graphs(args.cache))} compiled graphs in {args.out} "
          f"({args.out.stat().st_size / 2**20:.1f} MiB)")
    if failed := [row["graph"] for row in report if row["rc"]]:
        raise SystemExit(f"not built (their logs in {args.cache / 'logs'}): {', '.join(failed)}")


if __name__ == "__main__":
    main()
