"""The harness stops the whole `max serve` process tree, and starts it from any interpreter."""

from __future__ import annotations

import ast
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import psutil
import pytest

from gpt2_max.testing import server

pytestmark = pytest.mark.tier("unit")


def process_group(pgid: int) -> list[psutil.Process]:
    group = []
    for process in psutil.process_iter():
        try:
            if os.getpgid(process.pid) == pgid:
                group.append(process)
        except (ProcessLookupError, psutil.Error):
            continue
    return group


def test_stop_process_group_ends_children_that_outlive_the_leader(monkeypatch):
    monkeypatch.setattr(server, "STOP_TIMEOUT_S", 1)
    # The leader exits at once; its children ignore SIGTERM, as a busy worker may.
    leader = subprocess.Popen(
        ["sh", "-c", "trap '' TERM; sleep 300 & sleep 300 & echo started"],
        stdout=subprocess.PIPE, start_new_session=True, env=server.child_env(),
    )
    with leader.stdout:
        assert leader.stdout.readline() == b"started\n"
    children = [p for p in process_group(leader.pid) if p.pid != leader.pid]
    assert len(children) == 2

    server.stop_process_group(leader)

    assert not [p for p in children if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


@pytest.mark.tier("serve")
def test_refusal_runs_from_a_venv_that_is_not_activated(gpt2_max_checkpoint, tmp_path):
    """The venv's interpreter, called by path as an IDE or a CI step does, after importing MAX.

    MAX's import leaves `PYTHONEXECUTABLE` (the first `python3` on `PATH`, here
    outside the venv) in the C-level environment; a child that inherits it starts
    `max` outside the venv (`No module named 'max'`).
    """
    broken = tmp_path / "no-config"
    shutil.copytree(gpt2_max_checkpoint, broken)
    (broken / "config.json").unlink()
    venv_bin = str(Path(sys.executable).parent)
    env = server.child_env()
    env.pop("VIRTUAL_ENV", None)
    env["PATH"] = os.pathsep.join(
        entry for entry in env.get("PATH", "").split(os.pathsep) if entry != venv_bin
    )
    script = (
        "import sys, max.pipelines\n"
        "from gpt2_max.testing.server import assert_start_fails\n"
        "assert_start_fails(__import__('pathlib').Path(sys.argv[1]), 'No config.json')\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script, str(broken)], env=env, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr[-4000:]


def test_paused_stops_the_whole_tree_and_resumes_it(tmp_path):
    leader = subprocess.Popen(
        ["sh", "-c", "sleep 300 & sleep 300 & echo started; wait"],
        stdout=subprocess.PIPE, start_new_session=True, env=server.child_env(),
    )
    try:
        with leader.stdout:
            assert leader.stdout.readline() == b"started\n"
        tree = [psutil.Process(leader.pid), *psutil.Process(leader.pid).children()]
        assert len(tree) == 3
        served = server.Server(url="http://127.0.0.1:1", pid=leader.pid, log=tmp_path / "log")

        with served.paused():
            assert {p.status() for p in tree} == {psutil.STATUS_STOPPED}

        assert psutil.STATUS_STOPPED not in {p.status() for p in tree}
    finally:
        server.stop_process_group(leader)


SPAWNERS = {"run", "Popen", "call", "check_call", "check_output"}
"""The `subprocess` functions that start a process."""


def spawns_without_child_env(path: Path) -> list[str]:
    """Calls in `path` that start a process without the harness's environment: no
    `env=`, or an `env=` that neither calls `child_env` nor names a variable that
    was assigned from it."""
    tree = ast.parse(path.read_text())
    from_helper = {
        target.id
        for node in ast.walk(tree) if isinstance(node, ast.Assign)
        if "child_env" in ast.unparse(node.value)
        for target in node.targets if isinstance(target, ast.Name)
    }
    found = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in SPAWNERS
                and ast.unparse(node.func.value) == "subprocess"):
            continue
        env = next((k.value for k in node.keywords if k.arg == "env"), None)
        ok = env is not None and (
            "child_env" in ast.unparse(env)
            or (isinstance(env, ast.Name) and env.id in from_helper)
        )
        if not ok:
            found.append(f"{path}:{node.lineno}")
    return found


def test_every_process_the_tests_benchmarks_and_harness_start_gets_child_env():
    """After MAX is imported, a child started without an explicit environment inherits
    the interpreter MAX recorded and may start outside the venv (`child_env`)."""
    root = Path(__file__).parents[2]
    scanned = [
        path
        for folder in ("tests", "benchmarks", "gpt2_max")
        for path in sorted((root / folder).rglob("*.py"))
    ]
    assert {"bench_step.py", "server.py", "test_layout.py"} <= {p.name for p in scanned}
    assert [hit for path in scanned for hit in spawns_without_child_env(path)] == []


def test_children_find_this_interpreter_first_on_path():
    """MAX's interop records the first `python3` on `PATH` for the processes it starts
    (`path_with_this_interpreter`); a child's `PATH` leads with this interpreter's folder."""
    folder = str(Path(sys.executable).parent)
    path = server.child_env(PATH=os.pathsep.join(["/usr/bin", folder, "/bin"]))["PATH"]
    assert path == os.pathsep.join(["/usr/bin", folder, "/bin"])  # an explicit override wins
    assert server.path_with_this_interpreter("/usr/bin:/bin").split(os.pathsep) == [
        folder, "/usr/bin", "/bin"
    ]
    assert server.child_env()["PATH"].split(os.pathsep)[0] == folder


def test_steps_run_says_when_telemetry_is_off(monkeypatch):
    """With MAX's telemetry off its metrics endpoint is not served: counting steps says
    why instead of a bare connection error."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{probe.getsockname()[1]}/metrics"
    monkeypatch.setenv(server.NO_TELEMETRY_ENV, "1")
    with pytest.raises(RuntimeError, match=f"{server.NO_TELEMETRY_ENV} is set"):
        server.steps_run(closed)
    monkeypatch.delenv(server.NO_TELEMETRY_ENV)
    with pytest.raises(httpx.ConnectError):
        server.steps_run(closed)
