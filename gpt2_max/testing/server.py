"""Runs `max serve` with the gpt2_max plugin on loopback, and stops all of it again.

`max serve` is a process tree (API server, model worker, metrics), so it is
started as the leader of its own process group and stopped as a group: a test
or benchmark that ends leaves no worker behind holding memory or a port.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil

from gpt2_max.names import PACKAGE
from gpt2_max.settings import setting

MODEL_NAME = "gpt2"
"""What requests name in `model`: servers started here are `--served-model-name` it."""

STARTUP_TIMEOUT_S = 900
"""Long enough for a cold graph compile on a small shared CPU."""

STOP_TIMEOUT_S = 30
"""How long the group gets to exit after SIGTERM before it is killed."""
PAUSE_TIMEOUT_S = 5
"""How long `Server.paused` waits for every process of the group to stop."""

READY_POLL_S = 0.1
"""How often a starting server is asked whether it answers: `max_serve` yields within
this of the server being ready (the start profile times starts to the first answer)."""

ONE_KERNEL = {setting("packed_kernel").variable: "package"}
"""The environment of servers of a packed model whose answers are compared bit for bit
across starts. Each start of such a server takes MAX's or the package's kernel as its
CPU measured (`layers/kernel_choice.py`), and a measurement that other processes
disturbed is not kept, so two starts on a busy CPU can each measure and choose
differently where the two kernels are close; their sums round apart in the last bits of
a logit. Naming one kernel makes the starts' arithmetic the same."""

REFUSAL_TIMEOUT_S = 300
"""A start that must be refused stops before any graph compile; a hang fails."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def path_with_this_interpreter(path: str | None = None) -> str:
    """`path` (default: `PATH`) with this interpreter's folder first, as activating its
    venv would put it.

    MAX's Mojo interop, started by importing MAX, records the first `python3` on
    `PATH` as the interpreter of the processes it starts (`PYTHONEXECUTABLE`): a
    `max serve`'s workers and the compile pool of an in-process model. Where that
    `python3` is another installation than the venv's (a venv not activated, from a
    shell whose `python3` is the system's), they start with the venv's binary and
    the other installation's standard library, and die at their first import.
    """
    folder = str(Path(sys.executable).parent)
    entries = (os.environ.get("PATH", "") if path is None else path).split(os.pathsep)
    return os.pathsep.join([folder, *(e for e in entries if e and e != folder)])


def child_env(**overrides: str) -> dict[str, str]:
    """The environment every process this harness starts gets, passed explicitly.

    Importing MAX starts Mojo's Python interop, which sets `PYTHONEXECUTABLE` and
    prepends `:` to `PYTHONPATH` in the C-level environment, where `os.environ`
    does not see them; a child started without `env=` inherits them, and the venv's
    interpreter then starts outside its venv unless the venv was activated. So each
    child gets `os.environ` as Python sees it, without `PYTHONEXECUTABLE`, with this
    interpreter's folder first on `PATH` (`path_with_this_interpreter`), plus
    `overrides`.
    """
    env = {key: value for key, value in os.environ.items() if key != "PYTHONEXECUTABLE"}
    return {**env, "PATH": path_with_this_interpreter(), **overrides}


def max_executable() -> str:
    """MAX's `max` command for this interpreter: the one beside it (a venv, activated
    or not), else the first on `PATH` (an install with `pip --target`, whose scripts
    folder is put on `PATH` by hand)."""
    beside = Path(sys.executable).with_name("max")
    if beside.exists():
        return str(beside)
    found = shutil.which("max")
    if found is None:
        raise FileNotFoundError(f"no `max` command beside {sys.executable} or on PATH")
    return found


def serve_command(
    model: Path, *args: str, devices: str | None = "cpu", package: str = PACKAGE
) -> list[str]:
    """The `max serve` command line that loads `model` through the plugin `package`
    (this one unless a copy is named); `devices=None` leaves the device to MAX (the
    first GPU it sees, else the CPU)."""
    return [
        max_executable(), "serve",
        "--custom-architectures", package,
        "--model", str(model),
        *(() if devices is None else ("--devices", devices)),
        *args,
    ]


def assert_start_fails(model: Path, message: str, *args: str) -> None:
    """`max serve` of `model` (with further flags `args`) exits non-zero, naming `message`.

    A refused checkpoint or flag must stop the start with a message a user can
    act on, not leave a server up or a worker crashed without a word.
    """
    result = subprocess.run(
        serve_command(model, "--host", "127.0.0.1", "--port", "0", *args),
        capture_output=True, text=True, timeout=REFUSAL_TIMEOUT_S, env=child_env(),
    )
    output = result.stdout + result.stderr
    assert result.returncode != 0, output[-4000:]
    assert message in output, output[-4000:]


def stop_process_group(process: subprocess.Popen) -> None:
    """SIGTERM to the group `process` leads, SIGKILL if it lingers; returns once all are gone."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + STOP_TIMEOUT_S
        # The leader may exit before its children: wait for the whole group.
        while _group_alive(process) and time.monotonic() < deadline:
            time.sleep(0.1)
        if not _group_alive(process):
            break
    process.wait()


def _group_statuses(pgid: int) -> list[str]:
    """The status of every process in process group `pgid`."""
    statuses = []
    for p in psutil.process_iter(["status"]):
        try:
            if os.getpgid(p.pid) == pgid:
                statuses.append(p.info["status"])
        except (ProcessLookupError, psutil.Error):
            continue
    return statuses


