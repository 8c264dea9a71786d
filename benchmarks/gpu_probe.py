"""The served GPU crash, probed: `max serve` of the gpt2-small shape on the GPU, variants
of it one after another, each recorded in `$OUT` even when it fails.

    PYTHONPATH=$PWD python3 benchmarks/gpu_probe.py CHECKPOINT [SECONDS]

First MAX's defaults (bfloat16, `--max-batch-size 64`, MAX's KV sizing): the
benchmark's request sequence (its warm-up, then the stream that died on an H200), then
the 200 requests of `tests/gpu/served_workload.py`. If the defaults serve, float32 the
same way; if they crash, the variants that tell why: MAX's device-sync mode (names the
failing kernel), MAX's legacy KV cache, a small pool (`--max-batch-total-tokens`), and
prefix caching and chunked prefill off. No variant starts after SECONDS.
Record: `benchmarks/results/2026-11-27-gpu-h100-served-crash-probe.md`.
"""
from __future__ import annotations

import asyncio
import json
import os
import sys
import time
import traceback
from pathlib import Path

import httpx

from gpt2_max.testing.reference import random_prompt
from gpt2_max.testing.server import max_serve
from tests.gpu.served_workload import complete, two_hundred_requests

OUT = Path(os.environ.get("OUT", "/tmp/out"))
DEADLINE = time.monotonic() + float(sys.argv[2]) if len(sys.argv) > 2 else float("inf")
results: dict = {}


def save() -> None:
    (OUT / "probe.json").write_text(json.dumps(results, indent=1))


async def sequence(url, name):
    """The benchmark's warm-up and stream first (the H200 server died at the second),
    two more, then 16 at once."""
    out = []
    async with httpx.AsyncClient(timeout=httpx.Timeout(120, connect=10)) as c:
        for length, n, seed in ((16, 8, 999), (16, 128, 100), (40, 200, 101), (3, 1, 102)):
            r = await complete(c, url, random_prompt(length, seed), n, stream=True)
            out.append(r)
            print(name, length, n, r.get("status"), r.get("body", ""), flush=True)
            if r["status"] != 200:
                return out
        rs = await asyncio.gather(*(complete(c, url, random_prompt(16, 200 + i), 64, stream=True)
                                    for i in range(16)))
        out.append({"concurrent16": [r["status"] for r in rs]})
    return out


def variant(name, ckpt, env, flags, run_workload=False):
    if time.monotonic() > DEADLINE:
        results[name] = "skipped: out of time"
        save()
        return None
    env = {"MAX_SERVE_SCHEDULER_STATS_LOG_INTERVAL_S": "0", **env}
    log = OUT / f"serve-{name}.log"
    t = time.monotonic()
    try:
        with max_serve(ckpt, "--max-batch-size", "64", *flags, log=log, devices=None,
                       env=env) as server:
            start = time.monotonic() - t
            print(f"{name}: ready in {start:.1f}s", flush=True)
            seq = asyncio.run(sequence(server.url, name))
            crashed = any(r.get("status") != 200 for r in seq if "status" in r)
            res = {"ready_s": start, "sequence": seq, "crashed": crashed}
            if run_workload and not crashed:
                res["workload"] = asyncio.run(two_hundred_requests(server.url))
            results[name] = res
    except Exception:  # noqa: BLE001
        results[name] = {"error": traceback.format_exc()[-1500:]}
    save()
    print(name, json.dumps(results[name])[:600], flush=True)
    return results[name]


def main():
    ckpt = Path(sys.argv[1])
    a = variant("default", ckpt, {}, [], run_workload=True)
    if isinstance(a, dict) and a.get("crashed") is False:
        variant("float32", ckpt, {}, ["--quantization-encoding", "float32"], run_workload=True)
        return
    variant("device-sync", ckpt, {"MODULAR_DEBUG": "device-sync-mode"}, [])
    variant("legacy-kv", ckpt, {"MODULAR_USE_LEGACY_KV_CACHE": "1"}, [])
    variant("small-pool", ckpt, {}, ["--max-batch-total-tokens", "8192"])
    variant("no-prefix", ckpt, {}, ["--no-enable-prefix-caching", "--no-enable-chunked-prefill"])


if __name__ == "__main__":
    main()
