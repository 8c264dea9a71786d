"""Runs `max serve` with the gpt2_max plugin on loopback for end-to-end tests."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

MODEL_NAME = "gpt2"
"""What requests name in `model`."""

STARTUP_TIMEOUT_S = 900  # A cold compile of a new graph takes minutes on 2 cores.


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def serve_command(model: Path, *args: str, devices: str = "cpu") -> list[str]:
    """The `max serve` command line that loads `model` through the gpt2_max plugin."""
    return [
        str(Path(sys.executable).with_name("max")), "serve",
        "--custom-architectures", "gpt2_max",
        "--model", str(model),
        "--devices", devices,
        *args,
    ]


@dataclass
class Server:
    url: str
    """Base URL, `http://127.0.0.1:PORT`."""
    pid: int
    """The `max serve` process; its children are the model worker and friends."""
    log: Path
    """Its stdout and stderr."""

    def kv_cache_bytes(self) -> float:
        """The KV-cache size MAX logged at start (`cache_memory: 2.26 GiB`)."""
        value, unit = re.findall(r"cache_memory: ([\d.]+) (\w+)", self.log.read_text())[-1]
        return float(value) * 1024 ** ["B", "KiB", "MiB", "GiB", "TiB"].index(unit)


@contextmanager
def max_serve(
    model: Path,
    *args: str,
    log: Path,
    devices: str = "cpu",
    env: dict[str, str] | None = None,
) -> Iterator[Server]:
    """Starts `max serve` for `model`, yields it once it answers, stops it."""
    port = free_port()
    env = {
        **os.environ,
        "MAX_SERVE_METRICS_ENDPOINT_PORT": str(free_port()),
        **(env or {}),
    }
    command = serve_command(
        model,
        "--served-model-name", MODEL_NAME,
        "--host", "127.0.0.1",
        "--port", str(port),
        *args,
        devices=devices,
    )
    with open(log, "wb") as out:
        process = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            if process.poll() is not None:
                raise RuntimeError(
                    f"max serve exited with {process.returncode}:\n{log.read_text()[-4000:]}"
                )
            try:
                if httpx.get(f"{url}/v1/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"max serve did not start:\n{log.read_text()[-4000:]}")
            time.sleep(1)
        yield Server(url=url, pid=process.pid, log=log)
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, 9)
            process.wait()