def _group_alive(leader: subprocess.Popen) -> bool:
    """Whether any process of `leader`'s group still runs (zombies do not count)."""
    leader.poll()
    return any(status != psutil.STATUS_ZOMBIE for status in _group_statuses(leader.pid))


def tree_rss(pid: int) -> int:
    """Resident memory of a process and all its descendants, in bytes."""
    root = psutil.Process(pid)
    return sum(p.memory_info().rss for p in [root, *root.children(recursive=True)])


class PeakRss:
    """Samples the RSS of a process and all its children until stopped."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            try:
                self.peak = max(self.peak, tree_rss(self.pid))
            except psutil.Error:
                pass

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


@dataclass
class Server:
    url: str
    """Base URL, `http://127.0.0.1:PORT`."""
    pid: int
    """The `max serve` process; its children are the model worker and friends."""
    log: Path
    """Its stdout and stderr."""
    model: str = MODEL_NAME
    """The name requests give in `model`."""
    metrics_url: str = ""
    """Its Prometheus endpoint, `http://127.0.0.1:PORT/metrics`."""

    @contextmanager
    def paused(self) -> Iterator[None]:
        """The server's process group stopped (SIGSTOP) for the block, then resumed.

        An idle `max serve` is not idle: MAX's model worker polls its queues, and
        an engine timed beside it loses that CPU (`benchmarks/README.md`). The server
        leads its own process group, so one signal reaches every process of it,
        however many it has started. Requests sent while paused wait until the
        block ends.
        """
        try:
            os.killpg(self.pid, signal.SIGSTOP)
            # SIGSTOP lands asynchronously: the block starts once the whole group has.
            deadline = time.monotonic() + PAUSE_TIMEOUT_S
            while any(status not in (psutil.STATUS_STOPPED, psutil.STATUS_ZOMBIE)
                      for status in _group_statuses(self.pid)):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"max serve (process group {self.pid}) did not stop")
                time.sleep(0.001)
            yield
        finally:
            with suppress(ProcessLookupError):
                os.killpg(self.pid, signal.SIGCONT)

    def kv_cache_bytes(self) -> float:
        """The KV-cache size MAX logged at start (`cache_memory: 2.26 GiB`)."""
        value, unit = re.findall(r"cache_memory: ([\d.]+) (\w+)", self.log.read_text())[-1]
        return float(value) * 1024 ** ["B", "KiB", "MiB", "GiB", "TiB"].index(unit)


NO_TELEMETRY_ENV = "MAX_SERVE_DISABLE_TELEMETRY"
"""MAX's setting that turns its telemetry off, its metrics endpoint with it."""


def steps_run(metrics_url: str) -> int:
    """The steps (batches) a server has run: MAX's `maxserve.batch_size` histogram
    count on its metrics endpoint, read once it stops changing (the worker
    reports through MAX's telemetry process, a moment after each step)."""
    def read() -> int:
        try:
            text = httpx.get(metrics_url, timeout=5).text
        except httpx.ConnectError as error:
            if os.environ.get(NO_TELEMETRY_ENV, "").strip() not in ("", "0"):
                raise RuntimeError(
                    f"{metrics_url} refuses connections: {NO_TELEMETRY_ENV} is set in this "
                    "environment, which turns MAX's metrics endpoint off; unset it to count steps."
                ) from error
            raise
        return int(sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                       if line.startswith("maxserve_batch_size_count")))

    last = read()
    while True:
        time.sleep(1.0)
        if (now := read()) == last:
            return now
        last = now


@contextmanager
def max_serve(
    model: Path,
    *args: str,
    log: Path,
    devices: str | None = "cpu",
    env: dict[str, str] | None = None,
    package: str = PACKAGE,
) -> Iterator[Server]:
    """Starts `max serve` for `model` on a free port, yields it once it answers, stops it.

    `args` are further `max serve` flags; the server's output goes to `log`;
    `package` is the plugin `--custom-architectures` loads.
    """
    port, metrics_port = free_port(), free_port()
    env = child_env(MAX_SERVE_METRICS_ENDPOINT_PORT=str(metrics_port), **(env or {}))
    command = serve_command(
        model,
        "--served-model-name", MODEL_NAME,
        "--host", "127.0.0.1",
        "--port", str(port),
        *args,
        devices=devices,
        package=package,
    )
    with open(log, "wb") as out:
        process = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        # One client for every poll: `httpx.get` builds a client, and its TLS context,
        # at each call, which at `READY_POLL_S` kept a small CPU busy enough, while the
        # server started, for the server's kernel choice, timed then, not to be kept
        # (`layers/kernel_choice.py`).
        with httpx.Client(timeout=2) as client:
            while True:
                if process.poll() is not None:
                    raise RuntimeError(f"max serve exited with {process.returncode}:\n"
                                       f"{log.read_text()[-4000:]}")
                try:
                    if client.get(f"{url}/v1/models").status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(f"max serve did not start:\n{log.read_text()[-4000:]}")
                time.sleep(READY_POLL_S)
        yield Server(url=url, pid=process.pid, log=log,
                     metrics_url=f"http://127.0.0.1:{metrics_port}/metrics")
    finally:
        stop_process_group(process)
