"""llama.cpp's own benchmark tools as a peer: `llama-bench` (tg128, pp900),
`llama-batched-bench`, and `llama-server` over HTTP (what a user would put beside
`max serve`), on the same GGUF files as the other rows.

The binaries come from `build_llama_cpp.sh` (llama.cpp as vendored in the
llama-cpp-python sdist the ctypes peer runs, built for this CPU); `binaries()`
runs it, which is a no-op once they exist. Flash attention is off unless asked
for, as in the ctypes peer. A benchmark-only extra, never in the test install.
"""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import httpx
import streams

from gpt2_max.testing.server import child_env

BUILD_SCRIPT = Path(__file__).with_name("build_llama_cpp.sh")


def binaries() -> Path:
    """The folder holding llama.cpp's tools, built first if they are not."""
    out = subprocess.run(
        [str(BUILD_SCRIPT)], check=True, capture_output=True, text=True, env=child_env()
    )
    return Path(out.stdout.strip().splitlines()[-1])


def llama_bench(
    model: Path, threads: int, *, prompt: int = 900, generate: int = 128, repeat: int = 3,
    flash_attn: bool = False, repack: bool = True,
) -> dict[str, float]:
    """`llama-bench`'s mean tokens per second: `pp<prompt>` and `tg<generate>`; with
    `repack` False, its weights as the file has them (`--repack 0`, not its CPU repacking)."""
    out = subprocess.run(
        [str(binaries() / "llama-bench"), "-m", str(model), "-t", str(threads),
         "-p", str(prompt), "-n", str(generate), "-r", str(repeat),
         "-fa", "1" if flash_attn else "0", "--repack", "1" if repack else "0", "-o", "json"],
        check=True, capture_output=True, text=True, env=child_env(),
    )
    rows = {}
    for test in json.loads(out.stdout):
        name = f"pp{test['n_prompt']}" if test["n_gen"] == 0 else f"tg{test['n_gen']}"
        rows[name] = float(test["avg_ts"])
    return rows


def batched_bench(
    model: Path, threads: int, *, sequences: int = 8, prompt: int = 16, generate: int = 128,
    flash_attn: bool = False, repack: bool = True,
) -> dict[str, float]:
    """`llama-batched-bench` with `sequences` streams of `prompt` + `generate` tokens:
    its decode tokens per second over all streams (`S_TG t/s`) and its total; `repack`
    as for `llama_bench`."""
    ctx = sequences * (prompt + generate)
    out = subprocess.run(
        [str(binaries() / "llama-batched-bench"), "-m", str(model), "-t", str(threads),
         "-c", str(ctx), "-b", "2048", "-ub", "512", "-npp", str(prompt),
         "-ntg", str(generate), "-npl", str(sequences), "-fa", "1" if flash_attn else "0",
         *(() if repack else ("--no-repack",)), "--output-format", "jsonl"],
        check=True, capture_output=True, text=True, env=child_env(),
    )
    (row,) = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    return {"tg": float(row["speed_tg"]), "total": float(row["speed"])}


@contextmanager
def server(
    model: Path, threads: int, *, parallel: int, ctx_per_slot: int, extra: Sequence[str] = (),
    log_path: Path | None = None,
) -> Iterator[str]:
    """`llama-server` on `model` with `parallel` slots, flash attention off as in the
    other rows, and `extra` flags (a draft model); yields its base URL once it answers
    `/health`. Its output goes to `log_path` if given."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    opened = open(log_path, "w+b") if log_path else tempfile.TemporaryFile()  # noqa: SIM115
    with opened as log:
        process = subprocess.Popen(
            [str(binaries() / "llama-server"), "-m", str(model), "-t", str(threads),
             "-tb", str(threads), "--parallel", str(parallel),
             "-c", str(parallel * ctx_per_slot), "-fa", "off", "--host", "127.0.0.1",
             "--port", str(port), *extra],
            stdout=log, stderr=subprocess.STDOUT, env=child_env(),
        )
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 120
            while True:
                if process.poll() is not None:
                    log.seek(0)
                    raise RuntimeError(f"llama-server exited:\n{log.read()[-3000:].decode()}")
                try:
                    if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError("llama-server did not start")
                time.sleep(0.5)
            yield url
        finally:
            process.terminate()
            process.wait()


def server_run(url: str, prompts: list[list[int]], n: int) -> list[dict]:
    """`prompts` sent at once to `llama-server`, each streamed; per request its tokens,
    token arrival times and wall time (as `bench_serve.run_max` gives them for MAX)."""
    return asyncio.run(streams.gather(streams.llama_completion, url, prompts, n))
